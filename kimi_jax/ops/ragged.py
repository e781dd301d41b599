"""Where each row of a flat-token (ragged) step lives: its span on the token axis and its pages.

A ragged step feeds any mix of rows (a decode row: one token; a prompt chunk: many, after cached
tokens or not) as one flat token axis. Under data parallelism the axis is split into equal blocks,
one per rank, and every index below is local to its rank's block: token indices into the rank's
tokens, page ids into the rank's pages of the pool, positions in `pages_X` into the rank's part of
it. Arrays are flat, the ranks' blocks one after another (each sharded over the batch axes); the
model sees the token axis as [ranks, tokens per rank] (one "batch row" per rank).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# A ragged step reads each row's cached pages this many positions at a time, as many blocks as the
# step's longest cached prefix needs (at least one page a block).
BLOCK_TOKENS = 256
# A step's own tokens are scored this many queries at a time (`_new_part`).
NEW_BLOCK_TOKENS = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedRows:
    """The rows of a ragged step: each field [B] int32 (B rows, the ranks' blocks in turn) but
    `pages_X`.
    query_start_B: the row's first token on its rank's token axis (rows follow one another);
    query_len_B: its tokens this step (0: a padding row);
    cached_B: tokens it holds in the pool before this step (so its first token's position);
    page_start_B: where its pages begin in its rank's `pages_X`;
    pages_X: [X] the rows' page ids, row after row within each rank's block of X / ranks (a row's
    pages cover its positions 0 .. cached + query_len - 1, in order; the rest of a block: 0)."""
    query_start_B: jax.Array
    query_len_B: jax.Array
    cached_B: jax.Array
    page_start_B: jax.Array
    pages_X: jax.Array


def mla_ragged_attention(
    q_lat_ZTNA: jax.Array,
    q_pe_ZTNR: jax.Array,
    new_ZTC: jax.Array,
    pool: jax.Array,
    rows: RaggedRows,
    positions_ZT: jax.Array,
    scale: float,
    *,
    max_pages: int,
    plan=None,
    parallel=None,
    layer=None,
) -> jax.Array:
    """Absorbed MLA for a ragged step -> o_lat [Z, T, N, A] (Z blocks of T tokens, one per rank).
    q_lat = W_UK^T q; new_ZTC: this step's latents [c | k^R], not yet in the pool; pool as
    `ops.gather_pages` (a stack [L, X, p, C] with `layer`); rows: fields [B] (the blocks' rows in
    turn, B / Z each) and pages_X [X'] (X' / Z each); positions_ZT < 0: padding. Token t of row b
    sees the row's cached positions < cached_B[b], read through pages_X[page_start_B[b] + j] for
    j < max_pages (static: the most pages a row holds), and this step's tokens of row b at
    positions <= its own; a padding token (in no row, or position < 0) gives 0.

    Under impl 'pallas' (A and R powers of two >= 16, the pool in q's dtype) the cached part is
    the paged MLA decode kernel (pallas_kernels/mla/decode.py): every token is one of its rows,
    reading its row's pages in place through the flat pages_X (no gather), its cached tokens split
    as the kernel splits a decode row (plan.mla_schedule, default 'balanced': work items shared by
    length, a padding token gets none; 'rows': each token's own splits); this
    step's tokens of the same row are the `_new_part` einsums, merged with the splits by
    log-sum-exp as the decode kernel's finish merges them. Under impl 'xla' plain jnp with float32
    scores (as `ops._mla_paged_attention_xla`): each token gathers its row's cached pages on its
    own, BLOCK_TOKENS positions at a time (Z x T x BLOCK_TOKENS latents, online softmax), as many
    blocks as the step's longest cached prefix needs (the rest skipped: one program; on a GPU
    each block's skip is a host round trip, hence the kernel there).
    Under plan.batch_invariant (any backend) `_ragged_invariant_local`: a token's bits follow from
    its row's keys alone, whatever else the step holds and wherever the row's cached / new boundary
    falls (chunk size, prefix-cache hit, preemption).
    parallel (a MoEParallel): run per shard (shard_map) over its batch axes (each rank its blocks
    and its part of a page-split pool, `ops.page_split`) and its heads axes."""
    from kimi_jax import ops
    if not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages < 1:
        raise ValueError(f"mla_ragged_attention: max_pages={max_pages!r} must be an int >= 1")
    Z = q_lat_ZTNA.shape[0]
    for name, n in (("query_start_B", rows.query_start_B.shape[0]),
                    ("pages_X", rows.pages_X.shape[0])):
        if n % Z:
            raise ValueError(f"mla_ragged_attention: RaggedRows.{name} has {n} entries, not a "
                             f"multiple of the {Z} blocks")
    pool_LXpC, layer = ops._stacked(pool, layer)
    plan = ops.default_plan(plan)
    A, R = q_lat_ZTNA.shape[-1], q_pe_ZTNR.shape[-1]
    if plan.batch_invariant:
        local = functools.partial(_ragged_invariant_local, scale=scale, max_pages=max_pages)
    elif (plan.pallas and all(v >= 16 and not v & (v - 1) for v in (A, R))
            and pool_LXpC.dtype == q_lat_ZTNA.dtype):
        local = functools.partial(_ragged_kernel_local, scale=scale, max_pages=max_pages,
                                  schedule=plan.mla_schedule or "balanced",
                                  xla_max_macs=plan.combine_xla_max_macs)
    else:
        local = functools.partial(_ragged_local, scale=scale, max_pages=max_pages)
    local = ops.per_attention_shard(local, parallel,
                                    lambda P, b: RaggedRows(P(b), P(b), P(b), P(b), P(b)))
    return local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows, positions_ZT,
                 jnp.asarray(layer, jnp.int32))


def _token_rows(rows: RaggedRows, positions_ZT):
    """Per token of Z blocks of T: (its row's index in its block, whether it is a real token, its
    row's cached tokens (0 for padding), where its row's pages begin in its block's pages_X)."""
    Z, T = positions_ZT.shape
    start_ZB, len_ZB, cached_ZB, first_page_ZB = (
        f.reshape(Z, -1) for f in (rows.query_start_B, rows.query_len_B, rows.cached_B,
                                   rows.page_start_B))
    # each token's row: the one whose span [query_start, query_start + query_len) holds it
    t = jnp.arange(T)[None, :, None]
    member_ZTB = (t >= start_ZB[:, None, :]) & (t < (start_ZB + len_ZB)[:, None, :])
    row_ZT = jnp.argmax(member_ZTB, axis=-1)
    valid_ZT = member_ZTB.any(axis=-1) & (positions_ZT >= 0)
    cached_ZT = jnp.where(valid_ZT, jnp.take_along_axis(cached_ZB, row_ZT, axis=1), 0)
    return row_ZT, valid_ZT, cached_ZT, jnp.take_along_axis(first_page_ZB, row_ZT, axis=1)


def _new_part(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, row_ZT, valid_ZT, positions_ZT, scale):
    """Each token against this step's tokens of its row at positions <= its own, float32 scores:
    (normalized output [Z, T, N, A] f32, log-sum-exp [Z, T, N]; a padding token: 0 and -inf).
    Past NEW_BLOCK_TOKENS tokens, NEW_BLOCK_TOKENS queries at a time against the keys up to their
    block's end (a row's tokens are consecutive, earlier ones first): scores of at most
    NEW_BLOCK_TOKENS x T a head, not T x T."""
    T = positions_ZT.shape[1]
    args = (q_lat_ZTNA, q_pe_ZTNR, new_ZTC, row_ZT, valid_ZT, positions_ZT, scale)
    if T <= NEW_BLOCK_TOKENS:
        return _new_block(*args, 0, T)
    parts = [_new_block(*args, t0, min(T, t0 + NEW_BLOCK_TOKENS))
             for t0 in range(0, T, NEW_BLOCK_TOKENS)]
    return tuple(jnp.concatenate(p, axis=1) for p in zip(*parts))


def _new_block(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, row_ZT, valid_ZT, positions_ZT, scale, t0, t1):
    """`_new_part` of the queries t0 <= t < t1 (keys: the tokens before t1)."""
    from kimi_jax.ops.impl import einsum_f32
    A = q_lat_ZTNA.shape[-1]
    q_lat, q_pe = q_lat_ZTNA[:, t0:t1], q_pe_ZTNR[:, t0:t1]
    keys_ZSC = new_ZTC[:, :t1].astype(q_lat_ZTNA.dtype)
    row_q, valid_q, pos_q = row_ZT[:, t0:t1], valid_ZT[:, t0:t1], positions_ZT[:, t0:t1]
    row_k, valid_k, pos_k = row_ZT[:, :t1], valid_ZT[:, :t1], positions_ZT[:, :t1]
    mask_ZTS = ((row_k[:, None, :] == row_q[:, :, None]) & valid_k[:, None, :] & valid_q[..., None]
                & (pos_k[:, None, :] <= pos_q[..., None]))
    s_ZNTS = (einsum_f32("ztna,zsa->znts", q_lat, keys_ZSC[..., :A])
              + einsum_f32("ztnr,zsr->znts", q_pe, keys_ZSC[..., A:])) * scale
    s_ZNTS = jnp.where(mask_ZTS[:, None], s_ZNTS, -1e30)
    m_ZNT = s_ZNTS.max(axis=-1)
    p_ZNTS = jnp.exp(s_ZNTS - m_ZNT[..., None])
    l_ZNT = p_ZNTS.sum(axis=-1)
    o_ZTNA = einsum_f32("znts,zsa->ztna", p_ZNTS.astype(keys_ZSC.dtype), keys_ZSC[..., :A])
    o_ZTNA = o_ZTNA / jnp.moveaxis(l_ZNT, 1, 2)[..., None]
    valid_Z1T = valid_q[:, None, :]
    lse_ZNT = jnp.where(valid_Z1T, m_ZNT + jnp.log(jnp.where(valid_Z1T, l_ZNT, 1.0)), -jnp.inf)
    return (jnp.where(valid_q[..., None, None], o_ZTNA, 0.0), jnp.moveaxis(lse_ZNT, 1, 2))


def _ragged_kernel_local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows: RaggedRows,
                         positions_ZT, layer, *, scale, max_pages, schedule, xla_max_macs):
    """`mla_ragged_attention` on one device's blocks and pages with the paged decode kernel: each
    token a row of the kernel over its row's cached tokens, then its `_new_part`, merged."""
    from pallas_kernels.int4 import tile
    from pallas_kernels.mla import combine as mla_combine
    from pallas_kernels.mla import decode as mla_decode
    Z, T, N, A = q_lat_ZTNA.shape
    R = q_pe_ZTNR.shape[-1]
    L, X, page, C = pool_LXpC.shape
    dtype = q_lat_ZTNA.dtype
    row_ZT, valid_ZT, cached_ZT, first_ZT = _token_rows(rows, positions_ZT)
    x_per = rows.pages_X.shape[0] // Z
    base_T = (first_ZT + jnp.arange(Z, dtype=jnp.int32)[:, None] * x_per).reshape(-1)
    table_X = jnp.clip(rows.pages_X, 0, X - 1) + layer * X
    interpret = tile.resolve_interpret(None)
    cfg = mla_decode.resolve_config(mla_decode.MlaDecodeConfig(schedule=schedule), Z * T, N,
                                    max_pages * page, A)
    cached_T = cached_ZT.reshape(-1)
    work = (mla_decode.balanced_items(cached_T, Z * T * cfg.num_splits, cfg.block_k)
            if schedule == "balanced" else None)
    o_TJNA, lse_TJN = mla_decode.mla_decode_partials(
        q_lat_ZTNA.reshape(Z * T, N, A), q_pe_ZTNR.astype(dtype).reshape(Z * T, N, R),
        pool_LXpC.reshape(L * X, page, C), table_X, cached_T, scale=scale,
        config=cfg, interpret=interpret, work=work, page_base_B=base_T)
    o_new_ZTNA, lse_new_ZTN = _new_part(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, row_ZT, valid_ZT,
                                        positions_ZT, scale)
    o_new_TNA, lse_new_TN = o_new_ZTNA.reshape(Z * T, N, A), lse_new_ZTN.reshape(Z * T, N)
    if work is None:    # each token's splits [T, J, N, .] merged as the decode finish merges them
        o_TNA, _ = mla_decode.combine(
            jnp.moveaxis(o_TJNA, 1, 2)[:, None], jnp.moveaxis(lse_TJN, 1, 2)[:, None],
            o_new_TNA[:, None], lse_new_TN[:, None])
        o_TNA = o_TNA[:, 0]
    else:               # items of any token: merged by the item table
        items = o_TJNA.shape[0] * o_TJNA.shape[1]
        o_TNA, _ = mla_combine.combine(
            o_TJNA.reshape(items, N, A), lse_TJN.reshape(items, N), work, o_new_TNA, lse_new_TN,
            interpret=interpret, xla_max_macs=xla_max_macs)
    o_ZTNA = o_TNA.reshape(Z, T, N, A)
    return jnp.where(valid_ZT[..., None, None], o_ZTNA, 0).astype(dtype)


def _ragged_local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows: RaggedRows, positions_ZT, layer,
                  *, scale, max_pages):
    """`mla_ragged_attention` on one device's blocks and pages."""
    from kimi_jax.ops.impl import einsum_f32
    Z, T, N, A = q_lat_ZTNA.shape
    dtype = q_lat_ZTNA.dtype
    L, X, page, C = pool_LXpC.shape
    pages_ZX = rows.pages_X.reshape(Z, -1)
    row_ZT, valid_ZT, cached_ZT, first_ZT = _token_rows(rows, positions_ZT)
    # this step's tokens of the same row, causally: the online softmax starts from their part
    o_new_ZTNA, lse_ZTN = _new_part(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, row_ZT, valid_ZT,
                                    positions_ZT, scale)
    m_ZNT = jnp.moveaxis(jnp.where(valid_ZT[..., None], lse_ZTN, -1e30), 1, 2)
    l_ZNT = jnp.broadcast_to(valid_ZT[:, None, :], m_ZNT.shape).astype(jnp.float32)
    acc_ZTNA = o_new_ZTNA
    # the row's cached pages, G at a time (online softmax), only as many blocks as the step's
    # longest cached prefix needs: a short context reads a few pages, not max_pages
    G = max(1, min(max_pages, -(-BLOCK_TOKENS // page)))
    n_blocks = jnp.minimum(-(-cached_ZT.max() // (G * page)), -(-max_pages // G))
    flat_pool = pool_LXpC.reshape(L * X, page, C)

    def block(j, carry):
        m_ZNT, l_ZNT, acc_ZTNA = carry
        at_ZTG = first_ZT[..., None] + j * G + jnp.arange(G)
        at_ZTG = jnp.clip(at_ZTG, 0, pages_ZX.shape[1] - 1)
        table_ZTG = jnp.take_along_axis(pages_ZX, at_ZTG.reshape(Z, -1), axis=1)
        table_ZTG = jnp.clip(table_ZTG.reshape(at_ZTG.shape), 0, X - 1) + layer * X
        old_ZTSC = flat_pool[table_ZTG].reshape(Z, T, G * page, C).astype(dtype)
        mask_ZTS = j * G * page + jnp.arange(G * page) < cached_ZT[..., None]
        s_ZNTS = (einsum_f32("ztna,ztsa->znts", q_lat_ZTNA, old_ZTSC[..., :A])
                  + einsum_f32("ztnr,ztsr->znts", q_pe_ZTNR, old_ZTSC[..., A:])) * scale
        s_ZNTS = jnp.where(mask_ZTS[:, None], s_ZNTS, -1e30)
        m_new = jnp.maximum(m_ZNT, s_ZNTS.max(axis=-1))
        p_ZNTS = jnp.exp(s_ZNTS - m_new[..., None])
        c_ZNT = jnp.exp(m_ZNT - m_new)
        acc_ZTNA = (acc_ZTNA * jnp.moveaxis(c_ZNT, 1, 2)[..., None]
                    + einsum_f32("znts,ztsa->ztna", p_ZNTS.astype(dtype), old_ZTSC[..., :A]))
        return m_new, l_ZNT * c_ZNT + p_ZNTS.sum(axis=-1), acc_ZTNA

    # a loop of known trip count (what HLO tools count), its blocks past n_blocks skipped
    m_ZNT, l_ZNT, acc_ZTNA = jax.lax.fori_loop(
        0, -(-max_pages // G),
        lambda j, c: jax.lax.cond(j < n_blocks, block, lambda j, c: c, j, c),
        (m_ZNT, l_ZNT, acc_ZTNA))
    o_ZTNA = acc_ZTNA / jnp.moveaxis(jnp.maximum(l_ZNT, 1e-30), 1, 2)[..., None]
    return jnp.where(valid_ZT[..., None, None], o_ZTNA, 0).astype(dtype)


def _ragged_invariant_local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows: RaggedRows,
                            positions_ZT, layer, *, scale, max_pages):
    """`mla_ragged_attention` with every token's result independent of the rest of its step: the
    tokens run `impl.row_tiles` (a few at a time, one program a tile), each reading its row's keys
    at positions 0 .. its own in blocks of BLOCK_TOKENS positions from position 0 (a key before the
    row's cached count from its page, a later one from this step's latents, rounded to the pool's
    dtype as the cache would hold it), merged block after block by online softmax, the sums by
    `impl.row_sums`. So the products' shapes, the blocks, their keys and the order of every sum are
    those of the token's position alone, not of T, the other rows, or how the row's earlier tokens
    were split between the cache and this step (chunk size, prefix-cache hit, preemption); blocks
    past a token's position leave it unchanged to the bit (scores masked: the merge's factors are
    exactly 1 and 0). Every tile runs every block that max_pages holds, a loop of fixed trip count
    with no branch: a block skipped by a branch costs a host round trip on a GPU (the predicate is
    read back), so the reads grow with max_model_len, not with the tile's longest position."""
    from kimi_jax.ops.impl import einsum_f32, row_sums, row_tiles
    Z, T, N, A = q_lat_ZTNA.shape
    dtype = q_lat_ZTNA.dtype
    L, X, page, C = pool_LXpC.shape
    pages_ZX = rows.pages_X.reshape(Z, -1)
    row_ZT, valid_ZT, cached_ZT, first_ZT = _token_rows(rows, positions_ZT)
    start_ZT = jnp.take_along_axis(rows.query_start_B.reshape(Z, -1), row_ZT, axis=1)
    block_ZT = jnp.broadcast_to(jnp.arange(Z, dtype=jnp.int32)[:, None], (Z, T))
    new_ZTC = new_ZTC.astype(pool_LXpC.dtype).astype(dtype)
    flat_pool = pool_LXpC.reshape(L * X, page, C)
    # blocks of BLOCK_TOKENS positions whatever max_pages is (it follows the engine's limits)
    G = max(1, BLOCK_TOKENS // page)
    S = G * page

    def tile(tok):
        q_lat, q_pe, pos_t, valid_t, cached_t, first_t, start_t, z_t = tok
        t = pos_t.shape[0]

        def block(j, carry):
            m_tN, l_tN, acc_tNA = carry
            pos_S = j * S + jnp.arange(S)
            at_tG = jnp.clip(first_t[:, None] + j * G + jnp.arange(G), 0, pages_ZX.shape[1] - 1)
            table_tG = jnp.clip(pages_ZX[z_t[:, None], at_tG], 0, X - 1) + layer * X
            old_tSC = flat_pool[table_tG].reshape(t, S, C).astype(dtype)
            at_tS = jnp.clip(start_t[:, None] + pos_S - cached_t[:, None], 0, T - 1)
            keys_tSC = jnp.where((pos_S < cached_t[:, None])[..., None], old_tSC,
                                 new_ZTC[z_t[:, None], at_tS])
            mask_tS = (pos_S <= pos_t[:, None]) & valid_t[:, None]
            s_tNS = (einsum_f32("tna,tsa->tns", q_lat, keys_tSC[..., :A])
                     + einsum_f32("tnr,tsr->tns", q_pe, keys_tSC[..., A:])) * scale
            s_tNS = jnp.where(mask_tS[:, None], s_tNS, -1e30)
            m_new = jnp.maximum(m_tN, s_tNS.max(axis=-1))
            p_tNS = jnp.exp(s_tNS - m_new[..., None])
            c_tN = jnp.exp(m_tN - m_new)
            acc_tNA = (acc_tNA * c_tN[..., None]
                       + einsum_f32("tns,tsa->tna", p_tNS.astype(dtype), keys_tSC[..., :A]))
            return m_new, l_tN * c_tN + row_sums(p_tNS)[..., 0], acc_tNA

        init = (jnp.full((t, N), -1e30, jnp.float32), jnp.zeros((t, N), jnp.float32),
                jnp.zeros((t, N, A), jnp.float32))
        _, l_tN, acc_tNA = jax.lax.fori_loop(0, -(-(max_pages * page) // S), block, init)
        o_tNA = acc_tNA / jnp.maximum(l_tN, 1e-30)[..., None]
        return jnp.where(valid_t[:, None, None], o_tNA, 0).astype(dtype)

    flat = lambda a: a.reshape(Z * T, *a.shape[2:])  # noqa: E731
    toks = tuple(flat(a) for a in (q_lat_ZTNA, q_pe_ZTNR.astype(dtype), positions_ZT, valid_ZT,
                                   cached_ZT, first_ZT, start_ZT, block_ZT))
    return row_tiles(tile, toks).reshape(Z, T, N, A)
