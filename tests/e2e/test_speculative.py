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
from kimi_jax.engine.sampling import SamplingArrays, verify_drafts
from kimi_jax.engine.speculative import NgramDrafter, SpecState

CFG = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                             num_experts_per_tok=3)


def test_ngram_drafter_proposes_what_followed_the_last_match():
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert d.propose([5, 6, 7], 2) == []                       # nothing repeats
    assert d.propose([7, 1, 7], 4) == [1, 7]                   # 1-gram fallback, clipped at the end


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (3, 2), (2, 2)])
def test_ngram_index_matches_the_scanning_drafter(max_n, min_n):
    """The incremental index proposes exactly what the reference scan proposes, at every length of
    seeded random sequences over a small vocabulary (so n-grams repeat often)."""
    rng = np.random.default_rng(max_n * 10 + min_n)
    ref = NgramDrafter(max_n, min_n)
    for _ in range(20):
        seq = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
        idx = ref.index()
        cut = int(rng.integers(1, len(seq) + 1))                      # prompt seq[:cut], then outputs
        for L in range(cut, len(seq) + 1):
            idx.extend(seq[:cut], seq[cut:L])
            assert idx.propose(3) == ref.propose(seq[:L], 3), (seq[:L], cut)


def test_shadow_drafts_are_scored_against_the_tokens_produced():
    s = SpecState()
    assert s.rate == 0.0                          # pessimistic prior: nothing verified before evidence
    s.offer_shadow(2, [5, 6, 7])
    s.check_shadow([1, 1, 5])                     # only the first drafted position produced so far
    assert s.shadow is not None and s.tried == 0
    s.check_shadow([1, 1, 5, 6, 9])               # 2 accepted, the 3rd rejected: 3 positions tried
    assert s.shadow is None and (s.hits, s.tried) == (2, 3)
    a1 = s.rate                                   # evidence of repetition: 2 / 5
    assert a1 == pytest.approx(0.4)
    for _ in range(10):                           # drafts that keep failing drive the estimate down
        s.offer_shadow(0, [4, 4])
        s.check_shadow([3])
    assert s.rate < 0.3 < a1 and s.expected_accepted(4) < 0.5
    assert (s.drafted, s.verify_steps) == (0, 0)  # shadow attempts are not reported as verification
    s.record(4, 4)
    assert (s.drafted, s.accepted, s.verify_steps) == (4, 4, 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec"))
    write_checkpoint(path, CFG, seed=4, std=0.08)
    return path


def mixed_prompts():
    rng = np.random.default_rng(0)
    rep = [list(rng.integers(2, 500, 12)) * 3 for _ in range(3)]      # repetitive: drafts get accepted
    return rep + [list(rng.integers(2, 500, int(n))) for n in (5, 17, 30)]


@pytest.mark.parametrize("layout", [{}, {"step_layout": "ragged"},
                                    pytest.param({"data_parallel_size": 2, "tensor_parallel_size": 4,
                                                  "enable_expert_parallel": True, "step_layout": "ragged"},
                                                 marks=pytest.mark.slow),
                                    pytest.param({"data_parallel_size": 2, "tensor_parallel_size": 4,
                                                  "enable_expert_parallel": True}, marks=pytest.mark.slow)],
                         ids=["1dev", "ragged", "dp2_tp4_ep_ragged", "dp2_tp4_ep"])
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


def _run(llm, prompts, sp):
    """Generate through a fresh engine core; (token ids per request, engine stats)."""
    core = llm.frontend.make_core()
    reqs = [r for i, p in enumerate(prompts) for r in core.add_request(str(i), p, sp, seed=i)]
    core.run()
    return [r.output_ids for r in reqs], core.stats


def test_gate_uses_measured_costs_once_and_is_deterministic(ckpt):
    """The gate's pass costs are measured the first time a bucket is met; a second identical run
    measures nothing, compiles nothing and takes the same decisions. With the costs pinned, a
    GPU-like verify/decode ratio (1.0) verifies and a CPU-like one (100) never does; greedy output
    is the same in every case."""
    from jax import monitoring
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = mixed_prompts()
    base, _ = _run(LLM(ckpt, dtype="float32"), prompts, sp)
    llm = LLM(ckpt, dtype="float32", speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    first, s1 = _run(llm, prompts, sp)
    assert first == base and s1["cost_calibrations"] == len(llm.frontend.steps.pass_costs) > 0
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: compiles.append(ev) if ev.endswith("backend_compile_duration") else None)
    second, s2 = _run(llm, prompts, sp)
    assert second == base and not compiles and s2 == {**s1, "cost_calibrations": 0}
    for ratio, verifies in ((1.0, True), (100.0, False)):
        llm.frontend.steps.pass_costs = {(b, p): (1.0, ratio) for b in (1, 2, 4, 8) for p in (4, 8, 16, 32)}
        out, st = _run(llm, prompts, sp)
        assert out == base and (st["verify_passes"] > 0) == verifies and st["cost_calibrations"] == 0, (ratio, st)


def test_the_ragged_gate_measures_two_widths_once(ckpt):
    """The ragged step verifies drafts inside its one step: the gate times the step of its decode
    rows at the widths without and with the drafts (once per pair of widths, keys ('ragged', T0,
    T1)); a second identical run measures nothing, compiles nothing and decides the same. With the
    costs pinned, a ratio of 1.0 drafts more than 100 (which drafts only where the drafts leave the
    width as it is: free); greedy output is the same each time."""
    from jax import monitoring
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = mixed_prompts()
    base, _ = _run(LLM(ckpt, dtype="float32", step_layout="ragged"), prompts, sp)
    llm = LLM(ckpt, dtype="float32", step_layout="ragged",
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    first, s1 = _run(llm, prompts, sp)
    costs = llm.frontend.steps.pass_costs
    assert first == base and s1["cost_calibrations"] == len(costs) > 0
    assert all(k[0] == "ragged" and k[1] < k[2] for k in costs), costs
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: compiles.append(ev) if ev.endswith("backend_compile_duration") else None)
    second, s2 = _run(llm, prompts, sp)
    assert second == base and not compiles and s2 == {**s1, "cost_calibrations": 0}
    widths = llm.frontend.make_core().scheduler.ragged_shapes.ladder()
    drafted = {}
    for ratio in (1.0, 100.0):
        llm.frontend.steps.pass_costs = {("ragged", a, b): (1.0, ratio) for a in widths for b in widths}
        out, st = _run(llm, prompts, sp)
        assert out == base and st["cost_calibrations"] == 0, (ratio, st)
        assert st["ragged_passes"] > 0 and st["verify_passes"] == 0
        assert (st["spec_steps"] > 0) == (st["drafted"] > 0)
        drafted[ratio] = st["drafted"]
    assert drafted[1.0] > drafted[100.0], drafted


def test_ragged_speculation_samples_seeded_rows_the_same_each_run(ckpt):
    """Seeded sampled rows (temperature 1, top-p 0.9) with drafts verified in the ragged step: two
    runs give the same tokens, drafts are accepted, and every token is inside the vocabulary."""
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
    llm = LLM(ckpt, dtype="float32", step_layout="ragged",
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False})
    a, sa = _run(llm, mixed_prompts(), sp)
    b, _ = _run(llm, mixed_prompts(), sp)
    assert a == b and sa["drafted"] > 0 and all(len(x) == 16 for x in a)
    assert all(0 <= t < CFG.vocab_size for x in a for t in x)


def test_ragged_drafts_under_preemption_and_prefix_caching(ckpt):
    """The ragged step with speculation on a pool too small for its rows and prefix caching on:
    drafts take pages (preempting others) and preempted rows recompute, greedy tokens as without
    speculation on the same pool."""
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = dict(dtype="float32", step_layout="ragged", max_num_seqs=3, block_size=4,
              num_gpu_blocks_override=30, enable_prefix_caching=True)
    prompts = mixed_prompts()
    base, _ = _run(LLM(ckpt, **kw), prompts, sp)
    got, st = _run(LLM(ckpt, speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                 "adaptive": False}, **kw), prompts, sp)
    assert got == base and st["drafted"] > 0 and st["preemptions"] > 0, st
