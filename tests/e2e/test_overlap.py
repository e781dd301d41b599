"""Overlap scheduling (decode step N+1 dispatched before step N's tokens are read): every request's
tokens, logprobs, finish and stop reasons equal the ordinary scheduler's, with requests finishing at
different steps (max_tokens, stop tokens, eos, stop strings), more requests than slots (admission
mid-run), chunked prefill and preemption under page pressure; and the chain really overlaps."""
from __future__ import annotations

import numpy as np
import pytest

from kimi_jax import SamplingParams
from kimi_jax.config import preset

CFG = preset("tiny")


@pytest.fixture(scope="module")
def pool_slots():
    """3 slots for `pool_llm` (tests/e2e/conftest.py): most runs here have more requests than that."""
    return 3


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(n)]


def mixed_params(n, seed, **kw):
    """Greedy and seeded top-p rows alternating, max_tokens 1..14 (requests end at different steps)."""
    lens = np.random.default_rng(seed).integers(1, 15, n)
    return [SamplingParams(max_tokens=int(m), **({"temperature": 0.0} if i % 2 else
                                                  {"temperature": 0.8, "top_p": 0.9}), **kw)
            for i, m in enumerate(lens)]


def generate(llm, ps, params, overlap, stream=False):
    """(requests, engine stats) of one run through a fresh engine core."""
    core = llm.frontend.make_core(overlap_scheduling=overlap)
    s = core.scheduler
    assert s.overlap == overlap
    reqs = [r for i, (p, sp) in enumerate(zip(ps, params))
            for r in core.make_request(str(i), p, sp, seed=100 + i)]
    for r in reqs:
        core.add([r])
    if stream:                        # as kimi-generate --stream drives it: outputs only ever grow
        seen = {r.request_id: 0 for r in reqs}
        while core.has_unfinished():
            core.step()
            for r in reqs:
                assert seen[r.request_id] <= len(r.output_ids) <= r.max_new
                seen[r.request_id] = len(r.output_ids)
        core.drain()
    else:
        core.run()
    assert not s.running and not s.waiting and core.runner.inflight is None and s.inflight is None
    assert len(s.pool.free) == s.pool.num_pages      # every page came back
    return reqs, core.stats


def summary(reqs):
    return [(r.output_ids, r.finish_reason, r.stop_reason, r.text, [sorted(lp) for lp in r.logprobs])
            for r in reqs]


def assert_same(got, ref):
    """Tokens, finish and stop reasons, text and top-logprob ids identical; logprob values to float
    noise (a row's logits move ~1e-6 with its batch's padded shape, on either path)."""
    assert summary(got) == summary(ref)
    for g, r in zip(got, ref):
        if r.params.logprobs is not None:
            vals = lambda q: [v.logprob for lp in q.logprobs for _, v in sorted(lp.items())] + [q.cumulative_logprob]
            np.testing.assert_allclose(vals(g), vals(r), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_overlap_gives_the_same_tokens_under_pressure(pool_llm):
    """Greedy and seeded rows, admission mid-run, preemption; then the same requests with stop tokens
    taken from their own outputs (ends by 'stop' at different steps)."""
    ps = prompts(7)
    params = mixed_params(len(ps), seed=1, ignore_eos=True)
    ref, ref_stats = generate(pool_llm, ps, params, overlap=False)
    got, stats = generate(pool_llm, ps, params, overlap=True)
    assert_same(got, ref)
    assert stats["generated_tokens"] == ref_stats["generated_tokens"]
    assert stats["preemptions"] > 0 and stats["overlapped_steps"] > 0, stats

    stops = [SamplingParams(**{**sp.__dict__, "max_tokens": 20, "stop_token_ids": [r.output_ids[len(r.output_ids) // 2]]})
             for r, sp in zip(ref, params)]
    ref, _ = generate(pool_llm, ps, stops, overlap=False)
    got, stats = generate(pool_llm, ps, stops, overlap=True)
    assert_same(got, ref)
    assert stats["overlapped_steps"] > 0
    assert sum(r.finish_reason == "stop" for r in got) >= 4


def test_overlap_eos_stop_strings_logprobs_streaming(pool_llm, monkeypatch, word_tokenizer):
    """The model's eos (made a token it often produces), stop strings found one step behind, logprobs,
    and the engine driven step by step as the streaming CLI does (outputs read between steps only
    grow)."""
    monkeypatch.setattr(pool_llm.frontend, "tokenizer", word_tokenizer)
    ps = prompts(6, seed=3)
    params = mixed_params(len(ps), seed=4, logprobs=2)
    ref, _ = generate(pool_llm, ps, params, overlap=False)
    counts = np.bincount(np.concatenate([r.output_ids for r in ref]), minlength=CFG.vocab_size)
    eos = (int(counts.argmax()),)
    monkeypatch.setattr(pool_llm.frontend, "config", pool_llm.config.replace(eos_token_id=eos))
    word = f" w{ref[0].output_ids[len(ref[0].output_ids) // 2]}"
    params = [SamplingParams(**{**sp.__dict__, "max_tokens": 24, "stop": [word]}) for sp in params]
    ref, _ = generate(pool_llm, ps, params, overlap=False)
    got, stats = generate(pool_llm, ps, params, overlap=True, stream=True)
    assert_same(got, ref)
    assert stats["overlapped_steps"] > 0
    assert {r.finish_reason for r in got} <= {"stop", "length"}
    assert any(r.stop_reason == word for r in got) and any(isinstance(r.stop_reason, int) for r in got)


def test_overlap_is_off_with_speculation(pool_llm, monkeypatch):
    """Drafts need each step's tokens on the host: speculation runs the ordinary path."""
    from kimi_jax.engine.speculative import SpeculativeConfig
    assert pool_llm.frontend.make_core(overlap_scheduling=True).scheduler.overlap is True
    spec = pool_llm.frontend.make_core(overlap_scheduling=True,
                                       speculative_config=SpeculativeConfig())
    assert spec.scheduler.overlap is False


def test_decode_step_schedule_choice(pool_llm, monkeypatch):
    """The engine's per-step MLA schedule: 'balanced' only on the Pallas kernels for a large, skewed
    batch (host-side positions); a step traced with it gives the same tokens (on CPU the XLA path
    runs, so this checks the plumbing: the static argument reaches the step, one more compile)."""
    from kimi_jax.engine import mla_schedule
    big, pick = mla_schedule.BALANCE_MIN_TOKENS, mla_schedule.mla_schedule_for
    assert pick([big, 10, 10, -1], pallas=True) == "balanced"
    assert pick([big, 10, 10, -1], pallas=False) is None       # the XLA path
    assert pick([big // 2] * 4, pallas=True) is None           # equal rows
    assert pick([big // 4, 10, -1], pallas=True) is None       # small batch
    assert pick([-1, -1], pallas=True) is None
    ps = prompts(4, seed=3)
    params = mixed_params(len(ps), seed=4, ignore_eos=True)
    ref, _ = generate(pool_llm, ps, params, overlap=True)
    seen = []
    monkeypatch.setattr(mla_schedule, "mla_schedule_for",
                        lambda pos, pallas: seen.append(pallas) or "balanced")
    got, _ = generate(pool_llm, ps, params, overlap=True)
    assert seen and not any(seen)                     # asked on every decode step, XLA on CPU
    assert_same(got, ref)
