"""Structured outputs' packed token bitmask [B, ceil(V / 32)] int32 (bit t % 32 of word t // 32:
token t allowed) and the device op the step applies it with (`apply_token_bitmask`)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["mask_words", "apply_token_bitmask", "apply_token_bitmask_reference"]


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits_BV: jnp.ndarray, mask_Bw: jnp.ndarray) -> jnp.ndarray:
    """Logits with each token whose bit (t % 32 of word t // 32) is clear at -inf (jit-friendly)."""
    B, V = logits_BV.shape
    bits_Bw32 = (mask_Bw[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed_BV = bits_Bw32.reshape(B, -1)[:, :V].astype(bool)
    return jnp.where(allowed_BV, logits_BV, jnp.asarray(-jnp.inf, logits_BV.dtype))


def apply_token_bitmask_reference(logits_BV: np.ndarray, mask_Bw: np.ndarray) -> np.ndarray:
    """Plain-loop numpy reference of `apply_token_bitmask`."""
    out = np.array(logits_BV, copy=True)
    B, V = out.shape
    for b in range(B):
        for t in range(V):
            if not (int(mask_Bw[b, t // 32]) >> (t % 32)) & 1:
                out[b, t] = -np.inf
    return out
