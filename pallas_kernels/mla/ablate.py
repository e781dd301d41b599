"""Timing ablations of the Mosaic GPU MLA decode kernel, version 2 (split S): what each piece of a
pair's work costs. Each variant is version 2 with ONE piece removed or faked, so its outputs are wrong
(except `full`); it exists only to be timed against the full kernel in the same process. A profiler
cannot split one kernel's time among its overlapped parts; removing a part and timing the rest can.

Variants (names as printed):
  full       version 2 as in `mla_decode_mgpu._kernel_split_s` (plain, without the serving options)
  nobt       refill page ids by arithmetic (row b's pages consecutive) instead of block-table loads
  nomask     no iota / compare / select on the scores
  norescale  the [64, 256] accumulator is not multiplied by the max correction
  nox        no max exchange between the warpgroups (each uses its own running max)
  nop        no P exchange barrier (the other warpgroup's P may be read before it is written)
  nox_nop    neither exchange
  noPV       no P @ C wgmma
  noS        no S = Q K^T wgmma (scores = 0)
  noS_noPV   no wgmma at all: the tile pipeline, barriers and softmax alone
  pipeline_only  no wgmma and no exchanges: the tile waits, softmax and refills (added after the
             measured run below: untimed)
  full2      the full kernel again, last (the spread of the run)

Run on the GPU (one H200, ~45 s): `PYTHONPATH=. python -m pallas_kernels.mla.ablate` -> per case (64 x 32K
and 64 x 128K, 64 heads, page 16, pages scattered) us per call and GB/s of cache read, partials only.
Measured 2026-11-30 (jax 0.11.2, copy 4,192 GB/s read+write): BENCHMARKS.md "MLA round 10".
CPU: tests/test_mla_decode_mgpu.py lowers every variant for cuda.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla import decode_mgpu as mg

plgpu = mg.plgpu

VARIANTS = {"full": frozenset(), "nobt": {"nobt"}, "nomask": {"nomask"}, "norescale": {"norescale"},
            "nox": {"nox"}, "nop": {"nop"}, "nox_nop": {"nox", "nop"}, "noPV": {"noPV"},
            "noS": {"noS"}, "noS_noPV": {"noS", "noPV"},
            "pipeline_only": {"noS", "noPV", "nox", "nop"}, "full2": frozenset()}
CASES = ((64, 32768), (64, 131072))


def make_kernel(drop):
    """Version 2's kernel with the pieces in `drop` removed (see the module docstring)."""
    def kernel(len_ref, bt_ref, q_ref, pool_ref, o_ref, lse_ref, *, bk, stages, splits, qk_scale,
               interpret, o_bmsa=False, prefetch=0, bt_ahead=False, early_pv=False, mask_tail_only=False,
               producer=False):
        del interpret, o_bmsa, prefetch, bt_ahead, early_pv, mask_tail_only   # GPU only, version 2 plain
        assert not producer, "the ablations are of version 2 without the producer warpgroup"
        (b, j, h, c, bn, dt, npairs, start, end, n_pairs, row0, col0,
         issue_pair) = mg._pair_program(len_ref, bt_ref, q_ref, pool_ref, o_ref, bk=bk,
                                        stages=stages, splits=splits)
        page, pages_per_row = pool_ref.shape[1], bt_ref.shape[1]
        if "nobt" in drop:
            def issue_pair(k_smem, k_bars, i, ps):
                for u in range(2):
                    base = start + (2 * i + u) * bk
                    for t, pos in enumerate(mg._tile_positions(page, base, end, bk)):
                        plgpu.copy_gmem_to_smem(pool_ref.at[b * pages_per_row + pos // page],
                                                k_smem.at[2 * ps + u].at[pl.ds(t * page, page)],
                                                k_bars.at[2 * ps + u])

        def main(q_smem, k_smem, p_smem, x_smem, k_bars, q_bar, consumed, x_bar, p_bar):
            leader = h == 0
            mg._prologue(q_ref, q_smem, q_bar, k_smem, k_bars, b, row0, issue_pair, npairs,
                         n_pairs, q_wg=leader, tma_wg=leader)

            def exchange(x, combine):
                x_smem.at[h][...] = x
                plgpu.commit_smem()
                plgpu.barrier_arrive(x_bar)
                plgpu.barrier_wait(x_bar)
                return combine(x, mg._load_rows(x_smem.at[1 - h], False))

            def step(i, carry):
                acc, m_prev, l_prev = carry
                ps = i % npairs
                mine = 2 * ps + h
                plgpu.barrier_wait(k_bars.at[mine])
                if "noS" in drop:
                    s = mg._lc(jnp.zeros((mg._ROWS, bk), jnp.float32), plgpu.Layout.WGMMA, False)
                elif "nomask" in drop:
                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_smem, k_smem.at[mine].transpose((1, 0)))
                        return s_ref[...]
                    s = pl.run_scoped(qk, plgpu.ACC((mg._ROWS, bk), jnp.float32)) * qk_scale
                else:
                    s = mg._scores(q_smem, k_smem.at[mine], end - (start + (2 * i + h) * bk),
                                   qk_scale, False)
                m_loc = jnp.maximum(m_prev, s.max(axis=1))
                m_next = m_loc if "nox" in drop else exchange(m_loc, jnp.maximum)
                corr = jnp.exp2(m_prev - m_next)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
                l_next = l_prev * corr + p.sum(axis=1)
                if "norescale" not in drop:
                    acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
                p_smem.at[h][...] = p.astype(dt)
                plgpu.commit_smem()
                if "nop" not in drop:
                    plgpu.barrier_arrive(p_bar)
                    plgpu.barrier_wait(p_bar)
                plgpu.barrier_wait(k_bars.at[2 * ps + 1 - h])
                if "noPV" not in drop:
                    acc = mg._accumulate(acc, lambda: [
                        (p_smem.at[u], k_smem.at[2 * ps + u].at[:, pl.ds(col0, bn)])
                        for u in range(2)], False)
                plgpu.barrier_arrive(consumed.at[ps])

                @pl.when(jnp.logical_and(leader, i + npairs < n_pairs))
                def _():
                    plgpu.barrier_wait(consumed.at[ps])
                    issue_pair(k_smem, k_bars, i + npairs, ps)
                return acc, m_next, l_next

            acc, m, l_part = lax.fori_loop(0, n_pairs, step, mg._init_carry(bn, False))
            return acc, m, mg._split_s_row_sums(leader, consumed, n_pairs, npairs, exchange,
                                                l_part, p_bar)

        acc, m, l = pl.run_scoped(main, *mg._pair_scratch(c, dt, bk, stages, page),
                                  plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2),
                                  collective_axes="wg")
        mg._write_partials(acc, m, l, o_ref, lse_ref, b=lax.axis_index("b"), j=j, row0=row0, col0=col0, h=h,
                           two_wg=True)
    return kernel


def partials_fn(name: str):
    """A jitted (q_lat, q_pe, new, pool, block_table, positions) -> partials of variant `name` (the
    plain version 2 config; the variant's kernel swapped in while it is traced)."""
    cfg = mg.VERSION_2

    def f(q_lat, q_pe, new, pool, bt, pos):
        del new
        B, T, N, A = q_lat.shape
        saved = mg._kernel_split_s
        mg._kernel_split_s = make_kernel(VARIANTS[name])
        try:
            return mg.mla_decode_partials_mgpu(
                q_lat.reshape(B, T * N, A), q_pe.reshape(B, T * N, -1), pool, bt,
                jnp.maximum(pos[:, 0], 0), scale=0.07, config=cfg)
        finally:
            mg._kernel_split_s = saved
    return jax.jit(f)


def main(argv):
    if argv:
        raise SystemExit(f"{sys.argv[0]}: no arguments (got {argv})")
    print("copy", round(mg.copy_bandwidth_gbs()), "GB/s (read + write)", flush=True)
    for B, ctx in CASES:
        arg_sets = mg._bench_case(jax.random.key(2), B, ctx, 64, 16, 512 << 20)
        nbytes = B * ctx * 576 * 2
        row = {"B": B, "context": ctx}
        for name in VARIANTS:
            us = mg._time(partials_fn(name), arg_sets, iters=10)
            row[name] = {"us": round(us, 1), "GBs": round(nbytes / us / 1e3)}
            print(name, row[name], flush=True)
        print(json.dumps(row), flush=True)
        del arg_sets


if __name__ == "__main__":
    main(sys.argv[1:])
