"""The one-launch finish of an MLA decode step (pallas_kernels/mla/finish.py: new tokens + combine of the
split partials) against the XLA path it replaces, and inside both decode kernels' wrappers against the
float32 reference of the whole op. Interpret mode on CPU; seeded inputs.

Tolerances: float32 inputs agree with the XLA path to 2e-5 (same math, other summation order; p is
rounded to the inputs' dtype before the new-token P @ C in both). bfloat16: the output is rounded to
bf16 (|o| ~ 1: 8e-3 per ulp), so 3e-2 as in tests/test_mla_decode.py.
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import decode as md
from pallas_kernels.mla import decode_mgpu as mg
from pallas_kernels.mla import finish as mf
from test_mla_decode import _case, _check



def finish_reference(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale: float):
    """The XLA path the finish kernel replaces (`decode.finish_xla`), same contract."""
    o, lse = md.finish_xla(o_BJMA, lse_BJM, q_lat_BTNA, q_pe_BTNR, new_BTC, positions_BT, scale)
    return o.astype(q_lat_BTNA.dtype), lse

def _partials(seed, *, B, J, T, N, A, R, dtype, empty=(), positions=None):
    """Random normalized split outputs and lse (empty (b, j) splits: lse -inf, o 0), queries, new
    tokens at positions (default: 5 + t)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    M = T * N
    o = jax.random.normal(ks[0], (B, J, M, A), jnp.float32)
    lse = jax.random.normal(ks[1], (B, J, M), jnp.float32) * 3.0
    for b, j in empty:
        o, lse = o.at[b, j].set(0.0), lse.at[b, j].set(-jnp.inf)
    q_lat = jax.random.normal(ks[2], (B, T, N, A), jnp.float32).astype(dtype)
    q_pe = jax.random.normal(ks[3], (B, T, N, R), jnp.float32).astype(dtype)
    new = jax.random.normal(ks[4], (B, T, A + R), jnp.float32).astype(dtype)
    if positions is None:
        positions = jnp.broadcast_to(5 + jnp.arange(T, dtype=jnp.int32), (B, T))
    return o, lse, q_lat, q_pe, new, jnp.asarray(positions, jnp.int32)


@pytest.mark.parametrize("name,B,J,T,N,dtype,empty,positions,atol", [
    ("t1_n8_f32", 2, 3, 1, 8, jnp.float32, (), None, 2e-5),
    ("t3_n16_padding_f32", 2, 5, 3, 16, jnp.float32, ((1, 4),), [[7, 8, 9], [4, 5, -1]], 2e-5),
    ("t1_n64_one_split_bf16", 1, 1, 1, 64, jnp.bfloat16, (), None, 3e-2),
    ("t2_n8_all_splits_empty_f32", 2, 2, 2, 8, jnp.float32, ((0, 0), (0, 1)), [[0, 1], [-1, -1]], 2e-5),
])
def test_finish_matches_the_xla_path(name, B, J, T, N, dtype, empty, positions, atol):
    """Empty splits (a row shorter than the split count), a padding token (position -1) that nobody
    sees, a row with no cached keys (only its new tokens), a fully padded row (o = 0, lse = -inf)."""
    args = _partials(zlib.crc32(name.encode()) % 1000, B=B, J=J, T=T, N=N, A=64, R=16, dtype=dtype, empty=empty,
                     positions=positions)
    o, lse = mf.finish_partials(*args, 0.125, interpret=True)
    ro, rlse = finish_reference(*args, 0.125)
    assert o.shape == (B, T, N, 64) and o.dtype == dtype and lse.shape == (B, T, N)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=atol, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-4, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(o, np.float32)))


@pytest.mark.parametrize("block_a,block_k", [(32, 2), (0, 0)])
def test_finish_split_over_columns_and_split_chunks(block_a, block_k):
    """The grid's third axis and the chunked split loop: each program writes block_a of the A columns
    (the first block also lse) and reads the J = 5 splits block_k at a time (3 chunks, the last one
    partly past J); interpret-mode outputs start as NaN, so a column block nobody wrote fails.
    block_a = block_k = 0: the automatic `_blocks`."""
    assert mf._blocks(2 * 16, 5, 128) == (8, 32)        # few programs: columns narrowed to 32
    assert mf._blocks(64 * 64, 2, 512) == (2, 512)      # batch 64 x 64 heads, 2 splits: whole rows
    assert mf._blocks(8, 300, 512) == (64, 32)
    args = _partials(11, B=2, J=5, T=2, N=8, A=128, R=16, dtype=jnp.float32, empty=((1, 2),),
                     positions=[[6, 7], [3, -1]])
    o, lse = mf.finish_partials(*args, 0.125, interpret=True, block_a=block_a, block_k=block_k)
    ro, rlse = finish_reference(*args, 0.125)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="block_a=48 does not divide"):
        mf.finish_partials(*args, 0.125, interpret=True, block_a=48)


def test_finish_in_the_triton_decode_path():
    """`MlaDecodeConfig(finish='kernel')` through the whole op vs its f32 reference: ragged rows,
    a page-boundary end, T = 4 with padding tokens."""
    page, P = 16, 3
    cached = [0, 1, 2 * page, P * page - 4]
    args = _case(11, B=len(cached), T=4, N=8, A=64, R=16, page=page, P=P, cached=cached,
                 dtype=jnp.float32, pad_tokens=[(2, 3)])
    _check(args, 0.11, md.MlaDecodeConfig(block_k=16, num_splits=3, finish="kernel"), atol=2e-5)


@pytest.mark.skipif(mg.interpret_params() is None if mg.plgpu is not None else True,
                    reason="this jax has no Mosaic GPU interpreter")
@pytest.mark.slow
def test_finish_in_the_mosaic_gpu_decode_path():
    """The Mosaic GPU kernel's partials (its interpreter) finished by the kernel: same answer as the
    reference of the whole op (bf16 cache, 64 query rows)."""
    q_lat, q_pe, new, pool, bt, pos = md.make_case(jax.random.PRNGKey(12), [0, 17, 300], heads=64, a=512)
    cfg = mg.MgpuConfig(num_splits=2, finish="kernel")              # the one-row served config, 2 splits
    o = mg.mla_paged_attention_mgpu(q_lat, q_pe, new, pool, bt, pos, 576 ** -0.5, config=cfg,
                                    interpret=True)
    ro = md.mla_paged_attention_reference(q_lat, q_pe, new, pool, bt, pos, 576 ** -0.5)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=3e-2, rtol=0)


def test_bad_finish_is_a_one_line_error():
    with pytest.raises(ValueError, match="finish"):
        md.MlaDecodeConfig(finish="cuda")
    with pytest.raises(ValueError, match="finish"):
        mg.MgpuConfig(finish="cuda")
    args = _partials(1, B=1, J=2, T=1, N=8, A=64, R=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="finish_partials"):
        mf.finish_partials(args[0][:, :, :4], *args[1:], 0.1, interpret=True)


@pytest.mark.parametrize("T,N,J", [(1, 64, 2), (1, 8, 66), (4, 8, 3)])
def test_finish_lowers_for_cuda(T, N, J):
    """The kernel's Triton lowering at Kimi's A = 512, R = 64 (64 heads at TP1, 8 under TP8, T = 4
    under speculation): shapes and dots the GPU backend accepts."""
    S = jax.ShapeDtypeStruct
    B, M, A, R = 8, T * N, 512, 64
    args = (S((B, J, M, A), jnp.float32), S((B, J, M), jnp.float32), S((B, T, N, A), jnp.bfloat16),
            S((B, T, N, R), jnp.bfloat16), S((B, T, A + R), jnp.bfloat16), S((B, T), jnp.int32))
    try:
        jax.jit(lambda *a: mf.finish_partials(*a, 0.07, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",))
    except RuntimeError as e:   # jax >= 0.11's Triton lowering asks a GPU for its compute capability
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
        raise
