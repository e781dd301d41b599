"""Absorbed MLA paged decode on Pallas **Mosaic GPU** (wgmma + TMA), for 64 query rows (H200 / sm_90).

Same contract as `mla_decode.mla_decode_partials` (flash-decoding partials), so `mla_decode.combine`
merges the splits: `mla_decode_partials_mgpu(q_lat [B, M, A], q_pe [B, M, R], pool [X, page, A+R],
block_table [B, P], lengths [B]) -> o [B, splits, M, A] f32 (each split normalized), lse [B, splits, M]
f32 (natural log, -inf for an empty split)`. `mla_paged_attention_mgpu` is the full op (cached tokens
here, the step's new tokens by `mla_decode._new_token_part`, merged by `combine`), a drop-in for
`mla_decode.mla_paged_attention`. Every version also runs on `schedule='balanced'` (`MgpuConfig`):
CTA (b, j) then reads work item b * splits + j of `mla_decode.balanced_items` (`_work_item`: its row's
queries, pages and token range) and `mla_combine` merges the items by row (BENCHMARKS.md MLA round 11).

Design (version 1: the simplest correct one; one warpgroup per CTA, no warp specialization)
-------------------------------------------------------------------------------------------
- Grid (row_blocks * halves, splits, B). One CTA = one warpgroup (128 threads) owning 64 query rows
  (T * N rows of one sequence, padded to a multiple of 64: the wgmma M), one split of the row's cached
  tokens, and `A / halves` latent output columns (halves = 2: a [64, 256] f32 accumulator = 128
  registers per thread; the whole [64, 512] would be 256, more than a thread has). Both halves of a
  (row block, split, b) compute the full scores (K = 576) and read the same pages (the second read is
  adjacent in the grid, mostly from L2). That duplicated QK^T is the price of the simple version:
  ~13.6 MFLOP of wgmma per 64-token tile instead of 8.9 (see "Next steps").
- Shared memory: Q [64, 576] bf16 (72 KB, TMA once), `stages` K/V tiles [block_k, 576] bf16 (72 KB each
  at block_k = 64) and P [64, block_k] bf16; all with the (8, 64) tiling + 128-byte swizzle wgmma wants.
  block_k = 64 with 2 stages is 224 KB of the 227 KB an H100/H200 CTA can have (1 CTA per SM);
  block_k = 32 with 3 stages is 184 KB.
- Page gather: each tile of block_k tokens is block_k / page TMA copies of whole pages ([page, 576] is
  contiguous in the pool), all arriving on the tile's barrier (num_arrivals = copies); page 64 with
  block_k 32 copies half a page. Tail tiles still copy every page (clamped to the split's last token:
  real cache data, finite) and mask the scores, so the barrier count never depends on the length.
- Pipeline: the prologue issues tiles 0..stages-1; step kb waits on its slot, computes
  S = Q K^T (wgmma, B = the tile transposed in shared memory), masks tokens >= end, online softmax in
  f32 with exp2 (scores pre-scaled by scale * log2 e), writes P (bf16) to shared memory, O += P C_half
  (wgmma; C_half = the tile's 256 latent columns of this half, N = 256), waits, then refills the slot
  with tile kb + stages. So one tile's TMA overlaps the other stages' compute; softmax and the two
  wgmmas of one tile are serialized within the warpgroup.
- Splits: as the Triton kernel: chunk_b = ceil(len_b / splits) rounded up to block_k, split j covers
  [j * chunk_b, min((j + 1) * chunk_b, len_b)); programs past the length write o = 0, lse = -inf.
  Auto splits fill the SMs once: floor(132 / (B * row_blocks * halves)), at least 1, at most
  ceil(max tokens / min_split_tokens).

What was verified on CPU (jax 0.10.2 here, and 0.11.2 in a scratch venv)
-----------------------------------------------------------------------
- The kernel BODY runs under the Mosaic GPU interpreter (`InterpretGPUParams`, private API: it simulates
  SMEM, TMA copies with their barriers, wgmma) and matches `mla_paged_attention_reference` on ragged
  rows (0, 1, page boundaries, multi-split), page 16 and 64, block_k 32 / 64, 64 and 128 rows
  (tests/test_mla_decode_mgpu.py). Two interpreter gaps of 0.10.2 are bridged only in interpret mode:
  `layout_cast` (a no-op there: the interpreter keeps values in logical layout) is skipped, and a
  transposed wgmma operand is supported by a wrapped interpreter callback (`_install_interpret_shims`;
  0.11.2's interpreter handles both natively).
- The GPU path (no interpret) TRACES and LOWERS to the Mosaic GPU MLIR for the cuda platform on CPU
  (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, Lane semantics, both jax versions):
  TMA descriptors / swizzle / tiling / wgmma shape checks happen in that Python lowering.
  The lowering also counts the CTA's shared memory against sm_90's 227 KiB (the CPU "device" has no
  `shared_memory_per_block_optin`), so a config that does not fit fails the lowering test.
- Version 2's barrier protocol under the interpreter's happens-before race detector
  (`interpret_params(detect_races=True)`, `races_found()`): no race (it does flag a mutant without
  the P-ready barrier, and found the shared epilogue's double lse store, now warpgroup 0's only).
GPU check + timing (one H200): `PYTHONPATH=. python -m pallas_kernels.mla.decode_mgpu
--out=$OUT/mgpu [--semantics=Warpgroup] [--cases=default|full|large] [--configs=k64,wg2s_k32s4,...]
[--budget_s=S]` (`check_and_time`: ragged correctness per config first, then the configs that passed
vs the Triton kernel at 64 heads; default cases B x context 1x32K, 8x32K, 64x4K, 64x32K (~150 s),
full = B in (1, 8, 64) x (4K, 32K, 128K), the acceptance grid (budget 220 s before the last case
starts), large = its four memory-bound cases; configs `default_configs()`: k64, wg2_k32s4, wg2s_k32s4
(+ _m256, _m1024, _bmsa, _fin, _bta_epv, _prod_epv), v5, v5_mtail (= SERVING_CONFIG); the measured
one-off variants of `variant_configs()` by name).
Verified on an H200 (jax 0.11.2, Lane): versions 1 and 1b compile, pass the checks, and time as in
the version 2 notes below. Unverified until a GPU run: version 2 (compilation, barrier phases on
hardware, registers, speed).

Interpreter runs outside the test suite: run them with the suite's
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (tests/conftest.py). With the default single CPU
device on a 2-core machine the two-warpgroup kernels deadlocked the interpreter in 3 of 4 runs
(seventh session, jax 0.10.2 and 0.11.2, plain version 2 as well as the new options): one warpgroup's
barrier-wait callback blocks while the other warpgroup's XLA execution makes no progress (a host
thread pool too small for the blocked callbacks, by the stacks); with 8 devices 5 of 5 runs finished.

Known limitations
-----------------
- bf16 only (cache and queries), A a multiple of 256 (halves of 256 columns), R = 64 (so C = A + R is
  a multiple of 64), page size a multiple of 8 that divides or is a multiple of block_k, query rows
  padded to a multiple of 64 (8 heads x T = 1 would do 8x the MMA work: use the Triton kernel there).
- The interpreter does not model asynchrony (wgmma / TMA complete at once), so a missing wait would not
  show on CPU.
- Lane lowering semantics are requested explicitly (`lowering_semantics`, the 0.10 default; 0.11
  defaults to Warpgroup). Both lower on CPU; the GPU run may pick either (`--semantics`).

Variant `warpgroups=2` (version 1b)
-----------------------------------
The two halves become the 2 warpgroups of ONE CTA (grid (row_blocks, splits, B), num_threads=2):
shared Q and K buffers (each page read once), warpgroup 0 issues all TMA copies, each warpgroup still
computes the full S (duplicated QK^T) and writes its own P buffer; a per-slot "consumed" barrier
(2 arrivals, one per warpgroup after its P @ C wgmma completed) gates the leader's refill; after the
loop the leader drains the last releases and both meet on a "done" barrier before the epilogue reuses
the tiles' shared memory. Needs block_k = 32 (Q 72 KB + 3-4 stages x 36 KB + 2 P buffers). While one
warpgroup does its softmax the other can use the tensor cores. Same CPU verification as version 1.

Version 2: `split_s=True` ("split S", FlashMLA-style; warpgroups=2, block_k=32, stages=4)
---------------------------------------------------------------------------------------------
Why: on the H200 (jax 0.11.2, 64 heads, page 16) version 1b (wg2_k32s4) reached 64.8% of copy at
64 x 32K (914 us) and 47-49% at 8 x 32K / 64 x 4K; it did 447 GFLOP there (QK^T twice, once per
output half) = 489 TFLOP/s: tensor-core bound. Without the duplication the work is 292 GFLOP.
What (`_kernel_split_s`): grid (row_blocks, splits, B), 2 warpgroups per CTA; the split's tiles of
32 tokens go in pairs. Per pair i, warpgroup h (0, 1) waits for tile 2i + h, computes S_h = Q tile^T
[64, 32] (K = 576), scales / masks it and m_loc = max(m, rowmax S_h); both exchange m_loc through a
[2, 64] f32 shared buffer x (x[h] = m_loc, commit_smem, arrive + wait on x_bar, read x[1 - h]) so both
hold the same m_new and corr; p_h = 2^(S_h - m_new) -> P[h] (bf16 [64, 32]), l_h = l_h corr + rowsum,
acc_h *= corr; arrive + wait on p_bar; then acc_h += P[0] tile_2i[:, cols_h] + P[1] tile_2i+1[:, cols_h]
(two wgmmas, K = 32; cols_h = this warpgroup's 256 latent columns); release the pair (consumed[pair
slot], 2 arrivals) and warpgroup 0 (the TMA issuer) refills both slots with pair i + 2. After the loop
l = l_0 + l_1 through x once more; same partials contract. Splits cover whole pairs (chunk rounded up
to 64 tokens); an odd tile count (the row's last split) pads the last pair with a tile that starts
past the end: `_issue_tile` clamps its copies to the split's last real page (finite data), its scores
are all masked, p = 0 (no uninitialized shared memory is ever multiplied). Auto splits: one CTA per
(row block, split, b): floor(132 / (B * row_blocks)) capped by ceil(tokens / min_split_tokens),
min_split_tokens = 512 by default for this variant: each split writes 64 x 512 f32 = 128 KiB of o
(read back by the combine) vs 1152 B per cached token, so 256-token splits would add ~43% write
traffic (87% with the combine's read); `wg2s_k32s4_m256` / `_m1024` in the sweep compare.
Shared memory (the lowering's count): Q 72 KiB + 4 tiles x 36 KiB + P 2 x 4 KiB + x (512 B, in a
1 KiB allocation) + Mosaic's reduction scratch cut from 2 KiB to 1 KiB (`reduction_scratch_bytes`; the
row reductions of WGMMA-layout values stay inside a warp and use none) + 9 barriers = 231,496 B of
232,448 (with the default 2 KiB scratch it would be 232,520: too much).
Barriers (x_bar, p_bar, consumed: 2 arrivals = one per warpgroup; in Lane semantics Pallas scales a
barrier's count by 128 and every thread arrives once, so `barrier_arrive` from a warpgroup is one
arrival; `barrier_wait` keeps a per-thread phase bit per barrier, flipped at each wait, so a thread
must wait on every phase of a barrier it waits on, and mbarrier parity waits cannot tell phase k from
k + 2):
- x[h] is rewritten (pair i + 1, or the final l exchange) only after this warpgroup passed p_bar of
  pair i, which needs the other's p_bar arrival, which follows its read of x[h] in program order.
- P[h] is rewritten at pair i + 1 only after passing x_bar of pair i + 1, which needs the other's
  arrival there, which follows its pair-i P @ C wgmmas and their wait (run_state), the last reads of
  P[h]; this warpgroup's own wgmmas were waited before too.
- x_bar and p_bar alternate (x, p, x, p, ... per pair): a warpgroup arrives on one only after passing
  the other, which needs the other warpgroup's arrival, so neither can arrive twice on a barrier
  before the other waited on the pending phase: no phase is skipped; both wait on every phase.
- Tile slots: the refill of a pair slot waits for consumed (both warpgroups' P @ C of that pair
  done); each tile barrier completes once per use and both warpgroups wait on both tiles of every
  pair (the other's tile: already complete, waited for the parity bits and so that each warpgroup
  observes the TMA's writes itself); the leader drains the last consumed phases after the loop.
- End: the l exchange puts both warpgroups past their loops, and one more p_bar round makes sure both
  read x before the epilogue's o / lse staging reuses the loop's shared memory.
Expected: the tensor-core time at 64 x 32K drops from ~914 us to ~600 us (292 GFLOP at the ~490
TFLOP/s seen), about the copy time of the 2.4 GB of cache (592 us); but the two warpgroups now run in
lockstep (S, exchange, softmax, P @ C), so one's softmax no longer overlaps the other's MMA as in 1b.
Unverified until the GPU run: compile, phases on hardware, speed.

Version 3 (`seesaw`: FlashMLA's seesaw schedule on version 2's pairs, the two warpgroups in different
loops) was slower than version 2 at every memory-bound case (BENCHMARKS.md MLA round 5: 77% vs 85% of
copy at 64 x 32K) and was removed in the eighteenth session (commit 08435da has it and its design).

Option `o_bmsa=True` (any variant; config `wg2s_k32s4_bmsa`)
-------------------------------------------------------------
The kernel writes o as [B, M, splits, A] instead of [B, splits, M, A]: each CTA's [64, 256] f32
block goes to rows strided by splits * A * 4 bytes (same TMA box, other strides), and
`mla_paged_attention_mgpu` reshapes it to the combine's [B, T, N, K, A] without a transpose (with
the default layout XLA may materialize a transposed copy of o: up to 128 KiB per split and row block
written and read once more). lse stays [B, splits, M] (a TMA store of a 64-float column with a
splits-float stride is not expressible: the innermost dimension must be contiguous and >= 16 B); its
transpose is B * splits * M * 4 bytes, negligible. CPU: interpreter (version 2 + o_bmsa, 2 splits both
holding data, rows padded 8 -> 64) and cuda lowering in both semantics. To measure on the GPU:
whether XLA fused the transpose into the combine anyway (then no gain).

Version 2 options `bt_ahead`, `early_pv` (SERVING_V2: sessions 7-16's serving config), `l2_prefetch`
----------------------------------------------------------------------------------------------------
What bounds version 2 at 64 heads (H200, jax 0.11.2, 2026-11-30; BENCHMARKS.md "MLA round 10"):
- Pipeline depth: one pair of tiles in flight (`stages=2`) streams at 41-44% of copy, two pairs (the
  default 4 stages) at 73-88%: twice the bytes in flight, twice the speed. Q (72 KiB) and 4 tiles of
  36 KiB fill the 227 KiB, so a third pair does not fit. 16-token tiles (8 or 6 stages: 4 or 3
  pairs of the same bytes) are slower (55-61%): S = Q K^T with N = 16 re-reads Q from shared memory
  per 16 tokens instead of 32.
- Ablations (`pallas_kernels/mla/ablate.py`: the same kernel with one piece removed, timing only):
  with NO wgmma at all (neither S nor P @ C) the kernel is no faster than the full one (~85% of copy):
  the tile pipeline and the per-pair handshakes, not the tensor cores, set the pace. Removing the
  max exchange and the P exchange barriers saved ~10%, the accumulator rescale ~4-6%, the
  block-table loads before each refill ~5%, the mask ~2-4%.
- `l2_prefetch` (TMA prefetch of the pair d pairs past each one issued into L2, no shared memory):
  slower at every case (d = 1, 2: 66-69% vs 73-81%; d = 4: 51-56%): not used. A page is prefetched
  as 3 boxes of [rows, 192] (a TMA box is <= 256 per dimension).
- `bt_ahead` (the next refill's page ids loaded at the top of each step and carried in registers)
  plus `early_pv` (the own tile's P @ C issued before the P exchange wait): in 4 processes on two
  machines, 1-4% faster than plain version 2 at 64 x 32K, 8 x 128K and (3 of 4) 64 x 128K; each
  alone within noise. SERVING_V2 took both.

Version 2 option `producer` (SERVING_PRODUCER, the seventeenth session's serving config)
---------------------------------------------------------------------------------------
A third warpgroup (h = 2; `num_threads=3`) does all the TMA: Q, the first pairs, and the refill of a
pair slot as soon as both computing warpgroups released it (it waits the 2-arrival consumed barrier,
every phase, then issues the pair two ahead; it reads the block table itself, so bt_ahead does not
apply). The computing warpgroups run version 2's loop without the refill, so warpgroup 0 no longer
waits at the end of every pair for warpgroup 1's P @ C and then issues the copies on its own path.
Registers: `plgpu.set_max_registers` (setmaxnreg) 40 for the producer, 232 for the two others (384
threads start at 168; ptxas: 168, no spill). The epilogue runs inside the computing branch (values do not
leave a `pl.when`), staging o / lse in buffers that share the loop's shared memory through
`plgpu.RefUnion` (the l exchange's last barrier round puts both computing warpgroups past their loop
reads; the producer's last copy was waited by them). In interpret mode the staging is separate
buffers (the 0.10.2 interpreter has no aliased refs). Measured (BENCHMARKS.md MLA round 20): 1-2%
faster at 64 x 32K and 8 x 128K in two runs, mixed at 64 x 128K (power-capped), ties below.

Version 5: `one_scorer=True` (on the producer; SERVING_CONFIG since the eighteenth session)
-----------------------------------------------------------------------------------------
`mla_decode_v5.py` (its docstring has the design and the barrier argument): warpgroup 0 scores each
pair of 32-token tiles as one N = 64 wgmma and does the whole softmax; warpgroup 1 takes P and the max
correction from shared memory; each accumulates P @ C for its 256 latent columns. It halves the
shared-memory reads of Q that made version 2's N = 32 scoring bandwidth-bound: 92-103% of copy at the
memory-bound 64-head cases, 8.5-21% faster than version 2 + producer (BENCHMARKS.md MLA round 21). The
"Next steps" below were written for version 2; NOTES.md (eighteenth session) has what is left.

Next steps (performance; in order)
---------------------------------
0. Find which half of the measured bound it is: `mla_ablate`'s `pipeline_only` variant (no wgmma
   and no exchanges: only the tile waits and refills) is untimed. If it streams near the copy, the
   per-pair handshakes are the cost (fewer, or overlapped with the next pair's S); if it stays near
   85%, the pair-granular refill is (tiles released one at a time, or a 2-CTA cluster splitting the
   576 columns: Q 40 / 32 KiB per SM instead of 72, ~20% more tile bytes in flight, partial scores
   summed through distributed shared memory; the Mosaic GPU interpreter does not model clusters).
1. (Done as version 2, pending the GPU numbers.) Stop duplicating QK^T.
2. (Tried as version 3 `seesaw`: slower, removed.) Overlap one warpgroup's softmax with the
   other's P @ C. If it helps: skip the accumulator rescale when the row max did not move (a warp
   vote on the factor), issue the next pair's S wgmma before waiting bar_B in warpgroup 0 (a second
   S accumulator), and a producer warpgroup for the TMA (emit_pipeline_warp_specialized).
3. Mask only the last tile (the [64, block_k] int32 iota costs registers every step).
4. B = 1: the partials (128 KiB of f32 o per split) cost as much as ~230 cached tokens; bf16 o or a
   fused combine (last CTA of a row merges) would allow more, shorter splits.
5. (Ninth session, not built.) Every large 64-head case runs 128 CTAs on the 132 SMs: the rows
   schedule gives each of B rows floor(132 / B) splits (B = 8: 16, B = 64: 2), and the balanced
   schedule cannot do better with one row per CTA (8 equal rows over 132 CTAs: some row still has
   16 items of 8K tokens; 64 rows of 32K: 4 items of 8K each). The ablation's no-P @ C variant
   streams at the copy's speed on the same 128 CTAs, so the kernel is bound per SM, not by HBM, and
   the 4 idle SMs are ~3% of every large case (8 x 128K read 83.7% of copy in round 11, 1.3 points
   short). Recovering them needs CTAs that run up to two segments of different rows in turn
   (FlashMLA's tile-scheduler metadata): CTA c takes tokens [c S, (c + 1) S) of the rows laid end
   to end (S = total / 132, whole pairs), i.e. the tail of one row and the head of the next; its
   segments write items c + (crossings before c) and the next one, so a row's items stay contiguous
   for `mla_combine` (G = 132 + B items, the tail unused and never read, so never written). Rows
   shorter than S would need more than two segments: then the table falls back to balanced_items.
   Kernel side: a second pass of the pair loop after the first segment's epilogue (Q of the next
   row, its first pairs; the tile barriers' phases run on, the staging's TMA store waited before Q
   is overwritten). Expected, worked out with such a table (built and checked off-GPU, then
   dropped): shares are whole pairs, so the longest CTA gets ceil(pairs / 132) pairs: 8 x 128K 125
   instead of 128 (2.4%), 64 x 32K 249 instead of 256 (2.8%), 64 x 4K 32 either way (nothing); less
   a second prologue and epilogue in every CTA that crosses a row (the slowest CTAs: 67 of 132 at
   64 x 32K) and the items' merge (the combine kernel, ~9-13 us, against ~5 us of XLA for the rows
   schedule's): ~0.5-1% at 8 x 128K, ~2% at 64 x 32K. Not worth the kernel change by itself.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # the Mosaic GPU Pallas frontend (jax >= 0.5); its API moves between versions (see NOTES.md)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from pallas_kernels.mla import decode as tri
from pallas_kernels.mla import finish as mla_finish


def _load_needs_idx() -> bool:
    import inspect
    try:
        p = inspect.signature(plgpu.load).parameters.get("idx")
    except (AttributeError, TypeError, ValueError):
        return True
    return p is not None and p.default is inspect.Parameter.empty


_LOAD_NEEDS_IDX = plgpu is not None and _load_needs_idx()

_NEG = -1e30
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
NUM_SMS = 132
_SMEM_LIMIT = 227 * 1024          # max dynamic shared memory per CTA on sm_90 (232,448 B)
_SMEM_RESERVED = 2048 + 512       # Mosaic's reduction scratch (CompilerParams default) + barriers
_ROWS = 64                        # wgmma M: query rows per CTA
_TMA_BOX_MAX = 256                # elements per dimension of one TMA box


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    block_k: int = 64             # tokens per tile (wgmma N of S, K of P @ C)
    stages: int = 0               # 0: as many tiles as fit in shared memory (2 at 64, 3-4 at 32)
    halves: int = 2               # CTAs splitting the A latent output columns (A / halves <= 256)
    warpgroups: int = 1           # 2: the two halves are 2 warpgroups of one CTA (shared pages)
    split_s: bool = False         # version 2 (warpgroups=2): each warpgroup scores one tile of a
    #                               pair (no duplicated QK^T), row maxima exchanged through smem
    o_bmsa: bool = False          # partials o as [B, M, splits, A] (the combine's order: no
    #                               transpose before it) instead of [B, splits, M, A]
    num_splits: int = 0           # 0: auto (fill the SMs `waves` times)
    waves: int = 1                # auto splits: CTAs for this many rounds of one CTA per SM. 2 at batch
    #                               8: 33 splits = 264 CTAs on the 132 SMs instead of 16 = 128 (4 SMs
    #                               idle), at the cost of a second prologue / epilogue per SM (a sweep
    #                               candidate; see "Next steps" 5)
    min_split_tokens: int = 0     # auto splits: at least this many tokens per split (0: 512 for
    #                               split_s, where the partials cost matters most, else 256)
    semantics: str = "Lane"       # Mosaic GPU lowering semantics ("Lane" or "Warpgroup")
    l2_prefetch: int = 0          # split_s (versions 2, 3): also prefetch the pair this many pairs
    #                               past each one issued into L2 (TMA prefetch: more bytes in flight
    #                               than the shared-memory slots hold; 0: off)
    bt_ahead: bool = False        # version 2: block-table entries read one step ahead (carried)
    early_pv: bool = False        # version 2: own-tile P @ C issued before the P exchange wait
    mask_tail_only: bool = False  # version 2: scores masked only in tiles that reach past the split's end
    producer: bool = False        # version 2: a third warpgroup issues the TMA (setmaxnreg 40 / 232)
    one_scorer: bool = False      # version 5 (mla_decode_v5.py; producer): warpgroup 0 scores each
    #                               pair as one N = 2 block_k wgmma, both accumulate P @ C halves
    finish: str = "xla"           # new tokens + combine: 'xla' or 'kernel' (mla_finish.finish_partials,
    #                               one Triton launch; [B, splits, M, A] partials only, not o_bmsa)
    schedule: str = "rows"        # 'rows' or 'balanced' (mla_decode.MlaDecodeConfig.schedule)

    def __post_init__(self):
        if self.l2_prefetch < 0:
            raise ValueError(f"MgpuConfig.l2_prefetch={self.l2_prefetch} must be >= 0")
        if self.finish not in mla_finish.FINISHES:
            raise ValueError(f"MgpuConfig.finish={self.finish!r} not in {mla_finish.FINISHES}")
        tri.check_schedule("MgpuConfig", self.schedule, self.finish, o_bmsa=self.o_bmsa)


# split_s: Mosaic's cross-warp reduction scratch (CompilerParams.reduction_scratch_bytes, default
# 2048) is cut to 1024 to make room for the [2, 64] f32 max / sum exchange buffer (512 B, allocated
# in 1024 B units): the row reductions of a WGMMA-layout array stay within a warp and use none.
_SPLIT_S_REDUCTION_SCRATCH = 1024
# producer (version 2 option): registers per thread of the TMA warpgroup and of the two computing ones
# (setmaxnreg; 384 threads start at 65536 / 384 = 170; 40 + 2 x 232 = 504 <= 512 per lane of 128)
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232


def _smem_bytes(block_k: int, stages: int, c: int, dtype_bytes: int = 2, wgs: int = 1,
                split_s: bool = False) -> int:
    """Shared memory of one CTA: Q, the K tiles, P, Mosaic's reserve (the epilogue's o / lse
    staging reuses the loop's space; checked against the lowering's estimate: 231,424 B of scratch at
    block_k 64 x 2 stages, plus the barriers). Each allocation is rounded up to 1 KiB by Mosaic.
    split_s adds the exchange buffer (1 KiB) and takes 1 KiB off the reduction scratch."""
    n = (_ROWS * c + stages * block_k * c + wgs * _ROWS * block_k) * dtype_bytes + _SMEM_RESERVED
    if split_s:
        n += 1024 - (2048 - _SPLIT_S_REDUCTION_SCRATCH)
    return n


def _quantum(cfg: MgpuConfig) -> int:
    """Tokens a split's length is rounded to: whole pairs of tiles (split_s) or whole tiles."""
    return 2 * cfg.block_k if cfg.split_s else cfg.block_k


def _balanced_work(lengths_B, cfg: MgpuConfig):
    """The balanced schedule's work table for a resolved config (one item per CTA slot (b, j))."""
    return tri.balanced_items(lengths_B, lengths_B.shape[0] * cfg.num_splits, _quantum(cfg))


def _default_min_split_tokens(cfg: MgpuConfig) -> int:
    return cfg.min_split_tokens or (512 if cfg.split_s else 256)


def resolve_config(cfg: Optional[MgpuConfig], batch: int, rows: int, max_tokens: int,
                   c: int = 576) -> MgpuConfig:
    cfg = cfg or MgpuConfig()
    stages = cfg.stages
    if not stages:
        stages = 2
        while (_smem_bytes(cfg.block_k, stages + 1, c, wgs=cfg.warpgroups, split_s=cfg.split_s)
               <= _SMEM_LIMIT and stages < 4):
            stages += 1
        if cfg.split_s:
            stages -= stages % 2          # whole pairs of tiles
    splits = cfg.num_splits
    if not splits:
        ctas = batch * (-(-rows // _ROWS)) * (cfg.halves if cfg.warpgroups == 1 else 1)
        slots = NUM_SMS * max(1, cfg.waves)
        splits = max(1, min(slots // ctas if ctas < slots else 1,
                            -(-max_tokens // _default_min_split_tokens(cfg))))
    return dataclasses.replace(cfg, stages=stages, num_splits=splits)


# ----------------------------------------------------------------------------------------------
# Interpret-mode support (CPU tests).

def interpret_params(**kw):
    """The Mosaic GPU interpreter's parameters (private path in jax 0.10-0.11), or None. `kw`: its
    fields, e.g. detect_races=True (a happens-before race detector over the simulated shared
    memory: cross-warpgroup buffer reuse without a barrier shows up as "RACE DETECTED";
    `races_found()` afterwards)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    _install_interpret_shims()
    return InterpretGPUParams(**kw)


def races_found() -> Optional[bool]:
    """After an interpret run with detect_races=True: whether the detector found a race (None if
    this jax has no such state)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        return bool(gc.get_races().races_found)
    except (ImportError, AttributeError, AssertionError):
        return None


def _install_interpret_shims():
    """jax 0.10.2's GPU interpreter reads wgmma operands through NDIndexer transforms only, so a
    transposed B (`ref.transpose((1, 0))`) fails ("'TransposeTransform' object has no attribute
    'indices'"). Wrap its wgmma callback to strip trailing transposes and apply them to the operand
    it read. Only touches the interpreter; newer versions (0.11.2 handles transposes) are left alone."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.pallas.mosaic.interpret import utils as iu
        from jax._src.state import types as st
    except ImportError:
        return
    orig = gc.wgmma
    if getattr(orig, "_mla_mgpu_shim", False):
        return
    import inspect
    params = inspect.signature(orig).parameters
    if "device_id" not in params or "acc_dtype" not in params or not hasattr(iu, "to_range"):
        return   # another interpreter version: assume it handles transposed operands

    def split(transforms):
        transforms = tuple(gc._remove_noop_transforms(transforms))
        perm = None
        while transforms and isinstance(transforms[-1], st.TransposeTransform):
            p = tuple(transforms[-1].permutation)
            perm = p if perm is None else tuple(p[i] for i in perm)
            transforms = transforms[:-1]
        return jax.tree.map(int, transforms), perm

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
              acc_transforms, acc_dtype, a_allocation_key_as_array, a_transforms,
              b_allocation_key_as_array, b_transforms, source_info=None):
        mem = gc._get_shared_memory()
        gtid = mem.get_global_thread_id(int(device_id), int(thread_id))
        info = iu.GPULoggingInfo(device_id=int(device_id),
                                 grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                 thread_id=int(thread_id), source_info=source_info)

        def read(key, transforms):
            transforms, perm = split(transforms)
            x, _, _ = mem.get_buffer_content(gc.HostAllocationKey.from_array(key),
                                             iu.to_range(transforms), gtid, logging_info=info)
            return x if perm is None else np.transpose(x, perm)

        a = read(a_allocation_key_as_array, a_transforms)
        b = read(b_allocation_key_as_array, b_transforms)
        acc_t, _ = split(acc_transforms)
        key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
        rng = iu.to_range(acc_t)
        acc, _, _ = mem.get_buffer_content(key, rng, gtid, logging_info=info)
        mem.store_buffer_content(key, rng, acc + np.matmul(a, b, dtype=acc_dtype), gtid,
                                 logging_info=info)
        return token

    wgmma._mla_mgpu_shim = True
    gc.wgmma = wgmma


# ----------------------------------------------------------------------------------------------
# The kernel.

def _tile_positions(page: int, base, end, bk: int):
    """The first cached position of each page copy of the `bk` tokens [base, base + bk): bk / page
    whole pages, or one part of a page when page > bk. Positions at or past `end` re-read the split's
    last real tokens (clamped to end - 1: finite cache data, never an index past the row's block
    table; their scores are masked), so the copy count never depends on the length; and to >= 0, so a
    look-ahead past an empty split still reads a valid block-table entry. A tile that starts past
    `end` (version 2's padding tile of an odd tile count) becomes a copy of the split's last page."""
    return [jnp.maximum(jnp.minimum(base + i * page, end - 1), 0)
            for i in range(max(1, bk // page))]


def _tile_page_ids(bt_ref, page: int, b, base, end, bk: int):
    """The pool pages (block-table entries of row b) of the tile's copies."""
    return tuple(bt_ref[b, pos // page] for pos in _tile_positions(page, base, end, bk))


def _tile_copies(bt_ref, pool_ref, b, base, end, bk: int, pgs=None):
    """The page copies of the tile [base, base + bk) of row b: [(source ref in the pool, destination
    rows of the [bk, C] tile or None for all)]; `pgs`: its page ids if already loaded
    (`_tile_page_ids`), else read from the block table here."""
    page = pool_ref.shape[1]
    pos = _tile_positions(page, base, end, bk)
    if pgs is None:
        pgs = _tile_page_ids(bt_ref, page, b, base, end, bk)
    if page <= bk:
        return [(pool_ref.at[pg], pl.ds(i * page, page)) for i, pg in enumerate(pgs)]
    off = pl.multiple_of(pos[0] % page // bk * bk, bk)
    return [(pool_ref.at[pgs[0], pl.ds(off, bk)], None)]


def _issue_tile(bt_ref, pool_ref, b, base, end, bk: int, dst, bar, pgs=None):
    """TMA the tile's page copies (`_tile_copies`) into dst [bk, C], all arriving on `bar` (so the
    barrier's arrival count never depends on the length)."""
    for src, rows in _tile_copies(bt_ref, pool_ref, b, base, end, bk, pgs):
        plgpu.copy_gmem_to_smem(src, dst if rows is None else dst.at[rows], bar)


def _prefetch_tile(bt_ref, pool_ref, b, base, end, bk: int):
    """L2 prefetch (TMA; no shared memory, no barrier) of the pages `_issue_tile` would copy for the
    same tile: a hint only, so the values and the barrier protocol are the same with or without it.
    The Mosaic GPU interpreter has no rule for it: the kernels drop it there (`prefetch=0`). One
    prefetch is one TMA box, whose every dimension must be <= 256 (the GPU run rejected a [16, 576]
    box: "Window shape must be in [0, 256]"), so a page goes as equal column parts."""
    c = pool_ref.shape[-1]
    parts = -(-c // _TMA_BOX_MAX)
    while c % parts:
        parts += 1
    w = c // parts                          # 576 -> 3 boxes of 192 columns (a TMA box is <= 256)
    for src, _ in _tile_copies(bt_ref, pool_ref, b, base, end, bk):
        for k in range(parts):
            plgpu.async_prefetch(src.at[:, pl.ds(k * w, w)])


def _lc(x, layout, interpret: bool):
    """layout_cast, a no-op in the interpreter (0.10.2 lacks an impl for it)."""
    return x if interpret else plgpu.layout_cast(x, layout)


_ROW_LAYOUT = None if plgpu is None else plgpu.Layout.WGMMA.reduce(1)


def _load_rows(ref, interpret: bool):
    """[64] f32 from shared memory, in the WGMMA row layout."""
    if interpret:
        return ref[...]
    idx = [()] if _LOAD_NEEDS_IDX else []          # 0.10: load(ref, idx, ...); 0.11: no idx
    return plgpu.load(ref, *idx, layout=_ROW_LAYOUT, optimized=False)


def _tiled(bk: int):
    """Shared-memory transforms of Q, the tiles and P: wgmma wants both operands with the same
    swizzle, and P [64, bk] allows 2 * bk bytes per row."""
    swz = min(128, 2 * bk)
    return (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))


def _split_range(len_ref, b, j, splits: int, quantum: int):
    """Split j of row b: [start, end) of its cached tokens, chunks rounded up to `quantum` tokens."""
    length = len_ref[b]
    chunk = ((length + splits - 1) // splits + quantum - 1) // quantum * quantum
    start = j * chunk
    return start, jnp.minimum(start + chunk, length)


def _work_item(len_ref, b, j, splits: int, quantum: int):
    """Program (b, j)'s work: (the row it reads, start, end). len_ref is the lengths [B] (schedule
    'rows': split j of row b) or the balanced work table [5, B * splits] (item b * splits + j,
    `mla_decode.balanced_items`). The partials slot stays (b, j) either way."""
    if len(len_ref.shape) == 2:
        g = b * splits + j
        return len_ref[0, g], len_ref[1, g], len_ref[2, g]
    return (b, *_split_range(len_ref, b, j, splits, quantum))


def _init_carry(bn: int, interpret: bool):
    """(acc [64, bn], running max m [64], row sum l [64]) before the first tile."""
    return (_lc(jnp.zeros((_ROWS, bn), jnp.float32), plgpu.Layout.WGMMA, interpret),
            _lc(jnp.full((_ROWS,), _NEG, jnp.float32), _ROW_LAYOUT, interpret),
            _lc(jnp.zeros((_ROWS,), jnp.float32), _ROW_LAYOUT, interpret))


def _scores(q_smem, tile, valid, qk_scale: float, interpret: bool, mask_tail_only: bool = False):
    """S = Q tile^T [64, bk] f32 (wgmma, K = C), scaled (log2 units); tokens >= `valid` masked.
    mask_tail_only: the mask (an iota, a compare and a select per score) only where the tile reaches
    past the end (valid < bk: the split's last tile, or a padding tile), a branch elsewhere."""
    bk = tile.shape[0]

    def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, tile.transpose((1, 0)))
        return s_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bk), jnp.float32)) * qk_scale

    def masked(s):
        tok = _lc(lax.broadcasted_iota(jnp.int32, (_ROWS, bk), 1), plgpu.Layout.WGMMA, interpret)
        return jnp.where(tok < valid, s, _NEG)
    if not mask_tail_only:
        return masked(s)
    return lax.cond(valid >= bk, lambda s: s, masked, s)


def _accumulate(acc, operands, interpret: bool):
    """acc + sum of P @ C over operands() = [(P ref [64, bk], C ref [bk, bn]), ...] (an item may
    instead be a callable, called in order between the wgmma issues); waits for the wgmmas (so their
    shared memory is free afterwards). `operands` is called inside the scope: a ref
    sliced by a literal index outside it comes back from run_state's lowering as a Python int, which
    Warpgroup semantics rejects."""
    def issue(acc_ref):
        for item in operands():
            if callable(item):   # e.g. a barrier between the wgmmas (version 2's early_pv)
                item()
            else:
                plgpu.wgmma(acc_ref, *item)

    if interpret:   # the interpreters (0.10.2, 0.11.2) lack run_state: same sum, two steps
        def f(acc_ref):
            issue(acc_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

    return pl.run_state(issue)(plgpu.ACC.init(acc))   # in place (no second [64, bn] f32 in registers)


def _pair_scratch(c: int, dt, bk: int, stages: int, page: int):
    """The shared memory and barriers version 2 (and its ablations) start with: Q, the tiles, P [2, 64,
    bk] (one per warpgroup), x [2, 64] f32 (one exchanged row vector per warpgroup), one barrier per
    tile slot, Q's barrier, and one 2-arrival "consumed" barrier per pair slot."""
    tiled = _tiled(bk)
    return (plgpu.SMEM((_ROWS, c), dt, transforms=tiled),
            plgpu.SMEM((stages, bk, c), dt, transforms=tiled),
            plgpu.SMEM((2, _ROWS, bk), dt, transforms=tiled),
            plgpu.SMEM((2, _ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=max(1, bk // page), num_barriers=stages),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages // 2))


def _pair_page_ids(bt_ref, page: int, b, start, end, bk: int, i):
    """The page ids of pair i's two tiles (read ahead of its `_issue_pair` with `bt_ahead`)."""
    return tuple(_tile_page_ids(bt_ref, page, b, start + (2 * i + u) * bk, end, bk) for u in range(2))


def _issue_pair(bt_ref, pool_ref, b, start, end, bk: int, prefetch: int, n_pairs, k_smem, k_bars,
                i, ps, pgs=None):
    """TMA tiles 2i and 2i + 1 of the split into pair slot ps (tile slots 2 ps, 2 ps + 1). The padding
    tile of an odd tile count (2i + 1 == n_tiles) is clamped to the split's last page: finite, masked,
    p = 0. prefetch > 0: also an L2 prefetch of pair i + prefetch if the split has it (every pair
    from `prefetch` on is prefetched once, `prefetch` pairs before its copy is issued). pgs: the
    pair's page ids (`_pair_page_ids`) if already loaded."""
    for u in range(2):
        slot = 2 * ps + u
        _issue_tile(bt_ref, pool_ref, b, start + (2 * i + u) * bk, end, bk, k_smem.at[slot],
                    k_bars.at[slot], None if pgs is None else pgs[u])
    if prefetch:
        @pl.when(i + prefetch < n_pairs)
        def _():
            for u in range(2):
                _prefetch_tile(bt_ref, pool_ref, b, start + (2 * (i + prefetch) + u) * bk, end, bk)


def _kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, stages: int, splits: int,
            halves: int, qk_scale: float, interpret: bool, two_wg: bool, o_bmsa: bool = False):
    """len [B] i32, bt [B, P] i32, q [B, Mp, C] bf16 (latent | rope), pool [X, page, C] bf16 ->
    o [B, splits, Mp, A] f32, lse [B, splits, Mp] f32.

    two_wg: the halves are the 2 warpgroups of one CTA (shared Q / K buffers, warpgroup 0 issues the
    TMA, a "consumed" barrier per slot with 2 arrivals gates the refill); else grid CTAs."""
    hr = lax.axis_index("hr")                 # one-warpgroup CTAs: row block * halves + half
    j = lax.axis_index("split")
    b = lax.axis_index("b")
    if two_wg:
        rb, h = hr, lax.axis_index("wg")
    else:
        rb, h = hr // halves, hr % halves
    page, c = pool_ref.shape[1], pool_ref.shape[2]
    a = o_ref.shape[-1]
    bn = a // halves
    dt = q_ref.dtype
    slot_b = b                               # partials slot (b, j); b becomes the row read
    b, start, end = _work_item(len_ref, b, j, splits, bk)
    n_blocks = jnp.where(end > start, (end - start + bk - 1) // bk, 0)
    row0 = pl.multiple_of(rb * _ROWS, _ROWS)
    col0 = pl.multiple_of(h * bn, bn)
    tiled = _tiled(bk)

    def main(q_smem, k_smem, p_smem, k_bars, q_bar, *consumed):
        if two_wg:
            p_smem = p_smem.at[h]
            leader = h == 0
        else:
            leader = True

        @pl.when(leader)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, _ROWS)], q_smem, q_bar)

        def issue(kb, slot):
            _issue_tile(bt_ref, pool_ref, b, start + kb * bk, end, bk, k_smem.at[slot],
                        k_bars.at[slot])

        for s in range(stages):
            pl.when(jnp.logical_and(leader, s < n_blocks))(functools.partial(issue, s, s))
        plgpu.barrier_wait(q_bar)

        def step(kb, carry):
            acc, m_prev, l_prev = carry
            slot = kb % stages
            plgpu.barrier_wait(k_bars.at[slot])
            tile = k_smem.at[slot]
            s = _scores(q_smem, tile, end - (start + kb * bk), qk_scale, interpret)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            corr = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l_next = l_prev * corr + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
            p_smem[...] = p.astype(dt)
            plgpu.commit_smem()                   # P visible to the wgmma (fence + WG barrier)

            acc = _accumulate(acc, lambda: [(p_smem, tile.at[:, pl.ds(col0, bn)])],  # slot free
                              interpret)
            if two_wg:
                plgpu.barrier_arrive(consumed[0][0].at[slot])   # this warpgroup is done with slot

                @pl.when(jnp.logical_and(leader, kb + stages < n_blocks))
                def _():
                    plgpu.barrier_wait(consumed[0][0].at[slot])  # ... and so is the other one
                    issue(kb + stages, slot)
            else:
                pl.when(kb + stages < n_blocks)(functools.partial(issue, kb + stages, slot))
            return acc, m_next, l_next

        out = lax.fori_loop(0, n_blocks, step, _init_carry(bn, interpret))
        if two_wg:
            consumed_bars, done_bar = consumed[0]

            @pl.when(leader)
            def _():   # the last tiles' releases were not waited on: drain them (keeps the leader's
                # barrier phases complete) -- afterwards the other warpgroup is past every K read
                @pl.loop(jnp.maximum(n_blocks - stages, 0), n_blocks)
                def _(kb):
                    plgpu.barrier_wait(consumed_bars.at[kb % stages])
            # both warpgroups past their loops before the epilogue reuses the tiles' shared memory
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
        return out

    scoped = dict(collective_axes="wg") if two_wg else {}
    acc, m, l = pl.run_scoped(
        main,
        plgpu.SMEM((_ROWS, c), dt, transforms=tiled),
        plgpu.SMEM((stages, bk, c), dt, transforms=tiled),
        plgpu.SMEM(((2,) if two_wg else ()) + (_ROWS, bk), dt, transforms=tiled),
        plgpu.Barrier(num_arrivals=max(1, bk // page), num_barriers=stages),
        plgpu.Barrier(num_arrivals=1),
        *([(plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_arrivals=2))]
          if two_wg else []),
        **scoped,
    )

    _write_partials(acc, m, l, o_ref, lse_ref, b=slot_b, j=j, row0=row0, col0=col0, h=h, two_wg=two_wg,
                    o_bmsa=o_bmsa)


def _write_partials(acc, m, l, o_ref, lse_ref, *, b, j, row0, col0, h, two_wg: bool,
                    o_bmsa: bool = False):
    """Epilogue: o = acc / l (this program's [64, bn] columns), lse = m ln 2 + ln l (-inf and o = 0 for
    an empty split; acc = 0 there) staged in shared memory and TMA'd out; lse by (warpgroup / half)
    0. The staging reuses the main loop's shared memory: callers make sure every warpgroup is past
    its last read of that space first."""
    def epilogue(o_smem, lse_smem):
        _store_partials(acc, m, l, o_smem.at[h] if two_wg else o_smem, lse_smem, o_ref, lse_ref, b=b,
                        j=j, row0=row0, col0=col0, h=h, o_bmsa=o_bmsa)

    pl.run_scoped(epilogue,
                  plgpu.SMEM(((2,) if two_wg else ()) + (_ROWS, acc.shape[1]), jnp.float32),
                  plgpu.SMEM((_ROWS,), jnp.float32),
                  **(dict(collective_axes="wg") if two_wg else {}))


def _store_partials(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, *, b, j, row0, col0, h,
                    o_bmsa: bool = False):
    """`_write_partials` through given staging buffers: o_smem [64, bn] (this warpgroup's), lse_smem
    [64] (written by h == 0 only)."""
    bn = acc.shape[1]
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])     # acc = 0 when there were no tokens
    lse = jnp.where(has, m * _LN2 + jnp.log(l_safe), -jnp.inf)
    o_smem[...] = o

    @pl.when(h == 0)   # one writer (two warpgroups share lse_smem; the values are identical,
    def _():           # but the other's late store would race with this TMA read)
        lse_smem[...] = lse
    plgpu.commit_smem()
    if o_bmsa:   # o [B, Mp, splits, A]: rows strided by splits * A (the combine's order)
        o_dst = o_ref.at[b, pl.ds(row0, _ROWS), j, pl.ds(col0, bn)]
    else:        # o [B, splits, Mp, A]
        o_dst = o_ref.at[b, j, pl.ds(row0, _ROWS), pl.ds(col0, bn)]
    plgpu.copy_smem_to_gmem(o_smem, o_dst)

    @pl.when(h == 0)
    def _():
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, j, pl.ds(row0, _ROWS)])
    plgpu.wait_smem_to_gmem(0)


def _pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, *, bk: int, stages: int, splits: int,
                  prefetch: int = 0):
    """What the pair kernels (versions 2, 5) know about their program before the loop: (the row b it
    reads (the program's own b unless the schedule is balanced: `_work_item`), split j, warpgroup h, C,
    the warpgroup's latent columns bn = A / 2, dtype, pair slots, the split's token range [start,
    end), its pairs of bk-token tiles (an odd tile count pads the last pair), the first query row,
    the warpgroup's first latent column, and `issue_pair` (the TMA of one pair into a slot))."""
    rb = lax.axis_index("hr")
    j = lax.axis_index("split")
    h = lax.axis_index("wg")
    bn = o_ref.shape[-1] // 2
    b, start, end = _work_item(len_ref, lax.axis_index("b"), j, splits, 2 * bk)  # whole pairs but
    #                                                           the row's last; b: the row read
    n_tiles = jnp.where(end > start, (end - start + bk - 1) // bk, 0)
    n_pairs = (n_tiles + 1) // 2
    return (b, j, h, pool_ref.shape[2], bn, q_ref.dtype, stages // 2, start, end, n_pairs,
            pl.multiple_of(rb * _ROWS, _ROWS), pl.multiple_of(h * bn, bn),
            functools.partial(_issue_pair, bt_ref, pool_ref, b, start, end, bk, prefetch, n_pairs))


def _prologue(q_ref, q_smem, q_bar, k_smem, k_bars, b, row0, issue_pair, npairs, n_pairs, *, q_wg,
              tma_wg):
    """Version 2 before its loop: warpgroup `q_wg` loads the 64 query rows, warpgroup
    `tma_wg` issues the first pairs into every pair slot (as many as the split has), and both wait
    for Q."""
    @pl.when(q_wg)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, _ROWS)], q_smem, q_bar)

    for s in range(npairs):
        pl.when(jnp.logical_and(tma_wg, s < n_pairs))(functools.partial(issue_pair, k_smem, k_bars, s, s))
    plgpu.barrier_wait(q_bar)


def _producer(q_ref, q_smem, q_bar, k_smem, k_bars, consumed, b, row0, issue_pair, npairs, n_pairs):
    """The producer warpgroup of versions 2 (`producer`) and 5: its registers cut to _PRODUCER_REGS, it
    loads Q and the first pairs (`_prologue`), then refills each pair slot with the pair `npairs` ahead
    once both computing warpgroups released it (every phase of `consumed` waited, the last ones too).
    `issue_pair(k_smem, k_bars, pair, slot)`."""
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
    _prologue(q_ref, q_smem, q_bar, k_smem, k_bars, b, row0, issue_pair, npairs, n_pairs,
              q_wg=True, tma_wg=True)

    @pl.loop(0, n_pairs)
    def _(i):
        ps = i % npairs
        plgpu.barrier_wait(consumed.at[ps])     # both computing warpgroups done with pair i
        pl.when(i + npairs < n_pairs)(lambda: issue_pair(k_smem, k_bars, i + npairs, ps))


def _split_s_row_sums(leader, consumed, n_pairs, npairs, exchange, l_part, p_bar, drain: bool = True):
    """Version 2 after its loop: warpgroup 0 drains the last pairs' releases (keeps its consumed
    phases complete), then l = l_0 + l_1 through `exchange` (x slot h is free: the other warpgroup
    read it before its last p_bar arrival). That exchange is also the "both past their loops" point;
    the p_bar round after it makes sure both have read x_smem before the epilogue's staging reuses
    the space. Returns l. drain=False: the producer warpgroup drains instead."""
    if drain:
        @pl.when(leader)
        def _():
            @pl.loop(jnp.maximum(n_pairs - npairs, 0), n_pairs)
            def _(i):
                plgpu.barrier_wait(consumed.at[i % npairs])
    l = exchange(l_part, jnp.add)
    plgpu.barrier_arrive(p_bar)
    plgpu.barrier_wait(p_bar)
    return l


def _kernel_split_s(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, stages: int,
                    splits: int, qk_scale: float, interpret: bool, o_bmsa: bool = False,
                    prefetch: int = 0, bt_ahead: bool = False, early_pv: bool = False,
                    mask_tail_only: bool = False, producer: bool = False):
    """Version 2 ("split S", FlashMLA-style): 2 warpgroups per CTA, grid (row_blocks, splits, B).
    Per pair i of block_k-token tiles (2i, 2i + 1) of the split, warpgroup h:
      1. waits for tile 2i + h, S_h = Q tile^T [64, bk] (wgmma, K = C), scaled and masked, and
         m_loc = max(m, rowmax S_h);
      2. exchanges m_loc through x_smem[h] (commit_smem, arrive + wait on x_bar, 2 arrivals) and
         takes m_new = max of both, identical in both warpgroups (so is corr = 2^(m - m_new));
      3. p_h = 2^(S_h - m_new) -> P[h] (bf16), l_h = l_h corr + rowsum p_h, acc_h *= corr; arrive +
         wait on p_bar (2 arrivals): both P halves written;
      4. acc_h += P[0] tile_2i[:, cols_h] + P[1] tile_2i+1[:, cols_h] (two wgmmas, K = bk, cols_h =
         this warpgroup's A / 2 latent columns);
      5. releases the pair's two slots (consumed[pair slot], 2 arrivals); warpgroup 0 (which issues
         all TMA) waits for it and refills them with pair i + stages / 2.
    After the loop l = l_0 + l_1 is exchanged through x_smem once. See the module docstring for the
    barrier argument (why one P buffer per warpgroup and one x slot per warpgroup are enough).
    bt_ahead: the page ids of the pair the next refill issues are read from the block table at the
    top of each step and carried, so the refill (on warpgroup 0's path, which the other warpgroup
    waits for at the next exchange) issues its copies without a dependent global load.
    early_pv: step 4's wgmma on this warpgroup's own P and tile is issued before the p_bar wait
    (its P is written and fenced, its tile waited on), the other's after it, so the tensor cores
    start while the warpgroups meet (same sum, the two products added in the other order).
    producer: a third warpgroup (h = 2, its registers cut to _PRODUCER_REGS, the two others' raised to
    _CONSUMER_REGS) loads Q, issues every tile copy and refills a pair slot as soon as both warpgroups
    released it (waiting the consumed barrier off their path), then drains the last releases; the two
    warpgroups only compute (no refill, no block-table loads, no wait for the other's P @ C at the end
    of a pair) and write their partials from inside their branch, through staging that shares the
    loop's shared memory (plgpu.RefUnion; separate buffers in interpret mode, whose 0.10.2 interpreter
    has no aliased refs). bt_ahead does not apply (the producer reads the block table)."""
    (b, j, h, c, bn, dt, npairs, start, end, n_pairs, row0, col0,
     issue_pair) = _pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, bk=bk, stages=stages, splits=splits,
                                  prefetch=prefetch)

    def main(*refs):
        if producer:
            ((q_smem, k_smem, p_smem, x_smem), (o_stage, lse_stage)), *bars = refs
        else:
            q_smem, k_smem, p_smem, x_smem, *bars = refs
        k_bars, q_bar, consumed, x_bar, p_bar = bars
        leader = h == 0

        def exchange(x, combine):
            """combine(x, the other warpgroup's x) through x_smem (both warpgroups call it)."""
            x_smem.at[h][...] = x
            plgpu.commit_smem()                # all 128 threads' stores done (and fenced)
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)
            return combine(x, _load_rows(x_smem.at[1 - h], interpret))

        page = pool_ref.shape[1]

        def step(i, carry):
            acc, m_prev, l_prev, pgs = carry
            pgs_next = (_pair_page_ids(bt_ref, page, b, start, end, bk, i + npairs + 1)
                        if bt_ahead else ())           # in flight for the whole step
            ps = i % npairs
            mine = 2 * ps + h
            other = 2 * ps + 1 - h
            plgpu.barrier_wait(k_bars.at[mine])
            s = _scores(q_smem, k_smem.at[mine], end - (start + (2 * i + h) * bk), qk_scale,
                        interpret, mask_tail_only)
            m_next = exchange(jnp.maximum(m_prev, s.max(axis=1)), jnp.maximum)
            corr = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l_next = l_prev * corr + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
            p_smem.at[h][...] = p.astype(dt)
            plgpu.commit_smem()                # P visible to both warpgroups' wgmmas

            def meet():
                plgpu.barrier_arrive(p_bar)
                plgpu.barrier_wait(p_bar)
                # the other tile: complete (the other warpgroup waited on it before its x_bar
                # arrival); waited here too so that this warpgroup sees the TMA's writes directly
                # and observes every phase of every k barrier (per-thread parity bits)
                plgpu.barrier_wait(k_bars.at[other])

            def pv(u):
                return p_smem.at[u], k_smem.at[2 * ps + u].at[:, pl.ds(col0, bn)]
            if early_pv:
                acc = _accumulate(acc, lambda: [pv(h), meet, pv(1 - h)], interpret)
            else:
                meet()
                acc = _accumulate(acc, lambda: [pv(u) for u in range(2)], interpret)
            plgpu.barrier_arrive(consumed.at[ps])       # this warpgroup is done with the pair

            if not producer:
                @pl.when(jnp.logical_and(leader, i + npairs < n_pairs))
                def _():
                    plgpu.barrier_wait(consumed.at[ps])     # ... and so is the other one
                    issue_pair(k_smem, k_bars, i + npairs, ps, pgs or None)
            return acc, m_next, l_next, pgs_next

        def compute():
            pgs0 = _pair_page_ids(bt_ref, page, b, start, end, bk, npairs) if bt_ahead else ()
            acc, m, l_part, _ = lax.fori_loop(0, n_pairs, step, _init_carry(bn, interpret) + (pgs0,))
            return acc, m, _split_s_row_sums(leader, consumed, n_pairs, npairs, exchange, l_part,
                                             p_bar, drain=not producer)

        if not producer:
            _prologue(q_ref, q_smem, q_bar, k_smem, k_bars, b, row0, issue_pair, npairs, n_pairs,
                      q_wg=leader, tma_wg=leader)
            return compute()

        @pl.when(h < 2)
        def _():
            plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
            plgpu.barrier_wait(q_bar)
            acc, m, l = compute()
            _store_partials(acc, m, l, o_stage.at[h], lse_stage, o_ref, lse_ref, b=lax.axis_index("b"),
                            j=j, row0=row0, col0=col0, h=h, o_bmsa=o_bmsa)

        pl.when(h == 2)(lambda: _producer(q_ref, q_smem, q_bar, k_smem, k_bars, consumed, b, row0,
                                          issue_pair, npairs, n_pairs))

    bufs = _pair_scratch(c, dt, bk, stages, pool_ref.shape[1])
    bars = (*bufs[4:],
            plgpu.Barrier(num_arrivals=2),          # x_bar: both warpgroups' x written
            plgpu.Barrier(num_arrivals=2))          # p_bar: both warpgroups' P written
    if producer:
        staging = (plgpu.SMEM((2, _ROWS, bn), jnp.float32), plgpu.SMEM((_ROWS,), jnp.float32))
        loop = tuple(bufs[:4])
        pl.run_scoped(main, (loop, staging) if interpret else plgpu.RefUnion(loop, staging), *bars,
                      collective_axes="wg")
        return
    acc, m, l = pl.run_scoped(main, *bufs[:4], *bars, collective_axes="wg")
    _write_partials(acc, m, l, o_ref, lse_ref, b=lax.axis_index("b"), j=j, row0=row0, col0=col0, h=h, two_wg=True,
                    o_bmsa=o_bmsa)


def _check_shapes(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, cfg: MgpuConfig):
    B, M, A = q_lat_BMA.shape
    R = q_pe_BMR.shape[-1]
    page = pool_XpC.shape[1]
    if pool_XpC.shape[-1] != A + R or (A + R) % 64:
        raise ValueError(f"pool {pool_XpC.shape}: last dim must be A + R = {A + R}, a multiple of 64")
    if A % cfg.halves or (A // cfg.halves) % 64 or A // cfg.halves > 256:
        raise ValueError(f"A={A} / halves={cfg.halves} must be a multiple of 64 and <= 256 (wgmma N)")
    bk = cfg.block_k
    if bk % 16 or bk > 256 or bk < 16:
        raise ValueError(f"block_k={bk} must be a multiple of 16 in [16, 256]")
    if page % 8 or (bk % page and page % bk):
        raise ValueError(f"page size {page} must be a multiple of 8 dividing or divisible by "
                         f"block_k={bk}")
    if cfg.warpgroups not in (1, 2) or (cfg.warpgroups == 2 and cfg.halves != 2):
        raise ValueError(f"warpgroups={cfg.warpgroups} must be 1, or 2 with halves=2")
    if cfg.producer and not cfg.split_s:
        raise ValueError("producer (a TMA warpgroup) is a version 2 option: split_s=True")
    if cfg.split_s and (cfg.warpgroups != 2 or cfg.stages % 2 or cfg.stages < 2):
        raise ValueError(f"split_s needs warpgroups=2 and an even number of stages (tiles; 2 per "
                         f"pair), got warpgroups={cfg.warpgroups}, stages={cfg.stages}")
    if cfg.one_scorer:
        from pallas_kernels.mla import decode_v5 as mla_decode_v5
        mla_decode_v5.check_config(bk, cfg.stages, A + R, split_s=cfg.split_s, producer=cfg.producer)
    need = _smem_bytes(bk, cfg.stages, A + R, wgs=cfg.warpgroups, split_s=cfg.split_s)
    if need > _SMEM_LIMIT:
        raise ValueError(f"block_k={bk} x stages={cfg.stages} x warpgroups={cfg.warpgroups} "
                         f"(split_s={cfg.split_s}) needs {need} B of shared memory "
                         f"(> {_SMEM_LIMIT})")
    for x in (q_lat_BMA, q_pe_BMR, pool_XpC):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"the Mosaic GPU MLA kernel takes bf16 inputs, got {x.dtype}")
    if block_table_BP.shape[0] != B:
        raise ValueError(f"block_table {block_table_BP.shape} does not match B={B}")


def mla_decode_partials_mgpu(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, lengths_B, *,
                             scale: float, config: Optional[MgpuConfig] = None,
                             interpret=False, work=None):
    """Flash-decoding partials over the cached tokens (see the module docstring): o [B, splits, M, A]
    f32 (each split normalized; [B, M, splits, A] with config.o_bmsa) and lse [B, splits, M] f32.
    With config.schedule 'balanced', slot (b, j) holds item b * splits + j of `work` (default
    `_balanced_work(lengths_B, resolved config)`).
    `interpret`: False (GPU), True (the Mosaic GPU interpreter on CPU) or an InterpretGPUParams."""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available")
    B, M, A = q_lat_BMA.shape
    R = q_pe_BMR.shape[-1]
    C = A + R
    cfg = resolve_config(config, B, M, block_table_BP.shape[1] * pool_XpC.shape[1], C)
    _check_shapes(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, cfg)
    row_blocks = -(-M // _ROWS)
    Mp = row_blocks * _ROWS
    q_BMC = jnp.concatenate([q_lat_BMA, q_pe_BMR.astype(q_lat_BMA.dtype)], axis=-1)
    if Mp != M:
        q_BMC = jnp.pad(q_BMC, ((0, 0), (0, Mp - M), (0, 0)))
    if interpret is True:
        interpret = interpret_params()
        if interpret is None:
            raise RuntimeError("this jax has no Mosaic GPU interpreter")
    interp = bool(interpret)
    splits = cfg.num_splits
    two_wg = cfg.warpgroups == 2
    if cfg.one_scorer:
        from pallas_kernels.mla import decode_v5 as mla_decode_v5
        kernel = functools.partial(mla_decode_v5.kernel, bk=cfg.block_k, stages=cfg.stages, splits=splits,
                                   qk_scale=float(scale) * _LOG2E, interpret=interp, o_bmsa=cfg.o_bmsa,
                                   mask_tail_only=cfg.mask_tail_only)
        extra = dict(reduction_scratch_bytes=_SPLIT_S_REDUCTION_SCRATCH)
    elif cfg.split_s:
        kernel = functools.partial(_kernel_split_s, bk=cfg.block_k, stages=cfg.stages,
                                   splits=splits, qk_scale=float(scale) * _LOG2E, interpret=interp,
                                   o_bmsa=cfg.o_bmsa, prefetch=0 if interp else cfg.l2_prefetch,
                                   bt_ahead=cfg.bt_ahead and not cfg.producer, early_pv=cfg.early_pv,
                                   mask_tail_only=cfg.mask_tail_only, producer=cfg.producer)
        extra = dict(reduction_scratch_bytes=_SPLIT_S_REDUCTION_SCRATCH)
    else:
        kernel = functools.partial(_kernel, bk=cfg.block_k, stages=cfg.stages, splits=splits,
                                   halves=cfg.halves, qk_scale=float(scale) * _LOG2E,
                                   interpret=interp, two_wg=two_wg, o_bmsa=cfg.o_bmsa)
        extra = {}
    if cfg.schedule != "balanced":
        work = lengths_B.astype(jnp.int32)
    elif work is None:
        work = _balanced_work(lengths_B, cfg)
    params = plgpu.CompilerParams(
        lowering_semantics=getattr(plgpu.LoweringSemantics, cfg.semantics), **extra)
    kw = dict(interpret=interpret) if interp else {}
    if two_wg:
        kw.update(num_threads=3 if cfg.producer else 2, thread_name="wg")
    o, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, Mp, splits, A) if cfg.o_bmsa else (B, splits, Mp, A),
                                       jnp.float32),
                  jax.ShapeDtypeStruct((B, splits, Mp), jnp.float32)),
        grid=(row_blocks * (1 if two_wg else cfg.halves), splits, B),
        grid_names=("hr", "split", "b"),
        compiler_params=params,
        **kw,
    )(work, block_table_BP.astype(jnp.int32), q_BMC, pool_XpC)
    return (o[:, :M] if cfg.o_bmsa else o[:, :, :M]), lse[:, :, :M]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_lse"))
def mla_paged_attention_mgpu(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT,
                             scale: float, *, config: Optional[MgpuConfig] = None,
                             interpret: bool = False, return_lse: bool = False):
    """`mla_decode.mla_paged_attention`'s contract (cached tokens + the step's new tokens), with the
    cached part on the Mosaic GPU kernel and the new tokens merged by `mla_decode.combine`."""
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    lengths_B = jnp.maximum(positions_BT[:, 0], 0)
    work = None
    if config is not None and config.schedule == "balanced":   # one table for the kernel and the combine
        work = _balanced_work(lengths_B, resolve_config(config, B, T * N,
                                                        block_table_BP.shape[1] * pool_XpC.shape[1], A + R))
    o_BKMA, lse_BKM = mla_decode_partials_mgpu(
        q_lat_BTNA.reshape(B, T * N, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, T * N, R),
        pool_XpC, block_table_BP, lengths_B, scale=scale, config=config, interpret=interpret, work=work)
    if work is not None:
        o_BTNA, lse_BTN = tri.finish_items(o_BKMA, lse_BKM, work, q_lat_BTNA, q_pe_BTNR, new_BTC,
                                           positions_BT, scale, interpret=bool(interpret))
    else:
        o_BTNA, lse_BTN = tri.finish(o_BKMA, lse_BKM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                                     kernel=config is not None and config.finish == "kernel",
                                     interpret=bool(interpret), splits_minor=config is not None and config.o_bmsa)
    o_BTNA = o_BTNA.astype(q_lat_BTNA.dtype)
    return (o_BTNA, lse_BTN) if return_lse else o_BTNA


# ----------------------------------------------------------------------------------------------
# Test data and the GPU check/benchmark.

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


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-6))


def _time(fn, arg_sets, iters=20, warmup=2):
    """Median-free throughput timing: `iters` calls enqueued back to back (async dispatch hides the
    host), cycling through `arg_sets` (different block tables over one pool, so consecutive calls do
    not find the previous call's pages in L2), one block at the end. Returns us per call."""
    for k in range(warmup):
        jax.block_until_ready(fn(*arg_sets[k % len(arg_sets)]))
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[k % len(arg_sets)]) for k in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / iters * 1e6


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """XLA `x ^ 1` over nbytes (read + write), the project's copy roofline (NOTES.md item 9)."""
    x = jnp.zeros(nbytes // 4, jnp.uint32)
    f = jax.jit(lambda v: v ^ 1)
    us = _time(f, [(x,)], iters=10)
    return 2 * x.nbytes / (us * 1e-6) / 1e9


def _bench_case(key, B, ctx, heads, page, min_pool_bytes):
    """Full-length rows; the pool holds max(1, min_pool_bytes / cache bytes) disjoint copies of the
    batch's pages, one block table per copy."""
    per = B * ctx * 576 * 2
    copies = max(1, -(-min_pool_bytes // per))
    P = -(-ctx // page)
    q_lat, q_pe, new, pool, _, pos = make_case(key, [ctx] * B, heads=heads, page=page,
                                               pages_per_row=P, extra_pages=(copies - 1) * B * P)
    X = pool.shape[0]
    perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1), X))
    return [(q_lat, q_pe, new, pool, jnp.asarray(perm[k * B * P:(k + 1) * B * P].reshape(B, P)), pos)
            for k in range(copies)]


# --cases=default: the version-1 comparison; full: the acceptance grid B in (1, 8, 64) x context
# (4K, 32K, 128K) at 64 heads, most informative first (a run cut by --budget_s loses the least).
CASES = {
    "default": ((1, 32768), (8, 32768), (64, 4096), (64, 32768)),
    "full": ((64, 32768), (64, 131072), (8, 32768), (1, 32768), (64, 4096), (8, 131072),
             (1, 131072), (8, 4096), (1, 4096)),
    "large": ((64, 32768), (64, 131072), (8, 131072), (8, 32768)),   # the memory-bound cases
}
_MAX_CASE_BYTES = 40e9            # skip a case whose cache alone would exceed this


# Version 2 (split S), the fastest config at every case of the 64-head grid from 1 x 32K up on the H200
# from the fourth to the seventeenth session (BENCHMARKS.md, fourth session: 82-88% of copy at B = 64 x
# 32K / 128K); SERVING_V2 adds the page ids read a step ahead and the own-tile P @ C before the P exchange
# (round 10: 1-4% faster); what kimi_jax.ops runs is `serving_config` below (version 5).
VERSION_2 = MgpuConfig(block_k=32, stages=4, warpgroups=2, split_s=True)   # plain, no options
SERVING_V2 = dataclasses.replace(VERSION_2, bt_ahead=True, early_pv=True)     # seventh-sixteenth sessions
# Seventeenth session: the TMA from a third (producer) warpgroup, so the two computing ones never wait
# for each other's P @ C to refill a pair (MLA round 20: 1-2% faster at 64 x 32K and 8 x 128K in two
# runs; bt_ahead does not apply, the producer reads the block table).
SERVING_PRODUCER = dataclasses.replace(VERSION_2, early_pv=True, producer=True)
# Version 5 (mla_decode_v5.py), on the producer: warpgroup 0 scores each pair of 32-token tiles as one
# N = 64 wgmma (half the shared-memory reads of Q), both warpgroups accumulate P @ C halves.
ONE_SCORER = dataclasses.replace(VERSION_2, producer=True, one_scorer=True)
# Since the eighteenth session (MLA round 21: 8-18% faster than SERVING_PRODUCER at the memory-bound
# cases, 90-103% of the copy), with the scores masked only in a split's tail tiles.
SERVING_CONFIG = dataclasses.replace(ONE_SCORER, mask_tail_only=True)


def serving_config(batch: int, schedule: Optional[str] = None) -> MgpuConfig:
    """What kimi_jax.ops runs for `batch` rows on this device: SERVING_CONFIG, with the one-launch finish
    (mla_finish.py: new tokens + the combine of the splits' partials) for a single row, whose 132 splits
    make XLA's finishing ops the largest fixed cost (MLA round 21 I, version 5: 1 x 32K 32.1 vs 36.3 us,
    1 x 128K 63.2 vs 65.5 us per call by device time; a tie from 2 rows up). `schedule`: a forced one
    (`ops.use_mla_schedule`), with XLA's finish (the only one the balanced schedule takes)."""
    if schedule is not None:
        return dataclasses.replace(SERVING_CONFIG, schedule=schedule)
    return dataclasses.replace(SERVING_CONFIG, finish="kernel") if batch == 1 else SERVING_CONFIG


def default_configs(semantics: str = "Lane") -> dict:
    """The configs `check_and_time` checks and times: version 1 (k64) and 1b (wg2_k32s4) for
    comparison, version 2 (wg2s_*: split S) with its auto splits at min_split_tokens 512 (default),
    256 and 1024 (they differ only where that cap binds: B = 1, and B = 8 at 4K); *_bmsa: o written as
    [B, M, splits, A] (no transpose before the combine); *_fin: new tokens + combine in one Triton
    launch (mla_finish.py); *_bta_epv: SERVING_V2 (the serving config until the seventeenth session);
    *_prod_epv: SERVING_PRODUCER (a producer warpgroup issues the TMA; the seventeenth session's);
    v5: version 5 (ONE_SCORER: one warpgroup scores each pair, mla_decode_v5.py); v5_mtail:
    SERVING_CONFIG (v5 with the scores masked only in tail tiles)."""
    ss = dataclasses.replace(VERSION_2, semantics=semantics)
    return {
        "k64": MgpuConfig(block_k=64, semantics=semantics),
        "wg2_k32s4": MgpuConfig(block_k=32, stages=4, warpgroups=2, semantics=semantics),
        "wg2s_k32s4": ss,
        "wg2s_k32s4_m256": dataclasses.replace(ss, min_split_tokens=256),
        "wg2s_k32s4_m1024": dataclasses.replace(ss, min_split_tokens=1024),
        "wg2s_k32s4_bmsa": dataclasses.replace(ss, o_bmsa=True),
        "wg2s_k32s4_fin": dataclasses.replace(ss, finish="kernel"),
        "wg2s_k32s4_bta_epv": dataclasses.replace(SERVING_V2, semantics=semantics),
        "wg2s_k32s4_prod_epv": dataclasses.replace(SERVING_PRODUCER, semantics=semantics),
        "v5": dataclasses.replace(ONE_SCORER, semantics=semantics),
        "v5_mtail": dataclasses.replace(SERVING_CONFIG, semantics=semantics),
    }


def variant_configs(semantics: str = "Lane") -> dict:
    """Measured one-off variants of version 2, by name for `--configs` (not in the default run):
    the serving options alone (_bta, _epv), the pipeline depth (k32s2: one pair of tiles in flight;
    k16s8 / k16s6: 16-token tiles, 4 / 3 pairs) and L2 prefetches 1, 2, 4 pairs ahead (_pf*)."""
    ss = dataclasses.replace(VERSION_2, semantics=semantics)
    return {
        "wg2s_k32s4_bta": dataclasses.replace(ss, bt_ahead=True),
        "wg2s_k32s4_epv": dataclasses.replace(ss, early_pv=True),
        "serving_mtail": dataclasses.replace(SERVING_V2, semantics=semantics, mask_tail_only=True),
        "wg2s_k32s2": dataclasses.replace(ss, stages=2),
        "wg2s_k16s8": dataclasses.replace(ss, block_k=16, stages=8),
        "wg2s_k16s6": dataclasses.replace(ss, block_k=16, stages=6),
        **{f"wg2s_k32s4_pf{d}": dataclasses.replace(ss, l2_prefetch=d) for d in (1, 2, 4)},
    }


def check_and_time(out: Optional[str] = None, semantics: str = "Lane", budget_s: float = 140.0,
                   cases=CASES["default"], heads: int = 64,
                   page: int = 16, configs=None, interpret: bool = False,
                   copy_bytes: int = 2 << 30, min_pool_bytes: int = 512 << 20, iters: int = 20):
    """On the GPU: correctness vs the f32 reference on small ragged cases (page 16 and 64), then
    us / GB/s / % of copy vs the Triton kernel (default config) at `heads` heads, full-length rows.
    A config whose resolved kernel (stages, splits) equals one already timed in that case is not
    timed again ({"same_as": name}); each timing records its resolved splits.
    Writes a JSON to `out` (a directory or a .json path) if given; returns the record.
    `interpret=True` (CPU smoke test of this harness only: tiny `cases`, small copy_bytes)."""
    t_start = time.time()
    rec = {"jax": jax.__version__, "device": str(jax.devices()[0]), "semantics": semantics,
           "checks": [], "timings": []}
    configs = configs or default_configs(semantics)
    scale = 1.0 / math.sqrt(192.0)
    ok_configs = {}
    for name, cfg in configs.items():
        for lens, pg in (([0, 1, 15, 16, 17, 300, 1000], page), ([64, 129, 0, 700], 64)):
            args = make_case(jax.random.key(1), lens, heads=heads, page=pg)
            try:
                o, lse = mla_paged_attention_mgpu(*args, scale, config=cfg, return_lse=True,
                                                  interpret=interpret)
                o_ref, lse_ref = tri.mla_paged_attention_reference(*args, scale, return_lse=True)
                err = _rel_err(o, o_ref)
                lse_err = float(np.nanmax(np.abs(np.asarray(lse) - np.asarray(lse_ref))))
                ok = bool(err < 3e-2 and lse_err < 1e-2
                          and np.isfinite(np.asarray(o, np.float32)).all())
                rec["checks"].append({"config": name, "page": pg, "lengths": lens, "rel_err": err,
                                      "lse_err": lse_err, "ok": ok})
            except Exception as e:  # noqa: BLE001 - report and go on with the other configs
                ok = False
                rec["checks"].append({"config": name, "page": pg, "lengths": lens, "ok": False,
                                      "error": f"{type(e).__name__}: {str(e)[:3000]}"})
            print(json.dumps(rec["checks"][-1]), flush=True)
            if not ok:
                break
        else:
            ok_configs[name] = cfg
    rec["copy_gbs"] = copy_bandwidth_gbs(copy_bytes)
    print(f"copy bandwidth (x ^ 1 over {copy_bytes >> 20} MiB, read + write): "
          f"{rec['copy_gbs']:.0f} GB/s", flush=True)
    fns = {"triton": jax.jit(functools.partial(tri.mla_paged_attention, scale=scale,
                                               interpret=interpret or None))}
    for name, cfg in ok_configs.items():
        fns[f"mgpu_{name}"] = jax.jit(functools.partial(mla_paged_attention_mgpu, scale=scale,
                                                        config=cfg, interpret=interpret))
    for (B, ctx) in cases:
        nbytes = B * ctx * 576 * 2
        skip = ("budget" if time.time() - t_start > budget_s else
                f"cache {nbytes / 1e9:.1f} GB > {_MAX_CASE_BYTES / 1e9:.0f}"
                if nbytes > _MAX_CASE_BYTES else None)
        if skip:
            rec["timings"].append({"B": B, "context": ctx, "skipped": skip})
            print(json.dumps(rec["timings"][-1]), flush=True)
            continue
        arg_sets = _bench_case(jax.random.key(2), B, ctx, heads, page, min_pool_bytes)
        row = {"B": B, "context": ctx, "heads": heads, "MB": nbytes / 1e6,
               "pool_copies": len(arg_sets)}
        timed = {}                                   # resolved config -> the name timed with it
        for name, fn in fns.items():
            cfg = ok_configs.get(name[len("mgpu_"):]) if name.startswith("mgpu_") else None
            if cfg is not None:
                cfg = resolve_config(cfg, B, heads, -(-ctx // page) * page)
                key = dataclasses.replace(cfg, min_split_tokens=0)   # spent on num_splits
                if key in timed:
                    row[name] = {"same_as": timed[key], "splits": cfg.num_splits}
                    continue
                timed[key] = name
            try:
                us = _time(fn, arg_sets, iters=iters)
                gbs = nbytes / (us * 1e-6) / 1e9
                row[name] = {"us": round(us, 1), "GBs": round(gbs, 1),
                             "pct_copy": round(100 * gbs / rec["copy_gbs"], 1)}
                if cfg is not None:
                    row[name]["splits"] = cfg.num_splits
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
        rec["timings"].append(row)
        print(json.dumps(row), flush=True)
        del arg_sets
    rec["wall_s"] = time.time() - t_start
    if out:
        path = out if out.endswith(".json") else os.path.join(out, "mla_mgpu.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
        print("wrote", path)
    return rec


def check_schedules(configs=None, interpret: bool = False, lengths=(1, 4000, 37, 20000, 0, 515, 63, 64),
                    pages=(16, 64), ts=(1, 2)) -> bool:
    """GPU check of whole ops (`mla_paged_attention_mgpu`) under both schedules ('rows', 'balanced'):
    a ragged batch (empty, 1-token, page +- 1 and long rows), T = 1 and 2 (64 and 128 query rows), pages
    16 and 64, against the f32 reference; then a few of its rows alone under `serving_config(1)` (the
    one-launch finish); max |o - ref| < 3e-2 (bf16 output of values up to ~3, as the tests). Prints one
    line per case; returns whether all passed. `configs`: {name: MgpuConfig} (default: SERVING_CONFIG
    and ONE_SCORER)."""
    configs = configs or {"serving": SERVING_CONFIG, "v5": ONE_SCORER}
    scale, ok = 1.0 / math.sqrt(192.0), True

    def check(label, args, ref, cfg):
        nonlocal ok
        o = np.asarray(mla_paged_attention_mgpu(*args, scale, config=cfg, interpret=interpret), np.float32)
        err = float(np.max(np.abs(o - ref)))
        good = bool(np.all(np.isfinite(o)) and err < 3e-2)
        ok &= good
        print(f"{label} max|o-ref|={err:.2e} {'OK' if good else 'FAIL'}", flush=True)

    for page in pages:
        for t in ts:
            args = make_case(jax.random.key(3 + page + t), list(lengths), heads=64, t=t, page=page)
            ref = np.asarray(tri.mla_paged_attention_reference(*args, scale), np.float32)
            for sched in ("rows", "balanced"):
                for name, base in configs.items():
                    check(f"page={page} T={t} {sched:8s} {name:8s}", args, ref,
                          dataclasses.replace(base, schedule=sched))
            # one row: serving_config(1) (the one-launch finish), rows of the same batch alone
            for r in sorted({0, 1, len(lengths) // 2, int(np.argmax(lengths))}):
                one = [x if i == 3 else x[r:r + 1] for i, x in enumerate(args)]   # args[3]: the pool
                check(f"page={page} T={t} row {r} (length {lengths[r]}) alone, serving_config(1):", one,
                      ref[r:r + 1], serving_config(1))
    print("ALL OK" if ok else "SOME FAILED", flush=True)
    return ok


def _main(argv):
    if argv == ["--check_schedules"]:
        raise SystemExit(0 if check_schedules() else 1)
    out, semantics, budget, cases, names = None, "Lane", None, "default", None
    for arg in argv:
        if arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        elif arg.startswith("--semantics="):
            semantics = arg.split("=", 1)[1]
        elif arg.startswith("--budget_s="):
            budget = float(arg.split("=", 1)[1])
        elif arg.startswith("--cases="):
            cases = arg.split("=", 1)[1]
        elif arg.startswith("--configs="):
            names = arg.split("=", 1)[1].split(",")
        else:
            raise SystemExit(f"unknown argument {arg} (--check_schedules alone, or --out=DIR, --semantics=Lane|Warpgroup, "
                             f"--budget_s=S, --cases={'|'.join(CASES)}, --configs=NAME,... of "
                             f"{','.join({**default_configs(), **variant_configs()})})")
    if cases not in CASES:
        raise SystemExit(f"--cases={cases}: one of {', '.join(CASES)}")
    configs = default_configs(semantics)
    if names:
        known = {**configs, **variant_configs(semantics)}
        unknown = set(names) - set(known)
        if unknown:
            raise SystemExit(f"unknown configs {sorted(unknown)}: known {', '.join(known)}")
        configs = {n: known[n] for n in names}
    if budget is None:   # seconds after which no new timing case starts (the run ends ~1 case later)
        budget = 140.0 if cases == "default" else 220.0
    check_and_time(out, semantics=semantics, budget_s=budget, cases=CASES[cases], configs=configs)


if __name__ == "__main__":
    _main(sys.argv[1:])
