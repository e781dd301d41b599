"""Hostile requests through LLM: every bad value is refused up front with one line naming the request
and the field, the engine keeps serving (results equal a clean run's), and a request that outgrows the
page pool ends at the pool's limit instead of spinning."""
from __future__ import annotations

import pytest

from kimi_jax import LLM
from kimi_jax.engine.sampling import SamplingParams

GOOD = [([5, 6, 7], SamplingParams(temperature=0, max_tokens=4)),
        ([9, 10], SamplingParams(temperature=0.8, seed=3, max_tokens=5)),
        ([11, 12, 13], SamplingParams(temperature=0.9, seed=2 ** 64 - 1, max_tokens=4))]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    # a pool of 4 pages of 16 tokens: less than max_model_len (256), so one request can outgrow it
    return LLM(tiny_ckpt, dtype="float32", max_num_seqs=4, num_gpu_blocks_override=4, block_size=16)


@pytest.fixture(scope="module")
def clean(llm):
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in GOOD], [sp for _, sp in GOOD])]


BAD_PARAMS = [   # (SamplingParams kwargs, words of the message)
    (dict(top_k=2 ** 31 + 1, temperature=0.5), None),           # accepted: at or above the vocabulary is "off"
    (dict(logprobs=513), ["logprobs", "vocabulary"]),
    (dict(logprobs=True), ["logprobs"]),
    (dict(temperature=float("inf")), ["temperature", "finite"]),
    (dict(temperature=float("nan")), ["temperature"]),
    (dict(top_p=float("nan")), ["top_p"]),
    (dict(seed=2 ** 64), ["seed", "64 bits"]),
    (dict(seed="7"), ["seed", "integer"]),
    (dict(seed=True), ["seed"]),
    (dict(top_k=2.0), ["top_k"]),
    (dict(max_tokens=0), ["max_tokens"]),
    (dict(stop_token_ids=[1, 600]), ["stop_token_ids", "vocabulary"]),
    (dict(stop=[""]), ["stop"]),
]


def kw_field(kw: dict) -> str:
    return next(k for k in kw if k != "temperature" or len(kw) == 1)


@pytest.mark.parametrize("kw,words", BAD_PARAMS, ids=[",".join(k) + str(i) for i, (k, _) in enumerate(BAD_PARAMS)])
def test_bad_sampling_value_is_refused_naming_request_and_field(llm, clean, kw, words):
    prompts = [p for p, _ in GOOD]
    params = [sp for _, sp in GOOD]
    if words is not None and not ({"logprobs", "stop_token_ids"} & set(kw) and "vocabulary" in words):
        with pytest.raises(ValueError) as e:       # refused when built, naming the field
            SamplingParams(**{"max_tokens": 5, **kw})
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words) and getattr(e.value, "field", None) == kw_field(kw), msg
        return
    params[1] = SamplingParams(**{"max_tokens": 5, **kw})
    if words is None:      # an accepted edge value: runs, and the others are unchanged
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [clean[0], clean[2]]
        return
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, params)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("request 1: ") and all(w in msg for w in words), msg
    # nothing is lost: the engine serves the same requests, with the same results, right after
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, [sp for _, sp in GOOD])] == clean


@pytest.mark.parametrize("prompt,words", [
    ([5, True, 7], ["prompt token 1", "True"]),
    ([5, 6.0], ["prompt token 1"]),
    ([5, 512], ["token id 512", "vocabulary"]),
    ([5, -1], ["token id -1"]),
    (7.5, ["prompt"]),
    (None, ["prompt"]),
    ({"x": 1}, ["prompt"]),
    ([], ["empty prompt"]),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": "x"}}, ["'multi_modal_data'", "not supported"]),
    ({"prompt_token_ids": [5, 6], "mm_processor_kwargs": {"a": 1}}, ["'mm_processor_kwargs'"]),
    ({"prompt_token_ids": [5, 6], "extra": 1}, ["'extra'"]),
])
def test_bad_prompt_is_refused_naming_request(llm, clean, prompt, words):
    prompts = [GOOD[0][0], prompt, GOOD[2][0]]
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, [sp for _, sp in GOOD])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("request 1: ") and all(w in msg for w in words), msg
    assert [o.outputs[0].token_ids for o in llm.generate([p for p, _ in GOOD], [sp for _, sp in GOOD])] == clean


def test_seeds_of_64_bits_are_distinct_streams(llm):
    """A seed is taken as 64 bits: seeds 5 and 2^32 + 5 give different streams (sampled)."""
    sp = lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True)
    a, b, a2 = llm.generate([[5, 6], [5, 6], [5, 6]], [sp(5), sp(2 ** 32 + 5), sp(5)])
    assert a.outputs[0].token_ids == a2.outputs[0].token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_lone_request_that_outgrows_the_pool_ends_at_its_limit(llm):
    """4 pages of 16 tokens and no other request to preempt: the request ends with "length" once the
    pool is full, its tokens those of a shorter run (greedy) up to there."""
    prompt, sp = [3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    out = llm.generate(prompt, sp)[0].outputs[0]
    assert out.finish_reason == "length"
    assert 64 - len(prompt) <= len(out.token_ids) <= 64 - len(prompt) + 1
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert out.token_ids[:20] == ref.token_ids
