"""Building blocks: linear, RMSNorm, dense SwiGLU MLP, and interleaved RoPE with YaRN.

Weights keep the Hugging Face layout ([out, in] for a linear) so checkpoint tensors load without
transposes; every parameter carries logical axis names (`axes` metadata) that
kimi_jax.parallel.sharding maps onto a device mesh. Shape letters follow the glossary in
docs/ARCHITECTURE.md ("Shape letters").
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.model.layer_weights import JointGateUp


def param(
    rngs: nnx.Rngs | None, shape, dtype, axes: tuple, *, std: float = 0.02, init: str = "normal"
):
    """An nnx.Param with logical axis names; `init` is 'normal' (std) or 'ones' or 'zeros'."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=axes)


class Linear(nnx.Module):
    """y = x @ W^T with W [out, in] (HF layout)."""

    def __init__(self, in_features: int, out_features: int, axes: tuple, *, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (out_features, in_features), dtype, axes)

    def __call__(self, x, plan=None):
        return ops.linear(x, self.weight[...], plan=plan)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as the reference). Given a
    residual: (h = x + residual, y of h), in one Pallas launch under the plan's norm_kernel
    'pallas'."""

    def __init__(self, dim: int, eps: float, *, dtype, axes=("norm",), parallel=None):
        self.eps = eps
        self.parallel = parallel
        self.weight = param(None, (dim,), dtype, axes, init="ones")

    def __call__(self, x, residual=None, *, plan=None):
        return ops.add_rms_norm(
            x, residual, self.weight[...], self.eps, plan=plan, parallel=self.parallel
        )


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used by dense layers and shared experts."""

    def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs, ffn_axis: str = "mlp"):
        self.gate_proj = Linear(dim, hidden, (ffn_axis, "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, (ffn_axis, "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, ("embed", ffn_axis), dtype=dtype, rngs=rngs)

    def __call__(self, x, plan=None):
        w = self.gate_proj.weight.get_value()
        # one product for gate and up (kimi_jax.model.layer_weights)
        if isinstance(w, JointGateUp):
            y_of = lambda x_: jnp.einsum("...d,kid->...ki", x_, w.w_2ID,  # noqa: E731
                                         preferred_element_type=x.dtype)
            if plan is not None and plan.batch_invariant:   # as ops.linear
                y = ops.row_tiles(y_of, x.reshape(-1, x.shape[-1]),
                                  plan.row_tile).reshape(*x.shape[:-1], 2, -1)
            else:
                y = y_of(x)
            return self.down_proj(jax.nn.silu(y[..., 0, :]) * y[..., 1, :], plan)
        return self.down_proj(jax.nn.silu(self.gate_proj(x, plan)) * self.up_proj(x, plan), plan)


# ---- rotary position embedding ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [R/2] for the rope dims, with YaRN's ramp between the original frequency
    (pairs below `low`) and frequency / factor (pairs above `high`)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if rs.rope_type != "yarn":
        return inv_freq.astype(np.float32)

    def correction_dim(n_rot):
        return (
            dim
            * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp                       # 1: keep original frequency
    inv = (inv_freq / rs.factor) * (1.0 - extrapolation) + inv_freq * extrapolation
    # computed in float64 then rounded once; the reference computes in float32 (~1e-7 relative)
    return inv.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, scale: float):
    """cos/sin [..., R/2] for integer positions."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved (GPT-J / complex-pair) rotation: pair (2i, 2i+1) rotates by angle i.

    x: [..., R]; cos/sin broadcastable to [..., R/2]. The output is de-interleaved ([even' | odd'])
    exactly as the reference does it; q and k get the same permutation, so scores are unchanged.
    """
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
