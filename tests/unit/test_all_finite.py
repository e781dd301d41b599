"""checkpoints.loader.all_finite (two integer maxima over the bits) against numpy's isfinite."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.loader import _FINITE_BLOCK, all_finite


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, np.uint16), (np.float16, np.uint16)])
def test_every_16_bit_pattern(dtype, bits):
    values = np.arange(1 << 16, dtype=np.uint32).astype(bits).view(dtype)
    want = np.isfinite(values.astype(np.float32))
    got = np.array([all_finite(values[i:i + 1]) for i in range(values.size)])
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:8]


def test_float32_patterns_around_the_exponent_boundaries():
    rng = np.random.default_rng(0)
    edges = np.array([0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF7FFFFF, 0xFF800000,
                      0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x00000000, 0x80000000, 0x00000001], np.uint32)
    values = np.concatenate([edges, rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)])
    values = values.view(np.float32)
    got = np.array([all_finite(values[i:i + 1]) for i in range(values.size)])
    assert np.array_equal(got, np.isfinite(values))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_one_bad_value_anywhere_in_a_multi_block_array(dtype, value):
    n = 3 * _FINITE_BLOCK // np.dtype(dtype).itemsize + 5       # three whole blocks and a partial one
    arr = np.random.default_rng(1).standard_normal(n).astype(dtype).reshape(-1, 1)
    assert all_finite(arr)
    for i in (0, n // 3, _FINITE_BLOCK // np.dtype(dtype).itemsize, n - 1):
        bad = arr.copy()
        bad[i] = value
        assert not all_finite(bad), i
        assert not all_finite(bad[::-1]), i         # a non-contiguous view is checked too


def test_empty_and_other_float_dtypes():
    assert all_finite(np.zeros((0, 4), jnp.bfloat16))
    assert not all_finite(np.array([1.0, np.nan], np.float64))
