"""The end of an MLA decode step in ONE launch: the step's new tokens and the flash-decoding combine.

After a decode kernel (decode.py on the Triton backend, decode_mgpu.py on Mosaic GPU) has written
each split's normalized output o [B, J, M, A] (f32) and log-sum-exp lse [B, J, M] over the CACHED
tokens, every query row (t, n) = divmod(m, N) still needs

  1. its scores against the step's own new tokens t' <= t (positions >= 0):
     s = (q_lat . c_t' + q_pe . k^R_t') * scale, their softmax output o_new and lse_new;
  2. the merge of the J splits and the new-token part by their log-sum-exps:
     o = sum_parts exp(lse_part - m) o_part / sum_parts exp(lse_part - m).

`decode.finish_xla` does this in XLA (the reference here): a transpose, two score einsums, a
softmax, a third einsum and the merge, i.e. 7-9 small launches after the decode kernel (14-18 us per
call on an H200 at every decode size, plus the gaps between them: `kimi-bench mla --profile`).
`finish_partials` does it in one Pallas (Triton backend) launch, grid (B, M, A / block_a): one program
per query row and block_a latent columns. It scores the row against the (up to 16) new tokens with
vector dot products (16 x 576 multiply-adds: no tensor-core tile to fill for one row), then reads the
splits' lse and its block_a columns of o in chunks of block_k splits -- one [block_k, block_a] load
per chunk, reduced over the splits in registers -- and writes its columns of o in the queries' dtype
(the first column block also the total lse).

Why chunks of splits: one program per 16 rows walking the splits one at a time (grid (B, M / 16))
took 9.3-10 us at 64 heads but 31-46 us at 8 heads x batch 8 and 198 us at batch 1 x 128K on the H200
(hundreds of splits, one dependent load each). This kernel takes 7-20 us alone; inside an executable of
layers the calls are no shorter than with XLA's finish beyond the run-to-run spread, except after the
Mosaic GPU kernel for one row (BENCHMARKS.md, "MLA decode attention"), which is where it serves (`decode_mgpu.SERVING_CONFIGS`).
Selected by `MlaDecodeConfig.finish` / `MgpuConfig.finish` = 'kernel' (default 'xla').
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile

FINISHES = ("xla", "kernel")
MAX_NEW = 16          # new-token slots per row; more new tokens per step: the XLA path
_NEG = -1e30          # finite "minus infinity": no inf - inf anywhere in the kernel
_EMPTY = -1e29        # an lse at or below this is an empty part (no keys)


def _kernel(o_ref, lse_ref, ql_ref, qp_ref, new_ref, pos_ref, out_ref, lse_out_ref, *, splits: int,
            n_heads: int, t_len: int, rows: int, a: int, r: int, ba: int, bk: int, scale: float):
    # Flattened refs (every index below is scalar-first, as the Triton lowering wants):
    # o_ref [B, J, M * A] f32, lse_ref [B, J * M] f32, ql_ref [B, M * A], qp_ref [B, M * R],
    # new_ref [B, T, A + R], pos_ref [B, T] int32; out_ref [B, M * A], lse_out_ref [B, M] f32.
    b, m, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    ia = jnp.arange(a, dtype=jnp.int32)
    ir = jnp.arange(r, dtype=jnp.int32)
    ja = j * ba + jnp.arange(ba, dtype=jnp.int32)                     # this program's columns
    # 1. the new tokens: scores [MAX_NEW], causal by position
    ts = jnp.arange(MAX_NEW, dtype=jnp.int32)
    has_t = ts < t_len
    tc = jnp.minimum(ts, t_len - 1)
    ql = tile.load(ql_ref.at[b, m * a + ia]).astype(f32)
    qp = tile.load(qp_ref.at[b, m * r + ir]).astype(f32)
    c = tile.load(new_ref.at[b, tc[:, None], ia[None, :]], mask=has_t[:, None], other=0.0)
    kr = tile.load(new_ref.at[b, tc[:, None], a + ir[None, :]], mask=has_t[:, None], other=0.0)
    pos_k = tile.load(pos_ref.at[b, tc], mask=has_t, other=-1)                       # [MAX_NEW]
    pos_q = jnp.max(jnp.where(ts == m // n_heads, pos_k, -1))                        # this row's position
    s = (jnp.sum(c.astype(f32) * ql[None, :], axis=1)
         + jnp.sum(kr.astype(f32) * qp[None, :], axis=1)) * scale                    # [MAX_NEW]
    seen = has_t & (pos_k >= 0) & (pos_k <= pos_q)
    s = jnp.where(seen, s, _NEG)
    m_new = jnp.max(s)
    p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
    l_new = jnp.sum(p)
    p = p.astype(c.dtype).astype(f32)               # rounded as the XLA path's P @ C operand
    c_j = tile.load(new_ref.at[b, tc[:, None], ja[None, :]], mask=has_t[:, None], other=0.0)
    o_new = jnp.sum(p[:, None] * c_j.astype(f32), axis=0)                           # [ba], unnormalized
    lse_new = jnp.where(l_new > 0, m_new + jnp.log(jnp.maximum(l_new, 1e-30)), _NEG)
    # 2. the merge, block_k splits per load: their common max first (lse only), then one pass over o
    ik = jnp.arange(bk, dtype=jnp.int32)
    chunks = -(-splits // bk)

    def lse_chunk(i):
        k = i * bk + ik
        lk = tile.load(lse_ref.at[b, jnp.minimum(k, splits - 1) * rows + m], mask=k < splits, other=_NEG)
        return k, jnp.maximum(lk, _NEG)                              # -inf (empty split) -> _NEG

    mx = lax.fori_loop(0, chunks, lambda i, mx: jnp.maximum(mx, jnp.max(lse_chunk(i)[1])), lse_new)
    w_new = jnp.where(lse_new > _EMPTY, jnp.exp(lse_new - mx), 0.0)
    acc = (w_new / jnp.maximum(l_new, 1e-30)) * o_new               # the new part, normalized, weighted

    def add_chunk(i, carry):
        acc, den = carry
        k, lk = lse_chunk(i)
        w = jnp.where((k < splits) & (lk > _EMPTY), jnp.exp(lk - mx), 0.0)              # [bk]
        ok = tile.load(o_ref.at[b, jnp.minimum(k, splits - 1)[:, None], m * a + ja[None, :]],
                       mask=(k < splits)[:, None], other=0.0)                           # [bk, ba]
        return acc + jnp.sum(jnp.where(w[:, None] > 0, w[:, None] * ok, 0.0), axis=0), den + jnp.sum(w)

    acc, den = lax.fori_loop(0, chunks, add_chunk, (acc, w_new))
    has = den > 0
    out = jnp.where(has, acc / jnp.where(has, den, 1.0), 0.0)
    tile.store(out_ref.at[b, m * a + ja], out.astype(out_ref.dtype))
    lse = jnp.where(has, mx + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    one = jnp.arange(1, dtype=jnp.int32)
    tile.store(lse_out_ref.at[b, m + one], jnp.full((1,), lse, f32), mask=(one == 0) & (j == 0))


def supported(T: int) -> bool:
    """The kernel takes up to MAX_NEW new tokens per row."""
    return 1 <= T <= MAX_NEW


def _blocks(programs_per_block: int, splits: int, a: int, min_programs: int = 264) -> tuple[int, int]:
    """(block_k, block_a): up to 64 splits per load; block_a as wide as keeps a load at ~4K values
    (32 f32 registers per thread at 4 warps), then narrowed (to 32) until the grid has `min_programs`
    programs (two per SM of an H200)."""
    bk = min(pl.next_power_of_2(splits), 64)
    ba = min(a, max(32, 4096 // bk))
    while ba > 32 and ba % 2 == 0 and programs_per_block * (a // ba) < min_programs:
        ba //= 2
    return bk, ba


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_a", "block_k", "num_warps"))
def finish_partials(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale: float, *,
                    interpret: bool = False, block_a: int = 0, block_k: int = 0, num_warps: int = 4):
    """The new tokens' part and the combine of J split partials, one launch. o_BJMA [B, J, M, A] f32
    and lse_BJM [B, J, M] f32 (natural log; -inf or very negative for an empty split) over M = T * N
    rows (t, n) = divmod(m, N). Returns (o [B, T, N, A] in q_lat's dtype, lse [B, T, N] f32); a row
    that sees no key at all gets o = 0 and lse = -inf, as `decode.combine`. block_a / block_k:
    latent columns per program / splits per load (0: `_blocks`)."""
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    J, M = o_BJMA.shape[1], o_BJMA.shape[2]
    if M != T * N or not supported(T) or new_BTC.shape != (B, T, A + R):
        raise ValueError(f"finish_partials: partials {o_BJMA.shape} / new tokens {new_BTC.shape} do not "
                         f"match queries [B={B}, T={T}, N={N}, A={A}] (T <= {MAX_NEW})")
    bk, ba = _blocks(B * M, J, A)
    bk, ba = block_k or bk, block_a or ba
    if A % ba:
        raise ValueError(f"finish_partials: block_a={ba} does not divide the latent width {A}")
    kernel = functools.partial(_kernel, splits=J, n_heads=N, t_len=T, rows=M, a=A, r=R, ba=ba, bk=bk,
                               scale=scale)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, M * A), q_lat_BTNA.dtype),
                   jax.ShapeDtypeStruct((B, M), jnp.float32)),
        grid=(B, M, A // ba),
        interpret=interpret,
        compiler_params=tile.compiler_params(num_warps, 2, interpret),
        name="mla_decode_finish",
    )(o_BJMA.reshape(B, J, M * A), lse_BJM.reshape(B, J * M), q_lat_BTNA.reshape(B, M * A),
      q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, M * R), new_BTC, positions_BT.astype(jnp.int32))
    return o.reshape(B, T, N, A), lse.reshape(B, T, N)

