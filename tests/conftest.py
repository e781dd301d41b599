"""Test setup: 8 simulated CPU devices (must be set before jax is imported) and float32 matmuls."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The suite is mostly XLA:CPU compiles of small programs: LLVM's lowest optimization level compiles them
# about a fifth faster end to end (an engine test 23.6 -> 17.7 s) and computes the same values (every
# tolerance below holds); set the flag yourself to test another level.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run: many tests build an LLM over the same tiny
# model, and identical programs then compile once instead of once per LLM instance.
import tempfile  # noqa: E402

# One directory per xdist worker: jax 0.10 writes a cache entry with a plain write and reads it
# without a lock, so a worker sharing the directory could load another's half-written executable (a
# segmentation fault in compilation_cache.get_executable_and_time).
_CACHE_ROOT = os.environ.get("KIMI_JAX_TEST_CACHE",
                             os.path.join(tempfile.gettempdir(), "kimi_jax_test_xla_cache"))
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(_CACHE_ROOT, os.environ.get("PYTEST_XDIST_WORKER", "main")))
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


class CliResult:
    """What a launcher run in this process did: its exit status and what it wrote."""

    def __init__(self, code: int, out: str, err: str):
        self.returncode, self.stdout, self.stderr = code, out, err

    def __repr__(self):
        return f"CliResult(returncode={self.returncode}, stderr={self.stderr[-500:]!r})"


def _absl_snapshot():
    from absl import app, flags
    import launch.common  # noqa: F401  (the shared launcher flags stay defined for the whole run)
    app.define_help_flags()
    return flags.FLAGS, set(flags.FLAGS)


def _forget(module: str, flags_, before) -> None:
    import sys
    for name in set(flags_) - before:
        delattr(flags_, name)
    for m in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        del sys.modules[m]
    flags_.unparse_flags()


@pytest.fixture
def cli(capsys):
    """Run a launcher in this process: `cli("launch.generate", "--max-tokens=2")` -> CliResult. The
    module is imported fresh and its `run(argv)` called as its console script calls it; the absl flags
    it defines are removed afterwards (launchers define the same names: two cannot share one flag
    registry), so launchers run one after another in one test process without a fresh interpreter."""
    import importlib
    import sys

    def run(module: str, *args: str) -> CliResult:
        flags_, before = _absl_snapshot()
        flags_.unparse_flags()
        capsys.readouterr()
        code = 0
        try:
            importlib.import_module(module).run([module, *map(str, args)])
        except SystemExit as e:
            if isinstance(e.code, str):        # what the interpreter prints for sys.exit("message")
                sys.stderr.write(e.code + "\n")
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            _forget(module, flags_, before)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)
    return run


def _tool_module():
    import importlib
    done = []

    def load(module: str):
        flags_, before = _absl_snapshot()
        mod = importlib.import_module(module)
        done.append((module, flags_, before))
        return mod
    yield load
    for module, flags_, before in reversed(done):
        _forget(module, flags_, before)


@pytest.fixture
def tool_module():
    """Import a launcher module for its functions (`tool_module("launch.bench.int4").dense_sweep`):
    the flags its import defines are removed again, as `cli` does."""
    yield from _tool_module()


@pytest.fixture(scope="module")
def module_tool():
    """`tool_module` for a whole test module (its module-scoped fixtures)."""
    yield from _tool_module()


# Long end-to-end checks (many compiled shapes or several engines each): skipped unless asked for with
# `--run-slow` or KIMI_JAX_SLOW_TESTS=1, so the default suite fits the CI budget; each feature keeps a
# faster test in the default run.
def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long end-to-end checks)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow") or os.environ.get("KIMI_JAX_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or KIMI_JAX_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
