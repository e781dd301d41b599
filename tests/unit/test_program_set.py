"""The runner's declared program set (`Runner.programs`) against the plans the scheduler makes: seeded
random workloads run through an EngineCore whose steps are faked (random tokens, no model), and
every program a step asks for must be declared; at small limits the workloads reach every declared
program."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import ops
from kimi_jax.engine import mla_schedule, shapes, steps
from kimi_jax.engine.args import CacheConfig, SchedulerConfig
from kimi_jax.engine.core import EngineCore
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.speculative import SpeculativeConfig
from kimi_jax.engine.steps import Occurrences


class FakeSteps:
    """What EngineCore (its Scheduler and Runner) reads of an ModelSteps; the steps themselves are
    `fake_call`."""

    def __init__(self, vocab_size: int, dp: int, plan: ops.ExecPlan):
        self.cfg = types.SimpleNamespace(vocab_size=vocab_size)
        self.dp, self.exec_plan, self.pass_costs = dp, plan, {}
        self.token_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def batch_size(self, n: int) -> int:
        return -(-shapes.bucket(n, 1) // self.dp) * self.dp

    def init_pages(self, num_pages, page_size, dtype=None):
        return {}

    def new_occurrences(self, num_rows):
        return Occurrences(None, num_rows)

    def set_occurrences(self, occ, row, row_V):
        pass

    def copy_pages(self, pages, src, dst, rank=0):
        return pages


def fake_engine(rng, vocab_size, seen, *, num_pages, page_size, max_num_seqs, max_model_len,
                prefill_chunk, max_prefill_tokens, dp=1, plan=ops.ExecPlan(),
                enable_prefix_caching=False, overlap=False, speculative=None, step_layout="padded",
                max_num_batched_tokens=0, long_prefill_token_threshold=0) -> EngineCore:
    sc = SchedulerConfig(max_num_seqs, max_model_len, prefill_chunk, max_prefill_tokens,
                         speculative_config=speculative, overlap_scheduling=overlap,
                         step_layout=step_layout, max_num_batched_tokens=max_num_batched_tokens,
                         long_prefill_token_threshold=long_prefill_token_threshold)
    cc = CacheConfig(page_size, num_pages, enable_prefix_caching=enable_prefix_caching)
    core = EngineCore(FakeSteps(vocab_size, dp, plan), sc, cc)

    def fake_call(batch, key, **kw):
        seen.append(key)
        B = key.batch
        if key.kind == "verify":
            n_draft = np.asarray(batch.n_draft_B)
            return jnp.asarray(rng.integers(0, n_draft + 1)), jnp.asarray(rng.integers(0, vocab_size, B))
        out = {"tokens": jnp.asarray(rng.integers(0, vocab_size, B), jnp.int32)}
        if key.logprobs is not None:
            n = key.logprobs
            out.update(logprob=jnp.zeros((B,)), rank=jnp.ones((B,), jnp.int32),
                       top_ids=jnp.asarray(rng.integers(0, vocab_size, (B, n))), top_vals=jnp.zeros((B, n)))
        if key.prompt_logprobs is not None:
            T, n = key.width, key.prompt_logprobs
            out.update(prompt_logprob=jnp.zeros((B, T)), prompt_rank=jnp.ones((B, T), jnp.int32),
                       prompt_top_ids=jnp.asarray(rng.integers(0, vocab_size, (B, T, n))),
                       prompt_top_vals=jnp.zeros((B, T, n)))
        return out

    def fake_ragged(batch, key):
        """The forward: rows' token spans checked against the plan's shapes, stand-in logits."""
        seen.append(key)
        T, B = key.width, key.batch
        assert batch.tokens_T.shape == (T,)
        assert batch.sample_B.shape == (B * core.runner.spec_width,)
        assert batch.rows.pages_X.shape == (key.table,)
        if key.prompt_logprobs is None:
            return None
        n = key.prompt_logprobs
        return None, dict(prompt_logprob=jnp.zeros((T,)), prompt_rank=jnp.ones((T,), jnp.int32),
                          prompt_top_ids=jnp.asarray(rng.integers(0, vocab_size, (T, n))),
                          prompt_top_vals=jnp.zeros((T, n)))

    def fake_sample(logits, inputs, key, snapshot=True):
        seen.append(key)
        out = fake_call(None, key)
        if inputs.drafts_BY is not None:      # a ragged step verifying drafts
            out["accepted"] = jnp.asarray(rng.integers(0, np.asarray(inputs.n_draft_B) + 1))
        return out

    core.runner._call = fake_call
    core.runner._call_ragged, core.runner._call_sample = fake_ragged, fake_sample
    return core


def random_params(rng, max_tokens: int) -> SamplingParams:
    kw = dict(temperature=float(rng.choice([0.0, 0.8])), max_tokens=int(rng.integers(1, max_tokens + 1)),
              ignore_eos=True, seed=int(rng.integers(1 << 20)))
    pick = rng.integers(8)
    if pick == 1:
        kw["logprobs"] = int(rng.choice([0, 3]))
    elif pick == 2:
        kw["prompt_logprobs"] = int(rng.choice([0, 2]))
    elif pick == 3:
        kw.update(repetition_penalty=1.2, frequency_penalty=0.5)
    elif pick == 4:
        kw.update(logit_bias={1: 2.0}, min_tokens=1)
    elif pick == 5:
        kw.update(temperature=0.8, n=2, best_of=int(rng.choice([2, 3])),
                  prompt_logprobs=int(rng.choice([0, 1])) if rng.random() < .5 else None)
    return SamplingParams(**kw)


def run_workload(seed: int, n_requests: int, vocab_size: int = 16, max_tokens: int = 24,
                 stats: bool = False, **kw):
    """(keys the steps asked for, the engine's declared programs) of one random workload."""
    rng, seen = np.random.default_rng(seed), []
    core = fake_engine(rng, vocab_size, seen, **kw)
    mml, i = core.scheduler.max_model_len, 0

    def feed() -> bool:
        nonlocal i
        for _ in range(int(rng.integers(0, 4))):
            if i == n_requests:
                break
            n = int(min(rng.choice([1, 2, rng.integers(1, 40), rng.integers(1, mml)]), mml - 1))
            prompt = rng.integers(0, vocab_size, n).tolist()
            core.add(core.make_request(str(i), prompt, random_params(rng, max_tokens), seed=i))
            i += 1
        return i < n_requests

    core.run(feed=feed)
    assert not core.has_unfinished()
    if stats:
        return seen, core.runner.programs(core.limits()), core.stats
    return seen, core.runner.programs(core.limits())


CONFIGS = {
    "small": dict(num_pages=8, page_size=16, max_num_seqs=2, max_model_len=64, prefill_chunk=16,
                  max_prefill_tokens=32),
    "xla": dict(num_pages=96, page_size=8, max_num_seqs=8, max_model_len=160, prefill_chunk=40,
                max_prefill_tokens=64, enable_prefix_caching=True, overlap=True),
    "pallas": dict(num_pages=160, page_size=8, max_num_seqs=8, max_model_len=160, prefill_chunk=24,
                   max_prefill_tokens=100, enable_prefix_caching=True, overlap=True,
                   plan=ops.ExecPlan(impl="pallas", layer_loop="unroll")),
    "pallas_absorbed_chunks": dict(num_pages=160, page_size=8, max_num_seqs=8, max_model_len=160, prefill_chunk=40,
                                   max_prefill_tokens=100, enable_prefix_caching=True, overlap=True,
                                   plan=ops.ExecPlan(impl="pallas", layer_loop="unroll", absorbed_chunk_tokens=16)),
    "pallas_dp2": dict(num_pages=80, page_size=4, max_num_seqs=6, max_model_len=120, prefill_chunk=32,
                       max_prefill_tokens=48, dp=2, plan=ops.ExecPlan(impl="pallas", layer_loop="unroll")),
    "speculative": dict(num_pages=64, page_size=8, max_num_seqs=4, max_model_len=128, prefill_chunk=32,
                        max_prefill_tokens=64, speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False)),
    "pallas_speculative": dict(num_pages=64, page_size=8, max_num_seqs=4, max_model_len=128, prefill_chunk=16,
                               max_prefill_tokens=64, plan=ops.ExecPlan(impl="pallas", layer_loop="unroll"),
                               speculative=SpeculativeConfig(num_speculative_tokens=2, adaptive=False)),
}


RAGGED = {
    "ragged": dict(num_pages=96, page_size=8, max_num_seqs=8, max_model_len=160, prefill_chunk=40,
                   max_prefill_tokens=64, enable_prefix_caching=True, step_layout="ragged",
                   max_num_batched_tokens=48, long_prefill_token_threshold=24),
    "ragged_overlap": dict(num_pages=256, page_size=8, max_num_seqs=16, max_model_len=96,
                           prefill_chunk=40, max_prefill_tokens=64, enable_prefix_caching=True,
                           overlap=True, step_layout="ragged", max_num_batched_tokens=64),
    "ragged_dp2": dict(num_pages=80, page_size=4, max_num_seqs=6, max_model_len=120,
                       prefill_chunk=32, max_prefill_tokens=48, dp=2, step_layout="ragged",
                       max_num_batched_tokens=64),
    "ragged_speculative": dict(num_pages=96, page_size=8, max_num_seqs=8, max_model_len=160,
                               prefill_chunk=40, max_prefill_tokens=64, step_layout="ragged",
                               max_num_batched_tokens=48,
                               speculative=SpeculativeConfig(num_speculative_tokens=2, adaptive=False)),
}


@pytest.fixture
def small_thresholds(monkeypatch):
    """Thresholds these small limits cross: tables from 32 tokens, the one decode width up to 8 pages,
    the balanced schedule from 256 cached tokens."""
    monkeypatch.setattr(shapes, "MIN_TABLE_TOKENS", 32)
    monkeypatch.setattr(shapes, "DECODE_TABLE_PAGES", 8)
    monkeypatch.setattr(mla_schedule, "BALANCE_MIN_TOKENS", 256)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_program_a_workload_runs_is_declared(name, small_thresholds):
    reached, kinds = set(), set()
    for seed in range(3):
        seen, declared = run_workload(seed, 24, **CONFIGS[name])
        missing = sorted({k for k in seen if k not in set(declared)}, key=str)
        assert not missing, f"{len(missing)} undeclared programs, e.g. {missing[:3]}"
        reached |= set(seen)
        kinds |= {(k.kind, k.fresh, k.prompt_logprobs is not None, k.mla_schedule) for k in seen}
    assert {("decode", False, False, None), ("prefill", True, False, None), ("prefill", False, False, None),
            ("prefill", True, True, None)} <= kinds
    if "speculative" in name:
        assert any(k.kind == "verify" for k in reached)
    if name == "pallas":
        assert ("decode", False, False, "balanced") in kinds


def test_small_limits_reach_every_declared_program():
    reached = set()
    for seed in range(12):
        seen, declared = run_workload(seed, 16, **CONFIGS["small"])
        reached |= set(seen)
    assert set(declared) == reached and len(declared) == 18


def test_decode_widths_and_prefill_caps():
    s = shapes.Shapes.of(4096, 16, 2048, rank_pages=2048, pallas=True)
    assert s.max_pages == 256 and s.tables("decode") == [256] == s.tables("verify")
    assert shapes.Shapes.of(1 << 16, 16, 2048, pallas=True).tables("decode") == [1024, 2048, 4096]
    xla = shapes.Shapes.of(4096, 16, 2048)
    assert xla.tables("decode") == [16, 32, 64, 128, 256] == xla.tables("prefill", 64)
    assert xla.tables("prefill", 16, fresh=True) == [16] and xla.tables("prefill", 512, fresh=True) == [32]
    assert s.prefill_fits(4, 512, 200, fresh=False) and not s.prefill_fits(8, 512, 200, fresh=True)
    assert not s.prefill_fits(16, 16, 200, fresh=False) and s.prefill_fits(16, 16, 200, fresh=True)
    assert mla_schedule.can_balance(2, 1 << 16) and not mla_schedule.can_balance(1, 1 << 20)
    assert not mla_schedule.can_balance(8, 8191)


def test_a_decode_plan_never_scores_prompt_positions():
    """A 2-token prompt's samples prefill one token that scores the prompt's last: a prefill step."""
    seen = []
    core = fake_engine(np.random.default_rng(0), 16, seen, num_pages=16, page_size=16, max_num_seqs=4,
                     max_model_len=64, prefill_chunk=16, max_prefill_tokens=32)
    core.add_request("a", [3, 5], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1), seed=0)
    core.run()
    assert seen[0].kind == "prefill" and seen[0].prompt_logprobs is not None
    assert all(k.prompt_logprobs is None for k in seen if k.kind == "decode")


def ragged_limits(max_num_seqs, max_model_len, budget, page_size=16, pages_per_rank=None):
    return shapes.Limits(max_num_seqs, max_model_len, page_size, 2048, 2048, 20,
                         pages_per_rank=pages_per_rank, step_layout="ragged",
                         max_num_batched_tokens=budget)


@pytest.mark.parametrize("limits,dp,count", [
    (ragged_limits(256, 131072, 8192), 1, 40),
    (ragged_limits(256, 131072, 8192, pages_per_rank=4096), 8, 39),
    (ragged_limits(64, 131072, 2048), 1, 28),           # kimi-serve's defaults (max_num_seqs 64)
    (ragged_limits(256, 2048, 256), 2, 30),
    (ragged_limits(1, 131072, 8192), 1, 24),
    (ragged_limits(200, 4096, 8000, pages_per_rank=999), 3, 39),
])
def test_the_ragged_program_set_is_small_at_any_limits(limits, dp, count):
    """Forward programs keyed by T alone (plus prompt logprobs from RaggedShapes.prompt_tokens up),
    sampling halves by B (greedy and sampled, plain and extras): at most 40 programs up to 256
    sequences, 131,072 tokens a row and 8,192 tokens a step."""
    from kimi_jax.engine.runner import Runner
    runner = Runner(FakeSteps(16, dp, ops.ExecPlan()), num_pages=64, page_size=16, cache_dtype=None,
                    max_num_seqs=limits.max_num_seqs)
    progs = runner.programs(limits)
    assert len(progs) == len(set(progs)) == count <= 40
    rs = shapes.RaggedShapes.for_limits(limits, dp)
    forward = [k for k in progs if k.part == "forward"]
    assert {k.width for k in forward} == set(rs.ladder())
    assert min(rs.ladder()) == -(-shapes.RAGGED_MIN_TOKENS // dp) * dp
    assert max(rs.ladder()) <= shapes.bucket(limits.max_num_batched_tokens, 16) + dp
    assert {k.width for k in forward if k.prompt_logprobs is not None} == {
        T for T in rs.ladder() if T >= rs.prompt_tokens()}
    assert len([k for k in progs if k.part == "sample"]) == 4 * len({k.batch for k in forward})
    for k in forward:
        assert k.width % dp == 0 and k.batch % dp == 0
        assert k.batch == min(max(k.width, -(-shapes.RAGGED_MIN_ROWS // dp) * dp), rs.max_rows)
        rank_pages = limits.pages_per_rank or k.batch // dp * rs.max_pages
        assert k.table == dp * min(rank_pages, k.batch // dp * rs.max_pages)


@pytest.mark.parametrize("name", sorted(RAGGED))
def test_every_program_a_ragged_workload_runs_is_declared(name):
    reached, overlapped, drafted = set(), 0, 0
    for seed in range(3):
        seen, declared, stats = run_workload(seed, 24, stats=True, **RAGGED[name])
        missing = sorted({k for k in seen if k not in set(declared)}, key=str)
        assert not missing, f"{len(missing)} undeclared programs, e.g. {missing[:3]}"
        reached |= set(seen)
        overlapped += stats["overlapped_steps"]
        drafted += stats["drafted"]
    assert {k.kind for k in reached} == {"ragged"} and len(declared) <= 40
    assert (overlapped > 0) == RAGGED[name].get("overlap", False)
    assert (drafted > 0) == ("speculative" in RAGGED[name])
    assert any(k.prompt_logprobs for k in reached) and any(k.logprobs for k in reached)
    assert len({k.width for k in reached if k.part == "forward"}) > 1
