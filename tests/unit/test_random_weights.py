"""Random weights made parameter by parameter (kimi_jax.entrypoints.weights.random_model) against the
whole-model jitted init under several layouts: the same tree, shapes, dtypes and shardings, and a model
that runs (finite logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.config import QuantConfig, preset
from kimi_jax.engine.steps import ModelSteps
from kimi_jax.entrypoints.weights import random_model
from kimi_jax.model.transformer import Transformer, abstract_model
from kimi_jax.parallel.sharding import Layout, param_shardings

CFG = preset("tiny").replace(num_hidden_layers=2)


def whole_model_init(cfg, layout, dtype, seed=0):
    """The model's own constructor under one jit, each output placed by its sharding."""
    parallel = layout.moe_parallel()
    graphdef, state = nnx.split(abstract_model(cfg, dtype, parallel, seed))
    shardings = param_shardings(layout, state)
    paths = [tuple(str(k) for k in p) for p, _ in nnx.to_flat_state(state)]
    make = lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), parallel=parallel)      # noqa: E731
    init = jax.jit(lambda: [v.get_value() for _, v in nnx.to_flat_state(nnx.split(make())[1])],
                   out_shardings=[shardings[p] for p in paths])
    return dict(zip(paths, init()))


def leaves(model):
    return {tuple(str(k) for k in p): v.get_value() for p, v in nnx.to_flat_state(nnx.split(model)[1])}


@pytest.mark.parametrize("layout,int4", [(Layout(1), True), (Layout(2), False),
                                         (Layout(2, 2, enable_expert_parallel=True), False)])
def test_leafwise_weights_match_the_whole_model_init(layout, int4):
    cfg = CFG.replace(quantization=QuantConfig()) if int4 else CFG
    model = random_model(cfg, layout, jnp.float32, seed=1)
    ours, ref = leaves(model), whole_model_init(cfg, layout, jnp.float32, seed=1)
    describe = lambda d: {p: (x.shape, x.dtype, x.sharding) for p, x in d.items()}      # noqa: E731
    assert describe(ours) == describe(ref)
    logits = ModelSteps(model, cfg, layout).logits([3, 1, 4, 1, 5])
    assert logits.shape == (5, cfg.vocab_size) and np.isfinite(logits).all()
