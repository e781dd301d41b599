"""Per-layer weights for the unrolled layer loop.

A stacked weight [L, ...] sliced with static indices puts each layer's offset into that layer's
matmul fusion, so XLA sees L different fusions and autotunes each one (compile time grows with
depth). Held as L separate arrays (`LayerList`), every layer's fusion is the same computation and is
autotuned once. The routed experts stay stacked: their kernels index them by layer.
ExecPlan.layer_weights chooses it; BENCHMARKS.md, "Compile time and per-layer weights", has the
measurement. Each layer's kv_b_proj is held as its two absorbed halves (`AbsorbedKvB`), laid out so
the decode step's matrix-vector products reduce over their minor axis (BENCHMARKS.md, "MLA absorbed
weights"), and its q_a_proj and kv_a_proj_with_mqa, two products of the same input, as one weight
(`JointQKvA`: one matrix-vector product a layer instead of two; kv_a_proj_with_mqa then holds an
`InJoint`, no array). `pack_vectors`: a layer's small vectors as one array (each array costs the
host ~1.4 us a call: docs/ARCHITECTURE.md, "Fixed buffers").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
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
class JointGateUp:
    """A SwiGLU MLP's gate_proj and up_proj [I, D] as w_2ID, held by gate_proj (up_proj: InJoint)"""

    w_2ID: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InJoint:
    """A weight inside another's joint one (kv_a_proj_with_mqa, up_proj): no array; taken once."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InPack:
    """A vector held inside its layer's VectorPack: elements [offset, offset + size) in `dtype`."""
    offset: int = dataclasses.field(metadata=dict(static=True))
    size: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))

    def of(self, w_X: jax.Array) -> jax.Array:
        return w_X[self.offset:self.offset + self.size].astype(self.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VectorPack:
    """A layer's small vectors as one float32 w_X, held by the first (its own: `own`); the others:
    InPack."""

    w_X: jax.Array
    own: InPack = dataclasses.field(metadata=dict(static=True))


def _is_packed(x) -> bool:
    return isinstance(x, (VectorPack, InPack))


def unpacked(layer_state):
    """One layer's weights, every VectorPack / InPack replaced by its vector (inside the step)."""
    packs = [
        x for x in jax.tree.leaves(layer_state, is_leaf=_is_packed) if isinstance(x, VectorPack)
    ]
    if not packs:
        return layer_state
    if len(packs) > 1:
        raise ValueError(
            f"layer_weights.unpacked: a layer holds {len(packs)} VectorPacks, expected one"
        )
    w_X = packs[0].w_X
    return jax.tree.map(
        lambda x: x.own.of(w_X)
        if isinstance(x, VectorPack)
        else x.of(w_X)
        if isinstance(x, InPack)
        else x,
        layer_state,
        is_leaf=_is_packed,
    )


def is_layer_list(x) -> bool:
    return isinstance(x, LayerList)


def layer(tree, i: int):
    """Layer i of a stack's weights: a LayerList's i-th array, a stacked array's static slice."""
    return jax.tree.map(lambda a: a[i], tree, is_leaf=is_layer_list)


def stacked(tree):
    """The stack's weights with every LayerList stacked back to [L, ...] (for lax.scan)."""
    return jax.tree.map(
        lambda a: a.stacked() if is_layer_list(a) else a, tree, is_leaf=is_layer_list
    )


def num_layers(tree) -> int:
    first = jax.tree.leaves(tree, is_leaf=is_layer_list)[0]
    return len(first) if is_layer_list(first) else first.shape[0]


@functools.lru_cache(maxsize=None)
def _unstack_fn(n: int, sharding):
    return jax.jit(
        lambda a: tuple(a[i] for i in range(n)), out_shardings=(sharding,) * n if sharding else None
    )


def _layer_sharding(a):
    s = getattr(a, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))
    return s if isinstance(s, jax.sharding.SingleDeviceSharding) else None


@functools.lru_cache(maxsize=None)
def _absorbed_fn(n: int, heads: int, head_dim: int, sharding):
    specs = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        specs = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(tuple(sharding.spec)[0], None, None)
        )
    elif sharding is not None:
        specs = sharding

    def split(a_LKA):
        w_LNKA = a_LKA.reshape(n, heads, -1, a_LKA.shape[-1])
        return tuple(
            AbsorbedKvB(w_LNKA[i, :, :head_dim].swapaxes(1, 2), w_LNKA[i, :, head_dim:])
            for i in range(n)
        )

    return jax.jit(split, out_shardings=None if specs is None else (AbsorbedKvB(specs, specs),) * n)


@functools.lru_cache(maxsize=None)
def _joint_fn(n: int, q_rows: int, sharding):
    def join(q_LQD, kv_LCD):
        return tuple(JointQKvA(jnp.concatenate([q_LQD[i], kv_LCD[i]]), q_rows) for i in range(n))

    return jax.jit(
        join, out_shardings=None if sharding is None else (JointQKvA(sharding, q_rows),) * n
    )


@functools.lru_cache(maxsize=None)
def _gate_up_fn(n: int, sharding):
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
        )

    def join(gate_LID, up_LID):
        return tuple(JointGateUp(jnp.stack([gate_LID[i], up_LID[i]])) for i in range(n))
    return jax.jit(join, out_shardings=None if sharding is None else (JointGateUp(sharding),) * n)


@functools.lru_cache(maxsize=None)
def _pack_fn(n: int, count: int, sharding):
    # count LayerLists' arrays, layer-major: vectors[j * n + i] is vector j of layer i
    def pack(*vectors):
        return tuple(
            jnp.concatenate([vectors[j * n + i].astype(jnp.float32) for j in range(count)])
            for i in range(n)
        )

    return jax.jit(pack, out_shardings=None if sharding is None else (sharding,) * n)


def _replicated(a) -> bool:
    s = getattr(a, "sharding", None)
    return isinstance(s, jax.sharding.SingleDeviceSharding) or (
        isinstance(s, jax.sharding.NamedSharding) and all(p is None for p in s.spec))


def pack_vectors(state, max_size: int = 1 << 16) -> int:
    """Replace, in place, each stack's per-layer replicated float vectors (at most `max_size` long)
    by one VectorPack a layer; returns how many were packed."""
    by_stack = {stack: [] for stack in STACKS}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if (
            str(path[0]) not in by_stack
            or not is_layer_list(value)
            or not all(isinstance(a, jax.Array) for a in value)
        ):
            continue
        a = value[0]
        if (
            a.ndim == 1
            and a.size <= max_size
            and jnp.issubdtype(a.dtype, jnp.floating)
            and _replicated(a)
        ):
            by_stack[str(path[0])].append((path, var, value))
    n_packed = 0
    for found in by_stack.values():
        if len(found) < 2:
            continue
        found.sort(key=lambda f: tuple(str(p) for p in f[0]))
        n = len(found[0][2])
        offsets = np.cumsum([0] + [v[0].size for _, _, v in found])
        entries = [
            InPack(int(offsets[j]), int(v[0].size), str(v[0].dtype))
            for j, (_, _, v) in enumerate(found)
        ]
        packs = _pack_fn(n, len(found), found[0][2][0].sharding)(
            *(a for _, _, v in found for a in v.arrays)
        )
        found[0][1].set_value(LayerList([VectorPack(w, entries[0]) for w in packs]))
        for (_, var, _), entry in zip(found[1:], entries[1:]):
            var.set_value(LayerList([entry] * n))
        n_packed += len(found)
    return n_packed


def split_layers(state, cfg=None, pack: bool = False) -> int:
    """Replace, in place, every stacked non-expert weight of `state` (an nnx.State of a Transformer)
    by a LayerList placed as the stack was (its leading layer axis dropped); with `cfg` (the
    ModelConfig) each layer's kv_b_proj becomes an AbsorbedKvB, its q_a_proj and kv_a_proj_with_mqa
    one JointQKvA and each SwiGLU MLP's gate_proj and up_proj (dense FFN, shared expert) one
    JointGateUp (where both are plain arrays of one dtype, placed alike); with `pack` its vectors
    one VectorPack (`pack_vectors`). Returns how many were split."""
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
            kv_var.set_value(LayerList([InJoint()] * q.shape[0]))
            n += 2
        for names, gate_var in by_path.items():
            if (
                names[0] not in STACKS
                or names[-2:] != ("gate_proj", "weight")
                or "experts" in names
            ):
                continue
            up_var = by_path.get(names[:-2] + ("up_proj", "weight"))
            gate, up = gate_var.get_value(), None if up_var is None else up_var.get_value()
            if not (
                isinstance(gate, jax.Array)
                and isinstance(up, jax.Array)
                and gate.dtype == up.dtype
                and gate.shape == up.shape
                and getattr(gate, "sharding", None) == getattr(up, "sharding", None)
            ):
                continue
            gate_var.set_value(
                LayerList(_gate_up_fn(gate.shape[0], _layer_sharding(gate))(gate, up))
            )
            up_var.set_value(LayerList([InJoint()] * gate.shape[0]))
            n += 2
    for path, var in flat:
        names = [str(p) for p in path]
        value = var.get_value()
        if names[0] not in STACKS or "experts" in names or is_layer_list(value):
            continue
        if cfg is not None and names[-2:] == ["kv_b_proj", "weight"]:
            fn = _absorbed_fn(
                value.shape[0],
                cfg.num_attention_heads,
                cfg.qk_nope_head_dim,
                _layer_sharding(value),
            )
        else:
            fn = _unstack_fn(value.shape[0], _layer_sharding(value))
        var.set_value(LayerList(fn(value)))
        n += 1
    if pack:
        pack_vectors(state)
    return n
