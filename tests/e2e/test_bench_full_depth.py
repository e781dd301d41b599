"""kimi-bench full_depth on the CPU: one in-process run of every measurement on a 2-layer tiny
model (one device), as a user runs it, and the preset it benchmarks."""
import json

import jax.numpy as jnp
import pytest

from kimi_jax.config import PRESETS, preset


def test_full_depth_preset_is_kimi_with_16_experts():
    """kimi-k2.5-61x16 differs from kimi-k2.5 only in its routed experts: 61 layers, top-8, INT4."""
    full, cut = preset("kimi-k2.5"), preset("kimi-k2.5-61x16")
    assert "kimi-k2.5-61x16" in PRESETS
    assert cut == full.replace(n_routed_experts=16)
    assert (cut.num_hidden_layers, cut.num_experts_per_tok, cut.quantization) == (61, 8, full.quantization)


@pytest.fixture(scope="module")
def fd(module_tool):
    return module_tool("launch.bench.full_depth")


@pytest.fixture(scope="module")
def rows(fd, tmp_path_factory):
    """`kimi-bench full_depth --tiny` (the tiny preset at 2 layers, float32) with every measurement on
    batch 1: the rows it appends to OUT/full_depth_rows.jsonl."""
    out = tmp_path_factory.mktemp("full_depth")
    with pytest.raises(SystemExit) as done:
        fd.run(["kimi-bench full_depth", "--tiny", "--layers=2", "--batches=1", "--context=256", "--steps=2",
                "--variants=default,off", "--variant_batches=1", "--profile_batches=1", "--scheduler_batches=1",
                "--hardware=cpu", "--fixed_buffers", f"--out={out}"])
    assert done.value.code in (0, None)
    return [json.loads(line) for line in open(out / "full_depth_rows.jsonl")]


def test_full_depth_bench_rows(rows):
    """The batch has one row per variant it compiles plus the serving call's; timed rows carry all four modes and the planner's prediction; the
    profiled row counts kernels; the scheduler runs with overlap on (every step after the first
    overlapped) and off (none)."""
    steps = [(r["batch"], r["variant"]) for r in rows if r["kind"] == "step"]
    assert steps == [(1, "default"), (1, "off"), (1, "serve"), (1, "fixed")]
    # the step over fixed buffers samples what the ordinary step samples from the same pool
    assert [r["tokens_match"] for r in rows if r["kind"] == "step" and r["variant"] == "fixed"] == [True]
    disp = [r for r in rows if r["kind"] == "dispatch"]
    assert len(disp) == 1 and disp[0]["arguments"] > 0 and disp[0]["with_weights_us"] > disp[0]["alone_us"] > 0
    for r in rows:
        if r["kind"] == "step":
            assert r["layers"] == 2 and r["context"] == 256 and r["pred_ms"] > 0
            assert 0 < r["bytes_gb"] <= r["bytes_max_gb"] and 0 < r["floor_ms"] and "pred_8dev_ms" not in r
            assert 0 < r["enqueue_ms"] <= r["chain_ms"] and (r["variant"] == "fixed" or r["sync_ms"] > 0)
            assert r["pred_error"] == pytest.approx(r["chain_ms"] / r["pred_ms"] - 1)
        if r["kind"] == "step" and r["variant"] not in ("serve", "fixed"):
            assert r["compile_s"] > 0 and r["lower_s"] > 0 and r["kernels_outside"] > 0
            assert r["command_buffers"] == 0          # XLA:CPU has none
    prof = [r for r in rows if "kernels_per_step" in r]
    assert [(r["batch"], r["variant"]) for r in prof] == [(1, "default")]
    assert prof[0]["kernels_per_step"] > 0 and 0 < prof[0]["device_busy_ms"]
    sched = {r["overlap"]: r for r in rows if r["kind"] == "scheduler"}
    assert sched[True]["engine_steps"] == sched[False]["engine_steps"] == 2
    assert sched[True]["overlapped_steps"] == 1 and sched[False]["overlapped_steps"] == 0


def test_full_depth_bench_needs_whole_page_tables(fd):
    bench = fd.bench
    with pytest.raises(ValueError, match="context=48"):
        bench(preset("tiny"), [1], context=48, steps=1, variants=["default"])


def test_command_buffer_census_counts_kernels_inside_and_outside(fd):
    """A GPU program's command-buffer calls: kernels inside them and in the entry counted apart."""
    command_buffer_census = fd.command_buffer_census
    text = """HloModule m

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %f1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fc
  ROOT %c = f32[4]{0} custom-call(%f1), custom_call_target="mosaic_gpu"
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %cb = f32[4]{0} call(%a), to_apply=%command_buffer
  ROOT %f2 = f32[4]{0} fusion(%cb), kind=kLoop, calls=%fc
}
"""
    assert command_buffer_census(text) == dict(command_buffers=1, kernels_in_buffers=2, kernels_outside=1,
                                               custom_calls_in_buffers=1, custom_calls_outside=0)


def test_leafwise_weights_are_the_models_parameters(fd):
    """The parameter-by-parameter random weights (the whole-model jitted init does not compile in
    minutes at 61 layers on the H200) have the model's tree, shapes and dtypes (random_model makes
    that model), INT4 experts included, and its initializers' kinds of values: norms 1, router bias 0, scales 0.005, random
    codes and weights."""
    import numpy as np
    from flax import nnx
    from kimi_jax.config import QuantConfig
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.model.transformer import Transformer
    from kimi_jax.tools.profiling import random_engine as leafwise_random_engine
    cfg = preset("tiny").replace(num_hidden_layers=2, quantization=QuantConfig())
    ours = {p: v.get_value() for p, v in nnx.to_flat_state(leafwise_random_engine(cfg, Layout(1), jnp.float32).state)}
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))   # random_model's
    ref = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.split(model)[1])}
    assert {p: (x.shape, x.dtype) for p, x in ours.items()} == {p: (x.shape, x.dtype) for p, x in ref.items()}
    for path, x in ours.items():
        name, x = str(path[-1]), np.asarray(x)
        if name.endswith("_scale"):
            assert np.all(x == np.float32(0.005)), path
        elif name == "e_score_correction_bias":
            assert not x.any(), path
        elif any("norm" in str(p) for p in path[:-1]):
            assert np.all(x == 1), path
        else:       # random: no two equal neighbours in a row of codes; weights of about std 0.02
            assert len(np.unique(x)) > x.size // 2, path
            if x.dtype != np.int32:
                assert 0.015 < x.std() < 0.025, path
