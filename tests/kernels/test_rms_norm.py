"""The fused residual add + RMSNorm (pallas_kernels/norm/rms_norm.py) against its jnp reference and the
model's RMSNorm, interpret mode on CPU, seeded inputs.

Tolerances: h = x + r is one correctly rounded add in both: bit-equal. y: the mean of squares is summed
in another order (1-2 float32 ulps of the statistic), and XLA's default xla_allow_excess_precision lets
a compiled program (the interpreted kernel, the model's jitted RMSNorm) keep the normalized value in
float32 through the weight multiply where the Triton kernel and eager jnp round it to the dtype first:
1 ulp of the normalized value, which the weight multiply's own rounding can make 2 ulps of y (bf16:
compared as bit patterns; float32: 3e-7 relative, a few ulps).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops
from kimi_jax.model.layers import RMSNorm
from pallas_kernels.norm import rms_norm as rn


def _inputs(seed, shape, D, dtype):
    kx, kr, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (3 * jax.random.normal(kx, (*shape, D), jnp.float32)).astype(dtype)
    r = jax.random.normal(kr, (*shape, D), jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (D,), jnp.float32)).astype(dtype)
    return x, r, w


def _assert_within_two_ulps(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if y.dtype == jnp.bfloat16:
        a = np.asarray(jax.lax.bitcast_convert_type(y, jnp.int16), np.int32)
        b = np.asarray(jax.lax.bitcast_convert_type(ref, jnp.int16), np.int32)
        assert np.abs(a - b).max() <= 2 and (a * b >= 0).all()            # same sign, <= 2 ulps apart
    else:
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=3e-7, atol=1e-30)


@pytest.mark.parametrize("shape,D,dtype", [((3,), 64, jnp.bfloat16), ((2, 3), 7168, jnp.bfloat16),
                                           ((5,), 96, jnp.float32), ((1,), 512, jnp.float32)])
def test_add_rms_norm_matches_the_reference(shape, D, dtype):
    """Leading dims flattened to rows; D = 96 is not a power of two (a masked [128] row); Kimi's 7168."""
    x, r, w = _inputs(D + len(shape), shape, D, dtype)
    h, y = rn.add_rms_norm(x, r, w, 1e-6, interpret=True)
    rh, ry = jax.jit(rn.add_rms_norm_reference, static_argnums=3)(x, r, w, 1e-6)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32))
    _assert_within_two_ulps(y, ry)
    _assert_within_two_ulps(rn.add_rms_norm(x, None, w, 1e-6, interpret=True),
                            jax.jit(rn.add_rms_norm_reference, static_argnums=3)(x, None, w, 1e-6))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_is_the_models_rmsnorm_and_the_plan_switches_it(dtype):
    """The reference computes exactly what kimi_jax.model.layers.RMSNorm's XLA path does (bit-equal);
    under norm_kernel='pallas' the module runs the kernel (within 2 ulps) and returns (h, y) alike."""
    x, r, w = _inputs(4, (2, 5), 64, dtype)
    norm = RMSNorm(64, 1e-5, dtype=dtype)
    norm.weight.set_value(w)
    xla, pallas = ops.ExecPlan(), ops.ExecPlan(norm_kernel="pallas")
    rh, ry = rn.add_rms_norm_reference(x, r, w, 1e-5)
    h, y = norm(x, r, plan=xla)
    assert (np.asarray(h, np.float32) == np.asarray(rh, np.float32)).all()
    assert (np.asarray(y, np.float32) == np.asarray(ry, np.float32)).all()
    assert (np.asarray(norm(x, plan=xla), np.float32) == np.asarray(rn.add_rms_norm_reference(x, None, w, 1e-5),
                                                                     np.float32)).all()
    h, y = norm(x, r, plan=pallas)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32))
    _assert_within_two_ulps(y, ry)


def test_bad_norm_arguments_are_one_line_errors():
    x, r, w = _inputs(1, (2,), 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="add_rms_norm"):
        rn.add_rms_norm(x, r, w[:32], 1e-6, interpret=True)
    with pytest.raises(ValueError, match="add_rms_norm"):
        rn.add_rms_norm(x, r.astype(jnp.float32), w, 1e-6, interpret=True)


@pytest.mark.parametrize("rows,residual", [(1, True), (1, False), (64, True)])
def test_norm_lowers_for_cuda(rows, residual):
    S = jax.ShapeDtypeStruct
    args = (S((rows, 7168), jnp.bfloat16), S((rows, 7168), jnp.bfloat16) if residual else None,
            S((7168,), jnp.bfloat16))
    try:
        jax.jit(lambda x, r, w: rn.add_rms_norm(x, r, w, 1e-5, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",))
    except RuntimeError as e:   # jax >= 0.11's Triton lowering asks a GPU for its compute capability
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
        raise
