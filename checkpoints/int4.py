"""compressed-tensors `pack-quantized` INT4 codec (W4A16, symmetric, group-wise), numpy and jnp.

The format (Kimi-K2-Thinking / K2.5 routed experts: the checkpoint's quantization_config says
compressed-tensors, pack-quantized, 4-bit int, symmetric, strategy group, group_size 32; attention,
shared experts, the dense MLP and lm_head stay bf16):

* a weight `w` [..., N, K] (N output features, K input features, HF Linear layout) is split along K
  into groups of `group_size` (g, 32 for Kimi) columns, one scale per group: `scale` [..., N, K/g], bf16;
* `q = round(clamp(w / scale, -8, 7))`, no zero point;
* stored unsigned `u = q + 8` and packed along the last (K) dim: element k of a row goes to int32
  word k // 8, bits 4*(k % 8) .. 4*(k % 8)+3 (lowest index in the least significant nibble):
  `packed` [..., N, K/8] int32;
* dequantized `w' = q * scale`.

Every function accepts arbitrary leading dims, so stacked experts [E, N, K/8] work unchanged.

`quantize` reproduces compressed-tensors 0.20 bit for bit for a bf16 weight (the dtype Kimi's
weights had when they were compressed): the min-max observer math of `calculate_qparams`
(`scale = max(|min|, |max|) / 7.5`, computed as a bf16 torch op: f32 arithmetic rounded once to
bf16; a zero scale becomes bf16 eps), then `_quantize` (`w / scale` as a bf16 op, clamp to [-8, 7],
round half to even). tests/test_int4_codec.py checks this against the installed library.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
NUM_BITS = 4
PACK_FACTOR = 32 // NUM_BITS          # 8 INT4 values per int32 word
Q_MIN, Q_MAX = -8, 7                  # calculate_range for 4-bit int: [-2^(b-1), 2^(b-1)-1]
OFFSET = 1 << (NUM_BITS - 1)          # stored value u = q + 8
# (q_max - q_min) / 2 as compressed-tensors computes it for symmetric scales: 15 / 2.
_HALF_RANGE = np.float32((Q_MAX - Q_MIN) / 2)
# compressed-tensors replaces a zero scale by torch.finfo(scale dtype).eps; bf16 eps = 2^-7.
_BF16_EPS = np.float32(2.0 ** -7)
_SHIFTS = np.arange(PACK_FACTOR, dtype=np.uint32) * NUM_BITS   # [8]: 0, 4, ..., 28

__all__ = ["quantize", "pack", "unpack", "dequantize", "pack_weight", "dequantize_jnp",
           "check_k", "Q_MIN", "Q_MAX", "PACK_FACTOR"]


def check_k(k: int, group_size: int | None = None, what: str = "weight") -> None:
    """Raise ValueError unless the input dim K is a multiple of 8 (and of group_size if given)."""
    if k % PACK_FACTOR:
        raise ValueError(f"INT4 {what}: input dim K={k} is not a multiple of {PACK_FACTOR} "
                         "(8 INT4 values are packed per int32 word along K)")
    if group_size is not None:
        if group_size <= 0 or group_size % PACK_FACTOR:
            raise ValueError(f"INT4 {what}: group_size={group_size} must be a positive multiple of "
                             f"{PACK_FACTOR}")
        if k % group_size:
            raise ValueError(f"INT4 {what}: input dim K={k} is not a multiple of group_size={group_size}")


def quantize(w: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-wise INT4 quantization exactly as compressed-tensors does it.

    Args:
      w: float array [..., N, K] (any float dtype; it is first rounded to bf16, the dtype the
        library sees for Kimi's weights).
      group_size: g, columns per scale; must divide K and be a multiple of 8.
    Returns:
      q: int8 [..., N, K] in [-8, 7]; scale: bf16 [..., N, K/g].
    """
    w = np.asarray(w)
    if w.ndim < 1:
        raise ValueError("INT4 quantize: need an array with at least one dim")
    k = w.shape[-1]
    check_k(k, group_size)
    wb = w.astype(BF16)
    # bf16 -> f32 is exact, so every f32 op below followed by a bf16 cast is the same as torch's
    # bf16 elementwise op (computed in f32, rounded once to bf16 with round-half-to-even).
    g = wb.astype(np.float32).reshape(*w.shape[:-1], k // group_size, group_size)
    if not np.all(np.isfinite(g)):
        raise ValueError("INT4 quantize: weight has non-finite values")
    mn = np.minimum(g.min(axis=-1), np.float32(0))          # 0 must be representable
    mx = np.maximum(g.max(axis=-1), np.float32(0))
    max_pos = np.maximum(np.abs(mn), np.abs(mx))
    scale = (max_pos / _HALF_RANGE).astype(BF16)
    scale = np.where(scale.astype(np.float32) == 0, _BF16_EPS, scale.astype(np.float32)).astype(BF16)
    scaled = (g / scale.astype(np.float32)[..., None]).astype(BF16).astype(np.float32)
    q = np.round(np.clip(scaled, Q_MIN, Q_MAX))             # np.round: half to even, like torch
    return q.astype(np.int8).reshape(w.shape), scale


def pack(q: np.ndarray) -> np.ndarray:
    """Pack INT4 values q (int8 [..., K], in [-8, 7]) into int32 words [..., K/8] (see module doc)."""
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise ValueError(f"INT4 pack: need integer values, got dtype {q.dtype}")
    check_k(q.shape[-1], what="pack")
    if q.size and (q.min() < Q_MIN or q.max() > Q_MAX):
        raise ValueError(f"INT4 pack: values outside [{Q_MIN}, {Q_MAX}] "
                         f"(found min {q.min()}, max {q.max()})")
    u = (q.astype(np.int32) + OFFSET).astype(np.uint32)
    u = u.reshape(*q.shape[:-1], q.shape[-1] // PACK_FACTOR, PACK_FACTOR)
    words = np.bitwise_or.reduce(u << _SHIFTS, axis=-1)   # nibbles do not overlap: OR == sum
    return words.astype(np.uint32).view(np.int32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack`: int32 [..., K/8] -> int8 [..., K] in [-8, 7]."""
    packed = np.asarray(packed)
    if packed.dtype != np.int32:
        raise ValueError(f"INT4 unpack: packed weights must be int32, got {packed.dtype}")
    u = (packed.view(np.uint32)[..., None] >> _SHIFTS) & np.uint32(0xF)
    return (u.astype(np.int8) - np.int8(OFFSET)).reshape(*packed.shape[:-1], packed.shape[-1] * PACK_FACTOR)


def _check_scale(packed_shape, scale_shape, group_size: int) -> int:
    k = packed_shape[-1] * PACK_FACTOR
    check_k(k, group_size)
    want = (*packed_shape[:-1], k // group_size)
    if tuple(scale_shape) != want:
        raise ValueError(f"INT4 dequantize: scale shape {tuple(scale_shape)} does not match packed "
                         f"shape {tuple(packed_shape)} with group_size={group_size} (need {want})")
    return k


def dequantize(packed: np.ndarray, scale: np.ndarray, group_size: int = 32,
               dtype=np.float32) -> np.ndarray:
    """packed int32 [..., N, K/8] + scale [..., N, K/g] -> weight [..., N, K] in `dtype`.

    q * scale is computed in float32, where it is exact (4-bit q times an 8-bit-mantissa bf16
    scale needs at most 12 mantissa bits), then cast once to `dtype`. With dtype=bfloat16 the
    result equals compressed-tensors' `_dequantize` (a bf16 multiply) bit for bit.
    """
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    k = _check_scale(packed.shape, scale.shape, group_size)
    q = unpack(packed).astype(np.float32).reshape(*packed.shape[:-1], k // group_size, group_size)
    w = q * scale.astype(np.float32)[..., None]
    return w.reshape(*packed.shape[:-1], k).astype(dtype)


def pack_weight(w: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Quantize and pack a float weight [..., N, K]: returns (packed int32 [..., N, K/8], scale bf16)."""
    q, scale = quantize(w, group_size)
    return pack(q), scale


def dequantize_jnp(packed, scale, group_size: int = 32, dtype=None):
    """jax.numpy version of `dequantize` (jit-friendly; int32 shifts and masks, no uint types).

    packed: int32 [..., N, K/8]; scale: [..., N, K/g] (bf16 or f32); returns [..., N, K] in `dtype`
    (default: scale's dtype). Same rounding as `dequantize`: exact f32 product, one cast.
    """
    import jax.numpy as jnp

    packed = jnp.asarray(packed)
    scale = jnp.asarray(scale)
    if packed.dtype != jnp.int32:
        raise ValueError(f"INT4 dequantize_jnp: packed weights must be int32, got {packed.dtype}")
    k = _check_scale(packed.shape, scale.shape, group_size)
    dtype = scale.dtype if dtype is None else dtype
    shifts = jnp.arange(PACK_FACTOR, dtype=jnp.int32) * NUM_BITS
    # Arithmetic right shift of a negative word sign-extends, but the 0xF mask drops those bits.
    u = jnp.bitwise_and(jnp.right_shift(packed[..., None], shifts), 0xF)
    q = (u - OFFSET).astype(jnp.float32).reshape(*packed.shape[:-1], k // group_size, group_size)
    w = q * scale.astype(jnp.float32)[..., None]
    return w.reshape(*packed.shape[:-1], k).astype(dtype)
