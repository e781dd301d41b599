"""Test setup: 8 simulated CPU devices (must be set before jax is imported) and float32 matmuls."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run: many tests build an LLM over the same tiny
# model, and identical programs then compile once instead of once per LLM instance.
import tempfile  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("KIMI_JAX_TEST_CACHE",
                                                              os.path.join(tempfile.gettempdir(), "kimi_jax_test_xla_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny preset as a real-format checkpoint (seed 4, std 0.08), written once per test run for
    every suite that serves it through the engine."""
    from checkpoints.synthetic import write_checkpoint
    from kimi_jax.config import preset
    path = str(tmp_path_factory.mktemp("tiny_ckpt"))
    write_checkpoint(path, preset("tiny"), seed=4, std=0.08)
    return path
