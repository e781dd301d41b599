"""kimi-bench-serve's timing of one streamed request (`launch.bench_serve.one`) against a loopback stream
shaped like the server's: every chunk with a choice is a token arrival, empty text included (random
weights' tokens decode to nothing), and the output token count comes from the usage chunk."""
import asyncio
import json

import aiohttp
from aiohttp import web

from launch import bench_serve


def _chunks(texts):
    for t in texts:
        yield {"choices": [{"index": 0, "text": t, "finish_reason": None}]}
    yield {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(texts)}}


def test_every_chunk_is_a_token_and_usage_counts_them():
    texts = ["", "", "a", ""]

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in _chunks(texts):
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await bench_serve.one(session, f"http://127.0.0.1:{port}/v1/completions", {}, {}, 10.0)
        finally:
            await runner.cleanup()

    r = asyncio.run(go())
    assert r["output_tokens"] == len(texts) and len(r["times"]) == len(texts)
    assert r["start"] < r["times"][0] and all(a < b for a, b in zip(r["times"], r["times"][1:]))
