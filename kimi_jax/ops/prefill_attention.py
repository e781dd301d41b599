"""Expanded-form (prefill) MLA attention: XLA einsums or cuDNN flash attention, masked or split in
two calls merged by log-sum-exp. BENCHMARKS.md "MLA prefill attention through cuDNN"."""
from __future__ import annotations

import functools
import logging
from typing import Optional

import jax
import jax.numpy as jnp

from kimi_jax.ops.impl import einsum_f32, shard_map as _shard_map, softmax
from kimi_jax.ops.plan import (
    CHUNK_ATTENTION_CHOICES,
    PREFILL_ATTENTION_CHOICES,
    ExecPlan,
    default_plan,
)  # noqa: F401


def cudnn_attention_fits(qk_dim: int, v_dim: int, dtype) -> bool:
    """Whether cuDNN flash attention takes these head dims (v padded to qk_dim) and dtype."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and qk_dim % 8 == 0 and qk_dim <= 256 and v_dim <= qk_dim)


def prefill_attention_path(
    qk_dim: int, v_dim: int, dtype, *, causal: bool, plan: Optional[ExecPlan] = None
) -> str:
    """mla_prefill_attention's path (static): forced, 'cudnn' / 'cudnn_split' or 'einsum'."""
    plan = default_plan(plan)
    forced = plan.prefill_attention if causal else plan.chunk_attention
    if forced != "auto":
        return forced
    if plan.pallas and cudnn_attention_fits(qk_dim, v_dim, dtype):
        return "cudnn" if causal else "cudnn_split"
    return "einsum"


def _dot_product_attention(q_BTNW, k_BSNW, v_BSNW, scale, implementation):
    """jax.nn.dot_product_attention, causal (top-left); a module attribute so tests can wrap it."""
    return jax.nn.dot_product_attention(q_BTNW, k_BSNW, v_BSNW, scale=scale, is_causal=True,
                                        implementation=implementation)


def _masked_dot_product_attention(q_BTNW, k_BSNW, v_BSNW, mask_BTS, scale, implementation):
    """jax.nn.dot_product_attention with an explicit mask [B, T, S] (shared by the heads)."""
    return jax.nn.dot_product_attention(q_BTNW, k_BSNW, v_BSNW, mask=mask_BTS[:, None], scale=scale,
                                        implementation=implementation)


@functools.cache
def _warn_fallback(path: str, error: str) -> None:
    """Log one warning per (path, error)."""
    logging.getLogger(__name__).warning(
        "prefill attention: %s path unavailable (%s); falling back", path, error
    )


def mla_prefill_attention(
    q_nope_BTNH: jax.Array,
    q_pe_BTNR: jax.Array,
    k_BSNH: jax.Array,
    kpe_BSR: jax.Array,
    v_BSNU: jax.Array,
    mask_BTS: jax.Array,
    scale: float,
    *,
    causal: bool = False,
    plan: Optional[ExecPlan] = None,
    parallel=None,
    chunk_lens=None,
) -> jax.Array:
    """softmax((q_nope . k + q_pe . kpe) * scale) . v over the keys mask [B, T, S] allows -> o [B,
    T, N, U] f32. causal (static): a fresh prefill (S == T, mask s <= t); chunk_lens (cached [B],
    new [B]) enables split."""
    H, R, U = q_nope_BTNH.shape[-1], q_pe_BTNR.shape[-1], v_BSNU.shape[-1]
    dtype = q_nope_BTNH.dtype
    fresh = causal and k_BSNH.shape[1] == q_nope_BTNH.shape[1]
    path = prefill_attention_path(H + R, U, dtype, causal=fresh, plan=plan)
    masked = path.removesuffix("_split")
    for p in ([path, masked] if path != masked and chunk_lens is not None else [masked]):
        if p == "einsum":
            break
        try:
            return _mla_prefill_attention_dpa(
                q_nope_BTNH,
                q_pe_BTNR,
                k_BSNH,
                kpe_BSR,
                v_BSNU,
                scale,
                p,
                parallel,
                mask_BTS=None if fresh else mask_BTS,
                chunk_lens=chunk_lens if p.endswith("_split") else None,
            )
        except (NotImplementedError, RuntimeError) as e:
            _warn_fallback(p, f"{type(e).__name__}: {e}")
    return _mla_prefill_attention_einsum(
        q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNU, mask_BTS, scale,
        default_plan(plan).batch_invariant
    )


def _mla_prefill_attention_einsum(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNU, mask_BTS, scale,
                                  invariant=False):
    dtype = q_nope_BTNH.dtype
    rope_BNTS = einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR)
    nope_BNTS = einsum_f32("btnh,bsnh->bnts", q_nope_BTNH, k_BSNH)
    s_BNTS = jnp.where(mask_BTS[:, None], (nope_BNTS + rope_BNTS) * scale, -1e30)
    p_BNTS = softmax(s_BNTS, invariant=invariant).astype(dtype)
    return einsum_f32("bnts,bsnu->btnu", p_BNTS, v_BSNU)


def _mla_prefill_attention_dpa(
    q_nope_BTNH,
    q_pe_BTNR,
    k_BSNH,
    kpe_BSR,
    v_BSNU,
    scale,
    implementation,
    parallel,
    mask_BTS=None,
    chunk_lens=None,
):
    extra = (
        tuple(chunk_lens) if chunk_lens is not None else (mask_BTS,) if mask_BTS is not None else ()
    )

    def attend(q_nope, q_pe, k, kpe, v, *extra):
        N, W, U = k.shape[2], k.shape[3] + kpe.shape[-1], v.shape[-1]
        q_BTNW = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
        kpe_BSNR = jnp.broadcast_to(kpe[:, :, None, :], (*kpe.shape[:2], N, kpe.shape[-1])).astype(
            k.dtype
        )
        k_BSNW = jnp.concatenate([k, kpe_BSNR], axis=-1)
        v_BSNW = jnp.pad(v.astype(k.dtype), ((0, 0), (0, 0), (0, 0), (0, W - U)))
        if chunk_lens is not None:
            o_BTNW = _split_attention(
                q_BTNW, k_BSNW, v_BSNW, *extra, scale, implementation.removesuffix("_split")
            )
        elif extra:
            m_BTS = extra[0]
            m_BTS = m_BTS.at[:, :, 0].set(m_BTS[:, :, 0] | ~m_BTS.any(axis=-1))
            o_BTNW = _masked_dot_product_attention(
                q_BTNW, k_BSNW, v_BSNW, m_BTS, scale, implementation
            )
        else:
            o_BTNW = _dot_product_attention(q_BTNW, k_BSNW, v_BSNW, scale, implementation)
        return o_BTNW[..., :U].astype(jnp.float32)

    if parallel is not None and parallel.mesh.size > 1:
        from jax.sharding import PartitionSpec as P
        b, h = parallel.batch or None, parallel.heads or None
        extra_specs = (P(b),) * 2 if chunk_lens is not None else (P(b, None, None),) * len(extra)
        attend = _shard_map(attend, parallel.mesh,
                            in_specs=(P(b, None, h, None), P(b, None, h, None), P(b, None, h, None),
                                      P(b, None, None), P(b, None, h, None)) + extra_specs,
                            out_specs=P(b, None, h, None))
    return attend(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNU, *extra)


def _split_attention(q_BTNW, k_BSNW, v_BSNW, cached_B, new_B, scale, implementation):
    """A chunk after cached tokens, unmasked: keys = S - T cached slots (first cached[b] real), then
    the T chunk tokens (first new[b] real, causal); two calls merged by log-sum-exp; padding queries
    get 0."""
    T = q_BTNW.shape[1]
    S0 = k_BSNW.shape[1] - T
    parts = attention_lse_cudnn if implementation == "cudnn" else _attention_lse_xla
    if S0 == 0:
        cached_B = jnp.zeros_like(cached_B)
        pad = ((0, 0), (1, 0), (0, 0), (0, 0))
        k_BSNW, v_BSNW, S0 = jnp.pad(k_BSNW, pad), jnp.pad(v_BSNW, pad), 1
    has_old = (cached_B > 0)[:, None, None]
    new_len = jnp.maximum(new_B, 1).astype(jnp.int32)
    o_old, lse_old = parts(q_BTNW, k_BSNW[:, :S0], v_BSNW[:, :S0], new_len,
                           jnp.maximum(cached_B, 1).astype(jnp.int32), scale, causal=False)
    o_new, lse_new = parts(
        q_BTNW, k_BSNW[:, S0:], v_BSNW[:, S0:], new_len, new_len, scale, causal=True
    )
    lse_old = jnp.where(has_old, lse_old, -jnp.inf)
    m = jnp.maximum(lse_old, lse_new)
    w_old, w_new = jnp.exp(lse_old - m), jnp.exp(lse_new - m)
    o_old = jnp.where(has_old[..., None], o_old.astype(jnp.float32), 0.0)
    o = (o_old * w_old[..., None] + o_new.astype(jnp.float32) * w_new[..., None]) / (w_old + w_new)[
        ..., None
    ]
    real = (jnp.arange(T)[None, :] < new_B[:, None])[:, :, None, None]
    return jnp.where(real, o, 0.0)


def attention_lse_cudnn(q_BTNW, k_BSNW, v_BSNW, q_len_B, kv_len_B, scale, *, causal):
    """(o [B, T, N, W], log-sum-exp [B, T, N] float32) with per-row lengths, via jax's private cuDNN
    entry point (the public one rounds the log-sum-exp to the inputs' dtype)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    try:
        o, lse_BNT = fa.dot_product_attention(
            q_BTNW,
            k_BSNW,
            v_BSNW,
            q_seqlen=q_len_B,
            kv_seqlen=kv_len_B,
            scale=scale,
            mask_type=mask_type,
            return_residual=True,
        )
    # a differing private signature or a refused shape: caller falls back
    except (TypeError, ValueError) as e:
        raise NotImplementedError(f"jax's cuDNN entry point: {e}") from e
    return o, jnp.transpose(lse_BNT, (0, 2, 1)).astype(jnp.float32)


def _attention_lse_xla(q_BTNW, k_BSNW, v_BSNW, q_len_B, kv_len_B, scale, *, causal):
    """The same in jnp (float32 scores): the CPU stand-in of attention_lse_cudnn."""
    del q_len_B
    s_BNTS = einsum_f32("btnw,bsnw->bnts", q_BTNW, k_BSNW) * scale
    S, T = k_BSNW.shape[1], q_BTNW.shape[1]
    see = jnp.arange(S)[None, None, :] < kv_len_B[:, None, None]
    if causal:
        see = see & (jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None])
    s_BNTS = jnp.where(see[:, None], s_BNTS, -jnp.inf)
    lse_BNT = jax.nn.logsumexp(s_BNTS, axis=-1)
    p_BNTS = jnp.exp(s_BNTS - lse_BNT[..., None]).astype(q_BTNW.dtype)
    return einsum_f32("bnts,bsnw->btnw", p_BNTS, v_BSNW).astype(q_BTNW.dtype), jnp.transpose(
        lse_BNT, (0, 2, 1)
    )
