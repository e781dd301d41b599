"""The server's intake against hostile requests: nothing on the event loop stalls /health, every limit
answers 400 / 413 naming itself, deep JSON and odd headers are 400 / 401 (never 500), a request that
can never be queued is 400 (not 429), and SIGTERM with a client that never reads exits 0 in its grace."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e.serving import free_socket, serving
from tests.e2e.test_server import _http, _wait_ready

KEY = "k"
NAME = "demo"
SLOTS, QUEUE, MAX_LEN = 8, 4, 512
BODY_LIMIT = 2 * 2**20
# /health must answer within this while another request is worked on: the loop only parses HTTP and
# hands bodies to the intake pool; 0.5 s leaves room for a 2-core machine shared with other jobs
HEALTH_S = 0.5


@pytest.fixture(scope="module")
def server():
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.intake import RequestLimits
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    llm = LLM(None, dtype="float32", max_num_seqs=SLOTS, max_model_len=MAX_LEN)
    srv = OpenAIServer(llm.frontend, served_model_name=NAME, api_key=KEY, max_queue=QUEUE,
                       limits=RequestLimits(max_body_bytes=BODY_LIMIT), metrics_need_key=True)
    with serving(srv) as url:
        yield srv, url


def _post(url, path, body, key=KEY):
    return _http(url + path, body, {"Authorization": f"Bearer {key}"})


def _health_while(url, fn) -> tuple[list, object]:
    """fn() on a thread; /health latencies (s) measured until it returns, and fn's result."""
    box, times = {}, []
    t = threading.Thread(target=lambda: box.setdefault("r", fn()))
    t.start()
    time.sleep(0.05)
    while t.is_alive() or not times:
        t0 = time.perf_counter()
        assert _http(url + "/health")[0] == 200
        times.append(time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    return times, box["r"]


def _err(r):
    status, _, body = r
    assert "\n" not in body["error"]["message"]
    return status, body["error"]["param"], body["error"]["message"]


def test_health_answers_while_intake_works(server, monkeypatch):
    srv, url = server
    real = srv._engine_requests

    def slow(g, rid):              # a request whose tokenizing / building takes 2 s of a worker thread
        time.sleep(2.0)
        return real(g, rid)
    monkeypatch.setattr(srv, "_engine_requests", slow)
    times, r = _health_while(url, lambda: _post(url, "/v1/completions", {"model": NAME, "prompt": [5, 6], "max_tokens": 2}))
    assert r[0] == 200 and len(times) >= 5 and max(times) < HEALTH_S, times


def test_prompts_times_n_beyond_the_limit_is_400_at_once(server):
    srv, url = server
    body = {"model": NAME, "prompt": ["a"] * 20000, "n": 64, "max_tokens": 1}
    t0 = time.perf_counter()
    times, r = _health_while(url, lambda: _post(url, "/v1/completions", body))
    status, param, msg = _err(r)
    assert status == 400 and param == "n" and "1280000 choices" in msg and "max_choices" in msg
    assert time.perf_counter() - t0 < 5 and max(times) < HEALTH_S


def test_more_choices_than_slots_and_queue_is_400_not_429(server):
    srv, url = server
    n = SLOTS + QUEUE + 1
    status, param, msg = _err(_post(url, "/v1/completions", {"model": NAME, "prompt": [5], "n": n, "max_tokens": 1}))
    assert status == 400 and param == "n" and f"more than the {SLOTS + QUEUE}" in msg
    r = _post(url, "/v1/completions", {"model": NAME, "prompt": [5], "n": SLOTS + QUEUE, "max_tokens": 1})
    assert r[0] == 200 and len(r[2]["choices"]) == SLOTS + QUEUE


def test_text_prompt_that_cannot_fit_is_400_without_tokenizing(server):
    srv, url = server
    big = "word " * (srv.max_prompt_chars // 5 + 1)
    for path, body, field in (("/v1/completions", {"model": NAME, "prompt": big}, "prompt"),
                              ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": big}]},
                               "messages"),
                              ("/tokenize", {"prompt": big}, "prompt")):
        t0 = time.perf_counter()
        status, param, msg = _err(_post(url, path, body))
        assert status == 400 and param == field and "max_prompt_chars" in msg, (path, msg)
        assert time.perf_counter() - t0 < 2
    # just under the limit it is tokenized and refused by its token count, as before
    assert srv.max_prompt_chars >= MAX_LEN


def test_body_over_the_limit_is_413_naming_it(server):
    srv, url = server
    body = json.dumps({"model": NAME, "prompt": "x" * BODY_LIMIT}).encode()
    status, _, body = _http(url + "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 413 and f"max_body_bytes={BODY_LIMIT}" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("depth", [200, 100_000])
def test_deep_json_is_400(server, path, depth):
    srv, url = server
    raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, _, body = _http(url + path, raw, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and "nested deeper than" in body["error"]["message"], body


@pytest.mark.parametrize("value", [b"Bearer \xe9\xff\xfe", b"Bearer k\xc3\xa9", "Bearer é".encode("latin-1"),
                                   b"", b"Bearer", b"bearer k", b"Bearer kk", b"Basic k", b"Bearer  k"])
def test_non_ascii_authorization_is_401(server, value):
    srv, url = server
    port = int(url.rsplit(":", 1)[1])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.putrequest("POST", "/v1/completions")
    c.putheader("Authorization", value)
    c.putheader("Content-Type", "application/json")
    data = json.dumps({"model": NAME, "prompt": [5]}).encode()
    c.putheader("Content-Length", str(len(data)))
    c.endheaders(data)
    r = c.getresponse()
    assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key"


def test_metrics_behind_the_key_when_asked(server):
    srv, url = server
    assert _http(url + "/metrics")[0] == 401
    status, _, text = _http(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and "kimi_jax:num_requests_running" in text
    assert _http(url + "/health")[0] == 200


def test_internal_error_text_names_no_path(server, monkeypatch):
    srv, url = server
    import kimi_jax
    where = os.path.dirname(kimi_jax.__file__)

    def broken(g, rid):
        raise RuntimeError(f"{where}/engine/x.py: something broke")
    monkeypatch.setattr(srv, "_engine_requests", broken)
    status, _, body = _post(url, "/v1/completions", {"model": NAME, "prompt": [5]})
    assert status == 500 and where not in json.dumps(body) and "RuntimeError" in body["error"]["message"]
    assert srv._scrub(f"no template in {where}/t.jinja") == "no template in <install>/kimi_jax/t.jinja"


def _send_queue(server_port: int, client_port: int) -> int:
    """Bytes the server's side of the connection holds unsent (/proc/net/tcp tx_queue)."""
    with open("/proc/net/tcp") as f:
        for row in f.read().splitlines()[1:]:
            cols = row.split()
            if int(cols[1].split(":")[1], 16) == server_port and int(cols[2].split(":")[1], 16) == client_port:
                return int(cols[4].split(":")[0], 16)
    return 0


def _wait_send_queue_full(server_port: int, client_port: int, timeout: float = 120.0) -> None:
    """Until the server has a send queue that stopped growing for a second: its writes are blocked."""
    t0, last, since = time.time(), -1, time.time()
    while time.time() - t0 < timeout:
        q = _send_queue(server_port, client_port)
        if q != last:
            last, since = q, time.time()
        elif q > 0 and time.time() - since > 1.0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the server's send queue never filled ({last} bytes)")


def test_a_taken_port_is_a_listen_error(server):
    import asyncio
    from kimi_jax.entrypoints.openai.server import ListenError, OpenAIServer, serve
    srv, url = server
    taken = int(url.rsplit(":", 1)[1])
    other = OpenAIServer(srv.frontend, served_model_name=NAME)
    with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{taken}: "):
        asyncio.run(serve(other, port=taken, stop=asyncio.Event()))


@pytest.mark.slow
def test_sigterm_with_a_client_that_never_reads_exits_0_in_grace():
    import jax
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    grace = 1.0
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--port", str(port), "--dtype", "float32",
                             "--max_num_seqs", "64", "--max_model_len", str(MAX_LEN), "--noxla_perf",
                             "--shutdown_grace_s", str(grace)], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, 240)
        # 64 streamed choices of 400 tokens with logprobs: megabytes of SSE into a 4 KB receive window
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        body = json.dumps({"model": "kimi-jax-demo", "prompt": ["The with statement"] * 8, "n": 8,
                           "max_tokens": 400, "logprobs": 5, "stream": True, "ignore_eos": True}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait_send_queue_full(port, client.getsockname()[1])
        t_term = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        took = time.time() - t_term
        err = proc.stderr.read()
        client.close()
        assert code == 0, err[-3000:]
        assert "cannot listen" not in err and "stopped" in err and "closing their connections" in err
        assert took < grace + 15, took      # grace, then CLOSE_S for handlers and for connections
    finally:
        if proc.poll() is None:
            proc.kill()
