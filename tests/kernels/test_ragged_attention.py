"""ops.mla_ragged_attention (one pass over a flat token axis of mixed rows) equals the paged XLA path,
ops._mla_paged_attention_xla, run on each row alone: decode rows over long cached contexts, a fresh
prompt chunk, a chunk after cached tokens, padding rows and padding tokens (which give 0), one and two
rank blocks, two page sizes; and per shard under a mesh (blocks and a page-split pool over dp = 4, heads
over tp = 2) it equals the same op on the whole pool. Float32 throughout: both sides sum the same
products of values of size ~1 in another order (the softmax over the cached and the new keys at once
against one einsum each), so 2e-5 absolute is float32 rounding with room."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops

SCALE = 0.2
N, A, R, L = 4, 32, 16, 3
# (cached tokens, tokens this step) of each row of a block; (0, 0): a padding row
BLOCKS = [
    [(37, 1), (0, 5), (9, 4), (0, 0), (50, 1)],
    [(0, 3), (21, 1), (4, 6), (0, 0), (0, 1)],
]
T_BLOCK = 16          # tokens per block: the rows' tokens, then padding


def case(blocks, page, pages_per_block, seed=0):
    """(q_lat, q_pe, new, pool, RaggedRows, positions, max_pages) with page ids drawn without
    repetition inside each block's part of the pool."""
    rng = np.random.default_rng(seed)
    Z = len(blocks)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_lat = jax.random.normal(ks[0], (Z, T_BLOCK, N, A), jnp.float32)
    q_pe = jax.random.normal(ks[1], (Z, T_BLOCK, N, R), jnp.float32)
    new = jax.random.normal(ks[2], (Z, T_BLOCK, A + R), jnp.float32)
    pool = jax.random.normal(ks[3], (L, Z * pages_per_block, page, A + R), jnp.float32)
    max_pages = max(-(-(c + n) // page) for b in blocks for c, n in b)
    fields = {k: [] for k in ("start", "len", "cached", "first")}
    pages_X = np.zeros((Z, len(blocks[0]) * max_pages), np.int32)
    positions = np.full((Z, T_BLOCK), -1, np.int32)
    for z, block in enumerate(blocks):
        ids = rng.permutation(pages_per_block)
        start = at = used = 0
        for c, n in block:
            held = -(-(c + n) // page)
            pages_X[z, at:at + held] = ids[used:used + held]
            fields["start"].append(start)
            fields["len"].append(n)
            fields["cached"].append(c)
            fields["first"].append(at)
            positions[z, start:start + n] = c + np.arange(n)
            start, at, used = start + n, at + held, used + held
    rows = ops.RaggedRows(*(np.asarray(fields[k], np.int32) for k in ("start", "len", "cached", "first")),
                          pages_X.reshape(-1))
    return q_lat, q_pe, new, pool, rows, positions, max_pages


def row_by_row(q_lat, q_pe, new, pool, rows, positions, max_pages, layer, offsets):
    """The paged XLA path on each row alone (offsets: each block's first page id in the pool);
    padding tokens stay 0."""
    Z, T = positions.shape
    per = len(rows.query_start_B) // Z
    pages_ZX = rows.pages_X.reshape(Z, -1)
    out = np.zeros(q_lat.shape, np.float32)
    for b in range(len(rows.query_start_B)):
        z, s, n = b // per, int(rows.query_start_B[b]), int(rows.query_len_B[b])
        if n == 0:
            continue
        first = int(rows.page_start_B[b])
        table = pages_ZX[z, first:first + max_pages] + offsets[z]
        table = np.pad(table, (0, max_pages - len(table)))[None]
        got = ops._mla_paged_attention_xla(q_lat[z, s:s + n][None], q_pe[z, s:s + n][None],
                                           new[z, s:s + n][None], pool, table,
                                           positions[z, s:s + n][None], SCALE, layer=layer)
        out[z, s:s + n] = np.asarray(got[0])
    return out


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("n_blocks", [1, 2])
def test_ragged_equals_the_paged_path_row_by_row(page, n_blocks):
    blocks = BLOCKS[:n_blocks]
    q_lat, q_pe, new, pool, rows, positions, max_pages = case(blocks, page, 32, seed=page + n_blocks)
    layer = 1
    got = jax.jit(lambda *a: ops.mla_ragged_attention(*a, SCALE, max_pages=max_pages, layer=layer))(
        q_lat, q_pe, new, pool, rows, positions)
    # one pool, page ids global: a block's offset is 0
    want = row_by_row(q_lat, q_pe, new, pool, rows, positions, max_pages, layer, [0] * n_blocks)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    assert np.all(np.asarray(got)[positions < 0] == 0)        # padding tokens: exactly 0, no NaN
    # one layer's pool [X, p, C] is a one-layer stack
    flat = ops.mla_ragged_attention(q_lat, q_pe, new, pool[layer], rows, positions, SCALE,
                                    max_pages=max_pages)
    np.testing.assert_allclose(np.asarray(flat), want, atol=2e-5, rtol=0)
    # impl 'pallas': the paged decode kernel (interpreted here) over each token's row's pages, its
    # balanced schedule by default
    pallas = ops.mla_ragged_attention(q_lat, q_pe, new, pool, rows, positions, SCALE,
                                      max_pages=max_pages, plan=ops.ExecPlan(impl="pallas"), layer=layer)
    np.testing.assert_allclose(np.asarray(pallas), want, atol=2e-5, rtol=0)
    assert np.all(np.asarray(pallas)[positions < 0] == 0)
    # its rows schedule (each token's own splits, merged as the decode finish merges them)
    by_rows = ops.mla_ragged_attention(
        q_lat, q_pe, new, pool, rows, positions, SCALE, max_pages=max_pages, layer=layer,
        plan=ops.ExecPlan(impl="pallas", mla_schedule="rows"))
    np.testing.assert_allclose(np.asarray(by_rows), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("block_tokens", [1, 8])
def test_ragged_reads_the_cached_pages_in_blocks(monkeypatch, block_tokens):
    """Cached pages read a block at a time (one page, two pages of 4) give the one-block result."""
    from kimi_jax.ops import ragged
    q_lat, q_pe, new, pool, rows, positions, max_pages = case(BLOCKS[:2], 4, 32, seed=11)
    assert max_pages * 4 > 2 * block_tokens            # several blocks per row
    want = row_by_row(q_lat, q_pe, new, pool, rows, positions, max_pages, 1, [0, 0])
    monkeypatch.setattr(ragged, "BLOCK_TOKENS", block_tokens)
    got = ops.mla_ragged_attention(q_lat, q_pe, new, pool, rows, positions, SCALE,
                                   max_pages=max_pages, layer=1)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


# both impls score the step's own tokens with the same `_new_part`: the xla one's run is slow
@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas"])
def test_ragged_scores_its_own_tokens_in_query_blocks(monkeypatch, impl):
    """The step's own tokens scored 3 queries at a time (blocks that cut rows) give the result of
    scoring them all at once."""
    from kimi_jax.ops import ragged
    q_lat, q_pe, new, pool, rows, positions, max_pages = case(BLOCKS[:2], 4, 32, seed=13)
    want = row_by_row(q_lat, q_pe, new, pool, rows, positions, max_pages, 1, [0, 0])
    monkeypatch.setattr(ragged, "NEW_BLOCK_TOKENS", 3)
    got = ops.mla_ragged_attention(q_lat, q_pe, new, pool, rows, positions, SCALE,
                                   max_pages=max_pages, layer=1, plan=ops.ExecPlan(impl=impl))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


def test_ragged_refuses_bad_sizes():
    q_lat, q_pe, new, pool, rows, positions, max_pages = case(BLOCKS, 4, 32)
    with pytest.raises(ValueError, match="max_pages=0 must be an int >= 1"):
        ops.mla_ragged_attention(q_lat, q_pe, new, pool, rows, positions, SCALE, max_pages=0, layer=0)
    odd = ops.RaggedRows(*(f[:-1] for f in (rows.query_start_B, rows.query_len_B, rows.cached_B,
                                            rows.page_start_B)), rows.pages_X)
    with pytest.raises(ValueError, match="query_start_B has 9 entries, not a multiple of the 2 blocks"):
        ops.mla_ragged_attention(q_lat, q_pe, new, pool, odd, positions, SCALE, max_pages=max_pages,
                                 layer=0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ragged_per_shard_on_a_split_pool_equals_the_whole_pool(impl):
    """dp = 4 blocks, each over its own quarter of the pool with page ids local to it, heads split over
    tp = 2: the same values as one device over the whole pool with global ids (the jnp path and the
    kernel's)."""
    from jax.sharding import PartitionSpec as P
    from kimi_jax.parallel.sharding import Layout
    lay = Layout(tensor_parallel_size=2, data_parallel_size=4)
    par = lay.moe_parallel()
    per_rank, page, layer = 32, 4, 2
    blocks = [BLOCKS[0], BLOCKS[1], BLOCKS[1][::-1], BLOCKS[0][::-1]]
    q_lat, q_pe, new, pool, rows, positions, max_pages = case(blocks, page, per_rank, seed=7)
    put = lambda x, *spec: jax.device_put(x, lay.sharding(P(*spec)))       # noqa: E731
    split_rows = jax.tree.map(lambda a: put(a, "dp"), rows)
    plan = ops.ExecPlan(impl=impl)
    got = jax.jit(lambda *a: ops.mla_ragged_attention(*a, SCALE, max_pages=max_pages, parallel=par,
                                                      plan=plan, layer=layer))(
        put(q_lat, "dp", None, "tp", None), put(q_pe, "dp", None, "tp", None), put(new, "dp", None, None),
        put(pool, None, "dp", None, None), split_rows, put(positions, "dp", None))
    want = row_by_row(q_lat, q_pe, new, pool, rows, positions, max_pages, layer,
                      [z * per_rank for z in range(4)])
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
