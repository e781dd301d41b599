r"""kimi-bench-serve: load a running OpenAI-compatible server (like `vllm bench serve`).

  kimi-serve --dtype float32 &
  python -m launch.bench_serve --num_prompts 200 --max_concurrency 8 --input_len 64 --output_len 32

Sends --num_prompts streamed /v1/completions requests of synthetic prompts (random token ids, exactly
--input_len tokens; ignore_eos so each yields exactly --output_len tokens), at most --max_concurrency
at a time, started at --request_rate per second (Poisson arrivals; inf: all at once). Prints and writes
(--result_json) throughput (requests/s, output tokens/s), TTFT, TPOT and ITL percentiles, errors, and the
programs the server compiled during the timed run (its /metrics `kimi_jax:compiled_programs`, where it has it).
--structured_output_ratio (vLLM's --structured-output-ratio) is the share of requests, picked by the seed,
that carry a grammar: a JSON schema (`structured_outputs.json`, an array of at least --output_len strings,
so the grammar never closes before --output_len tokens), or with --structured_kind tool_call a
/v1/chat/completions request with one tool and tool_choice "required" (its arguments the same array).
--num_warmups untimed requests go first. Targets loopback only unless --allow_remote. With --baseline_model it then runs LLM.generate on the
same prompts one at a time in this process and reports its output tokens/s next to the server's.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Optional

from absl import flags

from launch import common

PROG = "kimi-bench-serve"
FLAGS = flags.FLAGS
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "the server")
flags.DEFINE_string("model", None, "model name to send (default: the server's first model)")
flags.DEFINE_integer("num_prompts", 100, "requests to send")
flags.DEFINE_integer("max_concurrency", 8, "requests in flight at most")
flags.DEFINE_float("request_rate", float("inf"), "requests started per second (Poisson); inf: no pacing")
flags.DEFINE_integer("input_len", 64, "prompt tokens per request")
flags.DEFINE_integer("output_len", 32, "output tokens per request")
flags.DEFINE_integer("seed", 0, "seed of the prompts and arrivals")
flags.DEFINE_integer("vocab_low", 16, "smallest token id in prompts")
flags.DEFINE_integer("vocab_high", 3800, "largest token id in prompts (below the special tokens)")
flags.DEFINE_integer("num_warmups", 0, "untimed requests sent first at the same concurrency (compiles the "
                     "batch shapes the timed run meets)")
flags.DEFINE_float("structured_output_ratio", 0.0, "share of requests with a grammar (0 .. 1)")
flags.DEFINE_enum("structured_kind", "json", ["json", "tool_call"], "the grammar requests' kind: a JSON "
                  "schema on /v1/completions, or a required tool call on /v1/chat/completions")
flags.DEFINE_string("api_key", None, "sent as Authorization: Bearer KEY")
flags.DEFINE_string("result_json", None, "write the results here")
flags.DEFINE_bool("allow_remote", False, "allow a non-loopback server")
flags.DEFINE_float("timeout_s", 600.0, "per-request timeout")
flags.DEFINE_string("baseline_model", None, "also run LLM.generate on the same prompts one by one over this "
                    "model ('demo': the shipped demo model) and report its output tokens/s")
flags.DEFINE_string("baseline_dtype", "float32", "dtype of the baseline LLM")
flags.DEFINE_integer("baseline_max_num_seqs", 32, "max_num_seqs of the baseline LLM (as the server's: it sizes "
                     "the page pool on CPU)")
flags.DEFINE_integer("baseline_max_model_len", None, "max_model_len of the baseline LLM (as the server's)")


def prompts(n: int, length: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(low, high) for _ in range(length)] for _ in range(n)]


def percentiles(xs, ps=(50, 90, 99)) -> dict:
    import numpy as np
    if not xs:
        return {f"p{p}": None for p in ps} | {"mean": None}
    a = np.asarray(xs, np.float64) * 1e3
    return {f"p{p}": float(np.percentile(a, p)) for p in ps} | {"mean": float(a.mean())}


async def one(session, url, body, headers, timeout) -> dict:
    """One streamed request: its token arrival times."""
    import aiohttp
    t0 = time.perf_counter()
    times, n_tokens, err = [], 0, None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"].get("message")
                    break
                if chunk.get("usage"):
                    n_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):    # a step's tokens (the server streams one even when its text is empty)
                    times.append(time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if err is not None:
        return {"error": err}
    return {"start": t0, "times": times, "end": time.perf_counter(), "output_tokens": n_tokens}


def grammar_schema(output_len: int) -> dict:
    """A JSON schema whose shortest instance is longer than output_len tokens."""
    return {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                       "minItems": output_len}},
            "required": ["items"], "additionalProperties": False}


def request(model: str, prompt: list, output_len: int, grammar: Optional[str]) -> tuple[str, dict]:
    """(path, body) of one streamed greedy request; grammar None, 'json' or 'tool_call'."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if grammar == "tool_call":
        tool = {"type": "function", "function": {"name": "record", "description": "Record the items.",
                                                 "parameters": grammar_schema(output_len)}}
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Record some items."}],
                                        "tools": [tool], "tool_choice": "required"}
    if grammar == "json":
        body["structured_outputs"] = {"json": grammar_schema(output_len)}
    return "/v1/completions", {**body, "prompt": prompt}


async def bench(url: str, model: str, ps: list, output_len: int, concurrency: int, rate: float, headers,
                seed: int, timeout: float, ratio: float = 0.0, kind: str = "json") -> dict:
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed + 1)
    conn = aiohttp.TCPConnector(limit=concurrency)
    picks = random.Random(seed + 2)
    grammars = [kind if picks.random() < ratio else None for _ in ps]

    async def task(p, delay, grammar):
        await asyncio.sleep(delay)
        async with sem:
            path, body = request(model, p, output_len, grammar)
            return await one(session, url + path, body, headers, timeout)

    delays, t = [], 0.0
    for _ in ps:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[task(p, d, g) for p, d, g in zip(ps, delays, grammars)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["times"][0] - r["start"] for r in ok if r["times"]]
    tpot = [(r["end"] - r["times"][0]) / (r["output_tokens"] - 1) for r in ok
            if r["times"] and r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {"num_prompts": len(ps), "max_concurrency": concurrency, "request_rate": rate,
            "structured_output_ratio": ratio, "structured_kind": kind,
            "structured_requests": sum(g is not None for g in grammars),
            "completed": len(ok), "errors": len(errors), "error_samples": errors[:5], "duration_s": wall,
            "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
            "total_output_tokens": out_tokens, "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles(itl)}


def baseline(model: str, dtype: str, ps: list, output_len: int, max_num_seqs: int, max_model_len) -> dict:
    """LLM.generate on the same prompts, one request at a time (the server's concurrency-1 work)."""
    from kimi_jax.engine.sampling import SamplingParams
    from kimi_jax.entrypoints.llm import LLM
    llm = LLM(None if model == "demo" else model, dtype=dtype, max_num_seqs=max_num_seqs,
              max_model_len=max_model_len)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([ps[0]], sp, use_tqdm=False)   # compile
    t0 = time.perf_counter()
    n = sum(len(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in ps)
    wall = time.perf_counter() - t0
    return {"requests": len(ps), "output_tokens": n, "duration_s": wall, "output_throughput": n / wall}


def report(res: dict) -> str:
    f = lambda d: " ".join(f"{k}={v:.1f}" for k, v in d.items() if v is not None)
    return (f"concurrency {res['max_concurrency']}, structured {res['structured_requests']}: "
            f"{res['completed']}/{res['num_prompts']} ok, "
            f"{res['errors']} errors, {res['duration_s']:.1f}s, {res['request_throughput']:.2f} req/s, "
            f"{res['output_throughput']:.1f} out tok/s\n  TTFT ms {f(res['ttft_ms'])}\n"
            f"  TPOT ms {f(res['tpot_ms'])}\n  ITL ms  {f(res['itl_ms'])}")


COMPILES_METRIC = "kimi_jax:compiled_programs"


async def compiled_programs(url, headers):
    """The server's count of compiled programs (its /metrics `kimi_jax:compiled_programs`), or None where it
    has no such metric or no /metrics."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics", headers=headers) as r:
                if r.status != 200:
                    return None
                text = await r.text()
    except aiohttp.ClientError:
        return None
    found = [x.value for fam in text_string_to_metric_families(text) if fam.name == COMPILES_METRIC
             for x in fam.samples if x.name.endswith("_total")]
    return sum(found) if found else None


async def _model_name(url, headers) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models", headers=headers) as r:
            return (await r.json())["data"][0]["id"]


def main(argv):
    del argv
    url = FLAGS.base_url.rstrip("/")
    if not FLAGS.allow_remote:
        try:
            common.check_loopback(url, " (pass --allow_remote to load it)")
        except ValueError as e:
            common.fail(PROG, e)
    if FLAGS.num_prompts < 1 or FLAGS.max_concurrency < 1 or FLAGS.input_len < 1 or FLAGS.output_len < 1:
        common.fail(PROG, "--num_prompts, --max_concurrency, --input_len and --output_len must be >= 1")
    if not 0.0 <= FLAGS.structured_output_ratio <= 1.0:
        common.fail(PROG, f"--structured_output_ratio must be in [0, 1], got {FLAGS.structured_output_ratio}")
    headers = {"Authorization": f"Bearer {FLAGS.api_key}"} if FLAGS.api_key else {}
    try:
        model = FLAGS.model or asyncio.run(_model_name(url, headers))
    except OSError as e:
        common.fail(PROG, f"cannot reach {url}: {e}")
    ps = prompts(FLAGS.num_prompts, FLAGS.input_len, FLAGS.seed, FLAGS.vocab_low, FLAGS.vocab_high)
    if FLAGS.num_warmups > 0:
        warm = prompts(FLAGS.num_warmups, FLAGS.input_len, FLAGS.seed + 1, FLAGS.vocab_low, FLAGS.vocab_high)
        w = asyncio.run(bench(url, model, warm, FLAGS.output_len, FLAGS.max_concurrency, float("inf"), headers,
                              FLAGS.seed, FLAGS.timeout_s, FLAGS.structured_output_ratio, FLAGS.structured_kind))
        if w["errors"]:
            common.fail(PROG, f"warm-up requests failed: {w['error_samples']}")
    before = asyncio.run(compiled_programs(url, headers))
    res = asyncio.run(bench(url, model, ps, FLAGS.output_len, FLAGS.max_concurrency, FLAGS.request_rate,
                            headers, FLAGS.seed, FLAGS.timeout_s, FLAGS.structured_output_ratio,
                            FLAGS.structured_kind))
    after = asyncio.run(compiled_programs(url, headers))
    res.update(input_len=FLAGS.input_len, output_len=FLAGS.output_len, model=model,
               compiles_during_run=None if before is None or after is None else int(after - before))
    print(report(res))
    if res["compiles_during_run"] is not None:
        print(f"  programs compiled during the timed run: {res['compiles_during_run']}")
    if FLAGS.baseline_model:
        res["baseline"] = baseline(FLAGS.baseline_model, FLAGS.baseline_dtype, ps, FLAGS.output_len,
                                   FLAGS.baseline_max_num_seqs, FLAGS.baseline_max_model_len)
        b = res["baseline"]
        print(f"LLM.generate one by one: {b['output_throughput']:.1f} out tok/s "
              f"({b['output_tokens']} tokens in {b['duration_s']:.1f}s)")
    if FLAGS.result_json:
        with open(FLAGS.result_json, "w") as f:
            json.dump(res, f, indent=1)
    sys.stdout.flush()


def run(argv=None):
    common.run(main, PROG, __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
