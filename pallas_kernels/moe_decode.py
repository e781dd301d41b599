"""MoE routed experts at decode sizes (T <= a few tokens) in two launches and no XLA op.

    y[t] = sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = idx[t, k]

`moe_gmm.moe_experts` calls this for T <= pair_tiles_max_t when `MoeGmmConfig.decode == 'fused'`.
The 'tiles' decode path it replaces issues four launches at T=1 (x permute, gate/up, down, the sum
over k) plus routing ops; on the H200 the launch gaps were ~13 us of a 77.8 us call
(BENCHMARKS.md). Here:

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
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import int4_tile as tile


def _next_pow2(v: int) -> int:
    return 1 << max(1, (v - 1).bit_length())


def _gate_up_kernel(idx_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, h_ref, *, num_experts, topk,
                    d, group, bm, bn, bk, swap_ab, mode, x_layout):
    # idx_ref [T*K] int32; x_ref [T, D]; g/u w_ref int16 [E, F, D/4], s_ref bf16 [E, F, D/g];
    # h_ref [T*K, F] bf16, columns in pair-plane order.
    p, j = pl.program_id(0), pl.program_id(1)
    e = idx_ref[p]
    f = h_ref.shape[1]

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        bc, bkg = bk // 4, bk // group
        n0 = pl.multiple_of(j * bn, bn)
        live = (jnp.arange(bm, dtype=jnp.int32) == 0)[:, None]        # [BM, 1]: row 0 only
        rows = jnp.zeros((bm, 1), jnp.int32) + p // topk               # x row = the pair's token

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
        if swap_ab:
            g, u = g.T, u.T                                            # [BM, BN]
        h = g / (1.0 + jnp.exp(-g)) * u
        pc = tile.perm_index(n0 + jnp.arange(bn, dtype=jnp.int32), f)
        # distinct row per lane (masked lanes past the end write nothing): a masked store with
        # duplicate indices is ambiguous in interpret mode
        out_rows = p + jnp.arange(bm, dtype=jnp.int32)[:, None]
        tile.store(h_ref.at[out_rows, pc[None, :]], h.astype(h_ref.dtype), mask=live)


def _down_kernel(idx_ref, wt_ref, h_ref, dw_ref, ds_ref, y_ref, *, num_experts, topk, kp, group,
                 bm, bn, bk, swap_ab, mode):
    # idx_ref [T*K] int32, wt_ref [T*K] f32; h_ref [T*K, F] (pair-plane columns);
    # dw_ref int16 [E, D, F/4], ds_ref bf16 [E, D, F/g]; y_ref [T, D].
    t, j = pl.program_id(0), pl.program_id(1)
    f = h_ref.shape[1]
    bc, bkg = bk // 4, bk // group
    steps = f // bk
    n0 = pl.multiple_of(j * bn, bn)
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
    acc = lax.fori_loop(0, topk * steps, body, jnp.zeros(shape, jnp.float32))
    out = acc.T if swap_ab else acc                                     # [BM, BN]
    rows = t + jnp.arange(bm, dtype=jnp.int32)[:, None]                # distinct, row 0 live
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)[None, :]
    tile.store(y_ref.at[rows, cols], out.astype(y_ref.dtype), mask=live)


def moe_decode(x_TD, idx_TK, weight_TK, gate, up, down, *, block_m, block_n_gate_up, block_k_gate_up,
               block_n_down, block_k_down, swap_ab, dequant, x_layout, num_warps, num_stages,
               num_warps_down, num_stages_down, interp):
    """The two kernels. gate/up/down: (int16 packed, scale) pairs. Returns y [T, D] in x.dtype."""
    t, d = x_TD.shape
    topk = idx_TK.shape[1]
    (gw, gs), (uw, us), (dw, ds) = gate, up, down
    num_experts, f, _ = gw.shape
    group_d, group_f = d // gs.shape[-1], f // ds.shape[-1]
    bk_gu = tile.pick_block_k(d, max(block_k_gate_up, group_d))
    bk_dn = tile.pick_block_k(f, max(block_k_down, group_f))
    bn_gu, bn_dn = min(block_n_gate_up, f), min(block_n_down, d)
    if f % bn_gu or d % bn_dn or bk_gu % group_d or bk_dn % group_f or group_d % 8 or group_f % 8:
        raise ValueError(f"unsupported MoE shape: D={d} F={f} groups {group_d}/{group_f} "
                         f"blocks n {bn_gu}/{bn_dn} k {bk_gu}/{bk_dn}")
    mode = "f32" if interp else dequant
    idx = idx_TK.reshape(-1).astype(jnp.int32)
    wts = weight_TK.reshape(-1).astype(jnp.float32)
    if x_layout == "perm":
        x_TD = tile.perm_columns(x_TD)
    gu_kernel = functools.partial(
        _gate_up_kernel, num_experts=num_experts, topk=topk, d=d, group=group_d, bm=block_m,
        bn=bn_gu, bk=bk_gu, swap_ab=swap_ab, mode=mode, x_layout=x_layout)
    h = pl.pallas_call(
        gu_kernel, out_shape=jax.ShapeDtypeStruct((t * topk, f), x_TD.dtype),
        grid=(t * topk, f // bn_gu), interpret=interp,
        compiler_params=tile.compiler_params(num_warps, num_stages, interp),
        name="moe_decode_gate_up_int4",
    )(idx, x_TD, gw, gs.astype(jnp.bfloat16), uw, us.astype(jnp.bfloat16))
    dn_kernel = functools.partial(
        _down_kernel, num_experts=num_experts, topk=topk, kp=_next_pow2(topk), group=group_f,
        bm=block_m, bn=bn_dn, bk=bk_dn, swap_ab=swap_ab, mode=mode)
    return pl.pallas_call(
        dn_kernel, out_shape=jax.ShapeDtypeStruct((t, d), x_TD.dtype),
        grid=(t, d // bn_dn), interpret=interp,
        compiler_params=tile.compiler_params(num_warps_down or num_warps,
                                             num_stages_down or num_stages, interp),
        name="moe_decode_down_int4",
    )(idx, wts, h, dw, ds.astype(jnp.bfloat16))
