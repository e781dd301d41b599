"""Per-layer weights for the unrolled layer loop.

A stacked weight [L, ...] sliced with static indices puts each layer's offset into that layer's matmul
fusion, so XLA sees L different fusions and autotunes each one (compile time grows with depth). Held as L
separate arrays (`LayerList`), every layer's fusion is the same computation and is autotuned once. The
routed experts stay stacked: their kernels index them by layer. BENCHMARKS.md, "Compile time and the layer
loop", has the measurement.
"""
from __future__ import annotations

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
        return jnp.stack(self.arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


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


def split_layers(state) -> int:
    """Replace, in place, every stacked non-expert weight of `state` (an nnx.State of a Transformer) by a
    LayerList placed as the stack was (its leading layer axis dropped). Returns how many were split."""
    n = 0
    for path, var in nnx.to_flat_state(state):
        names = [str(p) for p in path]
        value = var.get_value()
        if names[0] not in STACKS or "experts" in names or is_layer_list(value):
            continue
        var.set_value(LayerList(_unstack_fn(value.shape[0], _layer_sharding(value))(value)))
        n += 1
    return n
