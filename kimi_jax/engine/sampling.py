"""Sampling parameters (vLLM's names) and the on-device sampler, which takes them as [B] arrays."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.engine.penalties import LogitsAdjust
from kimi_jax.engine.structured_params import StructuredOutputsParams
from kimi_jax.ops.impl import row_sums


@dataclasses.dataclass
class SamplingParams:
    """Mutable as vLLM's: checked when made and when a request takes them (generate, add_request)"""

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
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Optional[dict[int, float]] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        self.validate()

    def validate(
        self, vocab_size: Optional[int] = None, max_logprobs: Optional[int] = None
    ) -> None:
        """RequestError naming the field at fault (`.field`); vocab_size: the model's checks too;
        max_logprobs: the engine's cap on logprobs / prompt_logprobs (-1: none)."""
        from kimi_jax.engine.validation import (
            RequestError,
            check_finite,
            check_seed,
            is_int,
            is_real,
        )

        def need(ok: bool, field: str, what: str) -> None:
            if not ok:
                raise RequestError(f"{field} {what}, got {getattr(self, field)!r}", field=field)

        def number(field: str, ok, what: str) -> None:
            check_finite(field, getattr(self, field))
            need(ok(getattr(self, field)), field, what)

        number("temperature", lambda v: v >= 0.0, "must be >= 0")
        number("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        need(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k > 0),
            "top_k",
            "must be -1 (off) or a positive integer",
        )
        number("min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be a positive integer",
        )
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            need(v is None or (is_int(v) and v >= 0), field, "must be a non-negative integer")
        ids = self.stop_token_ids
        need(ids is None or (isinstance(ids, Sequence) and not isinstance(ids, (str, bytes))
                             and all(is_int(t) and t >= 0 for t in ids)), "stop_token_ids",
             "must be a list of non-negative token ids")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        need(
            stops is None
            or (isinstance(stops, Sequence) and all(isinstance(x, str) and x for x in stops)),
            "stop",
            "must be a non-empty string or a list of them",
        )
        for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, field), bool), field, "must be a boolean")
        check_seed(self.seed)
        need(is_int(self.n) and self.n >= 1, "n", "must be a positive integer")
        if self.best_of is not None:
            need(
                is_int(self.best_of) and self.best_of >= self.n,
                "best_of",
                f"must be an integer >= n ({self.n})",
            )
            need(
                self.best_of == 1 or self.temperature > 0.0,
                "best_of",
                "must be 1 with greedy sampling (temperature 0)",
            )
        number("presence_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
        number("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
        number("repetition_penalty", lambda v: v > 0.0, "must be > 0")
        need(
            is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            "must be a non-negative integer",
        )
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be <= max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            from kimi_jax.engine.penalties import MAX_LOGIT_BIAS

            need(
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries",
            )
            need(
                all(is_int(t) and t >= 0 for t in self.logit_bias),
                "logit_bias",
                "keys must be non-negative token ids",
            )
            need(
                all(is_real(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be finite numbers in [-100, 100]",
            )
        need(
            self.bad_words is None
            or (
                isinstance(self.bad_words, (list, tuple))
                and all(isinstance(w, str) and w.strip() for w in self.bad_words)
            ),
            "bad_words",
            "must be a list of non-empty strings",
        )
        if self.structured_outputs is not None:
            need(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                 "must be a StructuredOutputsParams")
            try:
                self.structured_outputs.validate()
            except ValueError as e:
                raise RequestError(str(e), field="structured_outputs") from None
        if vocab_size is not None:
            if self.logprobs is not None and self.logprobs > vocab_size:
                raise RequestError(
                    f"logprobs={self.logprobs} is more than the vocabulary ({vocab_size} tokens)",
                    field="logprobs",
                )
            if self.stop_token_ids and any(t >= vocab_size for t in self.stop_token_ids):
                raise RequestError(
                    f"stop_token_ids {list(self.stop_token_ids)} reach outside the vocabulary "
                    f"[0, {vocab_size})",
                    field="stop_token_ids",
                )
        if max_logprobs is not None and max_logprobs >= 0:
            for field in ("logprobs", "prompt_logprobs"):
                v = getattr(self, field)
                if v is not None and v > max_logprobs:
                    raise RequestError(
                        f"{field} {v} exceeds max_logprobs {max_logprobs}", field=field
                    )

    @property
    def num_samples(self) -> int:
        """Samples generated for the request: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def adjusts_logits(self) -> bool:
        """Some adjustment runs before sampling (kimi_jax.engine.penalties)."""
        return bool(
            self.logit_bias
            or self.bad_words
            or self.min_tokens
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

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
    top_k: jax.Array        # int32; <= 0: off
    top_p: jax.Array
    min_p: jax.Array
    key: jax.Array          # [B, 2] uint32 raw PRNG keys
    adjust: Optional[LogitsAdjust] = None   # None: no row adjusts (static)

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], keys=None,
              adjust: Optional[LogitsAdjust] = None) -> "SamplingArrays":
        """keys: precomputed key_data rows (see key_data_for_seed); else derived from seeds."""
        if keys is None:
            keys = np.stack([key_data_for_seed(s) for s in seeds])
        # numpy: the jitted step's C++ fast path takes them cheaper than device arrays made here
        return SamplingArrays(
            temperature=np.asarray([p.temperature for p in params], np.float32),
            top_k=np.asarray([p.top_k if 0 < p.top_k < 2 ** 31 else -1 for p in params], np.int32),
            top_p=np.asarray([p.top_p for p in params], np.float32),
            min_p=np.asarray([p.min_p for p in params], np.float32),
            key=np.asarray(keys, np.uint32), adjust=adjust)


def key_data_for_seed(seed: int, sample: Optional[int] = None) -> np.ndarray:
    """Raw uint32 key [2] of a request's stream: seed mod 2^64 as (high, low) words (= PRNGKey(seed)
    for 0 <= seed < 2^32); sample: one of the request's n samples, each its own stream."""
    s = int(seed) % 2 ** 64
    key = np.asarray([s >> 32, s & 0xFFFFFFFF], np.uint32)
    if sample is not None:
        key = np.asarray(
            jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), sample)),
            np.uint32,
        )
    return key


def _filtered_sorted(logits_BV, sp: SamplingArrays):
    """(order [B, V] descending, logits in that order after temperature and top-k / top-p / min-p:
    -inf)."""
    logits = logits_BV.astype(jnp.float32)
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    scaled = logits / temp[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = jnp.ones_like(sorted_logits, dtype=bool)
    keep &= (sp.top_k[:, None] <= 0) | (rank < sp.top_k[:, None])
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= cum_before < sp.top_p[:, None]
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def _row_key(key_data, step, salt=None):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
    return key if salt is None else jax.random.fold_in(key, salt)


SAMPLE_MODES = ("greedy", "plain", "filtered")


def sample_mode(sp: SamplingArrays) -> str:
    """The cheapest `sample` path for host SamplingArrays: 'greedy', 'plain' (no row filters) or
    'filtered'; static, so the step needs no device conditional (which makes a GPU host wait every
    step)."""
    sampling, filters = _row_paths(*map(np.asarray, (sp.temperature, sp.top_k, sp.top_p, sp.min_p)))
    if not sampling.any():
        return "greedy"
    return "filtered" if filters.any() else "plain"


def _row_paths(temperature, top_k, top_p, min_p):
    """Per row: (samples at all, samples with a top-k / top-p / min-p filter)."""
    sampling = temperature > 0
    return sampling, sampling & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))


def sample(
    logits_BV: jax.Array, sp: SamplingArrays, step_B: jax.Array, mode: Optional[str] = None
) -> jax.Array:
    """Next token per row [B] int32: argmax at temperature 0, else filtered sampling with the row's
    key folded with its step; the [B, V] sort runs only if some row filters (BENCHMARKS.md
    "ModelSteps decode step"). mode: static (`sample_mode`), or None to decide on the device; a
    row's token never depends on it."""
    if mode is not None and mode not in SAMPLE_MODES:
        raise ValueError(f"unknown sample mode {mode!r}; expected one of {SAMPLE_MODES}")
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    sampling, filters = _row_paths(sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    temp = jnp.where(sampling, sp.temperature, 1.0)
    draw = jax.vmap(lambda k, s, row: jax.random.categorical(_row_key(k, s), row))

    def plain(_):
        return draw(sp.key, step_B, logits_BV.astype(jnp.float32) / temp[:, None]).astype(jnp.int32)

    def filtered(_):
        order, kept = _filtered_sorted(logits_BV, sp)
        pick = draw(sp.key, step_B, kept)
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    if mode == "greedy":
        return greedy
    if mode is None:
        unfiltered = jax.lax.cond(jnp.any(sampling), plain, lambda _: greedy, None)
        picked = jax.lax.cond(jnp.any(filters), filtered, lambda _: unfiltered, None)
    else:
        unfiltered = plain(None)
        picked = filtered(None) if mode == "filtered" else unfiltered
    return jnp.where(sampling, jnp.where(filters, picked, unfiltered), greedy)


def target_probs(logits_BV: jax.Array, sp: SamplingArrays) -> jax.Array:
    """The distribution `sample` draws from, in vocabulary order [B, V] (float32)."""
    order, filtered = _filtered_sorted(logits_BV, sp)
    probs_sorted = jax.nn.softmax(filtered, axis=-1)
    return (
        jnp.zeros_like(probs_sorted)
        .at[jnp.arange(order.shape[0])[:, None], order]
        .set(probs_sorted)
    )


def verify_drafts(
    logits_BTV: jax.Array,
    drafts_BY: jax.Array,
    n_draft_B: jax.Array,
    sp: SamplingArrays,
    step_B: jax.Array,
    greedy: bool = False,
):
    """Speculative verification (lossless). Position i of row b holds the target's next-token logits
    after draft i (position 0: after the last accepted token); Y = T - 1 drafts per row, n_draft_B
    valid.

    Greedy rows accept draft i while it equals the target's argmax. Sampled rows use the standard
    rejection rule for a deterministic drafter (q = a point mass on the draft): accept draft i with
    probability p_i(d_i); at the first rejection draw from p_i with d_i removed (the residual
    (p - q)+ normalized); if every draft is accepted draw a bonus token from p_n. The output then
    has exactly the target's distribution. Returns (accepted count [B], next token [B]). greedy
    (static): every row is greedy (no probabilities computed).
    """
    B, T, V = logits_BTV.shape
    Y = T - 1
    greedy_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    matches_BY = drafts_BY == greedy_BT[:, :Y]

    def accepted(ok_BY):          # the leading run of accepted drafts among the row's valid ones
        ok_BY &= jnp.arange(Y)[None, :] < n_draft_B[:, None]
        return jnp.cumprod(ok_BY.astype(jnp.int32), axis=1).sum(axis=1)
    if greedy:
        n_acc_B = accepted(matches_BY)
        return n_acc_B.astype(jnp.int32), greedy_BT[jnp.arange(B), n_acc_B]
    sp_T = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), sp)
    probs_BTV = target_probs(logits_BTV.reshape(B * T, V), sp_T).reshape(B, T, V)
    sampled = sp.temperature > 0
    p_draft_BY = jnp.take_along_axis(probs_BTV[:, :Y], drafts_BY[..., None], axis=-1)[..., 0]
    u_BY = jax.vmap(lambda k, s: jax.random.uniform(_row_key(k, s, 1), (Y,)))(sp.key, step_B)
    n_acc_B = accepted(jnp.where(sampled[:, None], u_BY < p_draft_BY, matches_BY))
    rows = jnp.arange(B)
    p_next_BV = probs_BTV[rows, n_acc_B]
    rejected = n_acc_B < n_draft_B
    d_rej = drafts_BY[rows, jnp.minimum(n_acc_B, Y - 1)] if Y > 0 else jnp.zeros((B,), jnp.int32)
    residual = jnp.where(
        rejected[:, None] & (jnp.arange(V)[None, :] == d_rej[:, None]), 0.0, p_next_BV
    )
    draw = jax.vmap(lambda k, s, p: jax.random.categorical(_row_key(k, s, 2), jnp.log(p)))(
        sp.key, step_B, residual
    )
    nxt = jnp.where(sampled, draw.astype(jnp.int32), greedy_BT[rows, n_acc_B])
    return n_acc_B.astype(jnp.int32), nxt


def top_logprobs(logits_BV: jax.Array, tokens_B: jax.Array, n: int, *, invariant: bool = False):
    """Raw log-softmax: (chosen token's logprob [...], its rank (1 = best) [...], top-n ids [...,
    n], top-n values [..., n]); any leading shape. invariant (ExecPlan.batch_invariant): each row's
    sum of exponentials in one order (`ops.row_sums`; XLA's reduction over [B, V] sums a row in an
    order that follows B)."""
    lp = (_log_softmax_rows(logits_BV.astype(jnp.float32)) if invariant
          else jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1))
    chosen = jnp.take_along_axis(lp, tokens_B[..., None], axis=-1)[..., 0]
    rank = (lp > chosen[..., None]).sum(axis=-1).astype(jnp.int32) + 1
    vals, ids = jax.lax.top_k(lp, max(n, 1))
    return chosen, rank, ids, vals


def _log_softmax_rows(x):
    """log_softmax over the last axis, its sum of exponentials by `ops.row_sums` (one order
    whatever the batch; see top_logprobs)."""
    shifted = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    return shifted - jnp.log(row_sums(jnp.exp(shifted)))


@dataclasses.dataclass
class Logprob:
    """vLLM's Logprob: log-probability, vocabulary rank (1: most likely), text (None without a
    tokenizer)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None
