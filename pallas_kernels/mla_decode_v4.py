"""Version 4 of the 64-row Mosaic GPU MLA decode kernel (MEASURED SLOWER, kept here only in git history):
64-token tiles in one pair slot, refilled by column part (`MgpuConfig(column_refill=True)`).

Measured (BENCHMARKS.md MLA round 19): correct everywhere, 1.7-1.9x slower than version 2 (46-52% of the
copy); without refills (ABLATE_NO_REFILL) the same compute runs at 116% of the copy's rate, so the
one-slot memory pipeline, not the N = 64 compute, is what loses.

Design (FlashMLA's sm90 decode order; read, not copied). Q and each of the two tiles of a pair are held
as three column parts: L = [0, A/2), M = [A/2, A), rope = [A, C). Warpgroup 0 scores tile a and owns
output columns L; warpgroup 1 scores tile b and owns M. Per pair i (m = the running max after pair i - 1,
identical in both warpgroups; x [2, 64] f32 in shared memory):

  warpgroup 0:  S_a = Q K_a^T, one wgmma per part as it lands (L, M, rope); m_a = max(m, rowmax S_a);
                P_a = 2^(S_a - m_a); l_0 = l_0 2^(m - m_a) + rowsum P_a; m_a -> x[0]; arrive bar_A
                acc_L = acc_L 2^(m - m_a) + P_a K_aL       (P_a from registers: RS wgmma)
                refill aL with pair i + 1                  (its last reader)
                wait bar_B; m_b = x[1]; f = 2^(m_a - m_b)
                P_a f -> tile a's rope columns (S_a read them; they are dead until refilled); arrive bar_P
                acc_L = acc_L f + P_b K_bL                 (P_b from tile b's rope columns)
                refill bL and b-rope with pair i + 1; l_0 *= f
  warpgroup 1:  S_b (parts M, L, rope); wait bar_A; m_a = x[0]; m_b = max(m_a, rowmax S_b);
                P_b = 2^(S_b - m_b); l_1 = l_1 2^(m - m_b) + rowsum P_b
                P_b -> tile b's rope columns, m_b -> x[1]; arrive bar_B
                acc_R = acc_R 2^(m - m_b) + P_b K_bM       (registers)
                refill bM with pair i + 1
                wait bar_P; acc_R += (P_a f) K_aM; refill aM and a-rope with pair i + 1

After pair i acc_L, acc_R, l_0, l_1 are relative to m_b(i) >= m_a(i) >= m_b(i - 1) (every exponent <= 0);
after the loop l = l_0 + l_1 through x. A padding tile b (odd tile count) is all masked: P_b = 0. An empty
split runs no pair: o = 0, lse = -inf. Grid, splits (whole pairs: 128 tokens), partials contract and
epilogue as versions 2 and 3.

Barriers (the per-thread phase rules of mla_decode_mgpu's docstring): bar_A (0 -> 1), bar_B (1 -> 0),
bar_P (0 -> 1), once per pair each; each is arrived for pair i + 1 only after its waiter passed pair i
(bar_A(i + 1) after bar_B(i), which follows bar_A(i); bar_B(i + 1) after bar_A(i + 1); bar_P(i + 1) after
bar_B(i + 1), which follows warpgroup 1's bar_P(i) wait). x[0] is rewritten after bar_B(i), which
warpgroup 1 arrives after reading it; x[1] after bar_A(i + 1), which warpgroup 0 arrives after reading
it. A rope slot holding P is refilled only by that P's reader, after its wgmma completed, and rewritten
with the next P only after the next S (which waited for the refill). The six tile-part barriers complete
once per pair; a part is refilled only after every warpgroup that waits on it observed the phase (aM:
warpgroup 0's S_a precedes bar_A, which precedes warpgroup 1's bar_P wait; bL: warpgroup 1's S_b
precedes bar_B). Refills stop at the split's last pair. End: l_0 -> x[0], bar_A; warpgroup 1 reads it,
l_1 -> x[1], bar_B; then a two-arrival barrier before the epilogue reuses the shared memory.

Shared memory: Q 72 KiB + tiles 144 KiB + x 1 KiB + 1 KiB reduction scratch + 10 barriers (R must equal
block_k = 64 so that a tile's rope columns hold its P). Interpret mode (CPU tests): the 0.10.2
interpreter reads wgmma operands from refs only, so the own P @ C reads the rope-slot copy there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import mla_decode_mgpu as mg

plgpu = mg.plgpu
_ROWS = mg._ROWS
MASK_TAIL_ONLY = True       # scores masked only in tiles reaching past the split's end (a branch)
OWN_P_IN_REGISTERS = True   # the own P @ C as an RS wgmma (False: SS from the rope slot)
ABLATE_NO_REFILL = False    # timing only: the first pair's tiles are read again and again (no refills)


def smem_bytes(bk: int, c: int, a: int, dtype_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q and the two tiles in three column parts each, x (1 KiB), the
    reduction scratch (1 KiB) and the barriers (in mg._SMEM_RESERVED's count, which assumes 2 KiB of
    scratch). Allocations are rounded up to 1 KiB by Mosaic."""
    def kib(n):
        return -(-n // 1024) * 1024
    parts = (a // 2, a - a // 2, c - a)
    q = sum(kib(_ROWS * w * dtype_bytes) for w in parts)
    k = sum(kib(2 * bk * w * dtype_bytes) for w in parts)
    return q + k + 1024 + mg._SMEM_RESERVED - 1024


def check_config(bk: int, stages: int, c: int, a: int):
    """The shapes version 4 takes (raises ValueError naming the one at fault)."""
    if bk != 64:
        raise ValueError(f"column_refill (version 4) takes block_k=64 (S with N = 64), got {bk}")
    if stages != 2:
        raise ValueError(f"column_refill (version 4) has one pair slot: stages=2, got {stages}")
    if (a // 2) % 64 or a // 2 > 256 or a % 2:
        raise ValueError(f"column_refill: A / 2 = {a / 2} must be a multiple of 64 and <= 256")
    if c - a != bk:
        raise ValueError(f"column_refill: the rope width R = {c - a} must equal block_k = {bk} (each "
                         f"tile's rope columns hold its P [64, block_k] once scored)")
    need = smem_bytes(bk, c, a)
    if need > mg._SMEM_LIMIT:
        raise ValueError(f"column_refill: {need} B of shared memory (> {mg._SMEM_LIMIT})")


def kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, splits: int,
           qk_scale: float, interpret: bool, o_bmsa: bool = False):
    """Version 4 (see the module docstring): grid (row_blocks, splits, B), 2 warpgroups per CTA."""
    (b, j, h, c, bn, dt, _, start, end, n_pairs, row0, col0,
     _) = mg._pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, bk=bk, stages=2, splits=splits)
    page = pool_ref.shape[1]
    a = o_ref.shape[-1]
    col = (0, bn, a)                    # first column of part L, M, rope
    width = (bn, a - bn, c - a)
    L, M, ROPE = 0, 1, 2

    def bcast(v, shape):
        return lax.broadcast_in_dim(v, shape, [0])

    def main(q_l, q_m, q_r, k_l, k_m, k_r, x_smem, k_bars, q_bar, bar_a, bar_b, bar_p, done):
        wg0, wg1 = h == 0, h == 1
        q_parts, k_parts = (q_l, q_m, q_r), (k_l, k_m, k_r)
        zero = h * 0    # traced buffer indices (literal ones closed over by run_state lower badly)

        def tile(part, u):
            return k_parts[part].at[zero + u]

        def bar(u, part):
            return k_bars.at[3 * u + part]

        def tile_ids(i, u):
            """Page ids of tile u of pair i (positions clamped into the split: always valid)."""
            return mg._tile_page_ids(bt_ref, page, b, start + (2 * i + u) * bk, end, bk)

        def refill(i, u, parts, pgs):
            """TMA the column parts of tile u of pair i into their buffers, each on its barrier."""
            for src, rows in mg._tile_copies(bt_ref, pool_ref, b, start + (2 * i + u) * bk, end,
                                             bk, pgs):
                for part in parts:
                    dst = k_parts[part].at[u] if rows is None else k_parts[part].at[u, rows]
                    plgpu.copy_gmem_to_smem(src.at[:, pl.ds(col[part], width[part])], dst,
                                            bar(u, part))

        @pl.when(wg0)
        def _():
            for part in (L, M, ROPE):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[b, pl.ds(row0, _ROWS), pl.ds(col[part], width[part])],
                    q_parts[part], q_bar)

        @pl.when(jnp.logical_and(wg0, n_pairs > 0))
        def _():    # pair 0: each warpgroup issues the parts it refills in the loop
            refill(0, 0, (L,), None)
            refill(0, 1, (L, ROPE), None)

        @pl.when(jnp.logical_and(wg1, n_pairs > 0))
        def _():
            refill(0, 1, (M,), None)
            refill(0, 0, (M, ROPE), None)
        plgpu.barrier_wait(q_bar)

        def tma_wait(barrier, i):
            if ABLATE_NO_REFILL:
                pl.when(i == 0)(lambda: plgpu.barrier_wait(barrier))
            else:
                plgpu.barrier_wait(barrier)

        def scores(i, u, order):
            """S of tile u of pair i [64, bk] f32, scaled (log2 units) and masked: one wgmma per
            column part, each issued as soon as its part landed, in `order` (the part refilled
            first comes first)."""
            def qk(s_ref):
                for part in order:
                    tma_wait(bar(u, part), i)
                    plgpu.wgmma(s_ref, q_parts[part], tile(part, u).transpose((1, 0)))
                return s_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bk), jnp.float32)) * qk_scale
            valid = end - (start + (2 * i + u) * bk)

            def masked(s):   # only in a split's last tiles: the [64, bk] iota costs 32 registers
                tok = mg._lc(lax.broadcasted_iota(jnp.int32, (_ROWS, bk), 1), plgpu.Layout.WGMMA,
                             interpret)
                return jnp.where(tok < valid, s, mg._NEG)
            return lax.cond(valid >= bk, lambda s: s, masked, s) if MASK_TAIL_ONLY else masked(s)

        def write_p(p, u):
            """P of tile u into the tile's rope columns (read by S only, which has completed)."""
            tile(ROPE, u)[...] = p
            plgpu.commit_smem()                 # all 128 threads' stores done (and fenced)

        def own_pv(acc, p, u, part, written: bool):
            """acc + P_u @ tile u's `part` columns, P from registers (RS wgmma); in interpret mode
            (whose 0.10.2 wgmma reads refs only) from its copy in the rope slot (`written`: already
            there; warpgroup 1's is, and rewriting it after bar_B would race with its refill)."""
            via_smem = interpret or not OWN_P_IN_REGISTERS
            if via_smem and not written:
                write_p(p, u)
            a_op = tile(ROPE, u) if via_smem else p
            return mg._accumulate(acc, lambda: [(a_op, tile(part, u))], interpret)

        def step0(i, carry):                    # warpgroup 0: tile a, output columns L
            acc, m, l = carry
            nxt = (tile_ids(i + 1, 0), tile_ids(i + 1, 1))    # loads in flight during S
            more = i + 1 < n_pairs
            s = scores(i, 0, (L, M, ROPE))
            m_a = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - bcast(m_a, s.shape))
            corr = jnp.exp2(m - m_a)
            l = l * corr + p.sum(axis=1)
            p = p.astype(dt)                    # kept as bf16 (16 registers, not 32) until rescaled
            x_smem.at[0][...] = m_a
            plgpu.commit_smem()
            plgpu.barrier_arrive(bar_a)
            acc = own_pv(acc * bcast(corr, acc.shape), p, 0, L, written=False)
            pl.when(more & (not ABLATE_NO_REFILL))(lambda: refill(i + 1, 0, (L,), nxt[0]))
            plgpu.barrier_wait(bar_b)           # m_b in x[1], P_b in tile b's rope slot
            m_b = mg._load_rows(x_smem.at[1], interpret)
            f = jnp.exp2(m_a - m_b)
            write_p((p.astype(jnp.float32) * bcast(f, p.shape)).astype(dt), 0)   # P_a relative to m_b
            plgpu.barrier_arrive(bar_p)
            tma_wait(bar(1, L), i)              # complete (warpgroup 1 scored tile b): phase bits
            acc = mg._accumulate(acc * bcast(f, acc.shape),
                                 lambda: [(tile(ROPE, 1), tile(L, 1))], interpret)
            pl.when(more & (not ABLATE_NO_REFILL))(lambda: refill(i + 1, 1, (L, ROPE), nxt[1]))
            return acc, m_b, l * f

        def step1(i, carry):                    # warpgroup 1: tile b, output columns R
            acc, m, l = carry
            nxt = (tile_ids(i + 1, 0), tile_ids(i + 1, 1))
            more = i + 1 < n_pairs
            s = scores(i, 1, (M, L, ROPE))
            s_max = s.max(axis=1)
            plgpu.barrier_wait(bar_a)
            m_a = mg._load_rows(x_smem.at[0], interpret)
            m_b = jnp.maximum(m_a, s_max)
            p = jnp.exp2(s - bcast(m_b, s.shape))
            corr = jnp.exp2(m - m_b)
            l = l * corr + p.sum(axis=1)
            p = p.astype(dt)
            write_p(p, 1)
            x_smem.at[1][...] = m_b
            plgpu.commit_smem()
            plgpu.barrier_arrive(bar_b)
            acc = own_pv(acc * bcast(corr, acc.shape), p, 1, M, written=True)
            pl.when(more & (not ABLATE_NO_REFILL))(lambda: refill(i + 1, 1, (M,), nxt[1]))
            plgpu.barrier_wait(bar_p)           # P_a (relative to m_b) in tile a's rope slot
            tma_wait(bar(0, M), i)              # complete (warpgroup 0 scored tile a): phase bits
            acc = mg._accumulate(acc, lambda: [(tile(ROPE, 0), tile(M, 0))], interpret)
            pl.when(more & (not ABLATE_NO_REFILL))(lambda: refill(i + 1, 0, (M, ROPE), nxt[0]))
            return acc, m_b, l

        init = mg._init_carry(bn, interpret)
        acc, m, l_part = lax.cond(wg0, lambda: lax.fori_loop(0, n_pairs, step0, init),
                                  lambda: lax.fori_loop(0, n_pairs, step1, init))

        # l = l_0 + l_1 through x (module docstring, "End"), then both past every read.
        @pl.when(wg0)
        def _():
            x_smem.at[0][...] = l_part
            plgpu.commit_smem()
            plgpu.barrier_arrive(bar_a)
            plgpu.barrier_wait(bar_b)

        @pl.when(wg1)
        def _():
            plgpu.barrier_wait(bar_a)
            x_smem.at[1][...] = l_part
            plgpu.commit_smem()
            plgpu.barrier_arrive(bar_b)
        l = l_part + mg._load_rows(x_smem.at[1 - h], interpret)
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        return acc, m, l

    tiled = mg._tiled(bk)
    copies = max(1, bk // page)
    acc, m, l = pl.run_scoped(
        main,
        *[plgpu.SMEM((_ROWS, w), dt, transforms=tiled) for w in width],       # Q_L, Q_M, Q_rope
        *[plgpu.SMEM((2, bk, w), dt, transforms=tiled) for w in width],       # K_L, K_M, K_rope: a, b
        plgpu.SMEM((2, _ROWS), jnp.float32),                           # x: m_a, m_b (then l_0, l_1)
        plgpu.Barrier(num_arrivals=copies, num_barriers=6),            # a: L, M, rope; b: L, M, rope
        plgpu.Barrier(num_arrivals=3),                                 # Q (three parts)
        plgpu.Barrier(num_arrivals=1),                                 # bar_A
        plgpu.Barrier(num_arrivals=1),                                 # bar_B
        plgpu.Barrier(num_arrivals=1),                                 # bar_P
        plgpu.Barrier(num_arrivals=2),                                 # done
        collective_axes="wg",
    )
    mg._write_partials(acc, m, l, o_ref, lse_ref, b=lax.axis_index("b"), j=j, row0=row0, col0=col0,
                       h=h, two_wg=True, o_bmsa=o_bmsa)
