"""Structured outputs through the engine on the demo model (which follows no instruction): json_schema
outputs validate with jsonschema, tool_choice "required" / named responses carry calls whose arguments
validate (strings unbounded: the budget close ends them within max_tokens), LLM.chat returns parsed
tool_calls. A free row shares the constrained batch."""
import json

import jsonschema
import pytest

from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_openai import from_openai
from kimi_jax.engine.structured_params import StructuredOutputsParams
from kimi_jax.entrypoints.llm import LLM, demo_model_path
from kimi_jax.text.tool_parser import parse_output

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["cat", "dog", "bird"]},
    "info": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "tags": {"type": "array", "items": {"type": "string"},
                                                       "maxItems": 3}},
             "required": ["n", "tags"], "additionalProperties": False}},
    "required": ["label", "info"], "additionalProperties": False}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": False}}}]
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def llm():
    # few compiled programs: every prompt is one prefill chunk, and pages of 64 tokens put every
    # request's pages in one page-table bucket (8 pages); no prefix caching, so LLM.chat's prompts
    # (those of `mixed`) run the same prefill program instead of one over cached pages
    return LLM(demo_model_path(), dtype="float32", max_num_seqs=4, max_model_len=512, block_size=64, prefill_chunk=512,
               enable_prefix_caching=False)


@pytest.fixture(scope="module")
def mixed(llm):
    """One batch: a free row, json_schema rows and tool rows ("required" and named), all sampled."""
    tool_prompt = llm.encode_chat([{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS)
    required = from_openai(tools=TOOLS, tool_choice="required")
    named = from_openai(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    # one row of each kind (4 rows: one batch bucket); the 50-sample acceptance run is launch.tool_eval's
    # (BENCHMARKS.md "Structured outputs")
    rows = [("free", "The function returns", None), ("json", "Describe an animal.", StructuredOutputsParams(json=SCHEMA)),
            ("required", tool_prompt, required), ("named", tool_prompt, named)]
    sps = [SamplingParams(temperature=1.0, max_tokens=96, seed=i, structured_outputs=c) for i, (_, _, c) in enumerate(rows)]
    outs = llm.generate([p for _, p, _ in rows], sps)
    return [(kind, o.outputs[0]) for (kind, _, _), o in zip(rows, outs)]


def test_json_schema_outputs_validate(mixed):
    for kind, c in mixed:
        if kind == "json":
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_forced_tool_calls_validate(llm, mixed):
    for kind, c in mixed:
        if kind not in ("required", "named"):
            continue
        parsed = parse_output(c.token_ids, llm.tokenizer)
        assert c.finish_reason == "stop" and parsed.tool_calls, c.text
        for call in parsed.tool_calls:
            assert kind == "required" or call["function"]["name"] == "add"
            jsonschema.validate(json.loads(call["function"]["arguments"]), ARGS[call["function"]["name"]])


def test_chat_with_tools_returns_parsed_calls(llm):
    # 4 conversations: the batch shape of `mixed`, so its compiled programs serve
    sps = [SamplingParams(temperature=1.0, max_tokens=96, seed=100 + i) for i in range(4)]
    outs = llm.chat([[{"role": "user", "content": "Weather in Oslo?"}]] * 4, sps, tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "add"}})
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "tool_calls" and c.content == "" and len(c.tool_calls) == 1, c.text
        assert c.tool_calls[0]["function"]["name"] == "add"
        jsonschema.validate(json.loads(c.tool_calls[0]["function"]["arguments"]), ARGS["add"])


def test_bad_constraint_is_a_clear_error(llm):
    with pytest.raises(ValueError, match=r"request 1: .*structured_outputs\.grammar"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(grammar="start: nope"))])
