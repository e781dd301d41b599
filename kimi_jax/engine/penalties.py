"""Logits adjustments before sampling, with vLLM's semantics: banned tokens (bad words), min_tokens,
logit_bias, then the repetition, frequency and presence penalties.

Per row, on the device, in this order (vLLM's sampler order: token masks and logits processors, then
penalties):
  - banned tokens and logit_bias: added to the logits (-inf for a ban), from [B, entries] (id,
  value) lists;
  - min_tokens: the row's stop tokens (eos and stop_token_ids) are -inf while its output has fewer
    than min_tokens tokens (its step, the output index being sampled, is below min_tokens);
  - repetition_penalty r (tokens in the prompt or the output): logit > 0 -> logit / r, else logit *
  r;
  - frequency_penalty f and presence_penalty p (output tokens only): logit - f * count - p * (count
  > 0).

The penalties need each row's output-token counts and prompt-token presence. They live on the
device in an occurrence pool [rows + 1, V] int32, one row per penalised request (a running request
that uses penalties holds one; the last row absorbs padding rows): value = 2 * (times the token was
output) + (1 if it is in the prompt). A step gathers its rows' pool rows ([B, V]), and after
sampling adds 2 at each row's sampled token, so the counts follow the sampled tokens with no host
read: overlap scheduling (kimi_jax.engine.scheduler) can feed step N's tokens to step N+1 and the
counts are already right. A request's pool row is written from the host once when its request is
admitted (prompt and output so far: after a preemption, the recompute starts from the right counts).
Why a pool of [V] rows: docs/ARCHITECTURE.md, "Penalties".
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: logit_bias entries per request (OpenAI's limit).
MAX_LOGIT_BIAS = 300
#: an index past any vocabulary: pads the [B, entries] id lists (dropped by the scatters).
PAD_ID = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsAdjust:
    """Per-row adjustments as arrays (host numpy when built; see `build`). The penalty fields are
    all None when no row of the batch uses penalties."""
    bias_ids: jax.Array                    # [B, entries] int32 (PAD_ID: none)
    bias_vals: jax.Array                   # [B, entries] float32 (-inf: banned)
    min_tokens: jax.Array                  # [B] int32
    stop_ids: jax.Array                    # [B, stop ids] int32: suppressed while step < min_tokens
    repetition: Optional[jax.Array] = None  # [B] float32 (1: off)
    frequency: Optional[jax.Array] = None   # [B] float32
    presence: Optional[jax.Array] = None    # [B] float32
    occ_row: Optional[jax.Array] = None     # [B] int32: the row's occurrence-pool row
    # [B] int32: 1 where the sampled token is an output token
    counts: Optional[jax.Array] = None

    @property
    def has_penalties(self) -> bool:
        return self.occ_row is not None


@dataclasses.dataclass(frozen=True)
class RowAdjust:
    """One request's fixed adjustments (host): built once per request by `row_adjust`."""
    bias: dict                              # token id -> bias (bans: -inf)
    stop_ids: tuple[int, ...]               # min_tokens suppresses these
    min_tokens: int
    repetition: float
    frequency: float
    presence: float
    # multi-token bad words (ids): banned by their output's tail
    bad_words: tuple[tuple[int, ...], ...]

    @property
    def has_penalties(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0


def row_adjust(params, stop_ids, bad_word_ids: Sequence[Sequence[int]]) -> Optional[RowAdjust]:
    """A request's RowAdjust (None if it adjusts nothing). bad_word_ids: its bad words' token ids
    (`bad_words_token_ids`); single-token words are always banned, longer ones by `banned_now`."""
    bias = {int(t): float(v) for t, v in (params.logit_bias or {}).items()}
    multi = []
    for ids in bad_word_ids:
        if len(ids) == 1:
            bias[int(ids[0])] = -np.inf
        elif ids:
            multi.append(tuple(int(t) for t in ids))
    row = RowAdjust(
        bias,
        tuple(sorted(stop_ids)) if params.min_tokens else (),
        int(params.min_tokens),
        float(params.repetition_penalty),
        float(params.frequency_penalty),
        float(params.presence_penalty),
        tuple(multi),
    )
    if not (row.bias or row.min_tokens or row.has_penalties or row.bad_words):
        return None
    return row


def bad_words_token_ids(bad_words: Sequence[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as written (left-stripped) and, when that gives a
    different first token and the same length, with a leading space (a word inside a text)."""
    out: list[list[int]] = []
    for word in bad_words:
        for space in (False, True):
            ids = tokenizer.encode((" " if space else "") + word.lstrip())
            if not ids:
                continue
            if not space or (out and ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(list(ids))
    return out


def banned_now(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The last token of each multi-token bad word whose other tokens end the output (vLLM's rule:
    matched against the output tokens only, never the prompt)."""
    out = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= len(output_ids) and tuple(output_ids[len(output_ids) - prefix :]) == tuple(
            word[:-1]
        ):
            out.append(word[-1])
    return out


def build(rows: Sequence[Optional[tuple[RowAdjust, list[int], int, int]]], penalty_pad_row: int,
          min_entries: int = 4, min_stops: int = 4, with_penalties: bool = False) -> LogitsAdjust:
    """Host arrays for a batch: rows[b] = (RowAdjust, banned ids now, occurrence-pool row or -1,
    counts) or None (a row that adjusts nothing, or padding). The entry and stop-id counts are
    bucketed to powers of two, at least min_entries and min_stops (few compiled shapes);
    with_penalties: the penalty fields even when no row has penalties (rows without: no-ops at the
    padding row)."""
    from kimi_jax.engine.shapes import bucket
    B = len(rows)
    entries = [
        [] if r is None else [*r[0].bias.items(), *[(t, -np.inf) for t in r[1]]] for r in rows
    ]
    n_bias = bucket(max(len(e) for e in entries), min_entries)
    n_stop = bucket(max((len(r[0].stop_ids) for r in rows if r is not None), default=1), min_stops)
    bias_ids = np.full((B, n_bias), PAD_ID, np.int32)
    bias_vals = np.zeros((B, n_bias), np.float32)
    stop = np.full((B, n_stop), PAD_ID, np.int32)
    min_tokens = np.zeros((B,), np.int32)
    for b, (r, e) in enumerate(zip(rows, entries)):
        if e:
            bias_ids[b, :len(e)] = [t for t, _ in e]
            bias_vals[b, :len(e)] = [v for _, v in e]
        if r is not None and r[0].min_tokens:
            stop[b, :len(r[0].stop_ids)] = r[0].stop_ids
            min_tokens[b] = r[0].min_tokens
    adj = LogitsAdjust(bias_ids, bias_vals, min_tokens, stop)
    if not with_penalties and not any(r is not None and r[2] >= 0 for r in rows):
        return adj
    rep = np.ones((B,), np.float32)
    freq, pres = np.zeros((B,), np.float32), np.zeros((B,), np.float32)
    occ_row = np.full((B,), penalty_pad_row, np.int32)
    counts = np.zeros((B,), np.int32)
    for b, r in enumerate(rows):
        if r is not None and r[2] >= 0:
            rep[b], freq[b], pres[b] = r[0].repetition, r[0].frequency, r[0].presence
            occ_row[b], counts[b] = r[2], r[3]
    return dataclasses.replace(
        adj, repetition=rep, frequency=freq, presence=pres, occ_row=occ_row, counts=counts
    )


def adjust_logits(logits_BV: jax.Array, adj: LogitsAdjust, step_B: jax.Array,
                  occ_BV: Optional[jax.Array] = None) -> jax.Array:
    """float32 logits after the adjustments (module docstring). occ_BV: the rows' occurrence-pool
    rows (2 * output count + prompt flag), needed when adj has penalties."""
    x = logits_BV.astype(jnp.float32)
    rows = jnp.arange(x.shape[0])[:, None]
    x = x.at[rows, adj.bias_ids].add(adj.bias_vals, mode="drop")
    early = (step_B < adj.min_tokens)[:, None]
    x = x.at[rows, jnp.where(early, adj.stop_ids, PAD_ID)].set(-jnp.inf, mode="drop")
    if not adj.has_penalties:
        return x
    count = occ_BV >> 1
    seen = occ_BV > 0
    rep = adj.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - adj.frequency[:, None] * count - adj.presence[:, None] * (count > 0)


def count_sampled(occ: jax.Array, adj: LogitsAdjust, tokens_B: jax.Array) -> jax.Array:
    """The pool occ [rows + 1, V] after this step's sampled tokens: +2 (one output occurrence) at
    each counted row."""
    return occ.at[adj.occ_row, tokens_B].add(2 * adj.counts, mode="drop")


def occurrence_row(vocab_size: int, prompt_ids, output_ids) -> np.ndarray:
    """A request's pool row [V] int32 from a request's prompt and output so far (host)."""
    row = np.zeros((vocab_size,), np.int32)
    row[np.asarray(prompt_ids, np.int64)] = 1
    np.add.at(row, np.asarray(output_ids, np.int64), 2)
    return row
