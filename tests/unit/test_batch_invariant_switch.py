"""The batch-invariance switch: EngineConfig.batch_invariant (VLLM_BATCH_INVARIANT=1 its default),
carried to the engine's ExecPlan; einsum_f32's row tiles, which XLA:CPU sums the same whatever
the number of rows (a dot of one row, or of many, sums in another order)."""
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eq,a_shape,b_shape", [
    ("btnh,nah->btna", (1, 64, 4, 16), (4, 32, 16)),     # MLA's absorbed query (W_UK)
    ("tk,kn->tn", (64, 64), (64, 1024)),                 # a wide projection
    ("ztna,zsa->znts", (1, 64, 4, 32), (1, 64, 32)),     # scores against the step's own keys
])
def test_a_row_gives_the_same_bits_alone_and_among_many(dtype, eq, a_shape, b_shape):
    """With invariant (ExecPlan.batch_invariant) the first token's result is the same bits alone,
    among 7 and among 63 others; without it XLA:CPU's emitters sum it in another order at some of
    those counts (one row; past 32-64 rows), on these shapes."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal(a_shape), dtype)
    b = jnp.asarray(0.1 * rng.standard_normal(b_shape), dtype)
    t_axis = eq.index("t")
    out_t = eq.split("->")[1].index("t")
    f = jax.jit(ops.einsum_f32, static_argnums=0, static_argnames="invariant")

    def first(n, invariant):
        y = f(eq, jax.lax.slice_in_dim(a, 0, n, axis=t_axis), b, invariant=invariant)
        return np.asarray(jax.lax.index_in_dim(y, 0, out_t))
    alone = first(1, True)
    assert all((first(n, True) == alone).all() for n in (8, 64))
    assert not all((first(n, False) == first(1, False)).all() for n in (8, 64))
