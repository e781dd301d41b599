"""One ragged step (ModelSteps.ragged_jit: decode rows, a fresh prompt chunk and a chunk after cached
tokens on one flat token axis, padding rows and tokens) equals the padded programs (step_jit's fresh
prefill, chunk prefill and decode) run on the same rows from the same pool: the same next-token
log-probabilities and prompt logprobs, the same greedy tokens through sample_jit, and the same pool
contents afterwards; on one device and on the 8 simulated devices' TP, TP+EP and DP+EP layouts (under DP
each rank's block holds its own rows over its own part of the pool, ids local to it, and no
collective moves pool-sized bytes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import LLM, SamplingParams, ops
from kimi_jax.config import preset
from kimi_jax.engine.sampling import SamplingArrays
from kimi_jax.engine.steps import RaggedBatch, SampleInputs, StepBatch
from kimi_jax.ops import RaggedRows
from kimi_jax.tools import profiling

CFG = preset("tiny")
PAGE, PAGES_PER_RANK, T_RANK, N_PROMPT = 4, 128, 16, 2
LAYOUTS = {
    "1dev": dict(),
    # the GPU plan's layer loop and weights (each layer a call of one jitted body) on the XLA ops
    "1dev_unroll": dict(exec_plan=ops.ExecPlan(layer_loop="unroll", layer_weights="per_layer",
                                               pack_vectors=True)),
    "tp4": dict(tensor_parallel_size=4),
    "tp4_ep": dict(tensor_parallel_size=4, enable_expert_parallel=True),
    "dp2_tp4_ep": dict(data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True),
    "dp8_ep": dict(data_parallel_size=8, enable_expert_parallel=True),
}
SLOW = {"1dev_unroll", "tp4", "tp4_ep", "dp8_ep"}   # by default: 1dev, and dp2_tp4_ep (DP, TP heads, EP)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


class Row:
    """One row of a rank's block: `cached` tokens already in the pool, `n` fed this step."""

    def __init__(self, kind, cached, n, rng, free):
        self.kind, self.cached, self.n = kind, cached, n
        self.tokens = rng.integers(2, CFG.vocab_size, cached + n).tolist()
        self.targets = rng.integers(2, CFG.vocab_size, n).tolist()      # prompt-logprob targets
        self.pages = [free.pop() for _ in range(-(-(cached + n) // PAGE))]


def rank_rows(rng):
    """A rank's rows, in their order on its block: a decode row, a fresh chunk, a chunk after cached
    tokens, a padding row, a second decode row (then padding tokens)."""
    free = rng.permutation(PAGES_PER_RANK).tolist()           # pages in no order
    return [Row("decode", int(rng.integers(5, 14)), 1, rng, free),
            Row("fresh", 0, int(rng.integers(2, 7)), rng, free),
            Row("chunk", int(rng.integers(3, 10)), int(rng.integers(2, 6)), rng, free),
            Row("pad", 0, 0, rng, free),
            Row("decode", int(rng.integers(5, 14)), 1, rng, free)]


def greedy(B):
    return SamplingArrays.build([SamplingParams(temperature=0.0)] * B, list(range(B)))


def padded_batch(rows, width, max_pages, start=None):
    """A StepBatch of rows (one per batch row, the ranks' rows in turn): tokens from `start` (default:
    the row's cached tokens) up to its end, padded to `width` columns."""
    B = len(rows)
    tokens = np.zeros((B, width), np.int32)
    pos = np.full((B, width), -1, np.int32)
    targets = np.full((B, width), -1, np.int32)
    table = np.zeros((B, max_pages), np.int32)
    last = np.zeros(B, np.int32)
    for i, r in enumerate(rows):
        s = r.cached if start is None else start
        end = r.cached + r.n if start is None else r.cached
        tokens[i, :end - s] = r.tokens[s:end]
        pos[i, :end - s] = np.arange(s, end)
        if start is None:
            targets[i, :r.n] = r.targets
        table[i, :len(r.pages)] = r.pages
        last[i] = end - s - 1
    z = np.zeros(B, np.int32)
    if width == 1:
        return StepBatch(tokens[:, 0], pos, table, last, z, greedy(B))
    return StepBatch(tokens, pos, table, last, z, greedy(B), targets_BT=targets)


def ragged_batch(blocks, dp):
    """The RaggedBatch of every rank's rows: rank k's tokens at [k * T_RANK, (k + 1) * T_RANK)."""
    T, per_rank = dp * T_RANK, len(blocks[0])
    max_pages = max(len(r.pages) for b in blocks for r in b)
    tokens, pos, targets = (np.zeros(T, np.int32), np.full(T, -1, np.int32), np.full(T, -1, np.int32))
    slots = np.full(T, PAGES_PER_RANK * PAGE, np.int32)              # padding: past the rank's pages
    fields = {k: np.zeros(dp * per_rank, np.int32) for k in ("start", "len", "cached", "first")}
    sample = np.zeros(dp * per_rank, np.int32)
    pages_X = np.zeros(dp * per_rank * max_pages, np.int32)
    for k, block in enumerate(blocks):
        at = start = 0
        for j, r in enumerate(block):
            b, t0 = k * per_rank + j, k * T_RANK + start
            p = r.cached + np.arange(r.n)
            tokens[t0:t0 + r.n] = r.tokens[r.cached:]
            pos[t0:t0 + r.n] = p
            targets[t0:t0 + r.n] = r.targets
            slots[t0:t0 + r.n] = np.asarray(r.pages)[p // PAGE] * PAGE + p % PAGE
            for f, v in zip(("start", "len", "cached", "first"), (start, r.n, r.cached, at)):
                fields[f][b] = v
            sample[b] = start + max(r.n, 1) - 1
            x0 = k * per_rank * max_pages + at
            pages_X[x0:x0 + len(r.pages)] = r.pages
            at, start = at + len(r.pages), start + r.n
    rows = RaggedRows(fields["start"], fields["len"], fields["cached"], fields["first"], pages_X)
    return RaggedBatch(tokens, pos, slots, rows, sample, targets_T=targets), max_pages


def logprobs_of(out):
    """[B, V] log-probabilities from a step's top-V logprobs (every token, sorted)."""
    lp = np.zeros(np.asarray(out["top_ids"]).shape, np.float32)
    np.put_along_axis(lp, np.asarray(out["top_ids"]), np.asarray(out["top_vals"]), axis=1)
    return lp


@pytest.mark.parametrize("name", [pytest.param(n, marks=(pytest.mark.slow,) if n in SLOW else ())
                                  for n in LAYOUTS])
def test_ragged_step_equals_the_padded_programs(ckpt, name):
    lay = LAYOUTS[name]
    dp = lay.get("data_parallel_size", 1)
    eng = LLM(ckpt, dtype="float32", block_size=PAGE, max_num_seqs=4 * dp,
              num_gpu_blocks_override=dp * PAGES_PER_RANK, **lay).frontend.steps
    plan, V = eng.exec_plan, CFG.vocab_size
    rng = np.random.default_rng(dp * 10 + len(lay))
    blocks = [rank_rows(rng) for _ in range(dp)]
    batch, max_pages = ragged_batch(blocks, dp)
    of = lambda kind: [r for b in blocks for r in b if r.kind == kind]          # noqa: E731
    run = lambda pages, b, **kw: eng.step_jit(eng.weights, pages, b, plan=plan, **kw)   # noqa: E731

    # the cached tokens of the chunk and decode rows, by a fresh prefill
    cached = [r for b in blocks for r in b if r.cached]
    pages, _ = run(eng.init_pages(dp * PAGES_PER_RANK, PAGE),
                   padded_batch(cached, 16, max_pages, start=0), kind="prefill", fresh=True)
    copy = lambda p: jax.tree.map(jnp.copy, p)                                 # noqa: E731

    # the padded programs, one per kind of row (each rank's rows of that kind in its batch block)
    want_pages, want = copy(pages), {}
    for kind, width, fresh in (("fresh", 8, True), ("chunk", 8, False), ("decode", 1, False)):
        step_kind = "decode" if kind == "decode" else "prefill"
        extra = {} if kind == "decode" else dict(n_prompt_logprobs=N_PROMPT)
        want_pages, out = run(want_pages, padded_batch(of(kind), width, max_pages), kind=step_kind,
                              fresh=fresh, n_logprobs=V, **extra)
        want[kind] = out

    args = (eng.weights, copy(pages), batch)
    compiled = eng.ragged_jit.lower(*args, plan=plan, max_pages=max_pages).compile()
    if dp > 1:
        # each rank reads and writes its own part of the pool: no collective moves as many bytes as
        # one layer's part (128 pages: 80 KiB; the step's largest collective, dp8's tokens: 32 KiB)
        part = PAGES_PER_RANK * PAGE * CFG.latent_dim * 4
        big = [(o.kind, o.bytes) for o in profiling.collectives_of_hlo(compiled.as_text()).ops
               if not o.trivial and o.bytes >= part]
        assert not big, big
    got_pages, logits = compiled(*args)
    assert logits.shape == (len(batch.sample_B), V)
    # with prompt logprobs: the same pool and logits (the sampled rows' logits taken from every token's)
    prompt_pages, (prompt_logits, prompt) = eng.ragged_jit(
        eng.weights, copy(pages), batch, plan=plan, max_pages=max_pages, n_prompt_logprobs=N_PROMPT)
    np.testing.assert_allclose(np.asarray(prompt_logits), np.asarray(logits), atol=1e-5, rtol=0)
    for kind in got_pages:
        np.testing.assert_array_equal(np.asarray(prompt_pages[kind]), np.asarray(got_pages[kind]))
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    tokens = np.asarray(eng.sample_jit(logits, SampleInputs(greedy(len(batch.sample_B)),
                                                            np.zeros(len(batch.sample_B), np.int32)))["tokens"])
    flat = [r for b in blocks for r in b]
    starts = np.asarray(batch.rows.query_start_B) + np.repeat(np.arange(dp) * T_RANK, len(blocks[0]))
    # float32 on both sides, but the padded prefill programs run expanded MLA (W_UK, W_UV applied to
    # the keys and values) where the ragged step runs absorbed MLA, and each batch is padded otherwise:
    # the same function summed in another order, ~1e-6 on log-probabilities of size ~6 (1e-4: margin)
    for kind in ("fresh", "chunk", "decode"):
        ids = [i for i, r in enumerate(flat) if r.kind == kind]
        np.testing.assert_allclose(lp[ids], logprobs_of(want[kind]), atol=1e-4, rtol=0)
        assert tokens[ids].tolist() == np.asarray(want[kind]["tokens"]).tolist()
        if kind == "decode":
            continue
        for i, r in zip(ids, of(kind)):          # prompt logprobs of the row's tokens
            j = ids.index(i)
            np.testing.assert_allclose(np.asarray(prompt["prompt_logprob"])[starts[i]:starts[i] + r.n],
                                       np.asarray(want[kind]["prompt_logprob"])[j, :r.n], atol=1e-4, rtol=0)
            assert (np.asarray(prompt["prompt_top_ids"])[starts[i]:starts[i] + r.n].tolist()
                    == np.asarray(want[kind]["prompt_top_ids"])[j, :r.n].tolist())
    # the pool: every row's latents written at the same slots (padding tokens wrote nothing); latents
    # of size ~1 that differ as the hidden states above do
    for kind in got_pages:
        np.testing.assert_allclose(np.asarray(got_pages[kind]), np.asarray(want_pages[kind]),
                                   atol=1e-5, rtol=0)
        assert not np.array_equal(np.asarray(got_pages[kind]), np.asarray(pages[kind]))
        assert got_pages[kind].sharding.is_equivalent_to(want_pages[kind].sharding, 4)
