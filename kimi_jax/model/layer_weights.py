"""Per-layer weights for the unrolled layer loop.

A stacked weight [L, ...] sliced with static indices puts each layer's offset into that layer's matmul
fusion, so XLA sees L different fusions and autotunes each one (compile time grows with depth). Held as L
separate arrays (`LayerList`), every layer's fusion is the same computation and is autotuned once. The
routed experts stay stacked: their kernels index them by layer. ExecPlan.layer_weights chooses it;
BENCHMARKS.md, "Compile time and per-layer weights", has the measurement. Each layer's kv_b_proj is held
as its two absorbed halves (`AbsorbedKvB`), laid out so the decode step's matrix-vector products reduce
over their minor axis (BENCHMARKS.md, "MLA absorbed weights"), and its q_a_proj and kv_a_proj_with_mqa,
two products of the same input, as one weight (`JointQKvA`: one matrix-vector product a layer instead of two;
kv_a_proj_with_mqa then holds an `InJoint`, no array).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

STACKS = ("dense_layers", "moe_layers")


@jax.tree_util.register_pytree_node_class
class LayerList:
    """One stacked weight as L arrays; `w[i]` is layer i's."""

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def __getitem__(self, i):
        return self.arrays[i]

    def __len__(self):
        return len(self.arrays)

    def stacked(self):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *self.arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AbsorbedKvB:
    """One layer's kv_b_proj [N * (H + U), A] as W_UK^T [N, A, H] and W_UV [N, U, A]."""
    uk_NAH: jax.Array
    uv_NUA: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class JointQKvA:
    """q_a_proj [Q, D] over kv_a_proj_with_mqa [A + R, D] as w_XD (X = Q + A + R), held by both."""
    w_XD: jax.Array
    q_rows: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InJoint:
    """kv_a_proj_with_mqa's weight inside q_a_proj's JointQKvA: no array, so steps take the joint weight once."""
    q_rows: int = dataclasses.field(metadata=dict(static=True))


def is_layer_list(x) -> bool:
    return isinstance(x, LayerList)


def layer(tree, i: int):
    """Layer i of a stack's weights: LayerLists give their i-th array, stacked arrays a static slice."""
    return jax.tree.map(lambda a: a[i], tree, is_leaf=is_layer_list)


def stacked(tree):
    """The stack's weights with every LayerList stacked back to [L, ...] (for lax.scan)."""
    return jax.tree.map(lambda a: a.stacked() if is_layer_list(a) else a, tree, is_leaf=is_layer_list)


def num_layers(tree) -> int:
    first = jax.tree.leaves(tree, is_leaf=is_layer_list)[0]
    return len(first) if is_layer_list(first) else first.shape[0]


@functools.lru_cache(maxsize=None)
def _unstack_fn(n: int, sharding):
    return jax.jit(lambda a: tuple(a[i] for i in range(n)), out_shardings=(sharding,) * n if sharding else None)


def _layer_sharding(a):
    s = getattr(a, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))
    return s if isinstance(s, jax.sharding.SingleDeviceSharding) else None


@functools.lru_cache(maxsize=None)
def _absorbed_fn(n: int, heads: int, head_dim: int, sharding):
    specs = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        specs = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(tuple(sharding.spec)[0], None, None))
    elif sharding is not None:
        specs = sharding

    def split(a_LKA):
        w_LNKA = a_LKA.reshape(n, heads, -1, a_LKA.shape[-1])
        return tuple(AbsorbedKvB(w_LNKA[i, :, :head_dim].swapaxes(1, 2), w_LNKA[i, :, head_dim:]) for i in range(n))
    return jax.jit(split, out_shardings=None if specs is None else (AbsorbedKvB(specs, specs),) * n)


@functools.lru_cache(maxsize=None)
def _joint_fn(n: int, q_rows: int, sharding):
    def join(q_LQD, kv_LCD):
        return tuple(JointQKvA(jnp.concatenate([q_LQD[i], kv_LCD[i]]), q_rows) for i in range(n))
    return jax.jit(join, out_shardings=None if sharding is None else (JointQKvA(sharding, q_rows),) * n)


def split_layers(state, cfg=None) -> int:
    """Replace, in place, every stacked non-expert weight of `state` (an nnx.State of a Transformer) by a
    LayerList placed as the stack was (its leading layer axis dropped); with `cfg` (the ModelConfig) each
    layer's kv_b_proj becomes an AbsorbedKvB, and its q_a_proj and kv_a_proj_with_mqa one JointQKvA
    (where both are plain arrays of one dtype). Returns how many were split."""
    n = 0
    flat = nnx.to_flat_state(state)
    if cfg is not None:
        by_path = {tuple(str(p) for p in path): var for path, var in flat}
        for names, q_var in by_path.items():
            if names[0] not in STACKS or names[-2:] != ("q_a_proj", "weight"):
                continue
            kv_var = by_path.get(names[:-2] + ("kv_a_proj_with_mqa", "weight"))
            q, kv = q_var.get_value(), None if kv_var is None else kv_var.get_value()
            if not (isinstance(q, jax.Array) and isinstance(kv, jax.Array) and q.dtype == kv.dtype):
                continue
            joint = LayerList(_joint_fn(q.shape[0], q.shape[1], _layer_sharding(q))(q, kv))
            q_var.set_value(joint)
            kv_var.set_value(LayerList([InJoint(q.shape[1])] * q.shape[0]))
            n += 2
    for path, var in flat:
        names = [str(p) for p in path]
        value = var.get_value()
        if names[0] not in STACKS or "experts" in names or is_layer_list(value):
            continue
        if cfg is not None and names[-2:] == ["kv_b_proj", "weight"]:
            fn = _absorbed_fn(value.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, _layer_sharding(value))
        else:
            fn = _unstack_fn(value.shape[0], _layer_sharding(value))
        var.set_value(LayerList(fn(value)))
        n += 1
    return n
