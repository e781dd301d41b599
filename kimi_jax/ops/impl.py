from __future__ import annotations

import math

import jax
import jax.numpy as jnp


# ExecPlan.batch_invariant: products over rows (tokens) run this many rows at a time
INVARIANT_ROWS = 16


def einsum_f32(eq: str, a: jax.Array, b: jax.Array, *, invariant=False,
               weight: bool = False) -> jax.Array:
    """jnp.einsum returning float32 (on CPU operands are widened first: XLA:CPU lacks some bf16 ->
    f32 dots). invariant (ExecPlan.batch_invariant; an int: `ExecPlan.row_tile`, the rows of a
    tile; True: INVARIANT_ROWS): `a`'s rows (its dims not in `b`) go through `row_tiles`, so a
    row's result does not depend on how many rows come with it. weight: `b` is a weight, so the
    dims it shares with `a` and the result (MLA's heads) are the model's, not the step's (see
    `_row_tiled_einsum`)."""
    if invariant:
        return _row_tiled_einsum(eq, a, b, weight,
                                 INVARIANT_ROWS if invariant is True else int(invariant))
    if jax.default_backend() == "cpu":
        a, b = (
            a.astype(jnp.promote_types(a.dtype, jnp.float32)),
            b.astype(jnp.promote_types(b.dtype, jnp.float32)),
        )
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def row_tiles(f, x_R, rows: int = INVARIANT_ROWS):
    """f over the rows of x_R [R, ...] (an array, or a pytree of arrays of R rows each)
    `rows` at a time (the last tile padded with zero rows), one tile an iteration of a loop
    -> f's rows [R, ...] (each array of its pytree). Every tile is the same program, so a row's
    bits do not depend on R or on its neighbours: XLA:CPU's dot emitters sum a row in an order that
    follows the row count (one row, past 32-64 rows, a small batch) and the row's place in it."""
    R = jax.tree.leaves(x_R)[0].shape[0]
    t = rows
    tiles = -(-R // t)

    def cut(a):
        a = jnp.pad(a, [(0, tiles * t - R)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(tiles, t, *a.shape[1:])
    y = jax.lax.map(f, jax.tree.map(cut, x_R))
    return jax.tree.map(lambda a: a.reshape(tiles * t, *a.shape[2:])[:R], y)


def _row_tiled_einsum(eq: str, a: jax.Array, b: jax.Array, weight: bool = False,
                      tile: int = INVARIANT_ROWS) -> jax.Array:
    """einsum_f32(eq', a', b') with a's dims that are not in b (its rows) flattened and run by
    `row_tiles`, and the dims both operands and the result share (a batch: MLA's heads, or the
    step's rows) one at a time in a loop around it: every product a 2-d one of fixed rows (XLA:CPU
    lays out and emits a batched dot by its context). Off the CPU, with b a weight (its batch dims
    fixed by the model), a tile keeps them: one batched product of one shape whatever the step (a
    GPU runs one kernel for one shape, and a loop over 64 heads would be 64 launches a product).
    The result laid out as eq says."""
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    batch = [c for c in lhs if c in rhs and c in out]
    if batch and not (weight and jax.default_backend() != "cpu"):
        others = lambda spec: "".join(c for c in spec if c not in batch)  # noqa: E731
        a_N = jnp.transpose(a, [lhs.index(c) for c in batch] + [i for i, c in enumerate(lhs)
                                                                  if c not in batch])
        b_N = jnp.transpose(b, [rhs.index(c) for c in batch] + [i for i, c in enumerate(rhs)
                                                                  if c not in batch])
        n_shape = a_N.shape[:len(batch)]
        sub = f"{others(lhs)},{others(rhs)}->{others(out)}"
        y = jax.lax.map(lambda ab: _row_tiled_einsum(sub, ab[0], ab[1], weight, tile),
                        (a_N.reshape(-1, *a_N.shape[len(batch):]),
                         b_N.reshape(-1, *b_N.shape[len(batch):])))
        y = y.reshape(*n_shape, *y.shape[1:])
        have = batch + [c for c in out if c not in batch]
        return jnp.transpose(y, [have.index(c) for c in out])
    rows = [c for c in lhs if c not in rhs]
    kept = [c for c in lhs if c in rhs]
    z = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in eq)
    a_RX = jnp.transpose(a, [lhs.index(c) for c in rows + kept])
    row_shape = a_RX.shape[:len(rows)]
    a_RX = a_RX.reshape(math.prod(row_shape), *a_RX.shape[len(rows):])
    tile_out = z + "".join(c for c in out if c not in rows)
    y = row_tiles(lambda x: einsum_f32(f"{z}{''.join(kept)},{rhs}->{tile_out}", x, b), a_RX,
                  tile)
    y = y.reshape(*row_shape, *y.shape[1:])
    have = rows + [c for c in out if c not in rows]
    return jnp.transpose(y, [have.index(c) for c in out])


def row_sums(x: jax.Array) -> jax.Array:
    """float32 sum over the last axis [..., 1] in one order whatever the leading shape and the
    program around it (ExecPlan.batch_invariant): the axis zero-padded to a power of two, then
    halved by elementwise adds (first half + second half) to one column. A reduction's order on
    XLA:CPU follows the leading shape and fusion, and so does a dot's against ones, which XLA may
    rewrite as a reduction; elementwise adds have no order to choose."""
    x = x.astype(jnp.float32)
    width = 1 << max(0, (x.shape[-1] - 1).bit_length())
    if width != x.shape[-1]:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


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
