from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum returning float32 (on CPU operands are widened first: XLA:CPU lacks some bf16 ->
    f32 dots)."""
    if jax.default_backend() == "cpu":
        a, b = (
            a.astype(jnp.promote_types(a.dtype, jnp.float32)),
            b.astype(jnp.promote_types(b.dtype, jnp.float32)),
        )
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map without replication checks (jax.experimental's on older jax)."""
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except (AttributeError, TypeError):
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
