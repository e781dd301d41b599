"""The paged pool under data parallelism: its page axis is split over the dp ranks (each holds only the
pages of its own batch rows, ids local to the rank), and every layout gives the single-device greedy
tokens with more requests than slots and a pool small enough to force preemption; the compiled paged
steps move no pool-sized bytes between devices."""
from __future__ import annotations

import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset

CFG = preset("tiny")          # 4 heads, 8 experts: tp 2 and EP over 8 devices both divide
LAYOUTS = {
    "dp2_tp2_ep": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
    "dp4_tp2_ep": dict(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True),
    "dp8_ep": dict(data_parallel_size=8, enable_expert_parallel=True),
    "dp2": dict(data_parallel_size=2),
}
PAGES_PER_RANK, PAGE, SLOTS_PER_RANK = 12, 4, 2


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


def workload(n, seed=0):
    rng = np.random.default_rng(seed)
    ps = [rng.integers(2, CFG.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(1, 12, n)]
    return ps, params


def run(llm, ps, params):
    core = llm.frontend.make_core()
    reqs = [r for i, (p, sp) in enumerate(zip(ps, params))
            for r in core.make_request(str(i), p, sp, seed=0)]
    for r in reqs:
        core.add([r])
    core.run()
    s = core.scheduler
    assert not s.running and not s.waiting
    assert len(s.pool.free) == s.pool.num_pages        # every page came back
    return [r.output_ids for r in reqs], core


# the mixed DP x TP layouts are long checks (--run-slow); dp2 and dp8_ep run by default both ways
_SLOW_DP = {("dp2_tp2_ep", False), ("dp4_tp2_ep", False), ("dp2_tp2_ep", True), ("dp4_tp2_ep", True)}


@pytest.mark.parametrize("name,overlap", [pytest.param(n, o, marks=(pytest.mark.slow,) if (n, o) in _SLOW_DP else ())
                                          for o in (False, True) for n in sorted(LAYOUTS)])
def test_dp_split_pool_equals_single_device(ckpt, name, overlap):
    lay = LAYOUTS[name]
    dp = lay["data_parallel_size"]
    n = 4 * dp * SLOTS_PER_RANK if dp < 8 else 2 * dp * SLOTS_PER_RANK
    ps, params = workload(n, seed=dp)
    kw = dict(dtype="float32", block_size=PAGE, prefill_chunk=16, max_prefill_tokens=24,
              overlap_scheduling=overlap)
    # the reference: one device, one sequence at a time
    ref, _ = run(LLM(ckpt, max_num_seqs=1, num_gpu_blocks_override=PAGES_PER_RANK, **kw), ps, params)
    llm = LLM(ckpt, max_num_seqs=dp * SLOTS_PER_RANK, num_gpu_blocks_override=dp * PAGES_PER_RANK, **kw, **lay)
    got, core = run(llm, ps, params)
    assert got == ref
    assert core.stats["preemptions"] > 0                 # a partition really ran dry
    # each device holds its rank's partition only (after steps: the pool the steps returned)
    for kind, pool in core.runner.pages.items():
        L, num_pages, page, C = pool.shape
        assert num_pages == dp * PAGES_PER_RANK
        assert {s.data.shape for s in pool.addressable_shards} == {(L, PAGES_PER_RANK, page, C)}
        # rank k's devices hold global pages [k * 12, (k + 1) * 12)
        starts = {s.index[1].start for s in pool.addressable_shards}
        assert starts == {k * PAGES_PER_RANK for k in range(dp)}


def test_fresh_pool_is_created_split(ckpt):
    llm = LLM(ckpt, dtype="float32", max_num_seqs=4, block_size=PAGE, num_gpu_blocks_override=8 * 5,
              data_parallel_size=8, enable_expert_parallel=True)
    core = llm.frontend.make_core()
    assert core.scheduler.pool.parts == 8 and core.scheduler.pool.per_part == 5
    for pool in core.runner.pages.values():
        L, _, page, C = pool.shape
        assert len(pool.addressable_shards) == 8
        assert {s.data.shape for s in pool.addressable_shards} == {(L, 5, page, C)}
    # tp-only: one partition, the pool whole on every device (as before)
    core1 = LLM(ckpt, dtype="float32", max_num_seqs=4, block_size=PAGE, num_gpu_blocks_override=10,
                tensor_parallel_size=2).frontend.make_core()
    assert core1.scheduler.pool.parts == 1
    for pool in core1.runner.pages.values():
        assert {s.data.shape for s in pool.addressable_shards} == {pool.shape}


@pytest.mark.slow
def test_tp_only_layout_tokens_unchanged(ckpt):
    """dp = 1 (TP2): page ids are the global ones and the pool is whole; same tokens as one device."""
    ps, params = workload(8, seed=9)
    kw = dict(dtype="float32", block_size=PAGE, num_gpu_blocks_override=24, max_num_seqs=3, prefill_chunk=16,
              max_prefill_tokens=24)
    ref, _ = run(LLM(ckpt, **kw), ps, params)
    got, core = run(LLM(ckpt, tensor_parallel_size=2, **kw), ps, params)
    assert got == ref and core.stats["preemptions"] > 0


@pytest.mark.parametrize("name", ["dp2_tp2_ep", "dp8_ep", "dp2"])
def test_compiled_paged_steps_move_no_pool(ckpt, name):
    """Decode (absorbed), a prefill chunk over cached pages (expanded, pages gathered) and a fresh
    prefill: no collective moves as many bytes as one layer's pool shard (the pool stays put)."""
    from kimi_jax.tools import profiling
    from kimi_jax.engine.sampling import SamplingArrays
    from kimi_jax.engine.steps import StepBatch
    lay = LAYOUTS[name]
    dp = lay["data_parallel_size"]
    num_pages, page = 128 * dp, 16
    llm = LLM(ckpt, dtype="float32", max_num_seqs=2 * dp, block_size=page, num_gpu_blocks_override=num_pages, **lay)
    eng = llm.frontend.steps
    pages = eng.init_pages(num_pages, page)
    shard_bytes = (num_pages // dp) * page * CFG.latent_dim * 4          # one layer's pool shard
    B = eng.batch_size(2 * dp)
    table = np.tile(np.arange(4, dtype=np.int32), (B, 1))                 # local ids
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * B, list(range(B)))
    z = np.zeros((B,), np.int32)
    for T, absorbed, fresh in [(1, True, False), (16, False, False), (16, False, True)]:
        tok = np.ones((B, T), np.int32)
        pos = np.tile(np.arange(T, dtype=np.int32) + (0 if fresh else 20), (B, 1))
        batch = StepBatch(tok, pos, table, z, z, sp)
        kind = "decode" if absorbed else "prefill"
        compiled = eng.step_jit.lower(eng.state, pages, batch, kind=kind, n_logprobs=None,
                                      fresh=fresh, plan=eng.exec_plan).compile()
        ops = profiling.collectives_of_hlo(compiled.as_text()).ops
        big = [(o.kind, o.bytes, o.source) for o in ops if not o.trivial and o.bytes >= shard_bytes]
        assert not big, (T, absorbed, fresh, big)
        # and the pool comes out split as it went in
        out_pages = compiled.output_shardings[0]
        for kind, sh in out_pages.items():
            assert sh.is_equivalent_to(pages[kind].sharding, 4)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_ops_on_a_split_pool_equal_the_whole_pool(impl):
    """ops.mla_paged_attention (the decode kernel, interpreted on CPU, and the XLA path), gather_pages
    and write_pages on a pool whose pages are split over dp = 4 (tp = 2 splits the heads), with ids
    local to each row's rank and a layer index into the stack, equal the same ops on the whole pool
    with global ids."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from kimi_jax import ops
    from kimi_jax.model.mla import write_pages
    from kimi_jax.parallel.sharding import Layout
    lay = Layout(tensor_parallel_size=2, data_parallel_size=4)
    par = lay.moe_parallel()
    dp, L, per_rank, page, B, T, Np, N, A, R = 4, 3, 6, 4, 8, 2, 3, 8, 32, 16
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    pool = jax.random.normal(ks[0], (L, dp * per_rank, page, A + R), jnp.float32)
    q_lat = jax.random.normal(ks[1], (B, T, N, A), jnp.float32)
    q_pe = jax.random.normal(ks[2], (B, T, N, R), jnp.float32)
    new = jax.random.normal(ks[3], (B, T, A + R), jnp.float32)
    rng = np.random.default_rng(0)
    local = np.stack([rng.permutation(per_rank)[:Np] for _ in range(B)]).astype(np.int32)
    rank = np.arange(B) // (B // dp)
    glob = local + (rank * per_rank)[:, None]
    positions = (np.asarray([0, 1, 4, 5, 9, 3, 7, 8])[:, None] + np.arange(T)).astype(np.int32)
    positions[2, 1] = -1
    layer = 1
    split_pool = jax.device_put(pool, lay.sharding(P(None, "dp", None, None)))
    rows = lambda x: jax.device_put(x, lay.sharding(P("dp", *[None] * (x.ndim - 1))))   # noqa: E731
    heads = lambda x: jax.device_put(x, lay.sharding(P("dp", None, "tp", None)))        # noqa: E731

    got = jax.jit(lambda *a: ops.mla_paged_attention(*a, 0.2, plan=ops.ExecPlan(impl=impl), parallel=par,
                                                     layer=layer))(
        heads(q_lat), heads(q_pe), rows(new), split_pool, rows(local), rows(positions))
    want = ops.mla_paged_attention(q_lat, q_pe, new, pool[layer], glob, positions, 0.2, plan=ops.ExecPlan())
    valid = positions >= 0
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5, rtol=0)

    got = jax.jit(lambda p, t: ops.gather_pages(p, t, layer=layer, parallel=par))(split_pool, rows(local))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.gather_pages(pool[layer], glob)))

    new_LBTC = jax.random.normal(ks[4], (L, B, T, A + R), jnp.float32)
    got = jax.jit(lambda p, *a: write_pages(p, *a, parallel=par))(
        split_pool, rows(local), rows(positions), jax.device_put(new_LBTC, lay.sharding(P(None, "dp", None, None))))
    want = write_pages(pool, glob, positions, new_LBTC)
    assert got.sharding.is_equivalent_to(split_pool.sharding, 4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_default_pool_on_a_gpu_counts_every_dp_rank(monkeypatch):
    """On a device with a memory limit the default pool is what the free memory of one device holds,
    times dp: each device keeps only its rank's 1/dp of the pages."""
    import jax
    import jax.numpy as jnp
    from kimi_jax.engine.args import EngineConfig
    from kimi_jax.entrypoints import frontend
    from kimi_jax.parallel.sharding import Layout
    monkeypatch.setattr(frontend, "device_memory_bytes", lambda: 2 ** 30)
    cfg = CFG
    page_bytes = cfg.num_hidden_layers * 16 * cfg.latent_dim * 4
    ec = EngineConfig(cfg, block_size=16, max_num_seqs=10 ** 6, gpu_memory_utilization=0.5)
    for dp in (1, 4):
        used = jax.devices()[0].memory_stats() or {}
        expect = int((2 ** 30 * 0.5 - used.get("bytes_in_use", 0)) // page_bytes) * dp
        got = frontend._default_num_pages(cfg, Layout(1, dp, True), jnp.float32, ec, 10 ** 6)
        assert got == expect


def test_split_chunk_attention_under_dp_tp_ep_equals_single_device(ckpt, monkeypatch):
    """Prompt chunks after cached tokens through the unmasked split path ('xla_split', the CPU stand-in of
    the GPU default 'cudnn_split': the chunk against its cached keys and against itself, merged by
    log-sum-exp) under dp2 x tp2 + EP with a split pool give the single-device einsum path's greedy
    tokens (float32: the two differ in summation order only)."""
    from kimi_jax import ops
    from kimi_jax.ops import prefill_attention
    lay = LAYOUTS["dp2_tp2_ep"]
    ps, params = workload(8, seed=5)
    kw = dict(dtype="float32", block_size=PAGE, prefill_chunk=8, max_prefill_tokens=24)
    ref, _ = run(LLM(ckpt, max_num_seqs=1, num_gpu_blocks_override=PAGES_PER_RANK, **kw), ps, params)
    halves, real = [], prefill_attention._attention_lse_xla
    monkeypatch.setattr(prefill_attention, "_attention_lse_xla",
                        lambda *a, **k: halves.append(k["causal"]) or real(*a, **k))
    split = ops.ExecPlan(chunk_attention="xla_split")
    got, _ = run(LLM(ckpt, max_num_seqs=2 * SLOTS_PER_RANK, num_gpu_blocks_override=2 * PAGES_PER_RANK, exec_plan=split, **kw,
                     **lay), ps, params)
    assert set(halves) == {False, True}                  # traced: both halves of the split path
    assert got == ref
