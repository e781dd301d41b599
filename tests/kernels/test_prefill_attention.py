"""Fused attention for fresh prefills (ops.mla_prefill_attention): which path is chosen (decided at trace
time), the cuDNN formulation (v zero-padded to the qk head dim, one jax.nn.dot_product_attention call)
against the XLA einsum path, and engine generation through it. cuDNN does not run on CPU: its stand-in
is jax.nn.dot_product_attention(implementation="xla") on the very same padded inputs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import LLM, SamplingParams, ops
from kimi_jax.ops import prefill_attention
from kimi_jax.engine import steps as engine_mod
from kimi_jax.config import preset
from kimi_jax.model.mla import MLA

CFG = preset("tiny")
XLA, PALLAS = ops.ExecPlan(impl="xla"), ops.ExecPlan(impl="pallas")     # the CPU plan, the GPU one


def fresh_path(choice, base=XLA):
    """A plan forcing how fresh causal prefills attend."""
    return dataclasses.replace(base, prefill_attention=choice)


def chunk_path(choice, base=XLA):
    """A plan forcing how prefill chunks after cached tokens attend."""
    return dataclasses.replace(base, chunk_attention=choice)


@pytest.fixture
def recorder(monkeypatch):
    """Wraps prefill_attention._dot_product_attention: records the implementation each call asked for and runs the
    XLA implementation instead (so a 'cudnn' choice is checked without executing cuDNN)."""
    calls = []

    def fake(q, k, v, scale, implementation):
        calls.append(implementation)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")

    monkeypatch.setattr(prefill_attention, "_dot_product_attention", fake)
    return calls


# ---- (a) selection ------------------------------------------------------------------------------------

def test_path_selection():
    bf16, f32 = jnp.bfloat16, jnp.float32
    kimi = (192, 128)                                   # qk = 128 nope + 64 rope; v 128
    assert ops.prefill_attention_path(*kimi, bf16, causal=True, plan=PALLAS) == "cudnn"
    assert ops.prefill_attention_path(*kimi, jnp.float16, causal=True, plan=PALLAS) == "cudnn"
    assert ops.prefill_attention_path(*kimi, bf16, causal=False, plan=PALLAS) == "cudnn_split"  # chunk
    assert ops.prefill_attention_path(*kimi, bf16, causal=True, plan=XLA) == "einsum"      # not a GPU
    assert ops.prefill_attention_path(*kimi, f32, causal=True, plan=PALLAS) == "einsum"    # cuDNN: 16-bit
    assert ops.prefill_attention_path(264, 128, bf16, causal=True, plan=PALLAS) == "einsum"  # head > 256
    assert ops.prefill_attention_path(*kimi, bf16, causal=True) == "einsum"     # tests run on CPU
    assert ops.prefill_attention_path(*kimi, f32, causal=True, plan=fresh_path("xla")) == "xla"
    assert ops.prefill_attention_path(*kimi, f32, causal=False, plan=fresh_path("xla")) == "einsum"
    assert ops.prefill_attention_path(*kimi, bf16, causal=True, plan=fresh_path("einsum", PALLAS)) == "einsum"
    with pytest.raises(ValueError, match="prefill_attention"):
        fresh_path("flash")


def test_default_prefill_chunk():
    """LLM's prefill_chunk default follows the chunk path: 2048 where chunks after cached tokens take
    the split path (no [B, N, T, S] scores; a GPU with cuDNN), 256 where they take the einsum path."""
    from kimi_jax.entrypoints.llm import default_prefill_chunk
    cfg = preset("tiny")
    assert default_prefill_chunk(cfg, jnp.bfloat16) == 256                     # CPU: einsum
    assert default_prefill_chunk(cfg, jnp.bfloat16, PALLAS) == 2048            # as on a GPU: cudnn_split
    assert default_prefill_chunk(cfg, jnp.float32, PALLAS) == 256              # cuDNN takes 16-bit only
    split = chunk_path("xla_split")
    assert default_prefill_chunk(cfg, jnp.float32, split) == 2048
    assert LLM("tiny", dtype="float32", num_gpu_blocks_override=8, exec_plan=split).prefill_chunk == 2048
    assert LLM("tiny", dtype="float32", num_gpu_blocks_override=8, prefill_chunk=64, exec_plan=split).prefill_chunk == 64
    assert default_prefill_chunk(cfg, jnp.bfloat16, chunk_path("cudnn")) == 256   # one masked call
    assert LLM("tiny", dtype="float32", num_gpu_blocks_override=8).prefill_chunk == 256


def test_is_fresh():
    P = -1
    assert engine_mod.is_fresh(np.array([[0, 1, 2, 3], [0, 1, P, P], [P, P, P, P]]))
    assert not engine_mod.is_fresh(np.array([[0, 1, 2, 3], [5, 6, 7, P]]))        # a row with a cached prefix
    assert not engine_mod.is_fresh(np.array([[P, 0, 1, 2]]))                        # padding before tokens
    assert not engine_mod.is_fresh(np.array([[0, 1, P, 3]]))                        # a hole
    assert not engine_mod.is_fresh(np.array([[0, 2, 3, 4]]))                        # not consecutive


def _paged_inputs(seed=0, dtype=jnp.float32):
    """A paged prefill of 3 rows over a pool of garbage: row 0 full (12 tokens), row 1 of 5 tokens then
    padding, row 2 all padding (batch padding)."""
    B, T, page, X = 3, 12, 4, 16
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, T, CFG.hidden_size)), dtype)
    pos = np.full((B, T), -1, np.int32)
    pos[0] = np.arange(T)
    pos[1, :5] = np.arange(5)
    pool = jnp.asarray(rng.normal(size=(X, page, CFG.latent_dim)), dtype)
    table = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
    return x, jnp.asarray(pos), pool, jnp.asarray(table), pos >= 0


def _mla(dtype=jnp.float32):
    return MLA(CFG, dtype=dtype, rngs=nnx.Rngs(3))


def _run(mla, x, pos, pool, table, **kw):
    """The MLA layer jitted (traced afresh each call: the recorder sees every path taken)."""
    return jax.jit(lambda x, pos, pool, table: mla(x, pos, pool, block_table_BP=table, **kw))(x, pos, pool, table)


def test_mla_chooses_fused_only_for_fresh_prefill(recorder):
    mla = _mla()
    x, pos, pool, table, valid = _paged_inputs()
    ref, new_ref = _run(mla, x, pos, pool, table)                        # cached-prefix path (paged keys)
    assert recorder == []
    forced = fresh_path("xla")
    out, new = _run(mla, x, pos, pool, table, fresh=True, plan=forced)
    assert recorder == ["xla"]
    _run(mla, x, pos, pool, table, plan=forced)                          # not fresh: the einsum path
    _run(mla, x, pos, pool, table, fresh=True, absorbed=True, plan=forced)   # absorbed: never fused
    assert recorder == ["xla"]
    out_e, _ = _run(mla, x, pos, pool, table, fresh=True)               # CPU, automatic: einsum
    assert recorder == ["xla"]
    # the GPU plan (bf16 MLA: no INT4 weight, so no other kernel runs)
    mla16, b16 = _mla(jnp.bfloat16), jnp.bfloat16
    jax.eval_shape(lambda: mla16(x.astype(b16), pos, pool.astype(b16), block_table_BP=table, fresh=True,
                                 plan=PALLAS))
    assert recorder == ["xla", "cudnn"]
    jax.eval_shape(lambda: mla16(x.astype(b16), pos, pool.astype(b16), block_table_BP=table, plan=PALLAS))
    assert recorder == ["xla", "cudnn"]
    # the latents written to the cache are the same whichever path attends
    np.testing.assert_array_equal(np.asarray(new), np.asarray(new_ref))
    # real rows: the fresh paths (keys = new tokens only) match the paged-keys path; float32, the same
    # math in another summation order (and a concatenated vs split qk dot): ~1e-6 relative
    v = valid[..., None]
    for o in (out, out_e):
        np.testing.assert_allclose(np.where(v, np.asarray(o), 0), np.where(v, np.asarray(ref), 0),
                                   rtol=1e-4, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()                            # padding rows stay finite too


# ---- (b) the padded-v formulation against the einsum path --------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_padded_v_dot_product_attention_matches_einsum(dtype, tol):
    """Random q/k/v with Kimi's head-dim ratios scaled down (nope 32 + rope 16 = qk 48, v 32): ragged rows
    (full, partial with padding after, all padding). Tolerances: float32 differs only in summation order
    (~1e-6); bf16 inputs round the probabilities to bf16 in both paths, at different points of the
    (differently ordered) sums, so outputs may differ by about one bf16 ulp (2^-8 ~ 0.4%) of |o| <~ 3."""
    B, T, N, H, R, U = 4, 40, 4, 32, 16, 32
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    q_nope = jax.random.normal(ks[0], (B, T, N, H), dtype)
    q_pe = jax.random.normal(ks[1], (B, T, N, R), dtype)
    k = jax.random.normal(ks[2], (B, T, N, H), dtype)
    kpe = jax.random.normal(ks[3], (B, T, R), dtype)
    v = jax.random.normal(ks[4], (B, T, N, U), dtype)
    lengths = np.array([40, 17, 1, 0])
    pos = np.where(np.arange(T)[None, :] < lengths[:, None], np.arange(T)[None, :], -1)
    mask = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)
    scale = (H + R) ** -0.5
    args = (q_nope, q_pe, k, kpe, v, jnp.asarray(mask))
    run = lambda plan: np.asarray(jax.jit(  # noqa: E731
        lambda *a: ops.mla_prefill_attention(*a, scale, causal=True, plan=plan))(*args))
    ref = run(fresh_path("einsum"))
    out = run(fresh_path("xla"))
    valid = (pos >= 0)[..., None, None]
    assert out.shape == ref.shape == (B, T, N, U) and out.dtype == np.float32
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), rtol=tol, atol=tol)
    assert np.isfinite(out).all()


def test_sharded_dot_product_attention_per_shard(recorder, monkeypatch):
    """Under a dp2 x tp2 mesh the fused call runs per shard (shard_map: rows over dp, heads over tp) and
    gives the unsharded result."""
    from kimi_jax.parallel.sharding import Layout
    par = Layout(tensor_parallel_size=2, data_parallel_size=2).moe_parallel()
    B, T, N, H, R, U = 4, 8, 4, 16, 8, 16
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    args = (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, N, R)),
            jax.random.normal(ks[2], (B, T, N, H)), jax.random.normal(ks[3], (B, T, R)),
            jax.random.normal(ks[4], (B, T, N, U)))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    shapes, inner = [], prefill_attention._dot_product_attention
    monkeypatch.setattr(prefill_attention, "_dot_product_attention",
                        lambda q, *a: (shapes.append(q.shape), inner(q, *a))[1])
    forced = fresh_path("xla")
    ref = ops.mla_prefill_attention(*args, mask, 0.2, causal=True, plan=forced)
    out = jax.jit(lambda *a: ops.mla_prefill_attention(*a, mask, 0.2, causal=True, plan=forced, parallel=par))(
        *args)
    assert recorder == ["xla", "xla"]
    assert shapes == [(B, T, N, H + R), (B // 2, T, N // 2, H + R)]      # the second call saw one shard
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # a chunk after cached tokens (keys: 5 cached slots, then the chunk): the masked call per shard too,
    # its mask split over the rows like the queries
    S = 5 + T
    k2 = jax.random.normal(ks[2], (B, S, N, H))
    kpe2, v2 = jax.random.normal(ks[3], (B, S, R)), jax.random.normal(ks[4], (B, S, N, U))
    cached = np.array([5, 0, 3, 1])
    old = np.broadcast_to((np.arange(5)[None, :] < cached[:, None])[:, None, :], (B, T, 5))
    cmask = jnp.asarray(np.concatenate([old, np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))], -1))
    masked, inner_m = [], prefill_attention._masked_dot_product_attention
    monkeypatch.setattr(prefill_attention, "_masked_dot_product_attention",
                        lambda q, k, v, m, *a: (masked.append(m.shape), inner_m(q, k, v, m, *a))[1])
    chunk = (args[0], args[1], k2, kpe2, v2, cmask)
    ref = ops.mla_prefill_attention(*chunk, 0.2, plan=chunk_path("einsum"))
    out = jax.jit(lambda *a: ops.mla_prefill_attention(*a, 0.2, plan=chunk_path("xla"), parallel=par))(*chunk)
    assert masked == [(B // 2, T, S)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # the two unmasked calls merged ('xla_split'), per shard: the lengths split over the rows too
    parts, inner_p = [], prefill_attention._attention_lse_xla
    monkeypatch.setattr(prefill_attention, "_attention_lse_xla", lambda q, k, *a, **kw: (parts.append(k.shape),
                                                                             inner_p(q, k, *a, **kw))[1])
    lens = (jnp.asarray(cached, jnp.int32), jnp.full((B,), T, jnp.int32))
    split = chunk_path("xla_split")
    out = jax.jit(lambda *a, lens: ops.mla_prefill_attention(*a, 0.2, plan=split, parallel=par, chunk_lens=lens))(
        *chunk, lens=lens)
    assert parts == [(B // 2, 5, N // 2, H + R), (B // 2, T, N // 2, H + R)]     # cached keys, then the chunk
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ---- (c) engine generation ----------------------------------------------------------------------------

def test_engine_generation_same_tokens(recorder, monkeypatch):
    """Greedy tokens with fresh prefills through dot_product_attention (xla stand-in for cuDNN) equal the
    tokens of the engine without the fresh path (every prefill over paged keys, as before). Chunks of 16
    tokens: the first step is a fresh prefill (rows of 7, 16, 16 tokens and a padding row), the second
    continues two prompts after a cached prefix (einsum path)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (7, 17, 27)]
    # few shapes to compile (compiles dominate the time): the first prompt, done a step earlier, decodes
    # one token more, so all three finish together and decode at one batch size
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 4, 4)]
    kw = dict(dtype="float32", max_num_seqs=4, block_size=16, num_gpu_blocks_override=16, prefill_chunk=16,
              max_prefill_tokens=48)
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "is_fresh", lambda positions: False)
        before = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(prompts, sp)]
    assert recorder == []
    after = [o.outputs[0].token_ids for o in LLM("tiny", exec_plan=fresh_path("xla"), **kw).generate(prompts, sp)]
    assert recorder and set(recorder) == {"xla"}       # fresh prefills went through it
    assert after == before


# ---- (d) prefill chunks after cached tokens: the masked dot_product_attention call --------------------

def test_chunk_after_cached_tokens_masked_call_matches_einsum(monkeypatch):
    """A chunk of new tokens after each row's cached prefix (the paged keys' layout: cached slots, then
    the chunk): the plan's chunk_attention 'xla' (cuDNN's stand-in: the same padded inputs and mask through
    jax.nn.dot_product_attention) against the einsum path, float32 (summation order only: ~1e-6), for
    ragged prefixes (none, partial pages), a padded chunk and an all-padding row; the fresh path is
    untouched (the causal call, no mask)."""
    B, T, S0, N, H, R, U = 4, 6, 20, 3, 16, 8, 16
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    f32 = jnp.float32
    q_nope = jax.random.normal(ks[0], (B, T, N, H), f32)
    q_pe = jax.random.normal(ks[1], (B, T, N, R), f32)
    k = jax.random.normal(ks[2], (B, S0 + T, N, H), f32)
    kpe = jax.random.normal(ks[3], (B, S0 + T, R), f32)
    v = jax.random.normal(ks[4], (B, S0 + T, N, U), f32)
    cached, n_new = np.array([0, 7, 20, 3]), np.array([6, 4, 2, 0])
    pos = np.where(np.arange(T)[None] < n_new[:, None], cached[:, None] + np.arange(T)[None], -1)
    old = np.broadcast_to((np.arange(S0)[None, :] < cached[:, None])[:, None, :], (B, T, S0))
    new = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)
    mask = jnp.asarray(np.concatenate([old, new], axis=-1))
    scale = (H + R) ** -0.5
    calls = []
    real = prefill_attention._masked_dot_product_attention
    monkeypatch.setattr(prefill_attention, "_masked_dot_product_attention", lambda *a: calls.append(a[-1]) or real(*a))
    run = lambda plan=None: np.asarray(jax.jit(lambda *a: ops.mla_prefill_attention(*a, scale, plan=plan))(  # noqa: E731
        q_nope, q_pe, k, kpe, v, mask))
    ref = run()
    assert calls == []                                       # automatic on CPU: einsum
    # automatic on GPU (impl 'pallas'): cuDNN where it fits (bf16), as fresh prefills; einsum otherwise
    assert ops.prefill_attention_path(H + R, U, jnp.bfloat16, causal=False, plan=PALLAS) == "cudnn_split"
    assert ops.prefill_attention_path(H + R, U, f32, causal=False, plan=PALLAS) == "einsum"
    assert ops.prefill_attention_path(H + R, U, jnp.bfloat16, causal=False, plan=XLA) == "einsum"
    assert ops.prefill_attention_path(H + R, U, f32, causal=False, plan=chunk_path("xla")) == "xla"
    out = run(chunk_path("xla"))
    assert calls == ["xla"]
    valid = (pos >= 0)[..., None, None]
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), rtol=1e-4, atol=1e-5)
    assert np.isfinite(out).all()
    # 'xla_split': the chunk against the cached keys and against itself, merged by log-sum-exp (no
    # mask); a row without cached tokens (0) takes the chunk part only, the all-padding row gives 0s
    lens = (jnp.asarray(np.maximum(pos[:, 0], 0), jnp.int32), jnp.asarray((pos >= 0).sum(1), jnp.int32))
    split_plan = chunk_path("xla_split")
    split = np.asarray(jax.jit(lambda *a: ops.mla_prefill_attention(*a[:-2], scale, chunk_lens=a[-2:],
                                                                    plan=split_plan))(
        q_nope, q_pe, k, kpe, v, mask, *lens))
    assert len(calls) == 1                                    # no masked call
    masked = run(split_plan)                                  # without chunk_lens: the masked call
    assert len(calls) == 2
    np.testing.assert_allclose(np.where(valid, masked, 0), np.where(valid, ref, 0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.where(valid, split, 0), np.where(valid, ref, 0), rtol=1e-4, atol=1e-5)
    assert np.isfinite(split).all() and not split[3].any()
    # keys of the chunk alone (no cached slots): the chunk part only, as the einsum path over them
    only = (q_nope, q_pe, k[:, S0:], kpe[:, S0:], v[:, S0:], mask[:, :, S0:])
    zero = (jnp.zeros((B,), jnp.int32), lens[1])
    alone = np.asarray(ops.mla_prefill_attention(*only, scale, chunk_lens=zero, plan=split_plan))
    alone_ref = np.asarray(ops.mla_prefill_attention(*only, scale, plan=chunk_path("einsum")))
    np.testing.assert_allclose(np.where(valid, alone, 0), np.where(valid, alone_ref, 0), rtol=1e-4, atol=1e-5)
    # the split unavailable (jax's private cuDNN entry point changed, say): the masked call instead
    def unavailable(*a, **kw):
        raise NotImplementedError("no entry point")
    monkeypatch.setattr(prefill_attention, "_attention_lse_xla", unavailable)
    fallback = np.asarray(ops.mla_prefill_attention(q_nope, q_pe, k, kpe, v, mask, scale, chunk_lens=lens,
                                                    plan=split_plan))
    assert len(calls) == 3
    np.testing.assert_allclose(np.where(valid, fallback, 0), np.where(valid, ref, 0), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_attention"):
        chunk_path("flash")


@pytest.mark.slow
def test_engine_chunked_prefill_through_the_masked_call(monkeypatch):
    """Generation whose prompts are prefilled in several chunks (prefill_chunk 8: every chunk after a
    prompt's first follows cached tokens) gives the same greedy tokens with those chunks' attention
    through the masked dot_product_attention call as through the einsum path (float32 tiny model: the
    two differ in summation order only)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (21, 9, 30)]
    sp = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 3
    kw = dict(dtype="float32", max_num_seqs=4, block_size=16, num_gpu_blocks_override=16, prefill_chunk=8,
              max_prefill_tokens=24)
    calls = []
    real = prefill_attention._masked_dot_product_attention
    monkeypatch.setattr(prefill_attention, "_masked_dot_product_attention", lambda *a: calls.append(a[-1]) or real(*a))
    parts = []
    real_p = prefill_attention._attention_lse_xla
    monkeypatch.setattr(prefill_attention, "_attention_lse_xla",
                        lambda *a, **kw: parts.append(kw["causal"]) or real_p(*a, **kw))
    outs = []
    for choice in ("einsum", "xla", "xla_split"):
        llm = LLM("tiny", exec_plan=chunk_path(choice), **kw)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    assert calls and set(calls) == {"xla"}
    assert parts and set(parts) == {False, True}           # the split path ran (both halves)
    assert outs[0] == outs[1] == outs[2] and all(len(t) == 4 for t in outs[0])
