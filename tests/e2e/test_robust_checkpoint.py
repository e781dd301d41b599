"""Bad checkpoints through LLM and kimi-generate: a config field of the wrong type or out of range, a
config with fewer layers than the weights, overlapping or unclaimed byte ranges, and NaN / Inf in a
weight, a norm or an INT4 scale are each refused with one line naming config.json and the field, or
the file and the tensor; nothing is loaded silently wrong."""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import layout, synthetic
from checkpoints.safetensors_io import CheckpointError, CheckpointReader
from kimi_jax import LLM
from kimi_jax.config import ConfigError, QuantConfig, preset
from tests.e2e.test_batch_cli import ROOT, env

TINY_INT4 = preset("tiny").replace(quantization=QuantConfig())


def _copy(src, dst, config_change=None):
    """A checkpoint directory sharing src's weight files (links), with config.json changed."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    cfg = json.load(open(os.path.join(src, "config.json")))
    if config_change:
        config_change(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def _set(**kw):
    return lambda cfg: cfg.update(kw)


BAD_CONFIGS = {   # name -> (change, the field the message names, words)
    "layers-float": (_set(num_hidden_layers=4.5), "num_hidden_layers", "integer"),
    "layers-string": (_set(num_hidden_layers="four"), "num_hidden_layers", "integer"),
    "layers-bool": (_set(num_hidden_layers=True), "num_hidden_layers", "integer"),
    "heads-negative": (_set(num_attention_heads=-4), "num_attention_heads", ">= 1"),
    "eps-negative": (_set(rms_norm_eps=-1), "rms_norm_eps", "> 0"),
    "rope-theta-nan": (_set(rope_theta=float("nan")), "rope_theta", "finite"),
    "experts-per-token": (_set(num_experts_per_tok=9), "num_experts_per_tok", "n_routed_experts"),
    "vocab-zero": (_set(vocab_size=0), "vocab_size", ">= 1"),
    "norm-topk-string": (_set(norm_topk_prob="yes"), "norm_topk_prob", "true or false"),
    "eos-negative": (_set(eos_token_id=[1, -2]), "eos_token_id", ">= 0"),
    "topk-group": (_set(topk_group=3), "topk_group", "n_group"),
    "yarn-factor": (lambda c: c["rope_scaling"].update(factor="x"), "rope_scaling.factor", "number"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_field_names_config_json_and_the_field(tiny_ckpt, tmp_path, name):
    change, field, words = BAD_CONFIGS[name]
    path = _copy(tiny_ckpt, tmp_path / name, change)
    with pytest.raises(ConfigError) as e:
        LLM(path, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(os.path.join(path, "config.json") + ":"), msg
    assert f"'{field}'" in msg and words in msg, msg


def test_config_with_fewer_layers_than_the_weights(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "fewer", _set(num_hidden_layers=2))
    with pytest.raises(CheckpointError) as e:
        LLM(path, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and "model.safetensors" in msg and "layer 2" in msg, msg
    assert "num_hidden_layers=2" in msg and "config.json" in msg, msg


def test_kimi_generate_exits_2_with_one_line(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "g", _set(num_hidden_layers=4.5))
    p = subprocess.run([sys.executable, "-m", "launch.generate", "--model", path, "--prompt", "hi"],
                       cwd=ROOT, env=env(), capture_output=True, timeout=300)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr.decode()[-2000:]
    assert "config.json" in lines[0] and "num_hidden_layers" in lines[0], lines


# ---- byte ranges ----------------------------------------------------------------------------------
def _header(file):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _rewrite_header(src_dir, dst_dir, change, extra_bytes=b""):
    """A copy of a one-file checkpoint whose safetensors header is changed (same length, padded)."""
    _copy(src_dir, dst_dir)
    os.unlink(os.path.join(dst_dir, "model.safetensors"))
    src = os.path.join(src_dir, "model.safetensors")
    n, header = _header(src)
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    with open(src, "rb") as f:
        f.seek(8 + n)
        data = f.read()
    with open(os.path.join(dst_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + data + extra_bytes)
    return str(dst_dir)


def test_overlapping_and_unclaimed_byte_ranges_are_refused(tiny_ckpt, tmp_path):
    header = _header(os.path.join(tiny_ckpt, "model.safetensors"))[1]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])

    def overlap(h):     # two same-size tensors: the second one points at the first one's bytes
        by_size = {}
        for k in names:
            b, e = h[k]["data_offsets"]
            if (e - b) in by_size:
                h[k]["data_offsets"] = h[by_size[e - b]]["data_offsets"]
                return
            by_size[e - b] = k

    bad = _rewrite_header(tiny_ckpt, tmp_path / "overlap", overlap)
    with pytest.raises(CheckpointError) as e:
        LLM(bad, dtype="float32")
    assert "overlaps tensor" in str(e.value) and "model.safetensors" in str(e.value), str(e.value)
    bad = _rewrite_header(tiny_ckpt, tmp_path / "trailing", lambda h: None, extra_bytes=b"\0" * 64)
    with pytest.raises(CheckpointError, match="last 64 bytes belong to no tensor"):
        LLM(bad, dtype="float32")

    bad = _rewrite_header(tiny_ckpt, tmp_path / "gap", lambda h: h.pop(names[0]))   # its bytes: no one's
    with pytest.raises(CheckpointError, match=f"before tensor '{names[1]}' belong to no tensor"):
        LLM(bad, dtype="float32")


# ---- finite values --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_tensors(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("int4"))
    synthetic.write_checkpoint(path, TINY_INT4, seed=1, std=0.08)
    with CheckpointReader(path) as r:
        return {c: r.read(c) for c in r.validate(layout.expected_tensors(TINY_INT4))}


@pytest.mark.parametrize("tensor,value", [
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", math.nan),
    ("model.layers.2.post_attention_layernorm.weight", math.inf),
    ("model.layers.1.mlp.experts.5.down_proj.weight_scale", -math.inf),
    ("lm_head.weight", math.nan),
])
def test_non_finite_weight_is_refused_naming_file_and_tensor(int4_tensors, tmp_path, tensor, value):
    tensors = dict(int4_tensors)
    bad = np.array(tensors[tensor], copy=True)
    bad.reshape(-1)[bad.size // 2] = value
    tensors[tensor] = bad
    path = str(tmp_path / "ck")
    synthetic.write_checkpoint_from_tensors(path, TINY_INT4, tensors)
    with pytest.raises(CheckpointError) as e:
        LLM(path, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(os.path.join(path, "model.safetensors")), msg
    assert f"'{tensor}'" in msg and "NaN or Inf" in msg, msg
    # the opt-out loads it as stored
    LLM(path, dtype="float32", check_finite_weights=False)


def test_non_finite_weight_is_refused_when_read_in_slices_and_blocks(int4_tensors, tmp_path, monkeypatch):
    """Under TP x EP each device reads a slice of a tensor, and staged loads read a large shard in
    blocks: a NaN in any one slice or block is found, and so is a float32 value that becomes Inf when
    cast to a bfloat16 parameter."""
    from checkpoints import loader
    from kimi_jax.config import ModelConfig
    from kimi_jax.entrypoints.weights import load_model
    from kimi_jax.parallel.sharding import Layout
    monkeypatch.setattr(loader, "CPU_ADOPTS_HOST_BUFFERS", False)
    # (tensor, value, stored dtype (None: as written), parameter dtype); 3.4e38 is finite stored in
    # float32 and Inf once cast to a bfloat16 parameter
    for name, value, stored, dtype in [
            ("model.layers.1.mlp.experts.5.down_proj.weight_scale", math.nan, None, jnp.float32),
            ("model.layers.0.mlp.down_proj.weight", -math.nan, None, jnp.float32),
            ("model.embed_tokens.weight", 3.4e38, np.float32, jnp.bfloat16)]:
        tensors = dict(int4_tensors)
        bad = np.array(tensors[name], dtype=stored, copy=True)
        bad.reshape(-1)[-1] = value           # the last element: the last slice, the last block
        tensors[name] = bad
        path = str(tmp_path / name)
        synthetic.write_checkpoint_from_tensors(path, TINY_INT4, tensors, strict=False)
        cfg = ModelConfig.from_pretrained(path)
        live = [a for a in jax.live_arrays() if not a.is_deleted()]      # held: a count could drop meanwhile
        held = {id(a) for a in live}
        with pytest.raises(CheckpointError, match=f"'{name}' holds NaN or Inf"):
            load_model(path, cfg, Layout(4, 2, True), dtype, chunk_bytes=4096, readahead_bytes=16384)
        assert [a.shape for a in jax.live_arrays() if not a.is_deleted() and id(a) not in held] == []
        if stored is None:       # the opt-out loads it as stored
            load_model(path, cfg, Layout(4, 2, True), dtype, chunk_bytes=4096, readahead_bytes=16384,
                       check_finite=False)
