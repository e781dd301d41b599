"""Mosaic GPU MLA decode kernel (pallas_kernels/mla/decode_mgpu.py) on CPU.

1. The kernel body under the Mosaic GPU interpreter (simulated SMEM, TMA page copies with barriers,
   wgmma) vs `mla_paged_attention_reference`. Skipped when this jax has no GPU interpreter.
   Tolerances (bf16 inputs, Kimi dims A = 512, R = 64): outputs 3e-2 absolute (values of size <= ~3):
   the kernel rounds p to bf16 before P @ C (2^-9 relative per weight, as the Triton kernel and the
   XLA path) and the op's output to bf16 (up to ~6e-3 at |o| ~ 3); the reference is float32 throughout.
   A token wrongly included or dropped moves an output by ~1/len of a unit-variance row (> 3e-2 for the
   short rows here, which is where masking bugs live: lengths 1, page +- 1, tile +- 1). lse 1e-3: the
   scores are exact products of bf16 values accumulated in f32 on both sides (~1e-6 seen).
   Also the 2-warpgroup variants (two threads, cross-warpgroup barriers, simulated by the interpreter);
   version 2 (split_s) also under the interpreter's happens-before race detector (a buffer reused
   across warpgroups without a barrier in between is a race there; the interpreter completes wgmma
   and TMA at once, so it checks the barrier protocol, not asynchrony), and version 5 (one_scorer).
   The o_bmsa option (o written as [B, M, splits, A]) through the full op.
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
from pallas_kernels.mla import decode_v5 as mla_decode_v5

SCALE = 1.0 / math.sqrt(192.0)

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


# Lengths: 0 (new token only), 1, page - 1, page, page + 1, tile +- 1, several tiles. block_k 64 with
# page 16 = 4 page copies per tile; block_k 32 with page 64 = half-page copies; splits 1, 3 and auto;
# 64 heads (one row block), 128 rows (64 heads x T = 2: two row blocks), 8 heads (rows padded to 64).
@needs_interpreter
@pytest.mark.parametrize("lengths,heads,t,page,block_k,splits", [
    ([0, 1, 15, 16, 17, 200], 64, 1, 16, 64, 3),
    ([63, 64, 65, 129], 64, 1, 64, 32, 0),
    ([31, 0, 97], 64, 2, 16, 32, 2),
    ([1, 130], 8, 1, 16, 64, 1),
])
def test_kernel_matches_reference(lengths, heads, t, page, block_k, splits):
    args = mg.make_case(jax.random.key(7), lengths, heads=heads, t=t, page=page)
    _check(args, mg.MgpuConfig(block_k=block_k, num_splits=splits))


@needs_interpreter
@pytest.mark.parametrize("lengths,heads,t,page,splits", [
    ([300, 7], 64, 2, 16, 1),          # 10 tiles > 3 stages: refills gated by the consumed barrier
    ([0, 65], 64, 1, 64, 2),           # half-page copies, an empty row
])
def test_two_warpgroup_variant(lengths, heads, t, page, splits):
    """warpgroups=2: the halves are two warpgroups of one CTA sharing the page tiles (the interpreter
    runs both threads and checks the barriers: every phase of a waited barrier must be observed)."""
    args = mg.make_case(jax.random.key(5), lengths, heads=heads, t=t, page=page)
    _check(args, mg.MgpuConfig(block_k=32, stages=3, num_splits=splits, warpgroups=2))


# Version 2 (split S): tiles of 32 tokens in pairs, 2 pairs in flight (stages=4 tiles).
# (a) lengths 1 and 16 (a page boundary; one tile: an odd count, the pair's 2nd tile is padding, and
#     the second split is empty), 97 split in 2 (chunks round to 64 tokens: 64 + 33 -> the second
#     split has 2 tiles, the last with 1 token: a page copy past the end, clamped);
# (b) 0 (new token only), 128 rows (two row blocks), page 64 (half-page copies, the padding tile's
#     clamped part-page copy), 280 tokens = 9 tiles = 5 pairs > 2 pair slots (refills gated by the
#     consumed barrier). The interpreter costs ~2-4 s per CTA: 6 + 4 CTAs here.
# (a) plain, (b) and (a) again with SERVING_V2's options (bt_ahead: page ids read one step ahead and
# carried; early_pv: the own tile's P @ C issued before the P exchange; l2_prefetch: a GPU-only hint the
# interpreter drops; mask_tail_only: the scores masked only in tail tiles).
@needs_interpreter
@pytest.mark.parametrize("lengths,t,page,splits,options", [
    ([1, 16, 97], 1, 16, 2, {}),
    ([280, 0], 2, 64, 1, dict(bt_ahead=True, early_pv=True, l2_prefetch=1)),
    ([1, 16, 97], 1, 16, 2, dict(bt_ahead=True, early_pv=True, mask_tail_only=True)),
])
def test_split_s_variant(lengths, t, page, splits, options):
    """split_s: each warpgroup scores one tile of a pair, the row maxima and the final row sums are
    exchanged through shared memory; run under the race detector (no cross-warpgroup race)."""
    args = mg.make_case(jax.random.key(11), lengths, heads=64, t=t, page=page)
    cfg = mg.MgpuConfig(block_k=32, stages=4, warpgroups=2, split_s=True, num_splits=splits,
                        **options)
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)


# The producer option (SERVING_PRODUCER, the seventeenth session's serving config; version 5 runs on it):
# a third warpgroup loads Q, issues every tile copy and refills a pair slot once both computing
# warpgroups released it; they write their partials from inside their branch (staging aliased with the
# loop's shared memory on the GPU). 280 tokens = 5 pairs through 2 slots, page 64, 128 rows, an empty row.
@needs_interpreter
def test_producer_warpgroup():
    args = mg.make_case(jax.random.key(11), [280, 0], heads=64, t=2, page=64)
    cfg = dataclasses.replace(mg.SERVING_PRODUCER, num_splits=1)
    assert cfg.producer and not cfg.one_scorer
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)


# Version 5 (mla_decode_v5.py; SERVING_CONFIG since the eighteenth session): warpgroup 0 scores each pair
# as one N = 64 wgmma and hands P and the max correction to warpgroup 1 (p_bar / p_free), on the
# producer. Cases as test_split_s_variant's: (a) padding tiles (1 and 16 tokens: one tile, an odd count)
# and the second split empty, 97 in 2 splits (a 1-token tail tile); (b) an empty row, 128 rows, page 64,
# 5 pairs through 2 slots (p_bar / p_free and the slots cycle). Every score masked (ONE_SCORER) and the
# serving config's tail-only mask; under the race detector.
@needs_interpreter
@pytest.mark.parametrize("lengths,t,page,splits,cfg", [
    ([1, 16, 97], 1, 16, 2, mg.ONE_SCORER),
    ([1, 16, 97], 1, 16, 2, mg.SERVING_CONFIG),
    ([280, 0], 2, 64, 1, mg.SERVING_CONFIG),
])
def test_one_scorer(lengths, t, page, splits, cfg):
    args = mg.make_case(jax.random.key(11), lengths, heads=64, t=t, page=page)
    cfg = dataclasses.replace(cfg, num_splits=splits)
    assert cfg.one_scorer and cfg.producer
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)


# The balanced schedule (mla_decode.balanced_items: programs take items of one size across the
# batch, so CTA (b, j) may read another row's pages and queries; the combine goes by item row):
# a long row beside short and empty ones. Version 1 (one warpgroup, 64-token tiles) and the serving
# config (version 2 with bt_ahead / early_pv) under the race detector.
@needs_interpreter
@pytest.mark.parametrize("lengths,t,page,cfg", [
    ([300, 7, 0, 65], 1, 16, mg.MgpuConfig(block_k=64, num_splits=3, schedule="balanced")),
    ([300, 7, 0], 1, 16, dataclasses.replace(mg.SERVING_CONFIG, num_splits=2, schedule="balanced")),
])
def test_balanced_schedule(lengths, t, page, cfg):
    args = mg.make_case(jax.random.key(19), lengths, heads=64, t=t, page=page)
    _check(args, cfg, interpret=mg.interpret_params(detect_races=True))
    assert mg.races_found() in (False, None)
    with pytest.raises(ValueError, match="o_bmsa"):
        dataclasses.replace(cfg, o_bmsa=True)


@needs_interpreter
def test_partials_contract_and_empty_splits():
    """o [B, splits, M, A] f32 / lse [B, splits, M] f32; a split past a row's length: o = 0, lse = -inf;
    one split of a short row equals the reference over the cached tokens alone."""
    lengths = [40, 0]
    q_lat, q_pe, _, pool, bt, _ = mg.make_case(jax.random.key(3), lengths, heads=64, page=16)
    B, T, N, A = q_lat.shape
    o, lse = mg.mla_decode_partials_mgpu(
        q_lat.reshape(B, N, A), q_pe.reshape(B, N, -1), pool, bt, jnp.asarray(lengths, jnp.int32),
        scale=SCALE, config=mg.MgpuConfig(block_k=64, num_splits=2), interpret=True)
    assert o.shape == (B, 2, N, A) and o.dtype == jnp.float32
    assert lse.shape == (B, 2, N) and lse.dtype == jnp.float32
    o, lse = np.asarray(o), np.asarray(lse)
    # 40 tokens, 2 splits: chunk = ceil(20 / 64) * 64 = 64 -> split 0 has all, split 1 none
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


@needs_interpreter
def test_o_bmsa_layout():
    """o_bmsa: the kernel (the serving config's, version 5) writes o as [B, M, splits, A] (the
    combine's order, no transpose before it). 70 tokens in 2 splits (64 + 6): both splits of row 0 hold data, so a mixed-up layout would
    break the match; 8 heads: rows padded to 64 and cut on the M axis (1 with o_bmsa)."""
    lengths = [70, 0]
    args = mg.make_case(jax.random.key(17), lengths, heads=8, page=16)
    q_lat, q_pe, _, pool, bt, _ = args
    B, T, N, A = q_lat.shape
    cfg = dataclasses.replace(mg.SERVING_CONFIG, num_splits=2, o_bmsa=True)
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
@pytest.mark.parametrize("block_k,page,wgs,split_s,variant", [
    (64, 16, 1, False, ""), (32, 64, 1, False, ""), (32, 16, 2, False, ""), (32, 16, 2, True, ""),
    (32, 64, 2, True, ""), (32, 16, 2, True, "bmsa"), (32, 16, 2, True, "serving"), (32, 64, 2, True, "serving"),
    (32, 16, 2, True, "prefetch"), (32, 64, 2, True, "prefetch"), (32, 16, 2, True, "balanced"),
    (64, 16, 1, False, "balanced"), (32, 16, 2, True, "mtail"), (32, 16, 2, True, "producer"),
    (32, 64, 2, True, "producer"), (32, 16, 2, True, "v5"), (32, 64, 2, True, "v5")])
def test_lowers_for_cuda(semantics, block_k, page, wgs, split_s, variant, monkeypatch):
    """The GPU path (no interpreter) lowers to Mosaic GPU MLIR for cuda on a CPU-only host (the
    lowering also checks the CTA's shared memory against the 227 KiB of sm_90: the split_s config
    resolves to 4 stages, 231,496 B)."""
    args = _abstract_args(page)
    # "bmsa": o_bmsa; "serving": SERVING_V2's options; "prefetch": L2 prefetches;
    # "balanced": the balanced schedule (the serving options too with split_s); "mtail": the serving
    # options with the scores masked only in a split's tail tiles (a branch on the tile); "producer": a
    # third warpgroup issues the TMA (setmaxnreg, staging in a RefUnion with the loop's buffers); "v5":
    # SERVING_CONFIG (version 5 on the producer, tail-only mask)
    serving = variant in ("serving", "mtail") or (variant == "balanced" and split_s)
    cfg = mg.MgpuConfig(block_k=block_k, semantics=semantics, warpgroups=wgs, split_s=split_s,
                        o_bmsa=variant == "bmsa",
                        bt_ahead=serving, early_pv=serving, l2_prefetch=2 if variant == "prefetch" else 0,
                        schedule="balanced" if variant == "balanced" else "rows",
                        mask_tail_only=variant == "mtail", producer=variant == "producer")
    if variant == "v5":
        cfg = dataclasses.replace(mg.SERVING_CONFIG, semantics=semantics)
    boxes = []
    prefetch = mg.plgpu.async_prefetch

    def recorded(ref, **kw):
        boxes.append(tuple(ref.shape))
        return prefetch(ref, **kw)
    monkeypatch.setattr(mg.plgpu, "async_prefetch", recorded)
    f = jax.jit(lambda *a: mg.mla_paged_attention_mgpu(*a, SCALE, config=cfg))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    if variant == "prefetch":   # one TMA box is <= 256 per dimension: a [rows, 576] page goes in 3
        # parts (the H200 rejected a [16, 576] box at run time, which lowering on CPU does not check)
        assert boxes and set(boxes) == {(min(page, block_k), 192)}, boxes[:3]
    else:
        assert not boxes


def test_resolve_config_and_validation():
    with pytest.raises(ValueError, match="l2_prefetch"):
        mg.MgpuConfig(l2_prefetch=-1)
    assert mg.SERVING_CONFIG.one_scorer and mg.SERVING_CONFIG.producer and mg.SERVING_CONFIG.split_s
    assert mg.SERVING_PRODUCER.producer and mg.SERVING_PRODUCER.early_pv and not mg.SERVING_PRODUCER.one_scorer
    assert mg.SERVING_V2.bt_ahead and not mg.SERVING_V2.producer
    cfg = mg.resolve_config(mg.MgpuConfig(block_k=64), batch=1, rows=64, max_tokens=32768)
    assert cfg.stages == 2 and cfg.num_splits == 66               # 2 halves x 66 splits = 132 CTAs
    cfg = mg.resolve_config(mg.MgpuConfig(block_k=32), batch=64, rows=64, max_tokens=4096)
    assert cfg.stages == 4 and cfg.num_splits == 1
    assert mg._smem_bytes(64, 2, 576) <= mg._SMEM_LIMIT
    cfg = mg.resolve_config(mg.MgpuConfig(block_k=32, warpgroups=2), batch=8, rows=64,
                            max_tokens=32768)
    assert cfg.stages == 4 and cfg.num_splits == 16                # 8 x 16 = 128 CTAs
    # split_s: 4 tiles (2 pairs) fit; auto splits fill the SMs, at least 512 tokens each
    ss = mg.MgpuConfig(block_k=32, warpgroups=2, split_s=True)
    assert mg._smem_bytes(32, 4, 576, wgs=2, split_s=True) <= mg._SMEM_LIMIT
    assert mg._smem_bytes(32, 6, 576, wgs=2, split_s=True) > mg._SMEM_LIMIT
    cfg = mg.resolve_config(ss, batch=1, rows=64, max_tokens=32768)
    assert cfg.stages == 4 and cfg.num_splits == 64                # 32768 / 512
    assert mg.resolve_config(ss, batch=1, rows=64, max_tokens=131072).num_splits == 132
    assert mg.resolve_config(ss, batch=8, rows=64, max_tokens=32768).num_splits == 16
    assert mg.resolve_config(ss, batch=64, rows=64, max_tokens=4096).num_splits == 2
    # waves=2: CTAs for two rounds of one per SM (batch 8: 33 x 8 = 264 = 2 x 132, no SM idle)
    two = dataclasses.replace(ss, waves=2)
    assert mg.resolve_config(two, batch=8, rows=64, max_tokens=131072).num_splits == 33
    assert mg.resolve_config(two, batch=1, rows=64, max_tokens=131072).num_splits == 256   # >= 512 tokens
    assert mg.resolve_config(two, batch=64, rows=64, max_tokens=131072).num_splits == 4
    assert mg.resolve_config(dataclasses.replace(ss, min_split_tokens=1024), batch=1, rows=64,
                             max_tokens=32768).num_splits == 32
    q_lat, q_pe, _, pool, bt, _ = mg.make_case(jax.random.key(0), [5], heads=64, page=16)
    for bad in (mg.MgpuConfig(block_k=32, split_s=True),                      # warpgroups=1
                mg.MgpuConfig(block_k=32, warpgroups=2, split_s=True, stages=3)):
        with pytest.raises(ValueError, match="split_s"):
            mg.mla_decode_partials_mgpu(q_lat[:, 0], q_pe[:, 0], pool, bt, jnp.asarray([5]),
                                        scale=SCALE, config=bad)
    # version 5: only on the producer, a pair's N = 2 block_k a multiple of 64, and it must fit
    for bad, what in ((dataclasses.replace(mg.ONE_SCORER, producer=False), "producer=True"),
                      (dataclasses.replace(mg.ONE_SCORER, block_k=16), "multiple of 64"),
                      (dataclasses.replace(mg.ONE_SCORER, block_k=64, stages=2), "shared memory")):
        with pytest.raises(ValueError, match=what):
            mg.mla_decode_partials_mgpu(q_lat[:, 0], q_pe[:, 0], pool, bt, jnp.asarray([5]),
                                        scale=SCALE, config=bad)
    assert mla_decode_v5.smem_bytes(32, 4, 576) <= mg._SMEM_LIMIT
    with pytest.raises(ValueError, match="bf16"):
        mg.mla_decode_partials_mgpu(q_lat[:, 0].astype(jnp.float32), q_pe[:, 0], pool, bt,
                                    jnp.asarray([5]), scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):
        mg.mla_decode_partials_mgpu(q_lat[:, 0], q_pe[:, 0], pool, bt, jnp.asarray([5]),
                                    scale=SCALE, config=mg.MgpuConfig(block_k=64, stages=3))


@pytest.mark.skipif(mg.plgpu is None, reason="no jax.experimental.pallas.mosaic_gpu")
def test_ablation_variants_lower_for_cuda():
    """pallas_kernels/mla/ablate.py (timing-only variants of version 2): every variant still lowers
    for cuda, and swapping the kernel in for tracing leaves the module's own kernel in place."""
    from pallas_kernels.mla import ablate as mla_ablate
    args = _abstract_args(16)
    kernel = mg._kernel_split_s
    for name in mla_ablate.VARIANTS:
        text = mla_ablate.partials_fn(name).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, name
    assert mg._kernel_split_s is kernel
