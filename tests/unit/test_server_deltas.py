"""The OpenAI server's per-delta bookkeeping (`OpenAIServer._deltas`, what the streaming and the
non-streaming responses share), without a model: each delta is counted (a request's prompt tokens
once, with its first tokens), the deltas end when every request has finished, and an aborted request
ends them with the message the client gets (a 503 body for a non-streaming response)."""
import asyncio
import json
import types

from kimi_jax.engine.async_engine import Delta
from kimi_jax.entrypoints.openai.server import OpenAIServer, _Aborted


class _Counter:
    def __init__(self):
        self.n = 0

    def inc(self, k=1):
        self.n += k


def _server():
    s = OpenAIServer.__new__(OpenAIServer)         # no model: only what _deltas and _collect use
    s.finished = []
    s.metrics = types.SimpleNamespace(prompt_tokens=_Counter(), generation_tokens=_Counter(),
                                      finished=s.finished.append)
    return s


def _reqs():
    a = types.SimpleNamespace(request_id="a", prompt_ids=[1, 2, 3], finish_reason=None)
    b = types.SimpleNamespace(request_id="b", prompt_ids=[4, 5], finish_reason=None)
    return [(0, a), (1, b)]


def _drain(server, reqs, deltas):
    async def go():
        queue = asyncio.Queue()
        for d in deltas:
            queue.put_nowait(d)
        got = []
        try:
            async for k, r, d in server._deltas(reqs, queue):
                got.append((k, r.request_id, d.token_ids))
        except _Aborted as e:
            return got, str(e)
        return got, None
    return asyncio.run(go())


def test_deltas_count_tokens_and_end_when_every_request_finished():
    server, reqs = _server(), _reqs()
    (_, a), (_, b) = reqs
    a.finish_reason = b.finish_reason = "length"
    got, aborted = _drain(server, reqs, [
        Delta("a", [], []), Delta("a", [7], []), Delta("b", [8, 9], []), Delta("a", [10], [], True, a),
        Delta("b", [11], [], True, b), Delta("a", [99], [])])        # after the end: not read
    assert aborted is None
    assert got == [(0, "a", []), (0, "a", [7]), (1, "b", [8, 9]), (0, "a", [10]), (1, "b", [11])]
    assert server.metrics.prompt_tokens.n == 3 + 2                  # once per request, with its first tokens
    assert server.metrics.generation_tokens.n == 5
    assert server.finished == [a, b]


def test_an_aborted_request_ends_the_deltas_with_its_message():
    server, reqs = _server(), _reqs()
    (_, a), (_, b) = reqs
    got, aborted = _drain(server, reqs, [Delta("a", [7], []), Delta("b", [8], [], error="the engine failed")])
    assert got == [(0, "a", [7])] and aborted == "request aborted: the engine failed"
    a.finish_reason = "abort"                                        # the server shutting down
    got, aborted = _drain(server, reqs, [Delta("b", [8], []), Delta("a", [], [], True, a)])
    assert got == [(1, "b", [8])] and aborted == "request aborted: the server is shutting down"
    assert server.finished == []                                     # an abort is no finished request


def test_collect_answers_an_abort_with_503():
    server, reqs = _server(), _reqs()
    g = types.SimpleNamespace(kind="completion", tools=None, n=1)

    async def go():
        queue = asyncio.Queue()
        queue.put_nowait(Delta("a", [7], [], error="the engine failed"))
        return await server._collect(g, "cmpl-1", reqs, queue)
    resp = asyncio.run(go())
    assert resp.status == 503
    assert json.loads(resp.body)["error"]["message"] == "request aborted: the engine failed"
