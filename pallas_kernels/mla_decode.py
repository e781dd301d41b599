"""Absorbed MLA decode over the paged latent cache (flash-decoding), Pallas Triton backend.

For each sequence b, every query row (new token t, head n) attends to the same cached latents, so the
T * N rows share one read of the cache: they are the rows of the MMA (64 heads, 8 under TP8, times
T <= ~5 for speculative verification). Per cached token s the cache holds C = A + R values
[c_s (A = kv_lora_rank) | k^R_s (R = rope dim)] and

    score[t, n, s] = (q_lat[t, n] . c_s + q_pe[t, n] . k^R_s) * scale,     o_lat[t, n] = sum_s p c_s

with the softmax over s in float32. Position p of row b lives in page block_table[b, p // page] at
offset p % page of the pool [X, page, C]; row b's cached length is positions[b, 0].

Pipeline (`mla_paged_attention`):
  1. kernel, grid (row blocks, splits, B): program (i, j, b) walks split j of row b's cached tokens in
     blocks of `block_k` tokens, gathering each token's 576-value row through the block table (one
     contiguous 1152-byte row per token), s = q_lat c^T + q_pe k^R^T on the tensor cores, online
     softmax in float32 (exp2), acc += p c. It writes the split's normalized output (f32) and its
     log-sum-exp. Splits are a fraction of each row's own length (chunk_b = ceil(len_b / splits)
     rounded up to block_k), so ragged batches give every program of a row the same work; programs
     past a row's length write lse = -inf and read nothing.
  2. XLA (tiny): the T new tokens' scores (causal, t' <= t), their lse and output, then the
     flash-decoding combine of all splits and the new part by their lse.

Why Triton and not Mosaic GPU: the project's kernels run on the Triton backend because it runs under
plain `interpret=True` (the CPU tests execute this body) and lowers to SASS off-GPU for inspection
(`sass_probe.py`); see NOTES.md. The gathers here are per-token rows of a page, which Triton
pipelines with cp.async just like the paged_attention example in jax.experimental.pallas.ops.gpu.

`mla_paged_attention_reference` (pure jnp, float32 math, no bf16 rounding of p) is the oracle.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import int4_tile as tile

_NEG = -1e30          # finite "minus infinity" for masked scores (no inf - inf = NaN anywhere)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """Tiling. 0 means "choose from the shapes" (`resolve_config`)."""
    block_m: int = 0              # query rows (t, n) per program; power of two >= 16
    block_k: int = 32             # cached tokens per inner step; power of two >= 16
    num_splits: int = 0           # splits of each row's cached tokens (flash-decoding)
    num_warps: int = 0
    num_stages: int = 2
    target_programs: int = 264    # auto splits: aim for ~2 programs per SM (132 SMs on H200) ...
    min_split_tokens: int = 512   # ... but a split covers at least this many tokens of the longest row

    def __post_init__(self):
        for name in ("block_m", "block_k"):
            v = getattr(self, name)
            if v and (v < 16 or v & (v - 1)):
                raise ValueError(f"MlaDecodeConfig.{name}={v} must be a power of two >= 16")


def resolve_config(cfg: Optional[MlaDecodeConfig], batch: int, rows: int, max_tokens: int
                   ) -> MlaDecodeConfig:
    """Fill the automatic fields for `rows` = T * N query rows and a table of `max_tokens` slots."""
    cfg = cfg or MlaDecodeConfig()
    # 32 rows, 4 warps by default: off-GPU SASS (sass_probe) shows 64 rows x 8 warps spilling in the
    # loop (Triton gives a chained dot's first MMA all warps along M, so 2 warpgroups repeat the
    # 64-row score MMA) while 16 and 32 rows x 4 warps do not; row blocks of one split are adjacent
    # programs, so their repeated reads of the same pages are served from L2. Not yet timed on GPU.
    bm = cfg.block_m or min(32, max(16, 1 << (rows - 1).bit_length()))
    row_blocks = -(-rows // bm)
    splits = cfg.num_splits
    if not splits:
        by_occupancy = -(-cfg.target_programs // (batch * row_blocks))
        by_length = -(-max_tokens // cfg.min_split_tokens)
        splits = max(1, min(by_occupancy, by_length))
    warps = cfg.num_warps or (4 if bm <= 32 else 8)   # [bm, A] f32 accumulator: <= 128 regs/thread
    return dataclasses.replace(cfg, block_m=bm, num_splits=splits, num_warps=warps)


# ----------------------------------------------------------------------------------------------
# The kernel.

def _kernel(len_ref,     # [B] int32 cached tokens per row
            bt_ref,      # [B, P] int32 page ids into the pool
            ql_ref,      # [bm, A] latent queries of this row block
            qp_ref,      # [bm, R] rope queries
            pool_ref,    # [X, page, C] the paged cache (C = A + R)
            o_ref,       # [bm, A] f32 normalized output of this split
            lse_ref,     # [bm] f32 log-sum-exp of this split's scores (-inf: no tokens)
            *, bk: int, splits: int, scale: float):
    j, b = pl.program_id(1), pl.program_id(2)
    page = pool_ref.shape[1]
    a, r = ql_ref.shape[1], qp_ref.shape[1]
    length = tile.load(len_ref.at[b])
    chunk = pl.cdiv(pl.cdiv(length, splits), bk) * bk
    start = j * chunk
    end = jnp.minimum(start + chunk, length)
    n_blocks = jnp.where(end > start, pl.cdiv(end - start, bk), 0)

    ql = ql_ref[...]
    qp = qp_ref[...]
    cols_a = jnp.arange(a, dtype=jnp.int32)[None, :]
    cols_r = a + jnp.arange(r, dtype=jnp.int32)[None, :]
    ids = jnp.arange(bk, dtype=jnp.int32)
    qk_scale = scale * _LOG2E                         # scores in log2 units: exp2 in the loop

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        pos = start + kb * bk + ids                   # [bk] cached positions of this block
        valid = pos < end
        pos = jnp.minimum(pos, end - 1)               # tail lanes re-read the last row (no OOB)
        pg = tile.load(bt_ref.at[b, pos // page])[:, None]
        off = (pos % page)[:, None]
        c = tile.load(pool_ref.at[pg, off, cols_a])               # [bk, A]
        kr = tile.load(pool_ref.at[pg, off, cols_r])              # [bk, R]
        s = (jnp.dot(ql, c.T, preferred_element_type=jnp.float32)
             + jnp.dot(qp, kr.T, preferred_element_type=jnp.float32)) * qk_scale
        s = jnp.where(valid[None, :], s, _NEG)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        corr = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(c.dtype), c, preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    bm = ql.shape[0]
    init = (jnp.zeros((bm, a), jnp.float32), jnp.full((bm,), _NEG, jnp.float32),
            jnp.zeros((bm,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    o_ref[...] = jnp.where(has[:, None], acc / l_safe[:, None], 0.0)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf)


def _check(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT):
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    if q_pe_BTNR.shape[:3] != (B, T, N):
        raise ValueError(f"q_pe {q_pe_BTNR.shape} does not match q_lat {q_lat_BTNA.shape} in [B, T, N]")
    if pool_XpC.ndim != 3 or pool_XpC.shape[-1] != A + R:
        raise ValueError(f"pool must be [pages, page_size, A + R = {A + R}], got {pool_XpC.shape}")
    if new_BTC.shape != (B, T, A + R):
        raise ValueError(f"new_BTC must be [B, T, A + R] = {(B, T, A + R)}, got {new_BTC.shape}")
    if block_table_BP.ndim != 2 or block_table_BP.shape[0] != B:
        raise ValueError(f"block_table must be [B={B}, pages], got {block_table_BP.shape}")
    if positions_BT.shape != (B, T):
        raise ValueError(f"positions must be [B, T] = {(B, T)}, got {positions_BT.shape}")
    for name, v in (("A", A), ("R", R)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"MLA decode kernel needs {name} a power of two >= 16, got {v}")


def mla_decode_partials(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, lengths_B, *, scale: float,
                        config: MlaDecodeConfig, interpret: bool):
    """Kernel call over the cached tokens only. q rows M = T * N (padded to block_m inside).
    Returns o [B, splits, M, A] f32 (each split normalized) and lse [B, splits, M] f32."""
    B, M, A = q_lat_BMA.shape
    R = q_pe_BMR.shape[-1]
    bm, splits = config.block_m, config.num_splits
    row_blocks = -(-M // bm)
    pad = row_blocks * bm - M
    if pad:
        q_lat_BMA = jnp.pad(q_lat_BMA, ((0, 0), (0, pad), (0, 0)))
        q_pe_BMR = jnp.pad(q_pe_BMR, ((0, 0), (0, pad), (0, 0)))
    kernel = functools.partial(_kernel, bk=config.block_k, splits=splits, scale=float(scale))
    whole = pl.no_block_spec
    o, lse = pl.pallas_call(
        kernel,
        grid=(row_blocks, splits, B),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, bm, A), lambda i, j, b: (b, i, 0)),
                  pl.BlockSpec((None, bm, R), lambda i, j, b: (b, i, 0)),
                  whole],
        out_specs=[pl.BlockSpec((None, None, bm, A), lambda i, j, b: (b, j, i, 0)),
                   pl.BlockSpec((None, None, bm), lambda i, j, b: (b, j, i))],
        out_shape=[jax.ShapeDtypeStruct((B, splits, row_blocks * bm, A), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, row_blocks * bm), jnp.float32)],
        interpret=interpret,
        compiler_params=tile.compiler_params(config.num_warps, config.num_stages, interpret),
        name="mla_decode_paged",
    )(lengths_B.astype(jnp.int32), block_table_BP.astype(jnp.int32), q_lat_BMA, q_pe_BMR, pool_XpC)
    return o[:, :, :M], lse[:, :, :M]


def _new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale):
    """Scores of each query against the step's new tokens t' <= t (f32): output and lse [B, T, N]."""
    A = q_lat_BTNA.shape[-1]
    f32 = jnp.float32
    new = new_BTC.astype(q_lat_BTNA.dtype)
    c_BSA, kr_BSR = new[..., :A], new[..., A:]
    s_BTNS = (jnp.einsum("btna,bsa->btns", q_lat_BTNA, c_BSA, preferred_element_type=f32)
              + jnp.einsum("btnr,bsr->btns", q_pe_BTNR, kr_BSR, preferred_element_type=f32)) * scale
    mask_BTS = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (positions_BT[:, None, :] >= 0)
    s_BTNS = jnp.where(mask_BTS[:, :, None, :], s_BTNS, -jnp.inf)
    m_BTN = jnp.max(s_BTNS, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m_BTN), m_BTN, 0.0)
    p_BTNS = jnp.exp(s_BTNS - m_safe[..., None])
    l_BTN = p_BTNS.sum(axis=-1)
    o_BTNA = jnp.einsum("btns,bsa->btna", p_BTNS.astype(c_BSA.dtype), c_BSA, preferred_element_type=f32)
    has = l_BTN > 0
    o_BTNA = jnp.where(has[..., None], o_BTNA / jnp.where(has, l_BTN, 1.0)[..., None], 0.0)
    lse_BTN = jnp.where(has, m_safe + jnp.log(jnp.where(has, l_BTN, 1.0)), -jnp.inf)
    return o_BTNA, lse_BTN


def combine(o_BTNKA, lse_BTNK, o_new_BTNA, lse_new_BTN):
    """Flash-decoding merge of K split outputs and the new-token part, each normalized over its own
    disjoint key set, by their log-sum-exps. Parts with lse = -inf contribute nothing; a row with no
    part at all gives o = 0 and lse = -inf (padding tokens)."""
    m = jnp.maximum(jnp.max(lse_BTNK, axis=-1), lse_new_BTN)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_BTNK = jnp.exp(lse_BTNK - m[..., None])                     # 0 for empty parts
    w_new = jnp.exp(lse_new_BTN - m)
    den = w_BTNK.sum(axis=-1) + w_new
    has = den > 0
    den = jnp.where(has, den, 1.0)
    o = ((w_BTNK[..., None] * o_BTNKA).sum(axis=-2) + w_new[..., None] * o_new_BTNA) / den[..., None]
    return o, jnp.where(has, m + jnp.log(den), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_lse"))
def mla_paged_attention(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT,
                        scale: float, *, config: Optional[MlaDecodeConfig] = None,
                        interpret: Optional[bool] = None, return_lse: bool = False):
    """Absorbed MLA over the paged cache plus the step's new tokens -> o_lat [B, T, N, A] (q's dtype).

    The contract of `kimi_jax.ops.mla_paged_attention`: row b's cached tokens are positions
    [0, positions[b, 0]) read through block_table (padding rows, positions < 0, read nothing); new
    token t also sees new tokens t' <= t with positions >= 0. Softmax in float32. `interpret=None`
    interprets on CPU. With return_lse, also the float32 log-sum-exp [B, T, N] (natural log).
    """
    _check(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT)
    interp = tile.resolve_interpret(interpret)
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    cfg = resolve_config(config, B, T * N, block_table_BP.shape[1] * pool_XpC.shape[1])
    lengths_B = jnp.maximum(positions_BT[:, 0], 0)
    o_BKMA, lse_BKM = mla_decode_partials(
        q_lat_BTNA.reshape(B, T * N, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, T * N, R),
        pool_XpC, block_table_BP, lengths_B, scale=scale, config=cfg, interpret=interp)
    o_new_BTNA, lse_new_BTN = _new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale)
    K = cfg.num_splits
    o_BTNKA = o_BKMA.reshape(B, K, T, N, A).transpose(0, 2, 3, 1, 4)
    lse_BTNK = lse_BKM.reshape(B, K, T, N).transpose(0, 2, 3, 1)
    o_BTNA, lse_BTN = combine(o_BTNKA, lse_BTNK, o_new_BTNA, lse_new_BTN)
    o_BTNA = o_BTNA.astype(q_lat_BTNA.dtype)
    return (o_BTNA, lse_BTN) if return_lse else o_BTNA


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp, float32 math throughout; p is not rounded).

def mla_paged_attention_reference(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP,
                                  positions_BT, scale, *, return_lse: bool = False):
    """The op's definition, written the obvious way: gather every page of each row, append the new
    tokens, mask (cached: s < positions[b, 0]; new: t' <= t and position >= 0), f32 softmax."""
    f32, hp = jnp.float32, lax.Precision.HIGHEST
    B, T, N, A = q_lat_BTNA.shape
    _, page, C = pool_XpC.shape
    S = block_table_BP.shape[1] * page
    old_BSC = pool_XpC[block_table_BP].reshape(B, S, C)
    keys_BSC = jnp.concatenate([old_BSC.astype(f32), new_BTC.astype(f32)], axis=1)
    first_B = positions_BT[:, 0]
    old_mask_BTS = jnp.broadcast_to((jnp.arange(S)[None, :] < first_B[:, None])[:, None, :], (B, T, S))
    new_mask_BTS = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (positions_BT[:, None, :] >= 0)
    mask_BTS = jnp.concatenate([old_mask_BTS, new_mask_BTS], axis=-1)
    s_BTNS = (jnp.einsum("btna,bsa->btns", q_lat_BTNA.astype(f32), keys_BSC[..., :A], precision=hp)
              + jnp.einsum("btnr,bsr->btns", q_pe_BTNR.astype(f32), keys_BSC[..., A:], precision=hp))
    s_BTNS = jnp.where(mask_BTS[:, :, None, :], s_BTNS * scale, -jnp.inf)
    lse_BTN = jax.nn.logsumexp(s_BTNS, axis=-1)
    p_BTNS = jnp.exp(s_BTNS - jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)[..., None])
    o_BTNA = jnp.einsum("btns,bsa->btna", p_BTNS, keys_BSC[..., :A], precision=hp)
    o_BTNA = o_BTNA.astype(q_lat_BTNA.dtype)
    return (o_BTNA, lse_BTN) if return_lse else o_BTNA


def cache_bytes(lengths_B, C: int, itemsize: int) -> int:
    """Bytes the op must read from the cache: every cached token's C values once."""
    return int(sum(int(x) for x in lengths_B)) * C * itemsize
