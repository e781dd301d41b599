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

    One path for every plan: plain jnp with float32 scores (as `ops._mla_paged_attention_xla`);
    under impl 'pallas' too, until a GPU kernel takes it. Each token's cached pages are gathered on
    its own (Z x T x max_pages x p latents), so long prompt chunks over long contexts cost memory.
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
    local = functools.partial(_ragged_local, scale=scale, max_pages=max_pages)
    if parallel is not None and parallel.mesh.size > 1:
        from jax.sharding import PartitionSpec as P
        b, h = parallel.batch or None, parallel.heads or None
        split = ops.page_split(parallel) or None
        local = ops.shard_map(
            local,
            parallel.mesh,
            in_specs=(
                P(b, None, h, None),
                P(b, None, h, None),
                P(b, None, None),
                P(None, split, None, None),
                RaggedRows(P(b), P(b), P(b), P(b), P(b)),
                P(b, None),
                P(),
            ),
            out_specs=P(b, None, h, None),
        )
    return local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows, positions_ZT,
                 jnp.asarray(layer, jnp.int32))


def _ragged_local(q_lat_ZTNA, q_pe_ZTNR, new_ZTC, pool_LXpC, rows: RaggedRows, positions_ZT, layer,
                  *, scale, max_pages):
    """`mla_ragged_attention` on one device's blocks and pages."""
    from kimi_jax.ops.impl import einsum_f32
    Z, T, N, A = q_lat_ZTNA.shape
    dtype = q_lat_ZTNA.dtype
    L, X, page, C = pool_LXpC.shape
    start_ZB, len_ZB, cached_ZB, first_page_ZB = (
        f.reshape(Z, -1) for f in (rows.query_start_B, rows.query_len_B, rows.cached_B,
                                   rows.page_start_B))
    pages_ZX = rows.pages_X.reshape(Z, -1)
    # each token's row: the one whose span [query_start, query_start + query_len) holds it
    t = jnp.arange(T)[None, :, None]
    member_ZTB = (t >= start_ZB[:, None, :]) & (t < (start_ZB + len_ZB)[:, None, :])
    row_ZT = jnp.argmax(member_ZTB, axis=-1)
    valid_ZT = member_ZTB.any(axis=-1) & (positions_ZT >= 0)
    cached_ZT = jnp.where(valid_ZT, jnp.take_along_axis(cached_ZB, row_ZT, axis=1), 0)
    # the row's cached pages, as a block table of one row per token
    first_ZT = jnp.take_along_axis(first_page_ZB, row_ZT, axis=1)
    at_ZTP = jnp.clip(first_ZT[..., None] + jnp.arange(max_pages), 0, pages_ZX.shape[1] - 1)
    table_ZTP = jnp.take_along_axis(pages_ZX, at_ZTP.reshape(Z, -1), axis=1).reshape(at_ZTP.shape)
    table_ZTP = jnp.clip(table_ZTP, 0, X - 1) + layer * X
    old_ZTSC = pool_LXpC.reshape(L * X, page, C)[table_ZTP].reshape(Z, T, max_pages * page, C)
    old_ZTSC = old_ZTSC.astype(dtype)
    new_ZTC = new_ZTC.astype(dtype)
    old_mask_ZTS = jnp.arange(max_pages * page) < cached_ZT[..., None]
    # this step's tokens of the same row, causally
    new_mask_ZTT = ((row_ZT[:, None, :] == row_ZT[:, :, None])
                    & valid_ZT[:, None, :] & valid_ZT[:, :, None]
                    & (positions_ZT[:, None, :] <= positions_ZT[:, :, None]))
    s_old_ZNTS = (einsum_f32("ztna,ztsa->znts", q_lat_ZTNA, old_ZTSC[..., :A])
                  + einsum_f32("ztnr,ztsr->znts", q_pe_ZTNR, old_ZTSC[..., A:]))
    s_new_ZNTT = (einsum_f32("ztna,zsa->znts", q_lat_ZTNA, new_ZTC[..., :A])
                  + einsum_f32("ztnr,zsr->znts", q_pe_ZTNR, new_ZTC[..., A:]))
    s_ZNTS = jnp.concatenate([s_old_ZNTS, s_new_ZNTT], axis=-1) * scale
    mask_ZTS = jnp.concatenate([old_mask_ZTS, new_mask_ZTT], axis=-1)
    p_ZNTS = jax.nn.softmax(jnp.where(mask_ZTS[:, None], s_ZNTS, -1e30), axis=-1).astype(dtype)
    S = max_pages * page
    o_ZTNA = (einsum_f32("znts,ztsa->ztna", p_ZNTS[..., :S], old_ZTSC[..., :A])
              + einsum_f32("znts,zsa->ztna", p_ZNTS[..., S:], new_ZTC[..., :A]))
    return jnp.where(valid_ZT[..., None, None], o_ZTNA, 0).astype(dtype)
