"""The planner: the published RTX PRO 6000 anchor, hand-computed cases, and per-device bytes that agree
with kimi_jax.parallel.sharding on the full Kimi-K2.5 geometry."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.tools import hardware
from kimi_jax.tools import planner
from kimi_jax.config import ModelConfig, QuantConfig, preset
from kimi_jax.tools.hardware import CollectiveModel, Hardware
from kimi_jax.model.transformer import abstract_model
from kimi_jax.parallel.sharding import Layout, per_device_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- acceptance: the published profile of the deployment kimi_jax replaces --------------------------
def anchor_plan(**opts):
    a = planner.ANCHOR_RTX6KPRO
    return planner.plan(preset("kimi-k2.5"), hardware.preset("rtx-pro-6000"), Layout(8), a["batch"], a["context"],
                        planner.PlanOptions(engine=a["engine"], **opts), model_name="kimi-k2.5")


def test_anchor_allreduces_and_9_9_ms():
    """Kimi-K2.5 INT4, 8 x RTX PRO 6000 (96 GB, ~1.8 TB/s, PCIe Gen5), TP8, 78 us per all-reduce.

    The published profile is of a vLLM deployment, so the anchor plans vLLM's TP decode step
    (engine='vllm'), every collective justified by a source in planner.VLLM_TP_SOURCES: 1 embedding +
    61 o_proj + 1 dense down_proj + 60 MoE all-reduces = 123, and 1 logits all-gather. The profile
    counted 127 all-reduces; the 4 beyond 123 are not accounted for by the sources (acceptance asked
    for 127 +- 2: NOT met; this test pins what the sources justify). The all-reduce time is within
    the acceptance's 10% of 9.9 ms."""
    assert planner.ANCHOR_RTX6KPRO["engine"] == "vllm"
    p = anchor_plan(allreduce_us=78.0)
    counts = planner.collective_counts(p.collectives)
    assert counts == {"all-reduce": 1 + 61 + 1 + 60, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                      "collective-permute": 0}
    assert p.count() == 124
    assert 127 - p.count("all-reduce") == 4          # unexplained by the sources (see the report)
    for c in p.collectives:                          # every row cites vLLM's code
        assert "[vLLM: vllm/" in c.why or "[vLLM: deepseek_v2.py" in c.why, c.why
    ar_ms = 1e3 * p.collective_s_of("all-reduce")
    assert ar_ms == pytest.approx(123 * 0.078)
    assert abs(ar_ms - 9.9) <= 0.99                  # published 9.88 ms NCCL (+1.16 ms custom)
    assert abs(ar_ms - 9.88) / 9.88 < 0.10
    assert p.fits and p.weight_bytes / 2**30 == pytest.approx(71.26, abs=0.01)
    report = planner.anchor_report(p)
    print("\n" + report)
    for x in ("127", "123", "124", "9.88", "21.7", "82", "Unexplained", f"{1e3 * p.step_s:.2f}",
              f"{p.tokens_per_s:.1f}"):
        assert x in report
    # the preset's own all-reduce model (78 us + bytes over PCIe) stays within the same 10%
    q = anchor_plan()
    assert q.count("all-reduce") == 123
    assert abs(1e3 * q.collective_s_of("all-reduce") - 9.9) <= 0.99


def test_vllm_and_kimi_jax_collectives_under_tp8():
    cfg = preset("kimi-k2.5")
    vllm = planner.collective_counts(planner.collective_plan(cfg, Layout(8), 1, engine="vllm"))
    ours = planner.collective_counts(planner.collective_plan(cfg, Layout(8), 1))
    # kimi_jax's step now has the same collectives as vLLM's under TP8: 2 per layer + embedding, 1 gather
    assert ours == vllm == {"all-reduce": 123, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                            "collective-permute": 0}
    # but kimi_jax gathers f32 logits and vLLM bf16
    lg = {e: [c for c in planner.collective_plan(cfg, Layout(8), 1, engine=e) if c.kind == "all-gather"][0]
          for e in ("vllm", "kimi_jax")}
    assert lg["kimi_jax"].bytes == 2 * lg["vllm"].bytes == 163840 * 4
    with pytest.raises(ValueError, match="tensor-parallel"):
        planner.collective_plan(cfg, Layout(1, 8, True), 8, engine="vllm")


def test_anchor_step_is_between_production_and_profiled():
    p = anchor_plan(allreduce_us=78.0)
    assert 1e3 / 82 < 1e3 * p.step_s < 21.7          # 12.2 ms production < planned < 21.7 ms profiled


def test_kimi_plan_cli_anchor():
    out = subprocess.run([sys.executable, "-m", "launch.plan", "--anchor"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "all-reduces per token                          123         127" in out.stdout


# ---- hand-computed cases ----------------------------------------------------------------------------
def small(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=2,
                v_head_dim=4, norm_topk_prob=True, routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=1e4)
    base.update(kw)
    return ModelConfig(**base)


# round numbers: 1 byte per ns, every kernel at 100%, free compute, 10 us per collective
TOY = Hardware(name="toy", hbm_bytes=1e6, hbm_bw=1e9, bf16_flops=1e21, interconnect="toy", link_bw=1e21,
               collectives={"all-reduce": CollectiveModel(10e-6, 1e21)}, gemv_efficiency=1.0, int4_efficiency=1.0,
               attention_efficiency=1.0)


def test_one_dense_layer_by_hand():
    cfg = small()
    p = planner.plan(cfg, TOY, Layout(2), batch=1, context=8,
                     options=planner.PlanOptions(runtime_reserve_bytes=0, engine_artifacts=False))
    # attention, bf16, TP2: q_proj 12x16/2, kv_a 10x16, kv_a_norm 8, kv_b 16x8/2, o_proj 16x8/2
    attn = (6 * 16 + 10 * 16 + 8 + 8 * 8 + 16 * 4) * 2
    assert attn == 784
    norms = (2 * 16 + 16) * 2
    dense = 3 * 16 * 16 * 2                         # gate/up/down, width 32 split in two
    vocab = 32 * 16 * 2                             # embedding and lm_head, vocab split in two
    assert p.weights == {"attention": attn, "norms": norms, "dense_ffn": dense, "router": 0, "shared_experts": 0,
                         "routed_experts": 0, "embedding": vocab, "lm_head": vocab}
    assert p.weight_bytes == 4464
    assert p.cache_len == 8 and p.cache_bytes == 1 * 1 * 8 * 10 * 2       # L x B x S x (A+R) x bf16
    # collectives: embedding, attention, dense FFN all-reduces + one all-gather of the vocab-split logits
    assert planner.collective_counts(p.collectives) == {"all-reduce": 3, "all-gather": 1, "reduce-scatter": 0,
                                                        "all-to-all": 0, "collective-permute": 0}
    # bytes: [1, 16] bf16 partial sums, the [1, 64] f32 logits gathered
    assert sorted((c.kind, c.bytes) for c in p.collectives) == [("all-gather", 64 * 4)] + [("all-reduce", 32)] * 3
    # time: weights read once (embedding: one row of 16 bf16), the cache once (a GPU plan with the Pallas
    # decode kernels; twice on the XLA path's two einsums), 4 collectives x 10 us
    read = attn + norms + dense + vocab + 16 * 2
    assert p.compute_memory_s == pytest.approx((read + 160) * 1e-9, rel=1e-6)
    assert p.collective_s == pytest.approx(4 * 10e-6, rel=1e-6)
    assert p.step_s == pytest.approx(40e-6 + 3.632e-6, rel=1e-6)
    assert p.tokens_per_s == pytest.approx(1 / 43.632e-6, rel=1e-6)
    x = planner.plan(cfg, TOY, Layout(2), batch=1, context=8,
                     options=planner.PlanOptions(runtime_reserve_bytes=0, engine_artifacts=False, impl="xla"))
    assert x.compute_memory_s == pytest.approx((read + 2 * 160) * 1e-9, rel=1e-6)
    # no engine artifacts left in a one-layer TP step (no sampler loop, no layer loop)
    q = planner.plan(cfg, TOY, Layout(2), batch=1, context=8, options=planner.PlanOptions(runtime_reserve_bytes=0))
    assert q.step_s == pytest.approx(p.step_s, rel=1e-12)
    # float32 mode: the partial sums go over the wire in f32
    f = planner.collective_plan(cfg, Layout(2), 1, dtype_bytes=4)
    assert [c.bytes for c in f if c.kind == "all-reduce"] == [64] * 3


def test_moe_layer_tp_vs_ep_by_hand():
    cfg = small(first_k_dense_replace=0)             # one MoE layer: E=4, top-2, F=8, one shared expert
    design = planner.PlanOptions(engine_artifacts=False)
    tp = planner.plan(cfg, TOY, Layout(2), batch=1, context=8, options=design)
    ep = planner.plan(cfg, TOY, Layout(2, 1, True), batch=1, context=8, options=design)
    dp = planner.plan(cfg, TOY, Layout(1, 2, True), batch=2, context=8, options=design)
    router = (4 * 16 + 4) * 4                        # float32 weight and bias, replicated
    slice_ = (2 * 4 * 16 + 16 * 4) * 2               # one expert's half: gate/up 4x16, down 16x4, bf16
    whole = (2 * 8 * 16 + 16 * 8) * 2
    assert tp.weights["router"] == ep.weights["router"] == dp.weights["router"] == router
    assert tp.weights["routed_experts"] == 4 * slice_ == 1536          # every expert, half of each
    assert ep.weights["routed_experts"] == 2 * whole == 1536           # half the experts, whole
    assert tp.weights["shared_experts"] == 3 * 4 * 16 * 2 and dp.weights["shared_experts"] == 3 * 8 * 16 * 2
    assert tp.weight_bytes == ep.weight_bytes == 784 + 96 + router + 384 + 1536 + 2048 == 5120
    assert dp.weight_bytes == 1232 + 96 + router + 768 + 1536 + 4096 == 8000
    # collectives: TP and TP+EP all-reduce the MoE output once (shared + routed in one op); DP+EP dispatches
    counts = {n: planner.collective_counts(p.collectives) for n, p in (("tp", tp), ("ep", ep), ("dp", dp))}
    assert counts["tp"] == counts["ep"] == {"all-reduce": 3, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                                            "collective-permute": 0}
    moe = [c for c in tp.collectives if c.why.startswith("MoE")]
    assert [(c.count, c.bytes) for c in moe] == [(1, 2 * 16 * 2)]          # [1, 16] bf16, twice
    # DP2+EP: the logits' rows (1) and the dispatch of tokens/ids/weights (1); one reduce-scatter of the outputs
    assert counts["dp"] == {"all-reduce": 0, "all-gather": 2, "reduce-scatter": 1, "all-to-all": 0,
                            "collective-permute": 0}
    # the current engine on GPU adds nothing here (one MoE layer: no layer loop, no rematerialized dispatch)
    cur = planner.plan(cfg, TOY, Layout(2), batch=1, context=8)
    assert cur.count("all-reduce") == 3 and not any(c.artifact for c in cur.collectives)
    # on CPU (what tests/test_profiler.py compiles): 3 dispatch ops, cache-write and router top-k gathers
    cpu = planner.collective_plan(cfg, Layout(1, 2, True), 2, program="cpu")
    assert planner.collective_counts(cpu)["all-gather"] == 1 + 3 + (1 + 2) + 1
    # expert bytes read at batch 1: one token touches k=2 experts
    mem = {t.name.split(" (")[0]: t for t in tp.terms}
    assert mem["routed experts"].bytes == pytest.approx(2 * slice_)     # 2 touched slices on every TP device
    mem_ep = {t.name.split(" (")[0]: t for t in ep.terms}
    # EP: 2 local experts, each touched with p = 1/2 (mean 1, std sqrt(0.5)); the busier of two devices is one
    # expected maximum of two standard normals (1 / sqrt(pi)) above the mean. rel 1e-5: the planner tables
    # that maximum to 4 decimals
    assert math.isclose(mem_ep["routed experts"].bytes, (1 + math.sqrt(0.5) / math.sqrt(math.pi)) * whole,
                        rel_tol=1e-5)


def test_int4_expert_bytes_by_hand():
    cfg = small(first_k_dense_replace=0, moe_intermediate_size=32, quantization=QuantConfig(group_size=8))
    # gate/up [F=32, D=16]: 16/8 int32 words + 16/8 bf16 scales per row; down [16, 32]: 4 words + 4 scales per row
    assert planner.expert_bytes_local(cfg, Layout(1, 2, True)) == 2 * 32 * (2 * 4 + 2 * 2) + 16 * (4 * 4 + 4 * 2)
    assert planner.expert_bytes_local(cfg, Layout(2)) == 2 * 16 * (2 * 4 + 2 * 2) + 16 * (2 * 4 + 2 * 2)


def test_expected_touched_experts():
    assert planner.expected_touched(384, 8, 384, 1) == pytest.approx(8)
    assert planner.expected_touched(48, 8, 384, 1) == pytest.approx(1)
    assert planner.expected_touched(384, 8, 384, 10_000) == pytest.approx(384)
    assert planner.busiest_device_touched(48, 8, 384, 10_000, 8) == 48


def test_busiest_device_is_the_expected_maximum_of_normals():
    """busiest_device_touched is mean + z(n) x std with z(n) = E[max of n standard normals] =
    integral of x n phi(x) Phi(x)^(n-1) dx, here by the trapezoid rule on [-10, 10] in steps of 0.01 (error
    below 1e-8 for this smooth, fast-decaying integrand). abs 6e-5: the planner tables z to 4 decimals (5e-5)."""
    x = np.linspace(-10.0, 10.0, 2001)
    cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    local, k, E, tokens = 1000, 8, 384, 1            # mean 20.8, std 4.5: far from the cap at `local`
    p = 1.0 - (1.0 - k / E) ** tokens
    mean, std = local * p, math.sqrt(local * p * (1.0 - p))
    for n in (1, 2, 4, 8, 16, 32, 64):
        z = np.trapezoid(x * n * pdf * cdf ** (n - 1), x)
        got = planner.busiest_device_touched(local, k, E, tokens, n)
        assert (got - mean) / std == pytest.approx(z, abs=6e-5), n


# ---- the rules against compiled programs on the GPU ----------------------------------------------------
# Counted from the compiled decode step (launch/bench/engine.py, contiguous-cache reference step) on
# 2 x H200, jax 0.11.2, 2026-11-29 (BENCHMARKS.md, "ModelSteps decode step"): a Kimi-K2.5 slice of 3
# layers (1 dense + 2 MoE, 384 experts), batch 2 and 64 gave the same counts.
H200_RECORDED_3L = {
    Layout(2): {"all-reduce": 7, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0},
    Layout(2, 1, True): {"all-reduce": 7, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0,
                         "collective-permute": 0},
    Layout(1, 2, True): {"all-reduce": 0, "all-gather": 3, "reduce-scatter": 2, "all-to-all": 0,
                         "collective-permute": 0},
}


@pytest.mark.parametrize("batch", [2, 64])
@pytest.mark.parametrize("layout", list(H200_RECORDED_3L), ids=lambda l: l.name)
def test_rules_match_the_kimi_k25_step_compiled_on_h200(layout, batch):
    cfg = preset("kimi-k2.5").replace(num_hidden_layers=3)
    specs = planner.collective_plan(cfg, layout, batch, program="gpu")
    assert planner.collective_counts(specs) == H200_RECORDED_3L[layout]
    full = planner.collective_counts(planner.collective_plan(preset("kimi-k2.5"), layout, 8, program="gpu"))
    if layout.data_parallel_size == 1:    # the full model: embedding + 61 o_proj + 1 dense + 60 MoE
        assert full["all-reduce"] == 1 + 61 + 1 + 60 and full["all-gather"] == 1
    else:                                 # per MoE layer one dispatch gather and one combine; the logits
        assert (full["all-gather"], full["reduce-scatter"]) == (60 + 1, 60)


# ---- per-device bytes agree with kimi_jax.parallel.sharding ------------------------------------------------------
KIMI_LAYOUTS = [Layout(1), Layout(8), Layout(8, 1, True), Layout(1, 8, True), Layout(4, 2, True), Layout(2, 4),
                Layout(2, 4, True)]


@pytest.mark.slow
def test_param_bytes_match_sharding_for_kimi_k25():
    cfg = preset("kimi-k2.5")
    abstract = nnx.split(abstract_model(cfg, jnp.bfloat16))[1]
    for layout in KIMI_LAYOUTS:
        assert sum(planner.param_bytes(cfg, layout).values()) == per_device_bytes(layout, abstract), layout.name


@pytest.mark.parametrize("variant", ["tiny", "bf16_no_qlora", "odd_tp"])
def test_param_bytes_match_sharding_small(variant):
    cfg = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1)
    layouts = KIMI_LAYOUTS
    if variant == "bf16_no_qlora":
        cfg = cfg.replace(q_lora_rank=None, quantization=None, n_shared_experts=2)
    elif variant == "odd_tp":
        cfg = cfg.replace(quantization=QuantConfig(group_size=8))
        layouts = [Layout(3), Layout(1, 3, True), Layout(2, 2, True)]
    assert planner.param_bytes_from_model(cfg, Layout(1)) == sum(planner.param_bytes(cfg, Layout(1)).values())
    abstract = nnx.split(abstract_model(cfg, jnp.bfloat16))[1]
    for layout in layouts:
        assert sum(planner.param_bytes(cfg, layout).values()) == per_device_bytes(layout, abstract), layout.name


# ---- ranking, memory limits, hardware ---------------------------------------------------------------------
def test_rank_layouts_kimi_on_h200():
    cfg, hw = preset("kimi-k2.5"), hardware.preset("h200")
    fits, rejected = planner.rank_layouts(cfg, hw, 8, batch=1, context=8192,
                                          options=planner.PlanOptions(engine_artifacts=False))
    names = [p.layout for p in fits]
    assert names[0] == "TP8"                                            # fewest bytes per device at batch 1
    # the current engine (sampling on gathered logits: no sampler loop under TP any more) ranks TP8 first too;
    now, _ = planner.rank_layouts(cfg, hw, 8, batch=1, context=8192)
    assert now[0].layout == "TP8"
    assert not any("sampler" in t.name for p in now for t in p.terms)
    # the all-reduce curve of 2 devices serves the groups of 8 as-is, and the plan says so
    ar = hw.collectives["all-reduce"]
    assert any(f"measured on {ar.curve_devices} devices, used as-is for groups of [8]" in n for n in now[0].notes)
    # engine='vllm' plans tensor-parallel layouts only
    v, v_rejected = planner.rank_layouts(cfg, hw, 8, batch=1, context=8192, options=planner.PlanOptions(engine="vllm"))
    assert {p.layout for p in v} == {"TP8", "TP8+EP"} and "DP8+EP" in {n for n, _ in v_rejected}
    assert [p.tokens_per_s for p in fits] == sorted((p.tokens_per_s for p in fits), reverse=True)
    assert all(p.fits for p in fits)
    assert {"DP8", "DP4xTP2", "DP2xTP4"} <= {n for n, _ in rejected}    # replicated experts do not fit
    table = planner.ranking_table(fits, rejected)
    assert "TP8" in table and "does not run" in table


def test_largest_batch_and_context_fit():
    cfg, hw = preset("kimi-k2.5"), hardware.preset("h200")
    p = planner.plan(cfg, hw, Layout(8), batch=4, context=4096)
    assert p.fits
    big = planner.plan(cfg, hw, Layout(8), batch=4, context=p.max_context_for_batch)
    assert big.fits
    assert not planner.plan(cfg, hw, Layout(8), batch=4, context=2 * p.max_context_for_batch).fits
    assert planner.plan(cfg, hw, Layout(8), batch=p.max_batch_for_context, context=4096).fits
    assert not planner.plan(cfg, hw, Layout(8), batch=2 * p.max_batch_for_context, context=4096).fits


def test_collective_model_and_calibration(tmp_path):
    m = CollectiveModel(20e-6, 100e9)
    assert m.time("all-reduce", 1e6, 8) == pytest.approx(20e-6 + 2 * 7 / 8 * 1e6 / 100e9)
    assert m.time("all-gather", 1e6, 8) == pytest.approx(20e-6 + 7 / 8 * 1e6 / 100e9)
    assert m.time("all-reduce", 1e6, 1) == 0.0
    curve = [(1e4, 20e-6), (1e6, 40e-6)]
    d = hardware.calibration_dict("my H200", copy_bw=4.1e12, matmul_flops=700e12, n_devices=2,
                                  collectives={"all-reduce": curve}, int4_efficiency=0.6)
    path = hardware.write_calibration(str(tmp_path / "cal.json"), d)
    hw = hardware.get(path)
    assert json.load(open(path))["copy_bw"] == 4.1e12
    # what the file gives replaces the base preset's; what it does not give is the base preset's
    assert (hw.hbm_bw, hw.bf16_flops, hw.int4_efficiency) == (4.1e12, 700e12, 0.6)
    assert hw.hbm_bytes == hardware.preset(d["base"]).hbm_bytes
    assert hw.collective_time("all-reduce", 1e5, 2) == pytest.approx(math.sqrt(20e-6 * 40e-6))   # log-log midpoint
    assert hw.collective_time("all-reduce", 1e3, 2) == pytest.approx(20e-6)                      # flat below
    assert hw.collective_time("all-reduce", 1e8, 2) == pytest.approx(40e-6 * 100 ** (math.log(2) / math.log(100)))
    assert "measured" in hw.sources["hbm_bw"] and "measured" in hw.sources["all-reduce"]
    with pytest.raises(ValueError, match="unknown fields"):
        hardware.calibration_dict("x", copy_bw=1.0, colour="red")


def test_host_enqueue_term_and_its_calibration(tmp_path):
    """The host's enqueue per step = layers x (kernels a layer x seconds a kernel + weight arrays a layer x
    seconds an argument) (H200: 31 kernels at 0.28 us with fixed buffers, 9 arrays at 1.4 us, measured at 61
    layers); under
    overlap scheduling the step is the longer of the device's and the host's."""
    hw = hardware.preset("h200")
    p = planner.plan(preset("kimi-k2.5"), hw, Layout(8), 1, 4096, model_name="kimi-k2.5")
    assert p.kernels == 61 * 31 and p.host_s == pytest.approx(61 * (31 * 0.28e-6 + 9 * 1.4e-6))
    assert p.served_step_s == max(p.step_s, p.host_s) and p.to_json()["served_step_ms"] == 1e3 * p.served_step_s
    assert "host enqueue 1891 kernels" in p.table()
    d = hardware.calibration_dict("fused", copy_bw=4.2e12, kernels_per_layer=11.0, host_launch_s=2e-6,
                                  arguments_per_layer=3.0, host_argument_s=1e-6)
    fused = hardware.get(hardware.write_calibration(str(tmp_path / "cal.json"), d))
    q = planner.plan(preset("kimi-k2.5"), fused, Layout(8), 1, 4096, model_name="kimi-k2.5")
    assert q.host_s == pytest.approx(61 * (11 * 2e-6 + 3 * 1e-6)) and "measured" in fused.sources["host_launch_s"]
    assert "measured" in fused.sources["host_argument_s"]
    slow = dataclasses.replace(hw, host_launch_s=1e-3)       # a host far slower than the device sets the step
    r = planner.plan(preset("kimi-k2.5"), slow, Layout(8), 1, 4096, model_name="kimi-k2.5")
    assert r.served_step_s == r.host_s > r.step_s


def test_presets_say_where_numbers_come_from():
    for name in ("h200", "h100", "b200", "rtx-pro-6000"):
        hw = hardware.preset(name)
        for field in ("hbm_bytes", "hbm_bw", "bf16_flops", "all-reduce"):
            assert any(w in hw.sources[field] for w in ("datasheet", "measured", "assumed")), (name, field)
    # the measured all-reduce times the H200 preset cites are its curve's
    h200 = hardware.preset("h200")
    for _, seconds in h200.collectives["all-reduce"].curve:
        assert f"{1e6 * seconds:.1f} " in h200.sources["all-reduce"]
    with pytest.raises(ValueError, match="unknown hardware preset"):
        hardware.preset("tpu-v9")


# Exact up to float rounding (exp / log round trips: ~1e-15 relative); another interpolation (linear in x, the
# nearest point, a clamp in place of the slope) is off by more than 1e-3 relative on every curve checked here.
def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_log_interp(fn, points, beyond=None):
    """fn(x) against a curve of (x, y) points read from a preset or calibration: the points themselves,
    linear in log(x) between neighbours (at the geometric midpoint: the mean of the two), the first point's
    value below it, the last point's value beyond it (or `beyond(x)` where given)."""
    pts = sorted(points)
    assert len(pts) >= 2 and len({y for _, y in pts}) > 1          # a curve, not a constant
    for x, y in pts:
        assert same(fn(x), y), (x, fn(x), y)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        assert same(fn(math.sqrt(x0 * x1)), (y0 + y1) / 2), (x0, x1)
    x = pts[0][0] / 2
    assert same(fn(x), pts[0][1]), x
    x = 2 * pts[-1][0]
    assert same(fn(x), pts[-1][1] if beyond is None else beyond(x)), x


def check_loglog(fn, curve):
    """fn(bytes) against a measured (bytes, seconds) collective curve: the points, log-log linear between
    neighbours (at the geometric midpoint: the geometric mean), the first point's time below it, the last
    segment's log-log slope beyond the last."""
    pts = sorted(curve)
    assert len(pts) >= 2
    for b, s in pts:
        assert same(fn(b), s), b
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        assert same(fn(math.sqrt(b0 * b1)), math.sqrt(s0 * s1)), (b0, b1)
    for b in (0.0, 1.0, pts[0][0] / 2):
        assert same(fn(b), pts[0][1]), b
    (bp, sp), (bl, sl) = pts[-2], pts[-1]
    slope = math.log(sl / sp) / math.log(bl / bp)
    for k in (2.0, 100.0):
        assert same(fn(k * bl), sl * k ** slope), k


def test_h200_allreduce_follows_its_measured_curve():
    """The H200 all-reduce is its measured curve (log-log between the points, flat below, the last slope
    beyond), at the group size it was measured at and, as-is, at others; the other kinds keep the
    latency + wire bytes / bus bandwidth formula; one device moves nothing. A kind without a model of its
    own takes the all-reduce's latency and bus bandwidth in its own formula, not the all-reduce's curve."""
    hw = hardware.preset("h200")
    ar = hw.collectives["all-reduce"]
    for n in (ar.curve_devices, 8):
        check_loglog(lambda b: hw.collective_time("all-reduce", b, n), ar.curve)
    assert hw.collective_time("all-reduce", 1e6, 1) == 0.0
    ag = hw.collectives["all-gather"]
    assert not ag.curve
    assert same(hw.collective_time("all-gather", 1e6, 8), ag.latency_s + 7 / 8 * 1e6 / ag.bus_bw)
    only = TOY.replace(collectives={"all-reduce": ar})
    assert same(only.collective_time("all-gather", 1e6, 8), ar.latency_s + 7 / 8 * 1e6 / ar.bus_bw)
    assert only.collective_time("all-reduce", 1e6, 8) == hw.collective_time("all-reduce", 1e6, 8)


# Device time per paged decode step (the serving step, ModelSteps.step_jit) on H200s (jax 0.11.2,
# BENCHMARKS.md "ModelSteps decode step (the paged serving step) on a Kimi-K2.5 slice, one and two H200s"):
# a Kimi-K2.5 slice of 3 layers (1 dense + 2 MoE, 384 experts), context 1024, distinct tokens per row;
# one GPU 2026-11-29, two GPUs 2026-11-30. (layout, batch, device ms)
H200_MEASURED = [(Layout(1), 1, 1.28), (Layout(1), 16, 2.63), (Layout(1), 64, 5.10),
                 (Layout(2), 2, 0.92), (Layout(2), 64, 3.20), (Layout(2, 1, True), 2, 0.94),
                 (Layout(2, 1, True), 64, 3.12), (Layout(1, 2, True), 2, 1.41), (Layout(1, 2, True), 64, 3.45)]


@pytest.mark.parametrize("layout,batch,device_ms", H200_MEASURED, ids=lambda v: getattr(v, "name", str(v)))
def test_h200_measured_step_within_17_percent(layout, batch, device_ms):
    """17%: the worst rows are the two-GPU batch-2 ones, +15.7% (TP2+EP) and +13.7% (TP2), since the
    preset's per-layer small-kernel term (29 us, fit at full depth on one GPU, next test) adds 87 us to
    these 3-layer steps; without it they were +6.4% / +4.2%; the mean is 7.3%."""
    cfg = preset("kimi-k2.5").replace(num_hidden_layers=3)
    p = planner.plan(cfg, hardware.preset("h200"), layout, batch=batch, context=1024)
    assert abs(1e3 * p.step_s - device_ms) / device_ms < 0.17


# The device-bound decode step (`kimi-bench full_depth` `chain`: steps dispatched back to back) of
# kimi-k2.5-61x16 (16 INT4 experts, top-8) at batch 1 x 4K context, one H200, jax 0.11.2, 2026-12-02
# (BENCHMARKS.md "Full depth on one H200"): (layers, ms); the 61-layer step twice (two runs).
H200_FULL_DEPTH_B1 = [(4, 1.555), (61, 13.23), (61, 13.46)]


@pytest.mark.parametrize("layers,ms", H200_FULL_DEPTH_B1)
def test_h200_full_depth_batch_1_within_3_percent(layers, ms):
    """3%: the per-layer term was fit to these rows (residuals -1.2%, 0.0% / +1.8%); without it the
    61-layer plan was 13-15% short of the measurement and the 4-layer one 6% short."""
    p = planner.plan(preset("kimi-k2.5-61x16").replace(num_hidden_layers=layers), hardware.preset("h200"),
                     Layout(1), batch=1, context=4096)
    assert abs(1e3 * p.step_s - ms) / ms < 0.03
    small = next(t for t in p.terms if t.name == "small kernels (per layer)")
    assert small.seconds == pytest.approx(layers * hardware.preset("h200").layer_overhead_s)
    assert "small kernels" in p.table()


# The steps planned without the per-layer term when it was fit (kimi_jax/tools/hardware.py): (layers, ms)
H200_FULL_DEPTH_PLANNED_WITHOUT_OVERHEAD = [(4, 1.458), (61, 11.457)]


def test_h200_layer_overhead_is_the_fit_of_the_full_depth_steps():
    """The H200 preset's per-layer small-kernel time is the least-squares fit (relative error) of the
    plan without it to the measured steps, one point per depth (the two 61-layer runs averaged):
    x = sum(L (m - p) / m^2) / sum(L^2 / m^2). 0.5 us: the preset rounds the fit to whole microseconds.
    The planner without the term still gives the plans the fit used, within 1% (beyond that the fit would
    move by more than a microsecond per layer: refit)."""
    hw = hardware.preset("h200")
    runs = {}
    for layers, ms in H200_FULL_DEPTH_B1:
        runs.setdefault(layers, []).append(1e-3 * ms)
    num = den = 0.0
    for layers, planned_ms in H200_FULL_DEPTH_PLANNED_WITHOUT_OVERHEAD:
        m = sum(runs[layers]) / len(runs[layers])
        num += layers * (m - 1e-3 * planned_ms) / m ** 2
        den += layers ** 2 / m ** 2
        p = planner.plan(preset("kimi-k2.5-61x16").replace(num_hidden_layers=layers),
                         hw.replace(layer_overhead_s=0.0), Layout(1), batch=1, context=4096)
        assert abs(1e3 * p.step_s - planned_ms) / planned_ms < 0.01, layers
    assert abs(num / den - hw.layer_overhead_s) <= 0.5e-6


# MLA decode per layer as the engine calls it, one H200: (query rows, batch, context, us). 64 rows:
# BENCHMARKS.md, 'MLA decode attention', the wall-clock grid (copy 4,031 GB/s); 8 rows: the Triton
# kernel's wall-clock timings of 2026-11-30 under its present split rule (copy 4,024 GB/s), the fit
# that BENCHMARKS.md 'The planner's calibration' cites.
H200_MLA = [(8, 1, 131072, 67.7), (8, 8, 32768, 114.7), (8, 64, 32768, 633.0), (8, 64, 131072, 2288.5),
            (8, 32, 131072, 1145.4), (8, 16, 32768, 185.1),
            (64, 1, 131072, 72.3), (64, 8, 32768, 110.0), (64, 8, 131072, 324.6), (64, 64, 32768, 628.0)]


@pytest.mark.parametrize("rows,batch,context,us", H200_MLA)
def test_h200_attention_model_matches_the_mla_benchmark(rows, batch, context, us):
    """The preset's attention terms (per-call time + the cache at the rows' efficiency) against one run's
    timings per row count at 32-128K (64 rows: 4 of the 6 the fit used; 8 rows: 6 of the 15): within
    12% (the fits' worst residuals there: 2.2% at 64 rows, 12% at 8 rows; 18% at 8 rows x 4K)."""
    hw = hardware.preset("h200")
    cache = batch * (context - 1) * 576 * 2
    model = hw.attention_call_at(rows) + cache / (hw.hbm_bw * hw.attention_efficiency_at(rows))
    assert abs(1e6 * model - us) / us < 0.12


def test_attention_efficiency_curve_and_calibration_override():
    hw = hardware.preset("h200")
    check_log_interp(hw.attention_efficiency_at, hw.attention_curve)
    check_log_interp(hw.attention_call_at, hw.attention_call_curve)
    # a calibration file's constants replace the preset's curves at every row count; its own curves replace both
    flat = hardware.Hardware.from_calibration({"base": "h200", "copy_bw": 4e12, "attention_efficiency": 0.7,
                                               "attention_call_s": 20e-6})
    for rows in (1, 8, 20, 64, 512):
        assert (flat.attention_efficiency_at(rows), flat.attention_call_at(rows)) == (0.7, 20e-6)
    calls = hardware.Hardware.from_calibration(hardware.calibration_dict(
        "x", copy_bw=4e12, attention_call_curve=[[8, 10e-6], [64, 30e-6]]))
    check_log_interp(calls.attention_call_at, [(8, 10e-6), (64, 30e-6)])
    curve = hardware.Hardware.from_calibration({"base": "h200", "copy_bw": 4e12,
                                                "attention_curve": [[8, 0.9], [64, 0.6]]})
    check_log_interp(curve.attention_efficiency_at, [(8, 0.9), (64, 0.6)])
    assert "attention_curve" in hardware.calibration_dict("x", copy_bw=4e12, attention_curve=[[8, 0.9]])
    # the planner charges the per-call time once per layer
    cfg = preset("kimi-k2.5").replace(num_hidden_layers=3)
    base = planner.plan(cfg, hw.replace(attention_call_s=0.0, attention_call_curve=()), Layout(1), batch=1,
                        context=1024)
    more = planner.plan(cfg, hw, Layout(1), batch=1, context=1024)
    assert (more.step_s - base.step_s) == pytest.approx(3 * hw.attention_call_at(64))     # 64 heads, one device


def test_int4_efficiency_curve_and_calibration_override():
    hw = hardware.preset("h200")
    check_log_interp(hw.int4_efficiency_at, hw.int4_curve)
    # a calibration file's measured constant replaces the preset's curve at every token count; its own curve
    # replaces both
    flat = hardware.Hardware.from_calibration({"base": "h200", "copy_bw": 4e12, "int4_efficiency": 0.5})
    assert all(flat.int4_efficiency_at(t) == 0.5 for t in (1, 4, 16, 1000))
    curve = hardware.Hardware.from_calibration({"base": "h200", "copy_bw": 4e12, "int4_curve": [[1, 0.3], [64, 0.9]]})
    check_log_interp(curve.int4_efficiency_at, [(1, 0.3), (64, 0.9)])


def test_int4_efficiency_under_expert_parallelism():
    """The H200 preset's EP curves (BENCHMARKS.md, 'INT4 experts under expert parallelism': device span of the
    engine's default MoE config holding 1/8, 1/4 or 1/2 of the experts) apply where they were measured
    (T <= 8, shares <= 1/2); elsewhere the no-EP model (its curve at the call's pairs per touched expert, one
    pair here, with the call's fixed time where its bytes are given); between shares, linear in log(share)."""
    hw = hardware.preset("h200")
    curves = sorted(hw.int4_ep_curves)
    shares = [sh for sh, _ in curves]
    assert len(shares) >= 2 and shares[-1] < 1.0
    # at a measured share: its points, linear in log(tokens) between them, flat below; past its last token
    # count the no-EP curve (unmeasured there: no penalty)
    for share, pts in curves:
        check_log_interp(lambda t: hw.int4_efficiency_ep(t, share), pts, beyond=lambda t: hw.int4_efficiency_at(1.0))
    tokens = sorted({t for _, pts in curves for t, _ in pts})
    t_mid, t_past = math.sqrt(tokens[0] * tokens[1]), 2 * tokens[-1]      # between measured counts, past them
    # between neighbouring measured shares: linear in log(share) (the geometric mean share: the mean of the two)
    for s0, s1 in zip(shares, shares[1:]):
        mean = (hw.int4_efficiency_ep(t_mid, s0) + hw.int4_efficiency_ep(t_mid, s1)) / 2
        assert same(hw.int4_efficiency_ep(t_mid, math.sqrt(s0 * s1)), mean), (s0, s1)
    for t in (t_mid, t_past):
        assert hw.int4_efficiency_ep(t, shares[0] / 2) == hw.int4_efficiency_ep(t, shares[0])     # flat below
        no_ep = hw.int4_efficiency_at(1.0)
        for share in ((shares[-1] + 1) / 2, 1.0):              # above the largest measured share: no penalty
            assert hw.int4_efficiency_ep(t, share) == no_ep, (t, share)
    # past the measured token counts, between measured shares too: no penalty
    assert hw.int4_efficiency_ep(t_past, math.sqrt(shares[0] * shares[1])) == hw.int4_efficiency_at(1.0)
    # ... where the no-EP model takes the call's pairs per touched expert and bytes
    assert hw.int4_efficiency_ep(t_past, 1.0, 16.0, 397e6) == hw.int4_efficiency_at(16.0, 397e6) < \
        hw.int4_efficiency_at(16.0)
    # a calibrated INT4 curve or constant drops the preset's EP curves (they belong to the preset's kernels)
    for cal in ({"int4_curve": [[1, 0.3], [64, 0.9]]}, {"int4_efficiency": 0.5}):
        c = hardware.Hardware.from_calibration({"base": "h200", "copy_bw": 4e12, **cal})
        assert all(c.int4_efficiency_ep(t_mid, share) == c.int4_efficiency_at(1.0) for share in shares), cal

    # the plan streams the routed experts at the efficiency of the device's share of them: 1/8 under TP8+EP
    # (48 of 384 whole experts), every expert's slice under TP8; one token at batch 1
    cfg = preset("kimi-k2.5")
    eff = {}
    for lay in (Layout(8, 1, True), Layout(8)):
        share = planner.experts_local(cfg, lay) / cfg.n_routed_experts if lay.enable_expert_parallel else 1.0
        p = planner.plan(cfg, hw, lay, batch=1, context=8192)
        routed = next(t for t in p.terms if t.name.startswith("routed experts"))
        eff[lay.name] = hw.int4_efficiency_ep(1, share, 1.0, routed.bytes / cfg.num_moe_layers)   # one pair each
        assert routed.mem_s == pytest.approx(routed.bytes / (hw.hbm_bw * eff[lay.name])), lay
    assert eff["TP8+EP"] < eff["TP8"]          # the two cases tell a share-blind plan apart


# The measurements the H200 preset's INT4 curves cite (BENCHMARKS.md, "INT4 experts under expert
# parallelism"): device span per MoE call, us, by the share of the experts held and the tokens per call
H200_INT4_EP_SPAN_US = {1 / 8: {1: 23.6, 2: 33.4, 3: 41.6, 4: 51.2, 8: 91.5},
                        1 / 4: {1: 29.9, 2: 44.9, 4: 66.8, 8: 136.5},
                        1 / 2: {1: 42.9, 2: 66.1, 4: 114.8, 8: 224.4}}
H200_INT4_EXPERT_BYTES = 24.84e6       # one Kimi-K2.5 INT4 expert, as the benchmark counts it
# ... and the no-EP model's: (pairs per touched expert, expert bytes of the call, kernel us per MoE layer).
# 384 experts (BENCHMARKS.md, INT4 section: T = 16 / 64 / 256 touch 110.2 / 281.4 / 382.0 experts; the
# gate/up + down spans at 16, the device spans less ~18 us of routing at 64 and 256); kimi-k2.5-61x16 in the
# 61-layer step (BENCHMARKS.md, "Full depth on one H200": the INT4 experts' 3.65 / 7.5 / 26.0 ms over 60
# MoE layers at batch 1 / 16 / 64; batch 32: 144 + 81 us, "One GPU's share"); one TP8 shard's slices in its
# 61-layer step ("The decode step with one q_a / kv_a product": the two launches, 19.79 us a layer).
H200_INT4_NO_EP_US = [(1.0, 198.5e6, 3650.0 / 60), (1.0, 25.0e6, 19.79), (128 / 110.2, 2736.4e6, 440.6 + 229.1),
                      (512 / 281.4, 6991.1e6, 1786.6 - 18), (2048 / 382.0, 9546.0e6, 2623.1 - 18),
                      (8.0, 16 * H200_INT4_EXPERT_BYTES, 7500.0 / 60), (16.0, 16 * H200_INT4_EXPERT_BYTES, 144 + 81),
                      (32.0, 16 * H200_INT4_EXPERT_BYTES, 26000.0 / 60)]


def test_h200_int4_curves_follow_from_their_measurements():
    """Each point of the preset's INT4 curves is touched expert bytes / device span / hbm_bw. Under EP a
    token holds 8 x share of its pairs: at T = 1 they are distinct experts, so the point is exactly that;
    at T > 1 tokens may share an expert, so held pairs x expert bytes bound it from above. Spans are given to
    0.1 us (+-0.05 us each); EP points to 3 decimals (5e-4). No EP: kernel time = int4_call_s + bytes /
    (hbm_bw x curve): the two one-pair points (whole experts, one TP8 shard's slices) fix int4_call_s and the
    first point (two equations, two unknowns); each other point is bytes / hbm_bw / (us - int4_call_s), to 3
    decimals (5e-4) plus the routing estimate's +-2 us at 64 and 256 tokens."""
    hw, cfg = hardware.preset("h200"), preset("kimi-k2.5")
    curves = {share: dict(pts) for share, pts in hw.int4_ep_curves}
    assert {s: set(c) for s, c in curves.items()} == {s: set(c) for s, c in H200_INT4_EP_SPAN_US.items()}
    for share, spans in H200_INT4_EP_SPAN_US.items():
        for t, us in spans.items():
            held = t * cfg.num_experts_per_tok * share
            bound = held * H200_INT4_EXPERT_BYTES / (1e-6 * us * hw.hbm_bw)
            slack = 5e-4 + bound * 0.05 / us
            if t == 1:
                assert abs(curves[share][t] - bound) <= slack, (share, t, bound)
            else:
                assert curves[share][t] <= bound + slack, (share, t, bound)
    (_, b0, us0), (_, b1, us1) = H200_INT4_NO_EP_US[:2]
    eff1 = (b0 - b1) / hw.hbm_bw / (1e-6 * (us0 - us1))
    call = 1e-6 * us1 - b1 / (hw.hbm_bw * eff1)
    assert abs(hw.int4_call_s - call) <= 0.05e-6 and abs(dict(hw.int4_curve)[1.0] - eff1) <= 5e-4
    assert len(hw.int4_curve) == len(H200_INT4_NO_EP_US) - 1
    for x, nbytes, us in H200_INT4_NO_EP_US[2:]:
        eff = nbytes / hw.hbm_bw / (1e-6 * us - hw.int4_call_s)
        slack = 5e-4 + eff * (2.0 if us > 1000 else 0.1) / (us - 1e6 * hw.int4_call_s)
        assert abs(dict(hw.int4_curve)[x] - eff) <= slack, (x, eff)
        # the preset's model gives the measured time back
        model = hw.int4_call_s + nbytes / (hw.hbm_bw * hw.int4_efficiency_at(x))
        assert abs(1e6 * model - us) / us < 0.01, x


def test_dp_plans_hold_only_their_rows_of_the_paged_pool():
    """The serving engine splits its paged pool's pages over dp like the rows (tests/test_dp_pages.py):
    a DP8 plan holds its own 2 of the 16 rows' cache per device, the same as the design."""
    cfg, h200, lay = preset("kimi-k2.5"), hardware.preset("h200"), Layout(1, 8, True)
    art = planner.plan(cfg, h200, lay, batch=16, context=8192)
    design = planner.plan(cfg, h200, lay, batch=16, context=8192,
                          options=planner.PlanOptions(engine_artifacts=False))
    assert art.cache_bytes == design.cache_bytes
    assert art.cache_bytes == 2 * 8192 * cfg.num_hidden_layers * cfg.latent_dim * planner.KV_BYTES
    reads = lambda p: next(t.bytes for t in p.terms if t.name == "attention (cache)")   # noqa: E731
    assert reads(art) == reads(design)
    assert art.max_context_for_batch == design.max_context_for_batch
    assert art.max_batch_for_context == design.max_batch_for_context
    assert not any("replicated over dp" in n for n in art.notes)
    assert "split over dp" in art.cache_note
    single = planner.plan(cfg.replace(num_hidden_layers=3), h200, Layout(1), batch=16, context=1024)
    assert "split over dp" in single.cache_note
