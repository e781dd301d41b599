"""``<think>...</think>`` at the start of an output -> ``reasoning_content`` (vLLM's field), the
rest the answer, decided the same whatever the chunking: reasoning starts at a leading ``<think>``
or with the output when the prompt ended in one (``starts_in_reasoning``); ``</think>`` and the
whitespace after it end it; ``keep_inline=True`` leaves everything in the answer."""
from __future__ import annotations

import dataclasses
from typing import Iterable

from kimi_jax.text.markers import Event, Marker

__all__ = ["THINK_BEGIN", "THINK_END", "ReasoningConfig", "ReasoningStage", "split_reasoning"]

THINK_BEGIN = "<think>"
THINK_END = "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
    """enabled=False: output passes untouched; starts_in_reasoning: the prompt ends ``<think>``."""

    enabled: bool = True
    starts_in_reasoning: bool = False
    keep_inline: bool = False


_START, _REASONING, _AFTER, _ANSWER = range(4)


class ReasoningStage:
    def __init__(self, config: ReasoningConfig = ReasoningConfig()):
        self.config = config
        passthrough = not config.enabled or config.keep_inline
        self._state = (
            _ANSWER if passthrough else (_REASONING if config.starts_in_reasoning else _START)
        )
        self._pending = ""        # leading whitespace seen in _START / after </think>

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, events: Iterable[Event]) -> tuple[str, list[Event]]:
        reasoning: list[str] = []
        answer: list[Event] = []
        for ev in events:
            st = self._state
            if st == _ANSWER:
                answer.append(
                    ev.text
                    if isinstance(ev, Marker) and ev.text in (THINK_BEGIN, THINK_END)
                    else ev
                )
            elif st == _REASONING:
                if isinstance(ev, Marker) and ev.text == THINK_END:
                    self._state = _AFTER
                else:
                    reasoning.append(ev.text if isinstance(ev, Marker) else ev)
            elif isinstance(ev, str) and not ev.strip():
                self._pending += ev                    # _START or _AFTER: whitespace waits
            elif st == _START and isinstance(ev, Marker) and ev.text == THINK_BEGIN:
                self._pending = ""
                self._state = _REASONING
            else:
                if isinstance(ev, str):
                    ev = ev.lstrip() if st == _AFTER else ev
                    if st == _START and self._pending:
                        answer.append(self._pending)
                elif st == _START and self._pending:
                    answer.append(self._pending)
                self._pending = ""
                self._state = _ANSWER
                answer.append(
                    ev.text
                    if isinstance(ev, Marker) and ev.text in (THINK_BEGIN, THINK_END)
                    else ev
                )
        return "".join(reasoning), answer

    def finish(self) -> tuple[str, list[Event]]:
        """End of output: leading whitespace of an output that never began is the answer."""
        answer: list[Event] = []
        if self._state == _START and self._pending:
            answer.append(self._pending)
        self._pending = ""
        return "", answer


def split_reasoning(text: str, config: ReasoningConfig = ReasoningConfig()) -> tuple[str, str]:
    """``(reasoning, answer)`` of a complete output given as text."""
    from kimi_jax.text.markers import MarkerScanner
    scanner = MarkerScanner([THINK_BEGIN, THINK_END])
    stage = ReasoningStage(config)
    r1, a1 = stage.feed(scanner.feed_text(text) + scanner.finish())
    r2, a2 = stage.finish()
    return r1 + r2, "".join(e.text if isinstance(e, Marker) else e for e in a1 + a2)
