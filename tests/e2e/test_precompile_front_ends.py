"""EngineConfig.precompile in the front ends (kimi-serve / kimi-batch --precompile). The
OpenAIServer compiles its engine core's program set before /health answers 200 (503 meanwhile, the
engine thread not yet started), so a mixed workload through the `openai` client (greedy, sampled,
logprobs, penalties, a one-token, a short and a chunked prompt, streamed, chat) builds no program
after ready (kimi_jax:compiled_programs_total on /metrics); kimi-batch compiles it before its first
line, and its lines then build none. The ragged step layout at small limits: its set is about 15
programs."""
import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

from tests.e2e.serving import free_socket, serving

openai = pytest.importorskip("openai")

NAME = "demo"
LIMITS = dict(max_num_seqs=3, block_size=4, max_model_len=256, step_layout="ragged",
              max_num_batched_tokens=24, long_prefill_token_threshold=16)
LONG = " ".join(["The with statement closes the file it opened."] * 6)     # > 16 tokens: chunks
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get", "parameters": SCHEMA}}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def compiled_programs(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(_get(url + "/metrics")[1]):
        for sample in family.samples:
            if sample.name == "kimi_jax:compiled_programs_total":
                return sample.value
    raise AssertionError("kimi_jax:compiled_programs_total is not on /metrics")


def _workload(client) -> list:
    greedy = dict(model=NAME, temperature=0.0)
    chat = [{"role": "user", "content": "What does json.dumps do?"}]
    calls = [
        lambda: client.completions.create(prompt="The with statement", max_tokens=8, logprobs=2,
                                          **greedy),
        lambda: client.completions.create(model=NAME, prompt=LONG, max_tokens=6, temperature=0.8,
                                          top_p=0.9, seed=1),
        lambda: client.chat.completions.create(messages=chat, max_tokens=6, logprobs=True,
                                               top_logprobs=3, **greedy),
        lambda: list(client.completions.create(
            prompt=LONG, max_tokens=10, frequency_penalty=0.5, stream=True,
            extra_body={"repetition_penalty": 1.2, "ignore_eos": True}, **greedy)),
        lambda: client.completions.create(prompt=[7], max_tokens=4, logit_bias={"9": 3.0},
                                          **greedy),
        lambda: list(client.chat.completions.create(model=NAME, messages=chat, max_tokens=8,
                                                    temperature=1.0, seed=2, stream=True)),
        # a grammar (split overlapped steps), a required tool, n = 2, a prompt near max_model_len
        # (prompt logprobs, which the server does not take: the LLM test in test_ragged_engine.py)
        lambda: client.chat.completions.create(messages=chat, max_tokens=24, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, **greedy),
        lambda: client.chat.completions.create(messages=chat, max_tokens=24, tools=[TOOL],
                                               tool_choice="required", **greedy),
        lambda: client.completions.create(model=NAME, prompt="The sky", max_tokens=5, n=2,
                                          temperature=0.9, seed=3),
        lambda: client.completions.create(prompt=[7] * 248, max_tokens=4, **greedy),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_no_program_is_built_after_the_server_is_ready():
    from kimi_jax.engine import compiles
    from kimi_jax.engine.args import EngineConfig
    from kimi_jax.entrypoints.frontend import Frontend
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    fe = Frontend.from_config(EngineConfig(None, dtype="float32", precompile=True, seed=0,
                                           **LIMITS))
    srv = OpenAIServer(fe, served_model_name=NAME)
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    seen = {}
    precompile = fe.precompile

    def spy(core):
        seen.update(health=_get(url + "/health")[0], engine_running=srv.async_llm.alive,
                    before=compiles.compile_count(), programs=len(core.programs()))
        return precompile(core)
    fe.precompile = spy
    with serving(srv, sock=sock) as url:
        at_ready = compiled_programs(url)
        assert seen.get("health") == 503 and seen["engine_running"] is False, seen
        assert at_ready - seen["before"] >= seen["programs"] > 0, (at_ready, seen)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = _workload(client)
        assert len(out[0].choices[0].logprobs.tokens) == 8
        assert all(len(t.top_logprobs) == 3 for t in out[2].choices[0].logprobs.content)
        assert srv.async_llm.core.stats["ragged_passes"] > 10
        assert len(out[8].choices) == 2 and out[7].choices[0].message.tool_calls
        assert compiled_programs(url) == at_ready


def test_kimi_batch_builds_no_program_after_precompile(cli, tmp_path, monkeypatch):
    from kimi_jax.engine import compiles
    from kimi_jax.entrypoints.frontend import Frontend
    precompile, done = Frontend.precompile, []

    def spy(self, core):
        n = precompile(self, core)
        done.append((n, compiles.compile_count()))
        return n
    monkeypatch.setattr(Frontend, "precompile", spy)
    chat = [{"role": "user", "content": "Say hi"}]
    bodies = [
        ("/v1/completions", dict(prompt="The with statement", max_tokens=6, temperature=0,
                                 logprobs=2)),
        ("/v1/completions", dict(prompt=LONG, max_tokens=5, temperature=0.8, seed=1)),
        ("/v1/chat/completions", dict(messages=chat, max_tokens=4, temperature=0, logprobs=True,
                                      top_logprobs=3)),
        ("/v1/completions", dict(prompt=[7], max_tokens=8, temperature=0, presence_penalty=0.5)),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": u,
                                       "body": b}) + "\n" for i, (u, b) in enumerate(bodies)))
    limits = {k: v for k, v in LIMITS.items() if k != "block_size"}   # kimi-batch: 16 a page
    res = cli("launch.batch", f"--input={inp}", f"--output={out}", "--precompile",
              "--dtype=float32", *[f"--{k}={v}" for k, v in limits.items()])
    assert res.returncode == 0, res
    ((n, built),) = done
    assert f"precompiled {n} / {n} programs" in res.stderr, res
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in got] == [200] * len(bodies), got
    assert compiles.compile_count() == built
