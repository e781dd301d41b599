"""What a vLLM user types, through the official `openai` client against one in-thread server (the
demo model, float32): vLLM's structured_outputs and guided_* fields on both endpoints (outputs judged
by jsonschema, re.fullmatch and membership), extra fields accepted with one warning, schemas without
additionalProperties yielding declared keys only, /v1/models/{id}, /version, the API-key rule, the
access log, the Python API's vLLM names and kimi-serve's positional model."""
import io
import json
import logging
import math
import re
import urllib.request

import jsonschema
import pytest

from tests.e2e.serving import serving

openai = pytest.importorskip("openai")

KEY, NAME = "k", "demo"
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["label", "n"], "additionalProperties": False}
LOOSE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                          "c": {"type": "string", "maxLength": 6}}, "required": ["a"]}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'start: "id=" DIGITS ";"\nDIGITS: /[0-9]{1,4}/'
GRAMMAR_RE = r"id=[0-9]{1,4};"
MSGS = [{"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def llm():
    """The LLM the server's frontend belongs to (its own engine core next to the server's)."""
    from kimi_jax.entrypoints.llm import LLM
    return LLM(None, dtype="float32", max_num_seqs=16, max_model_len=512)


@pytest.fixture(scope="module")
def server(llm):
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    srv = OpenAIServer(llm.frontend, served_model_name=NAME, api_key=KEY)
    with serving(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def _get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _chat(client, extra, **kw):
    kw = {"max_tokens": 48, "temperature": 1.0, "seed": 1, **kw}
    return client.chat.completions.create(model=NAME, messages=MSGS, extra_body=extra, **kw)


def _text(client, extra, **kw):
    kw = {"max_tokens": 32, "temperature": 1.0, "seed": 2, **kw}
    return client.completions.create(model=NAME, prompt="The answer is", extra_body=extra, **kw)


def _check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


VALUES = {"json": SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": GRAMMAR, "json_object": True}


@pytest.mark.parametrize("kind", list(VALUES))
def test_structured_outputs_on_both_endpoints(client, kind):
    extra = {"structured_outputs": {kind: VALUES[kind]}}
    chat = _chat(client, extra, n=2)
    text = _text(client, extra)
    for out in [c.message.content for c in chat.choices] + [text.choices[0].text]:
        _check(kind, out)
    assert {c.finish_reason for c in chat.choices} | {text.choices[0].finish_reason} == {"stop"}


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_guided_fields_on_both_endpoints(client, kind):
    extra = {f"guided_{kind}": VALUES[kind]}
    _check(kind, _chat(client, extra).choices[0].message.content)
    _check(kind, _text(client, extra).choices[0].text)


GBNF = 'root ::= "id=" digits ";"\ndigits ::= [0-9]{1,4}\n'     # llama.cpp's form of GRAMMAR


def test_gbnf_grammar_in_every_grammar_field(client, llm):
    from kimi_jax import SamplingParams, StructuredOutputsParams
    for extra in ({"structured_outputs": {"grammar": GBNF}}, {"guided_grammar": GBNF}):
        _check("grammar", _chat(client, extra).choices[0].message.content)
        _check("grammar", _text(client, extra).choices[0].text)
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=5,
                        structured_outputs=StructuredOutputsParams(grammar=GBNF))
    _check("grammar", llm.generate(["x"], sp)[0].outputs[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        _text(client, {"guided_grammar": 'root ::= "a" undefined'})
    assert e.value.body["param"] == "guided_grammar" and "undefined" in e.value.body["message"]


TAG = {"type": "structural_tag", "triggers": ["a"],       # a trigger the demo model soon writes
       "structures": [{"begin": "a=", "schema": SCHEMA, "end": ";"}]}


def _tagged_parts(text: str, finish: str) -> int:
    """The count of TAG's parts in text, each checked: "a=", SCHEMA's JSON, ";" (the last may be cut
    off by max_tokens)."""
    n, at = 0, text.find("a")
    while at >= 0:
        try:
            assert text[at:at + 2] == "a=", text
            obj, end = json.JSONDecoder().raw_decode(text, at + 2)
            assert text[end] == ";", text
        except (ValueError, IndexError, AssertionError):
            assert finish == "length", text
            return n
        jsonschema.validate(obj, SCHEMA)
        n, at = n + 1, text.find("a", end + 1)
    return n


def test_response_format_structural_tag(client):
    """vLLM's response_format form of a structural tag: free text, each tagged part its schema's
    JSON."""
    chat = _chat(client, None, n=4, max_tokens=64, response_format=TAG).choices
    text = _text(client, {"response_format": TAG}, max_tokens=64).choices[0]
    outs = [(c.message.content, c.finish_reason) for c in chat] + [(text.text, text.finish_reason)]
    assert sum(_tagged_parts(t, f) for t, f in outs) >= 1, outs
    for bad in ({**TAG, "structures": []}, {**TAG, "triggers": ["<x"]}):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, None, response_format=bad)
        assert e.value.body["param"] == "response_format", e.value.body


def test_structured_outputs_streamed_adds_up(client):
    parts = [c.choices[0].delta.content or "" for c in _chat(client, {"guided_regex": REGEX}, stream=True)
             if c.choices]
    _check("regex", "".join(parts))


def test_structured_outputs_errors_name_the_field(client):
    cases = [({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
             ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
             ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
             ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
             ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "guided_whitespace_pattern")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _text(client, extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
        assert param.split(".")[0] in e.value.body["message"] and "\n" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, {"guided_regex": "a"}, response_format={"type": "json_object"})
    assert e.value.body["param"] == "guided_regex"


def test_extra_fields_are_accepted_and_listed_in_one_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="kimi_jax.entrypoints.openai.protocol"):
        r = _chat(client, {"my_client_field": 1, "priority": 0}, reasoning_effort="low", max_tokens=3)
    assert r.choices[0].message.content is not None
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kimi_jax.entrypoints.openai.protocol"]
    assert len(lines) == 1 and all(f in lines[0] for f in ("my_client_field", "priority", "reasoning_effort"))
    # fields whose silent ignoring would change the answer are refused, named
    for extra, param in [({"use_beam_search": True}, "use_beam_search"), ({"functions": [{"name": "f"}]}, "functions"),
                         ({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, extra)
        assert e.value.body["param"] == param and param in e.value.body["message"]


def _declared_keys_and_finite(texts, schema):
    for t in texts:
        obj = json.loads(t, parse_constant=lambda c: pytest.fail(f"{c} in {t!r}"))
        jsonschema.validate(obj, schema)
        assert set(obj) <= set(schema["properties"]), t
        assert all(math.isfinite(float(v)) for v in obj.values() if isinstance(v, (int, float))), t


@pytest.mark.parametrize("samples", [10, pytest.param(50, marks=pytest.mark.slow)])
def test_schema_without_additional_properties_yields_declared_keys(client, samples):
    """A schema that declares properties and says nothing of additionalProperties is compiled closed:
    sampled at temperature 1.5 (the demo model follows no instruction), no output has another key."""
    texts = []
    for seed in range(samples // 10):
        r = client.chat.completions.create(model=NAME, messages=MSGS, n=10, max_tokens=48, temperature=1.5, seed=seed,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "loose", "schema": LOOSE}})
        texts += [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert len(texts) >= samples * 0.9          # the close ends them within max_tokens
    _declared_keys_and_finite(texts, LOOSE)
    # the opt-out: vLLM's disable_additional_properties=False keeps the schema open (it compiles)
    r = _chat(client, {"structured_outputs": {"json": LOOSE, "disable_additional_properties": False}})
    jsonschema.validate(json.loads(r.choices[0].message.content), LOOSE)


def test_model_by_id_version_and_one_key_rule(server, client):
    _, url = server
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    from kimi_jax import __version__
    assert _get(url + "/version") == (200, {"version": __version__})        # open, like /health and /metrics
    assert _get(url + "/health")[0] == 200 and _get(url + "/metrics")[0] == 200
    for path in ("/v1/models", "/v1/models/" + NAME, "/tokenize"):
        assert _get(url + path)[0] == 401, path
    assert _get(url + "/v1/models/" + NAME, KEY)[0] == 200


def test_access_log_line_per_request(server, client, caplog):
    srv, _ = server
    with caplog.at_level(logging.INFO, logger="kimi_jax.entrypoints.openai.server"):
        r = client.completions.create(model=NAME, prompt="The with statement", max_tokens=3, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt="x", temperature=-1)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kimi_jax.entrypoints.openai.server"]
    ok = [ln for ln in lines if r.id in ln]
    assert len(ok) == 1, lines
    m = re.fullmatch(rf"{r.id} POST /v1/completions 200 prompt_tokens=(\d+) output_tokens=3 ttft=(\S+)s "
                     r"total=(\S+)s", ok[0])
    assert m and int(m.group(1)) == r.usage.prompt_tokens and 0 < float(m.group(2)) <= float(m.group(3)), ok[0]
    assert any(" POST /v1/completions 400 " in ln for ln in lines), lines
    srv.access_log = False
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kimi_jax.entrypoints.openai.server"):
            client.completions.create(model=NAME, prompt="x", max_tokens=1)
        assert not [rec for rec in caplog.records if "POST /v1/completions" in rec.getMessage()]
    finally:
        srv.access_log = True


def test_python_api_vllm_names(llm):
    import inspect

    import kimi_jax
    from kimi_jax import LLM, SamplingParams, StructuredOutputsParams
    assert llm.get_tokenizer() is llm.tokenizer and "StructuredOutputsParams" in kimi_jax.__all__
    assert inspect.signature(LLM.generate).parameters["use_tqdm"].default is True
    assert inspect.signature(LLM.chat).parameters["use_tqdm"].default is True
    from tqdm import tqdm
    made = []

    class Bar(tqdm):
        def __init__(self, *a, **kw):
            made.append(kw["total"])
            super().__init__(*a, file=io.StringIO(), **kw)
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=0,
                                                   structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                        use_tqdm=Bar)
    assert made == [4] and all(c.text in CHOICES for o in outs for c in o.outputs)
    for kw, field in [(dict(temperature=-1), "temperature"), (dict(top_p=float("nan")), "top_p"),
                      (dict(presence_penalty=3.0), "presence_penalty"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
                      (dict(repetition_penalty=float("inf")), "repetition_penalty")]:
        with pytest.raises(ValueError) as e:                    # refused when built, naming the field
            SamplingParams(**kw)
        assert e.value.field == field and str(e.value).startswith(field), str(e.value)


def test_serve_takes_the_model_positionally_and_tools_hint_at_flags(cli, tmp_path):
    missing = tmp_path / "no-such-model"
    r = cli("launch.serve", str(missing), "--port=1")
    assert r.returncode == 2 and str(missing) in r.stderr and "positional" not in r.stderr, r.stderr
    r = cli("launch.serve", str(missing), f"--model={missing}")
    assert r.returncode == 2 and "given twice" in r.stderr, r.stderr
    r = cli("launch.batch", str(tmp_path), "--input=x", "--output=y")
    assert r.returncode == 2 and f"--model {tmp_path}" in r.stderr, r.stderr


def test_documented_tools_state_sizes_and_device_counts(cli, tmp_path, monkeypatch):
    import collections
    import shutil
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 12, 0, 10 ** 9))
    r = cli("launch.make_synthetic", "--preset=kimi-k2.5", "--num-layers=4", f"--out={tmp_path / 'k'}")
    assert r.returncode == 2 and "35.1 GB to write and 1.0 GB free" in r.stderr, r
    assert "warning: 35.1 GB to write" in r.stderr and not (tmp_path / "k").exists()
    r = cli("launch.profile", "--model=tiny", "--tensor-parallel-size=8", "--data-parallel-size=2")
    assert r.returncode == 2 and "needs 16 devices; 8 cpu device(s) visible" in r.stderr, r


def test_structured_outputs_through_kimi_batch(llm, tmp_path):
    from kimi_jax.entrypoints.batch import ResultWriter, run_job
    bodies = {"so": ("/v1/chat/completions", {"messages": MSGS, "structured_outputs": {"json": SCHEMA}}),
              "regex": ("/v1/completions", {"prompt": "x", "guided_regex": REGEX, "max_tokens": 32}),
              "choice": ("/v1/chat/completions", {"messages": MSGS, "guided_choice": CHOICES}),
              "bad": ("/v1/completions", {"prompt": "x", "guided_regex": "a{20000}", "max_tokens": 20})}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": u, "body": {**b, "temperature": 1.0}})
                           + "\n" for k, (u, b) in bodies.items()))
    with open(inp) as f:
        run_job(llm.frontend, f, ResultWriter(str(out)), model_name=NAME, default_max_tokens=48, progress=False)
    got = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(got["so"]["body"]["choices"][0]["message"]["content"]), SCHEMA)
    _check("regex", got["regex"]["body"]["choices"][0]["text"])
    _check("choice", got["choice"]["body"]["choices"][0]["message"]["content"])
    err = got["bad"]["body"]["error"]
    assert got["bad"]["status_code"] == 400 and err["param"] == "guided_regex" and "10000" in err["message"]
