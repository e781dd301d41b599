"""Hostile requests at the protocol level, through the `openai` client against an in-thread server
(the demo model): each is a 400 whose `param` and message name the field at fault (never a 500, never
a success that is not valid), and the server keeps serving."""
import json
import urllib.request

import pytest

from tests.e2e.serving import serving

openai = pytest.importorskip("openai")

NAME = "demo"
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
RECURSIVE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}
MSGS = [{"role": "user", "content": "Add 1 and 2."}]


@pytest.fixture(scope="module")
def server():
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    llm = LLM(None, dtype="float32", max_num_seqs=4, max_model_len=512)
    srv = OpenAIServer(llm, served_model_name=NAME)
    with serving(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)


def _refused(call, param, *words):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param, body
    assert param.split(".")[0].split("[")[0] in body["message"] and all(w in body["message"] for w in words), body
    assert "\n" not in body["message"]
    return body


def test_malformed_tool_choice_and_x_guidance_are_400(client):
    chat = lambda **kw: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, **kw)
    for tc in ({"type": "function", "function": "add"}, {"type": "function"}, {"type": "function", "function": []}, 7):
        _refused(lambda: chat(tools=[ADD], tool_choice=tc), "tool_choice")
    bad = {**ADD, "function": {**ADD["function"], "parameters": {**ADD["function"]["parameters"], "x-guidance": "x"}}}
    _refused(lambda: chat(tools=[bad], tool_choice="required"), "tools", "x-guidance")
    schema = {"type": "object", "x-guidance": [1]}
    _refused(lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
             "response_format", "x-guidance")


def test_params_name_the_field(client):
    text = lambda **kw: client.completions.create(model=NAME, prompt="hi", max_tokens=4, **kw)
    _refused(lambda: text(logit_bias={"999999": 5}), "logit_bias", "vocabulary")
    _refused(lambda: text(extra_body={"stop_token_ids": [10 ** 7]}), "stop_token_ids", "vocabulary")
    _refused(lambda: text(extra_body={"stop_token_ids": ["a"]}), "stop_token_ids[0]")
    _refused(lambda: text(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage")
    chat = lambda **kw: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=4, **kw)
    _refused(lambda: chat(response_format={"type": "xml"}), "response_format")
    _refused(lambda: chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format")
    _refused(lambda: chat(logprobs=True, top_logprobs=99), "top_logprobs")


def test_ambiguity_is_refused(client):
    chat = lambda **kw: client.chat.completions.create(model=NAME, max_tokens=4, **kw)
    _refused(lambda: chat(messages=MSGS, tools=[ADD, ADD]), "tools", "'add'")
    _refused(lambda: chat(messages=MSGS, tools=[ADD, ADD], tool_choice="none"), "tools", "'add'")
    convo = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "3"}]
    _refused(lambda: chat(messages=convo, tools=[ADD]), "messages", "messages[2]", "tool_call_id")


def test_unsatisfiable_constraints_are_refused_not_reported_as_success(client):
    rec = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}
    chat = lambda **kw: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=64, **kw)
    _refused(lambda: chat(tools=[rec], tool_choice="required"), "tools", "cannot be satisfied")
    _refused(lambda: chat(tools=[rec], tool_choice={"type": "function", "function": {"name": "loop"}}), "tools")
    _refused(lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}),
             "response_format", "cannot be satisfied")
    _refused(lambda: chat(extra_body={"guided_json": RECURSIVE}), "guided_json", "cannot be satisfied")
    # satisfiable, but not within max_tokens
    _refused(lambda: client.completions.create(model=NAME, prompt="x", max_tokens=20,
                                               extra_body={"guided_regex": "a{200}"}), "guided_regex", "max_tokens")
    # what fits is served, and valid
    r = client.completions.create(model=NAME, prompt="x", max_tokens=40, extra_body={"guided_regex": "a{20}"})
    assert r.choices[0].text == "a" * 20 and r.choices[0].finish_reason == "stop"


def test_non_finite_values_are_400(server):
    _, url = server
    for raw, param in [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                       (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
                       (b'{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
                       (b'{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias"),
                       (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens")]:
        req = urllib.request.Request(url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == param and param in err["message"], (raw, err)


def test_values_past_float32_are_400(client):
    """Finite in float64 but inf in float32, the dtype the device samples in: refused by name, over
    HTTP and by SamplingParams."""
    from kimi_jax import SamplingParams
    text = lambda **kw: client.completions.create(model=NAME, prompt="x", max_tokens=2, **kw)
    for field, v in [("temperature", 1e39), ("temperature", 3.5e38), ("repetition_penalty", 1e39)]:
        kw = {field: v} if field == "temperature" else {"extra_body": {field: v}}
        _refused(lambda: text(**kw), field, "float32")
        with pytest.raises(ValueError, match=f"{field} must be within float32"):
            SamplingParams(**{field: v})
    SamplingParams(temperature=3.4e38)                   # the largest float32s are still finite
    assert text(temperature=0.0).choices[0].finish_reason in ("stop", "length")


def test_incomplete_tool_arguments_are_not_tool_calls(server):
    """A finished output whose call's arguments are not a complete JSON object (generation ended
    inside them) is not reported with finish_reason "tool_calls"."""
    from kimi_jax.entrypoints.openai import protocol as P
    tok = server[0].tokenizer
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
    for args, want in [('{"a": ', "stop"), ("", "stop"), ('{"a": 1}', "tool_calls")]:
        text = head + args + ("<|tool_call_end|><|tool_calls_section_end|>" if want == "tool_calls" else "")
        c = P.with_tool_calls(P.Choice(0, "", tok.encode(text, allow_special=True), "stop"), tok)
        assert c.finish_reason == want, (args, c)


def test_server_still_serves(client):
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
