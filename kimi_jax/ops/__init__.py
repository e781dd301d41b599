"""The model's ops, each with an 'xla' and (where one exists) a 'pallas' implementation chosen by
the caller's `ExecPlan` (`plan=`; default `ExecPlan.for_backend()`). The only module that imports
`pallas_kernels`."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.ops.fused import add_rms_norm, route  # noqa: F401
from kimi_jax.ops.impl import einsum_f32, row_sums, row_tiles, shard_map, softmax  # noqa: F401
# re-exported: the engine, model and launchers call ops.*
from kimi_jax.ops.plan import (  # noqa: F401
    CHUNK_ATTENTION_CHOICES,
    IMPLS,
    LAYER_LOOPS,
    MLA_DECODE_KERNELS,
    MLA_SCHEDULES,
    NORM_KERNELS,
    PREFILL_ATTENTION_CHOICES,
    ROUTER_KERNELS,
    ExecPlan,
    default_plan,
)
from kimi_jax.ops.ragged import RaggedRows, mla_ragged_attention  # noqa: F401
from kimi_jax.ops.prefill_attention import (  # noqa: F401
    cudnn_attention_fits, mla_prefill_attention, prefill_attention_path)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """compressed-tensors pack-quantized INT4: `packed` int32 [..., out, in/8], `scale` [..., out,
    in/g]."""

    packed: jax.Array
    scale: jax.Array

    @property
    def group_size(self) -> int:
        return self.packed.shape[-1] * 8 // self.scale.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 8)


Weight = Union[jax.Array, Int4Weight]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Routed experts of one MoE layer: gate/up [E, F, D], down [E, D, F] (bf16 or INT4)."""
    gate: Weight
    up: Weight
    down: Weight


def dequantize(w: Weight, dtype) -> jax.Array:
    """Dense weight [..., out, in] from bf16 or INT4 storage (the XLA path; unfused)."""
    if isinstance(w, Int4Weight):
        from checkpoints.int4 import dequantize_jnp
        return dequantize_jnp(w.packed, w.scale, w.group_size, dtype)
    return w.astype(dtype)


def linear(x: jax.Array, w: Weight, *, plan: Optional[ExecPlan] = None) -> jax.Array:
    """y[..., out] = x[..., in] @ w[out, in]^T (HF Linear layout); an INT4 weight runs Pallas under
    impl='pallas'."""
    if isinstance(w, Int4Weight) and default_plan(plan).pallas:
        from pallas_kernels.int4 import matmul as int4_matmul
        lead = x.shape[:-1]
        y = int4_matmul.int4_matmul(x.reshape(-1, x.shape[-1]), w.packed, w.scale)
        return y.reshape(*lead, y.shape[-1])
    wd = dequantize(w, x.dtype)
    # f32 accumulation either way; the model dtype out keeps TP partial sums bf16 on the wire
    def product(x_):
        return jnp.einsum("...k,nk->...n", x_, wd, preferred_element_type=x.dtype)
    if plan is not None and plan.batch_invariant:
        return row_tiles(product, x.reshape(-1, x.shape[-1]),
                         plan.row_tile).reshape(*x.shape[:-1], -1)
    return product(x)


def routed_experts(x_TD: jax.Array, idx_TK: jax.Array, weight_TK: jax.Array, experts: ExpertWeights,
                   *, plan: Optional[ExecPlan] = None, parallel=None, layer=None) -> jax.Array:
    """sum_k weight[t, k] * down(silu(gate(x_t)) * up(x_t)) over the experts idx[t, k] -> [T, D] in
    x's dtype. idx_TK int32, weight_TK float32; layer: index into weights stacked [L, E, ...], read
    in place."""
    plan = default_plan(plan)
    pallas, invariant = plan.pallas, plan.batch_invariant
    if parallel is not None:
        return _routed_experts_sharded(x_TD, idx_TK, weight_TK, experts, parallel, pallas, layer,
                                       invariant)
    return _routed_experts_local(x_TD, idx_TK, weight_TK, experts, pallas, layer,
                                 invariant=invariant)


def _routed_experts_sharded(
    x_TD, idx_TK, weight_TK, experts: ExpertWeights, par, pallas: bool, layer, invariant=False
):
    """Each device runs its experts (or slices) on its data-parallel group's tokens; partial sums
    are reduced. Pairs whose expert lives elsewhere get weight 0 and the out-of-range id E_local."""
    from jax.sharding import PartitionSpec as P
    size1 = {a for a in par.mesh.axis_names if par.mesh.shape[a] == 1}
    reduce_axes = tuple(a for a in dict.fromkeys(par.experts + par.expert_mlp) if a not in size1)
    # tokens must meet every expert shard
    gather = tuple(a for a in par.batch if a in reduce_axes)
    psum_axes = tuple(a for a in reduce_axes if a not in gather)
    batch = par.batch or None

    lead = 0 if layer is None else 1
    ep_degree = int(np.prod([par.mesh.shape[a] for a in par.experts]))

    def spec_of(w, mlp_dim):
        dims = [None] * w.ndim
        dims[lead] = par.experts or None
        if par.expert_mlp:
            dims[lead + mlp_dim] = par.expert_mlp
        return P(*dims)

    def specs_for(w, mlp_dim):
        if isinstance(w, Int4Weight):
            return Int4Weight(spec_of(w.packed, mlp_dim), spec_of(w.scale, mlp_dim))
        return spec_of(w, mlp_dim)

    w_specs = ExpertWeights(
        specs_for(experts.gate, 1), specs_for(experts.up, 1), specs_for(experts.down, 2)
    )

    def local(x, idx, wt, ew: ExpertWeights, *layer_arg):
        layer = layer_arg[0] if layer_arg else None
        if gather:
            x = jax.lax.all_gather(x, gather, axis=0, tiled=True)
            idx = jax.lax.all_gather(idx, gather, axis=0, tiled=True)
            wt = jax.lax.all_gather(wt, gather, axis=0, tiled=True)
        if par.experts:
            e_local = _num_experts(ew.gate, stacked=layer is not None)
            shard = 0
            for a in par.experts:
                shard = shard * par.mesh.shape[a] + jax.lax.axis_index(a)
            lidx = idx - shard * e_local
            mine = (lidx >= 0) & (lidx < e_local)
            idx = jnp.where(mine, lidx, e_local)
            wt = jnp.where(mine, wt, 0.0)
        y = _routed_experts_local(x, idx, wt, ew, pallas, layer, held_share=1.0 / ep_degree,
                                  invariant=invariant)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if psum_axes:
            y = jax.lax.psum(y, psum_axes)
        return y

    args, specs = (
        (x_TD, idx_TK, weight_TK, experts),
        (P(batch, None), P(batch, None), P(batch, None), w_specs),
    )
    if layer is not None:
        args, specs = args + (jnp.asarray(layer, jnp.int32),), specs + (P(),)
    return shard_map(local, par.mesh, in_specs=specs, out_specs=P(batch, None))(*args)


def _routed_experts_local(x_TD, idx_TK, weight_TK, experts: ExpertWeights, pallas: bool, layer=None,
                          held_share: float = 1.0, invariant: bool = False):
    pallas = pallas and isinstance(experts.gate, Int4Weight)
    if layer is not None:
        # [L, E, ...] -> [L*E, ...] (a bitcast) and ids offset into it; others stay out of range
        if pallas:
            n_layers, E = _leading(experts.gate)
            experts = jax.tree.map(lambda a: a.reshape(n_layers * E, *a.shape[2:]), experts)
            idx_TK = jnp.where((idx_TK >= 0) & (idx_TK < E), idx_TK + layer * E, n_layers * E)
        else:
            experts = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), experts
            )
    if pallas:
        from pallas_kernels.int4 import moe_gmm
        g, u, d = experts.gate, experts.up, experts.down
        y = moe_gmm.moe_experts(
            x_TD.astype(jnp.bfloat16),
            idx_TK,
            weight_TK,
            g.packed,
            g.scale,
            u.packed,
            u.scale,
            d.packed,
            d.scale,
            held_share=held_share,
            invariant=invariant,
        )
        return y.astype(x_TD.dtype)
    if invariant:
        return _routed_experts_every(x_TD, idx_TK, weight_TK, experts)
    return _routed_experts_xla(x_TD, idx_TK, weight_TK, experts)


def _routed_experts_xla(x_TD, idx_TK, weight_TK, experts: ExpertWeights):
    """Sort the T*K (token, expert) pairs by expert and run grouped matmuls (lax.ragged_dot).
    Pairs with an id >= E (experts held elsewhere) sort last, fall in no group and contribute 0."""
    T, K = idx_TK.shape
    E = _num_experts(experts.gate)
    dtype = x_TD.dtype
    flat_e = idx_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token_of = order // K
    x_sorted = x_TD[token_of]
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)

    def gmm(lhs, w):  # lhs [T*K, in], w [E, out, in] -> [T*K, out]
        wd = jnp.swapaxes(dequantize(w, dtype), 1, 2)
        return jax.lax.ragged_dot(lhs, wd, group_sizes, preferred_element_type=jnp.float32)

    gate = gmm(x_sorted, experts.gate)
    up = gmm(x_sorted, experts.up)
    h = (jax.nn.silu(gate) * up).astype(dtype)
    y_sorted = gmm(h, experts.down)
    w_sorted = weight_TK.reshape(-1)[order].astype(jnp.float32)
    w_sorted = jnp.where(flat_e[order] < E, w_sorted, 0.0)
    y_sorted = jnp.where((flat_e[order] < E)[:, None], y_sorted, 0.0)
    y = jnp.zeros((T, x_TD.shape[-1]), jnp.float32).at[token_of].add(y_sorted * w_sorted[:, None])
    return y.astype(dtype)


def _routed_experts_every(x_TD, idx_TK, weight_TK, experts: ExpertWeights):
    """`_routed_experts_xla` with each token's result independent of the others
    (ExecPlan.batch_invariant): every token through every expert (`row_tiles`, an expert a loop
    iteration), then its K picks weighted and added in its own top-k order. The grouped form's
    groups, and so its products' row counts, follow the batch's routing; this reads E / K times the
    FLOPs (the XLA path serves small models)."""
    T, K = idx_TK.shape
    E = _num_experts(experts.gate)
    dtype = x_TD.dtype

    def expert(ew: ExpertWeights):
        g, u, d = (dequantize(w, dtype) for w in (ew.gate, ew.up, ew.down))

        def rows(x_tD):
            gate = jnp.einsum("td,fd->tf", x_tD, g, preferred_element_type=jnp.float32)
            up = jnp.einsum("td,fd->tf", x_tD, u, preferred_element_type=jnp.float32)
            h = (jax.nn.silu(gate) * up).astype(dtype)
            return jnp.einsum("tf,df->td", h, d, preferred_element_type=jnp.float32)
        return row_tiles(rows, x_TD)

    y_ETD = jax.lax.map(expert, experts)
    y = jnp.zeros((T, x_TD.shape[-1]), jnp.float32)
    for k in range(K):
        e_T = idx_TK[:, k]
        y_k = jnp.take_along_axis(y_ETD, jnp.clip(e_T, 0, E - 1)[None, :, None], axis=0)[0]
        w_T = jnp.where(e_T < E, weight_TK[:, k].astype(jnp.float32), 0.0)
        y = y + w_T[:, None] * y_k
    return y.astype(dtype)


def _leading(w: Weight) -> tuple[int, ...]:
    return (w.packed if isinstance(w, Int4Weight) else w).shape[:2]


def _num_experts(w: Weight, stacked: bool = False) -> int:
    return (w.packed if isinstance(w, Int4Weight) else w).shape[1 if stacked else 0]


def page_split(parallel) -> tuple[str, ...]:
    """Mesh axes a paged pool's page axis is split over: the batch axes when they span > 1 device,
    else (). Each rank then holds its own rows' pages and block tables hold page ids LOCAL to the
    row's rank."""
    if parallel is None:
        return ()
    axes = tuple(parallel.batch)
    return axes if int(np.prod([parallel.mesh.shape[a] for a in axes])) > 1 else ()


def _layer_pages(pool_LXpC: jax.Array, block_table_BP: jax.Array, layer):
    """(pool [L, X, page, C] flattened to [L * X, page, C], page ids offset by layer * X)."""
    L, X = pool_LXpC.shape[:2]
    return pool_LXpC.reshape(L * X, *pool_LXpC.shape[2:]), block_table_BP + layer * X


def _stacked(pool, layer):
    """(stacked pool [L, X, page, C], layer): a flat pool [X, page, C] is a one-layer stack."""
    return (pool[None], 0) if layer is None else (pool, layer)


def per_page_shard(f, parallel, in_specs, out_specs):
    """f run per shard of a page-split pool (`page_split`), else f itself. Specs are written with
    the placeholder "split" for the page / batch axes; it becomes the split's mesh axes."""
    split = page_split(parallel)
    if not split:
        return f
    from jax.sharding import PartitionSpec as P
    sub = lambda spec: P(*[split if a == "split" else a for a in spec])   # noqa: E731
    return shard_map(f, parallel.mesh, in_specs=tuple(sub(s) for s in in_specs),
                      out_specs=sub(out_specs))


def per_attention_shard(f, parallel, rows_spec):
    """f(q_lat, q_pe, new, pool, rows, positions, layer), an absorbed MLA op over a paged pool, run
    per shard under a mesh of more than one device, else f itself: queries, new tokens and
    positions split by the batch axes (heads by the heads axes), the pool by its page split
    (`page_split`); rows_spec(P, b): the spec of its rows argument (a block table, RaggedRows)."""
    if parallel is None or parallel.mesh.size <= 1:
        return f
    from jax.sharding import PartitionSpec as P
    b, h = parallel.batch or None, parallel.heads or None
    split = page_split(parallel) or None
    return shard_map(
        f,
        parallel.mesh,
        in_specs=(
            P(b, None, h, None),
            P(b, None, h, None),
            P(b, None, None),
            P(None, split, None, None),
            rows_spec(P, b),
            P(b, None),
            P(),
        ),
        out_specs=P(b, None, h, None),
    )


def gather_pages(
    pool: jax.Array, block_table_BP: jax.Array, *, layer=None, parallel=None
) -> jax.Array:
    """The pages of each sequence in position order -> [B, P * page, C]. pool: [X, page, C], or a
    stack [L, X, page, C] with `layer`; a page-split pool (`page_split`) is gathered per shard, in
    place."""
    pool_LXpC, layer = _stacked(pool, layer)

    def gather(pool_LXpC, table, layer):
        flat, table = _layer_pages(pool_LXpC, table, layer)
        B, P = table.shape
        return flat[table].reshape(B, P * flat.shape[1], flat.shape[2])

    if page_split(parallel):
        return per_page_shard(
            gather,
            parallel,
            ((None, "split", None, None), ("split", None), ()),
            ("split", None, None),
        )(pool_LXpC, block_table_BP, jnp.asarray(layer, jnp.int32))
    return gather(pool_LXpC, block_table_BP, layer)


def mla_decode_kernel(rows: int, A: int, R: int, page: int, dtype, *, batch: int = 64,
                      context: int = 1 << 17, plan: Optional[ExecPlan] = None) -> str:
    """'mgpu' or 'triton' for `rows` = T * N query rows per sequence: mgpu where its tiles fill, on
    Hopper, with >= 16K tokens per row or >= 32K per batch (BENCHMARKS.md "MLA decode attention"); a
    forced plan wins."""
    plan = default_plan(plan)
    if plan.mla_decode_kernel != "auto":
        return plan.mla_decode_kernel
    fits = (
        rows % 64 == 0
        and A % 256 == 0
        and R == 64
        and page % 8 == 0
        and (64 % page == 0 or page % 64 == 0)
        and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    )
    pays = batch * context >= 32768 or context >= 16384
    return "mgpu" if fits and pays and plan.hopper else "triton"


def mla_paged_attention(
    q_lat_BTNA: jax.Array,
    q_pe_BTNR: jax.Array,
    new_BTC: jax.Array,
    pool_XpC: jax.Array,
    block_table_BP: jax.Array,
    positions_BT: jax.Array,
    scale: float,
    *,
    plan: Optional[ExecPlan] = None,
    parallel=None,
    layer=None,
) -> jax.Array:
    """Absorbed MLA over a paged latent cache plus the step's new tokens -> o_lat [B, T, N, A].
    q_lat = W_UK^T q; new_BTC: the new tokens' [c | k^R], not in the pool; pool as `gather_pages`;
    positions_BT < 0 is padding. Row b sees cached [0, positions[b, 0]) and new tokens t' <= t."""
    plan = default_plan(plan)
    A, R = q_lat_BTNA.shape[-1], q_pe_BTNR.shape[-1]
    # the kernel's tiles: powers of two >= 16
    kernel_fits = all(v >= 16 and not v & (v - 1) for v in (A, R))
    pool_LXpC, layer = _stacked(pool_XpC, layer)
    if plan.pallas and kernel_fits:
        from pallas_kernels.mla import decode as mla_decode

        def kernel(q_lat, q_pe, new, pool_LXpC, table, positions, layer):
            flat, table = _layer_pages(pool_LXpC, table, layer)
            B, T, N, _ = q_lat.shape
            page = flat.shape[1]
            same = flat.dtype == q_lat.dtype == new.dtype
            thresholds = dict(combine_xla_max_macs=plan.combine_xla_max_macs,
                              one_new_token_elementwise=plan.one_new_token_elementwise)
            if same and mla_decode_kernel(T * N, A, R, page, q_lat.dtype, batch=B,
                                          context=table.shape[1] * page, plan=plan) == "mgpu":
                from pallas_kernels.mla import decode_mgpu as mla_decode_mgpu
                cfg = mla_decode_mgpu.serving_config(B, plan.mla_schedule)
                return mla_decode_mgpu.mla_paged_attention_mgpu(
                    q_lat, q_pe, new, flat, table, positions, scale,
                    config=cfg, interpret=jax.default_backend() != "gpu", **thresholds)
            schedule = plan.mla_schedule or "rows"
            # the balanced schedule finishes in XLA
            fuse_new = plan.mla_fuse_new and schedule == "rows"
            cfg = (None if plan.mla_schedule is None and not fuse_new
                   else mla_decode.MlaDecodeConfig(schedule=schedule, fuse_new=fuse_new))
            return mla_decode.mla_paged_attention(
                q_lat, q_pe, new, flat, table, positions, scale, config=cfg, **thresholds
            )

        kernel = per_attention_shard(kernel, parallel, lambda P, b: P(b, None))
        return kernel(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_LXpC, block_table_BP, positions_BT,
                      jnp.asarray(layer, jnp.int32))
    return _mla_paged_attention_xla(
        q_lat_BTNA,
        q_pe_BTNR,
        new_BTC,
        pool_LXpC,
        block_table_BP,
        positions_BT,
        scale,
        invariant=default_plan(plan).batch_invariant,
        layer=layer,
        parallel=parallel,
    )


def paged_keys(
    pool: jax.Array,
    block_table_BP: jax.Array,
    new_BTC: jax.Array,
    positions_BT: jax.Array,
    *,
    layer=None,
    parallel=None,
):
    """(keys [B, P * page + T, C] in new_BTC's dtype, mask [B, T, P * page + T]): cached pages, then
    the new tokens; masks as `mla_paged_attention`; pool, layer, parallel as `gather_pages`."""
    old_BSC = gather_pages(pool, block_table_BP, layer=layer, parallel=parallel)
    S = old_BSC.shape[1]
    old_mask_BTS = jnp.broadcast_to((jnp.arange(S)[None, :] < positions_BT[:, :1])[:, None, :],
                                    (*positions_BT.shape, S))
    new_mask_BTS = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (
        positions_BT[:, None, :] >= 0
    )
    return (jnp.concatenate([old_BSC.astype(new_BTC.dtype), new_BTC], axis=1),
            jnp.concatenate([old_mask_BTS, new_mask_BTS], axis=-1))


def _mla_paged_attention_xla(
    q_lat_BTNA,
    q_pe_BTNR,
    new_BTC,
    pool,
    block_table_BP,
    positions_BT,
    scale,
    *,
    invariant=False,
    layer=None,
    parallel=None,
):
    A = q_lat_BTNA.shape[-1]
    dtype = q_lat_BTNA.dtype
    keys_BSC, mask_BTS = paged_keys(
        pool, block_table_BP, new_BTC.astype(dtype), positions_BT, layer=layer, parallel=parallel
    )
    c_BSA, kpe_BSR = keys_BSC[..., :A], keys_BSC[..., A:]
    s_BNTS = (einsum_f32("btna,bsa->bnts", q_lat_BTNA, c_BSA)
              + einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR)) * scale
    p_BNTS = softmax(jnp.where(mask_BTS[:, None], s_BNTS, -1e30), invariant=invariant).astype(dtype)
    return einsum_f32("bnts,bsa->btna", p_BNTS, c_BSA).astype(dtype)
