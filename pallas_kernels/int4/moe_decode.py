"""MoE routed experts at decode sizes (T <= a few tokens) in two launches and no XLA op.

    y[t] = sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = idx[t, k]

`moe_gmm.moe_experts` calls this for T <= pair_tiles_max_t when `MoeGmmConfig.decode == 'fused'`.
The 'tiles' decode path it replaces issues four launches at T=1 (x permute, gate/up, down, the sum
over k) plus routing ops; on the H200 the launch gaps were ~13 us of a 77.8 us call
(`kimi-bench int4 --moe_profile`). Here:

  1. gate/up kernel, grid (T*K pairs, F/BN): program (p, j) reads idx.flat[p] itself (an id
     outside [0, E) exits at once: expert parallelism / stacked-layer offsets), loads x's row
     t = p // K ('shuffle': one contiguous load split into pair-planes in registers, so no XLA
     permute; 'perm' / 'natural' as in moe_gmm), streams the gate and up tiles of its expert and
     writes h = silu(gate) * up (bf16) to row p of h [T*K, F] with columns in pair-plane order.
  2. down kernel, grid (T, D/BN): program (t, j) owns output columns [j*BN, (j+1)*BN) of token t
     and runs ONE flat K loop over all K experts of the token (K * F/BK steps, so the software
     pipeline reaches steady state instead of refilling every 4 steps), scaling each step's MMA
     result by the routing weight; it writes y[t] in x.dtype directly (no [T*K, D] buffer, no sum).
     Pairs with ids outside [0, E) are masked loads: they read nothing and add 0.

Only the pair's own token row of each 8-row MMA tile is live (rows 1..7 are masked loads: no
memory traffic), as in moe_gmm's pair tiles. Duplicate experts across tokens are re-read (from L2).

Variants (MoeGmmConfig): `split_k_down` splits the down kernel's K loop over several programs per
output block (relaxed f32 atomics into a zeroed buffer); on the H200 2 splits timed within the
run-to-run spread of the default at T = 1 (71.1 vs 72.8 us; 70.5-72.5 vs 76.7 in another run, where the
default itself moved by 4 us), so it is an option, not the default.
`stream_k_down` (timed on the H200 with `--moe_configs=fused_stream`: P = 264 ties the default at T = 1
inside the spread and is slower at T = 4) lays the T
x D/BN output blocks' K loops end to end and cuts them into P equal shares (stream-K; relaxed f32
atomics at each block a program leaves): at T = 1 the 112 one-per-block programs of the default
leave 20 of the H200's 132 SMs idle and split-K 2-4 gives 224-448 programs, ~1.7-3.4 per SM, uneven;
P = 132 or 264 is even. Checked in interpret mode and compiled for sm_90 off-GPU (128 registers, no
spills, the same cp.async pipeline as the one-block kernel); `launch/bench/int4.py
--moe_configs=fused_stream` times it. Like split_k_down, its f32 atomics add a block's parts in
whatever order the programs finish: y may differ in the last bits between runs (the default
one-program-per-block kernel is deterministic).
`chained=True` (decode='chained': 19-35% slower than the default
at T = 1, 11-13% at T = 4 on the H200, `--moe_configs=chained`) is the fused path in ONE launch: tickets from
an atomic counter make the first programs to start the gate/up work and the rest stream-K down
shares, which wait (volatile loads, then an acquire) until their token's pairs have all their h
blocks; no launch boundary between the phases (~3 us each on the H200), no assumption on the
hardware's block order. Interpret-mode tests and sm_90 compile off-GPU (167 registers, no spills; 90
KB shared memory: two programs per SM). `launch/bench/int4.py --moe_configs=chained` times it (run it on
its own: a wait that never ends would stall the run).
`moe_decode_single` (decode='single') is the whole layer in ONE launch, the down projection split
along F where gate/up produced h; on the H200 it was slower than the default (95-152 vs 77-80 us at
T = 1; `--moe_configs=single`), so it stays a measured option.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.int4 import matmul as im
from pallas_kernels.int4 import tile


def _next_pow2(v: int) -> int:
    return 1 << max(1, (v - 1).bit_length())


def _gate_up_tile(x_ref, gw_ref, gs_ref, uw_ref, us_ref, e, token, n0, *, d, group, bm, bn, bk,
                  swap_ab, mode, x_layout):
    """h = silu(gate) * up of F rows [n0, n0 + bn) of expert e for one token row (row 0 of a BM-row
    MMA tile; rows 1..BM-1 are masked loads: no traffic, zeros). f32 [BN, BM] if swap_ab else
    [BM, BN]."""
    bc, bkg = bk // 4, bk // group
    live = (jnp.arange(bm, dtype=jnp.int32) == 0)[:, None]        # [BM, 1]: row 0 only
    rows = jnp.zeros((bm, 1), jnp.int32) + token

    def body(kk, accs):
        c0 = pl.multiple_of(kk * bc, bc)
        xps = tile.load_x_planes(x_ref, rows, live, kk, c0, d, bk, x_layout)
        new = []
        for (w_ref, s_ref), acc in zip(((gw_ref, gs_ref), (uw_ref, us_ref)), accs):
            w = tile.load(w_ref.at[e, pl.ds(n0, bn), pl.ds(c0, bc)])
            s = tile.load(s_ref.at[e, pl.ds(n0, bn), pl.ds(kk * bkg, bkg)])
            planes = tile.dequant_pairs(w, tile.expand_scale(s, bc), mode)
            for q in range(tile.NPLANES):
                acc = acc + tile.plane_dot(planes[q], xps[q], swap_ab)
            new.append(acc)
        return tuple(new)

    shape = (bn, bm) if swap_ab else (bm, bn)
    g, u = lax.fori_loop(0, d // bk, body, (jnp.zeros(shape, jnp.float32),) * 2)
    return g / (1.0 + jnp.exp(-g)) * u


def _gate_up_work(idx_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, h_ref, p, j, *, num_experts, topk,
                  d, group, bm, bn, bk, swap_ab, mode, x_layout):
    """Pair p's F columns [j * bn, (j + 1) * bn) of h = silu(gate) * up (nothing for an id outside
    [0, E)). idx_ref [T*K] int32; x_ref [T, D]; g/u w_ref int16 [E, F, D/4], s_ref bf16 [E, F, D/g];
    h_ref [T*K, F] bf16, columns in pair-plane order."""
    e = idx_ref[p]
    f = h_ref.shape[1]

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        n0 = pl.multiple_of(j * bn, bn)
        h = _gate_up_tile(x_ref, gw_ref, gs_ref, uw_ref, us_ref, e, p // topk, n0, d=d, group=group,
                          bm=bm, bn=bn, bk=bk, swap_ab=swap_ab, mode=mode, x_layout=x_layout)
        if swap_ab:
            h = h.T                                                    # [BM, BN]
        live = (jnp.arange(bm, dtype=jnp.int32) == 0)[:, None]
        pc = tile.perm_index(n0 + jnp.arange(bn, dtype=jnp.int32), f)
        # distinct row per lane (masked lanes past the end write nothing): a masked store with
        # duplicate indices is ambiguous in interpret mode
        out_rows = p + jnp.arange(bm, dtype=jnp.int32)[:, None]
        tile.store(h_ref.at[out_rows, pc[None, :]], h.astype(h_ref.dtype), mask=live)


def _gate_up_kernel(*refs, **kw):
    _gate_up_work(*refs, pl.program_id(0), pl.program_id(1), **kw)


def _single_kernel(idx_ref, wt_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, dw_ref, ds_ref, y0_ref,
                   y_ref, *, num_experts, topk, d, group_d, group_f, bm, bf, bk, bn_down, swap_ab,
                   mode, x_layout, reduce, interp, blocked):
    # Program (p, j): pair p = (token p // K, expert idx[p]), F slice [j*BF, (j+1)*BF).
    # y0_ref (aliased to y_ref), zeroed, f32: reduce 'atomic' / 'relaxed': [T + BM, D], lane l of a
    # tile adds to row token + l; 'store': [T*K*S + BM, D] (S = F/BF slices), lane l of program
    # (p, j) writes row p*S + j + l (lane 0 live).
    del y0_ref
    p, j = pl.program_id(0), pl.program_id(1)
    e = idx_ref[p]

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        t = p // topk
        n0 = pl.multiple_of(j * bf, bf)
        bc = bf // 4
        c0 = pl.multiple_of(n0 // 4, bc)
        nsteps = d // bn_down
        # programs start at different output chunks so their atomics do not queue on one address
        start = (p * pl.num_programs(1) + j) % nsteps

        def down_tile(i):
            """Step i's down weight tile (D rows [d0, d0 + bn_down) of the slice) and scales."""
            step = i + start
            step = jnp.where(step >= nsteps, step - nsteps, step)
            d0 = pl.multiple_of(step * bn_down, bn_down)
            if blocked:     # [E, F/BF, D, BF/4]: the slice's rows are one contiguous block
                w = tile.load(dw_ref.at[e, j, pl.ds(d0, bn_down), pl.ds(0, bc)])
                s = tile.load(ds_ref.at[e, j, pl.ds(d0, bn_down), pl.ds(0, bf // group_f)])
            else:           # [E, D, F/4]: BF/2 bytes of each D row
                w = tile.load(dw_ref.at[e, pl.ds(d0, bn_down), pl.ds(c0, bc)])
                s = tile.load(ds_ref.at[e, pl.ds(d0, bn_down), pl.ds(n0 // group_f, bf // group_f)])
            return d0, w, s

        h = _gate_up_tile(x_ref, gw_ref, gs_ref, uw_ref, us_ref, e, t, n0, d=d, group=group_d,
                          bm=bm, bn=bf, bk=bk, swap_ab=swap_ab, mode=mode, x_layout=x_layout)
        hT = (h.T if swap_ab else h).astype(x_ref.dtype)              # [BM, BF] natural F order
        hps = tile.split_planes(hT)                                    # 4 x [BM, BF/4]: plane q
        #                                                                col c = F n0 + 4c + q
        wk = wt_ref[p]
        base = t if reduce != "store" else p * pl.num_programs(1) + j
        lanes = base + jnp.arange(bm, dtype=jnp.int32)[:, None]        # distinct rows per lane
        live = jnp.arange(bm, dtype=jnp.int32)[:, None] == 0

        def down_step(d0, w, s):
            planes = tile.dequant_pairs(w, tile.expand_scale(s, bc), mode)
            part = None
            for q in range(tile.NPLANES):
                dq = tile.plane_dot(planes[q], hps[q], swap_ab)
                part = dq if part is None else part + dq
            out = wk * (part.T if swap_ab else part)                     # [BM, BN_down] f32
            cols = d0 + jnp.arange(bn_down, dtype=jnp.int32)[None, :]
            # lanes 1..BM-1 hold zeros (masked x rows) and have distinct padded rows
            if reduce == "store":
                tile.store(y_ref.at[lanes, cols], out, mask=jnp.broadcast_to(live, out.shape))
            else:
                tile.atomic_accumulate(y_ref, (lanes, cols), out, live, interp=interp,
                                       relaxed=reduce == "relaxed")

        def body(i, carry):
            down_step(*down_tile(i))
            return carry

        lax.fori_loop(0, nsteps, body, 0)


def _down_steps(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, t, n0, lo, hi, *, num_experts, topk, kp, group,
                bm, bn, bk, swap_ab, mode):
    """Steps [lo, hi) of token t's down K loop (its K experts x F / bk steps, routing weights applied)
    for output columns [n0, n0 + bn): f32 [BN, BM] if swap_ab else [BM, BN] (row 0 live)."""
    f = h_ref.shape[1]
    bc, bkg = bk // 4, bk // group
    steps = f // bk
    ak = jnp.arange(kp, dtype=jnp.int32)
    kmask = ak < topk
    ids = tile.load(idx_ref.at[t * topk + ak], mask=kmask, other=-1)   # [Kp] this token's experts
    wts = tile.load(wt_ref.at[t * topk + ak], mask=kmask, other=0.0)
    live = (jnp.arange(bm, dtype=jnp.int32) == 0)[:, None]
    ic = jnp.arange(bc, dtype=jnp.int32)[None, :]

    def body(i, acc):
        kq = i // steps                                  # which of the token's experts
        kk = i - kq * steps                              # K step inside it
        sel = ak == kq
        e = jnp.sum(jnp.where(sel, ids, 0))              # register select: no dependent load
        wk = jnp.sum(jnp.where(sel, wts, 0.0))
        held = (e >= 0) & (e < num_experts)
        e = jnp.where(held, e, 0)
        c0 = pl.multiple_of(kk * bc, bc)
        w = tile.load(dw_ref.at[e, pl.ds(n0, bn), pl.ds(c0, bc)], mask=held, other=0)
        s = tile.load(ds_ref.at[e, pl.ds(n0, bn), pl.ds(kk * bkg, bkg)], mask=held, other=0.0)
        planes = tile.dequant_pairs(w, tile.expand_scale(s, bc), mode)
        rows = jnp.zeros((bm, 1), jnp.int32) + t * topk + kq
        part = None
        for q in range(tile.NPLANES):
            hq = tile.load(h_ref.at[rows, q * (f // 4) + c0 + ic], mask=live & held, other=0.0)
            dq = tile.plane_dot(planes[q], hq, swap_ab)
            part = dq if part is None else part + dq
        return acc + wk * part

    shape = (bn, bm) if swap_ab else (bm, bn)
    return lax.fori_loop(lo, hi, body, jnp.zeros(shape, jnp.float32))


def _down_write(y_ref, acc, t, n0, *, bm, bn, swap_ab, atomic, interp):
    """Token t's columns [n0, n0 + bn) of y: stored, or added by relaxed f32 atomics (lanes 1.. hold
    zeros and have distinct padded rows)."""
    out = acc.T if swap_ab else acc                                     # [BM, BN]
    rows = t + jnp.arange(bm, dtype=jnp.int32)[:, None]                # distinct, row 0 live
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)[None, :]
    live = (jnp.arange(bm, dtype=jnp.int32) == 0)[:, None]
    if atomic:
        tile.atomic_accumulate(y_ref, (rows, cols), out, live, interp=interp, relaxed=True)
    else:
        tile.store(y_ref.at[rows, cols], out.astype(y_ref.dtype), mask=live)


def _down_kernel(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, *y_refs, split, interp, **kw):
    # idx_ref [T*K] int32, wt_ref [T*K] f32; h_ref [T*K, F] (pair-plane columns);
    # dw_ref int16 [E, D, F/4], ds_ref bf16 [E, D, F/g]; y_refs: (y [T, D],) or, split > 1,
    # (zeros, y) f32 [T + BM, D] aliased: program (t, j, s) adds its share of the K loop by atomics.
    t, j = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * kw["bn"], kw["bn"])
    chunk = kw["topk"] * (h_ref.shape[1] // kw["bk"]) // split          # this program's K steps
    lo = pl.program_id(2) * chunk if split > 1 else 0
    acc = _down_steps(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, t, n0, lo, lo + chunk, **kw)
    _down_write(y_refs[-1], acc, t, n0, bm=kw["bm"], bn=kw["bn"], swap_ab=kw["swap_ab"], atomic=split > 1,
                interp=interp)


def _down_stream_work(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, y_ref, i, *, n_blocks, per_program, total,
                      interp, before_block=None, **kw):
    """Stream-K share i: the T x n_blocks output blocks' K loops laid end to end (total steps), share i
    is steps [i * per_program, (i + 1) * per_program): the tail of one block, whole blocks, the head of
    another; each block's part is added to y (zeroed f32 [T + BM, D]) by relaxed atomics.
    before_block(t): called before a block of token t is computed (the chained kernel's wait)."""
    steps = kw["topk"] * (h_ref.shape[1] // kw["bk"])                   # one block's K loop
    lo = i * per_program
    hi = jnp.minimum(lo + per_program, total)

    def block(u, carry):
        t = u // n_blocks
        n0 = pl.multiple_of((u - t * n_blocks) * kw["bn"], kw["bn"])
        if before_block is not None:
            before_block(t)
        acc = _down_steps(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, t, n0, jnp.maximum(lo - u * steps, 0),
                          jnp.minimum(hi - u * steps, steps), **kw)
        _down_write(y_ref, acc, t, n0, bm=kw["bm"], bn=kw["bn"], swap_ab=kw["swap_ab"], atomic=True,
                    interp=interp)
        return carry

    last = jnp.where(hi > lo, (hi + steps - 1) // steps, lo // steps)   # blocks [lo // steps, last)
    lax.fori_loop(lo // steps, last, block, 0)


def _down_stream_kernel(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, y0_ref, y_ref, **kw):
    del y0_ref                                                          # aliased to y_ref
    _down_stream_work(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, y_ref, pl.program_id(0), **kw)


def _chained_kernel(idx_ref, wt_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, dw_ref, ds_ref, c0_ref, y0_ref,
                    c_ref, y_ref, h_ref, *, n_gate_up, f_blocks, gu_kw, dn_kw, interp):
    """Both phases in ONE launch. Each program first takes a ticket (an atomic counter, the last
    slot of c_ref): tickets [0, n_gate_up) are gate/up work (pair p, F block j), the rest stream-K
    down shares. Gate/up work stores its h block, then (all threads' stores done: a CTA barrier)
    adds 1 to pair p's counter; down work first waits until each of its token's pairs with a held
    expert has f_blocks done, then (an acquire: an atomic read, then a CTA barrier) reads h. Tickets
    are handed out in the order programs start, so every gate/up ticket belongs to a running program
    that never waits: the waiting down programs cannot starve it (no assumption on the hardware's
    block order). c0_ref / y0_ref: zeroed, aliased to c_ref [T*K + 1] int32 / y_ref [T + BM, D] f32."""
    del c0_ref, y0_ref
    tickets = c_ref.shape[0] - 1
    one = jnp.int32(1)
    q = plt.atomic_add(c_ref, (jnp.int32(tickets),), one)

    @pl.when(q < n_gate_up)
    def _():
        p = q // f_blocks
        _gate_up_work(idx_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, h_ref, p, q - p * f_blocks, **gu_kw)
        if not interp:
            plt.debug_barrier()                       # every thread's h stores issued before the release
        plt.atomic_add(c_ref, (p,), one)              # acquire-release, GPU scope

    topk, num_experts = dn_kw["topk"], dn_kw["num_experts"]

    def wait_token(t):
        for k in range(topk):
            p = t * topk + k
            e = idx_ref[p]
            held = (e >= 0) & (e < num_experts)
            lax.while_loop(lambda c: held & (c < f_blocks),
                           lambda c: plt.load(c_ref.at[p], volatile=True), plt.load(c_ref.at[p], volatile=True))
            plt.atomic_add(c_ref, (p,), one * 0)      # acquire: h's stores are visible from here on
        if not interp:
            plt.debug_barrier()                       # ... to every thread of this program

    @pl.when(q >= n_gate_up)
    def _():
        _down_stream_work(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, y_ref, q - n_gate_up, interp=interp,
                          before_block=wait_token, **dn_kw)


def _dims(x_TD, idx_TK, gate, down):
    """(T, D, top-k, E, F, D's scale group, F's scale group) of a decode call (down in either layout:
    [E, D, F/g] scales, or `block_down`'s [E, F/BF, D, BF/g])."""
    t, d = x_TD.shape
    num_experts, f, _ = gate[0].shape
    f_scales = down[1].shape[-1] * (down[1].shape[1] if down[1].ndim == 4 else 1)
    return t, d, idx_TK.shape[1], num_experts, f, d // gate[1].shape[-1], f // f_scales


def block_down(packed: jax.Array, scale: jax.Array, block_f: int) -> tuple[jax.Array, jax.Array]:
    """One-time load step for `moe_decode_single`: the down weight [E, D, F/8] int32 (or its int16 view
    [E, D, F/4]) and scales [E, D, F/g] -> [E, F/BF, D, BF/8] (BF/4) and [E, F/BF, D, BF/g]: the D x BF
    slice one program multiplies becomes one contiguous block (BF/2 bytes per row in the checkpoint
    layout, a 32-byte sector per row at BF = 64 and scales at 4 bytes per 32-byte sector). Same bytes,
    same packing along F (the MMA's K side), so the dequantizer is unchanged."""
    e, d, words = packed.shape
    per = 8 if packed.dtype == jnp.int32 else 4                     # weights per word
    f = words * per
    groups = scale.shape[-1]
    if block_f <= 0 or f % block_f or block_f % per or (groups * block_f) % f:
        raise ValueError(f"block_down: block_f={block_f} must divide F={f} in whole words and scale groups "
                         f"(F/{f // groups} per group)")
    s = f // block_f

    def blocked(a):
        return a.reshape(e, d, s, a.shape[-1] // s).transpose(0, 2, 1, 3)
    return blocked(packed), blocked(scale)


def _routing_inputs(x_TD, idx_TK, weight_TK, x_layout):
    """x in the kernels' column order, the flat expert ids (int32) and weights (f32) per pair."""
    if x_layout == "perm":
        x_TD = tile.perm_columns(x_TD)
    return x_TD, idx_TK.reshape(-1).astype(jnp.int32), weight_TK.reshape(-1).astype(jnp.float32)


def moe_decode(x_TD, idx_TK, weight_TK, gate, up, down, *, block_m, block_n_gate_up, block_k_gate_up,
               block_n_down, block_k_down, swap_ab, dequant, x_layout, num_warps, num_stages,
               num_warps_down, num_stages_down, interp, split_k_down=1, stream_k_down=0, chained=False):
    """The two kernels. gate/up/down: (int16 packed, scale) pairs. Returns y [T, D] in x.dtype.
    split_k_down > 1: the down kernel's K loop (the token's K experts x F steps) is split over that many
    programs per output block, which add their partials with relaxed f32 atomics into a zeroed
    [T + BM, D] buffer (cast to x.dtype after): more programs, shorter loops. stream_k_down = P > 0:
    the T x D/block_n_down blocks' K loops laid end to end and cut into P equal shares (stream-K:
    a program may end one block and start the next), added the same way; P = the SM count or a
    multiple balances the SMs, which T x D/block_n_down blocks (112 at T = 1) do not.
    chained: both phases in ONE launch (`_chained_kernel`: down shares wait in-kernel for their
    token's h), the down phase as stream-K shares (stream_k_down, default one block each); the gate/
    up phase's num_warps / num_stages serve both."""
    t, d, topk, num_experts, f, group_d, group_f = _dims(x_TD, idx_TK, gate, down)
    (gw, gs), (uw, us), (dw, ds) = gate, up, down
    bk_gu = tile.pick_block_k(d, max(block_k_gate_up, group_d))
    bk_dn = tile.pick_block_k(f, max(block_k_down, group_f))
    bn_gu, bn_dn = min(block_n_gate_up, f), min(block_n_down, d)
    if f % bn_gu or d % bn_dn or bk_gu % group_d or bk_dn % group_f or group_d % 8 or group_f % 8:
        raise ValueError(f"unsupported MoE shape: D={d} F={f} groups {group_d}/{group_f} "
                         f"blocks n {bn_gu}/{bn_dn} k {bk_gu}/{bk_dn}")
    split = split_k_down
    if split < 1 or (topk * (f // bk_dn)) % split:
        raise ValueError(f"split_k_down={split} must divide the down K loop's {topk} x {f // bk_dn} steps")
    if stream_k_down < 0 or ((stream_k_down or chained) and split > 1):
        raise ValueError(f"stream_k_down={stream_k_down} (a program count >= 0) and chained={chained} "
                         f"do not take split_k_down={split} > 1")
    mode = "f32" if interp else dequant
    x_TD, idx, wts = _routing_inputs(x_TD, idx_TK, weight_TK, x_layout)
    gu_kw = dict(num_experts=num_experts, topk=topk, d=d, group=group_d, bm=block_m, bn=bn_gu, bk=bk_gu,
                 swap_ab=swap_ab, mode=mode, x_layout=x_layout)
    common = dict(num_experts=num_experts, topk=topk, kp=_next_pow2(topk), group=group_f, bm=block_m,
                  bn=bn_dn, bk=bk_dn, swap_ab=swap_ab, mode=mode)
    rows = t + block_m
    n_blocks = d // bn_dn
    total = t * n_blocks * topk * (f // bk_dn)
    per = -(-total // (stream_k_down or t * n_blocks))
    n_stream = -(-total // per)                                        # stream-K down programs
    stream_kw = dict(n_blocks=n_blocks, per_program=per, total=total, **common)
    gs16, us16, ds16 = (s.astype(jnp.bfloat16) for s in (gs, us, ds))
    if chained:
        n_gate_up = t * topk * (f // bn_gu)
        kernel = functools.partial(_chained_kernel, n_gate_up=n_gate_up, f_blocks=f // bn_gu, gu_kw=gu_kw,
                                   dn_kw=stream_kw, interp=interp)
        _, y, _ = pl.pallas_call(
            kernel, grid=(n_gate_up + n_stream,), interpret=interp,
            out_shape=[jax.ShapeDtypeStruct((t * topk + 1,), jnp.int32),
                       jax.ShapeDtypeStruct((rows, d), jnp.float32),
                       jax.ShapeDtypeStruct((t * topk, f), x_TD.dtype)],
            input_output_aliases={9: 0, 10: 1},
            compiler_params=tile.compiler_params(num_warps, num_stages, interp),
            name="moe_decode_chained_int4",
        )(idx, wts, x_TD, gw, gs16, uw, us16, dw, ds16,
          jnp.zeros((t * topk + 1,), jnp.int32), jnp.zeros((rows, d), jnp.float32))
        return y[:t].astype(x_TD.dtype)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, **gu_kw), out_shape=jax.ShapeDtypeStruct((t * topk, f), x_TD.dtype),
        grid=(t * topk, f // bn_gu), interpret=interp,
        compiler_params=tile.compiler_params(num_warps, num_stages, interp),
        name="moe_decode_gate_up_int4",
    )(idx, x_TD, gw, gs16, uw, us16)
    params = tile.compiler_params(num_warps_down or num_warps, num_stages_down or num_stages, interp)
    args = (idx, wts, h, dw, ds16)
    if split == 1 and not stream_k_down:
        return pl.pallas_call(
            functools.partial(_down_kernel, split=1, interp=interp, **common),
            out_shape=jax.ShapeDtypeStruct((t, d), x_TD.dtype), grid=(t, d // bn_dn),
            interpret=interp, compiler_params=params, name="moe_decode_down_int4")(*args)
    if stream_k_down:
        kernel = functools.partial(_down_stream_kernel, interp=interp, **stream_kw)
        grid, name = (n_stream,), "moe_decode_down_int4_streamk"
    else:
        kernel = functools.partial(_down_kernel, split=split, interp=interp, **common)
        grid, name = (t, d // bn_dn, split), "moe_decode_down_int4_splitk"
    y = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, d), jnp.float32), grid=grid,
        input_output_aliases={5: 0}, interpret=interp, compiler_params=params, name=name,
    )(*args, jnp.zeros((rows, d), jnp.float32))
    return y[:t].astype(x_TD.dtype)


def _pairs_cta_kernel(idx_ref, a_ref, *refs, n_weights, topk, num_experts, n, k, group, a_per_token,
                      perm_out, cfg, mode, mp):
    """Program (pair p, block j): weight j // (N/R) (gate / up, or the one down weight), rows
    [n0, n0 + R) of expert idx[p], times the pair's activation row (x's token p // K, or h's row p),
    with int4_matmul's 'cta' program (`cta_partials`: the K split over the warps inside the program).
    Pairs with an id outside [0, E) write nothing."""
    ws = [(refs[2 * i], refs[2 * i + 1]) for i in range(n_weights)]
    o_ref = refs[-1]
    p, j = pl.program_id(0), pl.program_id(1)
    e = idx_ref[p]
    R = cfg.block_n // cfg.split_k
    nb = n // R
    which, n0 = j // nb, pl.multiple_of((j % nb) * R, R)
    row = p // topk if a_per_token else p
    rr = n0 + jnp.arange(R, dtype=jnp.int32)
    cols = tile.perm_index(rr, n) if perm_out else rr
    for w_i, (w_ref, s_ref) in enumerate(ws):
        @pl.when((e >= 0) & (e < num_experts) & (which == w_i))
        def _(w_ref=w_ref, s_ref=s_ref, w_i=w_i):
            y = im.cta_partials(a_ref, w_ref, s_ref, e * n + n0, row, m=1, k=k, group=group, cfg=cfg,
                                mode=mode, mp=mp)                              # [R, 1]
            tile.store(o_ref.at[(p + jnp.arange(mp, dtype=jnp.int32))[:, None], (w_i * n + cols)[None, :]],
                       y.T)


def pairs_cta_config(n: int, k: int, group: int, *, split: int, num_warps: int, block_k: int,
                     num_stages: int = 3, dequant: str = "asm", x_layout: str = "shuffle"):
    """The 'cta' program config `pairs_matmul_cta` runs for an [N, K] weight with quantization groups
    of `group` (block_k fitted to a K slice), the one row's padded M (`int4_matmul.cta_config`) and its
    R = 16 * num_warps / split weight rows per program; ValueError naming what does not tile."""
    cfg = im.Int4MatmulConfig(block_n=16 * num_warps, block_k=block_k, num_warps=num_warps,
                              num_stages=num_stages, dequant=dequant, swap_ab=True, x_layout=x_layout,
                              split_k=split, split_reduce="cta")
    cfg, mp = im.cta_config(cfg, 1, k, group)
    R = cfg.block_n // split
    if n % R:
        raise ValueError(f"pairs_matmul_cta: N={n} must divide by {R} rows per program")
    return cfg, mp, R


def pairs_matmul_cta(a, idx_TK, weights, *, a_per_token: bool, perm_out: bool, split: int, num_warps: int,
                     num_stages: int, block_k: int, dequant: str, x_layout: str, interp: bool):
    """Each (token, k) pair's row times its expert's weight(s), one dense-style program per R weight rows:
    int4_matmul's split_reduce='cta' program (16 * num_warps MMA rows = `split` K-slices of R rows) aimed
    at one expert's rows. For decode steps that hold few pairs (expert parallelism at small batch: about
    one pair per token and device at EP8), where the grouped kernels give a lone pair 32 gate/up programs
    of 128 rows (one per SM, latency-bound: 30 us for one expert's 16.5 MB on the H200) and this shape gives it 2F/R programs of R rows with the K split 4 ways, as the dense
    kernel does (8.6 us for the same bytes). a: [T, K_in] (a_per_token: row = token, e.g. x) or
    [T*K, K_in] (row = pair, e.g. h); weights: (int16 packed [E, N, K_in/4], scale [E, N, K_in/g]) x 1
    or 2; x_layout 'shuffle' (a in natural columns) or 'perm' (a's columns in pair-plane order).
    Returns f32 [T*K, n_weights * N] (weight w at columns [w N, (w+1) N); in pair-plane order if
    perm_out); rows of pairs with an id outside [0, E) are not written."""
    num_experts, n, kw = weights[0][0].shape
    k = kw * 4
    group = k // weights[0][1].shape[-1]
    cfg, mp, R = pairs_cta_config(n, k, group, split=split, num_warps=num_warps, block_k=block_k,
                                  num_stages=num_stages, dequant=dequant, x_layout=x_layout)
    idx = idx_TK.reshape(-1).astype(jnp.int32)
    pairs = idx.shape[0]
    args = [idx, a]
    for p_, s_ in weights:      # [E, N, .] -> [E * N, .]: a free reshape; rows e * N + n
        args += [p_.reshape(num_experts * n, -1), s_.astype(jnp.bfloat16).reshape(num_experts * n, -1)]
    kernel = functools.partial(
        _pairs_cta_kernel, n_weights=len(weights), topk=idx_TK.shape[1], num_experts=num_experts, n=n, k=k,
        group=group, a_per_token=a_per_token, perm_out=perm_out, cfg=cfg,
        mode="f32" if interp else dequant, mp=mp)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((pairs, len(weights) * n), jnp.float32),
        grid=(pairs, len(weights) * (n // R)), interpret=interp,
        compiler_params=tile.compiler_params(num_warps, num_stages, interp), name="moe_pairs_cta_int4",
    )(*args)


SINGLE_REDUCES = ("atomic", "relaxed", "store")


def moe_decode_single(x_TD, idx_TK, weight_TK, gate, up, down, *, block_m, block_f, block_k,
                      block_n_down, swap_ab, dequant, x_layout, num_warps, num_stages, interp,
                      reduce="atomic"):
    """The whole routed-expert layer in ONE launch. Program (pair p, F slice j) computes
    h = silu(gate) * up for F features [j*BF, (j+1)*BF) of its pair's expert (full D reduction), then
    multiplies that h slice by the matching K-slice of the expert's down weight (D x BF) and adds
    weight[p] * (h_slice @ down_slice^T) to y[token] with f32 atomics: the down projection is split
    along F exactly where gate/up produced it, so no program waits for another and h never leaves
    registers. Every weight byte of a touched expert is read once (gate/up rows by one program, down
    columns by the same one). y is accumulated in f32 ([T + BM, D], zeroed by XLA) and cast after.
    reduce: 'atomic' (Pallas' acquire-release f32 atomics), 'relaxed' (relaxed-order atomics:
    `tile.atomic_add_relaxed`) or 'store' (each program stores its [D] partial, XLA sums the
    T*K*F/BF partials after: no atomics, one more op). gate/up/down: (int16 packed, scale) pairs;
    down may come in `block_down`'s layout (4-D, blocked for this block_f), where each program's down
    slice is one contiguous block instead of BF/2 bytes of every D row (T = 1 on the H200: 81.7 -> 57.2
    us of device span; loading the first down tile before the gate/up loop was
    tried and lost: 254 registers, 58.5 us). Returns y [T, D] in x.dtype."""
    t, d, topk, num_experts, f, group_d, group_f = _dims(x_TD, idx_TK, gate, down)
    (gw, gs), (uw, us), (dw, ds) = gate, up, down
    bk = tile.pick_block_k(d, max(block_k, group_d))
    bf, bn_dn = min(block_f, f), min(block_n_down, d)
    blocked = dw.ndim == 4
    if blocked and f // dw.shape[1] != bf:
        raise ValueError(f"the down weight is blocked by block_down for F slices of {f // dw.shape[1]}, "
                         f"but this call's block_f is {bf}: block it with block_f={bf}")
    if (f % bf or d % bn_dn or bk % group_d or bf % group_f or group_d % 8 or group_f % 8
            or bf % 64):
        raise ValueError(f"unsupported single-launch MoE shape: D={d} F={f} groups "
                         f"{group_d}/{group_f} block_f {bf} (a multiple of 64 dividing F and of the "
                         f"down group) block_n_down {bn_dn} block_k {bk}")
    if reduce not in SINGLE_REDUCES:
        raise ValueError(f"reduce {reduce!r} not in {SINGLE_REDUCES}")
    mode = "f32" if interp else dequant
    x_TD, idx, wts = _routing_inputs(x_TD, idx_TK, weight_TK, x_layout)
    slices = f // bf
    rows = (t * topk * slices if reduce == "store" else t) + block_m
    kernel = functools.partial(
        _single_kernel, num_experts=num_experts, topk=topk, d=d, group_d=group_d, group_f=group_f,
        bm=block_m, bf=bf, bk=bk, bn_down=bn_dn, swap_ab=swap_ab, mode=mode, x_layout=x_layout,
        reduce=reduce, interp=interp, blocked=blocked)
    y = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, d), jnp.float32),
        grid=(t * topk, f // bf), input_output_aliases={9: 0}, interpret=interp,
        compiler_params=tile.compiler_params(num_warps, num_stages, interp),
        name="moe_decode_single_int4",
    )(idx, wts, x_TD, gw, gs.astype(jnp.bfloat16), uw, us.astype(jnp.bfloat16), dw,
      ds.astype(jnp.bfloat16), jnp.zeros((rows, d), jnp.float32))
    if reduce == "store":
        return y[:rows - block_m].reshape(t, topk * slices, d).sum(axis=1).astype(x_TD.dtype)
    return y[:t].astype(x_TD.dtype)
