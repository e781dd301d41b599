"""LLM(batch_invariant=True): a request's greedy tokens and logprobs (top-k included) are the same
bits alone as among random neighbours, in batches of several sizes, on the CPU in bfloat16 (where
the padded layout without the switch differs), padded and ragged layouts; in the ragged layout also
in float32, after a prefix-cache hit, with another token budget (so other chunks) and after
preemption, and for a seeded sampled request."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset

CFG = preset("tiny")
_IDS = itertools.count()
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def _seen(out):
    c = out.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in c.logprobs]


def _alone_and_batched(llm, seed):
    """(target alone, target in batches of 2, 4 and 8 at random places among random neighbours)."""
    target = _prompts(1, seed)[0]
    alone = _seen(llm.generate([target], SP)[0])
    rng = np.random.default_rng(seed + 1)
    batched = []
    for size in (2, 4, 8):
        ps = _prompts(size - 1, seed + size)
        at = int(rng.integers(0, size))
        ps.insert(at, target)
        batched.append(_seen(llm.generate(ps, SP)[at]))
    return alone, batched


def _llm(ckpt, **kw):
    return LLM(ckpt, dtype="bfloat16", max_num_seqs=8, block_size=4, max_model_len=128,
               enable_prefix_caching=False, **kw)


@pytest.mark.parametrize("layout,chunk,seed", [
    ("padded", None, 0), pytest.param("padded", 8, 10, marks=pytest.mark.slow)],
    ids=["padded", "padded-chunk8"])
def test_alone_equals_batched_with_the_switch(tiny_ckpt, layout, chunk, seed):
    llm = _llm(tiny_ckpt, batch_invariant=True, prefill_chunk=chunk, step_layout=layout)
    alone, batched = _alone_and_batched(llm, seed)
    assert all(b == alone for b in batched)


# the products that differ without the switch, op by op, run by default
# (tests/unit/test_batch_invariant_switch.py, tests/kernels/test_pallas_int4.py)
@pytest.mark.slow
def test_without_the_switch_bfloat16_differs(tiny_ckpt):
    """The padded case above without the switch: the logprobs of some batch differ from alone's
    (the ragged layout's agree without it on the CPU)."""
    alone, batched = _alone_and_batched(_llm(tiny_ckpt, batch_invariant=False), 0)
    assert any(b != alone for b in batched)


def _run(core, prompts, params):
    """Each request's (tokens, top logprobs) through core, run to the end, and its stats."""
    groups = [core.add_request(f"r{next(_IDS)}", p, sp) for p, sp in zip(prompts, params)]
    core.run()
    return [_seen_sample(g[0]) for g in groups], core.stats


def _seen_sample(r):
    return r.output_ids, [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in r.logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_step_gives_the_same_bits_whatever_the_schedule(tiny_ckpt, dtype):
    """A greedy and a seeded sampled request, alone in one engine, equal themselves (1) among 7
    random neighbours after a prefix-cache hit on their own earlier run, and (2) in an engine of
    an 8-token budget (the prompt in 8-token chunks) and a small pool (preempted and recomputed),
    among 3 long neighbours: the attention reads every key in fixed blocks of positions, whether
    from the cache or from the step (ops.ragged), and every product runs rows in fixed tiles."""
    rng = np.random.default_rng(3)
    targets = [rng.integers(2, CFG.vocab_size, 37).tolist(), rng.integers(2, CFG.vocab_size, 21).tolist()]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, logprobs=3)
    kw = dict(dtype=dtype, block_size=4, max_model_len=128, step_layout="ragged",
              batch_invariant=True)
    core = LLM(tiny_ckpt, max_num_seqs=8, enable_prefix_caching=True, **kw).frontend.make_core()
    alone = [_run(core, [p], [sp])[0][0] for p, sp in zip(targets, (greedy, sampled))]
    others = _prompts(6, 5)
    got, stats = _run(core, others[:3] + targets + others[3:],
                      [greedy] * 3 + [greedy, sampled] + [greedy] * 3)
    assert stats["prefix_cache_hits"] > 0 and got[3:5] == alone
    small = LLM(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=8, num_gpu_blocks_override=24,
                enable_prefix_caching=False, **kw)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got, stats = _run(small.frontend.make_core(), targets + _prompts(2, 7),
                      [greedy, sampled, long, long])
    assert stats["preemptions"] > 0 and got[:2] == alone
