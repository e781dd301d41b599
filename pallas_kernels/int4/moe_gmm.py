"""MoE routed experts with INT4 W4A16 weights: sort by expert, grouped INT4 matmuls, weighted combine.

    y[t] = sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = idx[t, k]

Weights stay in the checkpoint layout (compressed-tensors pack-quantized, rows = output features):
  gate/up packed int32 [E, F, D/8], scale bf16 [E, F, D/32];  down packed [E, D, F/8], scale [E, D, F/32].
No repacking is needed (see NOTES.md): the kernels consume these arrays directly.

Pipeline (one jitted function, 2 Pallas kernels + a few tiny XLA ops):
  0. T <= pair_tiles_max_t (decode, default 4): no sort at all; tile i is (token, k) pair i with
     expert idx.flat[i] (a token's top-k experts are distinct; a duplicate across tokens is simply
     read twice). Only x's column permutation and the final sum remain as XLA ops.
     `decode='fused'` instead runs moe_decode.py: two kernels and no XLA op (routing read
     in-kernel, the down kernel sums a token's experts itself).
  1. otherwise, routing plan (XLA): stable argsort of the T*K expert ids, group sizes, and a static-size list of
     "tiles" (expert, first sorted row, end row) of at most BM rows each. Only experts that received
     tokens get tiles, so the kernels never touch the weights of idle experts; surplus tiles are empty
     and their programs exit at once.
  2. gate/up kernel, grid (tiles, F/BN): gathers its rows of x by token id, streams the gate AND up
     tiles of its expert, dequantizes in registers (tile.py), two MMA accumulators, epilogue
     h = silu(gate) * up (f32) -> bf16, stored with columns permuted into "plane" order so the down
     kernel's activation loads are contiguous.
  3. down kernel, grid (tiles, D/BN): streams the down tiles, multiplies each row by its routing weight
     and scatters rows to their (token, k) slot of a [T*K, D] f32 buffer (every slot written once).
  4. combine (XLA): sum over k, cast to x.dtype.

Backend: Pallas Triton, for the reasons given in matmul.py. `interpret=None` interprets on CPU.
Default tiles (decode, <= 8 rows per expert): 8 token rows per tile, weights on the MMA's M side
(m16n8k16, 4 warps x 16 weight rows = 64 features per program), 512-wide K steps, 3 stages.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import reference as int4_ref
from pallas_kernels.int4 import tile
from pallas_kernels.int4 import moe_decode

repack = tile.repack
block_down = moe_decode.block_down
DECODE_PATHS = ("tiles", "fused", "single", "chained")


@dataclasses.dataclass(frozen=True)
class MoeGmmConfig:
    block_m: int = 8             # sorted rows per tile (MMA minimum: 8 with swap_ab, else 16)
    block_n_gate_up: int = 64    # F features per gate/up program (x2: gate and up)
    block_n_down: int = 64       # D features per down program
    block_k_gate_up: int = 512   # D elements per K step of gate/up
    block_k_down: int = 512      # F elements per K step of down
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "asm"         # 'asm' | 'f32' (see tile.py)
    swap_ab: bool = True         # weights on the MMA's M side (needs block_n >= 16*num_warps)
    x_layout: str = "perm"       # 'perm': XLA permutes x columns into plane order; 'natural': strided
    pair_tiles_max_t: int = 4    # T <= this: one tile per (token, k) pair, no sort (top-k ids of a
                                 # token are distinct; duplicates across tokens are re-read)
    decode: str = "tiles"        # T <= pair_tiles_max_t: 'tiles' (pair tiles through the grouped
                                 # kernels, scatter + XLA sum over k) or 'fused' (moe_decode.py: two
                                 # launches, routing read in-kernel, down sums over k in-kernel)
                                 # or 'single' (moe_decode.moe_decode_single: one launch, program =
                                 # (pair, block_n_gate_up F slice), down split along F, f32 atomics)
                                 # or 'chained' (moe_decode, chained=True: 'fused' in ONE launch, the
                                 # down programs wait in-kernel for their token's h)
    num_warps_down: int = 0      # the down kernel's warps (every path; 0: num_warps)
    num_stages_down: int = 0     # the down kernel's stages (0: num_stages)
    single_reduce: str = "atomic"  # decode='single': 'atomic' | 'relaxed' | 'store' (moe_decode_single)
    split_k_down: int = 1        # decode='fused': down K loop split over this many programs (atomics)
    stream_k_down: int = 0       # decode='fused' / 'chained': > 0: the down blocks' K loops shared evenly
                                 # by this many programs (stream-K, atomics); 0: one program per block
    pairs_cta: int = 0           # decode='tiles', T <= pair_tiles_max_t, > 0: gate/up and down as dense-
                                 # style programs per pair (moe_decode.pairs_matmul_cta: 16 * num_warps / S
                                 # weight rows each, the K split S = pairs_cta ways inside the program), for
                                 # steps that hold few pairs (EP decode); silu and the sum over k by XLA;
                                 # x read in natural order (split in registers) whatever x_layout says
    split_gate_up: bool = False  # decode='tiles', T <= pair_tiles_max_t: gate and up rows in separate
                                 # programs (one weight stream each: about half the registers and shared
                                 # memory, so twice the CTAs per SM), f32 results, silu(gate) * up by XLA

    def __post_init__(self):
        if self.x_layout not in tile.X_LAYOUTS:
            raise ValueError(f"x_layout {self.x_layout!r} not in {tile.X_LAYOUTS}")
        if self.decode not in DECODE_PATHS:
            raise ValueError(f"decode {self.decode!r} not in {DECODE_PATHS}")


# Expected pairs held on this device (T * top-k * held share) at or below which the default runs each
# held pair as dense-style programs (`pairs_cta`), and the K split it uses. H200, device span
# (BENCHMARKS.md, "INT4 experts under expert parallelism"): 1 held pair at
# T = 1 23.6 us (split 4; split 2: 31.2) vs 45.6 for the pair tiles, 2 held pairs 29.9 (split 2: 36.2) vs
# 49.2; 4 held pairs at T = 1 (EP2) 42.9 with split 2 (split 4: 44.0) vs 51.5, at T = 4 with 1 of 8 held
# 51.2 (split 4: 53.2) vs 53.5; with 8 held pairs it loses (T = 1 all held 72.8 vs 62.0, T = 4 with 2 of
# 8 held 82.4 vs 66.8) or ties (T = 8 with 1 of 8 held: 92.0 vs 91.5).
PAIRS_CTA_MAX_HELD = 4.0
# ... and where the pair tiles would have at most this many gate/up programs, pairs_cta with the K split 4 ways
# whatever the pairs held: one TP8 shard's experts (F = 256, all 8 pairs held) at T = 1 have 32 such programs on
# the H200's 132 SMs, 28.5 us against 38.8 for the pair tiles (`kimi-bench int4 --moe_intermediate=256
# --moe_configs=tp8`, BENCHMARKS.md "INT4 experts at one TP8 shard's widths"); at T = 4 (128 programs) it lost
# (split 2: 59.4 against 56.6; split 4: 70.5)
PAIRS_CTA_MAX_TILE_PROGRAMS = 32
# at most this many gate/up programs (and not pairs_cta): the two-launch decode path with 32-row gate/up tiles
# and the down loop split 4 ways: the TP8 shard at T = 4, 47.6 us against 56.6 for the pair tiles; at T = 8
# (256 programs) the pair tiles win (102.5 against 115.8-134.2 for the narrower configs)
FUSED_NARROW_MAX_TILE_PROGRAMS = 128
PAIRS_CTA_SPLIT4_MAX_HELD = 2.0
_PAIRS_CTA_BLOCK_K = 256        # the default's K step for pairs_cta's gate/up and down programs


def _pairs_cta_tiles(dims: Optional[tuple[int, int]], split: int, group: int = 32) -> bool:
    """Whether pairs_cta's programs (the kernel's own tiling rule, `moe_decode.pairs_cta_config`) tile
    experts of hidden size D and intermediate size F, dims = (D, F): gate / up [F, D], down [D, F]; None:
    assume they do."""
    if dims is None:
        return True
    d, f = dims
    try:
        for n, k in ((f, d), (d, f)):
            moe_decode.pairs_cta_config(n, k, group, split=split, num_warps=MoeGmmConfig.num_warps,
                                        block_k=_PAIRS_CTA_BLOCK_K)
    except ValueError:
        return False
    return True


def default_config(num_pairs: int, num_experts: int, held_share: float = 1.0,
                   dims: Optional[tuple[int, int]] = None) -> MoeGmmConfig:
    """Measured on H200 (BENCHMARKS.md, "INT4 W4A16 kernels"): 8-row tiles with weights on the MMA's M side win for decode
    up to 256 tokens (<= ~5 rows per expert). Larger batches use bigger token tiles (fewer weight
    re-reads); those two configs are checked for correctness but not tuned. `held_share`: the expected
    fraction of the pairs whose expert is on this device (1 / the expert-parallel degree); a step
    expected to hold at most PAIRS_CTA_MAX_HELD pairs takes `pairs_cta` (EP decode; K split 4 ways up to
    PAIRS_CTA_SPLIT4_MAX_HELD pairs, 2 ways above) if its programs tile `dims` (D, F) (K slices of at
    least 64: the demo presets' small experts do not). Narrow experts (one TP8 shard's slices), whose pair
    tiles would have few programs: pairs_cta split 4 ways at one token (PAIRS_CTA_MAX_TILE_PROGRAMS), the
    two-launch decode path with narrow tiles up to 4 tokens (FUSED_NARROW_MAX_TILE_PROGRAMS)."""
    held = num_pairs * held_share
    pairs_cta = lambda split: MoeGmmConfig(pairs_cta=split, block_k_gate_up=_PAIRS_CTA_BLOCK_K,  # noqa: E731
                                           block_k_down=_PAIRS_CTA_BLOCK_K, pair_tiles_max_t=max(4, num_pairs))
    split = 4 if held <= PAIRS_CTA_SPLIT4_MAX_HELD else 2
    if held <= PAIRS_CTA_MAX_HELD and _pairs_cta_tiles(dims, split):
        return pairs_cta(split)
    # the pair tiles' gate/up programs (a pair per tile, F / block_n_gate_up each): few leave SMs idle
    tile_programs = held * dims[1] / MoeGmmConfig.block_n_gate_up if dims else None
    if (tile_programs is not None and tile_programs <= PAIRS_CTA_MAX_TILE_PROGRAMS and num_pairs <= 8
            and _pairs_cta_tiles(dims, 4)):
        return pairs_cta(4)
    if (tile_programs is not None and tile_programs <= FUSED_NARROW_MAX_TILE_PROGRAMS and num_pairs <= 32
            and dims[0] >= 2048 and dims[1] >= 256):        # sizes like the measured shard's, not a demo's
        return MoeGmmConfig(decode="fused", block_n_gate_up=32, num_warps=2, block_n_down=32, num_warps_down=2,
                            split_k_down=4)
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if rows_per_expert <= 8:
        return MoeGmmConfig()
    if rows_per_expert <= 24:
        return MoeGmmConfig(block_m=16)
    if rows_per_expert <= 96:
        return MoeGmmConfig(block_m=64, block_n_gate_up=64, block_n_down=64, block_k_gate_up=256,
                            block_k_down=256, num_warps=4, swap_ab=False)
    return MoeGmmConfig(block_m=128, block_n_gate_up=64, block_n_down=128, block_k_gate_up=128,
                        block_k_down=128, num_warps=8, swap_ab=False)


# ExecPlan.batch_invariant's config: every T through the sorted grouped kernels with the default's
# tiles (8 rows, weights on the MMA's M side) and K steps; no pair tiles, split K or atomics, whose
# choice follows T. A row's sums then run in one order whatever its neighbours and its tile.
INVARIANT_CONFIG = MoeGmmConfig(pair_tiles_max_t=0)


class Tiles(NamedTuple):
    expert: jax.Array   # [num_tiles] int32 (0 for empty tiles)
    start: jax.Array    # [num_tiles] int32 first sorted row
    end: jax.Array      # [num_tiles] int32 one past the last row (== start for empty tiles)


def max_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(size_e / BM) for sum_e size_e = rows."""
    return min(num_experts, rows) + rows // block_m


def make_tiles(group_sizes: jax.Array, rows: int, block_m: int) -> Tiles:
    """Tiles of <= block_m consecutive sorted rows, each inside one expert's group (XLA, tiny)."""
    num_experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    offsets = ends - sizes
    ntiles = (sizes + block_m - 1) // block_m
    cum = jnp.cumsum(ntiles)
    t = jnp.arange(max_tiles(rows, num_experts, block_m), dtype=jnp.int32)
    e = jnp.minimum(jnp.sum(cum[None, :] <= t[:, None], axis=1, dtype=jnp.int32), num_experts - 1)
    start = offsets[e] + (t - (cum[e] - ntiles[e])) * block_m
    end = jnp.minimum(start + block_m, ends[e])
    valid = t < cum[-1]
    zero = jnp.zeros_like(t)
    return Tiles(jnp.where(valid, e, zero), jnp.where(valid, start, zero),
                 jnp.where(valid, end, zero))


perm_columns = tile.perm_columns


# ----------------------------------------------------------------------------------------------
# The grouped kernel (one body, static flavours).

def _grouped_kernel(*refs, k, n_weights, group, bm, bn, bk, cfg: MoeGmmConfig, mode, a_layout,
                    a_rows, out_mode, n_out, rows_a):
    it = iter(refs)
    te_ref, ts_ref, tend_ref = next(it), next(it), next(it)
    arow_ref = next(it) if a_rows == "indirect" else None
    if out_mode == "scatter":
        dest_ref, rw_ref = next(it), next(it)
    a_ref = next(it)
    ws = [(next(it), next(it)) for _ in range(n_weights)]
    o_ref = next(it)

    bc, bkg = bk // 4, bk // group           # int16 columns per K step (= pair-plane width), scales
    t, j = pl.program_id(0), pl.program_id(1)
    e, r0, r1 = te_ref[t], ts_ref[t], tend_ref[t]
    n0 = pl.multiple_of(j * bn, bn)

    @pl.when(r0 < r1)
    def _():
        rr = r0 + jnp.arange(bm, dtype=jnp.int32)                     # sorted rows of this tile
        valid = rr < r1
        if a_rows == "indirect":
            arow = tile.load(arow_ref.at[pl.ds(r0, bm)])                # activation row (token)
        else:
            arow = jnp.minimum(rr, rows_a - 1)
        arow = arow[:, None]

        acc_shape = (bn, bm) if cfg.swap_ab else (bm, bn)

        def k_loop(weights, row0):
            """The K loop over D for rows [row0, row0 + bn) of each (packed, scale) weight: one f32
            accumulator per weight, the activation planes loaded once per step for all of them."""
            def body(kk, accs):
                c0 = pl.multiple_of(kk * bc, bc)
                xs = tile.load_x_planes(a_ref, arow, valid[:, None], kk, c0, k, bk, a_layout)
                new = []
                for (w_ref, s_ref), acc in zip(weights, accs):
                    w = tile.load(w_ref.at[e, pl.ds(row0, bn), pl.ds(c0, bc)])
                    s = tile.load(s_ref.at[e, pl.ds(row0, bn), pl.ds(kk * bkg, bkg)])
                    planes = tile.dequant_pairs(w, tile.expand_scale(s, bc), mode)
                    for p in range(tile.NPLANES):
                        acc = acc + tile.plane_dot(planes[p], xs[p], cfg.swap_ab)
                    new.append(acc)
                return tuple(new)
            init = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in weights)
            return lax.fori_loop(0, k // bk, body, init)

        if out_mode == "halves":
            # program column j: weight j // nb (gate 0, up 1), its rows n0 % F; each program streams
            # ONE weight (pl.when, not a select of refs: each branch loads from a static ref)
            nb = n_out // bn
            which, n0h = j // nb, pl.multiple_of((j % nb) * bn, bn)
            pc = tile.perm_index(n0h + jnp.arange(bn, dtype=jnp.int32), n_out)
            for w_i, weight in enumerate(ws):
                @pl.when(which == w_i)
                def _(weight=weight, w_i=w_i):
                    acc, = k_loop([weight], n0h)
                    acc = acc.T if cfg.swap_ab else acc                    # [BM, BN]
                    tile.store(o_ref.at[rr[:, None], w_i * n_out + pc[None, :]], acc.astype(o_ref.dtype),
                               mask=valid[:, None])
            return

        accs = k_loop(ws, n0)
        accs = [a.T if cfg.swap_ab else a for a in accs]              # [BM, BN]
        if n_weights == 2:
            g, u = accs
            res = g / (1.0 + jnp.exp(-g)) * u
        else:
            res = accs[0]
        c = n0 + jnp.arange(bn, dtype=jnp.int32)
        if out_mode == "rows":              # contiguous sorted rows, natural columns
            tile.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], res.astype(o_ref.dtype),
                       mask=valid[:, None])
        elif out_mode == "rows_perm":       # sorted rows, columns in plane order for the next GEMM
            pc = tile.perm_index(c, n_out)
            tile.store(o_ref.at[rr[:, None], pc[None, :]], res.astype(o_ref.dtype),
                       mask=valid[:, None])
        else:                               # scatter weighted rows to their (token, k) slot
            dest = tile.load(dest_ref.at[pl.ds(r0, bm)])
            rw = tile.load(rw_ref.at[pl.ds(r0, bm)])
            dummy = o_ref.shape[0] - 1
            dest = jnp.where(valid, dest, dummy)
            tile.store(o_ref.at[dest[:, None], c[None, :]],
                       (res * rw[:, None]).astype(o_ref.dtype))


def _grouped_call(tiles: Tiles, a, weights, *, out_shape, out_dtype, cfg: MoeGmmConfig, bn, bk,
                  interp, a_layout, a_rows, out_mode, arow=None, dest=None, rw=None,
                  name="grouped_int4"):
    n_weights = len(weights)
    weights = [(tile.as_int16(p), s) for p, s in weights]
    e_, n, kc = weights[0][0].shape
    k = kc * 4
    group = k // weights[0][1].shape[-1]
    bk = tile.pick_block_k(k, max(bk, group))
    bn = min(bn, n)
    if n % bn or bk % group or group % 8:
        raise ValueError(f"unsupported shape: N={n} block_n={bn} K={k} group={group} block_k={bk}")
    mode = "f32" if interp else cfg.dequant
    kernel = functools.partial(
        _grouped_kernel, k=k, n_weights=n_weights, group=group, bm=cfg.block_m, bn=bn, bk=bk,
        cfg=cfg, mode=mode, a_layout=a_layout, a_rows=a_rows, out_mode=out_mode, n_out=n,
        rows_a=a.shape[0])
    args = [tiles.expert, tiles.start, tiles.end]
    if a_rows == "indirect":
        args.append(arow)
    if out_mode == "scatter":
        args += [dest, rw]
    args.append(a)
    for p, s in weights:
        args += [p, s.astype(jnp.bfloat16)]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(tiles.expert.shape[0], (n // bn) * (n_weights if out_mode == "halves" else 1)),
        interpret=interp,
        compiler_params=tile.compiler_params(cfg.num_warps, cfg.num_stages, interp),
        name=name,
    )(*args)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_int4_matmul(x_sorted: jax.Array, group_sizes: jax.Array, packed: jax.Array,
                        scale: jax.Array, *, config: Optional[MoeGmmConfig] = None,
                        interpret: Optional[bool] = None) -> jax.Array:
    """Ragged (grouped) INT4 matmul: rows of x_sorted are grouped by expert (group_sizes[e] rows for
    expert e, in order); out[r] = x_sorted[r] @ dequant(packed[e], scale[e])^T. [R, K] -> [R, N].

    Rows past sum(group_sizes) are not written (undefined). Experts with zero rows are never read.
    """
    interp = tile.resolve_interpret(interpret)
    r, k = x_sorted.shape
    num_experts, n, _ = packed.shape
    cfg = config or default_config(r, num_experts)
    tiles = make_tiles(group_sizes, r, cfg.block_m)
    a = perm_columns(x_sorted) if cfg.x_layout == "perm" else x_sorted
    return _grouped_call(tiles, a, [(packed, scale)], out_shape=(r, n), out_dtype=x_sorted.dtype,
                         cfg=cfg, bn=cfg.block_n_down, bk=cfg.block_k_down, interp=interp,
                         a_layout=cfg.x_layout,
                         a_rows="direct", out_mode="rows", name="grouped_int4_matmul")


def _silu_mul_halves(gu: jax.Array, dtype) -> jax.Array:
    """[rows, 2F] f32 gate | up halves -> h = silu(gate) * up in dtype, rounded once as the fused
    gate/up kernel's epilogue rounds it."""
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    return (g / (1.0 + jnp.exp(-g)) * u).astype(dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "held_share", "invariant"))
def moe_experts(x_TD: jax.Array, idx_TK: jax.Array, weight_TK: jax.Array,
                gate_packed: jax.Array, gate_scale: jax.Array,
                up_packed: jax.Array, up_scale: jax.Array,
                down_packed: jax.Array, down_scale: jax.Array, *,
                config: Optional[MoeGmmConfig] = None, interpret: Optional[bool] = None,
                held_share: float = 1.0, invariant: bool = False) -> jax.Array:
    """sum_k weight[t,k] * down(silu(gate(x_t)) * up(x_t)) over experts idx[t,k]. Returns [T, D] x.dtype.

    Pairs whose id lies outside [0, E) are skipped (contribute 0, read nothing): with expert
    parallelism pass the ids of experts held on other devices as E. Experts that receive no token
    are never read. down_packed / down_scale may be in `block_down`'s layout (4-D) for the
    single-launch decode path (decode='single', T <= pair_tiles_max_t); the other paths reject it (a
    grouped down kernel reading it, one contiguous [BN, 16] tile per F block, measured 3-5x slower at
    T >= 4: BENCHMARKS.md, "INT4 W4A16 kernels"). `held_share` (1 / the expert-parallel degree) only steers the
    default config (`default_config`); the result does not depend on it. `invariant`: a token's
    result does not depend on the other tokens (INVARIANT_CONFIG unless `config` is given: its
    tiles, K steps and path the same at every T; the K picks added in pick order).
    """
    interp = tile.resolve_interpret(interpret)
    t, d = x_TD.shape
    kk = idx_TK.shape[1]
    num_experts, f, _ = gate_packed.shape
    tk = t * kk
    if invariant and config is not None and (config.pair_tiles_max_t or config.split_k_down > 1
                                             or config.stream_k_down):
        raise ValueError("moe_experts(invariant=True): the config's path must not depend on T "
                         "(pair_tiles_max_t=0, no split or stream K)")
    cfg = config or (INVARIANT_CONFIG if invariant else
                     default_config(tk, num_experts, held_share, dims=(d, f)))
    bm = cfg.block_m

    if down_packed.ndim == 4 and not (t <= cfg.pair_tiles_max_t and cfg.decode == "single"):
        raise ValueError(f"down weight {down_packed.shape} is in block_down's layout, which only the "
                         f"single-launch decode path reads (decode='single', T <= {cfg.pair_tiles_max_t}); "
                         f"this call has decode={cfg.decode!r}, T={t}")
    if t <= cfg.pair_tiles_max_t and cfg.decode != "tiles":
        weights = ((tile.as_int16(gate_packed), gate_scale), (tile.as_int16(up_packed), up_scale),
                   (tile.as_int16(down_packed), down_scale))
        common = dict(block_m=bm, block_n_down=cfg.block_n_down, swap_ab=cfg.swap_ab,
                      dequant=cfg.dequant, x_layout=cfg.x_layout, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, interp=interp)
        if cfg.decode == "single":
            return moe_decode.moe_decode_single(
                x_TD, idx_TK, weight_TK, *weights, block_f=cfg.block_n_gate_up,
                block_k=cfg.block_k_gate_up, reduce=cfg.single_reduce, **common)
        return moe_decode.moe_decode(
            x_TD, idx_TK, weight_TK, *weights, block_n_gate_up=cfg.block_n_gate_up,
            block_k_gate_up=cfg.block_k_gate_up, block_k_down=cfg.block_k_down,
            num_warps_down=cfg.num_warps_down, num_stages_down=cfg.num_stages_down,
            split_k_down=cfg.split_k_down, stream_k_down=cfg.stream_k_down,
            chained=cfg.decode == "chained", **common)

    flat = idx_TK.reshape(-1).astype(jnp.int32)
    held = (flat >= 0) & (flat < num_experts)      # ids outside [0, E) are skipped (EP: not local)
    pad = lambda v, fill: jnp.concatenate([v, jnp.full((bm,), fill, v.dtype)])
    w_flat = weight_TK.reshape(-1).astype(jnp.float32)
    if cfg.pairs_cta and t <= cfg.pair_tiles_max_t:
        common = dict(split=cfg.pairs_cta, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      dequant=cfg.dequant, interp=interp)
        gu = moe_decode.pairs_matmul_cta(
            x_TD, idx_TK, [(tile.as_int16(gate_packed), gate_scale), (tile.as_int16(up_packed), up_scale)],
            a_per_token=True, perm_out=True, block_k=cfg.block_k_gate_up, x_layout="shuffle", **common)
        h = _silu_mul_halves(gu, x_TD.dtype)                          # pair-plane column order
        y_pairs = moe_decode.pairs_matmul_cta(
            h, idx_TK, [(tile.as_int16(down_packed), down_scale)], a_per_token=False, perm_out=False,
            block_k=cfg.block_k_down, x_layout="perm", **common)
        # rows of pairs held elsewhere are never written (where, not a product, keeps them out)
        y = jnp.where(held[:, None], y_pairs * w_flat[:, None], 0.0)
        return y.reshape(t, kk, d).sum(axis=1).astype(x_TD.dtype)
    if t <= cfg.pair_tiles_max_t:
        # Decode fast path: tile i = pair i (one row, expert idx.flat[i]); no sort, no plan ops.
        pairs = jnp.arange(tk, dtype=jnp.int32)
        tiles = Tiles(jnp.where(held, flat, 0), pairs, jnp.where(held, pairs + 1, pairs))
        row_token = pad(pairs // kk, 0)
        row_dest = pad(pairs, tk)
        row_w = pad(w_flat, 0.0)
    else:
        key = jnp.where(held, flat, num_experts)                         # skipped pairs sort last
        order = jnp.argsort(key, stable=True).astype(jnp.int32)          # sorted row -> pair id
        sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
        tiles = make_tiles(sizes, tk, bm)
        row_token = pad(order // kk, 0)
        row_dest = pad(order, tk)
        row_w = pad(w_flat[order], 0.0)

    a = perm_columns(x_TD) if cfg.x_layout == "perm" else x_TD
    if cfg.split_gate_up and t <= cfg.pair_tiles_max_t:
        # gate and up in separate programs -> [gate | up] f32, both in plane column order
        gu = _grouped_call(tiles, a, [(gate_packed, gate_scale), (up_packed, up_scale)],
                           out_shape=(tk, 2 * f), out_dtype=jnp.float32, cfg=cfg, bn=cfg.block_n_gate_up,
                           bk=cfg.block_k_gate_up, interp=interp, a_layout=cfg.x_layout,
                           a_rows="indirect", out_mode="halves", arow=row_token, name="moe_gate_up_int4")
        h = _silu_mul_halves(gu, x_TD.dtype)
    else:
        h = _grouped_call(tiles, a, [(gate_packed, gate_scale), (up_packed, up_scale)],
                          out_shape=(tk, f), out_dtype=x_TD.dtype, cfg=cfg, bn=cfg.block_n_gate_up,
                          bk=cfg.block_k_gate_up, interp=interp, a_layout=cfg.x_layout,
                          a_rows="indirect", out_mode="rows_perm", arow=row_token,
                          name="moe_gate_up_int4")
    down_cfg = dataclasses.replace(cfg, num_warps=cfg.num_warps_down or cfg.num_warps,
                                   num_stages=cfg.num_stages_down or cfg.num_stages)
    y_pairs = _grouped_call(tiles, h, [(down_packed, down_scale)], out_shape=(tk + 1, d),
                            out_dtype=jnp.float32, cfg=down_cfg, bn=cfg.block_n_down,
                            bk=cfg.block_k_down, interp=interp, a_layout="perm", a_rows="direct",
                            out_mode="scatter", dest=row_dest, rw=row_w, name="moe_down_int4")
    y = jnp.where(held[:, None], y_pairs[:tk], 0.0)        # rows of skipped pairs are never written
    y = y.reshape(t, kk, d)
    if invariant:                                          # pick by pick, whatever XLA's reduce
        return functools.reduce(jnp.add, [y[:, j] for j in range(kk)]).astype(x_TD.dtype)
    return y.sum(axis=1).astype(x_TD.dtype)


# ----------------------------------------------------------------------------------------------
# References (pure jnp, float32 math on dequantized weights).

def grouped_int4_matmul_reference(x_sorted, group_sizes, packed, scale):
    r = x_sorted.shape[0]
    ends = jnp.cumsum(group_sizes)
    e_of_row = jnp.sum(jnp.arange(r)[:, None] >= ends[None, :], axis=1)
    w = int4_ref.dequantize(packed, scale, jnp.float32)                # [E, N, K]
    y = jnp.einsum("rk,rnk->rn", x_sorted.astype(jnp.float32),
                   w[jnp.minimum(e_of_row, packed.shape[0] - 1)], precision=lax.Precision.HIGHEST)
    return y.astype(x_sorted.dtype)


def moe_experts_reference(x_TD, idx_TK, weight_TK, gate_packed, gate_scale, up_packed, up_scale,
                          down_packed, down_scale):
    """Per (token, k) float32 evaluation; h is rounded to x.dtype like the kernel and the XLA path.
    Pairs with ids outside [0, E) contribute 0."""
    hp = lax.Precision.HIGHEST
    held = (idx_TK >= 0) & (idx_TK < gate_packed.shape[0])
    weight_TK = jnp.where(held, weight_TK, 0.0)
    idx_TK = jnp.where(held, idx_TK, 0)
    x = x_TD.astype(jnp.float32)
    deq = lambda p, s: int4_ref.dequantize(p[idx_TK], s[idx_TK])       # only the touched experts
    wg = deq(gate_packed, gate_scale)                                  # [T, K, F, D]
    wu = deq(up_packed, up_scale)
    wd = deq(down_packed, down_scale)                                  # [T, K, D, F]
    g = jnp.einsum("td,tkfd->tkf", x, wg, precision=hp)
    u = jnp.einsum("td,tkfd->tkf", x, wu, precision=hp)
    h = (jax.nn.silu(g) * u).astype(x_TD.dtype).astype(jnp.float32)
    y = jnp.einsum("tkf,tkdf->tkd", h, wd, precision=hp)
    return jnp.sum(y * weight_TK[..., None].astype(jnp.float32), axis=1).astype(x_TD.dtype)
