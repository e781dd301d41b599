"""Helpers the op modules share."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum accumulating in and returning float32 (on CPU the operands are widened first: XLA:CPU
    cannot run some bf16 x bf16 -> f32 dots)."""
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
