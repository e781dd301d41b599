"""LLM(batch_invariant=True): a request's greedy tokens and logprobs (top-k included) are the same
bits alone as among random neighbours, in batches of several sizes, on the CPU in bfloat16 (where
the padded layout without the switch differs), padded and ragged layouts, no prefix-cache hit."""
from __future__ import annotations

import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset

CFG = preset("tiny")
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


@pytest.mark.parametrize("layout,chunk,seed", [("padded", None, 0), ("padded", 8, 10),
                                               ("ragged", None, 0)],
                         ids=["padded", "padded-chunk8", "ragged"])
def test_alone_equals_batched_with_the_switch(tiny_ckpt, layout, chunk, seed):
    llm = _llm(tiny_ckpt, batch_invariant=True, prefill_chunk=chunk, step_layout=layout)
    alone, batched = _alone_and_batched(llm, seed)
    assert all(b == alone for b in batched)


def test_without_the_switch_bfloat16_differs(tiny_ckpt):
    """The padded case above without the switch: the logprobs of some batch differ from alone's
    (the ragged layout's agree without it on the CPU)."""
    alone, batched = _alone_and_batched(_llm(tiny_ckpt, batch_invariant=False), 0)
    assert any(b != alone for b in batched)
