"""kimi-bench-serve against loopback servers shaped like kimi-serve: one streamed request's timing
(`launch.bench_serve.one`: every chunk with a choice is a token arrival, empty text included, as random
weights' tokens decode to nothing; the output token count comes from the usage chunk), and the compile
counter it reads from /metrics around a timed run (None where a server has no such metric)."""
import asyncio
import json

import aiohttp
from aiohttp import web


def _chunks(texts):
    for t in texts:
        yield {"choices": [{"index": 0, "text": t, "finish_reason": None}]}
    yield {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(texts)}}


async def _serve(routes, client):
    """Run `client(base_url)` against an aiohttp app of `routes` on an ephemeral loopback port."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await client(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    finally:
        await runner.cleanup()


def test_every_chunk_is_a_token_and_usage_counts_them(tool_module):
    bench_serve = tool_module("launch.bench_serve")
    texts = ["", "", "a", ""]

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in _chunks(texts):
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go(base):
        async with aiohttp.ClientSession() as session:
            return await bench_serve.one(session, base + "/v1/completions", {}, {}, 10.0)

    r = asyncio.run(_serve([("POST", "/v1/completions", stream)], go))
    assert r["output_tokens"] == len(texts) and len(r["times"]) == len(texts)
    assert r["start"] < r["times"][0] and all(a < b for a, b in zip(r["times"], r["times"][1:]))


def test_compile_counter_is_read_from_metrics(tool_module):
    bench_serve = tool_module("launch.bench_serve")
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    reg = CollectorRegistry()
    c = Counter("kimi_jax:compiled_programs", "Programs jax built in this process.", ["model_name"], registry=reg)
    c.labels("m").inc(87)

    async def metrics(request):
        return web.Response(body=generate_latest(reg), content_type="text/plain")

    async def missing(request):
        return web.Response(status=404)

    read = lambda base: bench_serve.compiled_programs(base, {})      # noqa: E731
    assert asyncio.run(_serve([("GET", "/metrics", metrics)], read)) == 87
    assert asyncio.run(_serve([("GET", "/metrics", missing)], read)) is None
    assert asyncio.run(_serve([("GET", "/other", missing)], read)) is None


def test_a_structured_share_sends_grammars_the_server_takes(tool_module):
    """--structured_output_ratio: json requests carry vLLM's structured_outputs (a schema whose
    shortest instance outlasts output_len tokens), tool-call ones a required tool on chat; the share
    is the seed's pick of requests."""
    import jsonschema
    bench_serve = tool_module("launch.bench_serve")
    path, body = bench_serve.request("m", [5, 6], 8, "json")
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["stream"]
    schema = body["structured_outputs"]["json"]
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["items"]["minItems"] == 8     # >= 8 strings: at least 8 tokens
    path, body = bench_serve.request("m", [5, 6], 8, "tool_call")
    assert path == "/v1/chat/completions" and body["tool_choice"] == "required"
    assert body["tools"][0]["function"]["parameters"] == schema and "prompt" not in body
    path, body = bench_serve.request("m", [5, 6], 8, None)
    assert path == "/v1/completions" and "structured_outputs" not in body

    seen = []

    async def completions(request):
        seen.append(("structured_outputs" in await request.json()))
        resp = web.StreamResponse()
        await resp.prepare(request)
        for c in _chunks(["a", "b"]):
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run(base):
        return await bench_serve.bench(base, "m", [[1]] * 40, 2, 4, float("inf"), {}, 0, 10.0, ratio=0.25)
    res = asyncio.run(_serve([("POST", "/v1/completions", completions)], run))
    assert res["completed"] == 40 and res["structured_requests"] == sum(seen)
    assert 4 <= sum(seen) <= 16                                 # about a quarter of 40
