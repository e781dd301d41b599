"""The runner's fixed buffers (kimi_jax.engine.runner): each program's inputs and outputs stay at one
address from call to call (so XLA's CUDA graph of the step is never recorded again), and every request's
tokens, logprobs and finish equal those of the runner that hands the step fresh buffers, with overlap
scheduling on (the chained step is fed the previous step's tokens) and off, penalties (the occurrence pool
donated beside the outputs), logprobs and seeded sampling."""
from __future__ import annotations

import numpy as np
import pytest

from kimi_jax import SamplingParams
from kimi_jax.config import preset

CFG = preset("tiny")


def requests(n, seed=0):
    rng = np.random.default_rng(seed)
    ps = [rng.integers(2, CFG.vocab_size, int(rng.integers(1, 30))).tolist() for _ in range(n)]
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.0, logprobs=3),
             dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=0.0, logit_bias={t: -5.0 for t in range(10, 30)})]   # wider than the declared 16
    params = [SamplingParams(max_tokens=int(rng.integers(2, 12)), ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(n)]
    return ps, params


def run(llm, fixed: bool, overlap: bool, watch=None):
    core = llm.frontend.make_core(overlap_scheduling=overlap)
    assert core.scheduler.overlap == overlap
    runner = core.runner
    runner.fixed_buffers = fixed
    if watch is not None:
        call = runner._call

        def watched(batch, key, **kw):
            out = call(batch, key, **kw)
            watch(runner, key)
            return out
        runner._call = watched
    ps, params = requests(7)
    reqs = [r for i, (p, sp) in enumerate(zip(ps, params))
            for r in core.make_request(str(i), p, sp, seed=50 + i)]
    for r in reqs:
        core.add([r])
    core.run()
    return reqs


def summary(reqs):
    return [(r.output_ids, r.finish_reason, [sorted(lp) for lp in r.logprobs]) for r in reqs]


def pointers(tree):
    import jax
    return tuple(s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(tree) for s in a.addressable_shards)


@pytest.mark.parametrize("overlap", [False, True])
def test_fixed_buffers_give_the_same_outputs(pool_llm, overlap):
    ref = run(pool_llm, fixed=False, overlap=overlap)
    got = run(pool_llm, fixed=True, overlap=overlap)
    assert summary(got) == summary(ref)
    for g, r in zip(got, ref):
        if r.params.logprobs is not None:
            # the same program over the same values: equal to float32 rounding of the padded batch
            np.testing.assert_allclose(g.cumulative_logprob, r.cumulative_logprob, rtol=0, atol=1e-5)


def test_each_program_keeps_its_buffers(pool_llm):
    """Every call of a program finds its inputs, outputs and the page pool where the last call left them."""
    seen, calls = {}, {}

    def watch(runner, key):
        for slot, (io, out) in runner.resident.items():
            now = (pointers(io), pointers(out), pointers(runner.pages))
            assert seen.setdefault(slot, now) == now, slot
        calls[key] = calls.get(key, 0) + 1
    run(pool_llm, fixed=True, overlap=True, watch=watch)
    assert any(k.kind == "decode" and n >= 5 for k, n in calls.items()), calls
