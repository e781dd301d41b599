"""Structured outputs: the on-device bitmask against numpy references, OpenAI fields into constraints,
and outputs valid by construction when tokens are drawn at random under the masks (jsonschema and the
tool-call parser judge them)."""
import json
import os

import jax
import jsonschema
import numpy as np
import pytest

from kimi_jax.engine.structured import StructuredBackend
from kimi_jax.engine.structured_openai import from_openai
from kimi_jax.engine.structured_params import StructuredOutputError, StructuredOutputsParams
from kimi_jax.engine.token_mask import (apply_token_bitmask, apply_token_bitmask_reference,
                                        mask_words)
from kimi_jax.text.tokenizer import Tokenizer
from kimi_jax.text.tool_parser import parse_output

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "demo")
V_DEMO = 4096       # the demo model's logits (its tokenizer has 4098 ids)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def backend(tok):
    return StructuredBackend(tok, V_DEMO)


@pytest.mark.parametrize("B,V", [(3, 100), (2, 4096), (1, 31)])
def test_apply_token_bitmask_matches_references(B, V):
    rng = np.random.default_rng(B * 1000 + V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (B, mask_words(V)), dtype=np.int64).astype(np.int32)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    ref = apply_token_bitmask_reference(logits, mask)
    np.testing.assert_array_equal(got, ref)          # a select: exact
    import llguidance.numpy as lnp                   # llguidance's own numpy kernel
    theirs = logits.copy()
    lnp.apply_token_bitmask_inplace(theirs, mask)
    np.testing.assert_array_equal(got, theirs)
    free = np.full_like(mask, -1)                    # an unconstrained row: logits unchanged
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_token_bitmask)(logits, free)), logits)


def test_params_need_exactly_one_kind():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams().validate()
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"]).validate()
    with pytest.raises(StructuredOutputError, match="choice"):
        StructuredOutputsParams(choice="ab").validate()


def test_bad_grammar_is_a_clear_error(backend):
    with pytest.raises(StructuredOutputError, match=r"structured_outputs\.grammar"):
        backend.compile(StructuredOutputsParams(grammar="start: undefined_rule"))
    with pytest.raises(StructuredOutputError, match=r"structured_outputs\.json"):
        backend.compile(StructuredOutputsParams(json="{not json"))


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


def test_from_openai_fields():
    assert from_openai() is None
    assert from_openai({"type": "text"}) is None
    assert from_openai({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert from_openai({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}).json == {"type": "array"}
    assert "call+" in from_openai(tools=TOOLS, tool_choice="required").grammar
    named = from_openai(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}).grammar
    assert '"functions.add:"' in named and "get_weather" not in named
    assert "TEXT?" in from_openai(tools=TOOLS).grammar          # auto: text or a section
    with pytest.raises(StructuredOutputError, match="not among the tools"):
        from_openai(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(StructuredOutputError, match="no tools"):
        from_openai(tool_choice="required")
    with pytest.raises(StructuredOutputError, match="response_format.type"):
        from_openai({"type": "xml"})
    with pytest.raises(StructuredOutputError, match=r"tools\[0\]\.function\.name"):
        from_openai(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required")


def draw(backend, params, rng, max_tokens=300):
    """Tokens drawn uniformly at random among those each step's mask allows (a model that follows no
    instruction at all); stops at a stop token."""
    m = backend.matcher(params)
    out = []
    stops = set(backend.tokenizer.stop_token_ids)
    for _ in range(max_tokens):
        mask = backend.fill_bitmask([m])
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V_DEMO]
        allowed = np.flatnonzero(bits)
        # where the grammar may end, end half the time (else outputs of unbounded parts rarely stop)
        t = int(rng.choice(allowed))
        if stops & set(allowed.tolist()) and rng.random() < 0.5:
            t = int(min(stops & set(allowed.tolist())))
        if t in stops:
            return out, True
        assert m.accept(t), m.error()
        out.append(t)
    return out, False


BOUNDED_SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.parametrize("si", range(len(BOUNDED_SCHEMAS)))
def test_random_draws_under_json_schema_validate(backend, tok, si):
    schema = BOUNDED_SCHEMAS[si]
    rng = np.random.default_rng(si)
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    done = 0
    for _ in range(4):
        ids, stopped = draw(backend, params, rng)
        if not stopped:
            continue         # ran out of tokens inside an unbounded part (e.g. "additionalProperties")
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
        done += 1
    assert done >= 3


def test_random_draws_under_tool_choice_required_parse_and_validate(backend, tok):
    rng = np.random.default_rng(7)
    params = from_openai(tools=TOOLS, tool_choice="required")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ok = 0
    for _ in range(4):
        ids, stopped = draw(backend, params, rng)
        assert stopped
        parsed = parse_output(ids, tok)
        assert parsed.tool_calls and parsed.content == ""
        for c in parsed.tool_calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
        ok += 1
    assert ok == 4


def test_tool_choice_none_forbids_the_section(backend, tok):
    m = backend.matcher(from_openai(tools=TOOLS, tool_choice="none"))
    mask = backend.fill_bitmask([m, None])
    sb = tok.special_tokens["<|tool_calls_section_begin|>"]
    bit = lambda row, t: (int(mask[row, t // 32]) >> (t % 32)) & 1
    assert bit(0, sb) == 0 and bit(1, sb) == 1          # row 1 is unconstrained
    assert bit(0, tok.encode("Hello")[0]) == 1


UNBOUNDED = {"type": "object", "properties": {"note": {"type": "string"}, "x": {"type": "number"},
                                              "tags": {"type": "array", "items": {"type": "string"}}},
             "required": ["note", "x", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("budget", [48, 64])
def test_budget_close_ends_unbounded_outputs_complete(backend, tok, budget):
    """Uniform draws never close an unbounded string on their own (about 1 in 4000 per step); with the
    close narrowing the mask near the end of the budget every output ends complete within it."""
    rng = np.random.default_rng(budget)
    stops = set(tok.stop_token_ids)
    for _ in range(3):
        m = backend.matcher(StructuredOutputsParams(json=UNBOUNDED))
        out = []
        for k in range(budget):
            mask = backend.fill_bitmask([m])
            backend.bitmask_closing(mask[0], m, budget - k)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V_DEMO])
            t = int(rng.choice(allowed))
            if t in stops:
                break
            assert m.accept(t)
            out.append(t)
            if m.is_finished():
                break
        else:
            pytest.fail(f"no end within {budget} tokens: {tok.decode(out)!r}")
        jsonschema.validate(json.loads(tok.decode(out)), UNBOUNDED)


def test_a_row_that_follows_its_close_walks_it_once(backend, tok, monkeypatch):
    """A row narrowed to its greedy close from the first step on (a budget the close needs all but
    `close_margin` of) follows it to a complete output with one walk of the close, not a walk a
    step (each walk's token a grammar step, some a mask of the whole vocabulary)."""
    from kimi_jax.engine import structured as S
    walks = []
    original = S._CloseWalk.__init__

    def counted(self, m):
        walks.append(1)
        original(self, m)
    monkeypatch.setattr(S._CloseWalk, "__init__", counted)
    m = backend.matcher(StructuredOutputsParams(json=UNBOUNDED))
    budget, out = 40, []        # the close from the start: 34 tokens and the stop
    for k in range(budget):
        mask = backend.fill_bitmask([m])
        narrowed = backend.bitmask_closing(mask[0], m, budget - k)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V_DEMO])
        if set(allowed.tolist()) <= set(tok.stop_token_ids):      # complete: only a stop is left
            break
        assert narrowed and allowed.size == 1 and m.accept(int(allowed[0])), k
        out.append(int(allowed[0]))
    jsonschema.validate(json.loads(tok.decode(out)), UNBOUNDED)
    assert len(walks) == 1 and len(out) < budget


def test_a_row_with_no_close_within_reach_is_looked_at_less_often(backend, tok, monkeypatch):
    """An output whose shortest close is longer than the search reaches (an array of 200 items with
    40 tokens left) ends by length whatever the mask: its close is walked after 1, 2, 4, 8, 8, ...
    steps, not every step, and the mask is never narrowed."""
    from kimi_jax.engine import structured as S
    looks = []
    original = S.RowMatcher.closing_path

    def counted(self, priority, stop_ids, limit, first=None):
        looks.append(limit)
        return original(self, priority, stop_ids, limit, first)
    monkeypatch.setattr(S.RowMatcher, "closing_path", counted)
    long = {"type": "array", "items": {"type": "string"}, "minItems": 200}
    m = backend.matcher(StructuredOutputsParams(json=long))
    for k in range(40):
        mask = backend.fill_bitmask([m])
        assert not backend.bitmask_closing(mask[0], m, 40 - k)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V_DEMO])
        assert m.accept(int(allowed[0]))
    assert len(looks) == 8, looks          # steps 0, 1, 3, 7, 15, 23, 31, 39


def test_chat_body_with_tools_carries_the_constraint(tok):
    # the OpenAI chat body (server and kimi-batch parse it with kimi_jax.entrypoints.openai.protocol)
    from kimi_jax.entrypoints.openai import protocol as P
    from kimi_jax.text.tool_parser import parse_output, tool_finish_reason
    req = P.parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"})
    assert req.tools == TOOLS and "call+" in req.params.structured_outputs.grammar
    fmt = P.parse_chat({"messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": TOOLS[0]["function"]["parameters"]}}})
    assert fmt.tools is None and fmt.params.structured_outputs.json is not None
    assert P.parse_chat({"messages": [{"role": "user", "content": "hi"}]}).params.structured_outputs is None
    out = "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>" \
          '{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>'
    parsed = parse_output(tok.encode(out, allow_special=True), tok)
    assert tool_finish_reason("stop", bool(parsed.tool_calls)) == "tool_calls" and parsed.message()["content"] is None
    assert parsed.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    for body, field in [({"tools": TOOLS, "tool_choice": "some"}, "tool_choice"),
                        ({"response_format": {"type": "yaml"}}, "response_format")]:
        with pytest.raises(P.ProtocolError, match=field) as e:
            P.parse_chat({"messages": [{"role": "user", "content": "x"}], **body})
        assert e.value.param == field


def test_logits_past_the_tokenizer_are_masked_in_constrained_rows_only(tok):
    # a model vocabulary 96 logits larger than the tokenizer's ids (4098): those ids decode to nothing
    V = tok.vocab_size + 96
    wide = StructuredBackend(tok, V)
    m = wide.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    mask = wide.fill_bitmask([None, m])
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    assert mask.shape == (2, mask_words(V)) and bits[0].all()
    assert not bits[1, tok.vocab_size:].any() and bits[1, :tok.vocab_size].any()


LOOSE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                          "c": {"type": "string", "maxLength": 4}}, "required": ["a"]}


def _closed_draws(backend, tok, params, n, seed, budget=40):
    """n outputs drawn uniformly among the allowed tokens, the budget close ending each."""
    rng = np.random.default_rng(seed)
    stops = set(tok.stop_token_ids)
    outs = []
    for _ in range(n):
        m, out = backend.matcher(params), []
        for k in range(budget):
            mask = backend.fill_bitmask([m])
            backend.bitmask_closing(mask[0], m, budget - k)
            t = int(rng.choice(np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:V_DEMO])))
            if t in stops:
                break
            assert m.accept(t)
            out.append(t)
        outs.append(json.loads(tok.decode(out)))
    return outs


def test_schema_without_additional_properties_is_closed(backend, tok):
    """50 uniform draws (a model that follows no instruction) under a schema that declares properties
    and says nothing of additionalProperties: only declared keys, finite numbers; the opt-out
    (disable_additional_properties=False) lets the same draws write other keys."""
    closed = _closed_draws(backend, tok, StructuredOutputsParams(json=LOOSE), 50, 0)
    for obj in closed:
        jsonschema.validate(obj, LOOSE)
        assert set(obj) <= {"a", "b", "c"} and all(np.isfinite(float(v)) for k, v in obj.items() if k != "c"), obj
    open_ = _closed_draws(backend, tok, StructuredOutputsParams(json=LOOSE, disable_additional_properties=False), 10, 0)
    assert any(set(obj) - {"a", "b", "c"} for obj in open_)


def test_prepare_schema_closes_bounds_and_checks():
    from kimi_jax.engine.structured_params import INTEGER_BOUNDS, NUMBER_BOUND, prepare_schema
    s = prepare_schema({"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "number"}}},
                                                         "z": {"type": ["integer", "null"]}},
                        "allOf": [{"properties": {"w": {}}}], "$defs": {"d": {"properties": {}}}}, "s")
    assert s["additionalProperties"] is False and s["properties"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in s["allOf"][0] and s["$defs"]["d"]["additionalProperties"] is False
    assert (s["properties"]["x"]["properties"]["y"]["minimum"], s["properties"]["x"]["properties"]["y"]["maximum"]) \
        == (-NUMBER_BOUND, NUMBER_BOUND)
    assert (s["properties"]["z"]["minimum"], s["properties"]["z"]["maximum"]) == INTEGER_BOUNDS
    kept = prepare_schema({"properties": {}, "additionalProperties": True, "minimum": 0}, "s")
    assert kept["additionalProperties"] is True and prepare_schema({"properties": {}}, "s", close=False) == {"properties": {}}
    with pytest.raises(StructuredOutputError, match=r"s\.properties\.a\.x-guidance must be an object"):
        prepare_schema({"properties": {"a": {"x-guidance": "no"}}}, "s")


def test_structural_tag_constrains_the_tagged_part(backend, tok):
    tag = {"type": "structural_tag", "triggers": ["<fn="],
           "structures": [{"begin": "<fn=add>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                           "required": ["a"]}, "end": "</fn>"}]}

    def accepts(text):
        m = backend.matcher(StructuredOutputsParams(structural_tag=json.dumps(tag)))
        return all(m.accept(t) for t in tok.encode(text))
    assert accepts('Sure. <fn=add>{"a": 1}</fn> done')
    assert not accepts('Sure. <fn=add>{"b": 1}')
    with pytest.raises(StructuredOutputError, match="triggers"):
        backend.compile(StructuredOutputsParams(structural_tag={**tag, "triggers": ["<x"]}))


def test_grammar_compiles_on_a_stack_deep_enough_past_the_limits(backend, monkeypatch):
    """5,000 chained rules crash llguidance on an 8 MiB stack (SIGSEGV); with the limits lifted they
    still compile, on the compile thread's own stack; with them, a 400-style error names the limit."""
    from kimi_jax.engine import structured_params as S
    rules = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(5000)) + '\nr5000: "b"'
    with pytest.raises(StructuredOutputError, match="bytes"):
        backend.compile(StructuredOutputsParams(grammar=rules))
    monkeypatch.setattr(S, "MAX_CONSTRAINT_BYTES", 10 ** 7)
    monkeypatch.setattr(S, "MAX_GRAMMAR_RULES", 10 ** 5)
    m = backend.matcher(StructuredOutputsParams(grammar=rules))
    assert all(m.accept(backend.tokenizer.encode("a")[0]) for _ in range(5))


def test_budget_close_searches_a_bounded_number_of_tokens_a_step(backend, tok, monkeypatch):
    """Near the end of the budget the close checks each allowed special token (a section marker) with
    a search of its own: together they follow at most as many tokens as the row's own close may, so
    the engine thread's work a step is bounded; a section that still fits stays allowed."""
    from kimi_jax.engine import structured as S
    searched = []
    original = S.RowMatcher.closing_path

    def counted(self, priority, stop_ids, limit, first=None):
        path = original(self, priority, stop_ids, limit, first)
        searched.append(limit if path is None else len(path))       # the tokens it followed
        return path

    monkeypatch.setattr(S.RowMatcher, "closing_path", counted)
    reserved = [k for k in tok.special_tokens if k.startswith("<|reserved_token_")][:8]
    long_close = f'start: "a" | ({" | ".join(reserved)}) "{"ab" * 150}"'   # each special: a long close
    many = backend.matcher(StructuredOutputsParams(grammar=long_close))
    sb = tok.special_tokens["<|tool_calls_section_begin|>"]
    auto = backend.matcher(from_openai(tools=TOOLS))           # auto: text or a section
    for left in (90, 40, 20):
        for m in (many, auto):
            searched.clear()
            mask = backend.fill_bitmask([m])
            backend.bitmask_closing(mask[0], m, left)
            assert sum(searched) <= 2 * (2 * left + 16), (left, searched)
        allowed = (int(mask[0, sb // 32]) >> (sb % 32)) & 1
        assert allowed == (left == 90), left       # a whole call needs ~20 tokens + the 16 kept
