"""Two engines with different ExecPlans in one process each run their own plan: the default CPU plan
(layer loop under lax.scan, einsum attention) and one with the layers unrolled, fresh prefills through
jax.nn.dot_product_attention ('xla', the CPU stand-in of cuDNN) and later prompt chunks through the split
path ('xla_split'). Each engine's lowered step shows its loop (a stablehlo.while only under scan); spies
on the attention helpers only the second plan calls see them run for it alone; greedy tokens agree
(float32 tiny model: the paths differ in summation order only, far below this model's argmax margins).
Assigning another plan to a live engine compiles its steps for that plan (the plan is a static
argument of every step, part of the jit cache key)."""
from __future__ import annotations

import numpy as np

from kimi_jax import LLM, SamplingParams, ops
from kimi_jax.config import preset
from kimi_jax.engine.sampling import SamplingArrays
from kimi_jax.engine.steps import StepBatch
from kimi_jax.ops import prefill_attention

CFG = preset("tiny")
FUSED = ops.ExecPlan(layer_loop="unroll", prefill_attention="xla", chunk_attention="xla_split")


def _lowered_prefill(engine) -> str:
    """StableHLO of the engine's step for one fresh 8-token prefill, under the engine's own plan."""
    T = 8
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)], None, keys=np.zeros((1, 2), np.uint32))
    batch = StepBatch(i32(np.ones((1, T))), i32(np.arange(T)[None]), i32(np.arange(2)[None]),
                      i32([T - 1]), i32([0]), sp)
    return engine.step_jit.lower(engine.state, engine.init_pages(4, 4), batch, kind="prefill",
                                 n_logprobs=None, fresh=True, sample_mode="greedy",
                                 plan=engine.exec_plan).as_text()


def test_two_engines_in_one_process_run_their_own_plans(tiny_ckpt, monkeypatch):
    fused_calls, split_calls = [], []
    real_dpa, real_lse = prefill_attention._dot_product_attention, prefill_attention._attention_lse_xla
    monkeypatch.setattr(prefill_attention, "_dot_product_attention",
                        lambda *a: fused_calls.append(a[-1]) or real_dpa(*a))
    monkeypatch.setattr(prefill_attention, "_attention_lse_xla",
                        lambda *a, **k: split_calls.append(k["causal"]) or real_lse(*a, **k))
    # prompts of 5-14 tokens in chunks of 8: a fresh first chunk, then (the longer ones) a chunk after
    # cached tokens; 3 decode steps each
    kw = dict(dtype="float32", max_num_seqs=2, block_size=4, num_gpu_blocks_override=32, prefill_chunk=8, max_prefill_tokens=16)
    plain, fused = LLM(tiny_ckpt, **kw), LLM(tiny_ckpt, exec_plan=FUSED, **kw)
    plain_steps, fused_steps = plain.frontend.steps, fused.frontend.steps
    assert plain_steps.exec_plan == ops.ExecPlan.for_backend() == ops.ExecPlan()
    assert fused_steps.exec_plan == FUSED
    assert fused.exec_plan is fused_steps.exec_plan

    text_plain, text_fused = _lowered_prefill(plain_steps), _lowered_prefill(fused_steps)
    assert text_plain.count("stablehlo.while") == 2                # one lax.scan per layer stack (dense, MoE)
    assert "stablehlo.while" not in text_fused                     # unrolled: one call per layer
    assert fused_calls == ["xla"] * 2          # traced once per layer kind (dense, MoE), fused plan only
    del fused_calls[:]

    rng = np.random.default_rng(2)
    ps = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (5, 14)]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    run = lambda llm: [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]  # noqa: E731
    want = run(plain)
    assert fused_calls == [] and split_calls == []                 # the default plan: einsum everywhere
    got = run(fused)
    assert fused_calls and set(fused_calls) == {"xla"}
    assert set(split_calls) == {False, True}                       # both halves of the split path
    assert got == want and all(len(t) == 3 for t in want)

    # a live engine given another plan compiles for it instead of reusing the programs it has: its
    # full-sequence logits (one fresh prefill) before and after
    prompt = ps[1][:8]
    before = plain_steps.logits(prompt)
    n_fused = len(fused_calls)
    assert plain_steps.logits(prompt) is not None and len(fused_calls) == n_fused
    plain_steps.exec_plan = FUSED
    after = plain_steps.logits(prompt)
    assert len(fused_calls) == n_fused + 2                          # one trace per layer kind
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4)   # float32, summation order only
