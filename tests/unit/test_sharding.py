"""Parallel layouts on 8 simulated CPU devices: every layout gives the single-device tokens and
logits; per-device parameter bytes of the full Kimi-K2.5 match hand-computed values."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.synthetic import write_checkpoint
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import QuantConfig, preset
from kimi_jax.model.transformer import abstract_model
from kimi_jax.parallel.sharding import Layout, LayoutError, check_fits, per_device_bytes

# 8 heads and 16 experts so that tp=8 splits heads and EP over 8 devices gives 2 experts each
CFG = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                             num_experts_per_tok=3)
LAYOUTS = {
    "tp8": dict(tensor_parallel_size=8),
    "tp8_ep": dict(tensor_parallel_size=8, enable_expert_parallel=True),
    "dp8_ep": dict(data_parallel_size=8, enable_expert_parallel=True),
    "dp2_tp4_ep": dict(data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True),
    "tp4": dict(tensor_parallel_size=4),
}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 40, 41, 42], [14]]
LOGIT_IDS = list(range(3, 30))


def run(path, **layout):
    llm = LLM(path, dtype="float32", **layout)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return llm.logits(LOGIT_IDS), [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["bf16", "int4"])
def reference(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    # INT4 with F = 128 so each of 4 tensor-parallel slices is one whole 32-group
    cfg = CFG if request.param == "bf16" else CFG.replace(quantization=QuantConfig(), moe_intermediate_size=128)
    write_checkpoint(path, cfg, seed=2, std=0.08)
    return path, request.param, run(path)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_device(reference, name):
    path, kind, (ref_logits, ref_tokens) = reference
    if kind == "int4" and name not in ("dp2_tp4_ep", "tp4"):
        pytest.skip("INT4 runs the two layouts that exercise both expert splits (test time)")
    logits, tokens = run(path, **LAYOUTS[name])
    assert tokens == ref_tokens
    # float32 everywhere; only the order of the partial-sum reductions differs (~1e-7 relative)
    assert np.abs(logits - ref_logits).max() <= 1e-5 * np.abs(ref_logits).max()


def test_int4_tp_slices_smaller_than_a_group_are_refused(tmp_path):
    path = str(tmp_path / "c")
    write_checkpoint(path, CFG.replace(quantization=QuantConfig(), moe_intermediate_size=128), seed=0)
    with pytest.raises(LayoutError, match="not a multiple of the INT4 group size"):
        LLM(path, tensor_parallel_size=8)


def test_indivisible_heads_are_refused():
    with pytest.raises(LayoutError, match="num_attention_heads = 4 is not divisible by 8"):
        LLM("tiny", tensor_parallel_size=8)


def test_layout_that_does_not_fit_is_refused_with_numbers():
    abstract = nnx.split(abstract_model(CFG, jnp.bfloat16))[1]
    need = per_device_bytes(Layout(8), abstract)
    with pytest.raises(LayoutError, match=r"needs .* GiB per device .* but a device has"):
        check_fits(Layout(8), abstract, capacity=need - 1)
    assert check_fits(Layout(8), abstract, capacity=need) == need


# ---- golden: full Kimi-K2.5 geometry, shapes only ---------------------------------------------------
def kimi_bytes_by_hand(tp: int, ep_ways: int) -> int:
    """Per-device parameter bytes of Kimi-K2.5 (INT4 routed experts), from the published shapes.
    tp splits heads, dense/shared FFN width and vocab; experts split by ep_ways (whole experts) or,
    when ep_ways == 1, each expert's FFN width by tp."""
    D, V, N, H, R, A, Q, U, Fd, F, E = 7168, 163840, 64, 128, 64, 512, 1536, 128, 18432, 2048, 384
    bf16 = 2
    attn_repl = (Q * D + Q + (A + R) * D + A + 2 * D) * bf16          # q_a, norms, kv_a, layer norms
    attn_split = (N * (H + R) * Q + N * (H + U) * A + D * N * U) * bf16 // tp
    dense = 3 * Fd * D * bf16 // tp
    router = E * D * 4 + E * 4                                           # float32 weight and bias
    shared = 3 * F * D * bf16 // tp
    expert = 3 * (F * D // 2 + F * D // 32 * bf16)                      # packed nibbles + bf16 scales
    experts = E * expert // (ep_ways if ep_ways > 1 else tp)
    per_layer = attn_repl + attn_split
    total = 61 * per_layer + dense + 60 * (router + shared + experts)
    return total + 2 * V * D * bf16 // tp + D * bf16                   # embed, lm_head, final norm


@pytest.mark.slow
def test_kimi_k25_per_device_bytes():
    cfg = preset("kimi-k2.5")
    abstract = nnx.split(abstract_model(cfg, jnp.bfloat16))[1]
    for layout, tp, ep in [(Layout(8), 8, 1), (Layout(8, 1, True), 8, 8), (Layout(1, 8, True), 1, 8),
                           (Layout(4, 2, True), 4, 8)]:
        assert per_device_bytes(layout, abstract) == kimi_bytes_by_hand(tp, ep), layout.name
    # the whole model: the published 554.3 GiB (file size) less the ~0.9 GiB vision tower
    assert abs(per_device_bytes(Layout(1), abstract) / 2**30 - 553.4) < 0.5
