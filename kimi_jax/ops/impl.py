"""Helpers the op modules share (`kimi_jax.ops`, `kimi_jax.ops.prefill_attention`). Which implementation
an op runs is the caller's `ExecPlan` (kimi_jax.ops.plan), passed in.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum accumulating and returning float32. XLA:CPU cannot run some bf16 x bf16 -> f32 dots
    (batch dimensions that are not leading: "UNIMPLEMENTED ... DotThunk"), so on CPU the operands are
    widened to f32 first (exact; the products and sums are f32 either way)."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.promote_types(a.dtype, jnp.float32)), b.astype(jnp.promote_types(b.dtype, jnp.float32))
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map without its replication checks (the ops' bodies use collectives and custom calls);
    jax.experimental's on older jax."""
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except (AttributeError, TypeError):  # older jax
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
