"""Model output -> text and marker events (``<|tool_call_begin|>``, ``<think>``), from ids or text,
the same in any chunking: a marker with a special token of its own matches by id only, others in the
decoded text; a tail that could still become a marker, or an unfinished UTF-8 character, waits."""
from __future__ import annotations

import codecs
import dataclasses
import operator
from typing import Iterable, Optional, Sequence, Union

__all__ = ["Marker", "Event", "MarkerScanner"]


@dataclasses.dataclass(frozen=True)
class Marker:
    """A marker event; ``text`` is the marker's spelling."""
    text: str


Event = Union[str, Marker]      # a str event is a piece of plain text


class MarkerScanner:
    """Feed token ids (`feed_ids`) or text (`feed_text`), get events; `finish` at the end of output.

    tokenizer: a `kimi_jax.text.tokenizer.Tokenizer` (needed by `feed_ids`); markers that are its
    special tokens are matched by id. Other special ids (``<|im_end|>``, ...) are dropped from the
    text, as ``decode(skip_special_tokens=True)`` drops them.
    """

    def __init__(self, markers: Sequence[str], tokenizer=None):
        if not markers or any(not isinstance(m, str) or not m for m in markers):
            raise ValueError(f"markers must be non-empty strings, got {markers!r}")
        self.tokenizer = tokenizer
        specials = getattr(tokenizer, "special_tokens", {}) if tokenizer is not None else {}
        self._id_markers = {specials[m]: Marker(m) for m in markers if m in specials}
        self._text_markers = sorted(
            {m for m in markers if m not in specials}, key=len, reverse=True
        )
        self._prefixes = {m[:k] for m in self._text_markers for k in range(1, len(m))}
        self._max_prefix = max((len(m) - 1 for m in self._text_markers), default=0)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def marker_ids(self) -> dict[int, str]:
        """The markers matched by token id: ``{id: marker}``."""
        return {i: m.text for i, m in self._id_markers.items()}

    def feed_ids(self, ids: Iterable[int]) -> list[Event]:
        if self.tokenizer is None:
            raise ValueError("feed_ids needs a tokenizer")
        tok = self.tokenizer
        out: list[Event] = []
        text = []
        for i in ids:
            i = operator.index(i)
            marker = self._id_markers.get(i)
            if marker is not None:
                # a marker token ends the text before it: unfinished UTF-8 and held prefixes as text
                text.append(self._utf8.decode(b"", final=True))
                self._utf8.reset()
                self._scan("".join(text), out, final=True)
                text = []
                out.append(marker)
            elif tok.is_special(i) and i in tok._skippable_ids:
                continue
            else:
                text.append(self._utf8.decode(tok.token_bytes(i)))
        if text:
            self._scan("".join(text), out, final=False)
        return out

    def feed_text(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._scan(text, out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._scan(tail, out, final=True)
        return out

    def _scan(self, text: str, out: list[Event], final: bool) -> None:
        buf = self._held + text
        self._held = ""
        if not buf:
            return
        if self._text_markers:
            pos = 0
            while True:
                hit = self._find(buf, pos)
                if hit is None:
                    break
                start, m = hit
                if start > pos:
                    out.append(buf[pos:start])
                out.append(Marker(m))
                pos = start + len(m)
            buf = buf[pos:]
            if not final:
                keep = self._held_tail(buf)
                self._held, buf = buf[len(buf) - keep:], buf[:len(buf) - keep]
        if buf:
            out.append(buf)

    def _find(self, buf: str, pos: int) -> Optional[tuple[int, str]]:
        best: Optional[tuple[int, str]] = None
        for m in self._text_markers:          # longest first: on a tie the longer marker wins
            i = buf.find(m, pos)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, m)
        return best

    def _held_tail(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a text marker."""
        for k in range(min(self._max_prefix, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0
