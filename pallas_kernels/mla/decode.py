"""Absorbed MLA decode over the paged latent cache (flash-decoding), Pallas Triton backend.

(One file over 600 lines: the kernel, its wrapper, the finish both MLA decode kernels share, and its
pure-jnp reference.)

For each sequence b, every query row (new token t, head n) attends to the same cached latents, so the
T * N rows share one read of the cache: they are the rows of the MMA (64 heads, 8 under TP8, times
T <= ~5 for speculative verification). Per cached token s the cache holds C = A + R values
[c_s (A = kv_lora_rank) | k^R_s (R = rope dim)] and

    score[t, n, s] = (q_lat[t, n] . c_s + q_pe[t, n] . k^R_s) * scale,     o_lat[t, n] = sum_s p c_s

with the softmax over s in float32. Position p of row b lives in page block_table[b, p // page] at
offset p % page of the pool [X, page, C]; row b's cached length is positions[b, 0].

Pipeline (`mla_paged_attention`):
  1. kernel, grid (row blocks x column slices, splits, B): program (i, j, b) walks split j of row b's
     cached tokens in blocks of `block_k` tokens, gathering each token's 576-value row through the
     block table (one contiguous 1152-byte row per token), s = q_lat c^T + q_pe k^R^T on the tensor
     cores, online softmax in float32 (exp2), acc += p c. It writes the split's normalized output
     (f32) and its log-sum-exp for the M real query rows (masked stores: a 16-row tile of 8 heads
     writes 8 rows, not 16 with 8 of padding). Splits are a fraction of each row's own length (chunk_b =
     ceil(len_b / splits) rounded up to block_k), so ragged batches give every program of a row the
     same work; programs past a row's length read nothing. That is schedule 'rows'; with
     schedule='balanced' program (i, j, b) instead reads work item b * splits + j of
     `balanced_items` (items of one size shared across the batch, each within one row; a long row
     among short ones gets most of the programs: 1.4-7.3x faster on such batches on the H200,
     BENCHMARKS.md "MLA decode with rows of mixed lengths"; up to 37% slower on equal 4K rows) and the combine goes by each item's row
     (`mla_combine`). With `fuse_new` (off by default: it timed slower) the last split
     also takes the step's T new tokens (causal t' <= t, positions >= 0) as one more block, read
     from new_BTC. With block_a < A, A / block_a adjacent programs share a row block: each computes
     the full scores and accumulates only its block_a output columns.
  2. XLA (small): the flash-decoding combine of the splits by their lse (nothing when there is one
     split); without fuse_new also the new tokens' part (einsums) merged the same way. With
     `finish='kernel'` both are one more Pallas launch instead (`finish.py`).

Why Triton and not Mosaic GPU: the project's kernels run on the Triton backend because it runs under
plain `interpret=True` (the CPU tests execute this body) and lowers to SASS off-GPU for inspection
(NOTES.md). The gathers here are per-token rows of a page, which Triton
pipelines with cp.async just like the paged_attention example in jax.experimental.pallas.ops.gpu.

`mla_paged_attention_reference` (pure jnp, float32 math, no bf16 rounding of p) is the oracle of this
kernel and of the Mosaic GPU one (decode_mgpu.py); `make_case` builds random inputs for both.
"""
# Over 600 lines: the Triton kernel, its two work schedules and the item builder share one tile layout.
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile
from pallas_kernels.mla import combine as mla_combine
from pallas_kernels.mla import finish as mla_finish

_NEG = -1e30          # finite "minus infinity" for masked scores (no inf - inf = NaN anywhere)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """Tiling. 0 means "choose from the shapes" (`resolve_config`); `ONE_PAGE_BUFFER` is the
    baseline that launch/bench/mla.py --sweep compares against."""
    block_m: int = 0              # query rows (t, n) per program; power of two >= 16
    block_k: int = 0              # cached tokens per inner step; power of two >= 16 (0: 64 for
    #                               <= 16 rows at batch >= 64, else 32; see resolve_config)
    block_a: int = 0              # latent output columns per program (0: all A). With block_a < A,
                                  # A / block_a adjacent programs share a row block: each computes
                                  # the full scores, accumulates p @ c for its column slice only
    num_splits: int = 0           # splits of each row's cached tokens (flash-decoding)
    num_warps: int = 0
    num_stages: int = 0           # 0: 5 (see resolve_config: the block-table load is one level of
                                  # indirection, so Triton double-buffers the pages only from 5)
    target_programs: int = 0      # auto splits: aim for this many programs (0: 4 per SM, 2 per SM
    #                               for a few 8-head rows; see resolve_config) ...
    min_split_tokens: int = 0     # ... but a split covers at least this many tokens (0: by rows)
    fuse_new: bool = False        # True: the step's new tokens are a step of the last split
                                  # (in-kernel) instead of XLA einsums merged afterwards. Off: 2-35%
                                  # slower at 8 heads on the H200 (kimi-bench mla --sweep)
    max_auto_block_m: int = 16    # auto block_m: pow2 >= rows, in [16, this]
    trim_splits: bool = True      # auto splits, <= 16 rows: drop the splits a row of max_tokens leaves empty.
    #                               H200 (BENCHMARKS.md, MLA decode): batch 8 x 32K at 8 heads, 32
    #                               splits 95.5 / 95.9 / 97.2 us in three runs vs 100.8-114.7 us in
    #                               eight with 33 (the last empty); a tie at batch 1 / 2 / 8 x 128K
    finish: str = "xla"           # new tokens + combine: 'xla' (einsums and merge) or 'kernel'
    #                               (mla_finish.finish_partials: one launch; timed no faster)
    schedule: str = "rows"        # who reads which tokens (SCHEDULES): 'rows' (each row split into
    #                               num_splits equal parts of its own length) or 'balanced' (the
    #                               B x num_splits programs share the batch's tokens by length:
    #                               `balanced_items`; a mixed-length batch does not wait on its
    #                               longest row's few programs). 'balanced' needs finish='xla', no fuse_new

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_a"):
            v = getattr(self, name)
            if v and (v < 16 or v & (v - 1)):
                raise ValueError(f"MlaDecodeConfig.{name}={v} must be a power of two >= 16")
        if self.finish not in mla_finish.FINISHES:
            raise ValueError(f"MlaDecodeConfig.finish={self.finish!r} not in {mla_finish.FINISHES}")
        check_schedule("MlaDecodeConfig", self.schedule, self.finish, fuse_new=self.fuse_new)


SCHEDULES = ("rows", "balanced")


def check_schedule(owner: str, schedule: str, finish: str, *, fuse_new: bool = False, o_bmsa: bool = False):
    """The schedule field of a decode config (both kernels): a known name, and 'balanced' only with
    the XLA finish over [B, splits, M, A] partials (the combine then goes by each item's row)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{owner}.schedule={schedule!r} not in {SCHEDULES}")
    if schedule == "balanced":
        bad = [n for n, v in (("finish='kernel'", finish == "kernel"), ("fuse_new", fuse_new),
                              ("o_bmsa", o_bmsa)) if v]
        if bad:
            raise ValueError(f"{owner}.schedule='balanced' does not combine with {bad[0]}")


# The sweep's baseline: 2 pipeline stages (one page buffer, nothing overlapped), >= 512 tokens per split,
# ~2 programs per SM, new tokens in XLA; block_m automatic.
ONE_PAGE_BUFFER = MlaDecodeConfig(block_k=32, num_warps=4, num_stages=2, target_programs=264,
                        min_split_tokens=512, fuse_new=False, max_auto_block_m=32, trim_splits=False)

NUM_SMS = 132                     # H200


# Batches of at most this many rows of <= 16 query rows take the few-rows split rule (resolve_config).
FEW_ROWS = 8


def resolve_config(cfg: Optional[MlaDecodeConfig], batch: int, rows: int, max_tokens: int,
                   a: int = 512) -> MlaDecodeConfig:
    """Fill the automatic fields for `rows` = T * N query rows, a table of `max_tokens` slots and
    latent width `a`.

    Pipelining (Triton's loop pipeliner, as the sm_90 TTGIR shows): the page rows'
    addresses come from a block-table load inside the loop, one level of indirection, so Triton gives
    the page loads a latency of (num_stages - 1) // 2 iterations: num_stages 2-4 keep ONE page buffer
    (the next block's cp.async is issued after this block's MMAs and waited on at the top of the next
    iteration: nothing overlaps, ~4 us per 32-token step on the H200), 5 gives two buffers
    (this block's MMAs overlap the next block's gather), 7 gives three.
    """
    cfg = cfg or MlaDecodeConfig()
    # 16-row tiles by default, also for 64 heads (4 row blocks; adjacent programs, so the pages are
    # read from HBM once and from L2 by the other three). In the sm_90 SASS at 5 stages the 16-row
    # x 4-warp loop has no spills and no repeated MMAs (68 HMMA per warp per 32 tokens), 2 programs
    # fit an SM (~94 KB shared memory); 32 rows x 8 warps repeat the score MMA across warps (104
    # HMMA per warp) and 64 rows with the whole A spill. 64 rows with block_a=256 x 8 warps use
    # wgmma without spills in the loop (a sweep candidate: twice the score MMAs, 1 program per SM).
    bm = cfg.block_m or min(cfg.max_auto_block_m, max(16, 1 << (rows - 1).bit_length()))
    ba = cfg.block_a or a
    if ba > a or a % ba:
        raise ValueError(f"block_a={ba} must divide A={a}")
    row_blocks = -(-rows // bm) * (a // ba)
    stages = cfg.num_stages or 5
    # Short splits keep short contexts spread over the SMs (each split costs one prologue: two
    # dependent loads), but every split also writes and the combine reads rows x A f32 partials.
    # A few 8-head rows (batch <= FEW_ROWS, T = 1: TP8's decode batches) take ~2 programs per SM of
    # >= 256 tokens instead of 4 of >= 64: on the H200 (BENCHMARKS.md, "MLA decode attention", the
    # Triton kernel's split rule at 8 heads; this sweep's own run) batch 1 x 32K
    # 44.4 -> 31.3 us (512 splits of 64 tokens -> 128 of 256), 1 x 128K 72.5 -> 64.1 us (528 -> 264),
    # batch 8 x 4K / 32K / 128K 38.9 / 114.5 / 317.0 -> 32.1 / 103.8 / 303.7 us.
    few = rows <= 16 and batch <= FEW_ROWS
    target = cfg.target_programs or (2 if few else 4) * NUM_SMS
    min_tok = cfg.min_split_tokens or (256 if few or rows > 16 else 64)
    splits = cfg.num_splits
    if not splits:
        # 16-row tiles: at most `target` programs (splits rounded down). Two are resident per SM, so
        # a count just above a multiple of 2 * NUM_SMS runs a last wave of a few programs while the
        # other SMs idle. H200: batch 32 x 128K 17 splits (544 programs) 1,527 us, 78% of
        # copy -> 16 (512) 1,147-1,161 us; batch 64 x 128K 9 -> 8 splits 2,555 -> 2,307 us.
        rb = batch * row_blocks
        by_occupancy = max(1, target // rb) if rows <= 16 else -(-target // rb)
        by_length = -(-max_tokens // min_tok)
        splits = max(1, min(by_occupancy, by_length))
    warps = cfg.num_warps or (4 if bm * ba <= 16 * 512 else 8)   # [bm, ba] f32 acc: <= 64 regs/thread
    # 64-token steps at <= 16 rows (8 heads) and batch >= 64: on the H200 (BENCHMARKS.md, "MLA decode
    # attention", one sweep run) 657 vs 760 us at 64 x 32K, 2,556 vs 2,940 us at 64 x 128K (95% of
    # copy), 123 vs 126 us at 64 x 4K; at batch 8 the 32-token steps stay ahead (112 vs 121 us at 32K,
    # 318 vs 335 us at 128K). Batches 9-63 were not measured and keep 32.
    bk = cfg.block_k or (64 if rows <= 16 and batch >= 64 else 32)
    if cfg.trim_splits and not cfg.num_splits and rows <= 16:   # timed at 8 heads only
        # a row of max_tokens splits into chunks of cdiv(max_tokens, splits) rounded up to whole steps,
        # so its last splits can be empty (batch 8 x 32K: 33 splits of 1,024 tokens, the 33rd empty):
        # keep only the splits that the longest row fills
        per_split = -(-max_tokens // splits)
        chunk = -(-per_split // bk) * bk
        splits = -(-max_tokens // chunk)
    return dataclasses.replace(cfg, block_m=bm, block_a=ba, block_k=bk, num_splits=splits, num_warps=warps,
                               num_stages=stages, target_programs=target, min_split_tokens=min_tok)


# ----------------------------------------------------------------------------------------------
# The kernel.

def _kernel(*refs, bk: int, ba: int, splits: int, a_blocks: int, scale: float, n_heads: int,
            fuse_new: bool, balanced: bool = False, block_m: int = 0, flat_table: bool = False):
    base_ref = None
    if flat_table:       # [B] where row b's pages begin in the flat table bt_ref [X']
        base_ref, refs = refs[1], refs[:1] + refs[2:]
    if fuse_new:
        (len_ref,      # [B] int32 cached tokens per row
         bt_ref,       # [B, P] int32 page ids into the pool
         ql_ref,       # [bm, A] latent queries of this row block (q padded to whole row blocks)
         qp_ref,       # [bm, R] rope queries
         pool_ref,     # [X, page, C] the paged cache (C = A + R)
         new_ref,      # [B, T, C] the step's new latents
         pos_ref,      # [B, T] int32 their positions (< 0: padding)
         o_ref,        # [B, splits, M, A] f32 normalized output of each split (this program: its
         #               rows of split j, its column slice)
         lse_ref) = refs  # [B, splits, M] f32 log-sum-exp of each split's scores (-inf: no tokens)
    else:
        len_ref, bt_ref, ql_ref, qp_ref, pool_ref, o_ref, lse_ref = refs
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot_b = b                                        # the partials slot (b, j) is the program's
    page = pool_ref.shape[1]
    if balanced:   # len_ref is the work table [5, B * splits] flattened: this program's item
        g = b * splits + j   # (row, start, end); q is whole [B, Mp, .]: this item's row block of its row
        n_items = pl.num_programs(2) * splits
        b = tile.load(len_ref.at[g])
        q_rows = pl.ds(pl.multiple_of((i // a_blocks) * block_m, block_m), block_m)
        ql_ref, qp_ref = ql_ref.at[b, q_rows], qp_ref.at[b, q_rows]
    bm, a, r, M = ql_ref.shape[0], ql_ref.shape[1], qp_ref.shape[1], o_ref.shape[2]
    # this program's query rows: the partials hold the M real rows only (with 8 heads and 16-row
    # tiles, a padded partial row block would be half padding, written and sliced off after).
    # q stays padded: masked q loads instead cost 2 spills and 3x the shared-memory loads in the
    # sm_90 SASS of the 8-head loop
    rows = (i // a_blocks) * bm + jnp.arange(bm, dtype=jnp.int32)
    live = rows < M
    if balanced:
        start, end = tile.load(len_ref.at[n_items + g]), tile.load(len_ref.at[2 * n_items + g])
    else:
        length = tile.load(len_ref.at[b])
        chunk = pl.cdiv(pl.cdiv(length, splits), bk) * bk
        start = j * chunk
        end = jnp.minimum(start + chunk, length)
    n_blocks = jnp.where(end > start, pl.cdiv(end - start, bk), 0)

    # Column slices of the latent: slice 0 is this program's own (accumulated), the others only
    # enter the scores. a_blocks == 1: one static slice, the whole latent.
    ia = i % a_blocks if a_blocks > 1 else 0
    offs = [((ia + k) % a_blocks) * ba if a_blocks > 1 else 0 for k in range(a_blocks)]
    cols = [o + jnp.arange(ba, dtype=jnp.int32)[None, :] for o in offs]
    cols_r = a + jnp.arange(r, dtype=jnp.int32)[None, :]
    if a_blocks > 1:
        qls = [tile.load(ql_ref.at[:, pl.ds(pl.multiple_of(o, ba), ba)]) for o in offs]
    else:
        qls = [ql_ref[...]]
    qp = qp_ref[...]
    ids = jnp.arange(bk, dtype=jnp.int32)
    base = tile.load(base_ref.at[b]) if flat_table else None
    qk_scale = scale * _LOG2E                         # scores in log2 units: exp2 in the loop

    def step(carry, cs, kr, valid, zero_masked):
        """One block of keys: cs = the latent's column slices [n, ba] (own first), kr [n, R]."""
        acc, m_prev, l_prev = carry
        s = jnp.dot(qp, kr.T, preferred_element_type=jnp.float32)
        for q_k, c_k in zip(qls, cs):
            s = s + jnp.dot(q_k, c_k.T, preferred_element_type=jnp.float32)
        s = jnp.where(valid, s * qk_scale, _NEG)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        corr = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        if zero_masked:                               # rows may have no valid key in this block
            p = jnp.where(valid, p, 0.0)
        l_next = l_prev * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(cs[0].dtype), cs[0],
                                            preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    def body(kb, carry):
        pos = start + kb * bk + ids                   # [bk] cached positions of this block
        valid = pos < end
        pos = jnp.minimum(pos, end - 1)               # tail lanes re-read the last row (no OOB)
        at = bt_ref.at[base + pos // page] if flat_table else bt_ref.at[b, pos // page]
        pg = tile.load(at)[:, None]
        off = (pos % page)[:, None]
        cs = [tile.load(pool_ref.at[pg, off, c]) for c in cols]     # [bk, ba] each
        kr = tile.load(pool_ref.at[pg, off, cols_r])                # [bk, R]
        return step(carry, cs, kr, valid[None, :], False)

    init = (jnp.zeros((bm, ba), jnp.float32), jnp.full((bm,), _NEG, jnp.float32),
            jnp.zeros((bm,), jnp.float32))
    carry = lax.fori_loop(0, n_blocks, body, init)

    if fuse_new:
        t_new = new_ref.shape[1]
        bn = max(16, 1 << (t_new - 1).bit_length())

        def new_tokens(c):   # everything computed in here: nothing stays live across the loop
            tt = jnp.minimum(jnp.arange(bn, dtype=jnp.int32), t_new - 1)
            key_pos = jnp.where(jnp.arange(bn) < t_new, tile.load(pos_ref.at[b, tt]), -1)
            row_t = jnp.minimum(rows // n_heads, t_new - 1)
            row_pos = tile.load(pos_ref.at[b, row_t])
            valid_new = (key_pos[None, :] >= 0) & (key_pos[None, :] <= row_pos[:, None])
            cs = [tile.load(new_ref.at[b, tt[:, None], col]) for col in cols]   # [bn, ba] each
            kr = tile.load(new_ref.at[b, tt[:, None], cols_r])
            cs = [x.astype(qls[0].dtype) for x in cs]
            return step(c, cs, kr.astype(qls[0].dtype), valid_new, True)

        carry = lax.cond(j == splits - 1, new_tokens, lambda c: c, carry)

    acc, m, l = carry
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    # stores index the rows unclamped: masked lanes past M are dropped in both modes, where clamped
    # duplicates of row M - 1 could write interpret mode's stale value over the real one
    tile.store(o_ref.at[slot_b, j, rows[:, None], cols[0]], jnp.where(has[:, None], acc / l_safe[:, None], 0.0),
               mask=live[:, None])
    # every column slice of a row block writes the same lse (identical values)
    tile.store(lse_ref.at[slot_b, j, rows], jnp.where(has, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf), mask=live)


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
                        config: MlaDecodeConfig, interpret: bool, new_BTC=None, positions_BT=None,
                        work=None, page_base_B=None):
    """Kernel call over the cached tokens (and, with config.fuse_new, the new tokens new_BTC at
    positions_BT, in the last split). q rows M = T * N (padded to block_m inside). With
    page_base_B [B], block_table_BP is one flat table [X'] and row b's pages are
    block_table[page_base_B[b]:] (rows sharing pages share entries: a ragged step's tokens).
    Returns o [B, splits, M, A] f32 (each split normalized) and lse [B, splits, M] f32; with
    config.schedule 'balanced' slot (b, j) holds work item b * splits + j of `work` (default
    `balanced_items(lengths_B, B * splits, block_k)`; its row: that table's row 0)."""
    B, M, A = q_lat_BMA.shape
    R = q_pe_BMR.shape[-1]
    bm, splits, ba = config.block_m, config.num_splits, config.block_a or A
    a_blocks = A // ba
    row_blocks = -(-M // bm)
    pad = row_blocks * bm - M
    if pad:
        q_lat_BMA = jnp.pad(q_lat_BMA, ((0, 0), (0, pad), (0, 0)))
        q_pe_BMR = jnp.pad(q_pe_BMR, ((0, 0), (0, pad), (0, 0)))
    fuse = config.fuse_new
    n_heads = 1
    if fuse:
        T = new_BTC.shape[1]
        n_heads = M // T
    balanced = config.schedule == "balanced"
    flat = page_base_B is not None
    if flat and (fuse or block_table_BP.ndim != 1):
        raise ValueError("mla_decode_partials: page_base_B needs a flat [X'] block table and no "
                         "fuse_new")
    kernel = functools.partial(_kernel, bk=config.block_k, ba=ba, splits=splits, a_blocks=a_blocks,
                               scale=float(scale), n_heads=n_heads, fuse_new=fuse, balanced=balanced,
                               block_m=bm, flat_table=flat)
    whole = pl.no_block_spec
    if balanced:     # a program's row comes from the table: q whole, sliced in the kernel
        q_specs = [whole, whole]
        work = (balanced_items(lengths_B, B * splits, config.block_k) if work is None else work).reshape(-1)
    else:
        q_specs = [pl.BlockSpec((None, bm, A), lambda i, j, b: (b, i // a_blocks, 0)),
                   pl.BlockSpec((None, bm, R), lambda i, j, b: (b, i // a_blocks, 0))]
        work = lengths_B.astype(jnp.int32)
    in_specs = [whole, whole, *q_specs, whole]
    args = [work, block_table_BP.astype(jnp.int32), q_lat_BMA, q_pe_BMR, pool_XpC]
    if flat:
        in_specs, args = [whole, *in_specs], [work, page_base_B.astype(jnp.int32), *args[1:]]
    if fuse:
        in_specs += [whole, whole]
        args += [new_BTC, positions_BT.astype(jnp.int32)]
    o, lse = pl.pallas_call(
        kernel,
        grid=(row_blocks * a_blocks, splits, B),
        in_specs=in_specs,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((B, splits, M, A), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, M), jnp.float32)],
        interpret=interpret,
        compiler_params=tile.compiler_params(config.num_warps, config.num_stages, interpret),
        name="mla_decode_paged",
    )(*args)
    return o, lse


# Candidate chunk sizes of the balanced schedule: the rows schedule's chunk times 2^(-i/16), i <
# _CHUNK_STEPS (steps of 4.4%, down to 1/1024 of it), rounded up to the quantum.
_CHUNK_STEPS = 160


def balanced_items(lengths_B, items: int, quantum: int):
    """The 'balanced' schedule: `items` work items (the kernel's B x splits programs) share the
    batch's cached tokens. Every item reads at most `chunk` tokens of ONE row, chunk a multiple of
    `quantum` (the kernel's tokens per step), the smallest candidate for which the rows' items
    ceil(len_b / chunk) fit in `items`. The rows schedule's chunk (ceil(max len / splits), rounded
    up) is a candidate, so no item is ever longer than under 'rows' and a batch of equal lengths gets
    the same chunks; a row of 128K among rows of 4K gets most of the items instead of 1 / B of them.
    Items go to rows in order (row b's items are contiguous, empty rows get none); unused items
    read nothing (row B - 1, start = end = 0). Returns int32 [5, items]: each item's row, start,
    end; then, in the first B entries (items >= B), each row's first item and item count (the
    combine's spans, `mla_combine.combine_items`)."""
    len_B = jnp.maximum(lengths_B.astype(jnp.int32), 0)
    B = len_B.shape[0]
    splits = max(1, items // B)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    rows_chunk = jnp.maximum(cdiv(cdiv(jnp.max(len_B), splits), quantum) * quantum, quantum)
    scale = 2.0 ** (-jnp.arange(_CHUNK_STEPS, dtype=jnp.float32) / 16)
    cand = jnp.ceil(rows_chunk.astype(jnp.float32) * scale / quantum).astype(jnp.int32) * quantum
    cand = jnp.maximum(cand, quantum).at[0].set(rows_chunk)
    need = cdiv(len_B[None, :], cand[:, None]).sum(axis=1)
    chunk = jnp.min(jnp.where(need <= items, cand, rows_chunk))
    n_B = cdiv(len_B, chunk)
    incl_B = jnp.cumsum(n_B)
    g = jnp.arange(items, dtype=jnp.int32)
    row = (incl_B[None, :] <= g[:, None]).sum(axis=1).astype(jnp.int32)
    used = row < B
    row = jnp.minimum(row, B - 1)
    start = (g - (incl_B - n_B)[row]) * chunk
    end = jnp.minimum(start + chunk, len_B[row])
    spans = jnp.zeros((2, items), jnp.int32).at[:, :B].set(jnp.stack([incl_B - n_B, n_B]))
    return jnp.concatenate([jnp.stack([row, jnp.where(used, start, 0), jnp.where(used, end, 0)]),
                            spans]).astype(jnp.int32)


def finish_items(o_BJMA, lse_BJM, work, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale, *,
                 interpret: bool, combine_xla_max_macs: int = 1 << 27, one_new_token_elementwise: bool = True):
    """`finish_xla` for the balanced schedule (`work`: the kernel's `balanced_items` table): the new
    tokens' part in XLA, the merge by `mla_combine.combine` (XLA up to `combine_xla_max_macs`
    multiply-adds, else one launch)."""
    B, T, N, A = q_lat_BTNA.shape
    I = o_BJMA.shape[0] * o_BJMA.shape[1]
    o_new_BTNA, lse_new_BTN = _new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                                              one_new_token_elementwise=one_new_token_elementwise)
    o, lse = mla_combine.combine(o_BJMA.reshape(I, T * N, A), lse_BJM.reshape(I, T * N), work,
                                 o_new_BTNA.reshape(B, T * N, A), lse_new_BTN.reshape(B, T * N),
                                 interpret=interpret, xla_max_macs=combine_xla_max_macs)
    return o.reshape(B, T, N, A), lse.reshape(B, T, N)


def _one_new_token_part(q_lat_B1NA, q_pe_B1NR, new_B1C, positions_B1, scale):
    """`_new_token_part` at T = 1. The new token is the query's only new key, so its softmax weight is
    exactly 1: the output is the token's latent c and the lse its score. The score is an elementwise
    product summed over the last axis in f32 (what the einsum computes; products of bf16 values are
    exact in f32): XLA fuses it with the combine's elementwise work instead of launching the general
    form's three small matmuls and its softmax ops (a few us per layer at any batch)."""
    B, _, N, A = q_lat_B1NA.shape
    f32 = jnp.float32
    new = new_B1C.astype(q_lat_B1NA.dtype).astype(f32)            # as the general form rounds it
    c_B1A, kr_B1R = new[..., :A], new[..., A:]
    s_B1N = (jnp.sum(q_lat_B1NA.astype(f32) * c_B1A[:, :, None, :], axis=-1)
             + jnp.sum(q_pe_B1NR.astype(f32) * kr_B1R[:, :, None, :], axis=-1)) * scale
    has_B1 = positions_B1 >= 0
    o_B1NA = jnp.where(has_B1[:, :, None, None], jnp.broadcast_to(c_B1A[:, :, None, :], (B, 1, N, A)), 0.0)
    return o_B1NA, jnp.where(has_B1[:, :, None], s_B1N, -jnp.inf)


def _new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale, *, one_new_token_elementwise: bool = True):
    """Scores of each query against the step's new tokens t' <= t (f32): output and lse [B, T, N].
    One new token per row (T = 1, every plain decode step) takes `_one_new_token_part` instead of the
    general einsum form unless `one_new_token_elementwise` is off (`kimi-bench mla
    --new_token_einsum` turns it off to time both)."""
    if q_lat_BTNA.shape[1] == 1 and one_new_token_elementwise:
        return _one_new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale)
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


def combine(o_BTNJA, lse_BTNJ, o_new_BTNA, lse_new_BTN):
    """Flash-decoding merge of J split outputs and the new-token part, each normalized over its own
    disjoint key set, by their log-sum-exps. Parts with lse = -inf contribute nothing; a row with no
    part at all gives o = 0 and lse = -inf (padding tokens)."""
    m = jnp.maximum(jnp.max(lse_BTNJ, axis=-1), lse_new_BTN)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_BTNJ = jnp.exp(lse_BTNJ - m[..., None])                     # 0 for empty parts
    w_new = jnp.exp(lse_new_BTN - m)
    den = w_BTNJ.sum(axis=-1) + w_new
    has = den > 0
    den = jnp.where(has, den, 1.0)
    o = ((w_BTNJ[..., None] * o_BTNJA).sum(axis=-2) + w_new[..., None] * o_new_BTNA) / den[..., None]
    return o, jnp.where(has, m + jnp.log(den), -jnp.inf)


def finish_xla(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale, *,
               new_tokens: bool = True, splits_minor: bool = False, one_new_token_elementwise: bool = True):
    """The XLA end of a decode step: the new tokens' part (unless the kernel took them: new_tokens
    False) merged with the J split partials o [B, J, M, A] f32 (splits_minor: [B, M, J, A]) and lse
    [B, J, M] over M = T * N rows. Returns o [B, T, N, A] f32 and lse [B, T, N]
    (`mla_finish.finish_partials` is the same in one Pallas launch)."""
    B, T, N, A = q_lat_BTNA.shape
    J = lse_BJM.shape[1]
    if splits_minor:
        o_BTNJA = o_BJMA.reshape(B, T, N, J, A)
    else:
        o_BTNJA = o_BJMA.reshape(B, J, T, N, A).transpose(0, 2, 3, 1, 4)
    lse_BTNJ = lse_BJM.reshape(B, J, T, N).transpose(0, 2, 3, 1)
    if new_tokens:
        o_new_BTNA, lse_new_BTN = _new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                                                  one_new_token_elementwise=one_new_token_elementwise)
    else:
        o_new_BTNA = jnp.zeros((B, T, N, A), jnp.float32)
        lse_new_BTN = jnp.full((B, T, N), -jnp.inf, jnp.float32)
    return combine(o_BTNJA, lse_BTNJ, o_new_BTNA, lse_new_BTN)


def finish(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale, *, kernel: bool,
           interpret: bool, new_tokens: bool = True, splits_minor: bool = False,
           one_new_token_elementwise: bool = True):
    """The end of a decode step for both decode kernels' wrappers: `mla_finish.finish_partials` (one
    launch) where `kernel` asks for it and it applies (the new tokens still to do, [B, J, M, A]
    partials, T <= mla_finish.MAX_NEW), else `finish_xla`. Returns o [B, T, N, A] (f32, or q's dtype
    from the kernel) and lse [B, T, N]."""
    if kernel and new_tokens and not splits_minor and mla_finish.supported(q_lat_BTNA.shape[1]):
        return mla_finish.finish_partials(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT,
                                          scale, interpret=interpret)
    return finish_xla(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                      new_tokens=new_tokens, splits_minor=splits_minor,
                      one_new_token_elementwise=one_new_token_elementwise)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_lse", "combine_xla_max_macs",
                                             "one_new_token_elementwise"))
def mla_paged_attention(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT,
                        scale: float, *, config: Optional[MlaDecodeConfig] = None,
                        interpret: Optional[bool] = None, return_lse: bool = False,
                        combine_xla_max_macs: int = 1 << 27, one_new_token_elementwise: bool = True):
    """Absorbed MLA over the paged cache plus the step's new tokens -> o_lat [B, T, N, A] (q's dtype).

    The contract of `kimi_jax.ops.mla_paged_attention`: row b's cached tokens are positions
    [0, positions[b, 0]) read through block_table (padding rows, positions < 0, read nothing); new
    token t also sees new tokens t' <= t with positions >= 0. Softmax in float32. `interpret=None`
    interprets on CPU. With return_lse, also the float32 log-sum-exp [B, T, N] (natural log).
    combine_xla_max_macs, one_new_token_elementwise: the XLA finish's thresholds (`finish_items`,
    `_new_token_part`).
    """
    _check(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT)
    interp = tile.resolve_interpret(interpret)
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    cfg = resolve_config(config, B, T * N, block_table_BP.shape[1] * pool_XpC.shape[1], A)
    lengths_B = jnp.maximum(positions_BT[:, 0], 0)
    work = (balanced_items(lengths_B, B * cfg.num_splits, cfg.block_k) if cfg.schedule == "balanced"
            else None)       # one table for the kernel and the combine
    o_BJMA, lse_BJM = mla_decode_partials(
        q_lat_BTNA.reshape(B, T * N, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, T * N, R),
        pool_XpC, block_table_BP, lengths_B, scale=scale, config=cfg, interpret=interp,
        new_BTC=new_BTC, positions_BT=positions_BT, work=work)
    if work is not None:
        o_BTNA, lse_BTN = finish_items(o_BJMA, lse_BJM, work, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT,
                                       scale, interpret=interp, combine_xla_max_macs=combine_xla_max_macs,
                                       one_new_token_elementwise=one_new_token_elementwise)
    elif cfg.fuse_new and cfg.num_splits == 1:   # one split saw every key: its output is the answer
        o_BTNA, lse_BTN = o_BJMA[:, 0].reshape(B, T, N, A), lse_BJM[:, 0].reshape(B, T, N)
    else:
        o_BTNA, lse_BTN = finish(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                                 kernel=cfg.finish == "kernel", interpret=interp, new_tokens=not cfg.fuse_new,
                                 one_new_token_elementwise=one_new_token_elementwise)
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


def make_case(key, lengths, *, heads=64, t=1, page=16, a=512, r=64, pages_per_row=None, extra_pages=3,
              dtype=jnp.bfloat16):
    """Random inputs with a shuffled block table (rows' pages interleaved in the pool)."""
    lengths = [int(x) for x in lengths]
    B = len(lengths)
    P = pages_per_row or max(1, -(-max(max(lengths), 1) // page))
    X = B * P + extra_pages
    ks = jax.random.split(key, 5)
    q_lat = jax.random.normal(ks[0], (B, t, heads, a), jnp.float32).astype(dtype)
    q_pe = jax.random.normal(ks[1], (B, t, heads, r), jnp.float32).astype(dtype)
    pool = jax.random.normal(ks[2], (X, page, a + r), jnp.float32).astype(dtype)
    new = jax.random.normal(ks[3], (B, t, a + r), jnp.float32).astype(dtype)
    perm = np.asarray(jax.random.permutation(ks[4], X))[:B * P]
    bt = jnp.asarray(perm.reshape(B, P), jnp.int32)
    pos = np.asarray(lengths)[:, None] + np.arange(t)[None, :]
    return q_lat, q_pe, new, pool, bt, jnp.asarray(pos, jnp.int32)
