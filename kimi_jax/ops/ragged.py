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

import jax


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
