"""Sampling parameters (vLLM's names) and the on-device sampler.

Every request in a batch carries its own parameters; the sampler takes them as [B] arrays so one
compiled step serves any mix of greedy and sampled requests.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: Optional[int] = 16
    stop: Optional[Sequence[str] | str] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the parameter at fault."""
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (int(self.max_tokens) != self.max_tokens or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if self.logprobs is not None and (int(self.logprobs) != self.logprobs or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs}")
        if self.stop_token_ids is not None and any(int(t) != t or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            if any(not isinstance(s, str) or not s for s in stops):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays [B]."""
    temperature: jax.Array
    top_k: jax.Array        # int32; <= 0 means off
    top_p: jax.Array
    min_p: jax.Array
    key: jax.Array          # [B, 2] uint32 raw PRNG keys (one stream per request)

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], keys=None) -> "SamplingArrays":
        """keys: precomputed key_data rows (see key_data_for_seed); else derived from seeds."""
        if keys is None:
            keys = np.stack([key_data_for_seed(s) for s in seeds])
        return SamplingArrays(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
            key=jnp.asarray(keys, jnp.uint32))


def key_data_for_seed(seed: int) -> np.ndarray:
    """The raw uint32 key of a request's random stream (computed once per request)."""
    return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)), np.uint32)


def sample(logits_BV: jax.Array, sp: SamplingArrays, step_B: jax.Array) -> jax.Array:
    """Next token per row [B] int32. temperature 0 -> argmax; else top-k / top-p / min-p filtered
    sampling at that temperature, with the row's key folded with its step (reproducible per seed)."""
    logits = logits_BV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    scaled = logits / temp[:, None]
    order = jnp.argsort(-scaled, axis=-1)                          # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = jnp.ones_like(sorted_logits, dtype=bool)
    keep &= (sp.top_k[:, None] <= 0) | (rank < sp.top_k[:, None])
    cum_before = jnp.cumsum(probs, axis=-1) - probs                # mass of strictly better tokens
    keep &= cum_before < sp.top_p[:, None]
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)                                 # the best token always survives
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(key_data, step, row_logits):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
        return jax.random.categorical(key, row_logits)

    pick = jax.vmap(draw)(sp.key, step_B, filtered)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(sp.temperature > 0, sampled, greedy)


def top_logprobs(logits_BV: jax.Array, tokens_B: jax.Array, n: int):
    """log-softmax of the raw logits: (chosen token's logprob [B], top-n ids [B, n], top-n values [B, n])."""
    lp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens_B[:, None], axis=-1)[:, 0]
    vals, ids = jax.lax.top_k(lp, max(n, 1))
    return chosen, ids, vals
