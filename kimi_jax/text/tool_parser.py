"""Kimi tool calls in model output -> OpenAI ``tool_calls``, whole or streamed.

``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{json}<|tool_call_end|>...<|tool_calls_section_end|>`` after the answer text becomes ``{"id":
"functions.NAME:IDX", "type": "function", "function": {"name", "arguments"}}`` (arguments as
written). The parser never raises: a bad id, text between calls, a call cut off before its arguments
and text after the section are content. `ChatOutputParser` chains the reasoning split and this
parser; its streamed deltas follow OpenAI's chunk shape and concatenate to the whole output's
`ParsedOutput`, whatever the chunking."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterable, Optional, Sequence

from kimi_jax.text.markers import Event, Marker, MarkerScanner
from kimi_jax.text.reasoning import THINK_BEGIN, THINK_END, ReasoningConfig, ReasoningStage

__all__ = [
    "SECTION_BEGIN", "SECTION_END", "CALL_BEGIN", "ARG_BEGIN", "CALL_END", "TOOL_MARKERS",
    "DeltaMessage", "ParsedOutput", "ChatOutputParser", "parse_output", "parse_tool_calls",
    "format_call_id", "parse_call_id", "tool_finish_reason",
]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

# [functions.]NAME:IDX; NAME as OpenAI allows it (letters, digits, _ and -) plus dots.
_CALL_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+):(\d+)")


def parse_call_id(call_id: str) -> Optional[str]:
    """The function name of a Kimi call id (``functions.NAME:IDX``), or None if it is not one."""
    m = _CALL_ID.fullmatch(call_id)
    return m.group(1) if m else None


def format_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


@dataclasses.dataclass
class DeltaMessage:
    """One streamed step: content / reasoning_content text and tool-call deltas (OpenAI shape)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def to_openai(self) -> dict:
        """The ``delta`` object of a chat.completion.chunk (only the fields this step carries)."""
        out: dict = {}
        if self.content:
            out["content"] = self.content
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


@dataclasses.dataclass
class ParsedOutput:
    content: str
    reasoning_content: str
    # OpenAI tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_calls: list

    def message(self) -> dict:
        """An OpenAI assistant ``message`` (content None when empty and there are tool calls)."""
        msg: dict = {
            "role": "assistant",
            "content": self.content if (self.content or not self.tool_calls) else None,
        }
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def calls_complete(tool_calls: Optional[list]) -> bool:
    """Some calls, each with arguments that are a complete JSON object (else not "tool_calls")."""
    def complete(call) -> bool:
        try:
            return isinstance(json.loads(call["function"]["arguments"]), dict)
        except (ValueError, TypeError, KeyError):
            return False
    return bool(tool_calls) and all(complete(c) for c in tool_calls)


def tool_finish_reason(finish_reason: Optional[str], has_tool_calls: bool) -> Optional[str]:
    """OpenAI's finish_reason: "tool_calls" when a finished ("stop") output made calls."""
    return "tool_calls" if has_tool_calls and finish_reason == "stop" else finish_reason


_CONTENT, _SECTION, _ID, _ARGS, _BAD = range(5)


class _ToolCallStage:
    """The state machine over answer events; returns (content text, tool-call deltas) per feed."""

    def __init__(self):
        self._state = _CONTENT
        self._buf = ""          # _SECTION: text between calls; _ID: the call id so far
        self._ws = ""           # _ARGS: trailing whitespace held back
        self._args_started = False
        self.n_calls = 0

    def feed(self, events: Iterable[Event]):
        content: list[str] = []
        calls: list[dict] = []
        for ev in events:
            self._event(ev, content, calls)
        return "".join(content), calls

    def finish(self):
        content: list[str] = []
        st = self._state
        if st == _SECTION and self._buf.strip():
            content.append(self._buf)
        elif st == _ID:
            content.append(CALL_BEGIN + self._buf)
        self._state, self._buf, self._ws = _CONTENT, "", ""
        return "".join(content), []

    def _event(self, ev: Event, content: list, calls: list) -> None:
        st = self._state
        is_marker = isinstance(ev, Marker)
        m = ev.text if is_marker else None
        if st == _CONTENT:
            if m == SECTION_BEGIN:
                self._state, self._buf = _SECTION, ""
            else:
                content.append(m if is_marker else ev)
        elif st == _SECTION:
            if not is_marker:
                self._buf += ev
                return
            if self._buf.strip():
                content.append(self._buf)
            self._buf = ""
            if m == CALL_BEGIN:
                self._state = _ID
            elif m == SECTION_END:
                self._state = _CONTENT
            else:
                content.append(m)
        elif st == _ID:
            if not is_marker:
                self._buf += ev
                return
            call_id = self._buf.strip()
            name = parse_call_id(call_id)
            self._buf = ""
            if m == ARG_BEGIN and name is not None:
                calls.append({"index": self.n_calls, "id": call_id, "type": "function",
                              "function": {"name": name, "arguments": ""}})
                self._state, self._ws, self._args_started = _ARGS, "", False
            elif m == ARG_BEGIN:
                content.append(CALL_BEGIN + call_id + ARG_BEGIN)
                self._state = _BAD
            else:
                content.append(CALL_BEGIN + call_id)
                self._state = _SECTION
                self._event(ev, content, calls)
        elif st == _ARGS:
            if is_marker and m != ARG_BEGIN:
                self.n_calls += 1
                self._state = _SECTION
                if m != CALL_END:                   # a call without its end marker: closed here
                    self._event(ev, content, calls)
                return
            self._args(m if is_marker else ev, calls)
        else:  # _BAD: a call that cannot be read; its text up to its end marker is content
            if m == CALL_BEGIN:
                self._state, self._buf = _ID, ""
            elif m == SECTION_END:
                self._state = _CONTENT
            else:
                content.append(m if is_marker else ev)
                if m == CALL_END:
                    self._state = _SECTION

    def _args(self, text: str, calls: list) -> None:
        if not self._args_started:
            text = text.lstrip()
            if not text:
                return
            self._args_started = True
        body = text.rstrip()
        if body:
            frag = self._ws + body
            self._ws = text[len(body):]
            calls.append({"index": self.n_calls, "function": {"arguments": frag}})
        else:
            self._ws += text


class ChatOutputParser:
    """Streaming parser of one output. ``feed_ids`` / ``feed_text`` -> `DeltaMessage`; ``finish()``
    ends the output (its delta holds any held-back tail); ``result()`` is the whole `ParsedOutput`.

    tokenizer: needed for ``feed_ids``. tools: when False (a request without tools) the tool-call
    markers are left in the content as text. reasoning: a `ReasoningConfig`, or None for a model
    that does not think.
    """

    def __init__(
        self, tokenizer=None, *, tools: bool = True, reasoning: Optional[ReasoningConfig] = None
    ):
        markers: list[str] = list(TOOL_MARKERS) if tools else []
        self._reasoning = ReasoningStage(reasoning) if reasoning is not None else None
        if self._reasoning is not None and reasoning.enabled and not reasoning.keep_inline:
            markers += [THINK_BEGIN, THINK_END]
        self._scanner = MarkerScanner(markers, tokenizer) if markers else None
        self._tools = _ToolCallStage() if tools else None
        self._tokenizer = tokenizer
        self._decoder = tokenizer.incremental_decoder(skip_special_tokens=True) if (
            tokenizer is not None and self._scanner is None) else None
        self._content: list[str] = []
        self._reasoning_text: list[str] = []
        self._calls: list[dict] = []
        self._finished = False

    def feed_ids(self, ids: Sequence[int]) -> DeltaMessage:
        if self._scanner is None:
            if self._decoder is None:
                raise ValueError("feed_ids needs a tokenizer")
            return self._deliver([self._decoder.feed_many(ids)], final=False)
        return self._deliver(self._scanner.feed_ids(ids), final=False)

    def feed_text(self, text: str) -> DeltaMessage:
        if self._scanner is None:
            return self._deliver([text], final=False)
        return self._deliver(self._scanner.feed_text(text), final=False)

    def finish(self) -> DeltaMessage:
        if self._finished:
            return DeltaMessage()
        self._finished = True
        if self._scanner is not None:
            events = self._scanner.finish()
        else:
            events = [self._decoder.flush()] if self._decoder is not None else []
        return self._deliver(events, final=True)

    def _deliver(self, events: list, final: bool) -> DeltaMessage:
        if self._finished and not final:
            raise ValueError("output already finished")
        reasoning = ""
        if self._reasoning is not None:
            reasoning, events = self._reasoning.feed(events)
            if final:
                r2, e2 = self._reasoning.finish()
                reasoning += r2
                events = events + e2
        if self._tools is not None:
            content, calls = self._tools.feed(events)
            if final:
                c2, _ = self._tools.finish()
                content += c2
        else:
            content = "".join(e.text if isinstance(e, Marker) else e for e in events)
            calls = []
        self._content.append(content)
        self._reasoning_text.append(reasoning)
        for c in calls:
            if "id" in c:
                self._calls.append({"id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}})
            else:
                self._calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        return DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    def result(self) -> ParsedOutput:
        """Everything so far as one output (call after `finish` for the final one)."""
        return ParsedOutput(
            content="".join(self._content),
            reasoning_content="".join(self._reasoning_text),
            tool_calls=[
                {"id": c["id"], "type": c["type"], "function": dict(c["function"])}
                for c in self._calls
            ],
        )


def parse_output(output, tokenizer=None, *, tools: bool = True,
                 reasoning: Optional[ReasoningConfig] = None) -> ParsedOutput:
    """`ParsedOutput` of a complete output: text, or token ids (with ``tokenizer``)."""
    p = ChatOutputParser(tokenizer, tools=tools, reasoning=reasoning)
    if isinstance(output, str):
        p.feed_text(output)
    else:
        p.feed_ids(list(output))
    p.finish()
    return p.result()


def parse_tool_calls(text: str) -> ParsedOutput:
    """Tool calls and content of an output given as text (no reasoning split)."""
    return parse_output(text, tools=True, reasoning=None)
