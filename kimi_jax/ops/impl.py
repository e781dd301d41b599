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


def row_sums(x: jax.Array) -> jax.Array:
    """sum over the last axis [..., 1] as the rows of a float32 dot of >= 2 rows (a reduction's
    order on XLA:CPU follows the number of rows; a dot's row does not: ExecPlan.batch_invariant)."""
    x_RS = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    rows = x_RS.shape[0]
    if rows == 1:
        x_RS = jnp.concatenate([x_RS, x_RS])
    ones = jnp.ones((x.shape[-1], 2), jnp.float32)
    total = jnp.dot(x_RS, ones, precision=jax.lax.Precision.HIGHEST)[:rows, 0]
    return total.reshape(*x.shape[:-1], 1)


def softmax(s: jax.Array, *, invariant: bool = False) -> jax.Array:
    """jax.nn.softmax over the last axis; invariant: its sums by `row_sums`."""
    if not invariant:
        return jax.nn.softmax(s, axis=-1)
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(axis=-1, keepdims=True)))
    return e / row_sums(e)


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map without replication checks (jax.experimental's on older jax)."""
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except (AttributeError, TypeError):
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
