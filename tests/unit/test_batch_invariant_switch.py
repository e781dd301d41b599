"""The batch-invariance switch: EngineConfig.batch_invariant (VLLM_BATCH_INVARIANT=1 its default),
carried to the engine's ExecPlan; einsum_f32's two-row form, which XLA:CPU sums as any dot of
several rows (a dot of one row sums in another order)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import LLM, ops
from kimi_jax.engine.args import EngineConfig


def test_environment_turns_the_default_on(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert EngineConfig().batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant is True
    assert EngineConfig(batch_invariant=False).batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")


def test_llm_runs_the_invariant_plan(tiny_ckpt):
    llm = LLM(tiny_ckpt, dtype="float32", max_num_seqs=2, block_size=4, max_model_len=64,
              batch_invariant=True)
    assert llm.exec_plan.batch_invariant
    assert not ops.ExecPlan().batch_invariant


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot emitters")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_sums_as_a_row_of_many(dtype):
    """q_lat = q_nope . w_uk (MLA's absorbed query) for one token and for that token among 7
    others: bit-identical with two_rows; without it the one-row dot differs on XLA:CPU."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 1, 4, 64)), dtype)
    w = jnp.asarray(0.1 * rng.standard_normal((4, 96, 64)), dtype)
    eq = "btnh,nah->btna"
    f = jax.jit(ops.einsum_f32, static_argnums=0, static_argnames="two_rows")
    many = np.asarray(f(eq, q, w))[:1]
    assert (np.asarray(f(eq, q[:1], w, two_rows=True)) == many).all()
    assert (np.asarray(f(eq, q[1:], w, two_rows=True)) == np.asarray(f(eq, q, w))[1:]).all()
    assert not (np.asarray(f(eq, q[:1], w)) == many).all()
