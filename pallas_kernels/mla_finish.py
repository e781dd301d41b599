"""The end of an MLA decode step in ONE launch: the step's new tokens and the flash-decoding combine.

After a decode kernel (`mla_decode` on the Triton backend, `mla_decode_mgpu` on Mosaic GPU) has written
each split's normalized output o [B, K, M, A] (f32) and log-sum-exp lse [B, K, M] over the CACHED
tokens, every query row (t, n) = divmod(m, N) still needs

  1. its scores against the step's own new tokens t' <= t (positions >= 0):
     s = (q_lat . c_t' + q_pe . k^R_t') * scale, their softmax output o_new and lse_new;
  2. the merge of the K splits and the new-token part by their log-sum-exps:
     o = sum_parts exp(lse_part - m) o_part / sum_parts exp(lse_part - m).

`mla_decode.finish_xla` does this in XLA (the reference here): a transpose,
two score einsums, a softmax, a third einsum and the merge, i.e. several small launches after the
decode kernel, each a few microseconds at decode sizes. `finish_partials` does it in one Pallas
(Triton backend) launch, grid (B, M / block_m, A / block_a): a program loads its 16 query rows, the
row's (up to 16) new tokens, scores them on the tensor cores, then streams its block_a latent columns
of the K partials once, weighting each by exp(lse_k - m), and writes those columns of o in the
queries' dtype (the first column block also the total lse). block_a narrows until the grid has two
programs per SM: at (B, M / 16) alone, 8 heads at batch 8 was 8 programs and took 45.6 us.

Selected by `MlaDecodeConfig.finish` / `MgpuConfig.finish` = 'kernel'; the default stays 'xla' because
it does not pay (H200, sixth session, BENCHMARKS.md MLA round 9): with the (B, M / 16) grid 9.3 us at
64 heads x batch 64 against ~16 us of XLA ops but no shorter call, 18.8 us at 64 heads x batch 8 and
45.6 us at 8 heads x batch 8 (too few programs); with the column split 10.0 us at 64 heads x batch 8
(call 9 us longer than with XLA's finish), 31 us at 8 heads x batch 8, and 198 us at batch 1 x 128K,
where each program walks hundreds of splits one after another (XLA reduces them in parallel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import int4_tile as tile

FINISHES = ("xla", "kernel")
MAX_NEW = 16          # new-token slots per row (the score MMA's N); more new tokens: the XLA path
_NEG = -1e30          # finite "minus infinity": no inf - inf anywhere in the kernel
_EMPTY = -1e29        # an lse at or below this is an empty part (no keys)


def _kernel(o_ref, lse_ref, ql_ref, qp_ref, new_ref, pos_ref, out_ref, lse_out_ref, *, splits: int,
            n_heads: int, t_len: int, bm: int, ba: int, scale: float):
    # o_ref [B, K, M, A] f32, lse_ref [B, K, M] f32; ql_ref [B, M, A], qp_ref [B, M, R];
    # new_ref [B, T, A + R]; pos_ref [B, T] int32; out_ref [B, M, A]; lse_out_ref [B, M] f32.
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)   # j: this program's ba columns
    M, A = ql_ref.shape[1], ql_ref.shape[2]
    R = qp_ref.shape[2]
    f32 = jnp.float32
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    live = rows < M
    rr = jnp.minimum(rows, M - 1)                                    # clamped: masked lanes stay in bounds
    ia = jnp.arange(A, dtype=jnp.int32)[None, :]
    ja = j * ba + jnp.arange(ba, dtype=jnp.int32)[None, :]           # the output columns written here
    ir = jnp.arange(R, dtype=jnp.int32)[None, :]
    # 1. the new tokens: [bm, MAX_NEW] scores, causal by position
    ts = jnp.arange(MAX_NEW, dtype=jnp.int32)
    has_t = ts < t_len
    tc = jnp.minimum(ts, t_len - 1)[:, None]
    ql = tile.load(ql_ref.at[b, rr[:, None], ia], mask=live[:, None], other=0.0)
    qp = tile.load(qp_ref.at[b, rr[:, None], ir], mask=live[:, None], other=0.0)
    c = tile.load(new_ref.at[b, tc, ia], mask=has_t[:, None], other=0.0).astype(ql.dtype)
    kr = tile.load(new_ref.at[b, tc, A + ir], mask=has_t[:, None], other=0.0).astype(ql.dtype)
    pos_k = tile.load(pos_ref.at[b, tc[:, 0]], mask=has_t, other=-1)                # [MAX_NEW]
    pos_q = tile.load(pos_ref.at[b, rr // n_heads])                                 # [bm]
    dn = (((1,), (1,)), ((), ()))
    s = (lax.dot_general(ql, c, dn, preferred_element_type=f32)
         + lax.dot_general(qp, kr, dn, preferred_element_type=f32)) * scale            # [bm, MAX_NEW]
    seen = has_t[None, :] & (pos_k[None, :] >= 0) & (pos_k[None, :] <= pos_q[:, None])
    s = jnp.where(seen, s, _NEG)
    m_new = jnp.max(s, axis=1)
    p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = jnp.sum(p, axis=1)
    c_j = tile.load(new_ref.at[b, tc, ja], mask=has_t[:, None], other=0.0).astype(ql.dtype)
    o_new = lax.dot_general(p.astype(c.dtype), c_j, (((1,), (0,)), ((), ())),
                            preferred_element_type=f32)                                # [bm, ba], unnormalized
    lse_new = jnp.where(l_new > 0, m_new + jnp.log(jnp.maximum(l_new, 1e-30)), _NEG)
    # 2. the merge: the common max over the parts' lse, then one pass over the K partials
    def max_lse(k, m):
        lk = tile.load(lse_ref.at[b, k, rr], mask=live, other=_NEG)
        return jnp.maximum(m, jnp.maximum(lk, _NEG))                 # -inf (empty split) -> _NEG
    m = lax.fori_loop(0, splits, max_lse, lse_new)
    w_new = jnp.where(lse_new > _EMPTY, jnp.exp(lse_new - m), 0.0)
    acc = (w_new / jnp.maximum(l_new, 1e-30))[:, None] * o_new     # the new part, normalized, weighted

    def add_split(k, carry):
        acc, den = carry
        lk = tile.load(lse_ref.at[b, k, rr], mask=live, other=_NEG)
        w = jnp.where(lk > _EMPTY, jnp.exp(jnp.maximum(lk, _NEG) - m), 0.0)
        ok = tile.load(o_ref.at[b, k, rr[:, None], ja], mask=live[:, None], other=0.0)
        return acc + jnp.where(w[:, None] > 0, w[:, None] * ok, 0.0), den + w

    acc, den = lax.fori_loop(0, splits, add_split, (acc, w_new))
    has = den > 0
    out = jnp.where(has[:, None], acc / jnp.where(has, den, 1.0)[:, None], 0.0)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    tile.store(out_ref.at[b, rows[:, None], ja], out.astype(out_ref.dtype), mask=live[:, None])
    tile.store(lse_out_ref.at[b, rows], lse, mask=live & (j == 0))


def supported(T: int) -> bool:
    """The kernel takes up to MAX_NEW new tokens per row."""
    return 1 <= T <= MAX_NEW


def _block_a(programs: int, A: int, min_programs: int = 264) -> int:
    """Latent columns per program: the widest of A, A/2, ... (down to 64) that still gives
    `min_programs` programs (two per SM of an H200), so batch 1-8 fills the GPU too."""
    ba = A
    while ba > 64 and ba % 2 == 0 and programs * (A // ba) < min_programs:
        ba //= 2
    return ba


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_m", "block_a", "num_warps"))
def finish_partials(o_BKMA, lse_BKM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale: float, *,
                    interpret: bool = False, block_m: int = 16, block_a: int = 0, num_warps: int = 4):
    """The new tokens' part and the combine of K split partials, one launch. o_BKMA [B, K, M, A] f32
    and lse_BKM [B, K, M] f32 (natural log; -inf or very negative for an empty split) over M = T * N
    rows (t, n) = divmod(m, N). Returns (o [B, T, N, A] in q_lat's dtype, lse [B, T, N] f32); a row
    that sees no key at all gets o = 0 and lse = -inf, as `mla_decode.combine`."""
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    K, M = o_BKMA.shape[1], o_BKMA.shape[2]
    if M != T * N or not supported(T) or new_BTC.shape != (B, T, A + R):
        raise ValueError(f"finish_partials: partials {o_BKMA.shape} / new tokens {new_BTC.shape} do not "
                         f"match queries [B={B}, T={T}, N={N}, A={A}] (T <= {MAX_NEW})")
    ba = block_a or _block_a(B * pl.cdiv(M, block_m), A)
    if A % ba:
        raise ValueError(f"finish_partials: block_a={ba} does not divide the latent width {A}")
    kernel = functools.partial(_kernel, splits=K, n_heads=N, t_len=T, bm=block_m, ba=ba, scale=scale)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, M, A), q_lat_BTNA.dtype),
                   jax.ShapeDtypeStruct((B, M), jnp.float32)),
        grid=(B, pl.cdiv(M, block_m), A // ba),
        interpret=interpret,
        compiler_params=tile.compiler_params(num_warps, 2, interpret),
        name="mla_decode_finish",
    )(o_BKMA, lse_BKM, q_lat_BTNA.reshape(B, M, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, M, R),
      new_BTC, positions_BT.astype(jnp.int32))
    return o.reshape(B, T, N, A), lse.reshape(B, T, N)


def finish_reference(o_BKMA, lse_BKM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale: float):
    """The XLA path it replaces (`mla_decode.finish_xla`), same contract."""
    from pallas_kernels import mla_decode as md
    o, lse = md.finish_xla(o_BKMA, lse_BKM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale)
    return o.astype(q_lat_BTNA.dtype), lse
