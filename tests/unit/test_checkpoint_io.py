"""Synthetic writer + CheckpointReader round trips, the canonical layout, and every reader error.

All comparisons are exact: tensors are written and read back bit for bit, nothing is computed.
"""
import json
import logging
import os

import ml_dtypes
import numpy as np
import pytest

from checkpoints import int4, layout, synthetic
from checkpoints.safetensors_io import CheckpointError, CheckpointReader
from kimi_jax.config import ConfigError, ModelConfig, QuantConfig, preset

BF16 = np.dtype(ml_dtypes.bfloat16)
TINY = preset("tiny")
TINY_INT4 = TINY.replace(quantization=QuantConfig())
EXPERT = "model.layers.1.mlp.experts.3.down_proj"


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _read_all(path):
    with CheckpointReader(path) as r:
        expected = layout.expected_tensors(ModelConfig.from_pretrained(path))
        infos = r.validate(expected)
        return {c: r.read(c) for c in infos}


def _written(tmp_path, cfg=TINY_INT4, name="ck", **kw):
    path = str(tmp_path / name)
    synthetic.write_checkpoint(path, cfg, seed=kw.pop("seed", 0), **kw)
    return path


# ---- round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("int4_experts", [True, False])
@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("lay", ["k2", "k25"])
def test_round_trip(tmp_path, lay, num_shards, int4_experts):
    cfg = TINY.replace(quantization=QuantConfig() if int4_experts else None)
    path = _written(tmp_path, cfg, layout=lay, num_shards=num_shards, seed=7)
    files = sorted(os.listdir(path))
    if num_shards == 1:
        assert files == ["config.json", "model.safetensors"]
    else:
        assert files == ["config.json", "model-00001-of-00003.safetensors",
                         "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                         "model.safetensors.index.json"]
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        sizes = sum(os.path.getsize(os.path.join(path, f)) for f in files if f.startswith("model-"))
        assert 0 < index["metadata"]["total_size"] < sizes     # tensor bytes, without headers
    read_cfg = ModelConfig.from_pretrained(path)
    assert read_cfg == cfg.replace(model_type="kimi_k25" if lay == "k25" else cfg.model_type)
    with CheckpointReader(path) as r:
        assert r.layout == lay
        expected = layout.expected_tensors(cfg)
        infos = r.validate(expected)
        assert list(infos) == list(expected)
        for c, (shape, dtype) in expected.items():
            a = r.read(c)
            assert a.shape == shape and a.dtype.name == dtype, c
        norm = r.read("model.norm.weight")
        assert norm.dtype == BF16 and abs(float(norm.astype(np.float32).mean()) - 1.0) < 0.1
        if int4_experts:
            packed, scale = r.read(EXPERT + ".weight_packed"), r.read(EXPERT + ".weight_scale")
            w = int4.dequantize(packed, scale, 32)
            assert w.shape == (TINY.hidden_size, TINY.moe_intermediate_size)
            assert list(r.read(EXPERT + ".weight_shape")) == [64, 32]


def test_same_weights_across_layouts_and_shards(tmp_path):
    a = _read_all(_written(tmp_path, name="a", layout="k2", num_shards=1))
    b = _read_all(_written(tmp_path, name="b", layout="k25", num_shards=3))
    assert a.keys() == b.keys()
    assert all(_same(a[k], b[k]) for k in a)


def test_deterministic_for_a_seed(tmp_path):
    p1, p2 = _written(tmp_path, name="a", seed=3), _written(tmp_path, name="b", seed=3)
    p3 = _written(tmp_path, name="c", seed=4)
    blob = lambda p: open(os.path.join(p, "model.safetensors"), "rb").read()  # noqa: E731
    assert blob(p1) == blob(p2) != blob(p3)


def test_write_from_tensors_round_trip(tmp_path):
    tensors = _read_all(_written(tmp_path, name="src", layout="k2"))
    dst = str(tmp_path / "dst")
    synthetic.write_checkpoint_from_tensors(dst, TINY_INT4, tensors, layout="k25", num_shards=2)
    back = _read_all(dst)
    assert back.keys() == tensors.keys() and all(_same(back[k], tensors[k]) for k in back)
    bad = dict(tensors)
    bad["model.norm.weight"] = bad["model.norm.weight"].astype(np.float32)
    with pytest.raises(CheckpointError, match="'model.norm.weight' is float32"):
        synthetic.write_checkpoint_from_tensors(str(tmp_path / "x"), TINY_INT4, bad)


def test_tokenizer_files_copied(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tiktoken.model").write_bytes(b"abc 0\n")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "config.json").write_text("{}")                   # never copied over ours
    path = _written(tmp_path, tokenizer_dir=str(tok))
    assert (tmp_path / "ck" / "tiktoken.model").read_bytes() == b"abc 0\n"
    assert (tmp_path / "ck" / "tokenizer_config.json").exists()
    assert ModelConfig.from_pretrained(path) == TINY_INT4


def test_k25_config_nesting(tmp_path):
    path = _written(tmp_path, layout="k25")
    with CheckpointReader(path) as r:
        d = r.config_dict
    assert d["model_type"] == "kimi_k25"
    assert d["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert d["text_config"]["model_type"] == "kimi_k2"
    assert d["quantization_config"] == d["text_config"]["quantization_config"]
    assert "vision_config" in d


def test_skipped_tensors_logged_once(tmp_path, caplog):
    """Vision tower, projector, an MTP layer and rotary_emb.inv_freq are skipped by design."""
    tensors = _read_all(_written(tmp_path, name="src"))
    L = TINY_INT4.num_hidden_layers
    extra = {"vision_tower.encoder.blocks.0.wqkv.weight": np.zeros((4, 4), BF16),
             "mm_projector.proj.0.weight": np.zeros((4, 4), BF16),
             f"model.layers.{L}.mlp.gate.weight": np.zeros((8, 64), BF16),
             f"model.layers.{L}.eh_proj.weight": np.zeros((64, 128), BF16),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros((4,), np.float32)}
    path = str(tmp_path / "dst")
    synthetic.write_checkpoint_from_tensors(path, TINY_INT4, {**tensors, **extra}, strict=False)
    with caplog.at_level(logging.INFO, logger="checkpoints.safetensors_io"):
        r = CheckpointReader(path)
        r.validate(layout.expected_tensors(TINY_INT4))
        r.validate(layout.expected_tensors(TINY_INT4))
    lines = [m for m in caplog.messages if "skipping" in m]
    assert len(lines) == 1
    assert "skipping 5 tensors not used by design" in lines[0]
    assert "MTP layer: 2" in lines[0] and "vision tower: 1" in lines[0]


def test_weight_shape_int64_accepted(tmp_path):
    tensors = _read_all(_written(tmp_path, name="src"))
    tensors = {k: (v.astype(np.int64) if k.endswith("weight_shape") else v) for k, v in tensors.items()}
    path = str(tmp_path / "dst")
    synthetic.write_checkpoint_from_tensors(path, TINY_INT4, tensors)
    with CheckpointReader(path) as r:
        r.validate(layout.expected_tensors(TINY_INT4))
        assert r.read(EXPERT + ".weight_shape").dtype == np.int64


# ---- layout ----------------------------------------------------------------------------
def test_layout_kimi_k25_counts():
    """208,215 text tensors; with K2.5's 335 vision/projector tensors that is the 208,550 of the
    published checkpoint's index; 553.4 GiB of text tensors vs the published 554.27 GiB of tensor bytes
    in all."""
    exp = layout.expected_tensors(preset("kimi-k2.5"))
    assert len(exp) == 208_215
    size = {"bfloat16": 2, "float32": 4, "int32": 4}
    total = sum(int(np.prod(s)) * size[d] for s, d in exp.values())
    assert 553.3 < total / 2 ** 30 < 553.5
    assert exp["model.layers.1.mlp.experts.0.gate_proj.weight_packed"] == ((2048, 896), "int32")
    assert exp["model.layers.1.mlp.experts.0.down_proj.weight_scale"] == ((7168, 64), "bfloat16")
    assert exp["model.layers.1.mlp.experts.0.up_proj.weight_shape"] == ((2,), "int32")
    assert exp["model.layers.60.self_attn.kv_b_proj.weight"] == ((16384, 512), "bfloat16")
    assert exp["model.layers.0.mlp.down_proj.weight"] == ((7168, 18432), "bfloat16")
    assert exp["model.layers.5.mlp.gate.e_score_correction_bias"] == ((384,), "float32")
    assert "model.layers.0.mlp.gate.weight" not in exp


def test_layout_variants():
    exp = layout.expected_tensors(TINY.replace(q_lora_rank=None, tie_word_embeddings=True,
                                               n_shared_experts=0))
    N, H, R = TINY.num_attention_heads, TINY.qk_nope_head_dim, TINY.qk_rope_head_dim
    assert exp["model.layers.0.self_attn.q_proj.weight"] == ((N * (H + R), 64), "bfloat16")
    assert not any("q_a_proj" in n or "q_b_proj" in n or "shared_experts" in n for n in exp)
    assert "lm_head.weight" not in exp
    exp = layout.expected_tensors(TINY.replace(n_shared_experts=2))
    assert exp["model.layers.1.mlp.shared_experts.down_proj.weight"] == ((64, 64), "bfloat16")
    assert exp["model.layers.1.mlp.experts.7.up_proj.weight"] == ((32, 64), "bfloat16")


def test_canonical_names():
    c = layout.canonical_name
    assert c("language_model.model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert c("language_model.lm_head.weight") == "lm_head.weight"
    assert c("model.norm.weight") == "model.norm.weight"
    assert c("vision_tower.encoder.blocks.0.wqkv.weight") is None
    assert c("mm_projector.proj.0.weight") is None
    assert c("multi_modal_projector.linear_1.weight") is None
    assert c("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert c("model.layers.61.eh_proj.weight", num_hidden_layers=61) is None
    assert c("language_model.model.layers.61.embed_tokens.weight", 61) is None
    assert c("model.layers.60.mlp.gate.weight", 61) == "model.layers.60.mlp.gate.weight"
    assert layout.layout_name("lm_head.weight", "k25") == "language_model.lm_head.weight"


# ---- reader errors -----------------------------------------------------------------------
def _with(tmp_path, change, num_shards=3, cfg=TINY_INT4):
    """A checkpoint built from a valid one with `change(tensors)` applied (strict=False)."""
    tensors = _read_all(_written(tmp_path, cfg, name="src"))
    change(tensors)
    path = str(tmp_path / "bad")
    synthetic.write_checkpoint_from_tensors(path, cfg, tensors, num_shards=num_shards,
                                            strict=False)
    return path


def _validate(path, cfg=TINY_INT4):
    with CheckpointReader(path) as r:
        r.validate(layout.expected_tensors(cfg))


def _shard_of(path, name):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][name]


@pytest.mark.parametrize("num_shards", [1, 3])
def test_missing_tensor(tmp_path, num_shards):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    path = _with(tmp_path, lambda t: t.pop(name), num_shards)
    with pytest.raises(CheckpointError) as e:
        _validate(path)
    msg = str(e.value)
    assert "missing tensor" in msg and name in msg and "\n" not in msg
    if num_shards == 1:
        assert os.path.join(path, "model.safetensors") in msg
    else:
        assert os.path.join(path, "model.safetensors.index.json") in msg
        assert _shard_of(path, "model.layers.2.self_attn.o_proj.weight") in msg   # a peer's shard


def test_unexpected_tensor(tmp_path):
    name = "model.layers.1.mlp.experts.9.up_proj.weight_packed"       # tiny has 8 experts
    path = _with(tmp_path, lambda t: t.update({name: np.zeros((32, 8), np.int32)}))
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        _validate(path)
    assert name in str(e.value) and _shard_of(path, name) in str(e.value)


def test_wrong_shape(tmp_path):
    name = EXPERT + ".weight_scale"
    path = _with(tmp_path, lambda t: t.update({name: np.zeros((64, 2), BF16)}))
    with pytest.raises(CheckpointError) as e:
        _validate(path)
    msg = str(e.value)
    assert name in msg and _shard_of(path, name) in msg and "[64, 2]" in msg and "[64, 1]" in msg


def test_wrong_dtype(tmp_path):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    path = _with(tmp_path, lambda t: t.update({name: t[name].astype(BF16)}))
    with pytest.raises(CheckpointError) as e:
        _validate(path)
    msg = str(e.value)
    assert name in msg and _shard_of(path, name) in msg
    assert "dtype bfloat16, expected float32" in msg


def test_bf16_experts_with_int4_config(tmp_path):
    src = _written(tmp_path, TINY, name="bf16")            # bf16 experts, no quantization_config
    with pytest.raises(CheckpointError, match="bf16 experts but config.json has a quantization"):
        _validate(src, TINY_INT4)


def test_truncated_shard(tmp_path):
    path = _written(tmp_path, num_shards=3)
    shard = os.path.join(path, "model-00002-of-00003.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match="truncated") as e:
        CheckpointReader(path)
    msg = str(e.value)
    assert shard in msg and "tensor '" in msg
    cut = msg.split("tensor '")[1].split("'")[0]
    assert _shard_of(path, cut) == "model-00002-of-00003.safetensors"
    with open(shard, "r+b") as f:                           # now even the header is cut
        f.truncate(20)
    with pytest.raises(CheckpointError, match="truncated file") as e:
        CheckpointReader(path)
    assert shard in str(e.value)


def test_missing_shard(tmp_path):
    path = _written(tmp_path, num_shards=3)
    os.remove(os.path.join(path, "model-00003-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match="does not exist") as e:
        CheckpointReader(path)
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and "model-00003-of-00003.safetensors" in msg
    assert "tensor 'lm_head.weight'" in msg or "tensor 'model." in msg


def test_index_and_shard_disagree(tmp_path):
    path = _written(tmp_path, num_shards=3)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(CheckpointError, match="'model.norm.weight'") as e:
        CheckpointReader(path)
    assert "model-00001-of-00003.safetensors" in str(e.value)


def test_missing_config(tmp_path):
    path = _written(tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="config.json: missing config"):
        CheckpointReader(path)
    assert CheckpointReader(path, require_config=False).config_dict is None


def test_no_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(str(tmp_path), require_config=False)


def test_duplicate_names_across_layouts(tmp_path):
    path = _with(tmp_path, lambda t: t.update(
        {"language_model.model.norm.weight": t["model.norm.weight"]}), num_shards=1)
    with pytest.raises(CheckpointError, match="duplicates") as e:
        _validate(path)
    assert "model.norm.weight" in str(e.value)


def test_unsupported_quantization(tmp_path):
    path = _written(tmp_path)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        d = json.load(f)
    d["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with open(cfg_file, "w") as f:
        json.dump(d, f)
    with pytest.raises(ConfigError, match="num_bits"):
        ModelConfig.from_pretrained(path)


def test_hf_transformers_accepts_layout(tmp_path):
    """transformers' DeepseekV3ForCausalLM loads a bf16 synthetic checkpoint with no missing or
    unexpected keys: our canonical names are the HF names."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = _written(tmp_path, TINY, num_shards=2)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
