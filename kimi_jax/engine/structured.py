"""Constrained decoding through llguidance: a `StructuredOutputsParams` compiles to a grammar whose
per-request state (`RowMatcher`) the engine advances; each step the host fills a packed int32
bitmask [B, ceil(V/32)] (`token_mask`) and narrows a row near its token budget to a greedy close.
llguidance over xgrammar: BENCHMARKS.md "Structured outputs"."""
from __future__ import annotations

import collections
import threading
from typing import Any, Optional, Sequence

import numpy as np

from kimi_jax.engine.structured_params import (StructuredOutputError, StructuredOutputsParams,
                                               one_line)
from kimi_jax.engine.token_mask import mask_words

__all__ = ["StructuredBackend", "RowMatcher"]


class RowMatcher:
    """One request's grammar state: `accept` (False: the token broke the grammar), `is_finished`.
    It keeps its last greedy close (`closing_path`) while the row follows it: a row whose mask was
    narrowed to the close's next token walks the close once, not once a step."""

    def __init__(self, matcher, grammar: str):
        self._m = matcher
        self.grammar = grammar
        self._walk: Optional[_CloseWalk] = None
        self.close_backoff = self.close_wait = 0     # StructuredBackend.bitmask_closing's

    def accept(self, token: int) -> bool:
        walk, self._walk = self._walk, None
        ok = bool(self._m.consume_token(int(token)))
        if ok and walk is not None and walk.path and walk.path[0] == int(token):
            walk.path.pop(0)              # the rest of the close still closes from the new state
            if walk.end == "stop":
                walk.end_at -= 1
            self._walk = walk
        return ok

    def is_finished(self) -> bool:
        return bool(self._m.is_stopped())

    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return self._m.get_error()

    def closing_path(
        self, priority: Sequence[int], stop_ids, limit: int, first: Optional[int] = None
    ) -> Optional[list[int]]:
        """Tokens a greedy closer writes to a complete output (forced text, else `priority`'s first
        allowed, else the lowest id), None past `limit`; on a copy; `first`: taken before, not
        counted. Without `first` the walk is kept (and continued for a larger limit) until the
        row takes a token other than its next."""
        if first is not None:
            m = self._m.deep_copy()
            if not m.consume_token(int(first)):
                return None
            return _CloseWalk(m).run(priority, stop_ids, limit)
        if self._walk is None:
            self._walk = _CloseWalk(self._m.deep_copy())
        return self._walk.run(priority, stop_ids, limit)


class _CloseWalk:
    """A greedy close walked from one grammar state as far as it has been asked: its tokens, the
    matcher at its end, and how it ended (None: not yet; 'stop' or 'fail')."""

    def __init__(self, m):
        self.m, self.path, self.end = m, [], None
        self.end_at = 0             # 'stop': the least limit whose walk reaches the stop

    def run(self, priority: Sequence[int], stop_ids, limit: int) -> Optional[list[int]]:
        path, m = self.path, self.m
        while self.end is None and len(path) < limit:
            if m.is_stopped():
                self.end, self.end_at = "stop", len(path) + 1     # seen while len(path) < limit
                break
            forced = m.compute_ff_tokens()
            if forced:
                if not m.consume_tokens(forced):
                    self.end = "fail"
                    break
                path += forced
                continue
            # a priority token by itself (no mask of the whole vocabulary), else the lowest id
            pick = next((t for t in priority if m.validate_tokens([t]) == 1), None)
            if pick is None:
                pick = _lowest_set_bit(m.compute_bitmask())
                if pick is None:
                    self.end = "fail"
                    break
            path.append(pick)
            if pick in stop_ids:
                self.end, self.end_at = "stop", len(path)        # appended while len < limit
                break
            if not m.consume_token(pick):
                self.end = "fail"
                break
        if self.end == "stop" and self.end_at <= limit:
            return list(path)
        return None


# the most steps a row with no close within reach goes between two looks (bitmask_closing)
CLOSE_BACKOFF_MAX = 8


def _lowest_set_bit(mask: bytes) -> Optional[int]:
    """The lowest token id a little-endian packed bitmask allows (None: none)."""
    words = np.frombuffer(mask, np.uint8)
    nz = np.flatnonzero(words)
    if nz.size == 0:
        return None
    byte = int(words[nz[0]])
    return int(nz[0]) * 8 + ((byte & -byte).bit_length() - 1)


class StructuredBackend:
    """llguidance over one tokenizer and `vocab_size` logits, with the `cache_size` most recent
    compiled grammars; llguidance's tokenizer is built on first use."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        *,
        cache_size: int = 128,
        num_threads: Optional[int] = None,
    ):
        import llguidance as llg
        if tokenizer is None:
            raise StructuredOutputError(
                "structured outputs need the model's tokenizer; this model has none"
            )
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._llg = llg
        self._lltok_built = None
        self.words = mask_words(self.vocab_size)
        self._num_threads = num_threads
        self._executor_built = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def _tok_words(self) -> int:
        """Mask words of the tokenizer's ids (its vocabulary may exceed the model's logits)."""
        return mask_words(self.tokenizer.vocab_size)

    @property
    def _lltok(self):
        """The tokenizer as llguidance sees it, built on first use."""
        with self._lock:
            if self._lltok_built is None:
                from llguidance.tiktoken import lltokenizer_from_encoding
                self._lltok_built = lltokenizer_from_encoding(
                    self.tokenizer._enc, n_vocab=self.tokenizer.vocab_size,
                    eos_token=list(self.tokenizer.stop_token_ids))
            return self._lltok_built

    @property
    def _executor(self):
        if self._executor_built is None:
            self._executor_built = self._llg.LLExecutor(num_threads=self._num_threads)
        return self._executor_built

    @property
    def closing_priority(self) -> list[int]:
        """`RowMatcher.closing_path`'s token order: stops, closing markers, JSON-closing bytes, a
        space (JSON's separators; each token tried alone, a mask only where none is allowed)."""
        if getattr(self, "_priority", None) is None:
            tok = self.tokenizer
            ids = list(tok.stop_token_ids)
            ids += [
                tok.special_tokens[m]
                for m in ("<|tool_calls_section_end|>", "<|tool_call_end|>")
                if m in tok.special_tokens
            ]
            ids += [
                tok.mergeable_ranks[bytes([c])]
                for c in b'"}],:0[{tfn '
                if bytes([c]) in tok.mergeable_ranks
            ]
            self._priority = ids
        return self._priority

    #: slack a close keeps: one sampled token (an opening brace) can lengthen it
    close_margin: int = 16

    def bitmask_closing(self, mask_row: np.ndarray, row: RowMatcher, tokens_left: int) -> bool:
        """Narrow the row's mask to the greedy close's next token once the close needs all but
        `close_margin` of `tokens_left` (before that, forbid special tokens); True if it
        narrowed. A narrowed row follows its close, which is walked once (`RowMatcher`); a row
        with no close within reach (none in `2 * tokens_left + 16` tokens: its output ends by
        length whatever) is looked at again after 1, 2, 4, ... CLOSE_BACKOFF_MAX steps, not every
        step (a walk of that many tokens a step and row costs more than the step)."""
        if row.close_wait > 0:           # no close within reach lately: looked at less often
            row.close_wait -= 1
            return False
        stops = set(self.tokenizer.stop_token_ids)
        limit = 2 * tokens_left + 16
        path = row.closing_path(self.closing_priority, stops, limit)
        if path is None:
            row.close_backoff = min(2 * row.close_backoff or 1, CLOSE_BACKOFF_MAX)
            row.close_wait = row.close_backoff - 1
            return False
        row.close_backoff = 0
        if not path:
            return False
        if len(path) + self.close_margin >= tokens_left:
            t = path[0]
            if t >= self.words * 32:
                return False
            mask_row[:] = 0
            mask_row[t >> 5] = np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            return True
        narrowed = False
        base = self.tokenizer.num_base_tokens
        bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
        # each special token's close may search only as far as still fits, all of them together at
        # most `limit` tokens (the engine thread's work a step stays bounded; past it, forbid them)
        fits, budget = tokens_left - self.close_margin - 1, limit
        for t in np.flatnonzero(bits[base:]) + base:
            t = int(t)
            if t in stops or t >= self.vocab_size:
                continue
            reach = min(fits, budget)
            after = (
                row.closing_path(self.closing_priority, stops, reach, first=t)
                if reach > 0
                else None
            )
            budget -= reach if after is None else len(after)
            if after is None or 1 + len(after) + self.close_margin >= tokens_left:
                mask_row[t >> 5] &= np.int32(~np.uint32(1 << (t & 31)).view(np.int32))
                narrowed = True
        return narrowed

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of params, checked with this tokenizer (StructuredOutputError)."""
        grammar = params.to_grammar()
        self._start(grammar, params.kind())
        return grammar

    def _start(self, grammar: str, kind: str) -> Any:
        """The compiled start state (first mask computed: some errors show only then), cached."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        m = _on_big_stack(lambda: self._first_state(grammar))
        if m.is_error():
            raise StructuredOutputError(f"structured_outputs.{kind}: {one_line(m.get_error())}")
        hit = m
        with self._lock:
            self._cache[grammar] = hit
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return hit

    def _first_state(self, grammar: str) -> Any:
        m = self._llg.LLMatcher(self._lltok, grammar, log_level=0)
        if not m.is_error():
            m.compute_bitmask()
        return m

    def matcher(self, params: StructuredOutputsParams, budget: Optional[int] = None) -> RowMatcher:
        """A fresh grammar state; an output that `budget` cuts off ends with "length"."""
        grammar = params.to_grammar()
        return RowMatcher(self._start(grammar, params.kind()).deep_copy(), grammar)

    def fill_bitmask(self, rows: Sequence[Optional[RowMatcher]], batch: Optional[int] = None,
                     out: Optional[np.ndarray] = None) -> np.ndarray:
        """[batch, ceil(vocab_size / 32)] int32 for a step's rows (None or past len(rows): all
        ones), written into `out` when given (a buffer kept from step to step) and returned."""
        B = len(rows) if batch is None else batch
        if out is None:
            out = np.empty((B, self.words), np.int32)
        direct = self._tok_words == self.words and out.flags.c_contiguous
        mask = out if direct else np.empty((B, self._tok_words), np.int32)
        mask.fill(-1)
        pairs = [(r._m, b) for b, r in enumerate(rows) if r is not None]
        if pairs:
            self._executor.unsafe_compute_mask_ptr(pairs, mask.ctypes.data, self._tok_words * 4, B)
        if direct:
            return out
        w = min(self.words, self._tok_words)
        out[:, :w] = mask[:, :w]
        if self.words > w:             # tokens past the tokenizer's: never for a constrained row
            out[:, w:] = -1
            out[[b for _, b in pairs], w:] = 0
        return out


# llguidance builds 20,000 chained rules on it (8 MiB: SIGSEGV near 3,000)
COMPILE_STACK = 256 << 20
_STACK_LOCK = threading.Lock()


def _on_big_stack(fn):
    """fn() on a thread of its own with a COMPILE_STACK stack (reserved, used as it grows)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:      # re-raised on the caller's thread
            box["e"] = e
    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK)
        try:
            t = threading.Thread(target=run, name="kimi-jax-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]
