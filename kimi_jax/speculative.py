"""Speculative decoding: drafters propose tokens, the target model verifies them all in one pass.

A `Drafter` proposes up to k next tokens from a sequence's tokens so far. `NgramDrafter` is prompt
lookup: it finds the most recent earlier occurrence of the sequence's last n tokens (n from max_n
down to min_n) and proposes the tokens that followed it; it needs no extra model, so it works with
every checkpoint. A draft model or draft head can implement the same interface later.

`SpecState` backs off per request when drafts keep failing, so non-repetitive text pays (almost)
nothing: after a failed attempt the request waits 1, 2, 4, ... decode steps (up to 64) before
drafting again; an accepted draft resets the wait.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (possibly none)."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    max_n: int = 3
    min_n: int = 1

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = list(tokens[L - n:])
            for start in range(L - n - 1, -1, -1):          # most recent earlier match first
                if list(tokens[start:start + n]) == suffix:
                    follow = list(tokens[start + n:start + n + k])
                    if follow:
                        return follow
        return []


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style: method 'ngram', num_speculative_tokens k, prompt_lookup_max/min n."""
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2      # a 1-token match is mostly chance: it costs verification, rarely pays
    method: str = "ngram"
    adaptive: bool = True           # verify only while it beats plain decoding in measured tokens/s

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
            raise ValueError(f"speculative_config.method={out.method!r}: only 'ngram' is implemented")
        if out.num_speculative_tokens < 1 or not 1 <= out.prompt_lookup_min <= out.prompt_lookup_max:
            raise ValueError("speculative_config: need num_speculative_tokens >= 1 and "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")
        return out

    def drafter(self) -> Drafter:
        return NgramDrafter(self.prompt_lookup_max, self.prompt_lookup_min)


@dataclasses.dataclass
class SpecState:
    """Per-request speculation statistics and back-off."""
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    wait: int = 0          # decode steps to skip drafting
    backoff: int = 0

    def record(self, n_draft: int, n_accepted: int) -> None:
        self.drafted += n_draft
        self.accepted += n_accepted
        self.verify_steps += 1
        if n_accepted == 0:
            self.backoff = min(64, max(1, self.backoff * 2))
            self.wait = self.backoff
        else:
            self.backoff = 0

    def should_draft(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True
