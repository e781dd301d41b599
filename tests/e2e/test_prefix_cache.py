"""Automatic prefix caching: the page pool's bookkeeping, and generation with caching on giving the
tokens of caching off (float32 greedy) on one device and the 8-device layouts, with chunked prefill,
preemption, speculation and eviction under pressure; freed pages are poisoned so that a page still read
after it was given up would change the tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset
from kimi_jax.engine.page_pool import PagePool, chain_hashes

CFG = preset("tiny")


# ---- the pool ---------------------------------------------------------------------------------
def test_chain_hashes_depend_on_every_earlier_token():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], 2, [])
    assert len(a) == 3                                  # full pages only
    b = chain_hashes([9, 2, 3, 4, 5, 6], 2, [])
    assert all(x != y for x, y in zip(a, b))            # a change in page 0 changes every later hash
    known = chain_hashes([1, 2, 3], 2, [])
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7], 2, known) == a   # extends what was computed


def test_pool_reference_counts_lru_and_reclaim():
    reclaimed = []
    pool = PagePool(4, caching=True, on_reclaim=lambda part, pages: reclaimed.extend(pages))
    h = chain_hashes(list(range(8)), 2, [])             # 4 page hashes
    a = pool.take(2)
    pool.register(a, h[:2], 0)
    b = pool.acquire(h[:3], 0)                          # a second request shares both cached pages
    assert b == a and pool.free_in(0) == 2
    pool.give(a, 0)                                     # the first lets go: still held by the second
    assert pool.free_in(0) == 2 and pool.cached_in(0) == 0
    pool.give(b, 0)                                     # now cached, evictable, not reclaimed
    assert pool.free_in(0) == 4 and pool.cached_in(0) == 2 and reclaimed == []
    c = pool.take(2)                                    # free pages go first: the cache survives
    assert set(c).isdisjoint(a) and pool.peek(h, 0) == 2
    d = pool.take(1)                                    # the least recently used cached page is evicted
    assert d == [a[0]] and reclaimed == [a[0]] and pool.peek(h, 0) == 0
    pool.give(c, 0)                                     # unhashed pages are reclaimed at once
    assert sorted(reclaimed) == sorted([a[0], *c])
    assert pool.take(5) is None and pool.free_in(0) == 3   # nothing taken on a failed take


def test_register_keeps_the_first_page_of_a_hash():
    pool = PagePool(4, caching=True)
    h = chain_hashes([5, 6], 2, [])
    x, y = pool.take(1), pool.take(1)                   # two requests computed the same page
    pool.register(x, h, 0)
    pool.register(y, h, 0)
    assert pool.acquire(h, 0) == x
    pool.give(y, 0)
    assert pool.cached_in(0) == 0 and pool.free_in(0) == 3     # the duplicate was freed, not cached


# ---- through the engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


def shared_prefix_prompts(n, prefix_len, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, CFG.vocab_size, prefix_len).tolist()
    return [prefix + rng.integers(2, CFG.vocab_size, int(rng.integers(1, 12))).tolist() for _ in range(n)]


# Large and finite: the steps legitimately read unused block-table slots (page 0) at masked positions
# with weight exactly 0, where NaN would turn 0 * NaN into NaN; a real read of a poisoned latent moves
# the logits by orders of magnitude and changes the greedy tokens.
POISON = 1e4


def poison_freed(core):
    """Fill every page the pool gives up with POISON, on the device, at the moment it is given up."""
    def poison(part, pages):
        ids = jnp.asarray([part * pool.per_part + p for p in pages], jnp.int32)
        core.runner.pages = {k: v.at[:, ids].set(POISON) for k, v in core.runner.pages.items()}
    pool = core.scheduler.pool
    pool.on_reclaim = poison
    return core


def run(llm, prompts, params, poison=False):
    core = llm.frontend.make_core()
    if poison:
        poison_freed(core)
    reqs = [r for i, (p, sp) in enumerate(zip(prompts, params))
            for r in core.make_request(str(i), p, sp, seed=i)]
    for r in reqs:
        core.add([r])
    core.run()
    return [r.output_ids for r in reqs], reqs, core


def all_pages_back(core):
    pool = core.scheduler.pool
    return len(pool.free) == pool.num_pages       # every page came back (cached or free)


def greedy(n, m=6):
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)] * n


def test_generate_reports_cached_tokens_and_keeps_the_cache_between_calls(ckpt):
    ps = shared_prefix_prompts(3, 40)
    off = LLM(ckpt, dtype="float32", block_size=8, enable_prefix_caching=False)
    on = LLM(ckpt, dtype="float32", block_size=8, enable_prefix_caching=True)
    ref = [o.outputs[0].token_ids for o in off.generate(ps, greedy(3))]
    first = on.generate(ps[:1], greedy(1))
    rest = on.generate(ps[1:], greedy(2))
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [40, 40]        # 5 full pages of the shared prefix
    again = on.generate(ps[:1], greedy(1))[0]                   # prompt + its own output now cached too
    assert again.outputs[0].token_ids == ref[0] and again.num_cached_tokens == (len(ps[0]) - 1) // 8 * 8


@pytest.mark.parametrize("layout", [dict(),
                                    pytest.param(dict(data_parallel_size=2, tensor_parallel_size=4,
                                                      enable_expert_parallel=True), marks=pytest.mark.slow),
                                    pytest.param(dict(data_parallel_size=8, enable_expert_parallel=True),
                                                 marks=pytest.mark.slow)],
                         ids=["1dev", "dp2tp4ep", "dp8ep"])
def test_caching_gives_the_uncached_tokens(ckpt, layout):
    """Chunked prefill (chunks of 16 over 4-token pages), a pool small enough to preempt, poisoned
    freed pages; greedy float32 tokens equal with caching off."""
    ps = shared_prefix_prompts(6, 29, seed=1) + shared_prefix_prompts(3, 21, seed=2)
    params = greedy(len(ps), m=5)
    kw = dict(dtype="float32", max_num_seqs=4, block_size=4, prefill_chunk=16, max_prefill_tokens=24, **layout)
    dp = layout.get("data_parallel_size", 1)
    kw["num_gpu_blocks_override"] = 24 * dp
    ref, _, _ = run(LLM(ckpt, enable_prefix_caching=False, **kw), ps, params)
    got, reqs, core = run(LLM(ckpt, enable_prefix_caching=True, **kw), ps, params, poison=True)
    assert got == ref
    assert core.stats["prefix_cache_hits"] > 0 and all_pages_back(core)
    assert core.stats["prompt_tokens"] < sum(len(p) for p in ps)      # cached tokens were not recomputed


def test_eviction_under_pressure_and_preemption(ckpt):
    """More distinct cached prefixes than the pool holds, seeded sampling: the cache evicts least
    recently used pages, preempted requests come back, tokens equal caching off, poisoned pages
    never read."""
    ps = [p for s in range(4) for p in shared_prefix_prompts(3, 24, seed=10 + s)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, ignore_eos=True, seed=3)] * len(ps)
    kw = dict(dtype="float32", max_num_seqs=3, block_size=4, num_gpu_blocks_override=14, prefill_chunk=16)
    ref, _, _ = run(LLM(ckpt, enable_prefix_caching=False, **kw), ps, params)
    got, _, core = run(LLM(ckpt, enable_prefix_caching=True, **kw), ps, params, poison=True)
    assert got == ref and all_pages_back(core)
    assert core.scheduler.pool.evictions > 0
    assert core.stats["preemptions"] > 0 and core.stats["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_caching_with_speculation(ckpt):
    rng = np.random.default_rng(5)
    motif = rng.integers(2, CFG.vocab_size, 6).tolist()
    prefix = motif * 5
    ps = [prefix + rng.integers(2, CFG.vocab_size, 3).tolist() for _ in range(3)]
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    kw = dict(dtype="float32", block_size=4, max_num_seqs=2, speculative_config=spec)
    ref, _, _ = run(LLM(ckpt, enable_prefix_caching=False, **kw), ps, greedy(3, m=8))
    got, _, core = run(LLM(ckpt, enable_prefix_caching=True, **kw), ps, greedy(3, m=8), poison=True)
    assert got == ref and core.stats["prefix_cache_hits"] > 0 and all_pages_back(core)


def test_no_hits_without_caching(ckpt):
    ps = shared_prefix_prompts(2, 16)
    _, reqs, core = run(LLM(ckpt, dtype="float32", block_size=4, enable_prefix_caching=False), ps, greedy(2))
    assert core.stats["prefix_cache_hits"] == 0 and all(r.num_cached_tokens == 0 for r in reqs)


def test_a_repeated_workload_compiles_nothing_new(ckpt):
    """The first decode step's host-fed tokens are committed like the steps' own output tokens, so the
    programs compiled by one run of a workload serve every later run (a fresh pool, cached prefixes)."""
    llm = LLM(ckpt, dtype="float32", block_size=4, max_num_seqs=4, enable_prefix_caching=True)
    ps = shared_prefix_prompts(4, 12, seed=7)
    run(llm, ps, greedy(4))
    steps = (llm.frontend.steps.step_jit,)
    sizes = [f._cache_size() for f in steps]
    run(llm, ps, greedy(4))
    assert [f._cache_size() for f in steps] == sizes
