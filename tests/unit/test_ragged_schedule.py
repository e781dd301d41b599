"""The scheduler's ragged layout (step_layout="ragged"): one plan an iteration, decode rows before
prompt chunks, the token budget and long_prefill_token_threshold held, each data-parallel rank's
rows in its block, preemption with a small pool; plans checked as the scheduler makes them and
booked with fixed sampled tokens."""
import numpy as np

from kimi_jax import ops
from kimi_jax.engine.args import CacheConfig, SchedulerConfig
from kimi_jax.engine.requests import new_request
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.scheduler import Scheduler
from kimi_jax.engine.shapes import bucket
from kimi_jax.engine.steps import StepOutput


def scheduler(*, budget, threshold=0, dp=1, num_pages=64, max_num_seqs=8, page_size=4,
              max_model_len=256, caching=False) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs, max_model_len, 16, 64, step_layout="ragged",
                         max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    return Scheduler(sc, CacheConfig(page_size, num_pages, enable_prefix_caching=caching),
                     vocab_size=32, batch_size=lambda n: -(-bucket(n, 1) // dp) * dp, dp=dp,
                     exec_plan=ops.ExecPlan())


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, seed: int = 0):
    prompt = np.random.default_rng(seed).integers(1, 32, n_prompt).tolist()
    r = new_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True), seed, None, vocab_size=32,
                    max_model_len=s.max_model_len, page_size=s.page_size,
                    pages_per_rank=s.pool.per_part, dp=s.dp, eos_ids=frozenset(),
                    tokenizer=None)
    s.add(r)
    return r


def step(s: Scheduler):
    """The iteration's one plan, booked with token 7 for every row; (plan, finished)."""
    plan = s.schedule()
    assert plan is not None and plan.kind == "ragged" and s.schedule() is None
    out = StepOutput(tokens=np.full((plan.batch,), 7, np.int32))
    return plan, s.update(plan, out)


def check_layout(s: Scheduler, plan):
    """Rows in their rank's block, each rank within its tokens, rows and pages."""
    shapes, dp = s.ragged_shapes, s.dp
    assert plan.width == shapes.tokens(plan.width // dp) or plan.width in shapes.ladder()
    assert plan.batch == shapes.rows(plan.width) and plan.table == shapes.pages(plan.width)
    per = plan.batch // dp
    for k in range(dp):
        rows = [row for row in plan.rows if row.req.rank == k]
        assert [row.batch_row for row in rows] == list(range(k * per, k * per + len(rows)))
        assert sum(row.n for row in rows) <= min(plan.width // dp, shapes.rank_tokens)
        assert sum(len(row.pages) for row in rows) <= plan.table // dp


def test_decode_rows_first_then_prompt_chunks_within_the_budget():
    s = scheduler(budget=24)
    a, b = add(s, "a", 5), add(s, "b", 9, seed=1)
    plan, _ = step(s)                       # both prompts whole: 14 tokens
    assert [(row.req.request_id, row.n) for row in plan.rows] == [("a", 5), ("b", 9)]
    assert plan.width == 16 and plan.batch == 8
    c, d = add(s, "c", 30, seed=2), add(s, "d", 3, seed=3)
    plan, _ = step(s)                       # 2 decode rows, then c's chunk takes the 22 left
    check_layout(s, plan)
    assert [(row.req.request_id, row.n) for row in plan.rows] == [("a", 1), ("b", 1), ("c", 22)]
    assert [row.start for row in plan.rows] == [5, 9, 0] and plan.width == 32
    plan, _ = step(s)                       # c's last 8, then d whole (FCFS)
    assert [(row.req.request_id, row.n) for row in plan.rows] == [
        ("a", 1), ("b", 1), ("c", 8), ("d", 3)]
    plan, _ = step(s)
    assert [row.n for row in plan.rows] == [1, 1, 1, 1]
    assert a.output_ids == [7] * 4 and c.output_ids == [7, 7] == d.output_ids


def test_a_chunk_takes_at_most_the_threshold():
    s = scheduler(budget=64, threshold=8)
    add(s, "a", 20)
    add(s, "b", 3, seed=1)
    plan, _ = step(s)
    assert [(row.req.request_id, row.n) for row in plan.rows] == [("a", 8), ("b", 3)]
    plan, _ = step(s)
    assert [(row.req.request_id, row.n) for row in plan.rows] == [("b", 1), ("a", 8)]
    plan, _ = step(s)
    assert [(row.req.request_id, row.n) for row in plan.rows] == [("b", 1), ("a", 4)]


def test_each_rank_takes_its_share_of_the_budget_in_its_block():
    s = scheduler(budget=32, dp=2, num_pages=64, max_num_seqs=8)
    reqs = [add(s, str(i), n, seed=i) for i, n in enumerate([20, 5, 3, 40])]
    seen = 0
    while s.has_unfinished():
        plan, _ = step(s)
        check_layout(s, plan)
        for k in range(2):
            assert sum(row.n for row in plan.rows if row.req.rank == k) <= 16
        seen += 1
        assert seen < 40
    assert {r.rank for r in reqs} == {0, 1} and all(len(r.output_ids) == 4 for r in reqs)


def test_a_small_pool_preempts_the_newest_and_every_request_finishes():
    s = scheduler(budget=16, num_pages=10, max_num_seqs=4, page_size=4)
    reqs = [add(s, str(i), 10, max_tokens=8, seed=i) for i in range(3)]
    for _ in range(60):
        if not s.has_unfinished():
            break
        plan, _ = step(s)
        check_layout(s, plan)
        assert sum(row.n for row in plan.rows) <= 16
    assert not s.has_unfinished() and s.stats["preemptions"] > 0
    assert all(r.output_ids == [7] * 8 for r in reqs)


def test_a_prefix_cache_hit_skips_the_cached_pages():
    s = scheduler(budget=64, caching=True)
    add(s, "a", 13, max_tokens=1)
    step(s)
    b = add(s, "b", 13, max_tokens=1)        # the same prompt: 3 full pages of 4 cached
    plan, _ = step(s)
    assert [(row.start, row.n) for row in plan.rows] == [(12, 1)] and b.num_cached_tokens == 12


def test_drafts_beside_a_long_prompt_are_free_and_alone_are_timed():
    """Speculation in the ragged step: while a long prompt's chunks fill the budget, a decode row's
    drafts leave the step's width as it is, so they are taken without timing anything; once only
    decode rows remain (1 + 4 drafts: past the 4-token width), the gate times the two widths (here:
    drafts never pay) and stops drafting. A verifying row's accepted drafts and token are booked."""
    from kimi_jax.engine.speculative import SpeculativeConfig
    sc = SchedulerConfig(4, 512, 16, 64, step_layout="ragged", max_num_batched_tokens=24,
                         speculative_config=SpeculativeConfig(num_speculative_tokens=4,
                                                              prompt_lookup_min=1))
    timed = []
    s = Scheduler(sc, CacheConfig(4, 128), vocab_size=32, batch_size=lambda n: bucket(n, 1),
                  dp=1, exec_plan=ops.ExecPlan(),
                  measure=lambda p0, p1: timed.append((p0.width, p1.width)) or (1.0, 100.0))
    cycle = [11, 12, 13, 14, 15]
    a = new_request("a", cycle * 3, SamplingParams(temperature=0.0, max_tokens=120,
                                                     ignore_eos=True), 0, None, vocab_size=32,
                    max_model_len=512, page_size=4, pages_per_rank=s.pool.per_part, dp=1,
                    eos_ids=frozenset(), tokenizer=None)
    s.add(a)            # a continues its cycle: its drafts are right, every one accepted
    b = add(s, "b", 100, max_tokens=2, seed=1)
    beside, after = [], []
    while s.has_unfinished():
        plan = s.schedule()
        assert plan is not None and s.schedule() is None
        check_layout(s, plan)
        tokens, acc = np.full((plan.batch,), 7, np.int32), np.zeros((plan.batch,), np.int32)
        for row in plan.rows:
            acc[row.batch_row] = row.drafts
            if row.req is a:
                tokens[row.batch_row] = cycle[(len(a.output_ids) + row.drafts) % 5]
        drafted = sum(row.drafts for row in plan.rows)
        if (4, 8) in timed:
            after.append((drafted, plan.width))
        elif b.pending > 1:
            beside.append(drafted)
        s.update(plan, StepOutput(tokens=tokens, accepted=acc))
    assert sum(beside) > 0                   # drafted while b's chunks filled the steps
    # timed where the drafts widen the step (b's last chunk short, then a alone), once a pair
    assert (4, 8) in timed and len(set(timed)) == len(timed) and all(t0 < t1 for t0, t1 in timed)
    # a alone, timed: drafts never pay, but for the last ones that fit the 4-token width (free)
    assert len(after) > 10 and all(w == 4 for d, w in after if d)
    assert sum(d > 0 for d, _ in after) <= 2
    assert a.output_ids == [cycle[i % 5] for i in range(120)] and len(b.output_ids) == 2
    assert s.stats["accepted"] == s.stats["drafted"] >= sum(beside)
