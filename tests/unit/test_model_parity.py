"""Acceptance 1 and 3 of the foundation: logits match Hugging Face transformers' DeepseekV3ForCausalLM
(torch, CPU, float32) on random tiny configs, and cached generation matches full recomputation."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_reference import hf_logits, make_hf_checkpoint  # noqa: E402
from kimi_jax import LLM, SamplingParams  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_NO_MSCALE_ALL = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

CONFIGS = {
    # group-limited routing: 4 groups of 2 experts, keep 2 groups
    "groups": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    # no query compression: q_proj straight from x
    "no_q_lora": dict(q_lora_rank=None),
    # YaRN (Kimi's mscale == mscale_all_dim), sequence longer than original_max_position_embeddings
    "yarn_long": dict(rope_scaling=YARN, rope_theta=50000.0),
    # YaRN without mscale_all_dim: HF scales cos/sin by 0.1 ln(factor) + 1 and not the softmax
    "yarn_attention_factor": dict(rope_scaling=YARN_NO_MSCALE_ALL),
    # two dense layers first, two shared experts
    "dense2_shared2": dict(num_hidden_layers=4, first_k_dense_replace=2, n_shared_experts=2),
    # weights not renormalized over the chosen experts
    "no_norm_topk": dict(norm_topk_prob=False, routed_scaling_factor=1.0),
}
SEQ = 40  # > original_max_position_embeddings (16) of the YaRN configs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    model = make_hf_checkpoint(tmp_path, seed=len(name), **CONFIGS[name])
    ids = np.random.default_rng(0).integers(2, 96, SEQ).tolist()
    ref = hf_logits(model, ids)
    llm = LLM(str(tmp_path), dtype="float32")
    got = llm.logits(ids)
    assert got.shape == ref.shape and got.dtype == np.float32
    # Both sides compute in float32; they differ only in summation order, ~1e-6 relative. 1e-4 x the
    # largest logit is the bound and still fails on any real mistake (a wrong expert, a wrong
    # rope pair or scale moves logits by >1e-2 relative).
    err = np.abs(got - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), (name, err, np.abs(ref).max())


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    make_hf_checkpoint(path, seed=7, n_group=2, topk_group=1, rope_scaling=YARN)
    return LLM(str(path), dtype="float32")


def test_cached_greedy_equals_full_recompute(tiny_llm):
    prompts = [[5, 9, 14, 20, 33], [7, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    n = 12
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for p, o in zip(prompts, outs):
        seq = list(p)
        for _ in range(n):
            seq.append(int(np.argmax(tiny_llm.logits(seq)[-1])))
        assert o.outputs[0].token_ids == seq[len(p):]
        assert o.outputs[0].finish_reason == "length"


def test_absorbed_equals_expanded(tiny_llm):
    """Same weights, same tokens: the absorbed MLA (decode form) and the expanded one (prefill form)."""
    import jax.numpy as jnp
    from flax import nnx
    from kimi_jax.model.transformer import init_cache

    steps = tiny_llm.frontend.steps
    model = nnx.merge(steps.graphdef, steps.state)
    toks = jnp.asarray(np.random.default_rng(1).integers(2, 96, (2, 17)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(17), (2, 17))
    expanded, _ = model(toks, pos, None, absorbed=False)
    absorbed, _ = model(toks, pos, None, absorbed=True)
    cache = init_cache(model.cfg, 2, 32, jnp.float32)
    via_cache, _ = model(toks, pos, cache, absorbed=True)
    scale = float(jnp.abs(expanded).max())
    # float32, reassociated contractions: ~1e-6 relative
    assert float(jnp.abs(expanded - absorbed).max()) <= 1e-5 * scale
    assert float(jnp.abs(expanded - via_cache).max()) <= 1e-5 * scale


def test_stop_token_and_max_tokens(tiny_llm):
    base = tiny_llm.generate([[5, 9, 14]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    toks = base[0].outputs[0].token_ids
    stop_at = toks[2]
    out = tiny_llm.generate([[5, 9, 14]], SamplingParams(temperature=0.0, max_tokens=6,
                                                         stop_token_ids=[stop_at], ignore_eos=True))
    o = out[0].outputs[0]
    assert o.token_ids == toks[: toks.index(stop_at) + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop_at


def test_sampling_is_seeded_and_respects_top_k(tiny_llm):
    sp = SamplingParams(temperature=1.0, top_k=3, max_tokens=8, seed=11, logprobs=3, ignore_eos=True)
    a = tiny_llm.generate([[5, 9, 14]], sp)[0].outputs[0]
    b = tiny_llm.generate([[5, 9, 14]], sp)[0].outputs[0]
    assert a.token_ids == b.token_ids
    # every sampled token is among the 3 most likely of its step (top-k); logprobs lists them
    for t, lp in zip(a.token_ids, a.logprobs):
        top3 = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert t in dict(top3)


def test_bad_requests_name_the_request(tiny_llm):
    with pytest.raises(ValueError, match="request 1: token id 96"):
        tiny_llm.generate([[5, 6], [96]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request 0: empty prompt"):
        tiny_llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="temperature must be >= 0"):      # refused when built
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="request 0: logprobs"):
        tiny_llm.generate([[5]], SamplingParams(logprobs=10**6))
    with pytest.raises(ValueError, match="request 0: a text prompt needs a tokenizer"):
        tiny_llm.generate(["hello"], SamplingParams(max_tokens=2))
