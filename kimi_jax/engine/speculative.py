"""Speculative decoding: drafters propose tokens, the target model verifies them all in one pass.

A `Drafter` proposes up to k next tokens from a sequence's tokens so far. `NgramDrafter` is prompt
lookup: it finds the most recent earlier occurrence of the sequence's last n tokens (n from max_n
down to min_n) and proposes the tokens that followed it; it needs no extra model, so it works with
every checkpoint. `NgramIndex` is the same lookup kept incrementally per request (O(max_n) per token
and per proposal instead of a scan of the whole sequence); `NgramDrafter.propose` is its reference.

When to verify (kimi_jax.engine.scheduler) is decided from acceptance statistics and measured pass
costs, not from per-step timings. `SpecState` keeps each request's acceptance rate per draft
position, from real verifications and from "shadow" drafts: drafts proposed while the engine decodes
plainly are checked against the tokens that the request then produces. A draft token is accepted
exactly when it equals the token the target emits at that position (greedy: the argmax; sampled: the
rejection rule accepts d with probability p(d), which is the probability that the sampled token is
d), so the shadow match rate is an unbiased estimate of the acceptance rate and costs no
verification pass.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (possibly none)."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    max_n: int = 3
    min_n: int = 1

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Reference: scan for the most recent earlier occurrence of the last n tokens."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(tokens[length - n:])
            for start in range(length - n - 1, -1, -1):       # most recent earlier match first
                if list(tokens[start:start + n]) == suffix:
                    follow = list(tokens[start + n:start + n + k])
                    if follow:
                        return follow
        return []

    def index(self) -> "NgramIndex":
        return NgramIndex(self.max_n, self.min_n)


class NgramIndex:
    """Incremental prompt lookup for one sequence; proposes exactly what NgramDrafter.propose does.

    follow[n] maps each n-gram to the position just after its most recent occurrence, for
    occurrences followed by at least one token (so the sequence's own suffix never matches)."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follow: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, *parts: Sequence[int]) -> None:
        """Catch up with a sequence given as consecutive parts (e.g. prompt ids, output ids)."""
        seen = 0
        for part in parts:
            new = len(self.tokens) - seen
            seen += len(part)
            for t in part[max(new, 0):]:
                self._append(int(t))

    def _append(self, t: int) -> None:
        # the n-grams ending just before i now have a follower
        i = len(self.tokens)
        for n, table in self.follow.items():
            if i - n >= 0:
                table[tuple(self.tokens[i - n:i])] = i
        self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        length = len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            f = self.follow[n].get(tuple(self.tokens[length - n:]))
            if f is not None:
                return self.tokens[f:f + k]
        return []


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style: method 'ngram', num_speculative_tokens k, prompt_lookup_max/min n."""
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    # a 1-token match is mostly chance: it costs verification, rarely pays
    prompt_lookup_min: int = 2
    method: str = "ngram"
    adaptive: bool = True           # verify only when the expected tokens/s beat plain decoding

    @classmethod
    def from_any(cls, cfg) -> "SpeculativeConfig | None":
        if cfg is None or isinstance(cfg, cls):
            return cfg
        cfg = dict(cfg)
        unknown = set(cfg) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}")
        out = cls(**cfg)
        if out.method != "ngram":
            raise ValueError(
                f"speculative_config.method={out.method!r}: only 'ngram' is implemented"
            )
        if (
            out.num_speculative_tokens < 1
            or not 1 <= out.prompt_lookup_min <= out.prompt_lookup_max
        ):
            raise ValueError("speculative_config: need num_speculative_tokens >= 1 and "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")
        return out

    def drafter(self) -> NgramDrafter:
        return NgramDrafter(self.prompt_lookup_max, self.prompt_lookup_min)


# Acceptance estimate: a prior of PRIOR_HITS in PRIOR_TRIED, counts decayed by DECAY per attempt
# (~20 attempts). Pessimistic (no hits): first drafts are free shadow drafts, verified once they
# match; a 1-in-2 prior made the H200 run verify 5 times on text that never repeated (0.95x of
# speculation off at batch 1).
PRIOR_HITS, PRIOR_TRIED, DECAY = 0.0, 2.0, 0.95


@dataclasses.dataclass
class SpecState:
    """Per-request speculation statistics: real verification counts (reported as metrics) and the
    per-position acceptance estimate that the engine's gate uses (real and shadow attempts)."""
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    hits: float = 0.0          # decayed accepted draft positions (real + shadow)
    # decayed tried draft positions: a draft position is tried when all before it matched
    tried: float = 0.0
    # (output length when proposed, drafts), unverified
    shadow: Optional[tuple[int, list[int]]] = None
    index: Optional[NgramIndex] = None

    def _observe(self, n_draft: int, n_accepted: int) -> None:
        self.hits = DECAY * self.hits + n_accepted
        self.tried = DECAY * self.tried + min(n_accepted + 1, n_draft)

    def record(self, n_draft: int, n_accepted: int) -> None:
        """A real verification of n_draft drafts, n_accepted of them accepted."""
        self.drafted += n_draft
        self.accepted += n_accepted
        self.verify_steps += 1
        self.shadow = None
        self._observe(n_draft, n_accepted)

    def check_shadow(self, output_ids: Sequence[int]) -> None:
        """Score the pending shadow drafts against the tokens produced since they were proposed."""
        if self.shadow is None:
            return
        start, drafts = self.shadow
        produced = output_ids[start:start + len(drafts)]
        n = 0
        while n < len(produced) and produced[n] == drafts[n]:
            n += 1
        if n < len(produced) or n == len(drafts):       # a mismatch seen, or every draft matched
            self._observe(len(drafts), n)
            self.shadow = None

    def offer_shadow(self, n_output: int, drafts: list[int]) -> None:
        """Drafts that were proposed but not verified: score them once the tokens are known."""
        if drafts and self.shadow is None:
            self.shadow = (n_output, list(drafts))

    @property
    def rate(self) -> float:
        """Estimated probability that a draft position is accepted given the ones before it were."""
        return (self.hits + PRIOR_HITS) / (self.tried + PRIOR_TRIED)

    def expected_accepted(self, n_draft: int) -> float:
        """E[accepted drafts] for n_draft drafts: a + a^2 + ... + a^n with a = rate."""
        a = self.rate
        return sum(a ** i for i in range(1, n_draft + 1))


def propose_drafts(
    r, drafter: Optional["Drafter"], spec: Optional[SpeculativeConfig], max_model_len: int
) -> list[int]:
    """Draft tokens for a decode-ready request (none without speculation, with logprobs, logits
    adjustments or a grammar, or near the end of its budget); also scores pending shadow drafts."""
    if (drafter is None or r.params.logprobs is not None or r.adjust is not None or r.prefill_only
            or r.structured is not None):
        return []
    st = r.spec
    if st.index is None:
        st.index = drafter.index()
    st.index.extend(r.prompt_ids, r.output_ids)
    st.check_shadow(r.output_ids)
    room = min(r.max_new - len(r.output_ids), max_model_len - len(r.tokens)) - 1
    k = min(spec.num_speculative_tokens, room)
    return st.index.propose(k) if k > 0 else []
