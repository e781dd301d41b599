"""Kernel selection: the only module that imports `pallas_kernels`.

Each op has an 'xla' implementation (plain jnp/lax, runs everywhere) and, where one exists, a 'pallas'
implementation (GPU kernels). `impl=None` picks 'pallas' on GPU and 'xla' elsewhere; tests force each
with `impl=` or with `use_impl(...)`. `mla_prefill_attention`'s GPU path is not Pallas but cuDNN flash
attention: one causal jax.nn.dot_product_attention call for fresh prefills; for prefill chunks after
cached tokens two unmasked calls (chunk x cached keys, chunk x itself) merged by log-sum-exp;
`use_prefill_attention` / `use_chunk_attention` force a path.

Weight layout for routed experts (compressed-tensors / HF, rows are output features):
  bf16:  ExpertWeights(gate=[E, F, D], up=[E, F, D], down=[E, D, F])
  INT4:  ExpertWeights(gate=Int4Weight(packed int32 [E, F, D/8], scale bf16 [E, F, D/g]), ...)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

_FORCED_IMPL: Optional[str] = None
IMPLS = ("xla", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """compressed-tensors pack-quantized INT4: `packed` int32 [..., N, K/8], `scale` [..., N, K/g]."""
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


@contextlib.contextmanager
def _forced(name: str, value: Optional[str], choices: tuple, what: str):
    """Set the module-level switch `name` to `value` inside the block (None: automatic)."""
    if value is not None and value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {choices}")
    old = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = old


def use_impl(impl: Optional[str]):
    """Force every op to one implementation inside the block (for tests and benchmarks)."""
    return _forced("_FORCED_IMPL", impl, IMPLS, "ops implementation")


def resolve_impl(impl: Optional[str] = None) -> str:
    impl = impl or _FORCED_IMPL
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in IMPLS:
        raise ValueError(f"unknown ops implementation {impl!r}; expected one of {IMPLS}")
    return impl


def dequantize(w: Weight, dtype) -> jax.Array:
    """Dense weight [..., N, K] from bf16 or INT4 storage (the XLA path; unfused)."""
    if isinstance(w, Int4Weight):
        from checkpoints.int4 import dequantize_jnp
        return dequantize_jnp(w.packed, w.scale, w.group_size, dtype)
    return w.astype(dtype)


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum accumulating and returning float32. XLA:CPU cannot run some bf16 x bf16 -> f32 dots
    (batch dimensions that are not leading: "UNIMPLEMENTED ... DotThunk"), so on CPU the operands are
    widened to f32 first (exact; the products and sums are f32 either way)."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.promote_types(a.dtype, jnp.float32)), b.astype(jnp.promote_types(b.dtype, jnp.float32))
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: Weight, *, impl: Optional[str] = None) -> jax.Array:
    """y[..., N] = x[..., K] @ w[N, K]^T (HF Linear layout), float32 accumulation."""
    if isinstance(w, Int4Weight) and resolve_impl(impl) == "pallas":
        from pallas_kernels import int4_matmul
        lead = x.shape[:-1]
        y = int4_matmul.int4_matmul(x.reshape(-1, x.shape[-1]), w.packed, w.scale)
        return y.reshape(*lead, y.shape[-1])
    wd = dequantize(w, x.dtype)
    # The dot accumulates in float32 either way (XLA's GPU/CPU dots); asking for the output in the
    # model dtype keeps tensor-parallel partial sums in bf16 on the wire (half the bytes of f32).
    return jnp.einsum("...k,nk->...n", x, wd, preferred_element_type=x.dtype)


def routed_experts(x_TD: jax.Array, idx_TK: jax.Array, weight_TK: jax.Array, experts: ExpertWeights,
                   *, impl: Optional[str] = None, parallel=None, layer=None) -> jax.Array:
    """sum_k weight[t,k] * down(silu(gate(x_t)) * up(x_t)) over the K experts idx[t,k] of each token.

    x_TD: [T, D] activations; idx_TK: [T, K] int32 expert ids in [0, E); weight_TK: [T, K] float32.
    Returns [T, D] in x's dtype. Experts that receive no token are never read by the pallas path.
    `parallel` (kimi_jax.sharding.MoEParallel) runs the experts sharded inside shard_map.
    `layer` (an int or a traced int32 scalar): the weights are a whole layer stack [L, E, ...] and this
    call runs layer `layer` of it without copying that layer's slice out (the kernels offset the ids).
    """
    if parallel is not None:
        return _routed_experts_sharded(x_TD, idx_TK, weight_TK, experts, parallel, impl, layer)
    return _routed_experts_local(x_TD, idx_TK, weight_TK, experts, impl, layer)


def _routed_experts_sharded(x_TD, idx_TK, weight_TK, experts: ExpertWeights, par, impl, layer):
    """Each device runs the experts (or expert slices) it holds on the tokens of its data-parallel
    group, then partial sums are reduced. Tokens whose expert lives elsewhere get weight 0 and an
    out-of-range id (E_local), which both paths skip."""
    from jax.sharding import PartitionSpec as P
    size1 = {a for a in par.mesh.axis_names if par.mesh.shape[a] == 1}     # nothing to exchange there
    reduce_axes = tuple(a for a in dict.fromkeys(par.experts + par.expert_mlp) if a not in size1)
    gather = tuple(a for a in par.batch if a in reduce_axes)     # tokens must meet every expert shard
    psum_axes = tuple(a for a in reduce_axes if a not in gather)
    batch = par.batch or None

    lead = 0 if layer is None else 1          # a layer-stacked weight has the layer axis first

    def spec_of(w, mlp_dim):  # expert dim 0; FFN width at mlp_dim (packed/scale share the layout)
        dims = [None] * w.ndim
        dims[lead] = par.experts or None
        if par.expert_mlp:
            dims[lead + mlp_dim] = par.expert_mlp
        return P(*dims)

    def specs_for(w, mlp_dim):
        if isinstance(w, Int4Weight):
            return Int4Weight(spec_of(w.packed, mlp_dim), spec_of(w.scale, mlp_dim))
        return spec_of(w, mlp_dim)

    w_specs = ExpertWeights(specs_for(experts.gate, 1), specs_for(experts.up, 1), specs_for(experts.down, 2))

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
        y = _routed_experts_local(x, idx, wt, ew, impl, layer)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if psum_axes:
            y = jax.lax.psum(y, psum_axes)
        return y

    args, specs = (x_TD, idx_TK, weight_TK, experts), (P(batch, None), P(batch, None), P(batch, None), w_specs)
    if layer is not None:                     # the layer index rides along, replicated
        args, specs = args + (jnp.asarray(layer, jnp.int32),), specs + (P(),)
    return _shard_map(local, par.mesh, in_specs=specs, out_specs=P(batch, None))(*args)


def _shard_map(f, mesh, in_specs, out_specs):
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except (AttributeError, TypeError):  # older jax
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _routed_experts_local(x_TD, idx_TK, weight_TK, experts: ExpertWeights, impl, layer=None):
    pallas = resolve_impl(impl) == "pallas" and isinstance(experts.gate, Int4Weight)
    if layer is not None:
        if pallas:   # [L, E, ...] -> [L*E, ...] (a bitcast) and ids offset into it; others stay out of range
            n_layers, E = _leading(experts.gate)
            experts = jax.tree.map(lambda a: a.reshape(n_layers * E, *a.shape[2:]), experts)
            idx_TK = jnp.where((idx_TK >= 0) & (idx_TK < E), idx_TK + layer * E, n_layers * E)
        else:        # the XLA path reads the layer's slice (XLA fuses the dynamic slice into its users)
            experts = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), experts)
    if pallas:
        from pallas_kernels import moe_gmm
        g, u, d = experts.gate, experts.up, experts.down
        # The kernels are W4A16, bf16 activations in and out: a float32 model's experts see their input
        # and return their sum rounded to bf16 (accumulation is float32 inside). Pairs whose expert lives
        # on another device (id E_local) are skipped by the kernels.
        y = moe_gmm.moe_experts(x_TD.astype(jnp.bfloat16), idx_TK, weight_TK, g.packed, g.scale, u.packed,
                                u.scale, d.packed, d.scale)
        return y.astype(x_TD.dtype)
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
    x_sorted = x_TD[token_of]                                          # [T*K, D]
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)    # [E]

    def gmm(lhs, w):  # lhs [M, in], w [E, out, in] -> [M, out]
        wd = jnp.swapaxes(dequantize(w, dtype), 1, 2)                  # [E, in, out]
        return jax.lax.ragged_dot(lhs, wd, group_sizes, preferred_element_type=jnp.float32)

    gate = gmm(x_sorted, experts.gate)
    up = gmm(x_sorted, experts.up)
    h = (jax.nn.silu(gate) * up).astype(dtype)
    y_sorted = gmm(h, experts.down)                                    # [T*K, D] float32
    w_sorted = weight_TK.reshape(-1)[order].astype(jnp.float32)
    w_sorted = jnp.where(flat_e[order] < E, w_sorted, 0.0)
    y_sorted = jnp.where((flat_e[order] < E)[:, None], y_sorted, 0.0)
    y = jnp.zeros((T, x_TD.shape[-1]), jnp.float32).at[token_of].add(y_sorted * w_sorted[:, None])
    return y.astype(dtype)


def _leading(w: Weight) -> tuple[int, ...]:
    return (w.packed if isinstance(w, Int4Weight) else w).shape[:2]


def _num_experts(w: Weight, stacked: bool = False) -> int:
    return (w.packed if isinstance(w, Int4Weight) else w).shape[1 if stacked else 0]


def page_split(parallel) -> tuple[str, ...]:
    """Mesh axes a paged pool's page axis is split over: the batch's (data-parallel) axes when they span
    more than one device, else () (the pool is whole on every device, as under tensor parallelism).
    With a split, each data-parallel rank holds the pages of its own batch rows only (rows are split
    over the same axes in contiguous blocks) and block tables hold page ids LOCAL to the row's rank
    (kimi_jax.scheduler allocates them from the rank's partition)."""
    if parallel is None:
        return ()
    axes = tuple(parallel.batch)
    return axes if int(np.prod([parallel.mesh.shape[a] for a in axes])) > 1 else ()


def _layer_pages(pool_LNpC: jax.Array, block_table_BP: jax.Array, layer):
    """One layer's view of a stacked pool [L, N, page, C]: the pool flattened to [L * N, page, C] (a
    bitcast) and the page ids offset by layer * N. Under a page split this runs per shard, N the
    shard's own page count (ids are local)."""
    L, N = pool_LNpC.shape[:2]
    return pool_LNpC.reshape(L * N, *pool_LNpC.shape[2:]), block_table_BP + layer * N


def _stacked(pool, layer):
    """(stacked pool [L, N, page, C], layer): a flat pool [X, page, C] is a one-layer stack."""
    return (pool[None], 0) if layer is None else (pool, layer)


def _per_page_shard(f, parallel, in_specs, out_specs):
    """f run per shard of a page-split pool (`page_split`), else f itself. Specs are written with the
    placeholder "split" for the page / batch axes; it becomes the split's mesh axes."""
    split = page_split(parallel)
    if not split:
        return f
    from jax.sharding import PartitionSpec as P
    sub = lambda spec: P(*[split if a == "split" else a for a in spec])   # noqa: E731
    return _shard_map(f, parallel.mesh, in_specs=tuple(sub(s) for s in in_specs),
                      out_specs=sub(out_specs))


def gather_pages(pool: jax.Array, block_table_BP: jax.Array, *, layer=None, parallel=None) -> jax.Array:
    """The pages of each sequence in position order -> [B, P * page, C]. pool: [X, page, C] with
    page ids into it (layer None), or a layer stack [L, N, page, C] with this layer's index and ids
    into the layer's N pages. parallel: a page-split pool (`page_split`) is gathered per shard, each
    rank reading its own rows' pages with local ids (the pool never moves)."""
    pool_L, layer = _stacked(pool, layer)

    def gather(pool_L, table, layer):
        flat, table = _layer_pages(pool_L, table, layer)
        B, P = table.shape
        return flat[table].reshape(B, P * flat.shape[1], flat.shape[2])

    if page_split(parallel):
        return _per_page_shard(gather, parallel, ((None, "split", None, None), ("split", None), ()),
                               ("split", None, None))(pool_L, block_table_BP, jnp.asarray(layer, jnp.int32))
    return gather(pool_L, block_table_BP, layer)


# Which Pallas kernel `mla_paged_attention` runs over the cache (read at trace time, like use_impl):
# None = automatic (`mla_decode_kernel`), "triton" (pallas_kernels/mla_decode.py, any head count) or
# "mgpu" (pallas_kernels/mla_decode_mgpu.py: Mosaic GPU wgmma + TMA, 64-row tiles; on CPU it runs in
# the Mosaic GPU interpreter).
_MLA_DECODE_KERNEL: Optional[str] = None
MLA_DECODE_KERNELS = ("triton", "mgpu")


def use_mla_decode_kernel(choice: Optional[str]):
    """Force the paged MLA decode kernel inside the block: None (automatic), 'triton' or 'mgpu'."""
    return _forced("_MLA_DECODE_KERNEL", choice, MLA_DECODE_KERNELS, "MLA decode kernel")


# How the decode kernels share a step's cached tokens among their programs (read at trace time):
# None = each kernel's default, 'rows' (every row split into the same number of parts of its own
# length) or 'balanced' (pallas_kernels.mla_decode.balanced_items: parts of one size across the
# batch). Measured on the H200 (BENCHMARKS.md MLA rounds 11-12): 'balanced' is 1.4-7.3x faster on
# batches of one long row among short ones; on equal rows within 4% from 32K up, slower at 4K (its
# item table and combine: 4-7% at batch 64 since round 12's combine, up to 37% at batch 8-16), so it
# is not the ops default: the engine asks for it per decode step when a batch is skewed
# (kimi_jax.engine.mla_schedule_for: longest row >= 2x the mean, BENCHMARKS.md round 12's mild skew).
_MLA_SCHEDULE: Optional[str] = None


def use_mla_schedule(schedule: Optional[str]):
    """Force the paged MLA decode kernels' work schedule inside the block: None, 'rows' or 'balanced'."""
    from pallas_kernels.mla_decode import SCHEDULES
    return _forced("_MLA_SCHEDULE", schedule, SCHEDULES, "MLA decode schedule")


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def mla_decode_kernel(rows: int, A: int, R: int, page: int, dtype, *, batch: int = 64,
                      context: int = 1 << 17) -> str:
    """The decode kernel for `rows` = T * N query rows per sequence on one device, `batch` sequences
    whose block tables hold up to `context` tokens: the Mosaic GPU kernel where its 64-row wgmma tiles
    are full (rows a multiple of 64: 64 heads at TP1 / DP, or T * N under speculation) on a Hopper GPU
    with bf16, A a multiple of 256, R = 64, a page size of 8, 16, 32 or a multiple of 64, and a cache
    large enough to pay for its fixed cost; else the Triton kernel (8 heads per device under TP8: the
    mgpu kernel would pad 8 rows to 64). Measured on the H200 at 64 heads (BENCHMARKS.md, fifth
    session, `launch.bench_mla`: each timed call 8 layers in one executable, calls enqueued back to
    back): mgpu 1.3-4.2x the Triton kernel from 8 x 4K up (8 x 4K: 57.5 vs 72.2 us); at 1 x 4K
    Triton's 31 us wins. So mgpu needs tables of >= 16K tokens per row or >= 32K in the batch
    (`context`: the block table's capacity, a bucket). (The fourth session's harness, one dispatch per
    call, had Triton ahead at 8 x 4K too; there the host's dispatch set the pace of both.)"""
    if _MLA_DECODE_KERNEL is not None:
        return _MLA_DECODE_KERNEL
    fits = (rows % 64 == 0 and A % 256 == 0 and R == 64 and page % 8 == 0 and (64 % page == 0 or page % 64 == 0)
            and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16))
    pays = batch * context >= 32768 or context >= 16384
    return "mgpu" if fits and pays and _is_hopper() else "triton"


def mla_paged_attention(q_lat_BTNA: jax.Array, q_pe_BTNR: jax.Array, new_BTC: jax.Array, pool_XpC: jax.Array,
                        block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                        impl: Optional[str] = None, parallel=None, layer=None) -> jax.Array:
    """Absorbed MLA over a paged latent cache plus the step's new tokens; returns o_lat [B, T, N, A].

    q_lat: queries in latent space (W_UK^T q^C); q_pe: rotated rope queries; new_BTC: the new tokens'
    [c | k^R] (C = A + R), not yet in the pool; pool_XpC [X, page, C] with block_table_BP page ids into
    it, or (layer given) the layer stack's pool [L, N, page, C] and ids into this layer's N pages;
    positions_BT: the new tokens' absolute positions (consecutive per row, < 0 = padding). Row b's
    cached tokens are positions [0, positions[b, 0]); new token t also sees new tokens t' <= t.
    score = (q_lat . c + q_pe . k^R) * scale, softmax in float32, output sum_s p_s c_s.
    parallel: a kimi_jax.sharding.MoEParallel: the GPU kernel then runs per device shard (rows over the
    batch axes, heads over the head axes); a page-split pool (`page_split`: ids local to each row's
    data-parallel rank) is read per shard by either path.
    """
    A, R = q_lat_BTNA.shape[-1], q_pe_BTNR.shape[-1]
    kernel_fits = all(v >= 16 and not v & (v - 1) for v in (A, R))   # the kernel's tiles: powers of two >= 16
    pool_L, layer = _stacked(pool_XpC, layer)
    if resolve_impl(impl) == "pallas" and kernel_fits:
        from pallas_kernels import mla_decode

        def kernel(q_lat, q_pe, new, pool_L, table, positions, layer):
            flat, table = _layer_pages(pool_L, table, layer)
            B, T, N, _ = q_lat.shape          # this device's shard under shard_map
            page = flat.shape[1]
            same = flat.dtype == q_lat.dtype == new.dtype       # the mgpu kernel takes bf16 throughout
            if same and mla_decode_kernel(T * N, A, R, page, q_lat.dtype, batch=B,
                                          context=table.shape[1] * page) == "mgpu":
                from pallas_kernels import mla_decode_mgpu
                cfg = mla_decode_mgpu.SERVING_CONFIG
                if _MLA_SCHEDULE is not None:
                    cfg = dataclasses.replace(cfg, schedule=_MLA_SCHEDULE)
                return mla_decode_mgpu.mla_paged_attention_mgpu(
                    q_lat, q_pe, new, flat, table, positions, scale,
                    config=cfg, interpret=jax.default_backend() != "gpu")
            cfg = None if _MLA_SCHEDULE is None else mla_decode.MlaDecodeConfig(schedule=_MLA_SCHEDULE)
            return mla_decode.mla_paged_attention(q_lat, q_pe, new, flat, table, positions, scale, config=cfg)

        if parallel is not None and parallel.mesh.size > 1:
            # a kernel is opaque to XLA's partitioner (it would gather every operand and run the whole
            # batch and every head on each device): run it per shard, rows split like the batch and
            # heads like the attention weights; the pool's pages split like the rows (ids local to the
            # shard) under data parallelism, else whole on every device
            from jax.sharding import PartitionSpec as P
            b, h = parallel.batch or None, parallel.heads or None
            split = page_split(parallel) or None
            kernel = _shard_map(kernel, parallel.mesh,
                                in_specs=(P(b, None, h, None), P(b, None, h, None), P(b, None, None),
                                          P(None, split, None, None), P(b, None), P(b, None), P()),
                                out_specs=P(b, None, h, None))
        return kernel(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_L, block_table_BP, positions_BT,
                      jnp.asarray(layer, jnp.int32))
    return _mla_paged_attention_xla(q_lat_BTNA, q_pe_BTNR, new_BTC, pool_L, block_table_BP, positions_BT,
                                    scale, layer=layer, parallel=parallel)


def paged_keys(pool: jax.Array, block_table_BP: jax.Array, new_BTC: jax.Array, positions_BT: jax.Array, *,
               layer=None, parallel=None):
    """Keys of paged attention, (keys [B, P * page + T, C] in new_BTC's dtype, mask [B, T, P * page + T]):
    each row's cached pages in position order followed by the step's new tokens. Row b's cached tokens
    are positions [0, positions[b, 0]); new token t sees new tokens t' <= t (positions < 0: padding).
    pool, layer, parallel: as `gather_pages`."""
    old_BSC = gather_pages(pool, block_table_BP, layer=layer, parallel=parallel)
    S = old_BSC.shape[1]
    old_mask_BTS = jnp.broadcast_to((jnp.arange(S)[None, :] < positions_BT[:, :1])[:, None, :],
                                    (*positions_BT.shape, S))
    new_mask_BTS = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (positions_BT[:, None, :] >= 0)
    return (jnp.concatenate([old_BSC.astype(new_BTC.dtype), new_BTC], axis=1),
            jnp.concatenate([old_mask_BTS, new_mask_BTS], axis=-1))


def _mla_paged_attention_xla(q_lat_BTNA, q_pe_BTNR, new_BTC, pool, block_table_BP, positions_BT, scale, *,
                             layer=None, parallel=None):
    A = q_lat_BTNA.shape[-1]
    dtype = q_lat_BTNA.dtype
    keys_BSC, mask_BTS = paged_keys(pool, block_table_BP, new_BTC.astype(dtype), positions_BT, layer=layer,
                                    parallel=parallel)
    c_BSA, kpe_BSR = keys_BSC[..., :A], keys_BSC[..., A:]
    s_BNTS = (einsum_f32("btna,bsa->bnts", q_lat_BTNA, c_BSA)
              + einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR)) * scale
    p_BNTS = jax.nn.softmax(jnp.where(mask_BTS[:, None], s_BNTS, -1e30), axis=-1).astype(dtype)
    return einsum_f32("bnts,bsa->btna", p_BNTS, c_BSA).astype(dtype)


# ---- expanded-form (prefill) attention -------------------------------------------------------------

# How `mla_prefill_attention` runs a fresh causal prefill (`causal=True`): None = automatic (cuDNN flash
# attention when resolve_impl gives 'pallas' and the case fits, else the XLA einsum path); "einsum":
# always the XLA einsum path; "cudnn" / "xla": one jax.nn.dot_product_attention call with that
# implementation (V zero-padded to the qk head dim) for every causal case. "xla" runs the cuDNN
# formulation anywhere: the CPU stand-in the tests use. Read at trace time, like use_impl: set it before
# an engine first compiles a step.
_PREFILL_ATTENTION: Optional[str] = None
PREFILL_ATTENTION_CHOICES = ("einsum", "cudnn", "xla")


def use_prefill_attention(choice: Optional[str]):
    """Force how fresh causal prefills attend inside the block: None (automatic), 'einsum', 'cudnn' or
    'xla' (see _PREFILL_ATTENTION)."""
    return _forced("_PREFILL_ATTENTION", choice, PREFILL_ATTENTION_CHOICES, "prefill attention")


# Prefill chunks that follow cached tokens (the scheduler's later prompt chunks, recomputes): their mask
# is each row's cached prefix plus the chunk causally, which cuDNN's top-left causal mask cannot
# express. 'cudnn' / 'xla': jax.nn.dot_product_attention with the explicit mask (cuDNN: an additive bias
# [B, 1, T, S], 64x smaller than the einsum path's f32 scores [B, N, T, S]). 'cudnn_split' / 'xla_split':
# no mask, two calls merged by their log-sum-exps (`_split_attention`): the chunk against the row's
# cached keys (per-row key lengths) and against itself (causal), for callers that pass `chunk_lens`.
# Automatic where resolve_impl gives 'pallas' and cuDNN fits: 'cudnn_split'. On the H200 (BENCHMARKS.md
# MLA round 13), 256-token chunks at 64 heads after 4K / 32K cached tokens and 4 x 32K: einsum 0.70 /
# 5.08 / 22.5 ms, masked 0.53 / 3.47 / 13.5 ms, split 0.34 / 1.79 / 6.9 ms. `use_chunk_attention` forces.
_CHUNK_ATTENTION: Optional[str] = None
CHUNK_ATTENTION_CHOICES = PREFILL_ATTENTION_CHOICES + ("cudnn_split", "xla_split")


def use_chunk_attention(choice: Optional[str]):
    """Force how prefill chunks after cached tokens attend inside the block: None (automatic:
    'cudnn_split' on a GPU where cuDNN fits, else 'einsum'), 'einsum', 'cudnn' or 'xla' (one masked
    jax.nn.dot_product_attention call), 'cudnn_split' or 'xla_split' (two unmasked calls merged; see
    _CHUNK_ATTENTION)."""
    return _forced("_CHUNK_ATTENTION", choice, CHUNK_ATTENTION_CHOICES, "chunk attention")


def cudnn_attention_fits(qk_dim: int, v_dim: int, dtype) -> bool:
    """Shapes and dtypes cuDNN flash attention takes through jax.nn.dot_product_attention (after V is
    padded to the qk head dim): bf16/fp16, head dim a multiple of 8 and at most 256 (Hopper and later;
    jax refuses > 128 on older GPUs at trace time, and the op then falls back to einsum)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and qk_dim % 8 == 0 and qk_dim <= 256 and v_dim <= qk_dim)


def prefill_attention_path(qk_dim: int, v_dim: int, dtype, *, causal: bool, impl: Optional[str] = None) -> str:
    """Which path mla_prefill_attention takes, decided at trace time: 'einsum' (XLA einsums and a masked
    softmax), 'cudnn' or 'xla' (one jax.nn.dot_product_attention call with that implementation), or for
    a chunk after cached tokens 'cudnn_split' / 'xla_split' (two unmasked calls merged).
    Only a fresh causal prefill (`causal`: the keys are the query tokens themselves, row by row) can use
    dot_product_attention: cuDNN's causal mask is aligned top-left, and rows with cached tokens before
    their chunk need it aligned bottom-right, per row: they take `_CHUNK_ATTENTION` if forced, else
    'cudnn_split' where cuDNN fits (two unmasked calls merged; the masked call where the caller gives no
    chunk_lens or the split is unavailable)."""
    forced = _PREFILL_ATTENTION if causal else _CHUNK_ATTENTION
    if forced is not None:
        return forced
    if resolve_impl(impl) == "pallas" and cudnn_attention_fits(qk_dim, v_dim, dtype):
        return "cudnn" if causal else "cudnn_split"
    return "einsum"


def _dot_product_attention(q_BTNK, k_BSNK, v_BSNK, scale, implementation):
    """jax.nn.dot_product_attention, causal (top-left); a module attribute so tests can wrap it."""
    return jax.nn.dot_product_attention(q_BTNK, k_BSNK, v_BSNK, scale=scale, is_causal=True,
                                        implementation=implementation)


def _masked_dot_product_attention(q_BTNK, k_BSNK, v_BSNK, mask_BTS, scale, implementation):
    """jax.nn.dot_product_attention with an explicit mask [B, T, S] (shared by the heads)."""
    return jax.nn.dot_product_attention(q_BTNK, k_BSNK, v_BSNK, mask=mask_BTS[:, None], scale=scale,
                                        implementation=implementation)


_warned_fallback = False


def mla_prefill_attention(q_nope_BTNH: jax.Array, q_pe_BTNR: jax.Array, k_BSNH: jax.Array, kpe_BSR: jax.Array,
                          v_BSNV: jax.Array, mask_BTS: jax.Array, scale: float, *, causal: bool = False,
                          impl: Optional[str] = None, parallel=None, chunk_lens=None) -> jax.Array:
    """Expanded-form MLA attention; returns o [B, T, N, V] float32.

    score[b,n,t,s] = (q_nope . k + q_pe . kpe) * scale over keys with mask[b,t,s], softmax in float32.
    q_nope [B, T, N, H], q_pe [B, T, N, R] (rotated), k [B, S, N, H], kpe [B, S, R] (rotated, shared by
    every head), v [B, S, N, V]; mask [B, T, S] bool.
    causal (static): a fresh prefill: S == T, the keys are the query tokens, each row's real tokens
    come first (positions 0, 1, ...) with padding only after them, and for every real query t
    mask[b,t,s] is exactly s <= t. Then jax.nn.dot_product_attention with is_causal=True gives the same
    outputs for the real tokens (padding tokens' outputs differ; they stay finite and are ignored).
    The dot_product_attention path concatenates [q_nope | q_pe] and [k | kpe] to one qk head dim and
    zero-pads V to it (the public API wants equal qk and v head dims; zero columns of V give zero
    output columns, sliced off). Otherwise (keys = a cached prefix plus the chunk) the path is
    `prefill_attention_path(causal=False)`'s: einsums; the same call with `mask` (a real query always
    sees itself; a padding query that sees no key is given key 0, so no kernel meets an empty row); or,
    given chunk_lens, two unmasked calls merged (`_split_attention`).
    parallel: a kimi_jax.sharding.MoEParallel: the cuDNN call runs per device shard inside shard_map
    (rows over the batch axes, heads over the head axes), as the decode kernel does.
    chunk_lens: (cached [B], new [B]) int32 when the keys are `paged_keys`' layout (S - T cached slots,
    row b's first cached[b] real, then the chunk, its first new[b] tokens real): the '_split' paths
    need it (without it they take the masked call).
    """
    global _warned_fallback
    H, R, V = q_nope_BTNH.shape[-1], q_pe_BTNR.shape[-1], v_BSNV.shape[-1]
    dtype = q_nope_BTNH.dtype
    fresh = causal and k_BSNH.shape[1] == q_nope_BTNH.shape[1]
    path = prefill_attention_path(H + R, V, dtype, causal=fresh, impl=impl)
    masked = path.removesuffix("_split")      # a split path falls back to the masked call (chunks only)
    for p in ([path, masked] if path != masked and chunk_lens is not None else [masked]):
        if p == "einsum":
            break
        try:
            return _mla_prefill_attention_dpa(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNV, scale, p,
                                              parallel, mask_BTS=None if fresh else mask_BTS,
                                              chunk_lens=chunk_lens if p.endswith("_split") else None)
        except (NotImplementedError, RuntimeError) as e:
            # raised while tracing (no cuDNN, an unsupported GPU or shape, jax's private cuDNN entry point
            # changed): take the next path (split -> masked call -> einsums)
            if not _warned_fallback:
                import logging
                logging.getLogger(__name__).warning("prefill attention: %s path unavailable (%s: %s); "
                                                    "falling back", p, type(e).__name__, e)
                _warned_fallback = True
    return _mla_prefill_attention_einsum(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNV, mask_BTS, scale)


def _mla_prefill_attention_einsum(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNV, mask_BTS, scale):
    dtype = q_nope_BTNH.dtype
    rope_BNTS = einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR)
    nope_BNTS = einsum_f32("btnh,bsnh->bnts", q_nope_BTNH, k_BSNH)
    s_BNTS = jnp.where(mask_BTS[:, None], (nope_BNTS + rope_BNTS) * scale, -1e30)
    p_BNTS = jax.nn.softmax(s_BNTS, axis=-1).astype(dtype)
    return einsum_f32("bnts,bsnv->btnv", p_BNTS, v_BSNV)


def _mla_prefill_attention_dpa(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNV, scale, implementation, parallel,
                               mask_BTS=None, chunk_lens=None):
    extra = tuple(chunk_lens) if chunk_lens is not None else (mask_BTS,) if mask_BTS is not None else ()

    def attend(q_nope, q_pe, k, kpe, v, *extra):
        N, K, V = k.shape[2], k.shape[3] + kpe.shape[-1], v.shape[-1]
        q_BTNK = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
        kpe_BSNR = jnp.broadcast_to(kpe[:, :, None, :], (*kpe.shape[:2], N, kpe.shape[-1])).astype(k.dtype)
        k_BSNK = jnp.concatenate([k, kpe_BSNR], axis=-1)
        v_BSNK = jnp.pad(v.astype(k.dtype), ((0, 0), (0, 0), (0, 0), (0, K - V)))
        if chunk_lens is not None:
            o_BTNK = _split_attention(q_BTNK, k_BSNK, v_BSNK, *extra, scale, implementation.removesuffix("_split"))
        elif extra:
            m_BTS = extra[0]
            m_BTS = m_BTS.at[:, :, 0].set(m_BTS[:, :, 0] | ~m_BTS.any(axis=-1))   # padding queries
            o_BTNK = _masked_dot_product_attention(q_BTNK, k_BSNK, v_BSNK, m_BTS, scale, implementation)
        else:
            o_BTNK = _dot_product_attention(q_BTNK, k_BSNK, v_BSNK, scale, implementation)
        return o_BTNK[..., :V].astype(jnp.float32)

    if parallel is not None and parallel.mesh.size > 1:
        # jax's cuDNN attention is a custom call with its own partitioning rule; running it per shard
        # (rows like the batch, heads like the attention weights) states the placement outright, the same
        # way as the decode kernel, so the partitioner never gathers heads or rows around it
        from jax.sharding import PartitionSpec as P
        b, h = parallel.batch or None, parallel.heads or None
        extra_specs = (P(b),) * 2 if chunk_lens is not None else (P(b, None, None),) * len(extra)
        attend = _shard_map(attend, parallel.mesh,
                            in_specs=(P(b, None, h, None), P(b, None, h, None), P(b, None, h, None),
                                      P(b, None, None), P(b, None, h, None)) + extra_specs,
                            out_specs=P(b, None, h, None))
    return attend(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNV, *extra)


def _split_attention(q_BTNK, k_BSNK, v_BSNK, cached_B, new_B, scale, implementation):
    """Attention of a chunk after cached tokens without a mask: keys = S - T cached slots (row b's first
    cached[b] real), then the chunk's T tokens (its first new[b] real, attending causally). Two
    attention calls, each returning its log-sum-exp: queries x cached keys (per-row key lengths) and
    queries x chunk keys (causal, per-row lengths), merged as flash-decoding merges splits. Queries past
    new[b] (padding) get 0. implementation: 'cudnn' (jax's cuDNN entry point with per-row lengths) or
    'xla' (its CPU stand-in, jnp)."""
    T = q_BTNK.shape[1]
    S0 = k_BSNK.shape[1] - T
    parts = _attention_lse_cudnn if implementation == "cudnn" else _attention_lse_xla
    if S0 == 0:                                                 # no cached slots at all: the chunk only
        cached_B = jnp.zeros_like(cached_B)
        pad = ((0, 0), (1, 0), (0, 0), (0, 0))                  # one slot no query sees
        k_BSNK, v_BSNK, S0 = jnp.pad(k_BSNK, pad), jnp.pad(v_BSNK, pad), 1
    has_old = (cached_B > 0)[:, None, None]
    new_len = jnp.maximum(new_B, 1).astype(jnp.int32)          # no kernel meets a zero length
    o_old, lse_old = parts(q_BTNK, k_BSNK[:, :S0], v_BSNK[:, :S0], new_len,
                           jnp.maximum(cached_B, 1).astype(jnp.int32), scale, causal=False)
    o_new, lse_new = parts(q_BTNK, k_BSNK[:, S0:], v_BSNK[:, S0:], new_len, new_len, scale, causal=True)
    lse_old = jnp.where(has_old, lse_old, -jnp.inf)             # [B, T, N]
    m = jnp.maximum(lse_old, lse_new)
    w_old, w_new = jnp.exp(lse_old - m), jnp.exp(lse_new - m)
    o_old = jnp.where(has_old[..., None], o_old.astype(jnp.float32), 0.0)
    o = (o_old * w_old[..., None] + o_new.astype(jnp.float32) * w_new[..., None]) / (w_old + w_new)[..., None]
    real = (jnp.arange(T)[None, :] < new_B[:, None])[:, :, None, None]
    return jnp.where(real, o, 0.0)


def _attention_lse_cudnn(q_BTNK, k_BSNK, v_BSNK, q_len_B, kv_len_B, scale, *, causal):
    """cuDNN flash attention with per-row lengths, (o [B, T, N, K], log-sum-exp [B, T, N] float32), through
    jax's cuDNN entry point: the public jax.nn.dot_product_attention returns the log-sum-exp rounded to
    the inputs' dtype (bf16: merge weights off by up to ~3%)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    try:
        o, lse_BNT = fa.dot_product_attention(q_BTNK, k_BSNK, v_BSNK, q_seqlen=q_len_B, kv_seqlen=kv_len_B,
                                              scale=scale, mask_type=mask_type, return_residual=True)
    except (TypeError, ValueError) as e:   # a JAX whose private signature differs, a shape this cuDNN
        raise NotImplementedError(f"jax's cuDNN entry point: {e}") from e   # refuses: the caller falls back
    return o, jnp.transpose(lse_BNT, (0, 2, 1)).astype(jnp.float32)


def _attention_lse_xla(q_BTNK, k_BSNK, v_BSNK, q_len_B, kv_len_B, scale, *, causal):
    """The same in jnp (float32 scores): the CPU stand-in of _attention_lse_cudnn."""
    del q_len_B                       # rows past it are padding, zeroed by the caller
    s_BNTS = einsum_f32("btnk,bsnk->bnts", q_BTNK, k_BSNK) * scale
    S, T = k_BSNK.shape[1], q_BTNK.shape[1]
    see = jnp.arange(S)[None, None, :] < kv_len_B[:, None, None]                       # [B, 1, S]
    if causal:
        see = see & (jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None])     # [B, T, S]
    s_BNTS = jnp.where(see[:, None], s_BNTS, -jnp.inf)
    lse_BNT = jax.nn.logsumexp(s_BNTS, axis=-1)
    p_BNTS = jnp.exp(s_BNTS - lse_BNT[..., None]).astype(q_BTNK.dtype)
    return einsum_f32("bnts,bsnk->btnk", p_BNTS, v_BSNK).astype(q_BTNK.dtype), jnp.transpose(lse_BNT, (0, 2, 1))
