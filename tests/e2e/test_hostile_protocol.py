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
    srv = OpenAIServer(llm.frontend, served_model_name=NAME)
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


SELF = {"$ref": "#"}


def test_unsatisfiable_constraints_are_refused_not_reported_as_success(client):
    """A constraint no output matches is a 400 naming its field; one the model can match but does not
    complete within max_tokens (a required recursion, a long regex) ends with "length", never "stop"."""
    loop = {"type": "function", "function": {"name": "loop", "parameters": SELF}}
    chat = lambda **kw: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=24, **kw)
    _refused(lambda: chat(tools=[loop], tool_choice="required"), "tools", "$ref")
    _refused(lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SELF}}),
             "response_format", "$ref")
    _refused(lambda: chat(extra_body={"guided_json": SELF}), "guided_json", "$ref")
    text = lambda regex, n: client.completions.create(model=NAME, prompt="x", max_tokens=n,
                                                      extra_body={"guided_regex": regex}).choices[0]
    _refused(lambda: text("a{2000000}", 20), "guided_regex", "{2000000}", "10000")
    c = text("a{200}", 20)
    assert c.finish_reason == "length" and set(c.text) == {"a"} and len(c.text) < 200, c
    rec = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}
    r = chat(tools=[rec], tool_choice="required").choices[0]
    assert r.finish_reason == "length", r
    r = chat(extra_body={"guided_json": RECURSIVE}).choices[0]
    assert r.finish_reason == "length" and r.message.content.startswith("{"), r
    c = text("a{20}", 40)                                   # what fits is served, and valid
    assert c.text == "a" * 20 and c.finish_reason == "stop"


SATISFIABLE = [r"\w+@\w+\.com", r"\d+\.\d+", r"https?://[a-z]+\.com", "a*b", ".*end", "(yes|no)+ ok"]


def test_satisfiable_constraints_are_served(client):
    """Patterns whose shortest match a greedy closer misses are served: an output that ends with "stop"
    matches in full, one cut off is a "length"."""
    import re
    for i, regex in enumerate(SATISFIABLE):
        c = client.completions.create(model=NAME, prompt="x", max_tokens=24, seed=i, temperature=1.0,
                                      extra_body={"guided_regex": regex}).choices[0]
        assert c.finish_reason in ("stop", "length"), (regex, c)
        assert c.finish_reason == "length" or re.fullmatch(regex, c.text), (regex, c)
    options = [f"option-{i}" for i in range(2000)]
    c = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=16, seed=0,
                                       extra_body={"guided_choice": options}).choices[0]
    assert c.finish_reason == "stop" and c.message.content in options, c
    c = client.completions.create(model=NAME, prompt="x", max_tokens=24, seed=0,
                                  extra_body={"guided_grammar": "start: /[a-z]*z/"}).choices[0]
    assert c.finish_reason == "length" or re.fullmatch("[a-z]*z", c.text), c


def _chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "integer"}}}


def test_constraints_past_the_compiler_limits_are_400_and_the_server_serves(server, client):
    """Inputs that crash llguidance (a 3,000-deep $ref chain, 5,000 chained rules) or take it seconds
    (x{100000}, a 1 MB choice) are refused by size before it sees them; /health and a plain request
    are served at once after."""
    from kimi_jax.engine import structured_params as S
    text = lambda **kw: client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=kw)
    rules = lambda n: "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b"'
    _refused(lambda: text(guided_json=_chain(3000)), "guided_json", str(S.MAX_CONSTRAINT_BYTES))
    _refused(lambda: text(guided_json=_chain(100)), "guided_json", f"more than {S.MAX_SCHEMA_DEPTH} deep")
    _refused(lambda: text(guided_grammar=rules(5000)), "guided_grammar", str(S.MAX_CONSTRAINT_BYTES))
    _refused(lambda: text(guided_grammar=rules(600)), "guided_grammar", f"more than {S.MAX_GRAMMAR_RULES}")
    _refused(lambda: text(guided_regex="x{100000}"), "guided_regex", str(S.MAX_REPEAT))
    _refused(lambda: text(guided_choice=["x" * 1000] * 1000), "guided_choice", str(S.MAX_CONSTRAINT_BYTES))
    assert text(guided_json=_chain(40)).choices[0].finish_reason in ("stop", "length")
    with urllib.request.urlopen(server[1] + "/health", timeout=5) as r:
        assert r.status == 200
    assert text().choices[0].finish_reason in ("stop", "length")


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


def test_plain_request_is_served_while_hostile_constraints_are_refused(client):
    """Four x{100000} regexes and a 1 MB choice at once: each is refused by size without compiling
    (seconds each in llguidance), and a plain request beside them is not held up."""
    import concurrent.futures
    import time
    hostile = [{"guided_regex": "x{100000}"}] * 4 + [{"guided_choice": ["y" * 1000] * 1000}]
    post = lambda body: client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body=body)
    with concurrent.futures.ThreadPoolExecutor(len(hostile)) as pool:
        t0 = time.monotonic()
        refused = [pool.submit(post, b) for b in hostile]
        assert post({}).choices[0].finish_reason in ("stop", "length")
        plain_s = time.monotonic() - t0
        for f in refused:
            with pytest.raises(openai.BadRequestError) as e:
                f.result()
            assert e.value.body["param"] in ("guided_regex", "guided_choice"), e.value.body
    assert plain_s < 10, plain_s
