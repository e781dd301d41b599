"""Version 5 of the 64-row Mosaic GPU MLA decode kernel: ONE warpgroup scores each pair of tiles as a
single N = 2 block_k wgmma (`MgpuConfig(one_scorer=True)`, on top of version 2's producer warpgroup).

Why. Version 2 (SERVING_PRODUCER, the serving config before) scores a pair's two 32-token tiles in its
two computing warpgroups, each S = Q K^T with N = 32. An SS wgmma m64n32k16 reads 2 KiB of Q and 1 KiB
of K from shared memory for 16 clocks of tensor work at the SM's 2,048 bf16 MACs per clock: 192 B per
clock, more than the ~128 B per clock shared memory delivers, so S runs at ~2/3 of the tensor rate and
its shared-memory traffic (Q read once per 32 tokens: 216 KiB per pair, with P @ C's 80 KiB and the
TMA's 72 KiB of writes ~368 KiB per pair, ~1.8 us at 1.6 GHz) is close to the pair's 2.2 us of HBM time
per SM. m64n64k16 reads 4 KiB for 32 clocks (128 B per clock): one scorer reads Q once per 64 tokens
(144 KiB per pair, ~296 KiB in all). Measured (BENCHMARKS.md MLA round 21): 92-103% of the copy at the
memory-bound 64-head cases, 8.5-21% faster than version 2 + producer.
Version 4's ablation (MLA round 19: N = 64 scoring ran at 116% of the copy's rate when fed) is the
evidence that N = 64 scores fast here; version 4 lost on buffering (one pair slot), which version 5
keeps at version 2's two pair slots (the same shared memory: Q 72 KiB, 2 pair slots of [64, 576], one
P [64, 64] buffer, one row-vector buffer).

Per pair i (pair slot ps = i % slots; the producer refills a slot once both computing warpgroups
released it, as in version 2):

  warpgroup 0:  wait the pair; S = Q pair^T [64, 64] (one wgmma series, N = 64), scaled and masked;
                m' = max(m, rowmax S); corr = 2^(m - m'); P = 2^(S - m'); l = l corr + rowsum P
                wait p_free (warpgroup 1 done with the previous P and corr; not before pair 0)
                P -> p_smem (bf16), corr -> x[0]; arrive p_bar
                acc_0 = acc_0 corr + P @ pair[:, 0:A/2]; release the pair
  warpgroup 1:  wait the pair (its barrier phase and the TMA's writes), wait p_bar; corr <- x[0]
                acc_1 = acc_1 corr + P @ pair[:, A/2:A]; arrive p_free; release the pair

So there is no max exchange and warpgroup 0 never waits for warpgroup 1 inside a pair except for the
previous P's release (p_free), which warpgroup 1 gives right after its P @ C, ~one S earlier.
Barrier phases (per-thread parity bits, as in mla_decode_mgpu's docstring): p_bar is arrived for pair
i + 1 only after warpgroup 0 waited p_free(i), which warpgroup 1 arrives after waiting p_bar(i); p_free(i
+ 1) follows p_bar(i + 1), which follows warpgroup 0's p_free(i) wait. x[0] and p_smem are rewritten only
after p_free. After the loop: warpgroup 0 writes l to x[1] and arrives l_bar; warpgroup 1 reads it; then
a two-arrival `done` barrier before the epilogue's staging (aliased with the loop's shared memory)
is written. Warpgroup 1 has no running max: its lse is not written (warpgroup 0 writes lse).
A padding tile (odd tile count) is clamped to the split's last page and masked, as in version 2.

Interpret mode (CPU tests): the same code under the Mosaic GPU interpreter (race detector included);
the staging is separate there (the 0.10.2 interpreter rejects aliased refs), as in version 2.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla import decode_mgpu as mg

plgpu = mg.plgpu
_ROWS = mg._ROWS


def smem_bytes(bk: int, stages: int, c: int, dtype_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q, stages / 2 pair slots of [2 bk, C], P [64, 2 bk], x (1 KiB), the
    1 KiB reduction scratch and the barriers (mg._SMEM_RESERVED counts 2 KiB of scratch)."""
    return ((_ROWS * c + stages * bk * c + _ROWS * 2 * bk) * dtype_bytes + 1024
            + mg._SMEM_RESERVED - (2048 - mg._SPLIT_S_REDUCTION_SCRATCH))


def check_config(bk: int, stages: int, c: int, *, split_s: bool, producer: bool):
    """The shapes version 5 takes (raises ValueError naming the field at fault)."""
    if not (split_s and producer):
        raise ValueError("one_scorer (version 5) runs on version 2's producer warpgroup: split_s=True, "
                         "producer=True")
    if 2 * bk > 256 or (2 * bk) % 64:
        raise ValueError(f"one_scorer: a pair of block_k={bk} tiles is one wgmma with N = {2 * bk}; "
                         f"N must be a multiple of 64 and <= 256")
    need = smem_bytes(bk, stages, c)
    if need > mg._SMEM_LIMIT:
        raise ValueError(f"one_scorer: block_k={bk} x stages={stages} needs {need} B of shared memory "
                         f"(> {mg._SMEM_LIMIT})")


def kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk: int, stages: int, splits: int,
           qk_scale: float, interpret: bool, o_bmsa: bool = False, mask_tail_only: bool = False):
    """Version 5 (see the module docstring): grid (row_blocks, splits, B), 3 warpgroups per CTA
    (h = 0 scores, h = 0 and 1 each accumulate A / 2 latent columns, h = 2 issues the TMA)."""
    (b, j, h, c, bn, dt, npairs, start, end, n_pairs, row0, col0,
     _) = mg._pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, bk=bk, stages=stages, splits=splits)
    n = 2 * bk                                   # tokens per pair: the scores' N

    def issue_pair(kp, k_bars, i, ps):
        """TMA tiles 2i, 2i + 1 of the split into rows [0, bk), [bk, 2 bk) of pair slot ps, all
        copies on the slot's barrier (a padding tile is clamped to the split's last page)."""
        for u in range(2):
            mg._issue_tile(bt_ref, pool_ref, b, start + (2 * i + u) * bk, end, bk,
                           kp.at[ps, pl.ds(u * bk, bk)], k_bars.at[ps])

    def bcast(v, shape):
        return lax.broadcast_in_dim(v, shape, [0])

    def main(bufs, staging, k_bars, q_bar, consumed, p_bar, p_free, l_bar, done):
        q_smem, kp, p_smem, x_smem = bufs
        o_stage, lse_stage = staging

        def pv(acc, ps):
            return mg._accumulate(acc, lambda: [(p_smem, kp.at[ps].at[:, pl.ds(col0, bn)])], interpret)

        def score_step(i, carry):                 # warpgroup 0
            acc, m, l = carry
            ps = i % npairs
            plgpu.barrier_wait(k_bars.at[ps])
            s = mg._scores(q_smem, kp.at[ps], end - (start + i * n), qk_scale, interpret, mask_tail_only)
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
            corr = mg._load_rows(x_smem.at[0], interpret)
            acc = pv(acc * bcast(corr, acc.shape), ps)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[ps])
            return acc

        def finish(acc, m, l):
            plgpu.barrier_arrive(done)            # both past every read of the loop's buffers
            plgpu.barrier_wait(done)
            mg._store_partials(acc, m, l, o_stage.at[h], lse_stage, o_ref, lse_ref, b=lax.axis_index("b"),
                               j=j, row0=row0, col0=col0, h=h, o_bmsa=o_bmsa)

        @pl.when(h == 0)
        def _():
            plgpu.set_max_registers(mg._CONSUMER_REGS, action="increase")
            plgpu.barrier_wait(q_bar)
            acc, m, l = lax.fori_loop(0, n_pairs, score_step, mg._init_carry(bn, interpret))
            pl.when(n_pairs > 0)(lambda: plgpu.barrier_wait(p_free))   # the last phase (parity bits)
            x_smem.at[1][...] = l
            plgpu.commit_smem()
            plgpu.barrier_arrive(l_bar)
            finish(acc, m, l)

        @pl.when(h == 1)
        def _():
            plgpu.set_max_registers(mg._CONSUMER_REGS, action="increase")
            acc0, m0, _ = mg._init_carry(bn, interpret)
            acc = lax.fori_loop(0, n_pairs, pv_step, acc0)
            plgpu.barrier_wait(l_bar)
            finish(acc, m0, mg._load_rows(x_smem.at[1], interpret))

        pl.when(h == 2)(lambda: mg._producer(q_ref, q_smem, q_bar, kp, k_bars, consumed, b, row0,
                                             issue_pair, npairs, n_pairs))

    tiled = mg._tiled(n)                          # 128-byte swizzle: P [64, 64] bf16 rows
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
