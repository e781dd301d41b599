"""Speculative decoding: greedy output identical with speculation on (1 and 8 devices); the sampled
output distribution is exactly the target's (a goodness-of-fit test on the verification rule)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.synthetic import write_checkpoint
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset
from kimi_jax.sampling import SamplingArrays, verify_drafts
from kimi_jax.speculative import NgramDrafter, SpecState

CFG = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                             num_experts_per_tok=3)


def test_ngram_drafter_proposes_what_followed_the_last_match():
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert d.propose([5, 6, 7], 2) == []                       # nothing repeats
    assert d.propose([7, 1, 7], 4) == [1, 7]                   # 1-gram fallback, clipped at the end


def test_backoff_after_failures():
    s = SpecState()
    s.record(4, 0)
    assert [s.should_draft() for _ in range(2)] == [False, True]
    s.record(4, 0)
    assert [s.should_draft() for _ in range(3)] == [False, False, True]
    s.record(4, 2)
    assert s.should_draft()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec"))
    write_checkpoint(path, CFG, seed=4, std=0.08)
    return path


def mixed_prompts():
    rng = np.random.default_rng(0)
    rep = [list(rng.integers(2, 500, 12)) * 3 for _ in range(3)]      # repetitive: drafts get accepted
    return rep + [list(rng.integers(2, 500, int(n))) for n in (5, 17, 30)]


@pytest.mark.parametrize("layout", [{}, {"data_parallel_size": 2, "tensor_parallel_size": 4,
                                         "enable_expert_parallel": True}], ids=["1dev", "dp2_tp4_ep"])
def test_greedy_identical_with_speculation(ckpt, layout):
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(ckpt, dtype="float32", **layout).generate(mixed_prompts(), sp)]
    # always verify (no throughput gating) and accept 1-token matches, so drafts are many on this model
    spec_llm = LLM(ckpt, dtype="float32", speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                                "adaptive": False}, **layout)
    outs = spec_llm.generate(mixed_prompts(), sp)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert sum(o.metrics["spec_accepted"] for o in outs) > 0      # speculation really happened


def test_verification_preserves_the_target_distribution():
    """Rows share one target distribution p over V = 8 tokens (temperature 1, top-p 0.9 so filtering
    is exercised) and one 2-token draft; N = 40000 independent keys. The first emitted token must be
    distributed as p (filtered): accepted draft -> d1, rejected -> the residual draw.
    Test: chi-square goodness of fit at alpha = 1e-3 (7 dof: critical value 24.3). Power: a rule that
    is off by a total-variation distance of 0.02 (e.g. sampling the residual without removing the
    draft) gives an expected chi-square of about N * 4 * 0.02^2 / max p ~ 100+, detected with power
    > 0.999; the test below also checks that naive rule fails."""
    V, N = 8, 40000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 1.2, (3, V)), jnp.float32)           # positions 0..2
    drafts = jnp.asarray([[int(np.argsort(-np.asarray(logits[0]))[1]), 3]], jnp.int32)
    sp = SamplingArrays(temperature=jnp.ones((N,)), top_k=jnp.full((N,), -1, jnp.int32),
                        top_p=jnp.full((N,), 0.9), min_p=jnp.zeros((N,)),
                        key=jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(jnp.arange(N)).astype(jnp.uint32))
    n_acc, nxt = jax.jit(verify_drafts)(jnp.broadcast_to(logits, (N, 3, V)), jnp.broadcast_to(drafts, (N, 2)),
                                        jnp.full((N,), 2, jnp.int32), sp, jnp.zeros((N,), jnp.int32))
    n_acc, nxt = np.asarray(n_acc), np.asarray(nxt)
    first = np.where(n_acc >= 1, int(drafts[0, 0]), nxt)

    def filtered(p_logits):
        p = np.exp(p_logits - p_logits.max()); p /= p.sum()
        order = np.argsort(-p); cum = np.cumsum(p[order]) - p[order]
        keep = np.zeros(V, bool); keep[order[cum < 0.9]] = True; keep[order[0]] = True
        q = np.where(keep, p, 0); return q / q.sum()

    p0 = filtered(np.asarray(logits[0], np.float64))
    counts = np.bincount(first, minlength=V)
    support = p0 > 0
    assert counts[~support].sum() == 0
    chi2 = (((counts - N * p0) ** 2)[support] / (N * p0[support])).sum()
    assert chi2 < 24.3, (chi2, counts, N * p0)
    # the same statistic catches a wrong rule: residual drawn WITHOUT removing the rejected draft
    naive = np.where(n_acc >= 1, int(drafts[0, 0]),
                     np.random.default_rng(1).choice(V, size=N, p=p0))
    bad = np.bincount(naive, minlength=V)
    assert (((bad - N * p0) ** 2)[support] / (N * p0[support])).sum() > 24.3
