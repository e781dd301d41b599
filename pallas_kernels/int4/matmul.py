"""Dense INT4 W4A16 matmul: y[M, N] = x[M, K] @ dequant(packed, scale)[N, K]^T, float32 accumulation.

Weights stay in the checkpoint layout (compressed-tensors pack-quantized, rows = output features):
packed int32 [N, K/8] (8 nibbles per word, u = q + 8), scale bf16 [N, K/g]. No repacking: the
kernel reads the words as int16 half-words; the int32 -> int16 view XLA inserts is free (measured:
int32 and pre-viewed int16 inputs time the same), so `repack` is optional.

Backend: Pallas **Triton**. Reasons (measured/inspected, see pallas_kernels/NOTES.md):
  * it runs under plain `interpret=True` on CPU, so the CPU test suite checks the same kernel body
    (Mosaic GPU needs a private GPU interpreter);
  * its Triton IR can be compiled to SASS off-GPU (triton 3.6 + ptxas), which is how the kernels
    were tuned (instruction counts, registers, shared memory) within a ~15-minute GPU budget;
  * it lowers int32 bit ops, `elementwise_inline_asm` (the lop3/bf16x2 dequantizer) and `dot` to
    tensor-core MMA on sm_90. Measured on the H200: the MoE kernels alone stream weights at 94-97% of
    the copy bandwidth at 16 tokens, so wgmma/TMA (Mosaic GPU's advantages) are not what is missing;
  * it works unchanged on jax 0.10.2 and 0.11.2 (deprecated in 0.11 but present; the deprecation
    warning is expected). Mosaic GPU's API churns between those versions.

Kernel: grid (cdiv(M, BM), N / BN[, split_k]). Each program streams [BN, BK/4] int16 half-words
(= BK/8 packed words) + [BN, BK/g] scales per K step, dequantizes them in registers into 4 bf16
"pair-planes" (tile.py: one lop3 yields two MMA-ready bf16 values, 15 instructions per 8
weights) and runs 4 MMAs against the activation pair-planes (x's columns permuted once by XLA,
`x_layout='perm'`, or in registers from a contiguous load, `'shuffle'`: one launch per call).
Split-K partials are summed by one XLA op (`split_reduce='xla'`), by f32 atomics into a zeroed
buffer (`'atomic'`), or never leave the program (`'cta'`, the default at M <= 8: its MMA rows are
K-slices of its weight rows, `_kernel_cta`; one launch, bf16 out). For decode the tokens are the
MMA's 16-row side and the 4 warps split the weight rows, so no weight is dequantized twice (checked
in the SASS). Rows past M are masked.

`interpret=None`: interpret on CPU, compiled on GPU. In interpret mode the 'asm' dequantizer is replaced
by the bit-identical 'f32' one (inline PTX cannot run on CPU).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import reference as int4_ref
from pallas_kernels.int4 import tile

repack = tile.repack
SPLIT_REDUCES = ("xla", "atomic", "cta")


@dataclasses.dataclass(frozen=True)
class Int4MatmulConfig:
    block_m: int = 16          # token rows per program (MMA minimum: 16, or 8 with swap_ab)
    block_n: int = 32          # output features per program
    block_k: int = 512         # input features per K step (multiple of 128 and of the group size)
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "asm"       # 'asm' (PTX lop3 + bf16x2) or 'f32' (plain jnp)
    swap_ab: bool = False      # True: weights on the MMA's M side (needs block_n >= 16*num_warps)
    x_layout: str = "perm"     # 'perm': XLA permutes x's columns first; 'natural': strided gather
                               # in-kernel; 'shuffle': contiguous load split in registers (no XLA op)
    split_k: int = 1           # >1: K split over programs, partials reduced per split_reduce
    split_reduce: str = "xla"  # split_k > 1: 'xla' (f32 partials [split, M, N] summed by one XLA op)
                               # or 'atomic' (f32 atomic adds into a zeroed [M, N] buffer, then cast)
                               # or 'cta' (the K split inside each program: `_kernel_cta`, one launch,
                               # x.dtype out; swap_ab, block_n = the program's 16 * num_warps MMA rows)

    def __post_init__(self):
        if self.x_layout not in tile.X_LAYOUTS:
            raise ValueError(f"x_layout {self.x_layout!r} not in {tile.X_LAYOUTS}")
        if self.split_reduce not in SPLIT_REDUCES:
            raise ValueError(f"split_reduce {self.split_reduce!r} not in {SPLIT_REDUCES}")


def _cta_split(m: int, n: int, k: int) -> int:
    """split_k for the one-launch 'cta' kernel at M <= 8 (0: the shape does not tile): 4 K-slices of 16
    rows for M <= 2 at K >= 4096, else 2 of 32 (H200, ncu: gate+up M = 1 10.0 us
    at 4 slices vs 11.8 at 2; M = 4 12.3 vs 12.0; down 7.6 / 9.0 vs 7.5 / 7.3)."""
    split = 4 if m <= 2 and k >= 4096 else 2
    return split if m <= 8 and k % (split * 256) == 0 and n % (64 // split) == 0 else 0


def default_config(m: int, n: int, k: int) -> Int4MatmulConfig:
    """M <= 8: ONE launch with the K split inside the program (split_reduce='cta': MMA rows are K-slices
    of the program's weight rows, x permuted in registers, bf16 out): under ncu on the H200 10.0 / 12.3
    us (gate+up 4096 x 7168, M = 1 / 4) and 7.5 / 7.3 us (down 7168 x 2048) for the whole op, against
    torch's INT4 kernel's 12.5 / 16.9 and 8.6 / 11.1, and 10.3 / 10.0 and 8.1 / 8.1 for split-K 4 summed
    by f32 atomics plus an XLA zero fill and a cast (~2.5 us each under ncu). Shapes 'cta' cannot tile
    take that split-K 4 atomic config. 8 < M <= 32: tokens on the MMA's 16-row side, 4 warps each
    streaming 8 of the 32 weight rows of a program (no weight is dequantized twice), 1024-wide K steps,
    4 stages. 8 < M <= 16 (device time in the stream, BENCHMARKS.md "INT4 W4A16 kernels"): K < 4096 (down 7168 x 2048) the 'cta' kernel with 2 slices, 8.6-9.0 us
    against that config's 11.4-12.1; K >= 4096 (gate+up 4096 x 7168) 64 weight rows per program on the
    MMA's M side, split-K 4 summed by one XLA op, 12.9 us against 14.5."""
    split = _cta_split(m, n, k)
    if split:
        return Int4MatmulConfig(block_n=64, block_k=256, swap_ab=True, split_k=split, split_reduce="cta",
                                x_layout="shuffle")
    if m <= 8 and k % (4 * 256) == 0 and n % 64 == 0:
        return Int4MatmulConfig(block_m=8, block_n=64, block_k=256, swap_ab=True, split_k=4,
                                split_reduce="atomic", x_layout="shuffle")
    if 8 < m <= 16 and k < 4096 and k % 512 == 0 and n % 32 == 0:
        return Int4MatmulConfig(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta",
                                x_layout="shuffle")
    if 8 < m <= 16 and k % 1024 == 0 and n % 64 == 0:
        return Int4MatmulConfig(block_m=16, block_n=64, block_k=256, swap_ab=True, split_k=4)
    if m <= 32:
        return Int4MatmulConfig(block_m=16, block_n=32, block_k=1024, num_warps=4, num_stages=4,
                                swap_ab=False, x_layout="perm")
    if m <= 128:
        return Int4MatmulConfig(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=3,
                                swap_ab=False)
    return Int4MatmulConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                            swap_ab=False)


def _kernel(x_ref, w_ref, s_ref, *refs, m, k, group, cfg: Int4MatmulConfig, mode: str,
            interp: bool):
    o_ref = refs[-1]            # refs = (o_ref,) or (zeros_ref aliased to o_ref, o_ref)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bc, bkg = bk // 4, bk // group              # int16 columns (= pair-plane width), scale columns
    i, j = pl.program_id(0), pl.program_id(1)
    k_len = k // cfg.split_k
    ks = pl.program_id(2) * (k_len // bk) if cfg.split_k > 1 else 0   # first K step of this split
    # Rows past M: activation loads are masked (no memory traffic at M=1, addresses clamped to M-1)
    # and so are the stores (unclamped rows; out-of-range masked lanes write nothing).
    rr = i * bm + jnp.arange(bm, dtype=jnp.int32)
    valid = (rr < m)[:, None]
    rows = jnp.minimum(rr, m - 1)[:, None]                                             # [BM, 1]
    n0 = pl.multiple_of(j * bn, bn)

    def body(kk, acc):
        kk = kk + ks
        c0 = pl.multiple_of(kk * bc, bc)
        w = tile.load(w_ref.at[pl.ds(n0, bn), pl.ds(c0, bc)])
        s = tile.load(s_ref.at[pl.ds(n0, bn), pl.ds(kk * bkg, bkg)])
        planes = tile.dequant_pairs(w, tile.expand_scale(s, bc), mode)
        xps = tile.load_x_planes(x_ref, rows, valid, kk, c0, k, bk, cfg.x_layout)
        for p in range(tile.NPLANES):
            acc = acc + tile.plane_dot(planes[p], xps[p], cfg.swap_ab)
        return acc

    acc_shape = (bn, bm) if cfg.swap_ab else (bm, bn)
    acc = lax.fori_loop(0, k_len // bk, body, jnp.zeros(acc_shape, jnp.float32))
    out = acc.T if cfg.swap_ab else acc
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)[None, :]
    if cfg.split_k > 1 and cfg.split_reduce == "atomic":
        # o_ref has cdiv(M, BM) * BM rows, so every lane has its own address (interpret mode adds
        # the padded rows' zeros too); on the GPU the mask only saves the padded rows' atomics.
        tile.atomic_accumulate(o_ref, (rr[:, None], cols), out, valid, interp=interp, relaxed=False)
    elif cfg.split_k > 1:
        tile.store(o_ref.at[pl.program_id(2), rr[:, None], cols], out, mask=valid)
    else:
        tile.store(o_ref.at[rr[:, None], cols], out.astype(o_ref.dtype), mask=valid)


def cta_partials(x_ref, w_ref, s_ref, wrow0, xrow0, *, m, k, group, cfg: Int4MatmulConfig, mode: str,
                 mp: int) -> jax.Array:
    """The 'cta' program's product: f32 [R, mp], weight rows [wrow0, wrow0 + R) of w_ref (int16 half-words
    [rows, K/4], scales s_ref [rows, K/g]) times token rows [xrow0, xrow0 + m) of x_ref (natural or perm
    columns per cfg.x_layout); column t >= m is zero. (R = block_n / split_k; see `_kernel_cta`. Also the
    MoE decode path's per-pair programs, `moe_decode.pairs_matmul_cta`, which point wrow0 into one expert.)"""
    bn, bm, bk, S = cfg.block_n, cfg.block_m, cfg.block_k, cfg.split_k
    R = bn // S
    bc, bkg = bk // 4, bk // group
    kq = k // S                                          # natural columns per slice
    v = jnp.arange(bn, dtype=jnp.int32)
    q_v, r_v = v // R, v % R
    c = jnp.arange(bm, dtype=jnp.int32)
    q_c, t_c = c // mp, c % mp
    live_c = (q_c < S) & (t_c < m)                       # [BM]
    rows_c = (xrow0 + jnp.minimum(t_c, m - 1))[:, None]  # [BM, 1] token rows (clamped; masked)
    wrow = (wrow0 + r_v)[:, None]                        # [BN, 1]
    ic = jnp.arange(bc, dtype=jnp.int32)[None, :]
    ig = jnp.arange(bkg, dtype=jnp.int32)[None, :]

    def body(kk, acc):
        w = tile.load(w_ref.at[wrow, (q_v * (kq // 4))[:, None] + kk * bc + ic])
        sc = tile.load(s_ref.at[wrow, (q_v * (kq // group))[:, None] + kk * bkg + ig])
        planes = tile.dequant_pairs(w, tile.expand_scale(sc, bc), mode)
        if cfg.x_layout == "shuffle":
            cols = (q_c * kq)[:, None] + kk * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
            xps = tile.split_planes(tile.load(x_ref.at[rows_c, cols], mask=live_c[:, None], other=0.0))
        else:                                            # 'perm': plane p at columns [p K/4, (p+1) K/4)
            xps = [tile.load(x_ref.at[rows_c, p * (k // 4) + (q_c * (kq // 4))[:, None] + kk * bc + ic],
                             mask=live_c[:, None], other=0.0) for p in range(tile.NPLANES)]
        for p in range(tile.NPLANES):
            acc = acc + tile.plane_dot(planes[p], xps[p], True)
        return acc

    acc = lax.fori_loop(0, kq // bk, body, jnp.zeros((bn, bm), jnp.float32))
    keep = (q_v[:, None] == q_c[None, :]) & live_c[None, :]
    part = jnp.where(keep, acc, 0.0).reshape(S, R, bm).sum(axis=0)       # [R, BM]: slices summed
    return part.reshape(R, bm // mp, mp).sum(axis=1)                     # [R, mp]: token t's column


def _kernel_cta(x_ref, w_ref, s_ref, o_ref, *, m, k, group, cfg: Int4MatmulConfig, mode: str, mp: int):
    """split_reduce='cta': the K split inside the program, so no partials leave it (one launch, no
    zero fill, no cast: what the atomic split-K default pays two extra launches for at M <= 8).

    The program's block_n MMA rows are S = split_k K-slices of R = block_n / S real weight rows: MMA
    row v = q * R + r holds weight row n0 + r over K-slice q (natural columns [q K/S, (q+1) K/S)), so
    each warp's 16 rows stream one slice (R = 16: warp q streams slice q). The activations are the
    MMA's other side: column c = q' * mp + t holds token t's slice q' (mp = M padded to a power of
    two). acc[v, c] is then a partial dot for (row r, token t, slice q) wherever q' = q; the epilogue
    keeps those and sums the S slices in registers (`cta_partials`)."""
    R = cfg.block_n // cfg.split_k
    n0 = pl.multiple_of(pl.program_id(1) * R, R)
    y = cta_partials(x_ref, w_ref, s_ref, n0, 0, m=m, k=k, group=group, cfg=cfg, mode=mode, mp=mp)
    t = jnp.arange(mp, dtype=jnp.int32)
    # rows t >= M are masked lanes at distinct (out-of-range) addresses: a masked store with duplicate
    # indices is ambiguous in interpret mode (NOTES.md, "Things learned" 2)
    tile.store(o_ref.at[t[:, None], (n0 + jnp.arange(R, dtype=jnp.int32))[None, :]],
               y.T.astype(o_ref.dtype), mask=(t < m)[:, None])


def cta_config(cfg: Int4MatmulConfig, m: int, k: int, group: int) -> tuple[Int4MatmulConfig, int]:
    """A 'cta' config resolved for M tokens and K: (block_k fitted to a slice, block_m = split_k x mp;
    mp = M padded to a power of two), or ValueError naming what does not tile."""
    S = cfg.split_k
    if not cfg.swap_ab or cfg.block_n != 16 * cfg.num_warps or cfg.block_n % S or cfg.x_layout == "natural":
        raise ValueError(f"split_reduce='cta' needs swap_ab, block_n = 16 * num_warps divisible by split_k "
                         f"and x_layout 'shuffle' or 'perm': {cfg}")
    mp = 1 << max(0, (m - 1).bit_length())
    bm = max(8, S * mp)
    if k % S or bm > 64:
        raise ValueError(f"split_reduce='cta': K={k} must divide by split_k={S} and split_k * M (padded to a "
                         f"power of two) <= 64 (M={m})")
    bk = tile.pick_block_k(k // S, max(cfg.block_k, group))
    if bk % group:
        raise ValueError(f"group {group} must divide block_k {bk}")
    return dataclasses.replace(cfg, block_k=bk, block_m=bm), mp


def _int4_matmul_cta(x, packed, scale, cfg: Int4MatmulConfig, group: int, interp: bool):
    """split_reduce='cta' (see `_kernel_cta`): grid (1, N / R), one launch, y in x.dtype."""
    m, k = x.shape
    n = packed.shape[0]
    cfg, mp = cta_config(cfg, m, k, group)
    R = cfg.block_n // cfg.split_k
    if n % R:
        raise ValueError(f"split_reduce='cta': N={n} must divide by {R} rows per program")
    mode = "f32" if interp else cfg.dequant
    xin = tile.perm_columns(x) if cfg.x_layout == "perm" else x
    return pl.pallas_call(
        functools.partial(_kernel_cta, m=m, k=k, group=group, cfg=cfg, mode=mode, mp=mp),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(1, n // R),
        interpret=interp,
        compiler_params=tile.compiler_params(cfg.num_warps, cfg.num_stages, interp),
        name="int4_matmul_cta",
    )(xin, tile.as_int16(packed), scale.astype(jnp.bfloat16))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, *,
                config: Optional[Int4MatmulConfig] = None, interpret: Optional[bool] = None
                ) -> jax.Array:
    """y[M, N] = x[M, K] @ (q * scale)[N, K]^T in x.dtype, float32 accumulation.

    x: [M, K] bf16; packed: int32 [N, K/8] (checkpoint layout) or its int16 view [N, K/4] from
    `repack` (skips a per-call bitcast); scale: [N, K/g] (g a multiple of 8 dividing block_k).
    """
    m, k = x.shape
    n, kw = packed.shape
    kw = kw if packed.dtype == jnp.int32 else kw // 2
    if kw * 8 != k:
        raise ValueError(f"packed {packed.shape} does not match x {x.shape}")
    group = k // scale.shape[-1]
    if scale.shape != (n, k // group) or group % 8:
        raise ValueError(f"bad scale shape {scale.shape} for weight [{n}, {k}]")
    interp = tile.resolve_interpret(interpret)
    cfg = config or default_config(m, n, k)
    if cfg.split_reduce == "cta":
        return _int4_matmul_cta(x, packed, scale, cfg, group, interp)
    split = cfg.split_k
    if k % split:
        raise ValueError(f"split_k={split} must divide K={k}")
    bk = tile.pick_block_k(k // split, max(cfg.block_k, group))
    if bk % group:
        raise ValueError(f"group {group} must divide block_k {bk}")
    bn = min(cfg.block_n, n)
    if n % bn:
        raise ValueError(f"N={n} must be a multiple of block_n={bn}")
    cfg = dataclasses.replace(cfg, block_k=bk, block_n=bn)
    mode = "f32" if interp else cfg.dequant
    xin = tile.perm_columns(x) if cfg.x_layout == "perm" else x
    kernel = functools.partial(_kernel, m=m, k=k, group=group, cfg=cfg, mode=mode, interp=interp)
    grid = (pl.cdiv(m, cfg.block_m), n // bn) + ((split,) if split > 1 else ())
    args = [xin, tile.as_int16(packed), scale.astype(jnp.bfloat16)]
    aliases = {}
    if split > 1 and cfg.split_reduce == "atomic":
        out_shape = (grid[0] * cfg.block_m, n)               # padded rows: see _kernel
        args.append(jnp.zeros(out_shape, jnp.float32))
        aliases = {3: 0}
    elif split > 1:
        out_shape = (split, m, n)
    else:
        out_shape = (m, n)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split > 1 else x.dtype),
        grid=grid,
        input_output_aliases=aliases,
        interpret=interp,
        compiler_params=tile.compiler_params(cfg.num_warps, cfg.num_stages, interp),
        name="int4_matmul",
    )(*args)
    if split > 1 and cfg.split_reduce == "atomic":
        y = y[:m].astype(x.dtype)
    elif split > 1:
        y = jnp.sum(y, axis=0).astype(x.dtype)
    return y


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """Pure jnp: float32 math on the dequantized weight, result in x.dtype."""
    w = int4_ref.dequantize(packed, scale, jnp.float32)
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
