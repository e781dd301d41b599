"""The router and residual add + RMSNorm: XLA or Pallas (ExecPlan.router_kernel / norm_kernel)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kimi_jax.ops import impl
from kimi_jax.ops.impl import shard_map
from kimi_jax.ops.plan import ExecPlan, default_plan


def _per_batch_shard(f, parallel, rows: tuple, replicated: tuple, n_out: int):
    """f(*rows, *replicated) on each shard of the rows' leading axis (parallel.batch), on a mesh."""
    if parallel is None or parallel.mesh.size == 1:
        return f(*rows, *replicated)
    from jax.sharding import PartitionSpec as P
    row = P(parallel.batch or None, None)
    return shard_map(f, parallel.mesh, in_specs=(row,) * len(rows) + (P(),) * len(replicated),
                     out_specs=row if n_out == 1 else (row,) * n_out)(*rows, *replicated)


def route(
    x_TD,
    w_ED,
    bias_E,
    *,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
    plan: Optional[ExecPlan] = None,
    parallel=None,
):
    """-> (expert ids [T, K] int32, weights [T, K] float32); kernels only without a group limit."""
    from pallas_kernels.router import sigmoid_topk as st
    plan = default_plan(plan)
    kernel = plan.router_kernel_for(x_TD.shape[0], w_ED.shape[0])
    if kernel == "xla" or topk_group < n_group or plan.batch_invariant:
        ref = lambda x: st.sigmoid_topk_reference(  # noqa: E731
            x,
            w_ED,
            bias_E,
            k=k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            scaling=scaling,
        )
        # batch_invariant: the scores' product a few rows at a time (impl.row_tiles)
        ids, wts = impl.row_tiles(ref, x_TD, plan.row_tile) if plan.batch_invariant else ref(x_TD)
    else:
        config = st.RouterConfig(gemv="kernel" if kernel == "pallas_gemv" else "xla")
        f = lambda x, w, b: st.sigmoid_topk(
            x,
            w,
            b,
            k=k,
            norm_topk_prob=norm_topk_prob,  # noqa: E731
            scaling=scaling,
            config=config,
        )
        ids, wts = _per_batch_shard(f, parallel, (x_TD,), (w_ED, bias_E), 2)
    return (comb_ids(wts, w_ED.shape[0]), wts) if plan.routing == "uniform" else (ids, wts)


def comb_ids(wts_TK, experts: int):
    """Token t's experts h_t + j * (E // K) mod E, j < K (ExecPlan.routing 'uniform'), h_t a hash of
    the bits of its router weights: each expert equally likely, a token's K distinct, tokens
    independent of each other."""
    K = wts_TK.shape[-1]
    mix = lambda v, c: (v ^ (v >> 16)) * jnp.uint32(c)  # noqa: E731  (murmur3's finalizer steps)
    m = mix(
        jax.lax.bitcast_convert_type(wts_TK.astype(jnp.float32), jnp.uint32)
        * jnp.uint32(0x9E3779B1),
        0x85EBCA6B,
    )
    h = mix(jnp.sum(m ^ (m >> 13), -1, dtype=jnp.uint32), 0xC2B2AE35)
    h = h ^ (h >> 16)
    return (
        (h % experts).astype(jnp.int32)[:, None] + jnp.arange(K, dtype=jnp.int32) * (experts // K)
    ) % experts


def add_rms_norm(x, residual, w_D, eps: float, *, plan: Optional[ExecPlan] = None, parallel=None):
    """(x + residual, its RMSNorm), or the norm of x alone (residual None); x [..., D]."""
    from pallas_kernels.norm import rms_norm
    if default_plan(plan).batch_invariant:
        h = x if residual is None else x + residual
        h32 = h.astype(jnp.float32)
        ms = impl.row_sums(h32 * h32) / h.shape[-1]
        y = w_D * (h32 * jax.lax.rsqrt(ms + eps)).astype(h.dtype)
        return y if residual is None else (h, y)
    if default_plan(plan).norm_kernel == "xla":
        return rms_norm.add_rms_norm_reference(x, residual, w_D, eps)
    D = x.shape[-1]
    def f(*args):
        *rows, w = args
        return rms_norm.add_rms_norm(rows[0], rows[1] if len(rows) > 1 else None, w, eps)

    rows = (x.reshape(-1, D),) + (() if residual is None else (residual.reshape(-1, D),))
    out = _per_batch_shard(f, parallel, rows, (w_D,), 1 if residual is None else 2)
    return jax.tree.map(lambda o: o.reshape(x.shape), out)
