"""Mosaic GPU MLA decode kernel (pallas_kernels/mla/decode_mgpu.py) on CPU.

1. The kernel body under the Mosaic GPU interpreter (simulated SMEM, TMA page copies with barriers,
   wgmma) vs `mla_paged_attention_reference`. Skipped when this jax has no GPU interpreter.
   Tolerances (bf16 inputs, Kimi dims A = 512, R = 64): outputs 3e-2 absolute (values of size <= ~3):
   the kernel rounds p to bf16 before P @ C (2^-9 relative per weight, as the Triton kernel and the
   XLA path) and the op's output to bf16 (up to ~6e-3 at |o| ~ 3); the reference is float32 throughout.
   A token wrongly included or dropped moves an output by ~1/len of a unit-variance row (> 3e-2 for the
   short rows here, which is where masking bugs live: lengths 1, page +- 1, tile +- 1). lse 1e-3: the
   scores are exact products of bf16 values accumulated in f32 on both sides (~1e-6 seen).
   The three warpgroups (threads of the interpreter, cross-warpgroup barriers) run under the
   interpreter's happens-before race detector (a buffer reused across warpgroups without a barrier in
   between is a race there; the interpreter completes wgmma and TMA at once, so it checks the barrier
   protocol, not asynchrony). The o_bmsa option (o written as [B, M, splits, A]) through the full op.
2. The GPU path (no interpreter) traces and lowers to Mosaic GPU MLIR for the cuda platform, in both
   lowering semantics, so shape / tiling / swizzle / wgmma operand errors surface off-GPU.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import decode as md
from pallas_kernels.mla import decode_mgpu as mg

SCALE = 1.0 / math.sqrt(192.0)
# Kimi-K2.5's decode operands (shapes only): q latent [B, 64 heads, A 512], q rope [B, 64, R 64], a pool of
# pages of 16 tokens x (A + R), the block table
KIMI_MLA_SHAPES = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
    ((1, 64, 512), jnp.bfloat16), ((1, 64, 64), jnp.bfloat16), ((8, 16, 576), jnp.bfloat16), ((1, 8), jnp.int32)))

_interp = mg.interpret_params() if mg.plgpu is not None else None
needs_interpreter = pytest.mark.skipif(
    _interp is None, reason="this jax has no Mosaic GPU interpreter (jax._src.pallas.mosaic_gpu."
                            "interpret.params.InterpretGPUParams)")


def _check(args, config, atol=3e-2, interpret=True):
    o, lse = mg.mla_paged_attention_mgpu(*args, SCALE, config=config, interpret=interpret,
                                         return_lse=True)
    ro, rlse = md.mla_paged_attention_reference(*args, SCALE, return_lse=True)
    assert o.shape == args[0].shape and o.dtype == args[0].dtype
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ro, atol=atol, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-3, rtol=0)


# Warpgroup 0 scores each pair as one N = 64 wgmma and hands P and the max correction to warpgroup 1
# (p_bar / p_free); warpgroup 2 issues the TMA. (a) padding tiles (1 and 16 tokens: one tile, an odd
# count) and the second split empty, 97 in 2 splits (a 1-token tail tile); (b) an empty row, 128 rows,
# page 64, 280 tokens = 5 pairs through 2 slots (p_bar / p_free and the slots cycle). Every score masked
# and the served tail-only mask; under the race detector.
@needs_interpreter
@pytest.mark.parametrize("lengths,t,page,splits,cfg", [
    pytest.param([1, 16, 97], 1, 16, 2, mg.MgpuConfig(mask_tail_only=False), marks=pytest.mark.slow),
    ([1, 16, 97], 1, 16, 2, mg.MgpuConfig()),
    ([280, 0], 2, 64, 1, mg.MgpuConfig()),
])
def test_one_scorer(lengths, t, page, splits, cfg):
    args = md.make_case(jax.random.key(11), lengths, heads=64, t=t, page=page)
    cfg = dataclasses.replace(cfg, num_splits=splits)
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)


# The balanced schedule (decode.balanced_items: programs take items of one size across the batch, so
# CTA (b, j) may read another row's pages and queries; the combine goes by item row): a long row beside
# short and empty ones, under the race detector.
@needs_interpreter
@pytest.mark.parametrize("lengths,t,page,cfg", [
    ([300, 7, 0], 1, 16, mg.MgpuConfig(num_splits=2, schedule="balanced")),
])
def test_balanced_schedule(lengths, t, page, cfg):
    args = md.make_case(jax.random.key(19), lengths, heads=64, t=t, page=page)
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)
    with pytest.raises(ValueError, match="o_bmsa"):
        dataclasses.replace(cfg, o_bmsa=True)


@needs_interpreter
def test_partials_contract_and_empty_splits():
    """o [B, splits, M, A] f32 / lse [B, splits, M] f32; a split past a row's length: o = 0, lse = -inf;
    one split of a short row equals the reference over the cached tokens alone."""
    lengths = [40, 0]
    q_lat, q_pe, _, pool, bt, _ = md.make_case(jax.random.key(3), lengths, heads=64, page=16)
    B, T, N, A = q_lat.shape
    o, lse = mg.mla_decode_partials_mgpu(
        q_lat.reshape(B, N, A), q_pe.reshape(B, N, -1), pool, bt, jnp.asarray(lengths, jnp.int32),
        scale=SCALE, config=mg.MgpuConfig(num_splits=2), interpret=True)
    assert o.shape == (B, 2, N, A) and o.dtype == jnp.float32
    assert lse.shape == (B, 2, N) and lse.dtype == jnp.float32
    o, lse = np.asarray(o), np.asarray(lse)
    # 40 tokens, 2 splits: chunk = ceil(20 / 64) * 64 = 64 (a pair) -> split 0 has all, split 1 none
    assert np.all(o[0, 1] == 0) and np.all(np.isneginf(lse[0, 1]))
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))
    keys = pool[bt[0]].reshape(-1, pool.shape[-1])[:40].astype(jnp.float32)
    s = (jnp.einsum("na,sa->ns", q_lat[0, 0].astype(jnp.float32), keys[:, :A],
                    precision="highest")
         + jnp.einsum("nr,sr->ns", q_pe[0, 0].astype(jnp.float32), keys[:, A:],
                      precision="highest")) * SCALE
    ref_lse = jax.nn.logsumexp(s, axis=-1)
    ref_o = jax.nn.softmax(s, axis=-1) @ keys[:, :A]
    np.testing.assert_allclose(lse[0, 0], np.asarray(ref_lse), atol=1e-3, rtol=0)
    np.testing.assert_allclose(o[0, 0], np.asarray(ref_o), atol=3e-2, rtol=0)


@pytest.mark.slow
@needs_interpreter
def test_o_bmsa_layout():
    """o_bmsa: the kernel writes o as [B, M, splits, A] (the combine's order, no transpose before it). 70 tokens in 2 splits (64 + 6): both splits of row 0 hold data, so a mixed-up layout would
    break the match; 8 heads: rows padded to 64 and cut on the M axis (1 with o_bmsa)."""
    lengths = [70, 0]
    args = md.make_case(jax.random.key(17), lengths, heads=8, page=16)
    q_lat, q_pe, _, pool, bt, _ = args
    B, T, N, A = q_lat.shape
    cfg = mg.MgpuConfig(num_splits=2, o_bmsa=True)
    o, lse = jax.eval_shape(lambda *a: mg.mla_decode_partials_mgpu(
        *a, scale=SCALE, config=cfg, interpret=True), q_lat.reshape(B, N, A),
        q_pe.reshape(B, N, -1), pool, bt, jnp.asarray(lengths, jnp.int32))
    assert o.shape == (B, N, 2, A) and lse.shape == (B, 2, N)
    _check(args, cfg)


def _abstract_args(page: int, B: int = 2, P: int = 32):
    """The full op's arguments as shapes (64 heads, T = 1, Kimi's A / R), for lowering on CPU."""
    S = jax.ShapeDtypeStruct
    return (S((B, 1, 64, 512), jnp.bfloat16), S((B, 1, 64, 64), jnp.bfloat16),
            S((B, 1, 576), jnp.bfloat16), S((B * P, page, 576), jnp.bfloat16), S((B, P), jnp.int32),
            S((B, 1), jnp.int32))


@pytest.mark.skipif(mg.plgpu is None, reason="no jax.experimental.pallas.mosaic_gpu")
@pytest.mark.parametrize("semantics", ["Lane", "Warpgroup"])
@pytest.mark.parametrize("page,variant", [(16, "served"), (64, "served"), (16, "one_row"), (16, "balanced"),
                                          (16, "bmsa")])
def test_lowers_for_cuda(semantics, page, variant):
    """The GPU path (no interpreter) lowers to Mosaic GPU MLIR for cuda on a CPU-only host (the
    lowering also checks the CTA's shared memory against the 227 KiB of sm_90: 231,936 B). "served":
    the default config (the served one from two rows up), "one_row": the one-row config (the one-launch
    finish after the kernel), "balanced": the balanced schedule, "bmsa": o written [B, M, splits, A]."""
    args = _abstract_args(page)
    cfg = {"served": mg.serving_config(2), "one_row": mg.serving_config(1),
           "balanced": mg.serving_config(2, "balanced"), "bmsa": mg.MgpuConfig(o_bmsa=True)}[variant]
    cfg = dataclasses.replace(cfg, semantics=semantics)
    f = jax.jit(lambda *a: mg.mla_paged_attention_mgpu(*a, SCALE, config=cfg))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_serving_configs():
    """The served configs by shape class: the defaults, the one-launch finish for one row, and a forced
    schedule on the defaults (XLA's finish: the only one the balanced schedule takes)."""
    assert mg.serving_config(64) == mg.serving_config(2) == mg.MgpuConfig() == mg.SERVING_CONFIGS["rows"]
    assert mg.serving_config(1) == dataclasses.replace(mg.MgpuConfig(), finish="kernel")
    assert mg.serving_config(1, "balanced") == mg.MgpuConfig(schedule="balanced")
    # the served configs pass the kernel's own checks on Kimi-K2.5's MLA
    for cfg in mg.SERVING_CONFIGS.values():
        mg._check_shapes(*KIMI_MLA_SHAPES, cfg)


def test_resolve_config_and_validation():
    cfg = mg.MgpuConfig()
    # shared memory as smem_bytes documents it: Q [64, C], stages tiles [bk, C] (stages / 2 pair slots of
    # [2 bk, C]) and P [64, 2 bk] in the input dtype, plus fixed scratch and barriers
    for bk, stages, c in ((32, 4, 576), (64, 2, 576), (32, 2, 128)):
        base = mg.smem_bytes(bk, stages, c)
        assert mg.smem_bytes(bk, stages + 2, c) - base == 2 * bk * c * 2                  # one more pair slot
        assert mg.smem_bytes(bk, stages, c + 64) - base == (64 + stages * bk) * 64 * 2    # Q's and the slots' columns
        assert mg.smem_bytes(2 * bk, stages, c) - base == (stages * bk * c + 64 * 2 * bk) * 2   # slots and P
        assert mg.smem_bytes(bk, stages, c, 4) - base == 64 * c * 2 + stages * bk * c * 2 + 64 * 2 * bk * 2
    # 4 tiles (2 pairs) fit, 6 do not; auto splits fill the SMs, at least 512 tokens each
    assert mg.smem_bytes(32, 4, 576) <= mg._SMEM_LIMIT < mg.smem_bytes(32, 6, 576)
    assert mg.resolve_config(cfg, batch=1, rows=64, max_tokens=32768).num_splits == 64    # 32768 / 512
    assert mg.resolve_config(cfg, batch=1, rows=64, max_tokens=131072).num_splits == 132
    assert mg.resolve_config(cfg, batch=8, rows=64, max_tokens=32768).num_splits == 16    # 8 x 16 = 128 CTAs
    assert mg.resolve_config(cfg, batch=64, rows=64, max_tokens=4096).num_splits == 2
    # waves=2: CTAs for two rounds of one per SM (batch 8: 33 x 8 = 264 = 2 x 132, no SM idle)
    two = dataclasses.replace(cfg, waves=2)
    assert mg.resolve_config(two, batch=8, rows=64, max_tokens=131072).num_splits == 33
    assert mg.resolve_config(two, batch=1, rows=64, max_tokens=131072).num_splits == 256   # >= 512 tokens
    assert mg.resolve_config(two, batch=64, rows=64, max_tokens=131072).num_splits == 4
    assert mg.resolve_config(dataclasses.replace(cfg, min_split_tokens=1024), batch=1, rows=64,
                             max_tokens=32768).num_splits == 32
    with pytest.raises(ValueError, match="min_split_tokens"):
        mg.MgpuConfig(min_split_tokens=0)
    q_lat, q_pe, _, pool, bt, _ = md.make_case(jax.random.key(0), [5], heads=64, page=16)
    # a pair's N = 2 block_k a multiple of 64, an even tile count, and it must fit
    for bad, what in ((mg.MgpuConfig(block_k=16), "multiple of 64"),
                      (mg.MgpuConfig(stages=3), "even number"),
                      (mg.MgpuConfig(block_k=64, stages=2), "shared memory"),
                      (mg.MgpuConfig(block_k=64, stages=3), "shared memory")):
        with pytest.raises(ValueError, match=what):
            mg.mla_decode_partials_mgpu(q_lat[:, 0], q_pe[:, 0], pool, bt, jnp.asarray([5]),
                                        scale=SCALE, config=bad)
    with pytest.raises(ValueError, match="bf16"):
        mg.mla_decode_partials_mgpu(q_lat[:, 0].astype(jnp.float32), q_pe[:, 0], pool, bt,
                                    jnp.asarray([5]), scale=SCALE, interpret=True)
