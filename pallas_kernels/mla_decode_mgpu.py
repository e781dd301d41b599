"""Absorbed MLA paged decode on Pallas **Mosaic GPU** (wgmma + TMA), for 64 query rows (H200 / sm_90).

Same contract as `mla_decode.mla_decode_partials` (flash-decoding partials), so `mla_decode.combine`
merges the splits: `mla_decode_partials_mgpu(q_lat [B, M, A], q_pe [B, M, R], pool [X, page, A+R],
block_table [B, P], lengths [B]) -> o [B, splits, M, A] f32 (each split normalized), lse [B, splits, M]
f32 (natural log, -inf for an empty split)`. `mla_paged_attention_mgpu` is the full op (cached tokens
here, the step's new tokens by `mla_decode._new_token_part`, merged by `combine`), a drop-in for
`mla_decode.mla_paged_attention`.

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
GPU check + timing (one H200, < 150 s): `PYTHONPATH=. python -m pallas_kernels.mla_decode_mgpu
--out=$OUT/mgpu [--semantics=Warpgroup]` (`check_and_time`: ragged correctness per config first, then
the configs that passed vs the Triton kernel at 64 heads, B x context 1x32K, 8x32K, 64x4K, 64x32K).
Unverified until the GPU run: ptxas/NVVM compilation and the runtime (shared-memory limit, barrier
phases, register pressure: ~128 acc + 32 S + P + m, l regs per thread), numerics on hardware, speed.

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

Next steps (performance; in order)
---------------------------------
1. Stop duplicating QK^T (FlashMLA): each warpgroup computes S for half of the tile's tokens, they
   exchange row maxima through shared memory, each writes its half of P into one shared P buffer, then
   each accumulates its own 256 output columns over all the tile's tokens.
2. Issue the next tile's S wgmma before this tile's softmax (software pipelining), and a producer
   warpgroup for the TMA (emit_pipeline_warp_specialized) to free the compute warpgroups.
3. Mask only the last tile (the [64, block_k] int32 iota costs registers every step).
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

from pallas_kernels import mla_decode as tri

_NEG = -1e30
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
NUM_SMS = 132
_SMEM_LIMIT = 227 * 1024          # max dynamic shared memory per CTA on sm_90 (232,448 B)
_SMEM_RESERVED = 2048 + 512       # Mosaic's reduction scratch (CompilerParams default) + barriers
_ROWS = 64                        # wgmma M: query rows per CTA


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    block_k: int = 64             # tokens per tile (wgmma N of S, K of P @ C)
    stages: int = 0               # 0: as many tiles as fit in shared memory (2 at 64, 3 at 32)
    halves: int = 2               # CTAs splitting the A latent output columns (A / halves <= 256)
    warpgroups: int = 1           # 2: the two halves are 2 warpgroups of one CTA (shared pages)
    num_splits: int = 0           # 0: auto (fill the SMs once)
    min_split_tokens: int = 256   # auto splits: at least this many tokens per split
    semantics: str = "Lane"       # Mosaic GPU lowering semantics ("Lane" or "Warpgroup")


def _smem_bytes(block_k: int, stages: int, c: int, dtype_bytes: int = 2, wgs: int = 1) -> int:
    """Shared memory of one CTA: Q, the K tiles, P, Mosaic's reserve (the epilogue's o / lse
    staging reuses the loop's space; checked against the lowering's estimate: 231,424 B of scratch at
    block_k 64 x 2 stages, plus the barriers)."""
    return (_ROWS * c + stages * block_k * c + wgs * _ROWS * block_k) * dtype_bytes + _SMEM_RESERVED


def resolve_config(cfg: Optional[MgpuConfig], batch: int, rows: int, max_tokens: int,
                   c: int = 576) -> MgpuConfig:
    cfg = cfg or MgpuConfig()
    stages = cfg.stages
    if not stages:
        stages = 2
        while (_smem_bytes(cfg.block_k, stages + 1, c, wgs=cfg.warpgroups) <= _SMEM_LIMIT
               and stages < 4):
            stages += 1
    splits = cfg.num_splits
    if not splits:
        ctas = batch * (-(-rows // _ROWS)) * (cfg.halves if cfg.warpgroups == 1 else 1)
        splits = max(1, min(NUM_SMS // ctas if ctas < NUM_SMS else 1,
                            -(-max_tokens // cfg.min_split_tokens)))
    return dataclasses.replace(cfg, stages=stages, num_splits=splits)


# ----------------------------------------------------------------------------------------------
# Interpret-mode support (CPU tests).

def interpret_params():
    """The Mosaic GPU interpreter's parameters (private path in jax 0.10-0.11), or None."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    _install_interpret_shims()
    return InterpretGPUParams()


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

def _kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, stages: int, splits: int,
            halves: int, qk_scale: float, interpret: bool, two_wg: bool):
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

    def lc(x, layout):                         # layouts are a no-op in the interpreter (0.10.2 lacks
        return x if interpret else plgpu.layout_cast(x, layout)   # an impl for layout_cast)

    length = len_ref[b]
    chunk = ((length + splits - 1) // splits + bk - 1) // bk * bk
    start = j * chunk
    end = jnp.minimum(start + chunk, length)
    n_blocks = jnp.where(end > start, (end - start + bk - 1) // bk, 0)
    row0 = pl.multiple_of(rb * _ROWS, _ROWS)
    col0 = pl.multiple_of(h * bn, bn)

    # wgmma wants both operands with the same swizzle; P [64, bk] allows 2 * bk bytes per row
    swz = min(128, 2 * bk)
    tiled = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))

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
            base = start + kb * bk
            if page <= bk:
                for i in range(bk // page):
                    pos = jnp.minimum(base + i * page, end - 1)     # tail pages: re-read real data
                    pg = bt_ref[b, pos // page]
                    plgpu.copy_gmem_to_smem(pool_ref.at[pg], k_smem.at[slot, pl.ds(i * page, page)],
                                            k_bars.at[slot])
            else:
                pg = bt_ref[b, base // page]
                off = pl.multiple_of(base % page, bk)
                plgpu.copy_gmem_to_smem(pool_ref.at[pg, pl.ds(off, bk)], k_smem.at[slot],
                                        k_bars.at[slot])

        for s in range(stages):
            pl.when(jnp.logical_and(leader, s < n_blocks))(functools.partial(issue, s, s))
        plgpu.barrier_wait(q_bar)

        def step(kb, carry):
            acc, m_prev, l_prev = carry
            slot = kb % stages
            plgpu.barrier_wait(k_bars.at[slot])
            tile = k_smem.at[slot]

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_smem, tile.transpose((1, 0)))
                return s_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bk), jnp.float32))
            tok = lc(lax.broadcasted_iota(jnp.int32, (_ROWS, bk), 1), plgpu.Layout.WGMMA)
            s = jnp.where(tok < end - (start + kb * bk), s * qk_scale, _NEG)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            corr = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l_next = l_prev * corr + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
            p_smem[...] = p.astype(dt)
            plgpu.commit_smem()                   # P visible to the wgmma (fence + WG barrier)

            c_half = tile.at[:, pl.ds(col0, bn)]
            if interpret:   # the interpreters (0.10.2, 0.11.2) lack run_state: same sum, two steps
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, c_half)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC((_ROWS, bn), jnp.float32))
            else:           # accumulate in place (no second [64, bn] f32 in registers)
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, c_half)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))   # waits for the wgmma: slot is free
            if two_wg:
                plgpu.barrier_arrive(consumed[0][0].at[slot])   # this warpgroup is done with slot

                @pl.when(jnp.logical_and(leader, kb + stages < n_blocks))
                def _():
                    plgpu.barrier_wait(consumed[0][0].at[slot])  # ... and so is the other one
                    issue(kb + stages, slot)
            else:
                pl.when(kb + stages < n_blocks)(functools.partial(issue, kb + stages, slot))
            return acc, m_next, l_next

        init = (lc(jnp.zeros((_ROWS, bn), jnp.float32), plgpu.Layout.WGMMA),
                lc(jnp.full((_ROWS,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                lc(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        out = lax.fori_loop(0, n_blocks, step, init)
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

    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])     # acc = 0 when there were no tokens
    lse = jnp.where(has, m * _LN2 + jnp.log(l_safe), -jnp.inf)

    def epilogue(o_smem, lse_smem):
        if two_wg:
            o_smem = o_smem.at[h]
        o_smem[...] = o
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, j, pl.ds(row0, _ROWS), pl.ds(col0, bn)])

        @pl.when(h == 0)
        def _():
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, j, pl.ds(row0, _ROWS)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue,
                  plgpu.SMEM(((2,) if two_wg else ()) + (_ROWS, bn), jnp.float32),
                  plgpu.SMEM((_ROWS,), jnp.float32), **scoped)


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
    need = _smem_bytes(bk, cfg.stages, A + R, wgs=cfg.warpgroups)
    if need > _SMEM_LIMIT:
        raise ValueError(f"block_k={bk} x stages={cfg.stages} x warpgroups={cfg.warpgroups} needs "
                         f"{need} B of shared memory "
                         f"(> {_SMEM_LIMIT})")
    for x in (q_lat_BMA, q_pe_BMR, pool_XpC):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"the Mosaic GPU MLA kernel takes bf16 inputs, got {x.dtype}")
    if block_table_BP.shape[0] != B:
        raise ValueError(f"block_table {block_table_BP.shape} does not match B={B}")


def mla_decode_partials_mgpu(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, lengths_B, *,
                             scale: float, config: Optional[MgpuConfig] = None,
                             interpret=False):
    """Flash-decoding partials over the cached tokens (see the module docstring): o [B, splits, M, A]
    f32 (each split normalized) and lse [B, splits, M] f32. `interpret`: False (GPU), True (the
    Mosaic GPU interpreter on CPU) or an InterpretGPUParams."""
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
    kernel = functools.partial(_kernel, bk=cfg.block_k, stages=cfg.stages, splits=splits,
                               halves=cfg.halves, qk_scale=float(scale) * _LOG2E, interpret=interp,
                               two_wg=two_wg)
    params = plgpu.CompilerParams(
        lowering_semantics=getattr(plgpu.LoweringSemantics, cfg.semantics))
    kw = dict(interpret=interpret) if interp else {}
    if two_wg:
        kw.update(num_threads=2, thread_name="wg")
    o, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, splits, Mp, A), jnp.float32),
                  jax.ShapeDtypeStruct((B, splits, Mp), jnp.float32)),
        grid=(row_blocks * (1 if two_wg else cfg.halves), splits, B),
        grid_names=("hr", "split", "b"),
        compiler_params=params,
        **kw,
    )(lengths_B.astype(jnp.int32), block_table_BP.astype(jnp.int32), q_BMC, pool_XpC)
    return o[:, :, :M], lse[:, :, :M]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_lse"))
def mla_paged_attention_mgpu(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT,
                             scale: float, *, config: Optional[MgpuConfig] = None,
                             interpret: bool = False, return_lse: bool = False):
    """`mla_decode.mla_paged_attention`'s contract (cached tokens + the step's new tokens), with the
    cached part on the Mosaic GPU kernel and the new tokens merged by `mla_decode.combine`."""
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    lengths_B = jnp.maximum(positions_BT[:, 0], 0)
    o_BKMA, lse_BKM = mla_decode_partials_mgpu(
        q_lat_BTNA.reshape(B, T * N, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, T * N, R),
        pool_XpC, block_table_BP, lengths_B, scale=scale, config=config, interpret=interpret)
    K = o_BKMA.shape[1]
    o_BTNKA = o_BKMA.reshape(B, K, T, N, A).transpose(0, 2, 3, 1, 4)
    lse_BTNK = lse_BKM.reshape(B, K, T, N).transpose(0, 2, 3, 1)
    o_new, lse_new = tri._new_token_part(q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale)
    o_BTNA, lse_BTN = tri.combine(o_BTNKA, lse_BTNK, o_new, lse_new)
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


def check_and_time(out: Optional[str] = None, semantics: str = "Lane", budget_s: float = 140.0,
                   cases=((1, 32768), (8, 32768), (64, 4096), (64, 32768)), heads: int = 64,
                   page: int = 16, configs=None, interpret: bool = False,
                   copy_bytes: int = 2 << 30, min_pool_bytes: int = 512 << 20, iters: int = 20):
    """On the GPU: correctness vs the f32 reference on small ragged cases (page 16 and 64), then
    us / GB/s / % of copy vs the Triton kernel (default config) at `heads` heads, full-length rows.
    Writes a JSON to `out` (a directory or a .json path) if given; returns the record.
    `interpret=True` (CPU smoke test of this harness only: tiny `cases`, small copy_bytes)."""
    t_start = time.time()
    rec = {"jax": jax.__version__, "device": str(jax.devices()[0]), "semantics": semantics,
           "checks": [], "timings": []}
    configs = configs or {
        "k64": MgpuConfig(block_k=64, semantics=semantics),
        "k32": MgpuConfig(block_k=32, semantics=semantics),
        "wg2_k32s3": MgpuConfig(block_k=32, stages=3, warpgroups=2, semantics=semantics),
        "wg2_k32s4": MgpuConfig(block_k=32, stages=4, warpgroups=2, semantics=semantics)}
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
        if time.time() - t_start > budget_s:
            rec["timings"].append({"B": B, "context": ctx, "skipped": "budget"})
            print(json.dumps(rec["timings"][-1]), flush=True)
            continue
        arg_sets = _bench_case(jax.random.key(2), B, ctx, heads, page, min_pool_bytes)
        nbytes = B * ctx * 576 * 2
        row = {"B": B, "context": ctx, "heads": heads, "MB": nbytes / 1e6,
               "pool_copies": len(arg_sets)}
        for name, fn in fns.items():
            try:
                us = _time(fn, arg_sets, iters=iters)
                gbs = nbytes / (us * 1e-6) / 1e9
                row[name] = {"us": round(us, 1), "GBs": round(gbs, 1),
                             "pct_copy": round(100 * gbs / rec["copy_gbs"], 1)}
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


def _main(argv):
    out, semantics, budget = None, "Lane", 140.0
    for arg in argv:
        if arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        elif arg.startswith("--semantics="):
            semantics = arg.split("=", 1)[1]
        elif arg.startswith("--budget_s="):
            budget = float(arg.split("=", 1)[1])
        else:
            raise SystemExit(f"unknown argument {arg} (--out=DIR, --semantics=Lane|Warpgroup, "
                             f"--budget_s=S)")
    check_and_time(out, semantics=semantics, budget_s=budget)


if __name__ == "__main__":
    _main(sys.argv[1:])
