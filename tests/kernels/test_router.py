"""The one-launch sigmoid top-k router (pallas_kernels/router/sigmoid_topk.py) against the XLA router it
replaces (`sigmoid_topk_reference`, which the model's 'xla' path runs), both forms ('xla' gemv, gemv
in the kernel), interpret mode on CPU, seeded inputs; and kimi_jax.ops.route's choice of path.

Tolerances: the ids must be equal. With gemv='xla' the logits are XLA's own, so the scores are
bit-identical and the weights differ only in the order the K chosen scores are summed for the
normalization: 2 float32 ulps of weights <= scaling (5e-7 relative). With the gemv in the kernel the
logits are summed in another order (blocks of D columns): |d logit| <= ~D * 2^-24 * sum|x w| ~ 1e-6
here, sigmoid' <= 1/4, so 2e-6 relative on the weights.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops
from pallas_kernels.router import sigmoid_topk as st

RTOL = {"xla": 5e-7, "kernel": 2e-6}


def _inputs(seed, T, E, D, *, x_dtype=jnp.bfloat16):
    kx, kw, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (T, D), jnp.float32).astype(x_dtype)
    w = 0.1 * jax.random.normal(kw, (E, D), jnp.float32)
    b = 0.05 * jax.random.normal(kb, (E,), jnp.float32)
    return x, w, b


def _check(x, w, b, k, gemv, *, norm=True, scaling=2.827, **cfg):
    ids, wts = st.sigmoid_topk(x, w, b, k=k, norm_topk_prob=norm, scaling=scaling,
                               config=st.RouterConfig(gemv=gemv, **cfg), interpret=True)
    rids, rwts = st.sigmoid_topk_reference(x, w, b, k=k, norm_topk_prob=norm, scaling=scaling)
    assert ids.shape == wts.shape == (x.shape[0], k) and ids.dtype == jnp.int32 and wts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(wts), np.asarray(rwts), rtol=0, atol=RTOL[gemv] * scaling)
    return ids


@pytest.mark.parametrize("gemv", st.GEMVS)
@pytest.mark.parametrize("T,E,D,k,norm", [(1, 16, 64, 8, True), (5, 24, 128, 3, True), (37, 48, 64, 8, False),
                                          (3, 384, 64, 8, True)])
def test_router_matches_the_xla_router(gemv, T, E, D, k, norm):
    """T = 5 and 37 are not multiples of the token block (8 / 16 for 'xla'); E = 24, 48 and 384 are
    padded to 32, 64 and 512 in the program; K = 3 is padded to 4; unnormalized weights too."""
    _check(*_inputs(T * 7 + E, T, E, D), k, gemv, norm=norm, scaling=2.827 if norm else 1.0)


@pytest.mark.parametrize("gemv", st.GEMVS)
def test_ties_go_to_the_lowest_index_as_top_k(gemv):
    """Experts 3, 6, 9, 12 and 15 share one weight row and bias (equal choices in any summation order),
    biased above the rest: K = 3 takes 3, 6, 9 in that order. A zero token row scores every expert
    0.5; with zero bias all tie and it takes 0..K-1. A row of the block past T is masked."""
    T, E, D, k = 3, 16, 64, 3
    x, w, b = _inputs(5, T, E, D)
    tied = jnp.asarray([3, 6, 9, 12, 15])
    w = w.at[tied].set(w[0])
    b = b.at[tied].set(1.0)
    ids = _check(x, w, b, k, gemv)
    assert (np.asarray(ids) == [3, 6, 9]).all()
    ids = _check(x.at[1].set(0), w, jnp.zeros_like(b), k, gemv)
    np.testing.assert_array_equal(np.asarray(ids[1]), [0, 1, 2])


def test_float32_activations_and_explicit_blocks():
    """x float32 (the model in float32) and the gemv form's blocks given: 2 tokens per program, D in 16s."""
    x, w, b = _inputs(3, 7, 24, 96, x_dtype=jnp.float32)
    _check(x, w, b, 4, "kernel", block_t=2, block_d=16)
    _check(x, w, b, 4, "xla", block_t=4)


def test_ops_route_takes_the_kernel_only_without_a_group_limit():
    """ops.route: the plan's router_kernel picks the path; a group limit (topk_group < n_group) keeps
    the XLA router; topk_group == n_group keeps every group, so the kernel's answer is the grouped one."""
    x, w, b = _inputs(9, 6, 32, 64)
    kw = dict(k=4, norm_topk_prob=True, scaling=2.5)
    for kernel in ops.ROUTER_KERNELS:
        plan = ops.ExecPlan(router_kernel=kernel)
        ids, wts = ops.route(x, w, b, n_group=4, topk_group=4, plan=plan, **kw)
        rids, rwts = st.sigmoid_topk_reference(x, w, b, n_group=4, topk_group=4, **kw)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
        np.testing.assert_allclose(np.asarray(wts), np.asarray(rwts), atol=2e-6 * 2.5, rtol=0)
        limited = ops.route(x, w, b, n_group=4, topk_group=2, plan=plan, **kw)
        ref = st.sigmoid_topk_reference(x, w, b, n_group=4, topk_group=2, **kw)
        assert all((np.asarray(a) == np.asarray(r)).all() for a, r in zip(limited, ref))   # the XLA path itself


def test_uniform_routing_spreads_correlated_tokens_as_uniform_top_k_would():
    """ExecPlan.routing='uniform' (benchmarks of random weights): the router's weights are kept, each token's
    K experts are a comb h + j * E / K (distinct, in range), and tokens whose hidden states are nearly equal
    (what deep random-weight layers give) still touch as many experts as independent uniform choices of
    offsets would: over 8 tokens, E = 384, K = 8, 8 x 48 x (1 - (47/48)^8) = 59.4 on average, where the
    model's router touches far fewer. 64 seeded groups: the mean's standard deviation is below 1, so 3
    is a wide margin; the model's count is asserted only to be well below."""
    T, E, D, K = 512, 384, 64, 8
    key = jax.random.PRNGKey(5)
    common = jax.random.normal(key, (1, D))
    x = common + 1e-2 * jax.random.normal(jax.random.fold_in(key, 1), (T, D))
    w = 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (E, D))
    b = jnp.zeros((E,), jnp.float32)
    kw = dict(k=K, norm_topk_prob=True, scaling=2.5)
    ids, wts = ops.route(x, w, b, plan=ops.ExecPlan(routing="uniform"), **kw)
    mids, mwts = ops.route(x, w, b, plan=ops.ExecPlan(), **kw)
    np.testing.assert_array_equal(np.asarray(wts), np.asarray(mwts))
    ids, mids = np.asarray(ids), np.asarray(mids)
    assert ids.shape == (T, K) and ids.dtype == np.int32 and ((ids >= 0) & (ids < E)).all()
    assert all(len(set(r)) == K for r in ids)
    np.testing.assert_array_equal((ids - ids[:, :1]) % E, np.arange(K) * (E // K) % E * np.ones((T, 1), int))
    distinct = lambda a: np.mean([len(np.unique(g)) for g in a.reshape(-1, 8, K)])   # noqa: E731
    expected = 8 * 48 * (1 - (47 / 48) ** 8)
    assert abs(distinct(ids) - expected) < 3, distinct(ids)
    assert distinct(mids) < expected / 2, distinct(mids)
    with pytest.raises(ValueError, match="routing"):
        ops.ExecPlan(routing="random")


def test_bad_router_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="RouterConfig.gemv"):
        st.RouterConfig(gemv="cuda")
    with pytest.raises(ValueError, match="block_d"):
        st.RouterConfig(block_d=24)
    x, w, b = _inputs(1, 2, 16, 64)
    with pytest.raises(ValueError, match="sigmoid_topk"):
        st.sigmoid_topk(x, w[:, :32], b, k=2, interpret=True)
    with pytest.raises(ValueError, match="sigmoid_topk"):
        st.sigmoid_topk(x, w, b, k=17, interpret=True)


@pytest.mark.parametrize("gemv", st.GEMVS)
@pytest.mark.parametrize("T,E", [(1, 384), (64, 384), (1, 16), (33, 16)])
def test_router_lowers_for_cuda(gemv, T, E):
    """The Triton lowering at Kimi's D = 7168, K = 8: tile shapes the GPU backend accepts."""
    S = jax.ShapeDtypeStruct
    args = (S((T, 7168), jnp.bfloat16), S((E, 7168), jnp.float32), S((E,), jnp.float32))
    f = lambda x, w, b: st.sigmoid_topk(x, w, b, k=8, scaling=2.827, config=st.RouterConfig(gemv=gemv),  # noqa: E731
                                        interpret=False)
    try:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:   # jax >= 0.11's Triton lowering asks a GPU for its compute capability
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
        raise
