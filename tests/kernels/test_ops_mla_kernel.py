"""kimi_jax.ops picks the paged MLA decode kernel (ops.mla_decode_kernel) from the ExecPlan: the automatic
choice off a Hopper GPU is the Triton kernel and a plan's forced choice wins; forced to the Mosaic GPU kernel,
ops.mla_paged_attention (interpreted on CPU) equals the XLA path. Tolerance 3e-2 absolute: as
tests/kernels/test_mla_decode_mgpu.py (bf16 p before P @ C and a bf16 output on values of size <= ~3)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops
from pallas_kernels.mla import decode as md
from pallas_kernels.mla import decode_mgpu as mg

SCALE = 1.0 / math.sqrt(192.0)
PALLAS = ops.ExecPlan(impl="pallas")
HOPPER = ops.ExecPlan(impl="pallas", hopper=True)          # the automatic rule as on a Hopper GPU
XLA = ops.ExecPlan(impl="xla")
_interp = mg.interpret_params() if mg.plgpu is not None else None
needs_interpreter = pytest.mark.skipif(_interp is None, reason="this jax has no Mosaic GPU interpreter")


def test_ops_selects_the_decode_kernel():
    assert ops.mla_decode_kernel(64, 512, 64, 16, jnp.bfloat16) == "triton"   # CPU: not Hopper
    assert not ops.ExecPlan.for_backend().hopper
    pick = lambda rows=64, page=16, dtype=jnp.bfloat16, **kw: ops.mla_decode_kernel(  # noqa: E731
        rows, 512, 64, page, dtype, plan=HOPPER, **kw)
    assert pick(batch=1, context=32768) == pick(batch=64, context=4096) == pick(rows=128) == "mgpu"
    assert pick(batch=8, context=4096) == pick(batch=2, context=16384) == "mgpu"
    assert pick(batch=1, context=4096) == pick(batch=4, context=4096) == "triton"   # too little cache
    assert pick(rows=8) == pick(rows=96) == "triton"                                 # 64-row tiles not full
    assert pick(page=24) == pick(dtype=jnp.float32) == "triton"
    forced = dataclasses.replace(PALLAS, mla_decode_kernel="mgpu")
    assert ops.mla_decode_kernel(8, 512, 64, 16, jnp.bfloat16, plan=forced) == "mgpu"
    assert ops.mla_decode_kernel(64, 512, 64, 16, jnp.bfloat16, plan=dataclasses.replace(
        HOPPER, mla_decode_kernel="triton")) == "triton"
    with pytest.raises(ValueError, match="mla_decode_kernel"):
        dataclasses.replace(PALLAS, mla_decode_kernel="cuda")


@needs_interpreter
def test_ops_runs_the_mgpu_kernel(monkeypatch):
    calls = []
    real = mg.mla_paged_attention_mgpu
    monkeypatch.setattr(mg, "mla_paged_attention_mgpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    q_lat, q_pe, new, pool, bt, pos = md.make_case(jax.random.key(3), [0, 37, 16], heads=64, page=16)
    pos = pos.at[0].set(-1)                                     # a padding row reads nothing
    L = 2
    stacked = jnp.stack([pool * 0.5, pool])                     # layer 1 is `pool`
    got = ops.mla_paged_attention(q_lat, q_pe, new, stacked, bt, pos, SCALE,
                                  plan=dataclasses.replace(PALLAS, mla_decode_kernel="mgpu"), layer=L - 1)
    assert calls, "ops did not run the Mosaic GPU kernel"
    want = ops.mla_paged_attention(q_lat, q_pe, new, pool, bt, pos, SCALE, plan=XLA)
    # rows 1, 2 only: a padding row's output is unspecified (the engine discards it)
    np.testing.assert_allclose(np.asarray(got[1:], np.float32), np.asarray(want[1:], np.float32),
                               atol=3e-2, rtol=0)


def test_ops_keeps_the_triton_kernel_for_a_float32_pool(monkeypatch):
    """Automatic choice on a (pretended) Hopper GPU, 64 heads, a large table: bf16 queries over a bf16
    pool take the Mosaic GPU kernel, over a float32 pool the Triton kernel (the mgpu kernel reads bf16
    pages only). Both kernels are replaced by spies: only the decision is under test."""
    calls = []
    monkeypatch.setattr(mg, "mla_paged_attention_mgpu", lambda q, *a, **k: calls.append("mgpu") or q)
    monkeypatch.setattr(md, "mla_paged_attention", lambda q, *a, **k: calls.append("triton") or q)
    q_lat, q_pe, new, pool, bt, pos = md.make_case(jax.random.key(4), [5, 17], heads=64, page=16)
    bt = jnp.zeros((2, 1024), jnp.int32)                       # a 16K-token table: the cache pays
    for p in (pool, pool.astype(jnp.float32)):
        ops.mla_paged_attention(q_lat, q_pe, new, p, bt, pos, SCALE, plan=HOPPER)
    assert calls == ["mgpu", "triton"]


def test_ops_takes_the_one_launch_finish_for_a_single_row(monkeypatch):
    """On a (pretended) Hopper GPU the Mosaic GPU kernel runs `serving_config(rows)`: the one-launch finish
    (finish.py) for one row (H200: 1 x 32K 32.1 vs 36.3 us), XLA's finish for more rows and
    under a forced balanced schedule (which takes XLA's finish only). A spy records the config."""
    configs = []
    monkeypatch.setattr(mg, "mla_paged_attention_mgpu", lambda q, *a, **k: configs.append(k["config"]) or q)
    q_lat, q_pe, new, pool, bt, pos = md.make_case(jax.random.key(4), [5, 17], heads=64, page=16)
    bt = jnp.zeros((2, 1024), jnp.int32)                       # a 16K-token table: the mgpu kernel
    ops.mla_paged_attention(q_lat[:1], q_pe[:1], new[:1], pool, bt[:1], pos[:1], SCALE, plan=HOPPER)
    ops.mla_paged_attention(q_lat, q_pe, new, pool, bt, pos, SCALE, plan=HOPPER)
    ops.mla_paged_attention(q_lat[:1], q_pe[:1], new[:1], pool, bt[:1], pos[:1], SCALE,
                            plan=dataclasses.replace(HOPPER, mla_schedule="balanced"))
    assert [c.finish for c in configs] == ["kernel", "xla", "xla"]
    assert configs[1] == mg.MgpuConfig() and configs[2].schedule == "balanced"
    assert mg.serving_config(1) == dataclasses.replace(mg.MgpuConfig(), finish="kernel")
