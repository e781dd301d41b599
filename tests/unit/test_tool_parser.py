"""Tool-call and reasoning parsing: a corpus of Kimi-format outputs with hand-written expectations, and
streaming at every cut point (of the token ids and of the text) reassembling to the whole-output parse."""
import json
import os

import pytest

from kimi_jax.text.markers import Marker, MarkerScanner
from kimi_jax.text.reasoning import ReasoningConfig, split_reasoning
from kimi_jax.text.tool_parser import (ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END,
                                       ChatOutputParser, parse_output, parse_tool_calls, tool_finish_reason)
from kimi_jax.text.tokenizer import Tokenizer

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "demo")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(DEMO)


def call(name, idx, args):
    return f"{CALL_BEGIN}functions.{name}:{idx}{ARG_BEGIN}{args}{CALL_END}"


def tc(name, idx, args):
    return {"id": f"functions.{name}:{idx}", "type": "function", "function": {"name": name, "arguments": args}}


NESTED = json.dumps({"q": {"filters": [{"k": "a", "v": [1, 2, {"x": None}]}], "flag": True}})
UNICODE = json.dumps({"city": "東京", "note": "naïve café ☕ \U0001F600"}, ensure_ascii=False)

# (name, output text, expected content, expected tool_calls)
CORPUS = [
    ("plain", "Hello there, no tools.", "Hello there, no tools.", []),
    ("one_call", SECTION_BEGIN + call("get_weather", 0, '{"city": "Paris"}') + SECTION_END,
     "", [tc("get_weather", 0, '{"city": "Paris"}')]),
    ("several", SECTION_BEGIN + call("a", 0, "{}") + call("b_c-d", 1, '{"n": 2}') + call("a", 2, "[]") + SECTION_END,
     "", [tc("a", 0, "{}"), tc("b_c-d", 1, '{"n": 2}'), tc("a", 2, "[]")]),
    ("text_before", "Let me check.\n" + SECTION_BEGIN + call("f", 0, '{"x": 1}') + SECTION_END,
     "Let me check.\n", [tc("f", 0, '{"x": 1}')]),
    ("nested", SECTION_BEGIN + call("search", 0, NESTED) + SECTION_END, "", [tc("search", 0, NESTED)]),
    ("unicode", "天気を調べます" + SECTION_BEGIN + call("w", 0, UNICODE) + SECTION_END,
     "天気を調べます", [tc("w", 0, UNICODE)]),
    ("whitespace", SECTION_BEGIN + " \n" + CALL_BEGIN + " functions.f:0 " + ARG_BEGIN + " \n{\"a\": \" b \"}  \n"
     + CALL_END + "\n" + SECTION_END, "", [tc("f", 0, '{"a": " b "}')]),
    ("truncated_args", "ok" + SECTION_BEGIN + call("f", 0, "{}") + CALL_BEGIN + "functions.g:1" + ARG_BEGIN + '{"a": [1, ',
     "ok", [tc("f", 0, "{}"), tc("g", 1, '{"a": [1,')]),
    ("truncated_id", SECTION_BEGIN + call("f", 0, "{}") + CALL_BEGIN + "functions.g:",
     CALL_BEGIN + "functions.g:", [tc("f", 0, "{}")]),
    ("truncated_section", "hi" + SECTION_BEGIN, "hi", []),
    ("garbage_between", SECTION_BEGIN + call("f", 0, "{}") + " junk " + call("g", 1, "{}") + SECTION_END,
     " junk ", [tc("f", 0, "{}"), tc("g", 1, "{}")]),
    ("bad_id", SECTION_BEGIN + CALL_BEGIN + "not an id" + ARG_BEGIN + "{}" + CALL_END + call("g", 1, "{}") + SECTION_END,
     CALL_BEGIN + "not an id" + ARG_BEGIN + "{}" + CALL_END, [tc("g", 1, "{}")]),
    ("stray_markers", "a" + ARG_BEGIN + "b" + CALL_END + SECTION_END + "c", "a" + ARG_BEGIN + "b" + CALL_END + SECTION_END + "c", []),
    ("marker_out_of_place", SECTION_BEGIN + ARG_BEGIN + call("f", 0, "{}") + SECTION_END, ARG_BEGIN, [tc("f", 0, "{}")]),
    ("missing_call_end", SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARG_BEGIN + "{}" + CALL_BEGIN + "functions.g:1"
     + ARG_BEGIN + "[]" + SECTION_END + "tail", "tail", [tc("f", 0, "{}"), tc("g", 1, "[]")]),
    ("text_after", SECTION_BEGIN + call("f", 0, "{}") + SECTION_END + " after", " after", [tc("f", 0, "{}")]),
    ("prefix_lookalike", "a <|tool_ not a marker <|tool_call", "a <|tool_ not a marker <|tool_call", []),
    ("no_prefix_name", SECTION_BEGIN + CALL_BEGIN + "lookup:3" + ARG_BEGIN + '{"k": 1}' + CALL_END + SECTION_END,
     "", [{"id": "lookup:3", "type": "function", "function": {"name": "lookup", "arguments": '{"k": 1}'}}]),
]


def reassemble(deltas):
    """What an OpenAI client builds from streamed deltas."""
    content, reasoning, calls = "", "", []
    for d in deltas:
        content += d.content
        reasoning += d.reasoning_content
        for c in d.tool_calls:
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function" and c["function"]["arguments"] == ""
                calls.append({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return content, reasoning, calls


def stream(pieces, feed, parser):
    return [getattr(parser, feed)(p) for p in pieces] + [parser.finish()]


@pytest.mark.parametrize("name,text,content,calls", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_text_and_ids(tok, name, text, content, calls):
    got = parse_tool_calls(text)
    assert (got.content, got.tool_calls) == (content, calls)
    ids = tok.encode(text, allow_special=True)
    got_ids = parse_output(ids, tok)
    assert (got_ids.content, got_ids.tool_calls) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CORPUS, ids=[c[0] for c in CORPUS])
def test_streaming_every_cut(tok, name, text, content, calls):
    ids = tok.encode(text, allow_special=True)
    whole = (content, "", calls)
    assert reassemble(stream([[i] for i in ids], "feed_ids", ChatOutputParser(tok))) == whole
    assert reassemble(stream(list(text), "feed_text", ChatOutputParser())) == whole
    for k in range(len(ids) + 1):
        assert reassemble(stream([ids[:k], ids[k:]], "feed_ids", ChatOutputParser(tok))) == whole, k
    for k in range(len(text) + 1):
        assert reassemble(stream([text[:k], text[k:]], "feed_text", ChatOutputParser())) == whole, k


def test_first_delta_of_a_call_carries_id_and_name(tok):
    text = SECTION_BEGIN + call("get_weather", 0, '{"city": "Paris"}') + SECTION_END
    p = ChatOutputParser(tok)
    deltas = [p.feed_ids([i]) for i in tok.encode(text, allow_special=True)]
    with_calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert with_calls[0] == [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                              "function": {"name": "get_weather", "arguments": ""}}]
    assert len(with_calls) > 2        # the arguments arrive in several fragments, token by token


def test_literal_marker_text_is_not_a_marker_when_markers_are_tokens(tok):
    text = SECTION_BEGIN + call("f", 0, "{}") + SECTION_END
    ids = tok.encode(text, allow_special=False)          # the markers spelled by ordinary tokens
    got = parse_output(ids, tok)
    assert got.tool_calls == [] and got.content == text


def test_tools_off_keeps_markers_as_content(tok):
    text = SECTION_BEGIN + call("f", 0, "{}") + SECTION_END
    assert parse_output(tok.encode(text, allow_special=True), tok, tools=False).content == text


def test_message_and_finish_reason():
    got = parse_tool_calls(SECTION_BEGIN + call("f", 0, "{}") + SECTION_END)
    assert got.message() == {"role": "assistant", "content": None, "tool_calls": [tc("f", 0, "{}")]}
    assert tool_finish_reason("stop", True) == "tool_calls"
    assert tool_finish_reason("length", True) == "length"
    assert tool_finish_reason("stop", False) == "stop"


REASONING = [
    # (text, config, reasoning, answer)
    ("<think>step 1\nstep 2</think>\n\nThe answer.", ReasoningConfig(), "step 1\nstep 2", "The answer."),
    ("  <think>r</think>a", ReasoningConfig(), "r", "a"),
    ("no thinking here <think>x</think>", ReasoningConfig(), "", "no thinking here <think>x</think>"),
    ("cut off <think>inside", ReasoningConfig(starts_in_reasoning=True), "cut off <think>inside", ""),
    ("r</think>a", ReasoningConfig(starts_in_reasoning=True), "r", "a"),
    ("<think>r</think>a", ReasoningConfig(keep_inline=True), "", "<think>r</think>a"),
    ("   ", ReasoningConfig(), "", "   "),
    ("<think>unfinished", ReasoningConfig(), "unfinished", ""),
]


@pytest.mark.parametrize("text,cfg,reasoning,answer", REASONING)
def test_reasoning_split(text, cfg, reasoning, answer):
    assert split_reasoning(text, cfg) == (reasoning, answer)
    for k in range(len(text) + 1):
        p = ChatOutputParser(tools=False, reasoning=cfg)
        assert reassemble(stream([text[:k], text[k:]], "feed_text", p))[:2] == (answer, reasoning), k


def test_reasoning_then_tool_calls_streamed(tok):
    text = "<think>I should call f. " + SECTION_BEGIN + "</think>Calling." + SECTION_BEGIN + call("f", 0, '{"a": "é"}') + SECTION_END
    cfg = ReasoningConfig()
    whole = parse_output(tok.encode(text, allow_special=True), tok, reasoning=cfg)
    # a section inside the reasoning is reasoning text, not a call
    assert whole.reasoning_content == "I should call f. " + SECTION_BEGIN
    assert (whole.content, whole.tool_calls) == ("Calling.", [tc("f", 0, '{"a": "é"}')])
    ids = tok.encode(text, allow_special=True)
    for k in range(len(ids) + 1):
        got = reassemble(stream([ids[:k], ids[k:]], "feed_ids", ChatOutputParser(tok, reasoning=cfg)))
        assert got == (whole.content, whole.reasoning_content, whole.tool_calls), k


def test_scanner_holds_utf8_and_marker_prefixes(tok):
    s = MarkerScanner(["<think>"], tok)
    ids = tok.encode("é<thi", allow_special=True)
    events = []
    for i in ids:
        events += s.feed_ids([i])
    assert "".join(events) == "é"           # "<thi" may still become <think>
    assert s.feed_text("nk>x") == [Marker("<think>"), "x"]
    assert s.finish() == []
