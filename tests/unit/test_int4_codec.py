"""checkpoints.int4 against the compressed-tensors library, bit for bit, in both directions.

Every comparison here is exact (bitwise for bf16): the codec is integer packing plus float ops whose
rounding we reproduce step by step, so any difference is a bug, not noise.
"""
import numpy as np
import pytest

import ml_dtypes

from checkpoints import int4

try:  # the library is the reference; only the tests that call it need it (pytest.importorskip)
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
except ImportError:
    torch = None


@pytest.fixture
def ct():
    """Skip unless torch and compressed_tensors are installed."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")


BF16 = np.dtype(ml_dtypes.bfloat16)
# (shape [..., N, K], group size): plain Linear, Kimi's g=32, a leading expert dim [E, N, K], two
# leading dims, and a non-Kimi group size.
SHAPES = [((16, 64), 32), ((8, 256), 32), ((3, 16, 64), 32), ((2, 3, 8, 96), 32), ((4, 256), 128)]


def _scheme(group_size):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _to_torch(a: np.ndarray):
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_np(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16)
    return t.numpy()


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality including the bf16 bit pattern (so -0.0 != 0.0 would be caught)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if a.dtype == BF16:
        return bool(np.array_equal(a.view(np.int16), b.view(np.int16)))
    return bool(np.array_equal(a, b))


def _weights(shape, seed):
    """Random bf16 weights with the awkward cases: an all-zero group, an all-negative row, ties."""
    rng = np.random.default_rng(seed)
    w = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    flat = w.reshape(-1, shape[-1])
    flat[0, :32] = 0.0                             # zero group: scale becomes bf16 eps
    flat[1] = -np.abs(flat[1])                     # min-only row: max(|min|, |max|) = |min|
    # A row on the half-integer lattice: with max 7.5 * 2^-8 the scale is exactly 2^-8 and every
    # w / scale is k / 2, so round-half-to-even decides (e.g. 2.5 -> 2, -7.5 -> -8).
    k = rng.integers(-15, 16, size=shape[-1]).astype(np.float32)
    k[::32] = 15.0
    flat[2] = k / 2 * 2.0 ** -8
    return w.astype(BF16)


def _library_compress(w: np.ndarray, group_size: int):
    scheme = _scheme(group_size)
    wt = _to_torch(w)
    scale, zp = compute_dynamic_scales_and_zp(wt, scheme.weights, module=None)  # min-max observer
    out = PackedQuantizationCompressor.compress(
        {"weight": wt, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out, scale, zp


@pytest.mark.parametrize("shape,group_size", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_library(ct, shape, group_size, seed):
    w = _weights(shape, seed)
    scheme = _scheme(group_size)
    wt = _to_torch(w)
    scale_ct, zp = compute_dynamic_scales_and_zp(wt, scheme.weights, module=None)
    q_ct = ct_quantize(wt, scale_ct, zp, scheme.weights, dtype=torch.int8)
    q, scale = int4.quantize(w, group_size)
    assert scale.dtype == BF16 and scale.shape == (*shape[:-1], shape[-1] // group_size)
    assert _bits_equal(scale, _to_np(scale_ct))
    assert q.dtype == np.int8 and np.array_equal(q, q_ct.numpy())
    assert q.min() >= -8 and q.max() <= 7


@pytest.mark.parametrize("shape,group_size", SHAPES)
def test_library_compressed_is_read_exactly(ct, shape, group_size):
    """(a) library compress -> kimi_jax unpack/dequantize == library unpack/decompress."""
    w = _weights(shape, seed=2)
    out, _, _ = _library_compress(w, group_size)
    packed, scale = _to_np(out["weight_packed"]), _to_np(out["weight_scale"])
    assert packed.dtype == np.int32 and packed.shape == (*shape[:-1], shape[-1] // 8)
    assert np.array_equal(int4.unpack(packed),
                          unpack_from_int32(out["weight_packed"], 4, torch.Size(shape)).numpy())
    dec = PackedQuantizationCompressor.decompress(out, _scheme(group_size))["weight"]
    ours_bf16 = int4.dequantize(packed, scale, group_size, dtype=BF16)
    assert _bits_equal(ours_bf16, _to_np(dec))
    # The float32 result is the exact product; rounding it once to bf16 gives the library's value.
    assert _bits_equal(int4.dequantize(packed, scale, group_size).astype(BF16), _to_np(dec))
    # And our own packing of the same weight is identical to the library's.
    ours_packed, ours_scale = int4.pack_weight(w, group_size)
    assert np.array_equal(ours_packed, packed) and _bits_equal(ours_scale, scale)


@pytest.mark.parametrize("shape,group_size", SHAPES)
def test_kimi_packed_is_decompressed_exactly_by_library(ct, shape, group_size):
    """(b) kimi_jax pack (all 16 levels, arbitrary scales) -> library decompress == ours."""
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, size=shape, dtype=np.int8)
    scale = (rng.uniform(1e-4, 1e-1, size=(*shape[:-1], shape[-1] // group_size))).astype(BF16)
    packed = int4.pack(q)
    assert np.array_equal(packed, pack_to_int32(torch.from_numpy(q), 4).numpy())
    state = {"weight_packed": _to_torch(packed), "weight_scale": _to_torch(scale),
             "weight_shape": torch.tensor(shape, dtype=torch.int32)}
    dec = PackedQuantizationCompressor.decompress(state, _scheme(group_size))["weight"]
    assert _bits_equal(int4.dequantize(packed, scale, group_size, dtype=BF16), _to_np(dec))
    assert np.array_equal(unpack_from_int32(_to_torch(packed), 4, torch.Size(shape)).numpy(), q)


def test_pack_bit_layout():
    """Element k of a row sits in word k // 8 at bits 4*(k % 8), stored as q + 8."""
    q = np.array([[-8, -7, -1, 0, 1, 2, 6, 7, 0, 0, 0, 0, 0, 0, 0, -8]], dtype=np.int8)
    words = int4.pack(q).view(np.uint32)
    assert words.shape == (1, 2)
    assert words[0, 0] == sum((int(v) + 8) << (4 * j) for j, v in enumerate(q[0, :8]))
    assert words[0, 1] == 0x08888888                 # seven 0s (u=8) then -8 (u=0) on top
    assert np.array_equal(int4.unpack(int4.pack(q)), q)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_dequantize_jnp_matches_numpy(dtype):
    import jax
    import jax.numpy as jnp

    w = _weights((4, 16, 128), seed=4)               # leading expert dim
    packed, scale = int4.pack_weight(w, 32)
    f = jax.jit(lambda p, s: int4.dequantize_jnp(p, s, 32, jnp.dtype(dtype)))
    got = np.asarray(f(packed, scale))
    assert _bits_equal(got, int4.dequantize(packed, scale, 32, dtype=dtype))


def test_synthetic_checkpoint_dequantized_by_library(ct, tmp_path):
    """A whole synthetic INT4 checkpoint (config.json + safetensors) through the library's
    model-free dequantizer gives exactly our bf16 dequantized experts."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer)
    from safetensors.torch import load_file

    from checkpoints import synthetic
    from kimi_jax.config import QuantConfig, preset

    cfg = preset("tiny").replace(quantization=QuantConfig())
    synthetic.write_checkpoint(str(tmp_path), cfg, seed=5, layout="k25")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    out = CompressedTensorsDequantizer(str(tmp_path)).process(dict(tensors))
    n = 0
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            ours = int4.dequantize(t.numpy(), _to_np(tensors[base + "_scale"]), 32, dtype=BF16)
            assert _bits_equal(ours, _to_np(out[base])), name
            n += 1
    assert n == 3 * cfg.n_routed_experts * cfg.num_moe_layers


def test_errors():
    with pytest.raises(ValueError, match="K=60 is not a multiple of 8"):
        int4.quantize(np.zeros((4, 60), np.float32))
    with pytest.raises(ValueError, match="K=48 is not a multiple of group_size=32"):
        int4.quantize(np.zeros((4, 48), np.float32), 32)
    with pytest.raises(ValueError, match="outside"):
        int4.pack(np.full((1, 8), 8, np.int8))
    with pytest.raises(ValueError, match="must be int32"):
        int4.unpack(np.zeros((1, 8), np.int64))
    with pytest.raises(ValueError, match="scale shape"):
        int4.dequantize(np.zeros((4, 8), np.int32), np.zeros((4, 3), BF16), 32)
    with pytest.raises(ValueError, match="non-finite"):
        int4.quantize(np.full((1, 32), np.inf, np.float32))
