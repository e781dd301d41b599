"""The unrolled layer loop runs each layer as a call of one jitted body per layer kind (transformer._layer_call,
the layer index a traced int32): logits and new latents of a fresh prefill, a chunk after cached tokens and a
decode step on the paged pool, and of the contiguous-cache step, equal those of the static-index loop (each
layer traced with its Python index: the formulation it replaces) bitwise, float32 on CPU, because XLA
inlines the calls before optimizing and the two programs compute the same ops in the same order; and they
match the lax.scan plan over stacked weights (an independent loop) within 1e-5 of the largest logit (XLA's
other summation order under scan, as tests/unit/test_layer_weights.py; checked where it adds a kind of
case, to keep compiles few). Also under TP2 and DP2+EP (slow) meshes: shard_map'd experts and page-split
paged ops inside the call. And the body is traced once per layer kind."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import preset
from kimi_jax.engine.steps import ModelSteps
from kimi_jax.entrypoints.weights import random_model
from kimi_jax.model import transformer
from kimi_jax.model.transformer import DecoderLayer, init_cache
from kimi_jax.parallel.sharding import Layout

TINY = preset("tiny")                                                   # 1 dense + 2 MoE layers
DEEP = TINY.replace(num_hidden_layers=5, first_k_dense_replace=2)      # 2 dense + 3 MoE layers
UNROLL = ops.ExecPlan(layer_loop="unroll", layer_weights="per_layer")
SCAN = ops.ExecPlan(layer_loop="scan")
PAGE, PAGES = 4, 4                      # tokens per page, pages per row
B = 2


def static_index_loop(monkeypatch):
    """Make the unrolled loop trace every layer inline with its Python index (the replaced formulation)."""
    def inline(graphdef, experts, layer_state, x, positions, kv, table, layer, **kw):
        return transformer._layer_body(graphdef, experts, layer_state, x, positions, kv, table, int(layer), **kw)
    monkeypatch.setattr(transformer, "_layer_call", inline)


def paged_steps(engine: ModelSteps):
    """{name: (logits, pool)} of a fresh prefill, a chunk after its cached tokens and a decode step; row b's
    pages are ids b * PAGES ... local to its data-parallel rank (row 1 shorter: padding after its tokens)."""
    step = jax.jit(lambda state, pages, tok, pos, table, absorbed, fresh: _step(engine, state, pages, tok, pos, table,
                                                                                absorbed, fresh),
                   static_argnames=("absorbed", "fresh"))
    local = B // engine.dp
    table = jnp.asarray((np.arange(B)[:, None] % local) * PAGES + np.arange(PAGES)[None], jnp.int32)
    pages = engine.init_pages(B * PAGES, PAGE)
    rng = np.random.default_rng(0)
    tok = lambda T: jnp.asarray(rng.integers(2, TINY.vocab_size, (B, T)), jnp.int32)  # noqa: E731
    out = {}
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]], np.int32)
    logits, pages = step(engine.state, pages, tok(6), jnp.asarray(pos), table, absorbed=False, fresh=True)
    out["fresh"] = (logits, pages)
    pos = np.array([[6, 7, 8], [4, 5, -1]], np.int32)
    logits, pages = step(engine.state, pages, tok(3), jnp.asarray(pos), table, absorbed=False, fresh=False)
    out["chunk"] = (logits, pages)
    logits, pages = step(engine.state, pages, tok(1), jnp.asarray([[9], [6]], jnp.int32), table, absorbed=True,
                         fresh=False)
    out["decode"] = (logits, pages)
    return {k: (np.asarray(lg), {n: np.asarray(p) for n, p in pg.items()}) for k, (lg, pg) in out.items()}


def _step(engine, state, pages, tokens, positions, table, absorbed, fresh):
    model = nnx.merge(engine.graphdef, state)
    h, pages = model.hidden_states(tokens, positions, pages, absorbed=absorbed, block_table_BP=table, fresh=fresh,
                                   plan=engine.exec_plan)
    return model.logits(h, engine.exec_plan), pages


def contiguous_decode(engine: ModelSteps):
    """(logits, cache) of one absorbed token per row over a contiguous cache (the profiler's reference step)."""
    def f(state, cache, tok, pos):
        return nnx.merge(engine.graphdef, state)(tok, pos, cache, absorbed=True, plan=engine.exec_plan)
    cache = init_cache(engine.cfg, B, 8, jnp.float32)
    tok, pos = jnp.asarray([[5], [7]], jnp.int32), jnp.asarray([[3], [1]], jnp.int32)
    logits, cache = jax.jit(f)(engine.state, cache, tok, pos)
    return np.asarray(logits), {k: np.asarray(v) for k, v in cache.items()}


def engine_for(cfg, layout, plan):
    return ModelSteps(random_model(cfg, layout, jnp.float32, 3), cfg, layout, plan=plan)


def assert_runs_equal(got, ref, rtol=0.0):
    for name in ref:
        (lg, pg), (ref_lg, ref_pg) = got[name], ref[name]
        if rtol == 0.0:
            np.testing.assert_array_equal(lg, ref_lg, err_msg=name)
        else:
            assert np.abs(lg - ref_lg).max() <= rtol * np.abs(ref_lg).max(), name
        for kind in ref_pg:
            np.testing.assert_allclose(pg[kind], ref_pg[kind], rtol=rtol, atol=rtol, err_msg=f"{name} {kind}")


@pytest.mark.parametrize("cfg,scan", [(TINY, True), (DEEP, False)], ids=["tiny", "2dense-3moe"])
def test_layer_calls_equal_the_static_index_loop_and_scan(cfg, scan, monkeypatch):
    engine = engine_for(cfg, Layout(1), UNROLL)
    got = paged_steps(engine)
    got_contig = contiguous_decode(engine)
    if scan:
        assert_runs_equal(got, paged_steps(engine_for(cfg, Layout(1), SCAN)), rtol=1e-5)
    assert np.isfinite(got["decode"][0]).all() and np.abs(got["decode"][0]).max() > 0
    static_index_loop(monkeypatch)
    assert_runs_equal(got, paged_steps(engine))
    ref_lg, ref_cache = contiguous_decode(engine)
    np.testing.assert_array_equal(got_contig[0], ref_lg)
    for kind in ref_cache:
        np.testing.assert_array_equal(got_contig[1][kind], ref_cache[kind])


@pytest.mark.parametrize("layout,scan", [(Layout(2), False),
                                         pytest.param(Layout(1, 2, True), True, marks=pytest.mark.slow)],
                         ids=["tp2", "dp2-ep"])
def test_layer_calls_under_a_mesh(layout, scan, monkeypatch):
    engine = engine_for(TINY, layout, UNROLL)
    got = paged_steps(engine)
    if scan:
        assert_runs_equal(got, paged_steps(engine_for(TINY, layout, SCAN)), rtol=1e-5)
    static_index_loop(monkeypatch)
    assert_runs_equal(got, paged_steps(engine))


def test_layer_body_is_traced_once_per_kind(monkeypatch):
    """5 layers of two kinds: 2 layer traces and 2 layer functions in the module, 5 calls of them."""
    engine = engine_for(DEEP, Layout(1), UNROLL)
    calls = []
    original = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    jax.clear_caches()
    tok = jnp.zeros((B, 1), jnp.int32)
    text = jax.jit(lambda s, t: nnx.merge(engine.graphdef, s)(t, t, None, absorbed=True, plan=UNROLL)[0]).lower(
        engine.state, tok).as_text()
    assert len(calls) == 2
    assert len(set(re.findall(r"func\.func private @(_layer_body\w*)", text))) == 2
    assert len(re.findall(r"call @_layer_body", text)) == DEEP.num_hidden_layers
