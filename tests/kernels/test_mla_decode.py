"""MLA paged decode kernel (pallas_kernels/mla/decode.py, interpret mode) vs its pure-jnp reference.

Tolerances:
  float32 inputs: 2e-5. Interpret mode computes the kernel's dots in float32 (HIGHEST, conftest) and
    p is not rounded, so only summation order differs (~1e-6 seen). A key included or dropped by a
    masking bug moves the output by ~1/len of a unit-variance row, > 1e-2 here, so this catches it.
  bfloat16 inputs: 3e-2 absolute on outputs of size <= ~3. The kernel rounds p to bf16 before the
    P.c dot (relative 2^-9 per weight, like the XLA path) and the result to bf16 (2^-9 relative,
    up to ~6e-3 at |o| ~ 3); the reference keeps everything in float32.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops
from pallas_kernels.mla import decode as md


def _case(seed, *, B, T, N, A, R, page, P, cached, dtype, pad_tokens=()):
    """Random pool (more pages than used, pages shuffled) and queries; cached[b] = row b's length."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    X = B * P + 3
    pool_XpC = jax.random.normal(ks[0], (X, page, A + R), jnp.float32).astype(dtype)
    q_lat_BTNA = jax.random.normal(ks[1], (B, T, N, A), jnp.float32).astype(dtype)
    q_pe_BTNR = jax.random.normal(ks[2], (B, T, N, R), jnp.float32).astype(dtype)
    new_BTC = jax.random.normal(ks[3], (B, T, A + R), jnp.float32).astype(dtype)
    table_BP = jax.random.permutation(ks[4], X)[:B * P].reshape(B, P).astype(jnp.int32)
    first_B = jnp.asarray(cached, jnp.int32)
    positions_BT = first_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    for b, t in pad_tokens:                                   # padding: position < 0
        positions_BT = positions_BT.at[b, t:].set(-1)
    return q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, table_BP, positions_BT


def _check(args, scale, config, atol):
    o, lse = md.mla_paged_attention(*args, scale, config=config, interpret=True, return_lse=True)
    ro, rlse = md.mla_paged_attention_reference(*args, scale, return_lse=True)
    assert o.shape == args[0].shape and o.dtype == args[0].dtype
    valid = np.asarray(args[5] >= 0)                          # padding tokens' outputs are ignored
    np.testing.assert_allclose(np.asarray(o, np.float32)[valid], np.asarray(ro, np.float32)[valid],
                               atol=atol, rtol=0)
    np.testing.assert_allclose(np.asarray(lse)[valid], np.asarray(rlse)[valid], atol=1e-4, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(o, np.float32)))    # padding rows too: no NaN downstream


# Lengths: 0 (the new token only), 1, exactly on a page boundary (2 * page), mid-page, full table.
# splits: 1, 3 (more splits than some rows have blocks) and auto; every split count must agree with
# the reference to 2e-5, which is the flash-decoding combine's test.
@pytest.mark.parametrize("N,T,splits,page", [(8, 1, 1, 4), (64, 1, 3, 32), (4, 3, 0, 16)])
def test_kernel_matches_reference_f32(N, T, splits, page):
    P = 4
    cached = [0, 1, 2 * page, P * page - 5, P * page - T]
    args = _case(0, B=len(cached), T=T, N=N, A=32, R=16, page=page, P=P, cached=cached,
                 dtype=jnp.float32, pad_tokens=[(3, 1)] if T > 1 else [])
    _check(args, 0.17, md.MlaDecodeConfig(block_k=16, num_splits=splits), atol=2e-5)


def test_kernel_matches_reference_bf16_kimi_dims():
    """Kimi's A = 512, R = 64 in bfloat16; a padding row (position -1) and a one-token row."""
    page, P = 16, 3
    cached = [33, 0, 2 * page]
    args = _case(1, B=3, T=1, N=8, A=512, R=64, page=page, P=P, cached=cached, dtype=jnp.bfloat16)
    args = args[:5] + (args[5].at[2].set(-1),)
    _check(args, 512 ** -0.5, md.MlaDecodeConfig(num_splits=2), atol=3e-2)


def test_ops_pallas_branch_matches_xla():
    """kimi_jax.ops selects the kernel under a plan with impl='pallas'; it agrees with the 'xla'
    implementation (float32: the same 2e-5 as against the reference)."""
    args = _case(3, B=2, T=2, N=8, A=32, R=16, page=4, P=6, cached=[20, 16], dtype=jnp.float32)
    got = ops.mla_paged_attention(*args, 0.125, plan=ops.ExecPlan(impl="pallas"))
    want = ops.mla_paged_attention(*args, 0.125, plan=ops.ExecPlan(impl="xla"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_plans_fused_new_tokens_match_xla(monkeypatch):
    """ExecPlan.mla_fuse_new hands the kernel fuse_new=True under the 'rows' schedule (a spy records the
    config) and agrees with the 'xla' implementation (float32: 2e-5, as above); under a forced 'balanced'
    schedule the new tokens stay in XLA (the balanced finish cannot take them)."""
    seen = []
    real = md.mla_paged_attention
    monkeypatch.setattr(md, "mla_paged_attention", lambda *a, **k: seen.append(k["config"]) or real(*a, **k))
    args = _case(4, B=3, T=2, N=8, A=32, R=16, page=4, P=6, cached=[20, 0, 9], dtype=jnp.float32)
    want = ops.mla_paged_attention(*args, 0.125, plan=ops.ExecPlan(impl="xla"))
    for schedule in (None, "balanced"):
        plan = ops.ExecPlan(impl="pallas", mla_fuse_new=True, mla_schedule=schedule)
        got = ops.mla_paged_attention(*args, 0.125, plan=plan)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    assert [(c.fuse_new, c.schedule) for c in seen] == [(True, "rows"), (False, "balanced")]


# Options (resolve_config fills the rest): new tokens in XLA vs in the kernel's last split, latent
# column slices (block_a < A: 2 and 4 slices of A = 64), 16/32/64-row tiles, T = 1 and 4, heads 8
# and 64, the sweep's one-page-buffer baseline. Lengths: 0 (a row with only its new tokens), 1, exactly on a
# page boundary, mid-page, the full table; T = 4 adds padding tokens (position -1) in one row.
_C = md.MlaDecodeConfig


@pytest.mark.parametrize("N,T,cfg", [
    (8, 1, _C(block_k=16, fuse_new=True)),
    (8, 4, _C(block_k=16, block_a=16, num_splits=3)),
    (64, 1, _C(block_k=16, block_m=64, block_a=32, num_splits=2)),
    (64, 4, _C(block_k=16, block_m=32, block_a=32, fuse_new=True)),
    (8, 4, md.ONE_PAGE_BUFFER),
    (8, 1, _C(block_k=64, num_splits=2)),          # 64-token steps (the 8-head batch >= 64 default)
])
def test_options_match_reference_f32(N, T, cfg):
    page, P = 16, 3
    cached = [0, 1, 2 * page, P * page - 5, P * page - T]
    args = _case(5, B=len(cached), T=T, N=N, A=64, R=16, page=page, P=P, cached=cached,
                 dtype=jnp.float32, pad_tokens=[(3, 2)] if T > 1 else [])
    _check(args, 0.11, cfg, atol=2e-5)


def test_fused_new_tokens_padding_row_bf16():
    """In-kernel new tokens with a whole padding row (positions -1, no cached tokens) and a row whose
    only key is its own new token, bf16, one split: the kernel's output is used as is."""
    page, P = 16, 2
    args = _case(6, B=3, T=2, N=8, A=64, R=16, page=page, P=P, cached=[0, 0, page], dtype=jnp.bfloat16)
    args = args[:5] + (args[5].at[0].set(-1),)
    _check(args, 0.2, md.MlaDecodeConfig(num_splits=1), atol=3e-2)


def test_auto_config():
    # 8 heads: 16-row tiles, 5 stages (two page buffers), short splits at short contexts: >= 64
    # tokens, at most ~4 programs per SM (528) and never just above a whole wave
    cfg = md.resolve_config(None, batch=16, rows=8, max_tokens=1024)
    assert (cfg.block_m, cfg.num_warps, cfg.num_stages, cfg.block_a) == (16, 4, 5, 512)
    assert cfg.num_splits == 1024 // 64 and not cfg.fuse_new
    assert md.resolve_config(None, batch=16, rows=8, max_tokens=131072).num_splits == 33     # 528 programs
    assert md.resolve_config(None, batch=32, rows=8, max_tokens=131072).num_splits == 16     # 512, not 544
    assert md.resolve_config(None, batch=64, rows=8, max_tokens=131072).num_splits == 8      # 512, not 576
    assert md.resolve_config(None, batch=1024, rows=8, max_tokens=131072).num_splits == 1
    assert md.resolve_config(None, batch=16, rows=8, max_tokens=100).num_splits == 2
    # ... but a few rows (batch <= FEW_ROWS) at most ~2 programs per SM (264) of >= 256 tokens
    assert md.resolve_config(None, batch=1, rows=8, max_tokens=32768).num_splits == 32768 // 256
    assert md.resolve_config(None, batch=1, rows=8, max_tokens=131072).num_splits == 256      # 264, trimmed
    assert md.resolve_config(None, batch=8, rows=8, max_tokens=131072).num_splits == 33
    assert md.resolve_config(None, batch=5, rows=8, max_tokens=131072).num_splits == 52      # 260, not 265
    assert md.resolve_config(None, batch=1, rows=8, max_tokens=300).num_splits == 2
    assert md.resolve_config(None, batch=1, rows=8, max_tokens=40).num_splits == 1
    assert md.resolve_config(_C(target_programs=528, min_split_tokens=64), batch=1, rows=8,
                             max_tokens=32768).num_splits == 512                              # explicit wins
    # trim_splits (default): the splits a row of max_tokens leaves empty after rounding chunks to whole
    # steps go
    keep = _C(trim_splits=False)
    assert md.resolve_config(None, batch=8, rows=8, max_tokens=32768).num_splits == 32        # 33 -> 32
    assert md.resolve_config(keep, batch=8, rows=8, max_tokens=32768).num_splits == 33
    assert md.resolve_config(keep, batch=1, rows=8, max_tokens=131072).num_splits == 264
    assert md.resolve_config(None, batch=1, rows=8, max_tokens=32768).num_splits == 128       # exact: kept
    assert md.resolve_config(None, batch=4, rows=8, max_tokens=131072).num_splits == 66
    # 64 heads: 4 row blocks of 16; splits fill ~4 programs per SM.
    cfg = md.resolve_config(None, batch=1, rows=64, max_tokens=131072)
    assert (cfg.block_m, cfg.num_warps) == (16, 4) and cfg.num_splits * 4 >= 4 * 132
    assert md.resolve_config(None, batch=64, rows=64, max_tokens=4096).num_splits == 3
    cfg = md.resolve_config(_C(block_m=64, block_a=256), batch=1, rows=64, max_tokens=131072)
    assert cfg.num_warps == 8 and cfg.num_splits * 2 >= 4 * 132
    # 32-token steps, 64 at <= 16 rows and batch >= 64 (measured on the H200, BENCHMARKS.md "MLA decode attention")
    assert md.resolve_config(None, batch=8, rows=8, max_tokens=32768).block_k == 32
    assert md.resolve_config(None, batch=64, rows=8, max_tokens=32768).block_k == 64
    assert md.resolve_config(None, batch=64, rows=64, max_tokens=32768).block_k == 32
    assert md.resolve_config(_C(block_k=16), batch=64, rows=8, max_tokens=32768).block_k == 16
    # the sweep's baseline (one page buffer) stays reachable
    cfg = md.resolve_config(md.ONE_PAGE_BUFFER, batch=1, rows=8, max_tokens=4096)
    assert (cfg.num_stages, cfg.num_splits, cfg.fuse_new, cfg.block_k) == (2, 8, False, 32)
    with pytest.raises(ValueError, match="block_a"):
        md.resolve_config(_C(block_a=1024), batch=1, rows=8, max_tokens=64)


def test_bad_shapes_are_one_line_errors():
    args = _case(4, B=1, T=1, N=4, A=32, R=16, page=4, P=2, cached=[3], dtype=jnp.float32)
    with pytest.raises(ValueError, match="pool must be"):
        md.mla_paged_attention(*args[:3], args[3][..., :-1], *args[4:], 0.1, interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        md.MlaDecodeConfig(block_k=24)


# The balanced schedule (work items of one size shared across the batch, `balanced_items`).

def _optimal_chunk(lengths, items, quantum):
    """Plain loop: the smallest multiple of quantum whose per-row item counts fit in `items`."""
    c = quantum
    while sum(-(-n // c) for n in lengths) > items:
        c += quantum
    return c


@pytest.mark.parametrize("seed", range(6))
def test_balanced_items_cover_every_token_once(seed):
    """Random ragged batches (seeded; zeros included): every row's tokens [0, len) are covered
    exactly once by its items, in order and contiguous; every item reads <= chunk tokens of one row;
    chunk is a multiple of the quantum, no longer than the rows schedule's, and within 4.4% (one
    candidate step) of the smallest chunk that fits (plain-loop search)."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 9))
    splits = int(rng.integers(1, 6))
    quantum = int(rng.choice([16, 32, 64]))
    lengths = [int(v) for v in rng.integers(0, 3000, B) * rng.integers(0, 2, B)]
    lengths[0] = int(rng.integers(1, 40000))                     # one long row
    items = B * splits
    row, start, end = np.asarray(md.balanced_items(jnp.asarray(lengths), items, quantum))[:3]
    sizes = end - start
    assert np.all(sizes >= 0) and np.all(np.diff(row) >= 0)      # rows in order
    assert np.all(start[sizes == 0] == 0) and np.all(end[sizes == 0] == 0)
    for b, n in enumerate(lengths):
        mine = np.nonzero((row == b) & (sizes > 0))[0]
        assert np.all(np.diff(mine) == 1)                        # contiguous items
        got = [(int(start[g]), int(end[g])) for g in mine]
        assert [s for s, _ in got] == [0] + [e for _, e in got[:-1]] if got else n == 0
        assert (got[-1][1] if got else 0) == n
    chunk = int(sizes.max()) if sizes.any() else 0
    rows_chunk = -(-(-(-max(lengths) // splits)) // quantum) * quantum
    best = _optimal_chunk(lengths, items, quantum)
    if chunk:
        assert all(int(s) % quantum == 0 for s in start)
        assert chunk <= rows_chunk and chunk <= best * 1.045 + quantum, (chunk, best, rows_chunk)


def test_balanced_items_equal_lengths_and_one_long_row():
    """Equal lengths: the rows schedule's chunks (row b's items are its own J splits). One 128K row among
    seven of 4K, 128 items of 32-token steps: ~1.3K tokens per item instead of the rows schedule's 8K."""
    row, start, end = np.asarray(md.balanced_items(jnp.asarray([32768] * 64), 128, 64))[:3]
    assert np.array_equal(row, np.repeat(np.arange(64), 2)) and set(end - start) == {16384}
    row, start, end = np.asarray(md.balanced_items(jnp.asarray([131072] + [4096] * 7), 128, 32))[:3]
    assert (end - start).max() <= 1400 and np.sum(row == 0) > 90
    assert not np.asarray(md.balanced_items(jnp.asarray([0, 0]), 4, 32))[1:].any()  # nothing to read


@pytest.mark.parametrize("N,T,splits", [(8, 1, 3), (64, 1, 0), (4, 3, 2)])
def test_balanced_schedule_matches_reference_f32(N, T, splits):
    """The kernel on the balanced schedule (programs read other rows' tokens; the combine goes by
    each item's row): a long row among short ones, a row with only its new tokens, a page boundary,
    one token; f32, the same 2e-5 as the rows schedule."""
    page, P = 16, 12
    cached = [P * page - T, 0, 1, 2 * page, 5]
    args = _case(8, B=len(cached), T=T, N=N, A=32, R=16, page=page, P=P, cached=cached,
                 dtype=jnp.float32, pad_tokens=[(2, 1)] if T > 1 else [])
    _check(args, 0.17, _C(block_k=16, num_splits=splits, schedule="balanced"), atol=2e-5)


def test_schedule_validation_and_the_plans_schedule():
    for bad, msg in ((dict(schedule="fair"), "schedule"), (dict(schedule="balanced", fuse_new=True), "fuse_new"),
                     (dict(schedule="balanced", finish="kernel"), "finish")):
        with pytest.raises(ValueError, match=msg):
            _C(**bad)
    with pytest.raises(ValueError, match="mla_schedule"):
        ops.ExecPlan(mla_schedule="fair")
    args = _case(9, B=3, T=1, N=8, A=32, R=16, page=4, P=10, cached=[37, 2, 0], dtype=jnp.float32)
    want = ops.mla_paged_attention(*args, 0.125, plan=ops.ExecPlan(impl="xla"))
    got = ops.mla_paged_attention(*args, 0.125, plan=ops.ExecPlan(impl="pallas", mla_schedule="balanced"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("N,T,cfg", [(8, 1, None), (64, 1, None), (8, 4, _C(block_a=256)),
                                     (8, 1, _C(fuse_new=True)), (8, 1, _C(schedule="balanced"))])
def test_kernel_lowers_for_cuda(N, T, cfg):
    """The Triton lowering at Kimi's A = 512, R = 64: 8 heads (fewer rows than a 16-row tile, so the
    partials' stores are masked), 64 heads, column slices, the fused new tokens."""
    S = jax.ShapeDtypeStruct
    B, P, page = 4, 64, 16
    args = (S((B, T, N, 512), jnp.bfloat16), S((B, T, N, 64), jnp.bfloat16), S((B, T, 576), jnp.bfloat16),
            S((B * P, page, 576), jnp.bfloat16), S((B, P), jnp.int32), S((B, T), jnp.int32))
    try:
        jax.jit(lambda *a: md.mla_paged_attention(*a, 0.07, config=cfg, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",))
    except RuntimeError as e:   # jax >= 0.11's Triton lowering asks a GPU for its compute capability
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
        raise


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_new_token_part_matches_general_form(dtype):
    """T = 1's elementwise new-token part (o = the token's latent, lse = its score) against the general
    einsum form it replaces, including a padding row (position -1: o = 0, lse = -inf). Same math in
    f32 (products of the inputs are exact in f32), only the summation order of the score differs:
    rtol 1e-5. A wrong half of C (latent vs rope), a missing scale or mask moves them by >> 1e-3."""
    args = _case(11, B=3, T=1, N=8, A=64, R=16, page=16, P=2, cached=[5, 0, 17], dtype=dtype)
    q_lat, q_pe, new, _, _, pos = args
    pos = pos.at[1].set(-1)
    o1, lse1 = md._new_token_part(q_lat, q_pe, new, pos, 0.13)
    o2, lse2 = md._new_token_part(q_lat, q_pe, new, pos, 0.13, one_new_token_elementwise=False)
    assert o1.shape == o2.shape and lse1.shape == lse2.shape and o1.dtype == o2.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-5, atol=0)
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse2), rtol=1e-5, atol=1e-6)
    assert np.all(np.isneginf(np.asarray(lse1)[1])) and not np.any(np.asarray(o1)[1])
