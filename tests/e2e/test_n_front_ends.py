"""One `n` under every front end: LLM.generate / LLM.chat, the OpenAI server (the official `openai`
client against /v1/completions and /v1/chat/completions) and kimi-batch give the same completions
for the same prompt, sampling parameters and seed, with n = 1, 2 and 4 (the demo model, float32).

Every front end makes its samples through EngineCore.make_request (sample i keyed by the seed's
stream i) and prefills the prompt once for all of them, so the texts are equal exactly: no tolerance.
Prefix caching is off so that every run takes the same programs whatever ran before it."""
import io
import json

import pytest

pytest.importorskip("openai")

NAME = "demo"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
SAMPLING = dict(temperature=0.9, top_p=0.95, max_tokens=12, seed=7)


@pytest.fixture(scope="module")
def fronts():
    import openai

    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    from tests.e2e.serving import serving
    llm = LLM(None, dtype="float32", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
    srv = OpenAIServer(llm.frontend, served_model_name=NAME)
    with serving(srv) as url:
        yield llm, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), srv


def _batch(llm, tmp_path, bodies: list[tuple[str, dict]]) -> dict:
    """kimi-batch's job over these (url, body) lines: custom_id -> response body."""
    from kimi_jax.entrypoints import batch as B
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})
             for i, (url, body) in enumerate(bodies)]
    out = tmp_path / "out.jsonl"
    B.run_job(llm.frontend, io.BytesIO("\n".join(lines).encode() + b"\n"), B.ResultWriter(str(out)),
              model_name=NAME, default_max_tokens=16, progress=False)
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in got), got
    return {r["custom_id"]: r["response"]["body"] for r in got}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_completions_are_the_same_from_every_front_end(fronts, tmp_path, n):
    from kimi_jax import SamplingParams
    llm, client, _ = fronts
    ref = [c.text for c in llm.generate(PROMPT, SamplingParams(n=n, **SAMPLING), use_tqdm=False)[0].outputs]
    assert len(ref) == n and all(ref)
    if n == 4:
        assert len(set(ref)) > 1                   # the samples are sampled, not copies of one
    served = client.completions.create(model=NAME, prompt=PROMPT, n=n, **SAMPLING)
    assert [c.text for c in sorted(served.choices, key=lambda c: c.index)] == ref
    body = _batch(llm, tmp_path, [("/v1/completions", dict(model=NAME, prompt=PROMPT, n=n, **SAMPLING))])
    assert [c["text"] for c in sorted(body["c0"]["choices"], key=lambda c: c["index"])] == ref


@pytest.mark.parametrize("n", [1, 2, 4])
def test_chat_is_the_same_from_every_front_end(fronts, tmp_path, n):
    from kimi_jax import SamplingParams
    llm, client, _ = fronts
    ref = [c.text for c in llm.chat(MESSAGES, SamplingParams(n=n, **SAMPLING), use_tqdm=False)[0].outputs]
    assert len(ref) == n
    served = client.chat.completions.create(model=NAME, messages=MESSAGES, n=n, **SAMPLING)
    assert [c.message.content for c in sorted(served.choices, key=lambda c: c.index)] == ref
    body = _batch(llm, tmp_path, [("/v1/chat/completions", dict(model=NAME, messages=MESSAGES, n=n,
                                                                **SAMPLING))])
    assert [c["message"]["content"] for c in sorted(body["c0"]["choices"], key=lambda c: c["index"])] == ref
    # the chat prompt's ids through /v1/completions: the same samples as the conversation
    ids = llm.encode_chat(MESSAGES)
    as_ids = client.completions.create(model=NAME, prompt=ids, n=n, **SAMPLING)
    assert [c.text for c in sorted(as_ids.choices, key=lambda c: c.index)] == ref


def test_the_server_prefills_a_prompt_once_for_its_samples(fronts):
    """n = 4 through the server: the prompt is prefilled once (all but its last token), and each
    sample then feeds that last token itself, as under LLM.generate."""
    llm, client, srv = fronts
    ids = llm.inputs.token_ids(PROMPT)
    stats = srv.async_llm.core.stats
    before = stats["prompt_tokens"]
    client.completions.create(model=NAME, prompt=PROMPT, n=4, **SAMPLING)
    assert stats["prompt_tokens"] - before == (len(ids) - 1) + 4
