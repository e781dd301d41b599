"""step_layout="ragged" (one step an iteration over a flat token axis, decode rows and prompt chunks
mixed within max_num_batched_tokens) against the padded layout (prefill and decode passes) on one
mixed workload, float32: prompts of different lengths admitted while others decode, prompts chunked
by long_prefill_token_threshold / prefill_chunk, a prefix-cache hit, preemption in a small pool,
logprobs, prompt_logprobs, penalties, n > 1 and (the demo model, which has a tokenizer) a
json_schema request. Tokens are equal; logprobs agree within LOGPROB_TOL. On one device and the 8 simulated
devices' TP, DP+TP+EP and DP+EP layouts. Overlap scheduling chains any ragged step onto the one in
flight and gives the synchronous ragged tokens."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset
from kimi_jax.engine import compiles
from kimi_jax.engine.requests import prompt_entries_left
from kimi_jax.engine.structured_params import StructuredOutputsParams

# Both layouts compute the same float32 logits with attention summed in another order (the ragged
# kernel's online softmax over pages against the padded programs' expanded or absorbed MLA): the
# logprobs differ by ~1e-6 on these models; 1e-4 leaves room and still catches a wrong row, position
# or page (those move logprobs by far more than 1e-2).
LOGPROB_TOL = 1e-4
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SCHED = {"padded": dict(prefill_chunk=16, max_prefill_tokens=24),
         "ragged": dict(step_layout="ragged", max_num_batched_tokens=24,
                        long_prefill_token_threshold=16)}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


def workload(vocab: int, structured: bool):
    """(prompts, params): a shared 24-token prefix (6 pages of 4) in three prompts, short and long
    prompts, every kind of request the layouts treat apart."""
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    prefix = ids(24)
    greedy = dict(temperature=0.0, ignore_eos=True)
    reqs = [
        (prefix + ids(13), SamplingParams(max_tokens=6, logprobs=2, **greedy)),
        (ids(5), SamplingParams(max_tokens=12, prompt_logprobs=1, **greedy)),
        (ids(47), SamplingParams(max_tokens=4, **greedy)),                  # three chunks
        (prefix + ids(5), SamplingParams(max_tokens=8, repetition_penalty=1.3,
                                         frequency_penalty=0.5, **greedy)),
        (ids(9), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)),
        (prefix + ids(3), SamplingParams(max_tokens=5, prompt_logprobs=2, logprobs=1, **greedy)),
        (ids(2), SamplingParams(max_tokens=9, logit_bias={5: 3.0}, min_tokens=2, **greedy)),
    ]
    if structured:
        reqs.append((ids(6), SamplingParams(
            max_tokens=40, temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=SCHEMA))))
    return [p for p, _ in reqs], [sp for _, sp in reqs]


def run(llm, prompts, params):
    """Every request through a fresh core of llm (three run at a time): (samples, stats)."""
    core = llm.frontend.make_core()
    groups = [core.add_request(str(i), p, sp, seed=i)
              for i, (p, sp) in enumerate(zip(prompts, params))]
    core.run()
    pool = core.scheduler.pool
    assert len(pool.free) == pool.num_pages                   # every page came back
    return [r for g in groups for r in g], core.stats


def same_logprobs(a: list, b: list):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert set(x) == set(y)
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) <= LOGPROB_TOL, (t, x[t], y[t])


def compare(model, layout, structured, pages, preempts=True):
    kw = dict(dtype="float32", max_num_seqs=3, block_size=4, max_model_len=128,
              num_gpu_blocks_override=pages, enable_prefix_caching=True, **layout)
    llms = {name: LLM(model, **kw, **sched) for name, sched in SCHED.items()}
    vocab = llms["padded"].frontend.steps.cfg.vocab_size
    prompts, params = workload(vocab, structured)
    (ref, ref_stats), (got, stats) = (run(llms[n], prompts, params) for n in SCHED)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    for g, r in zip(got, ref):
        same_logprobs(g.logprobs, r.logprobs)
        assert (g.prompt_logprobs is None) == (r.prompt_logprobs is None)
        same_logprobs(g.prompt_logprobs or [], r.prompt_logprobs or [])
        if g.params.logprobs is not None:
            assert abs(g.cumulative_logprob - r.cumulative_logprob) <= 10 * LOGPROB_TOL
    assert stats["ragged_passes"] == stats["steps"] > 0
    assert stats["prefill_passes"] == stats["decode_passes"] == 0 < ref_stats["prefill_passes"]
    assert (stats["preemptions"] > 0) == preempts and stats["prefix_cache_hits"] > 0
    assert stats["prompt_tokens"] >= sum(len(p) for p in prompts) - stats["prefix_cache_hits"]
    return llms["ragged"], got


# the tiny model's parity (tp4 below) and the demo's constrained rows in the ragged layout
# (test_overlapped_ragged_steps_give_the_synchronous_tokens) run by default
@pytest.mark.slow
def test_ragged_gives_the_padded_tokens_on_the_demo_model():
    llm, got = compare(None, {}, structured=True, pages=20)
    jsonschema.validate(json.loads(llm.tokenizer.decode(got[-1].output_ids)), SCHEMA)


@pytest.mark.parametrize("layout,pages", [
    (dict(tensor_parallel_size=4), 20),
    pytest.param(dict(data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True),
                 2 * 13, marks=pytest.mark.slow),
    pytest.param(dict(data_parallel_size=8, enable_expert_parallel=True), 8 * 16,
                 marks=pytest.mark.slow),
], ids=["tp4", "dp2tp4ep", "dp8ep"])
def test_ragged_gives_the_padded_tokens(ckpt, layout, pages):
    """8 simulated devices; under dp8 each rank runs one request (nothing to preempt)."""
    compare(ckpt, layout, structured=False, pages=pages,
            preempts=layout.get("data_parallel_size", 1) < 8)


def chain_workload(llm, structured: bool):
    """workload's requests plus (second) one ending at a stop token mid-chain (the greedy run's
    fifth token of its prompt), and the index of one to abort (the penalised one)."""
    prompts, params = workload(llm.frontend.steps.cfg.vocab_size, structured)
    core = llm.frontend.make_core(overlap_scheduling=False)
    (probe,) = core.add_request("probe", prompts[1], SamplingParams(max_tokens=6, temperature=0.0,
                                                                    ignore_eos=True))
    core.run()
    stop = probe.output_ids[4]
    prompts.insert(1, prompts[1])
    params.insert(1, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                    stop_token_ids=[stop], logprobs=1))
    return prompts, params, 4


def chain_run(llm, prompts, params, abort: int, overlap: bool):
    """Every request through a fresh core, stepped by hand: request `abort` is aborted once it has
    three tokens (overlap: and a step is in flight). (samples, stats, each plan run as `spy`
    records it)."""
    core = llm.frontend.make_core(overlap_scheduling=overlap)
    groups = [core.add_request(str(i), p, sp, seed=i)
              for i, (p, sp) in enumerate(zip(prompts, params))]
    plans, run, s = [], core.runner.run, core.scheduler
    def spy(plan):
        """each plan run: whether every running request could overlap unsplit (no grammar, no
        prompt scored), whether a row of it scores its prompt, whether one is constrained"""
        plans.append((plan, all(r.structured is None and not prompt_entries_left(r)
                                for r in s.running),
                      any(prompt_entries_left(row.req) for row in plan.live),
                      any(row.req.structured is not None for row in plan.live)))
        return run(plan)
    core.runner.run = spy
    target = groups[abort][0]
    while core.has_unfinished():
        core.step()
        if (target.finish_reason is None and len(target.output_ids) >= 3
                and (s.inflight is not None) == overlap):
            assert core.abort(target.request_id) is target
    core.drain()
    pool = core.scheduler.pool
    assert len(pool.free) == pool.num_pages                   # every page came back
    assert target.finish_reason == "abort"
    return [r for g in groups for r in g], core.stats, plans


@pytest.mark.parametrize("seqs,layout,structured", [
    (4, {}, True),
    (1, {}, False),
    pytest.param(8, dict(data_parallel_size=8, enable_expert_parallel=True), False,
                 marks=pytest.mark.slow),
], ids=["seqs4-json", "seqs1", "dp8ep"])
def test_overlapped_ragged_steps_give_the_synchronous_tokens(seqs, layout, structured):
    """Under overlap every ragged step is planned while the one before runs, its decode rows fed
    that step's sampled tokens on the device, whatever the mix (prompts admitted beside decode
    rows, fewer than 16 rows, one stream, rows ending at max_tokens or a stop token, an abort with
    a step in flight); a step with a json_schema row is split (sampled once the step before is
    booked, its grammar advanced) and still chained; steps with a prompt scoring its logprobs run
    synchronously. Tokens and logprobs equal the synchronous run's."""
    llm = LLM(None, dtype="float32", max_num_seqs=seqs, block_size=4, max_model_len=128,
              **SCHED["ragged"], **layout)
    prompts, params, abort = chain_workload(llm, structured)
    (ref, ref_stats, _), (got, stats, plans) = (
        chain_run(llm, prompts, params, abort, overlap) for overlap in (False, True))
    # the aborted request stops where each run was (sample `abort`: request 5 has two)
    a, b = got[abort].output_ids, ref[abort].output_ids
    assert got[abort].request_id == str(abort) and got[abort].finish_reason == "abort"
    assert 3 <= len(a) < 8 and a[:len(b)] == b[:len(a)]
    got, ref = got[:abort] + got[abort + 1:], ref[:abort] + ref[abort + 1:]
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    for g, r in zip(got, ref):
        same_logprobs(g.logprobs, r.logprobs)
        assert g.finish_reason == r.finish_reason
    stopped = got[1]
    assert stopped.finish_reason == "stop" and 1 < len(stopped.output_ids) < 12
    assert ref_stats["overlapped_steps"] == 0 < stats["overlapped_steps"]
    assert stats["overlapped_steps"] == sum(p[0].chained for p in plans)
    # the steps with a decode row while no running request is constrained or scores its prompt:
    # most chained (not the first of a run of them)
    free = [p for p, ok, _, _ in plans
            if ok and any(not row.tokens or row.n == 1 for row in p.live)]
    assert sum(p.chained for p in free) >= 0.75 * len(free) > 0, (stats, len(free))
    # (plan, no running request is constrained or scores its prompt, one of its rows scores its
    # prompt, one of its rows is constrained) as each step was run
    assert all(not p.overlap for p, _, scoring, _ in plans if scoring)
    if structured:
        constrained = [p for p, _, scoring, grammar in plans if grammar and not scoring]
        assert all(p.split for p in constrained if p.overlap)
        assert sum(p.chained for p in constrained) >= 0.5 * len(constrained) > 0
        jsonschema.validate(json.loads(llm.tokenizer.decode(got[-1].output_ids)), SCHEMA)


def test_no_program_is_built_after_precompile(ckpt):
    """EngineCore.precompile builds the declared ragged set (at most 40 programs, ragged only) and
    the page copy; then the workload builds none, though it runs prompt logprobs, logprobs,
    penalties, chunks and an n > 1 request (its samples start from copies of its pages). The
    engine speculates (the same set, its steps 3 logits a row): the workload's rows with extras keep
    drafts out, then repetitive greedy prompts verify drafts in it (kimi-serve's set without
    speculation: tests/e2e/test_precompile_front_ends.py)."""
    compiles.install()
    speculation = {"num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(ckpt, dtype="float32", max_num_seqs=3, block_size=4, max_model_len=128,
              speculative_config=speculation, **SCHED["ragged"])
    core = llm.frontend.make_core()
    declared = core.programs()
    assert len(declared) <= 40 and {k.kind for k in declared} == {"ragged"}
    assert core.precompile() == len(declared)
    built = compiles.compile_count()
    # every program already called once (its fixed buffers made before any request)
    assert {key for key, _ in core.runner.resident} == set(declared)
    prompts, params = workload(preset("tiny").vocab_size, structured=False)
    assert any(sp.n > 1 for sp in params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(str(i), p, sp, seed=i)
    core.run()
    assert compiles.compile_count() == built and core.stats["ragged_passes"] > 10
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        core.add_request(f"rep{i}", [5 + i, 9, 13] * 4, greedy, seed=i)
    core.run()
    assert compiles.compile_count() == built and core.stats["drafted"] > 0
