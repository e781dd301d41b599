"""One GPU's share of Kimi-K2.5 under TP8 and TP8 + EP8 (config.shard_of and its presets), the bytes a
decode step reads (planner.step_bytes), and full_depth's rows for a shard."""
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.config import PRESETS, ConfigError, QuantConfig, preset, shard_of
from kimi_jax.model.transformer import abstract_model
from kimi_jax.parallel.sharding import MESH_AXES, Layout, _axes
from kimi_jax.tools import hardware, planner

TP8, TP8_EP8 = Layout(8), Layout(8, 1, True)

# Kimi-K2.5's structure at CPU scale: 16 heads, dense 512, experts 256 wide (INT4, group 32: 256 / 8 = 32
# is one group), 16 experts top-8 (K / 8 = 1 under EP), vocab 512, one group (EP needs n_group 1)
SMALL = preset("tiny").replace(num_attention_heads=16, intermediate_size=512, moe_intermediate_size=256,
                               n_routed_experts=16, num_experts_per_tok=8, n_group=1, topk_group=1,
                               quantization=QuantConfig(group_size=32))


def test_tp8_shard_shapes():
    c = preset("kimi-k2.5-tp8-shard")
    assert "kimi-k2.5-tp8-shard" in PRESETS
    assert (c.num_hidden_layers, c.num_attention_heads, c.moe_intermediate_size, c.intermediate_size,
            c.vocab_size) == (61, 8, 256, 2304, 20480)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.shared_expert_width) == (384, 8, 256)
    # replicated under TP: q_a, kv_a, the router and the latent cache
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.hidden_size) == (1536, 512, 64, 7168)
    # every INT4 matmul's K (gate/up: D, down: F / 8) is a whole number of groups of 32
    assert c.quantization.group_size == 32 and c.hidden_size % 32 == 0 and c.moe_intermediate_size % 32 == 0
    assert c.shared_expert_intermediate_size is None      # 256 = F x 1: the DeepSeek-V3 fields say it
    assert c.to_hf_dict()["moe_intermediate_size"] == 256


def test_tp8_ep8_shard_shapes():
    c = preset("kimi-k2.5-tp8-ep8-shard")
    assert "kimi-k2.5-tp8-ep8-shard" in PRESETS
    assert (c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size) == (61, 8, 2304, 20480)
    # whole experts, 384 / 8 of them; top-1: 8 / 384 = 1 / 48, each local expert's chance per token
    assert (c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok) == (2048, 48, 1)
    assert c.shared_expert_width == 256 and c.shared_expert_intermediate_size == 256
    assert c.num_experts_per_tok / c.n_routed_experts == 8 / 384
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        c.to_hf_dict()


def test_shard_of_refuses_what_does_not_split():
    with pytest.raises(ConfigError, match="num_attention_heads = 4 is not divisible by tensor_parallel_size 8"):
        shard_of(preset("tiny"), 8)
    with pytest.raises(ConfigError, match="INT4 group size 32"):       # 256 / 16 = 16 columns
        shard_of(SMALL.replace(num_attention_heads=16), 16)
    with pytest.raises(ConfigError, match="n_group = 8"):
        shard_of(preset("deepseek-v3"), 8, expert_parallel=True)
    with pytest.raises(ConfigError, match="num_experts_per_tok = 2"):
        shard_of(SMALL.replace(num_experts_per_tok=2), 8, expert_parallel=True)
    with pytest.raises(ConfigError, match="'n_shared_experts' must be an integer >= 1"):
        SMALL.replace(n_shared_experts=0, shared_expert_intermediate_size=32)


def _local_shapes(cfg, layout):
    """{parameter path: the shape one device holds} under `layout`, from the model's abstract state and
    the sharding RULES (as sharding.per_device_bytes)."""
    from flax import nnx
    sizes = dict(zip(MESH_AXES, (layout.data_parallel_size, layout.tensor_parallel_size)))
    out = {}
    for path, v in nnx.to_flat_state(nnx.split(abstract_model(cfg, jnp.bfloat16))[1]):
        local = list(v.shape)
        for d, rule in enumerate(layout.spec(getattr(v, "axes", None) or (), len(v.shape))):
            for ax in _axes(rule):
                local[d] //= sizes[ax]
        out[tuple(str(p) for p in path)] = tuple(local)
    return out


@pytest.mark.parametrize("ep", [False, True], ids=["tp8", "tp8_ep8"])
def test_shard_parameters_are_one_devices_share_of_the_whole_model(ep):
    """Every parameter of the shard's model has the shape one of 8 devices holds of the whole model
    under the layout's sharding rules; under EP only the router differs (replicated: 16 experts
    scored, the shard scores its 2)."""
    whole = _local_shapes(SMALL, TP8_EP8 if ep else TP8)
    shard = _local_shapes(shard_of(SMALL, 8, expert_parallel=ep), Layout(1))
    assert whole.keys() == shard.keys()
    differ = {p: (whole[p], shard[p]) for p in whole if whole[p] != shard[p]}
    if not ep:
        assert differ == {}
    else:
        assert differ == {("moe_layers", "mlp", "gate", "weight"): ((2, 16, 64), (2, 2, 64)),
                          ("moe_layers", "mlp", "gate", "e_score_correction_bias"): ((2, 16), (2, 2))}


def test_shard_presets_param_bytes_are_the_whole_models_per_device_bytes():
    """planner.param_bytes of a shard on one device equals the whole Kimi-K2.5's on 8 devices (the
    router: the shard's 48 of 384 experts under EP); the routed experts match the checkpoint's
    published 24.77 MB per expert (9.51 GB a layer), one eighth of it under TP."""
    full = preset("kimi-k2.5")
    for name, layout in (("kimi-k2.5-tp8-shard", TP8), ("kimi-k2.5-tp8-ep8-shard", TP8_EP8)):
        shard = planner.param_bytes(preset(name), Layout(1))
        whole = planner.param_bytes(full, layout)
        assert {k: v for k, v in shard.items() if k != "router"} == {k: v for k, v in whole.items() if k != "router"}
        assert shard["router"] * (8 if layout.enable_expert_parallel else 1) == whole["router"]
    per_expert = planner.expert_bytes_local(full, Layout(1))
    assert per_expert == pytest.approx(24.77e6, rel=2e-4)
    assert planner.expert_bytes_local(preset("kimi-k2.5-tp8-shard"), Layout(1)) * 8 == per_expert
    assert planner.expert_bytes_local(preset("kimi-k2.5-tp8-ep8-shard"), Layout(1)) == per_expert


def test_step_bytes_hand_count_tiny():
    """`tiny` (bf16 experts, 3 layers: 1 dense + 2 MoE), counted by hand: D 64, Q 48, N 4, H 16, R 8,
    A 32, U 16, dense 128, F 32, E 8, K 2, V 512; 2 bytes per weight, 4 per router value."""
    cfg = preset("tiny")
    per_layer_attn = (48 * 64 + 48 + 4 * 24 * 48) + 40 * 64 + 32 + 4 * 32 * 32 + 64 * 64   # 18512
    expert = 3 * 32 * 64 * 2                                                            # 12288 bytes
    hand = {"attention": 3 * per_layer_attn * 2 + (3 * 2 * 64 + 64) * 2,
            "dense_ffn": 3 * 128 * 64 * 2, "router": 2 * (8 * 64 + 8) * 4, "shared_experts": 2 * 3 * 32 * 64 * 2,
            "latent_cache": 64 * 3 * 40 * 2, "lm_head": 512 * 64 * 2 + 64 * 2}
    # batch 1: 2 distinct experts of 8, expected and at most
    b1 = planner.step_bytes(cfg, 1, 64)
    assert b1 == {**hand, "routed_experts": 2 * 2 * expert}
    assert planner.step_bytes(cfg, 1, 64, experts="max") == b1
    # batch 4: expected 8 x (1 - (6/8)^4) = 5.46875 experts; at most min(8, 4 x 2) = 8
    b4 = planner.step_bytes(cfg, 4, 64)
    assert b4["routed_experts"] == pytest.approx(2 * 5.46875 * expert, rel=1e-12)
    assert planner.step_bytes(cfg, 4, 64, experts="max")["routed_experts"] == 2 * 8 * expert
    assert b4["latent_cache"] == 4 * hand["latent_cache"] and b4["lm_head"] == 512 * 64 * 2 + 4 * 64 * 2
    with pytest.raises(ValueError, match="experts='all'"):
        planner.step_bytes(cfg, 1, 64, experts="all")


@pytest.mark.parametrize("name", ["kimi-k2.5-tp8-shard", "kimi-k2.5-tp8-ep8-shard", "kimi-k2.5-61x16"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_step_bytes_are_the_plans_bytes(name, batch):
    """On a GPU with the Pallas plan (cache read once) the planner's step terms read step_bytes."""
    cfg = preset(name)
    p = planner.plan(cfg, hardware.get("h200"), Layout(1), batch, 4096)
    assert sum(t.bytes for t in p.terms) == pytest.approx(sum(planner.step_bytes(cfg, batch, 4096).values()),
                                                          rel=1e-12)


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_tp8_shard_plan_is_the_8_device_plan_without_collectives(batch):
    """The planner's one-device plan of the TP8 shard is the whole model's TP8 plan on 8 x H200, term
    by term, less its collectives."""
    hw = hardware.get("h200")
    shard = planner.plan(preset("kimi-k2.5-tp8-shard"), hw, Layout(1), batch, 4096)
    whole = planner.plan(preset("kimi-k2.5"), hw, TP8, batch, 4096)
    assert [(t.name, t.bytes) for t in shard.terms] == [(t.name, t.bytes) for t in whole.terms]
    assert shard.step_s == pytest.approx(whole.compute_memory_s, rel=1e-12)
    assert shard.collectives == [] and whole.collective_s > 0


def test_ep8_shard_reads_the_expected_experts_of_one_ep_device():
    """48 local experts top-1: a token reads 1 expert, B tokens 48 (1 - (47/48)^B), the mean EP8
    device's count of the whole model (top-8 of 384)."""
    shard, full = preset("kimi-k2.5-tp8-ep8-shard"), preset("kimi-k2.5")
    per_expert = planner.expert_bytes_local(full, Layout(1))
    for batch in (1, 8, 32):
        got = planner.step_bytes(shard, batch, 4096)["routed_experts"]
        want = planner.step_bytes(full, batch, 4096, TP8_EP8)["routed_experts"]
        assert got == pytest.approx(want, rel=1e-12)
        assert got == pytest.approx(60 * 48 * (1 - (47 / 48) ** batch) * per_expert, rel=1e-12)
    assert planner.step_bytes(shard, 1, 4096, experts="max")["routed_experts"] == 60 * per_expert


@pytest.fixture(scope="module")
def fd(module_tool):
    return module_tool("launch.bench.full_depth")


def test_full_depth_takes_every_preset_and_knows_the_shards(fd):
    assert set(fd.FLAGS["preset"].parser.enum_values) == set(PRESETS)
    assert set(fd.SHARDS) == {"kimi-k2.5-tp8-shard", "kimi-k2.5-tp8-ep8-shard"}
    for name, (whole, layout) in fd.SHARDS.items():
        lay = Layout(**layout)
        assert preset(name) == shard_of(preset(whole), lay.tensor_parallel_size, lay.enable_expert_parallel)


@pytest.mark.parametrize("ep", [False, True], ids=["tp8", "tp8_ep8"])
def test_full_depth_runs_a_small_shard(fd, ep):
    """full_depth's decode step on the CPU-scale shard: it builds, runs, and every step row states its
    bytes and floors (step_bytes over the CPU preset's copy bandwidth) and the whole model's 8-device plan."""
    small = SMALL.replace(num_hidden_layers=2)                      # the dense layer and one MoE layer
    cfg = shard_of(small, 8, expert_parallel=ep)
    whole = (small, TP8_EP8 if ep else TP8)
    rows = fd.bench(cfg, [2], context=256, steps=1, variants=["default"], hw_name="cpu", dtype=jnp.float32,
                    emit=lambda r: None, whole=whole)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [(r["batch"], r["variant"]) for r in steps] == [(2, "default"), (2, "serve")]
    bw = hardware.get("cpu").hbm_bw
    for r in steps:
        read = sum(planner.step_bytes(cfg, r["batch"], 256).values())
        most = sum(planner.step_bytes(cfg, r["batch"], 256, experts="max").values())
        assert r["bytes_gb"] == pytest.approx(read / 1e9) and r["bytes_max_gb"] == pytest.approx(most / 1e9)
        assert r["floor_ms"] == pytest.approx(1e3 * read / bw) and r["floor_max_ms"] >= r["floor_ms"]
        assert r["pred_8dev_layout"] == ("TP8+EP" if ep else "TP8") and r["pred_8dev_ms"] > 0
        assert np.isfinite(r["chain_ms"]) and r["chain_ms"] > 0
    assert "floor" in fd.table(rows).splitlines()[0]
