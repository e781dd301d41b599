"""The OpenAI-compatible server, driven by the official `openai` client: one in-process server (the demo
model, float32) on a free 127.0.0.1 port for the module, plus one `kimi-serve` subprocess for SIGTERM."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.e2e.serving import free_socket, serving

openai = pytest.importorskip("openai")

KEY = "test-key"
NAME = "demo"
MAX_NUM_SEQS, MAX_QUEUE, MAX_MODEL_LEN = 32, 8, 512


@pytest.fixture(scope="module")
def llm():
    """The LLM the server's frontend belongs to (its own engine core next to the server's)."""
    from kimi_jax.entrypoints.llm import LLM
    return LLM(None, dtype="float32", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(llm):
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    srv = OpenAIServer(llm.frontend, served_model_name=NAME, api_key=KEY, max_queue=MAX_QUEUE)
    with serving(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def _http(url, body=None, headers=None, method=None):
    """(status, headers, parsed JSON or text) of a raw request."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode()


def _wait_ready(proc, url: str, timeout_s: float) -> None:
    """Poll a kimi-serve subprocess's /health until it answers 200 (the process must stay up)."""
    t0 = time.time()
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if _http(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        assert time.time() - t0 < timeout_s
        time.sleep(0.2)


def _metric(url, name) -> float:
    text = _http(url + "/metrics")[2]
    m = re.search(rf"^kimi_jax:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _wait_metric(url, name, pred, timeout=30.0) -> float:
    t0 = time.time()
    while True:
        v = _metric(url, name)
        if pred(v) or time.time() - t0 > timeout:
            return v
        time.sleep(0.05)


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_models_and_health(server, client):
    srv, url = server
    assert [m.id for m in client.models.list().data] == [NAME]
    assert _http(url + "/health")[0] == 200          # open without a key


def test_completion_stream_equals_non_stream(client):
    # greedy with a stop string; seeded top-p sampling with n=2 (two choices, distinct streams)
    for kw in (dict(temperature=0.0, stop=[" the"]), dict(temperature=0.9, top_p=0.9, seed=7, n=2)):
        full = client.completions.create(model=NAME, prompt="The with statement", max_tokens=24, **kw)
        pieces, usage = {}, None
        for ch in client.completions.create(model=NAME, prompt="The with statement", max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, **kw):
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                pieces.setdefault(c.index, []).append(c)
        assert sorted(pieces) == [c.index for c in full.choices]
        for c in full.choices:
            assert "".join(p.text for p in pieces[c.index]) == c.text, kw
            assert pieces[c.index][-1].finish_reason == c.finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens and usage.prompt_tokens == full.usage.prompt_tokens
        if "stop" in kw:
            assert " the" not in full.choices[0].text and full.choices[0].finish_reason == "stop"
        if "n" in kw:
            assert [c.index for c in full.choices] == [0, 1] and full.choices[0].text != full.choices[1].text


def test_streams_send_a_chunk_for_every_step(server, client):
    """As vLLM: a streamed completion or chat (without tools) sends a chunk for each decode step, empty-text
    ones included, so a client can time every token. logit_bias makes every token the lead byte 0xF0 of a
    4-byte character: the first decodes to nothing, each later one to U+FFFD for the byte before it (the
    last chunk flushes its own too); greedy one-token steps give one chunk a token."""
    tok = server[0].tokenizer
    lead = next(i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.token_bytes(i) == b"\xf0")
    kw = dict(model=NAME, max_tokens=24, temperature=0.0, stream=True, logit_bias={str(lead): 100},
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text = list(client.completions.create(prompt="The with statement", **kw))
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
    for chunks, piece in ((text, lambda ch: ch.choices[0].text),
                          (chat[1:], lambda ch: ch.choices[0].delta.content or "")):  # chat: after the role chunk
        pieces = [piece(ch) for ch in chunks if ch.choices]
        usage = [ch.usage for ch in chunks if ch.usage is not None]
        assert pieces[0] == "" and pieces[1:-1] == ["\ufffd"] * 22 and pieces[-1] == "\ufffd" * 2
        assert len(pieces) == usage[-1].completion_tokens == 24


def test_chat_matches_llm_chat_and_stream(llm, client):
    from kimi_jax.engine.sampling import SamplingParams
    msgs = [{"role": "user", "content": "What does json.dumps do?"}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0.0)
    ref = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0.0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    lp = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0.0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.token == t.top_logprobs[0].token and t.logprob <= 0 for t in content)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}]


def test_chat_tool_calls_and_their_stream(client):
    """tool_choice "required": the reply's tool_calls validate (jsonschema); the streamed deltas, put
    together as a client does, equal the non-streamed reply; response_format json_schema validates."""
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    kw = dict(model=NAME, messages=msgs, max_tokens=64, temperature=1.0, seed=3, tools=TOOLS, tool_choice="required")
    full = client.chat.completions.create(**kw)
    ch = full.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls and not ch.message.content
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("functions.")
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    calls, content, finish = [], "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.id is not None:
                assert t.index == len(calls)
                calls.append({"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""})
            else:
                calls[t.index]["arguments"] += t.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert calls == [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls]
    schema = TOOLS[0]["function"]["parameters"]
    js = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=64, temperature=1.0, seed=4,
                                        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    jsonschema.validate(json.loads(js.choices[0].message.content), schema)


def test_32_concurrent_streams_equal_one_by_one(client, server):
    prompts = [f"def f{i}(x):" if i % 2 else f"The value {i} is" for i in range(32)]
    one_by_one = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0).choices[0].text
                  for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)

    async def stream(p):
        out = []
        async for ch in await aclient.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0,
                                                         stream=True):
            out.append(ch.choices[0].text)
        return "".join(out)

    async def main():
        try:
            return await asyncio.gather(*[stream(p) for p in prompts])
        finally:
            await aclient.close()
    assert asyncio.run(main()) == one_by_one


def test_bad_requests_are_400_naming_the_field(server, client):
    _, url = server
    cases = [(dict(temperature=-1.0), "temperature"), (dict(top_p=2.0), "top_p"),
             (dict(max_tokens="many"), "max_tokens"), (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
             (dict(extra_body={"top_k": 0.5}), "top_k"), (dict(stop=[""]), "stop"),
             (dict(logprobs=99), "logprobs")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="hi", **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages" and "messages[0]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:          # longer than the context
        client.completions.create(model=NAME, prompt=[5] * MAX_MODEL_LEN, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:          # out-of-vocabulary token id
        client.completions.create(model=NAME, prompt=[10**9], max_tokens=4)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    status, _, body = _http(url + "/v1/completions", b"{not json", AUTH)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = _http(url + "/v1/completions", [1, 2], AUTH)
    assert status == 400
    # the server still serves
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0.0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_api_key_401(server):
    _, url = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, body = _http(url + "/v1/completions", {"model": NAME, "prompt": "hi"}, headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_queue_full_429_then_disconnect_frees_everything(server, client):
    """MAX_NUM_SEQS + MAX_QUEUE long streams fill every slot and the queue: one more is a 429 with
    Retry-After; closing the streams (client disconnect) aborts them: nothing runs or waits and every
    cache page is free again."""
    _, url = server
    streams = []
    for _ in range(MAX_NUM_SEQS + MAX_QUEUE):
        s = client.completions.create(model=NAME, prompt="The with statement", max_tokens=400, temperature=0.0,
                                      extra_body={"ignore_eos": True}, stream=True)
        next(iter(s)) if not streams else None        # the first stream is running
        streams.append(s)
    total = _wait_metric(url, "num_requests_running", lambda v: v == MAX_NUM_SEQS)
    assert total == MAX_NUM_SEQS
    assert _metric(url, "num_requests_waiting") == MAX_QUEUE
    status, headers, body = _http(url + "/v1/completions", {"model": NAME, "prompt": "hi"}, AUTH)
    assert status == 429 and int(headers["Retry-After"]) >= 1 and body["error"]["type"] == "rate_limit_error"
    assert _metric(url, "kv_cache_usage_perc") > 0
    for s in streams:
        s.close()
    assert _wait_metric(url, "num_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(url, "num_requests_waiting", lambda v: v == 0) == 0
    assert _wait_metric(url, "kv_cache_usage_perc", lambda v: v == 0) == 0
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0.0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3


def test_tokenize_detokenize_and_metrics(server, client):
    srv, url = server
    status, _, body = _http(url + "/tokenize", {"prompt": "The with statement"}, AUTH)
    assert status == 200 and body["tokens"] == srv.tokenizer.encode("The with statement")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    msgs = [{"role": "user", "content": "hi"}]
    tokens = _http(url + "/tokenize", {"messages": msgs}, AUTH)[2]["tokens"]
    assert tokens == srv.frontend.inputs.encode_chat(msgs)
    assert _http(url + "/detokenize", {"tokens": body["tokens"]}, AUTH)[2]["prompt"] == "The with statement"
    assert _http(url + "/detokenize", {"tokens": [-1]}, AUTH)[0] == 400
    gen, prompt = _metric(url, "generation_tokens_total"), _metric(url, "prompt_tokens_total")
    r = client.completions.create(model=NAME, prompt="The with statement", max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert _metric(url, "generation_tokens_total") == gen + 5
    assert _metric(url, "prompt_tokens_total") == prompt + r.usage.prompt_tokens
    text = _http(url + "/metrics")[2]
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"^kimi_jax:{h}_count\{{[^}}]*\}} [1-9]", text, re.M), h
    # prefix caching (vLLM's counters, in prompt tokens): the same long prompt twice, the second finds
    # its full pages cached; the counters are the engine's own totals
    queries, hits = _metric(url, "prefix_cache_queries_total"), _metric(url, "prefix_cache_hits_total")
    page_size = srv.frontend.cache_config.page_size
    long_prompt = list(range(10, 10 + 3 * page_size + 1))
    for _ in range(2):
        client.completions.create(model=NAME, prompt=long_prompt, max_tokens=1, temperature=0.0)
    stats = srv.async_llm.core.stats
    assert _metric(url, "prefix_cache_queries_total") == stats["prefix_cache_queries"] >= queries + 2 * len(long_prompt)
    assert _metric(url, "prefix_cache_hits_total") == stats["prefix_cache_hits"] >= hits + 3 * page_size


def test_sigterm_finishes_in_flight_and_exits_0(tmp_path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    import jax
    # the in-process server's settings and XLA options, so the programs come from the compilation cache
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               JAX_DEFAULT_MATMUL_PRECISION="highest")
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--port", str(port), "--dtype", "float32",
                             "--max_num_seqs", str(MAX_NUM_SEQS), "--max_model_len", str(MAX_MODEL_LEN),
                             "--noxla_perf", "--shutdown_grace_s", "120"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, 120)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        name = c.models.list().data[0].id
        results = [None] * 3

        def go(i):
            try:
                s = c.completions.create(model=name, prompt="The with statement", max_tokens=40, temperature=0.0,
                                         extra_body={"ignore_eos": True}, stream=True)
                results[i] = ("ok", "".join(ch.choices[0].text for ch in s if ch.choices))
                assert len(results[i][1]) > 0
            except openai.APIError as e:
                results[i] = ("error", e)
        threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        _wait_metric(url, "num_requests_running", lambda v: v == 3)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(150)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        # the access log is on by default: one INFO line per request
        access = re.findall(r"\] cmpl-\S+ POST /v1/completions 200 prompt_tokens=", err)
        assert len(access) == 3, err
        assert all(r is not None for r in results)
        assert all(r[0] == "ok" and r[1] for r in results), results      # in-flight requests completed
        with pytest.raises(OSError):
            _http(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_abort_frees_pages_while_a_step_is_in_flight(llm):
    """EngineCore.abort with overlap scheduling: abort a request while a decode step that includes it
    is in flight; its pages return at once and the other request's tokens equal a run without it."""
    from kimi_jax.engine.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = llm.tokenizer.encode("The with statement")
    ref = llm.generate([ids], sp)[0].outputs[0].token_ids
    core = llm.frontend.make_core()
    s = core.scheduler
    assert s.overlap
    [keep] = core.add_request("keep", ids, sp, seed=0)
    [drop] = core.add_request("drop", ids[:2], sp, seed=0)
    while core.runner.inflight is None or len(drop.output_ids) < 3:
        core.step()
    free_before = s.pool.num_free
    assert core.abort("drop") is drop and drop.finish_reason == "abort"
    assert s.pool.num_free > free_before and drop.pages == [] and drop not in s.running
    assert core.abort("drop") is None
    core.run()
    assert keep.output_ids == ref and s.pool.num_free == s.pool.num_pages
