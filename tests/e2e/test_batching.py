"""Continuous batching over the paged cache: mixed lengths, chunked prefill, requests joining as
others finish, and preemption under page pressure all give each request's solo tokens."""
from __future__ import annotations

import time

import numpy as np
import pytest

from checkpoints.synthetic import write_checkpoint
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset
from kimi_jax.engine.validation import RequestError

CFG = preset("tiny")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, int(rng.integers(1, 70))).tolist() for _ in range(n)]


def test_continuous_batching_equals_solo(ckpt):
    ps = prompts(7)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in np.random.default_rng(1).integers(1, 12, len(ps))]
    solo_llm = LLM(ckpt, dtype="float32", max_num_seqs=1)
    solo = [solo_llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(ps, params)]
    # 3 slots (requests join as others finish), chunks of 16 (long prompts span several steps), and
    # 24 pages of 4 tokens (< the 3 longest sequences at once: forces preemption and recompute)
    llm = LLM(ckpt, dtype="float32", max_num_seqs=3, block_size=4, num_gpu_blocks_override=24, prefill_chunk=16,
              max_prefill_tokens=24)
    core = llm.frontend.make_core()
    reqs = [r for i, (p, sp) in enumerate(zip(ps, params))
            for r in core.make_request(str(i), p, sp, seed=0)]
    for r in reqs:
        core.add([r])
    core.run()
    pool = core.scheduler.pool
    assert [r.output_ids for r in reqs] == solo
    assert core.stats["preemptions"] > 0        # the page pool really ran dry
    assert len(pool.free) == pool.num_pages     # every page came back


def test_latency_metrics(ckpt):
    """RequestOutput.metrics' times are ordered, inside the generate call, consistent with the derived
    figures, and show queueing: with 2 slots the third request starts only after the first finished."""
    ps = prompts(5, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 5, 9, 2, 7)]
    llm = LLM(ckpt, dtype="float32", max_num_seqs=2, block_size=4, num_gpu_blocks_override=24, prefill_chunk=16)
    t0 = time.time()
    outs = llm.generate(ps, params)
    t1 = time.time()
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        assert t0 <= m["arrival_time"] <= m["first_token_time"] <= m["finished_time"] <= t1
        assert m["time_to_first_token"] == pytest.approx(m["first_token_time"] - m["arrival_time"])
        if n == 1:
            assert m["time_per_output_token"] is None and m["finished_time"] == m["first_token_time"]
        else:
            assert m["time_per_output_token"] == pytest.approx((m["finished_time"] - m["first_token_time"]) / (n - 1))
            assert m["time_per_output_token"] > 0
    assert outs[2].metrics["first_token_time"] >= outs[0].metrics["finished_time"]
    assert outs[2].metrics["time_to_first_token"] > outs[0].metrics["time_to_first_token"]


def test_seeded_sampling_does_not_depend_on_batch(ckpt):
    ps = prompts(4, seed=2)
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, seed=123, ignore_eos=True)
    llm = LLM(ckpt, dtype="float32", max_num_seqs=4)
    together = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in ps]
    assert together == alone


def test_bad_requests_fail_alone(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=64)
    core = llm.frontend.make_core()
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    [good] = core.make_request("ok", [5, 6, 7], sp, seed=0)
    errors = {}
    for rid, ids, sp in [("long", list(range(2, 80)), SamplingParams()), ("empty", [], SamplingParams()),
                         ("badid", [5, 10**6], SamplingParams()), ("lp", [5], SamplingParams(logprobs=10**6))]:
        with pytest.raises(RequestError) as e:
            core.make_request(rid, ids, sp, seed=0)
        errors[rid] = str(e.value)
    assert "max_model_len=64" in errors["long"] and "empty prompt" in errors["empty"]
    assert "1000000" in errors["badid"] and "vocabulary" in errors["lp"]
    core.add([good])
    core.run()
    assert len(good.output_ids) == 3


def test_bfloat16_batch_runs_on_cpu(ckpt):
    """bf16 with several rows used to fail on XLA:CPU ("Unsupported element type for DotThunk: BF16 x
    BF16 = F32" for einsums whose batch dimension is not leading); ops.einsum_f32 widens on CPU. Before
    the fix this raised; now every row must finish with its 4 tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(ckpt, dtype="bfloat16", max_num_seqs=4, block_size=4, num_gpu_blocks_override=64)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts(4, seed=3), sp)]
    assert all(len(t) == 4 for t in outs)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=4)], ids=["dp2xtp2-ep", "tp4"])
def test_mla_kernel_runs_per_shard_and_matches_xla(tmp_path_factory, layout):
    """The MLA decode kernel (interpret mode here) under a sharded layout runs inside shard_map, rows
    split over dp and heads over tp; greedy tokens must equal the XLA attention path's. float32: the
    kernel and the reference differ only in summation order (~1e-6), far from any argmax margin of
    this model's 6 decoded tokens (a mismatch means wrong rows, heads or pages)."""
    from kimi_jax import ops
    ckpt = str(tmp_path_factory.mktemp("mla_kernel"))
    write_checkpoint(ckpt, CFG.replace(qk_rope_head_dim=16), seed=4, std=0.08)   # kernel tiles: R >= 16
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for impl in ("xla", "pallas"):
        llm = LLM(ckpt, dtype="float32", max_num_seqs=4, block_size=4, num_gpu_blocks_override=64,
                  exec_plan=ops.ExecPlan(impl=impl), **layout)
        out[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts(4, seed=5), sp)]
    assert out["pallas"] == out["xla"]
