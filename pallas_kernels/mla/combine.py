"""The flash-decoding combine of the balanced schedule's work items, one Pallas (Triton) launch.

Under `schedule='balanced'` (`decode.balanced_items`) the decode kernels' B x J programs each
read one work item: part of ONE row's cached tokens, items of a row contiguous and in row order, a
long row holding many more items than a short one. Each item wrote its normalized output
o [I, M, A] (f32, I = B x J items, M = T x N query rows) and its log-sum-exp lse [I, M]. Row b's
answer merges its items i in [first_b, first_b + count_b) and the step's new-token part
(o_new [B, M, A], lse_new [B, M]) by their log-sum-exps:

    o_b = sum_parts exp(lse_part - mx) o_part / sum_parts exp(lse_part - mx),  lse_b = mx + ln(den)

`combine_items_xla` writes that as XLA: per-row maxima and sums over a [B, I] row mask, the
numerator a one-hot contraction at full f32 precision. Its cost is B x I x M x A multiply-adds, which
at batch 64 x 2 splits x 64 heads (537 MFLOP of f32) made the balanced schedule 0-20% slower than
the rows schedule on equal lengths (H200, `kimi-bench mla --balanced`). `combine_items` is the same merge
reading each item once (`combine` picks one by size): grid (B, M, A / block_a), one program per
(row, query row, column block) walks the row's items in chunks of `block_g` ([block_g, block_a]
loads, an online max across chunks; a row of at most FEW_ITEMS items one item at a time), in item
order (deterministic). Items past count_b are masked; a row with no items and no new-token part gives
o = 0, lse = -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile


def combine_items_xla(o_IMA, lse_IM, row_I, o_new_BMA, lse_new_BM):
    """The merge in XLA (the kernel's reference, and `combine`'s choice for small shapes): each row's
    items (row_I; unused items carry lse = -inf) and its new-token part, by their lse."""
    B = o_new_BMA.shape[0]
    mask_BI = row_I[None, :] == jnp.arange(B, dtype=row_I.dtype)[:, None]
    mx_BM = jnp.max(jnp.where(mask_BI[:, :, None], lse_IM[None], -jnp.inf), axis=1)
    mx_BM = jnp.maximum(mx_BM, lse_new_BM)
    mx_BM = jnp.where(jnp.isfinite(mx_BM), mx_BM, 0.0)
    w_IM = jnp.exp(lse_IM - mx_BM[row_I])                           # 0 for empty items
    w_new_BM = jnp.exp(lse_new_BM - mx_BM)
    den_BM = jnp.where(mask_BI[:, :, None], w_IM[None], 0.0).sum(axis=1) + w_new_BM
    num_BMA = jnp.einsum("bim,ima->bma", jnp.where(mask_BI[:, :, None], w_IM[None], 0.0), o_IMA,
                         precision=lax.Precision.HIGHEST) + w_new_BM[..., None] * o_new_BMA
    has = den_BM > 0
    den_BM = jnp.where(has, den_BM, 1.0)
    return num_BMA / den_BM[..., None], jnp.where(has, mx_BM + jnp.log(den_BM), -jnp.inf)


def _kernel(span_ref, o_ref, lse_ref, onew_ref, lsenew_ref, out_ref, lseout_ref, *, n_rows: int, a: int,
            ba: int, bg: int):
    # Flattened refs, scalar-first indices (as the Triton lowering wants): span_ref [2 * B] int32 (each
    # row's first item, then each row's item count), o_ref [I, M * A], lse_ref [I * M],
    # onew_ref [B, M * A], lsenew_ref [B * M]; out_ref [B, M * A], lseout_ref [B * M].
    b, m, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    B = pl.num_programs(0)
    first = tile.load(span_ref.at[b])
    count = tile.load(span_ref.at[B + b])
    cols = m * a + j * ba + jnp.arange(ba, dtype=jnp.int32)
    lse_new = tile.load(lsenew_ref.at[b * n_rows + m])
    has_new = lse_new > -jnp.inf
    mx = lse_new                                                     # running max (-inf: none yet)
    acc = jnp.where(has_new, tile.load(onew_ref.at[b, cols]), 0.0)   # sum w o, relative to mx
    den = jnp.where(has_new, jnp.ones((ba,), jnp.float32), 0.0)   # [ba], equal lanes (a scalar
    #                                                  select from a bool lowers to i1 in Triton)
    ig = jnp.arange(bg, dtype=jnp.int32)

    def chunk(c, carry):
        mx, acc, den = carry
        g = first + c * bg + ig
        valid = g < first + count
        g = jnp.where(valid, g, first)                               # masked lanes stay in bounds
        lse = tile.load(lse_ref.at[g * n_rows + m], mask=valid, other=-jnp.inf)
        o = tile.load(o_ref.at[g[:, None], cols[None, :]], mask=valid[:, None], other=0.0)
        mx_new = jnp.maximum(mx, lse.max())
        live = mx_new > -jnp.inf
        scale = jnp.where(live & (mx > -jnp.inf), jnp.exp(mx - mx_new), 0.0)
        w = jnp.where(live & (lse > -jnp.inf), jnp.exp(lse - mx_new), 0.0)
        return mx_new, acc * scale + jnp.sum(w[:, None] * o, axis=0), den * scale + jnp.sum(w)

    # A row of few items (every row of an equal-length batch: the rows schedule's splits) is merged in
    # one step: its FEW_ITEMS [ba] loads (masked past count) issued together, no masked chunk lanes
    # and no load waiting on the previous one. A longer row is walked in chunks of bg items below.
    few = count <= FEW_ITEMS
    lse_i, o_i = [], []
    for i in range(FEW_ITEMS):
        ok = few & (i < count)
        g = jnp.where(ok, first + i, 0)                              # masked loads stay in bounds
        lse_i.append(tile.load(lse_ref.at[g * n_rows + m], mask=ok, other=-jnp.inf))
        o_i.append(tile.load(o_ref.at[g, cols], mask=jnp.full((ba,), ok), other=0.0))
    mx_new = functools.reduce(jnp.maximum, lse_i, mx)
    live = mx_new > -jnp.inf
    scale = jnp.where(live & (mx > -jnp.inf), jnp.exp(mx - mx_new), 0.0)
    acc, den = acc * scale, den * scale
    for lse, o in zip(lse_i, o_i):
        w = jnp.where(live & (lse > -jnp.inf), jnp.exp(lse - mx_new), 0.0)
        acc, den = acc + w * o, den + w
    # (not few: every lse_i is -inf, so mx_new = mx and acc / den are unchanged)
    mx, acc, den = lax.fori_loop(0, jnp.where(few, 0, pl.cdiv(count, bg)), chunk, (mx_new, acc, den))
    has = den > 0.0
    tile.store(out_ref.at[b, cols], jnp.where(has, acc / jnp.where(has, den, 1.0), 0.0))

    @pl.when(j == 0)
    def _():
        d = jnp.max(den)
        tile.store(lseout_ref.at[b * n_rows + m], jnp.where(d > 0.0, mx + jnp.log(jnp.maximum(d, 1e-30)),
                                                             -jnp.inf))


# A row of at most this many items is merged item by item ([block_a] loads) instead of in chunks of
# block_g: at batch 64 x 2 splits a [16, 512] chunk held 2 live items and 14 masked ones.
FEW_ITEMS = 4
_PROGRAMS = 2048          # the kernel's automatic block_a aims for about this many programs
NUM_WARPS = 4


def combine(o_IMA, lse_IM, work, o_new_BMA, lse_new_BM, *, interpret: bool, xla_max_macs: int = 1 << 27):
    """The balanced schedule's merge (`work`: `decode.balanced_items`' table): the XLA
    contraction up to `xla_max_macs` B x I x M x A multiply-adds, the kernel above. The default is
    measured on the H200 (`kimi-bench mla --combine_sweep`): the contraction was the faster at batch <= 8
    (8 x 128 items x 64 heads: 34M) and 20-100 us slower at batch 64 (268M).
    Returns o [B, M, A] f32 and lse [B, M] f32."""
    I, M, A = o_IMA.shape
    B = o_new_BMA.shape[0]
    if B * I * M * A <= xla_max_macs:
        return combine_items_xla(o_IMA, lse_IM, work[0], o_new_BMA, lse_new_BM)
    return combine_items(o_IMA, lse_IM, work[3, :B], work[4, :B], o_new_BMA, lse_new_BM, interpret=interpret)


def _auto_blocks(B: int, M: int, A: int):
    """(block_a, block_g): columns split until there are ~_PROGRAMS programs (a long row's items are
    walked by M x A / block_a programs in parallel), at least 64 columns; ~8K values per chunk load."""
    s = 1
    while B * M * s * 2 <= _PROGRAMS and A // (2 * s) >= 64 and A % (2 * s) == 0:
        s *= 2
    ba = A // s
    return ba, max(16, min(64, 8192 // ba))


@functools.partial(jax.jit, static_argnames=("interpret", "block_a", "block_g", "num_warps"))
def combine_items(o_IMA, lse_IM, first_B, count_B, o_new_BMA, lse_new_BM, *, interpret: bool = False,
                  block_a: int = 0, block_g: int = 0, num_warps: int = NUM_WARPS):
    """`combine_items_xla` in one launch: rows' items given as [first_B, first_B + count_B)
    (from `decode.balanced_items`). Returns o [B, M, A] f32 and lse [B, M] f32."""
    I, M, A = o_IMA.shape
    B = o_new_BMA.shape[0]
    auto_a, auto_g = _auto_blocks(B, M, A)
    ba, block_g = block_a or auto_a, block_g or auto_g
    if A % ba or ba & (ba - 1) or block_g & (block_g - 1):
        raise ValueError(f"combine_items: block_a={ba} must be a power of two dividing A={A} and "
                         f"block_g={block_g} a power of two")
    f32 = jnp.float32
    spans = jnp.concatenate([first_B, count_B]).astype(jnp.int32)
    out, lse = pl.pallas_call(
        functools.partial(_kernel, n_rows=M, a=A, ba=ba, bg=block_g),
        grid=(B, M, A // ba),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, M * A), f32), jax.ShapeDtypeStruct((B * M,), f32)],
        interpret=interpret,
        compiler_params=tile.compiler_params(num_warps, 3, interpret),
        name="mla_combine_items",
    )(spans, o_IMA.reshape(I, M * A).astype(f32), lse_IM.reshape(I * M).astype(f32),
      o_new_BMA.reshape(B, M * A).astype(f32), lse_new_BM.reshape(B * M).astype(f32))
    return out.reshape(B, M, A), lse.reshape(B, M)
