"""The unrolled layer loop's per-layer weights (kimi_jax.model.layer_weights): an ModelSteps whose plan has
layer_weights='per_layer' holds every stacked non-expert weight as L arrays placed like the stack (its layer axis
dropped; kv_b_proj as its two absorbed halves, q_a_proj and kv_a_proj_with_mqa as one joint weight, each MLP's
gate_proj and up_proj as one), the routed experts stay stacked, and its logits equal those of the stacked weights under
lax.scan (float32 tiny model on the CPU: the two loops differ only in XLA's summation order, so 1e-5
relative is far above their difference and far below a wrong layer's weights)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import preset
from kimi_jax.engine.steps import ModelSteps
from kimi_jax.entrypoints.weights import random_model
from kimi_jax.model import layer_weights
from kimi_jax.parallel.sharding import Layout

CFG = preset("tiny")


@pytest.mark.parametrize("tp", [1, 2])
def test_unrolled_engine_holds_per_layer_weights_with_equal_logits(tp):
    layout = Layout(tp)
    scan = ModelSteps(random_model(CFG, layout, jnp.float32, 3), CFG, layout, plan=ops.ExecPlan(layer_loop="scan"))
    unrolled = ModelSteps(random_model(CFG, layout, jnp.float32, 3), CFG, layout,
                      plan=ops.ExecPlan(layer_loop="unroll", layer_weights="per_layer"))
    stacked_leaves = dict(nnx.to_flat_state(scan.state))
    n_split = n_joint = 0
    for path, var in nnx.to_flat_state(unrolled.state):
        value, ref = var.get_value(), stacked_leaves[path].get_value()
        if layer_weights.is_layer_list(value):
            n_split += 1
            assert path[0] in layer_weights.STACKS and "experts" not in [str(p) for p in path]
            assert len(value) == ref.shape[0]
            if [str(p) for p in path][-2:] == ["kv_b_proj", "weight"]:
                N, H = CFG.num_attention_heads, CFG.qk_nope_head_dim
                for i, kvb in enumerate(value.arrays):
                    w = np.asarray(ref[i]).reshape(N, -1, ref.shape[-1])
                    np.testing.assert_array_equal(np.asarray(kvb.uk_NAH), w[:, :H].swapaxes(1, 2))
                    np.testing.assert_array_equal(np.asarray(kvb.uv_NUA), w[:, H:])
                    if tp > 1:
                        assert tuple(kvb.uk_NAH.sharding.spec)[0] == tuple(ref.sharding.spec)[1]
                continue
            if [str(p) for p in path][-2] == "up_proj":        # in gate_proj's joint weight
                assert value.arrays == (layer_weights.InJoint(),) * ref.shape[0]
                n_joint += 1
                continue
            if [str(p) for p in path][-2] == "gate_proj":
                up_ref = stacked_leaves[path[:-2] + ("up_proj", "weight")].get_value()
                for i, joint in enumerate(value.arrays):
                    np.testing.assert_array_equal(np.asarray(joint.w_2ID),
                                                  np.stack([np.asarray(ref[i]), np.asarray(up_ref[i])]))
                    if tp > 1:
                        assert tuple(joint.w_2ID.sharding.spec) == (None,) + tuple(ref.sharding.spec)[1:]
                n_joint += 1
                continue
            if [str(p) for p in path][-2] == "kv_a_proj_with_mqa":     # its rows are in q_a_proj's joint weight
                assert value.arrays == (layer_weights.InJoint(),) * ref.shape[0]
                assert jax.tree.leaves(value) == []
                n_joint += 1
                continue
            if [str(p) for p in path][-2] == "q_a_proj":
                q_ref = stacked_leaves[path[:-2] + ("q_a_proj", "weight")].get_value()
                kv_ref = stacked_leaves[path[:-2] + ("kv_a_proj_with_mqa", "weight")].get_value()
                for i, joint in enumerate(value.arrays):
                    assert joint.q_rows == CFG.q_lora_rank
                    np.testing.assert_array_equal(np.asarray(joint.w_XD),
                                                  np.concatenate([np.asarray(q_ref[i]), np.asarray(kv_ref[i])]))
                    if tp > 1:
                        assert tuple(joint.w_XD.sharding.spec) == tuple(q_ref.sharding.spec)[1:]
                n_joint += 1
                continue
            for i, a in enumerate(value.arrays):
                assert a.shape == ref.shape[1:] and a.dtype == ref.dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(ref[i]))
                if tp > 1:
                    assert tuple(a.sharding.spec) == tuple(ref.sharding.spec)[1:]
        else:
            assert path[0] not in layer_weights.STACKS or "experts" in [str(p) for p in path]
    assert n_split >= 10                 # attention, norms, router and shared expert of both stacks
    assert n_joint == 8                  # q_a / kv_a_proj_with_mqa and the MLPs' gate / up of both stacks
    # the step's arguments: a stacked weight's leaves once per layer, kv_b_proj's two halves, each joint
    # weight once (kv_a_proj_with_mqa and up_proj none of their own), the routed experts stacked
    stacks = [len(jax.tree.leaves(scan.state[k])) for k in layer_weights.STACKS]
    L = [CFG.first_k_dense_replace, CFG.num_hidden_layers - CFG.first_k_dense_replace]
    experts = len(jax.tree.leaves(scan.state["moe_layers"]["mlp"]["experts"]))
    want = L[0] * (stacks[0] - 1) + L[1] * (stacks[1] - experts - 1) + experts
    assert sum(len(jax.tree.leaves(unrolled.state[k])) for k in layer_weights.STACKS) == want
    ids = list(range(2, 13))
    np.testing.assert_allclose(unrolled.logits(ids), scan.logits(ids), rtol=1e-5, atol=1e-5)


def test_layer_helpers_match_static_slices():
    tree = {"a": jnp.arange(24.0).reshape(3, 8), "b": layer_weights.LayerList([jnp.ones(2) * i for i in range(3)])}
    assert layer_weights.num_layers({"b": tree["b"]}) == 3 and layer_weights.num_layers({"a": tree["a"]}) == 3
    one = layer_weights.layer(tree, 1)
    np.testing.assert_array_equal(one["a"], np.arange(8.0, 16.0))
    np.testing.assert_array_equal(one["b"], np.ones(2))
    back = layer_weights.stacked(tree)
    assert back["b"].shape == (3, 2) and float(back["b"][2, 0]) == 2.0
    leaves = jax.tree.leaves(tree)           # a LayerList flattens to its arrays (the jitted step's arguments)
    assert len(leaves) == 4


def test_plan_rule_for_per_layer_weights():
    assert ops.ExecPlan.for_backend("gpu", hopper=True).layer_weights == "per_layer"
    assert ops.ExecPlan.for_backend("gpu", hopper=True).pack_vectors
    assert not ops.ExecPlan.for_backend("gpu", hopper=True, layer_loop="scan").pack_vectors
    assert ops.ExecPlan.for_backend("gpu", hopper=True, layer_loop="scan").layer_weights == "stacked"
    assert ops.ExecPlan.for_backend("cpu").layer_weights == "stacked"
    with pytest.raises(ValueError, match="layer_weights='per_layer' needs layer_loop='unroll'"):
        ops.ExecPlan(layer_weights="per_layer")


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_vectors_give_equal_logits_with_fewer_arguments(tp):
    """pack_vectors: each layer's four norm scales and router bias travel as one float32 array and are cut
    back into their dtypes inside the step, so the logits are bit-for-bit those of the unpacked engine (the
    same XLA computation over the same values; a wrong offset would swap a norm's scale for another's)."""
    layout = Layout(tp)
    plans = [ops.ExecPlan(layer_loop="unroll", layer_weights="per_layer", pack_vectors=p) for p in (False, True)]
    plain, packed = (ModelSteps(random_model(CFG, layout, jnp.bfloat16, 5), CFG, layout, plan=p) for p in plans)
    L = [CFG.first_k_dense_replace, CFG.num_hidden_layers - CFG.first_k_dense_replace]
    vectors = [4, 5]               # input / post-attention / q_a / kv_a norms; the MoE layers' router bias too
    count = lambda e: sum(len(jax.tree.leaves(e.state[k])) for k in layer_weights.STACKS)   # noqa: E731
    assert count(plain) - count(packed) == sum(n * (v - 1) for n, v in zip(L, vectors))
    for path, var in nnx.to_flat_state(packed.state):
        value = var.get_value()
        if layer_weights.is_layer_list(value) and isinstance(value[0], layer_weights.VectorPack):
            pack = value[0]
            assert pack.w_X.dtype == jnp.float32 and pack.own.offset == 0
            if tp > 1:
                assert all(p is None for p in pack.w_X.sharding.spec)
    ref = dict(nnx.to_flat_state(plain.state))
    for path, var in nnx.to_flat_state(packed.state):
        if str(path[0]) not in layer_weights.STACKS:
            continue
        for i in range(L[layer_weights.STACKS.index(str(path[0]))]):
            layer = layer_weights.unpacked(layer_weights.layer(packed.state[str(path[0])], i))
            got = dict(nnx.to_flat_state(layer))[path[1:]].get_value()
            want = ref[path].get_value()[i]
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert g.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    ids = list(range(2, 13))
    np.testing.assert_array_equal(packed.logits(ids), plain.logits(ids))


def test_pack_vectors_needs_per_layer_weights():
    with pytest.raises(ValueError, match="pack_vectors needs layer_weights='per_layer'"):
        ops.ExecPlan(pack_vectors=True)


def test_steps_take_the_state_as_one_flat_node():
    """ModelSteps.weights (what the jitted steps take) holds the state's arrays themselves under one tree node,
    so a call flattens no nnx Variable, and the model it merges back is the state's."""
    from kimi_jax.engine.steps import FlatWeights, _merge
    plan = ops.ExecPlan(layer_loop="unroll", layer_weights="per_layer", pack_vectors=True)
    engine = ModelSteps(random_model(CFG, Layout(1), jnp.float32, 2), CFG, Layout(1), plan=plan)
    leaves = jax.tree.leaves(engine.state)
    assert isinstance(engine.weights, FlatWeights)
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.weights), leaves)) and len(engine.weights.leaves) == len(leaves)
    assert jax.tree.structure(engine.weights).num_nodes == len(leaves) + 1
    merged = nnx.state(_merge(engine.graphdef, engine.weights))
    assert jax.tree.structure(merged) == jax.tree.structure(engine.state)
