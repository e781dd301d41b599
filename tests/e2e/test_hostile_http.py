"""The server's HTTP layer and kimi-batch's reader against hostile input: integers beyond Python's
digit limit are a 400 / one error line (never a 500 or a lost line); what the HTTP parser refuses, deep
schema strings, odd logit_bias keys and long stop strings are JSON 400s of one bounded line; slow
headers and idle connections are closed within the keep-alive bound; the server keeps serving."""
import gzip
import http.client
import io
import json
import socket
import sys
import time
from urllib.parse import urlsplit

import pytest

from kimi_jax.entrypoints import batch as B
from tests.e2e.serving import serving
from tests.e2e.test_server import _http

NAME = "demo"
HUGE_INT = b"1" * (sys.get_int_max_str_digits() + 1)
KEEPALIVE_S = 1.0


@pytest.fixture(scope="module")
def server():
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    llm = LLM(None, dtype="float32", max_num_seqs=4, max_model_len=256)
    srv = OpenAIServer(llm.frontend, served_model_name=NAME)
    with serving(srv, keepalive_s=KEEPALIVE_S) as url:
        yield srv, url


def _err(r):
    status, _, body = r
    assert "\n" not in body["error"]["message"]
    return status, body["error"]["param"], body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_integer_beyond_the_digit_limit_is_400(server, path):
    srv, url = server
    raw = b'{"model": "demo", "prompt": [5], "max_tokens": ' + HUGE_INT + b"}"
    status, _, message = _err(_http(url + path, raw))
    assert status == 400 and f"more than {sys.get_int_max_str_digits()} digits" in message
    assert _http(url + "/v1/completions", {"model": NAME, "prompt": [5], "max_tokens": 1})[0] == 200


def test_batch_answers_a_line_with_a_huge_integer_once_and_goes_on(tiny_ckpt, tmp_path):
    from kimi_jax import LLM
    llm = LLM(tiny_ckpt, dtype="float32", max_num_seqs=4, block_size=4, num_gpu_blocks_override=32)
    good = [json.dumps({"custom_id": f"r{i}", "prompt": [5 + i, 6], "max_tokens": 1}).encode()
            for i in range(3)]
    bad = b'{"custom_id": "big", "prompt": [5], "max_tokens": ' + HUGE_INT + b"}"
    out = str(tmp_path / "o.jsonl")
    s = B.run_job(llm.frontend, io.BytesIO(b"\n".join([good[0], bad, good[1], good[2]]) + b"\n"),
                  B.ResultWriter(out), model_name="m", default_max_tokens=2, progress=False)
    with open(out, "rb") as f:
        records = [json.loads(x) for x in f.read().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["line-2", "r0", "r1", "r2"]
    err = next(r for r in records if r["custom_id"] == "line-2")["error"]
    assert "line 2" in err["message"] and "digits" in err["message"]
    assert s.counts["ok"] == 3 and s.counts["errors"] == 1


def _raw(url, method, path, body=b"", headers=None):
    """(status, content type, parsed JSON body) of one request sent as given (no client checks)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), json.loads(r.read())
    finally:
        conn.close()


BODY = json.dumps({"model": NAME, "prompt": [5], "max_tokens": 1}).encode()


@pytest.mark.parametrize("case", ["deflate-on-gzip", "br", "long-url", "long-header",
                                  "many-headers"])
def test_what_the_http_parser_refuses_is_a_json_400(server, case):
    srv, url = server
    path, headers, body = "/v1/completions", {"Content-Type": "application/json"}, BODY
    if case == "deflate-on-gzip":
        headers["Content-Encoding"], body = "deflate", gzip.compress(BODY)
    elif case == "br":
        headers["Content-Encoding"], body = "br", b"\x0b\x02\x80{}\x03"
    elif case == "long-url":
        path += "?" + "a" * 9000
    elif case == "long-header":
        headers["X-Big"] = "b" * 9000
    else:
        headers.update({f"X-{i}": "v" for i in range(200)})
    status, ctype, err = _raw(url, "POST", path, body, headers)
    assert status == 400 and ctype.startswith("application/json"), (status, ctype, err)
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert len(err["error"]["message"]) <= 200 and "\n" not in err["error"]["message"]
    assert _http(url + "/v1/completions", {"model": NAME, "prompt": [5], "max_tokens": 1})[0] == 200


def _post(url, path, body):
    status, _, err = _raw(url, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    return status, err.get("error", err)


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs", "response_format"])
def test_a_schema_string_nested_deep_is_400(server, field):
    srv, url = server
    schema = '{"items": ' * 1000 + "{}" + "}" * 1000
    body = {"model": NAME, "prompt": [5], "max_tokens": 1}
    if field == "guided_json":
        body["guided_json"] = schema
    elif field == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    status, err = _post(url, "/v1/completions", body)
    assert status == 400 and err["param"].startswith(field) and "nested deeper than 128" in err["message"]


def test_error_messages_are_one_bounded_line(server, monkeypatch):
    from kimi_jax.engine.validation import RequestError
    srv, url = server
    body = {"model": NAME, "prompt": [5], "max_tokens": 1, "logit_bias": {str(i): 1.0 for i in range(100_000)}}
    status, err = _post(url, "/v1/completions", body)
    assert status == 400 and err["param"] == "logit_bias" and len(err["message"]) <= 1000

    def panics(*a, **k):
        raise RequestError("structured_outputs.regex: panicked at src/lib.rs:7:9:\nstack backtrace:\n"
                           + "   0: frame\n" * 5000)
    monkeypatch.setattr(srv.async_llm, "make_request", panics)
    status, err = _post(url, "/v1/completions", {"model": NAME, "prompt": [5], "max_tokens": 1})
    assert status == 400 and err["message"] == "structured_outputs.regex: panicked at src/lib.rs:7:9:"


def test_a_lone_surrogate_key_is_named_escaped(server, caplog):
    srv, url = server
    raw = b'{"model": "demo", "prompt": [5], "stream_options": {"\\ud800": 1}, "stream": true}'
    status, err = _post(url, "/v1/completions", raw)
    assert status == 400 and err["param"] == "stream_options.\\ud800", err
    status, err = _post(url, "/v1/completions", b'{"model": "demo", "prompt": [5], "\\udc80x": 1}')
    assert status == 400 and err["param"] == "\\udc80x" and "not valid Unicode" in err["message"]
    for r in caplog.records:       # a log line with a raw surrogate cannot be written to a UTF-8 stream
        r.getMessage().encode("utf-8")


@pytest.mark.parametrize("key", [" 5 ", "\uff15", "1_0", "05", "+5", "-1", "5.0", "0x5", ""])
def test_logit_bias_keys_are_canonical_decimals(server, key):
    srv, url = server
    body = {"model": NAME, "prompt": [5], "max_tokens": 1, "logit_bias": {key: 1.0}}
    status, err = _post(url, "/v1/completions", body)
    assert status == 400 and err["param"] == "logit_bias" and "not a token id" in err["message"], err
    body["logit_bias"] = {"0": 1.0, "5": -1.0, "10": 2.0}
    assert _post(url, "/v1/completions", body)[0] == 200


def test_logit_bias_token_given_twice_is_refused():
    from kimi_jax.entrypoints.openai import protocol as P
    with pytest.raises(P.ProtocolError, match="token id 5 twice"):
        P.parse_completion({"prompt": [5], "logit_bias": {5: 1.0, "5": 2.0}})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_best_of_is_one_rule_on_both_routes(server, path):
    srv, url = server
    body = {"model": NAME, "max_tokens": 1, "n": 2, "best_of": 3}
    body.update({"prompt": [5]} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                 "content": "hi"}]})
    status, err = _post(url, path, body)
    assert status == 400 and err["param"] == "best_of" and "must equal n" in err["message"], err


@pytest.mark.parametrize("stop", ["s" * 1025, ["a"] * 65, ["ok", "x" * 2**20]])
def test_stop_strings_are_bounded(server, stop):
    srv, url = server
    body = {"model": NAME, "prompt": [5], "max_tokens": 1, "stop": stop}
    status, err = _post(url, "/v1/completions", body)
    assert status == 400 and err["param"] == "stop" and "at most 64 strings of at most 1024" in err["message"]
    body["stop"] = ["s" * 1024] * 64
    assert _post(url, "/v1/completions", body)[0] == 200


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending `drip` a byte per 0.1 s meanwhile."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    i = 0
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionError:
            return time.monotonic() - t0
        if i < len(drip):
            try:
                sock.send(drip[i:i + 1])
            except ConnectionError:
                return time.monotonic() - t0
            i += 1
    raise AssertionError(f"the connection is still open after {seconds} s")


def test_slow_headers_and_idle_keep_alive_are_closed(server):
    srv, url = server
    port = urlsplit(url).port
    slow = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert _closed_within(s, KEEPALIVE_S + 4, slow) < KEEPALIVE_S + 4
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(s, KEEPALIVE_S + 4) < KEEPALIVE_S + 4
    assert _http(url + "/health")[0] == 200


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_serve_refuses_a_keepalive_that_is_not_positive(cli, value):
    r = cli("launch.serve", "--model=tiny", f"--keepalive_s={value}")
    assert r.returncode == 2 and "--keepalive_s must be > 0" in r.stderr, r


def test_tokenize_renders_tools_as_the_chat_route_does(server):
    srv, url = server
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    status, bare = _post(url, "/tokenize", {"messages": msgs})
    status, with_tools = _post(url, "/tokenize", {"messages": msgs, "tools": tools})
    assert status == 200 and with_tools["count"] > bare["count"]
    status, chat = _post(url, "/v1/chat/completions", {"model": NAME, "messages": msgs, "tools": tools,
                                                       "max_tokens": 1, "temperature": 0})
    assert status == 200 and chat["usage"]["prompt_tokens"] == with_tools["count"]
    assert with_tools["tokens"] == srv.frontend.inputs.encode_chat(msgs, tools=tools)
    assert _post(url, "/tokenize", {"messages": msgs, "tools": "x"})[1]["param"] == "tools"
