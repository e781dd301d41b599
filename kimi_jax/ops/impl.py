from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def einsum_f32(eq: str, a: jax.Array, b: jax.Array, *, two_rows: bool = False) -> jax.Array:
    """jnp.einsum returning float32 (on CPU operands are widened first: XLA:CPU lacks some bf16 ->
    f32 dots). two_rows (ExecPlan.batch_invariant): where `a` has one row (its dims that are not
    in `b`), it runs as two copies, so the dot sums as one of more rows does on XLA:CPU."""
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    if two_rows and math.prod(n for c, n in zip(lhs, a.shape) if c not in rhs) == 1:
        z = next(c for c in "zyxwvu" if c not in eq)
        return einsum_f32(f"{z}{lhs},{rhs}->{z}{out}", jnp.stack([a, a]), b)[0]
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
