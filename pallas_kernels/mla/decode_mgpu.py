"""Absorbed MLA paged decode on Pallas **Mosaic GPU** (wgmma + TMA), 64 query rows per CTA (H200 / sm_90).

Contract (as `decode.mla_decode_partials`, flash-decoding partials, so `decode.finish` merges the splits):
`mla_decode_partials_mgpu(q_lat [B, M, A], q_pe [B, M, R], pool [X, page, A+R], block_table [B, P],
lengths [B]) -> o [B, splits, M, A] f32 (each split normalized), lse [B, splits, M] f32 (natural log,
-inf for an empty split)`. `mla_paged_attention_mgpu` is the full op (cached tokens here, the step's new
tokens and the merge by `decode.finish`), a drop-in for `decode.mla_paged_attention`. Under
`schedule='balanced'` CTA (b, j) reads work item b * splits + j of `decode.balanced_items`
(`_work_item`: its row's queries, pages and token range) and `combine` merges the items by row.

The kernel (`kernel`): grid (row blocks, splits, B), one CTA = three warpgroups sharing Q [64, 576] bf16
(72 KiB, one TMA), two pair slots of [64, 576] (each a pair of 32-token tiles, 144 KiB), one P [64, 64]
bf16 buffer and one [2, 64] f32 row-vector buffer x: 231,936 B by `smem_bytes` (Mosaic's reduction
scratch cut to 1 KiB, the barriers included) of the 232,448 sm_90 allows. Per pair i (pair slot ps = i % slots):

  warpgroup 2 (producer, 40 registers): loads Q and the first pairs, then refills slot ps with pair
                i + slots once both computing warpgroups released it (`consumed`, every phase waited);
                it reads the block table itself, so the computing warpgroups never load page ids.
  warpgroup 0:  wait the pair; S = Q pair^T [64, 64] (one wgmma series, N = 64), scaled (log2 units)
                and masked; m' = max(m, rowmax S); corr = 2^(m - m'); P = 2^(S - m'); l = l corr + rowsum P
                wait p_free (warpgroup 1 done with the previous P and corr; not before pair 0)
                P -> p_smem (bf16), corr -> x[0]; arrive p_bar
                acc_0 = acc_0 corr + P @ pair[:, 0:A/2]; release the pair
  warpgroup 1:  wait the pair (its barrier phase and the TMA's writes), wait p_bar; corr <- x[0]
                acc_1 = acc_1 corr + P @ pair[:, A/2:A]; arrive p_free; release the pair

Warpgroups 0 and 1 run with 232 registers each (setmaxnreg); each holds a [64, 256] f32 accumulator.
There is no max exchange, and warpgroup 0 waits for warpgroup 1 inside a pair only for the previous P's
release (p_free), which warpgroup 1 gives right after its P @ C, about one S earlier.

Barrier phases. In Lane semantics Pallas scales a barrier's count by 128 and every thread arrives once,
so `barrier_arrive` from a warpgroup is one arrival; `barrier_wait` keeps a per-thread phase bit per
barrier, flipped at each wait, so a thread must wait on every phase of a barrier it waits on (mbarrier
parity waits cannot tell phase k from k + 2). p_bar is arrived for pair i + 1 only after warpgroup 0
waited p_free(i), which warpgroup 1 arrives after waiting p_bar(i); p_free(i + 1) follows p_bar(i + 1),
which follows warpgroup 0's p_free(i) wait. x[0] and p_smem are rewritten only after p_free. After the
loop warpgroup 0 writes l to x[1] and arrives l_bar; warpgroup 1 reads it; a two-arrival `done` barrier
comes before the epilogue's o / lse staging (aliased with the loop's shared memory through
`plgpu.RefUnion`) is written. Warpgroup 1 keeps no running max: warpgroup 0 writes lse.

Pages and splits. A tile of 32 tokens is 32 / page TMA copies of whole pages ([page, 576] is contiguous
in the pool; page 64 copies half a page), all arriving on the pair slot's barrier, so its arrival count
never depends on the length: tail copies are clamped to the split's last real token (finite data, scores
masked), and the padding tile of an odd tile count is a copy of the split's last page (all scores masked,
p = 0). Split j of row b covers [j chunk_b, min((j + 1) chunk_b, len_b)) with chunk_b = ceil(len_b /
splits) rounded up to a pair (64 tokens); programs past the length write o = 0, lse = -inf. Automatic
splits fill the 132 SMs once (`waves` times), at least `min_split_tokens` per split: each split writes
64 x 512 f32 = 128 KiB of o that the combine reads back, against 1152 B per cached token.

CPU checks (tests/kernels/test_mla_decode_mgpu.py). The kernel body runs under the Mosaic GPU
interpreter (`interpret_params`: simulated shared memory, TMA with barriers, wgmma; a happens-before
race detector with `detect_races=True`, `races_found()`), which completes wgmma and TMA at once: it
checks the barrier protocol, not asynchrony. Two gaps of jax 0.10.2's interpreter are bridged in
interpret mode only: `layout_cast` is skipped (`_lc`), and a transposed wgmma operand goes through a
wrapped interpreter callback (`_install_interpret_shims`); the staging there is separate buffers (that
interpreter rejects aliased refs). Run it with several host devices
(`--xla_force_host_platform_device_count=8`, as tests/conftest.py): with one CPU device on 2 cores the
multi-warpgroup kernel can deadlock the interpreter (a barrier-wait callback blocks while the other
warpgroup's XLA execution gets no thread). The GPU path traces and lowers to Mosaic GPU MLIR for cuda on
CPU in both lowering semantics; the lowering also counts the CTA's shared memory against sm_90's.

Limits: bf16 only; A / 2 a multiple of 64 and <= 256 (wgmma N); R such that C = A + R is a multiple of
64; a page size that is a multiple of 8 and divides or is a multiple of 32; query rows padded to a
multiple of 64 (8 heads x T = 1 would do 8x the MMA work: the Triton kernel serves those). Lane lowering
semantics by default (`MgpuConfig.semantics`). The design lessons behind this kernel: NOTES.md.

Over 600 lines: the served kernel, its helpers and the interpreter shims it needs read in one file.
"""
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
# Mosaic's cross-warp reduction scratch (CompilerParams.reduction_scratch_bytes, default 2048) cut to 1024
# to make room for the [2, 64] f32 row-vector buffer x (512 B in a 1 KiB allocation): the row reductions
# of a WGMMA-layout array stay within a warp and use none.
_REDUCTION_SCRATCH = 1024
# registers per thread of the producer warpgroup and of the two computing ones (setmaxnreg; 384 threads
# start at 65536 / 384 = 170; 40 + 2 x 232 = 504 <= 512 per lane of 128)
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """The kernel's choices (static under jit). The defaults are the served ones (`SERVING_CONFIGS`)."""
    block_k: int = 32             # tokens per tile; a pair of tiles is one score wgmma with N = 2 block_k
    stages: int = 4               # tiles in shared memory, in pair slots (4: two pairs in flight)
    mask_tail_only: bool = True   # scores masked only in tiles that reach past the split's end
    o_bmsa: bool = False          # partials o as [B, M, splits, A] (the combine's order: no transpose
    #                               before it) instead of [B, splits, M, A]
    num_splits: int = 0           # 0: automatic (`resolve_config`)
    waves: int = 1                # automatic splits: CTAs for this many rounds of one CTA per SM
    min_split_tokens: int = 512   # automatic splits: at least this many tokens per split
    semantics: str = "Lane"       # Mosaic GPU lowering semantics ("Lane" or "Warpgroup")
    finish: str = "xla"           # new tokens + combine: 'xla' or 'kernel' (finish.finish_partials, one
    #                               Triton launch; [B, splits, M, A] partials only, not o_bmsa)
    schedule: str = "rows"        # 'rows' or 'balanced' (decode.MlaDecodeConfig.schedule)

    def __post_init__(self):
        if self.min_split_tokens < 1:
            raise ValueError(f"MgpuConfig.min_split_tokens={self.min_split_tokens} must be >= 1")
        if self.finish not in mla_finish.FINISHES:
            raise ValueError(f"MgpuConfig.finish={self.finish!r} not in {mla_finish.FINISHES}")
        tri.check_schedule("MgpuConfig", self.schedule, self.finish, o_bmsa=self.o_bmsa)


# The served configs by shape class (H200, 64 heads; BENCHMARKS.md, "MLA decode attention"). A single row's 132
# splits make XLA's finishing ops the largest fixed cost, so it takes the one-launch finish (device time
# per call 32.1 vs 36.3 us at 1 x 32K, 63.2 vs 65.5 us at 1 x 128K); from two rows up the two tie.
SERVING_CONFIGS = {
    "one_row": MgpuConfig(finish="kernel"),
    "rows": MgpuConfig(),
}


def shape_class(batch: int) -> str:
    """The `SERVING_CONFIGS` key of a batch of `batch` rows."""
    return "one_row" if batch == 1 else "rows"


def serving_config(batch: int, schedule: Optional[str] = None) -> MgpuConfig:
    """What kimi_jax.ops runs for `batch` rows. `schedule`: a forced one (the ExecPlan's `mla_schedule`), with
    XLA's finish (the only one the balanced schedule takes)."""
    if schedule is not None:
        return dataclasses.replace(SERVING_CONFIGS["rows"], schedule=schedule)
    return SERVING_CONFIGS[shape_class(batch)]


def smem_bytes(bk: int, stages: int, c: int, dtype_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q, stages / 2 pair slots of [2 bk, C], P [64, 2 bk], x (1 KiB), the
    1 KiB reduction scratch and the barriers (_SMEM_RESERVED counts 2 KiB of scratch)."""
    return ((_ROWS * c + stages * bk * c + _ROWS * 2 * bk) * dtype_bytes + 1024
            + _SMEM_RESERVED - (2048 - _REDUCTION_SCRATCH))


def _balanced_work(lengths_B, cfg: MgpuConfig):
    """The balanced schedule's work table for a resolved config (one item per CTA slot (b, j); items of
    whole pairs)."""
    return tri.balanced_items(lengths_B, lengths_B.shape[0] * cfg.num_splits, 2 * cfg.block_k)


def resolve_config(cfg: Optional[MgpuConfig], batch: int, rows: int, max_tokens: int) -> MgpuConfig:
    """`cfg` with its splits chosen: one CTA per (row block, split, row), enough to fill the SMs `waves`
    times, at most one split per `min_split_tokens` of the table's `max_tokens`."""
    cfg = cfg or MgpuConfig()
    splits = cfg.num_splits
    if not splits:
        ctas = batch * (-(-rows // _ROWS))
        slots = NUM_SMS * max(1, cfg.waves)
        splits = max(1, min(slots // ctas if ctas < slots else 1, -(-max_tokens // cfg.min_split_tokens)))
    return dataclasses.replace(cfg, num_splits=splits)


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
# The kernel's parts.

def _tile_positions(page: int, base, end, bk: int):
    """The first cached position of each page copy of the `bk` tokens [base, base + bk): bk / page
    whole pages, or one part of a page when page > bk. Positions at or past `end` re-read the split's
    last real tokens (clamped to end - 1: finite cache data, never an index past the row's block
    table; their scores are masked), so the copy count never depends on the length; and to >= 0, so a
    look-ahead past an empty split still reads a valid block-table entry. A tile that starts past
    `end` (the padding tile of an odd tile count) becomes a copy of the split's last page."""
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
    `decode.balanced_items`). The partials slot stays (b, j) either way."""
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
            if callable(item):   # e.g. a barrier between the wgmmas
                item()
            else:
                plgpu.wgmma(acc_ref, *item)

    if interpret:   # the interpreters (0.10.2, 0.11.2) lack run_state: same sum, two steps
        def f(acc_ref):
            issue(acc_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

    return pl.run_state(issue)(plgpu.ACC.init(acc))   # in place (no second [64, bn] f32 in registers)


def _issue_pair(bt_ref, pool_ref, b, start, end, bk: int, prefetch: int, n_pairs, k_smem, k_bars,
                i, ps, pgs=None):
    """TMA tiles 2i and 2i + 1 of the split into pair slot ps (tile slots 2 ps, 2 ps + 1). The padding
    tile of an odd tile count (2i + 1 == n_tiles) is clamped to the split's last page: finite, masked,
    p = 0. prefetch > 0: also an L2 prefetch of pair i + prefetch if the split has it (every pair
    from `prefetch` on is prefetched once, `prefetch` pairs before its copy is issued). pgs: the
    pair's page ids (two `_tile_page_ids`) if already loaded."""
    for u in range(2):
        slot = 2 * ps + u
        _issue_tile(bt_ref, pool_ref, b, start + (2 * i + u) * bk, end, bk, k_smem.at[slot],
                    k_bars.at[slot], None if pgs is None else pgs[u])
    if prefetch:
        @pl.when(i + prefetch < n_pairs)
        def _():
            for u in range(2):
                _prefetch_tile(bt_ref, pool_ref, b, start + (2 * (i + prefetch) + u) * bk, end, bk)


def _store_partials(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, *, b, j, row0, col0, h,
                    o_bmsa: bool = False):
    """Epilogue: o = acc / l (this warpgroup's [64, bn] columns), lse = m ln 2 + ln l (-inf and o = 0 for
    an empty split; acc = 0 there), staged in o_smem [64, bn] (this warpgroup's) and lse_smem [64]
    (written by h == 0 only) and TMA'd out. The staging shares the loop's shared memory: the caller makes
    sure every warpgroup is past its last read of that space first."""
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
    """What the kernel knows about its program before the loop: (the row b it
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
    """Before the pair loop: warpgroup `q_wg` loads the 64 query rows, warpgroup `tma_wg` issues the
    first pairs into every pair slot (as many as the split has), and both wait for Q."""
    @pl.when(q_wg)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, _ROWS)], q_smem, q_bar)

    for s in range(npairs):
        pl.when(jnp.logical_and(tma_wg, s < n_pairs))(functools.partial(issue_pair, k_smem, k_bars, s, s))
    plgpu.barrier_wait(q_bar)


def _producer(q_ref, q_smem, q_bar, k_smem, k_bars, consumed, b, row0, issue_pair, npairs, n_pairs):
    """The producer warpgroup: its registers cut to _PRODUCER_REGS, it
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


# ----------------------------------------------------------------------------------------------
# The kernel.

def kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, stages: int, splits: int,
           qk_scale: float, interpret: bool, o_bmsa: bool = False, mask_tail_only: bool = False):
    """The kernel (see the module docstring): grid (row_blocks, splits, B), 3 warpgroups per CTA
    (h = 0 scores, h = 0 and 1 each accumulate A / 2 latent columns, h = 2 issues the TMA)."""
    (b, j, h, c, bn, dt, npairs, start, end, n_pairs, row0, col0,
     _) = _pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, bk=bk, stages=stages, splits=splits)
    n = 2 * bk                                   # tokens per pair: the scores' N

    def issue_pair(kp, k_bars, i, ps):
        """TMA tiles 2i, 2i + 1 of the split into rows [0, bk), [bk, 2 bk) of pair slot ps, all
        copies on the slot's barrier (a padding tile is clamped to the split's last page)."""
        for u in range(2):
            _issue_tile(bt_ref, pool_ref, b, start + (2 * i + u) * bk, end, bk,
                        kp.at[ps, pl.ds(u * bk, bk)], k_bars.at[ps])

    def bcast(v, shape):
        return lax.broadcast_in_dim(v, shape, [0])

    def main(bufs, staging, k_bars, q_bar, consumed, p_bar, p_free, l_bar, done):
        q_smem, kp, p_smem, x_smem = bufs
        o_stage, lse_stage = staging

        def pv(acc, ps):
            return _accumulate(acc, lambda: [(p_smem, kp.at[ps].at[:, pl.ds(col0, bn)])], interpret)

        def score_step(i, carry):                 # warpgroup 0
            acc, m, l = carry
            ps = i % npairs
            plgpu.barrier_wait(k_bars.at[ps])
            s = _scores(q_smem, kp.at[ps], end - (start + i * n), qk_scale, interpret, mask_tail_only)
            m_next = jnp.maximum(m, s.max(axis=1))
            corr = jnp.exp2(m - m_next)
            p = jnp.exp2(s - bcast(m_next, s.shape))
            l = l * corr + p.sum(axis=1)
            pl.when(i > 0)(lambda: plgpu.barrier_wait(p_free))   # warpgroup 1 done with P(i - 1)
            p_smem[...] = p.astype(dt)
            x_smem.at[0][...] = corr
            plgpu.commit_smem()                   # P and corr visible to warpgroup 1 (and the wgmma)
            plgpu.barrier_arrive(p_bar)
            acc = pv(acc * bcast(corr, acc.shape), ps)
            plgpu.barrier_arrive(consumed.at[ps])
            return acc, m_next, l

        def pv_step(i, acc):                      # warpgroup 1
            ps = i % npairs
            plgpu.barrier_wait(k_bars.at[ps])     # the phase (parity bits) and the TMA's writes
            plgpu.barrier_wait(p_bar)
            corr = _load_rows(x_smem.at[0], interpret)
            acc = pv(acc * bcast(corr, acc.shape), ps)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[ps])
            return acc

        def finish(acc, m, l):
            plgpu.barrier_arrive(done)            # both past every read of the loop's buffers
            plgpu.barrier_wait(done)
            _store_partials(acc, m, l, o_stage.at[h], lse_stage, o_ref, lse_ref, b=lax.axis_index("b"),
                            j=j, row0=row0, col0=col0, h=h, o_bmsa=o_bmsa)

        @pl.when(h == 0)
        def _():
            plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
            plgpu.barrier_wait(q_bar)
            acc, m, l = lax.fori_loop(0, n_pairs, score_step, _init_carry(bn, interpret))
            pl.when(n_pairs > 0)(lambda: plgpu.barrier_wait(p_free))   # the last phase (parity bits)
            x_smem.at[1][...] = l
            plgpu.commit_smem()
            plgpu.barrier_arrive(l_bar)
            finish(acc, m, l)

        @pl.when(h == 1)
        def _():
            plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
            acc0, m0, _ = _init_carry(bn, interpret)
            acc = lax.fori_loop(0, n_pairs, pv_step, acc0)
            plgpu.barrier_wait(l_bar)
            finish(acc, m0, _load_rows(x_smem.at[1], interpret))

        pl.when(h == 2)(lambda: _producer(q_ref, q_smem, q_bar, kp, k_bars, consumed, b, row0,
                                          issue_pair, npairs, n_pairs))

    tiled = _tiled(n)                             # 128-byte swizzle: P [64, 64] bf16 rows
    copies = max(1, bk // pool_ref.shape[1])
    loop = (plgpu.SMEM((_ROWS, c), dt, transforms=tiled),              # Q (latent | rope)
            plgpu.SMEM((npairs, n, c), dt, transforms=tiled),          # pair slots
            plgpu.SMEM((_ROWS, n), dt, transforms=tiled),              # P
            plgpu.SMEM((2, _ROWS), jnp.float32))                       # x: corr, then l
    staging = (plgpu.SMEM((2, _ROWS, bn), jnp.float32), plgpu.SMEM((_ROWS,), jnp.float32))
    pl.run_scoped(lambda u, *bars: main(*u, *bars),
                  (loop, staging) if interpret else plgpu.RefUnion(loop, staging),
                  plgpu.Barrier(num_arrivals=2 * copies, num_barriers=npairs),   # a pair slot landed
                  plgpu.Barrier(num_arrivals=1),                                 # Q landed
                  plgpu.Barrier(num_arrivals=2, num_barriers=npairs),            # consumed
                  plgpu.Barrier(num_arrivals=1),                                 # p_bar
                  plgpu.Barrier(num_arrivals=1),                                 # p_free
                  plgpu.Barrier(num_arrivals=1),                                 # l_bar
                  plgpu.Barrier(num_arrivals=2),                                 # done
                  collective_axes="wg")


# ----------------------------------------------------------------------------------------------
# Entry points.

def _check_shapes(q_lat_BMA, q_pe_BMR, pool_XpC, block_table_BP, cfg: MgpuConfig):
    B, M, A = q_lat_BMA.shape
    R = q_pe_BMR.shape[-1]
    page = pool_XpC.shape[1]
    if pool_XpC.shape[-1] != A + R or (A + R) % 64:
        raise ValueError(f"pool {pool_XpC.shape}: last dim must be A + R = {A + R}, a multiple of 64")
    if A % 2 or (A // 2) % 64 or A // 2 > 256:
        raise ValueError(f"A={A} / 2 must be a multiple of 64 and <= 256 (wgmma N)")
    bk = cfg.block_k
    if bk % 16 or bk > 256 or bk < 16:
        raise ValueError(f"block_k={bk} must be a multiple of 16 in [16, 256]")
    if 2 * bk > 256 or (2 * bk) % 64:
        raise ValueError(f"a pair of block_k={bk} tiles is one wgmma with N = {2 * bk}; "
                         f"N must be a multiple of 64 and <= 256")
    if page % 8 or (bk % page and page % bk):
        raise ValueError(f"page size {page} must be a multiple of 8 dividing or divisible by "
                         f"block_k={bk}")
    need = smem_bytes(bk, cfg.stages, A + R)
    if need > _SMEM_LIMIT:
        raise ValueError(f"block_k={bk} x stages={cfg.stages} needs {need} B of shared memory "
                         f"(> {_SMEM_LIMIT})")
    if cfg.stages % 2 or cfg.stages < 2:
        raise ValueError(f"stages={cfg.stages} must be an even number >= 2 (tiles, 2 per pair slot)")
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
    cfg = resolve_config(config, B, M, block_table_BP.shape[1] * pool_XpC.shape[1])
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
    body = functools.partial(kernel, bk=cfg.block_k, stages=cfg.stages, splits=splits,
                             qk_scale=float(scale) * _LOG2E, interpret=interp, o_bmsa=cfg.o_bmsa,
                             mask_tail_only=cfg.mask_tail_only)
    if cfg.schedule != "balanced":
        work = lengths_B.astype(jnp.int32)
    elif work is None:
        work = _balanced_work(lengths_B, cfg)
    params = plgpu.CompilerParams(lowering_semantics=getattr(plgpu.LoweringSemantics, cfg.semantics),
                                  reduction_scratch_bytes=_REDUCTION_SCRATCH)
    kw = dict(interpret=interpret) if interp else {}
    o, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, Mp, splits, A) if cfg.o_bmsa else (B, splits, Mp, A),
                                       jnp.float32),
                  jax.ShapeDtypeStruct((B, splits, Mp), jnp.float32)),
        grid=(row_blocks, splits, B),
        grid_names=("hr", "split", "b"),
        compiler_params=params,
        num_threads=3,
        thread_name="wg",
        **kw,
    )(work, block_table_BP.astype(jnp.int32), q_BMC, pool_XpC)
    return (o[:, :M] if cfg.o_bmsa else o[:, :, :M]), lse[:, :, :M]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_lse", "combine_xla_max_macs",
                                             "one_new_token_elementwise"))
def mla_paged_attention_mgpu(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_XpC, block_table_BP, positions_BT,
                             scale: float, *, config: Optional[MgpuConfig] = None,
                             interpret: bool = False, return_lse: bool = False,
                             combine_xla_max_macs: int = 1 << 27, one_new_token_elementwise: bool = True):
    """`decode.mla_paged_attention`'s contract (cached tokens + the step's new tokens), with the cached
    part on the Mosaic GPU kernel and the new tokens merged by `decode.finish` (`decode.finish_items`
    under the balanced schedule; combine_xla_max_macs, one_new_token_elementwise: as there)."""
    B, T, N, A = q_lat_BTNA.shape
    R = q_pe_BTNR.shape[-1]
    lengths_B = jnp.maximum(positions_BT[:, 0], 0)
    work = None
    if config is not None and config.schedule == "balanced":   # one table for the kernel and the combine
        work = _balanced_work(lengths_B, resolve_config(config, B, T * N,
                                                        block_table_BP.shape[1] * pool_XpC.shape[1]))
    o_BJMA, lse_BJM = mla_decode_partials_mgpu(
        q_lat_BTNA.reshape(B, T * N, A), q_pe_BTNR.astype(q_lat_BTNA.dtype).reshape(B, T * N, R),
        pool_XpC, block_table_BP, lengths_B, scale=scale, config=config, interpret=interpret, work=work)
    if work is not None:
        o_BTNA, lse_BTN = tri.finish_items(o_BJMA, lse_BJM, work, q_lat_BTNA, q_pe_BTNR, new_BTC,
                                           positions_BT, scale, interpret=bool(interpret),
                                           combine_xla_max_macs=combine_xla_max_macs,
                                           one_new_token_elementwise=one_new_token_elementwise)
    else:
        o_BTNA, lse_BTN = tri.finish(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale,
                                     kernel=config is not None and config.finish == "kernel",
                                     interpret=bool(interpret), splits_minor=config is not None and config.o_bmsa,
                                     one_new_token_elementwise=one_new_token_elementwise)
    o_BTNA = o_BTNA.astype(q_lat_BTNA.dtype)
    return (o_BTNA, lse_BTN) if return_lse else o_BTNA
