"""Self-contained INT4 (compressed-tensors pack-quantized, W4A16 group 32) helpers for the kernels.

Layout (checkpoint / HF, rows are OUTPUT features):
  packed int32 [..., N, K/8]: element k of a row sits in word k//8, bits 4*(k%8)..4*(k%8)+3,
                              stored unsigned u = q + 8 with q in [-8, 7].
  scale  bf16  [..., N, K/g] (g = 32):  w[n, k] = q[n, k] * scale[n, k // g].

Nothing here depends on `checkpoints/` so the kernel package stays self-contained. These are the
references the kernels are tested against, plus random-weight generators for tests and benchmarks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
_SHIFTS = tuple(range(0, 32, 4))


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 [..., N, K/8] -> int8-valued int32 q [..., N, K] in [-8, 7]."""
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32)
    u = (packed[..., None] >> shifts) & 0xF                      # [..., N, K/8, 8]
    return (u - 8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Dense weight [..., N, K] = q * scale (scale broadcast over groups of K/scale.shape[-1]).

    The product q * s is exact in float32 (4-bit q times 8-bit-mantissa s), so dtype=bf16 rounds once,
    the same as compressed-tensors' `q.to(bf16) * scale`.
    """
    q = unpack_int4(packed)
    g = q.shape[-1] // scale.shape[-1]
    qg = q.reshape(*q.shape[:-1], scale.shape[-1], g).astype(jnp.float32)
    w = qg * scale.astype(jnp.float32)[..., None]
    return w.reshape(q.shape).astype(dtype)


def pack_int4_np(q: np.ndarray) -> np.ndarray:
    """numpy q int [..., N, K] in [-8, 7] -> packed int32 [..., N, K/8] (checkpoint layout)."""
    q = np.asarray(q)
    assert q.shape[-1] % 8 == 0
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    word = np.zeros(u.shape[:-1], np.uint32)
    for j in range(8):
        word |= u[..., j] << np.uint32(4 * j)
    return word.view(np.int32)


def random_int4(key: jax.Array, shape: tuple[int, ...], group: int = GROUP,
                scale_mag: float = 0.02) -> tuple[jax.Array, jax.Array]:
    """Random packed INT4 weight of logical shape [..., N, K] and its bf16 scales, built on device.

    Uses all 16 levels and positive/negative scales of varied magnitude. Never zeros.
    """
    *lead, n, k = shape
    assert k % 8 == 0 and k % group == 0
    kw, ks, kss = jax.random.split(key, 3)
    packed = jax.random.bits(kw, (*lead, n, k // 8), jnp.uint32).view(jnp.int32)
    mag = jnp.exp(jax.random.uniform(ks, (*lead, n, k // group), minval=-1.0, maxval=1.0))
    sign = jnp.where(jax.random.bernoulli(kss, 0.5, mag.shape), 1.0, -1.0)
    scale = (scale_mag * mag * sign).astype(jnp.bfloat16)
    return packed, scale
