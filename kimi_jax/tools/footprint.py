"""Bytes of parameters one device holds under a layout, and the routed experts a batch touches."""
from __future__ import annotations

import math

from kimi_jax.config import ModelConfig
from kimi_jax.parallel.sharding import Layout

GiB = 2 ** 30
KV_BYTES = 2          # bf16 latent cache
ROUTER_BYTES = 4      # the router weight and bias are float32 in the engine


def _cdiv(n: int, *ways: int) -> int:
    for w in ways:
        n = -(-n // w)
    return n


def bucket(n: int, minimum: int = 8) -> int:
    """As kimi_jax.engine.steps.bucket: next power of two >= n (at least `minimum`)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def padded_batch(batch: int, dp: int) -> int:
    """As ModelSteps.batch_size: a power of two, rounded up to a multiple of dp."""
    return _cdiv(bucket(batch, 1), dp) * dp


def param_bytes(cfg: ModelConfig, layout: Layout, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of parameters a device holds, by group (kimi_jax.parallel.sharding's rules)."""
    tp, dp, ep = (
        layout.tensor_parallel_size,
        layout.data_parallel_size,
        layout.enable_expert_parallel,
    )
    db = dtype_bytes
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    H, R, A, U = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    E, F, Fd = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    L, Ld, Lm = cfg.num_hidden_layers, cfg.num_dense_layers, cfg.num_moe_layers
    if cfg.q_lora_rank is None:
        q = _cdiv(N * (H + R), tp) * D
    else:
        Q = cfg.q_lora_rank
        q = Q * D + Q + _cdiv(N * (H + R), tp) * Q
    attn = q + (A + R) * D + A + _cdiv(N * (H + U), tp) * A + D * _cdiv(N * U, tp)
    out = {
        "attention": L * attn * db,
        "norms": (L * 2 * D + D) * db,
        "dense_ffn": Ld * 3 * _cdiv(Fd, tp) * D * db,
        "router": Lm * (E * D + E) * ROUTER_BYTES,
        "shared_experts": Lm * 3 * _cdiv(cfg.shared_expert_width, tp) * D * db,
        "routed_experts": Lm
        * expert_bytes_local(cfg, layout, dtype_bytes)
        * experts_local(cfg, layout),
        "embedding": _cdiv(V, tp) * D * db,
        "lm_head": 0 if cfg.tie_word_embeddings else _cdiv(V, tp) * D * db,
    }
    return out


def experts_local(cfg: ModelConfig, layout: Layout) -> int:
    """Routed experts a device holds (whole under EP, a 1/tp slice of each otherwise)."""
    if layout.enable_expert_parallel:
        return _cdiv(cfg.n_routed_experts, layout.data_parallel_size, layout.tensor_parallel_size)
    return cfg.n_routed_experts


def expert_bytes_local(cfg: ModelConfig, layout: Layout, dtype_bytes: int = 2) -> int:
    """Bytes of one routed expert's local part (gate, up, down) on a device."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    t = 1 if layout.enable_expert_parallel else layout.tensor_parallel_size
    q = cfg.quantization
    if q is None:
        return (2 * _cdiv(F, t) * D + D * _cdiv(F, t)) * dtype_bytes
    g = q.group_size
    gate_up = _cdiv(F, t) * (D // 8 * 4 + D // g * dtype_bytes)
    down = D * (_cdiv(F // 8, t) * 4 + _cdiv(F // g, t) * dtype_bytes)
    return 2 * gate_up + down


def param_bytes_from_model(cfg: ModelConfig, layout: Layout, dtype=None) -> int:
    """sharding.per_device_bytes of the model's abstract state (shapes only; slow for big ones)."""
    import jax.numpy as jnp
    from flax import nnx
    from kimi_jax.model.transformer import abstract_model
    from kimi_jax.parallel.sharding import per_device_bytes
    abstract = nnx.split(abstract_model(cfg, dtype or jnp.bfloat16))[1]
    return per_device_bytes(layout, abstract)


def expected_touched(local: int, k: int, E: int, tokens: int) -> float:
    """Expected distinct experts, of `local` held, that `tokens` tokens touch with top-k uniform
    over E."""
    if tokens <= 0:
        return 0.0
    return local * (1.0 - (1.0 - k / E) ** tokens)


# expected maximum of n standard normal samples (Gaussian order statistics)
_MAX_Z = {1: 0.0, 2: 0.5642, 4: 1.0294, 8: 1.4236, 16: 1.7660, 32: 2.0697, 64: 2.3437}


def busiest_device_touched(local: int, k: int, E: int, tokens: int, devices: int) -> float:
    """Under EP each device reads only its own touched experts and the step waits for the busiest:
    the expected maximum over `devices` of the touched count (normal approximation: mean +
    z(devices) x std, each of the `local` experts touched independently with p = 1 - (1 - k/E)^T),
    capped at `local`."""
    p = 1.0 - (1.0 - k / E) ** max(tokens, 0)
    mean, std = local * p, (local * p * (1.0 - p)) ** 0.5
    z = _MAX_Z.get(devices) or (2 * math.log(devices)) ** 0.5
    return min(float(local), mean + z * std)
