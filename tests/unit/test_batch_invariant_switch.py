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


def test_a_weights_heads_stay_in_the_tile_off_the_cpu(monkeypatch):
    """einsum_f32(invariant, weight) of MLA's absorbed query: on the CPU a loop over the heads
    around the row tiles (each product 2-d); on another backend the tile keeps the weight's heads
    (one batched product of one shape: no loop of 64 launches a product), the same values; the
    step's own batch dim (not a weight's) is looped over on every backend."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((2, 20, 4, 16)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal((4, 8, 16)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)

    def loops(eq, x, y, **kw):      # a new function each time: make_jaxpr keeps its traces
        return str(jax.make_jaxpr(lambda x, y: ops.einsum_f32(eq, x, y, invariant=True, **kw))(
            x, y)).count("scan[")
    absorb = "btnh,nah->btna"
    # float32 sums of 16 products: the tiled and the whole product differ in order only (~1e-7)
    want = jnp.einsum(absorb, a, w)
    assert loops(absorb, a, w, weight=True) == 2
    np.testing.assert_allclose(ops.einsum_f32(absorb, a, w, invariant=True, weight=True), want,
                               rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert loops(absorb, a, w, weight=True) == 1 and loops("btna,bsa->bnts", want, keys) == 2
    np.testing.assert_allclose(ops.einsum_f32(absorb, a, w, invariant=True, weight=True), want,
                               rtol=1e-6, atol=1e-6)
