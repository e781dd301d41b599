"""Loading at scale: streamed per-device loads, orbax conversion onto another mesh, and one
clear error per bad input, on 8 simulated CPU devices.

The checkpoint is the real format: Kimi-K2.5 layout (`language_model.` prefixes, nested config,
vision tensors to skip), 3 safetensors shards with an index, INT4 experts (F = 256 so that tp=8 slices
are whole 32-groups), 8 heads and 16 experts so every layout divides.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import tracemalloc
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import layout as layout_lib
from checkpoints import loader, orbax_io
from checkpoints.safetensors_io import CheckpointError, CheckpointReader
from checkpoints.synthetic import write_checkpoint, write_checkpoint_from_tensors
from kimi_jax import LLM
from kimi_jax.config import QuantConfig, preset
from kimi_jax.entrypoints.weights import load_model
from kimi_jax.model.transformer import abstract_model, param_arrays
from kimi_jax.parallel.sharding import Layout, param_shardings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                             num_experts_per_tok=3, quantization=QuantConfig(), moe_intermediate_size=256)
IDS = list(range(3, 24))
TP8 = Layout(8)
DP2_TP4_EP = Layout(4, 2, True)
DP8_EP = Layout(1, 8, True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("k25_int4"))
    write_checkpoint(path, CFG, seed=3, std=0.08, layout="k25", num_shards=3)
    return path


def _abstract(layout: Layout, dtype=jnp.float32):
    return nnx.split(abstract_model(CFG, dtype, layout.moe_parallel()))[1]


def _specs(layout: Optional[Layout]) -> dict:
    """{parameter path: ShapeDtypeStruct} of CFG in float32, sharded under `layout` (None: no sharding)."""
    state = _abstract(layout or Layout())
    sh = param_shardings(layout, state) if layout else {}
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh.get(k)) for k, v in param_arrays(state).items()}


def _load(path, layout: Layout, **kw):
    return load_model(path, CFG, layout, jnp.float32, **kw), param_shardings(layout, _abstract(layout))


_params = param_arrays


@pytest.fixture(scope="module")
def plain(ckpt):
    """Every parameter put together on the host from the stored tensors, by name (the layout's
    parameter path -> canonical name mapping), cast as the model wants it (floats to float32, INT4
    words as stored): the reference every load is compared with bit for bit."""
    out = {}
    with CheckpointReader(ckpt) as r:
        for path, v in _specs(None).items():
            arr = np.empty(v.shape, v.dtype)
            for idx, name in layout_lib.hf_names_for(path, CFG.num_dense_layers, v.shape):
                arr[idx] = np.asarray(r.read(name)).astype(v.dtype)
            out[path] = arr
    return out


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _live() -> list:
    """The live arrays, held: a later call's extras are what was placed since (not a count, which arrays
    of earlier tests being collected meanwhile would lower)."""
    return [a for a in jax.live_arrays() if not a.is_deleted()]


def _new_since(before: list) -> list:
    held = {id(a) for a in before}
    return [a.shape for a in _live() if id(a) not in held]


# ---- streamed sharded loading -------------------------------------------------------------------
@pytest.mark.parametrize("layout,chunk", [(TP8, None), (DP2_TP4_EP, 8192)], ids=["TP8", "DP2xTP4+EP-chunked"])
def test_streamed_load_equals_plain_load_and_each_device_holds_its_slice(ckpt, plain, layout, chunk,
                                                                         monkeypatch):
    stats = loader.LoadStats()
    if chunk:   # stage as for accelerators; a small chunk_bytes sends the larger shards through the
        # chunked in-place path (blocks of every local shard written into the global array)
        monkeypatch.setattr(loader, "CPU_ADOPTS_HOST_BUFFERS", False)
        model, sh = _load(ckpt, layout, chunk_bytes=chunk, readahead_bytes=4 * chunk, stats=stats)
        assert stats.blocks > 0 and stats.max_host_bytes <= 4 * chunk
    else:
        model, sh = _load(ckpt, layout, stats=stats)
        assert stats.blocks == 0 and stats.params == len(plain)
    params = _params(model)
    assert params.keys() == plain.keys()
    for path, arr in params.items():
        assert arr.sharding == sh[path], path
        assert _same_bits(arr, plain[path]), path
        for shard in arr.addressable_shards:             # each device got exactly its slice
            assert shard.data.shape == sh[path].shard_shape(arr.shape), path
            assert _same_bits(shard.data, plain[path][shard.index]), path


@pytest.fixture(scope="module")
def dp2_logits(ckpt):
    return LLM(ckpt, dtype="float32", **_kw(DP2_TP4_EP)).logits(IDS)


def test_default_load_streams_onto_the_first_device(ckpt, plain):
    """A spec without shardings: every parameter on the first local device."""
    got = loader.load_arrays(ckpt, _specs(None), CFG)
    assert got.keys() == plain.keys()
    for path, arr in got.items():
        assert arr.devices() == {jax.local_devices()[0]} and _same_bits(arr, plain[path]), path


def test_sharded_logits_equal_plain_logits(ckpt, dp2_logits):
    one = LLM(ckpt, dtype="float32").logits(IDS)
    sharded = dp2_logits
    # float32; only the order of partial-sum reductions differs between layouts (~1e-7 relative)
    np.testing.assert_allclose(sharded, one, rtol=0, atol=1e-5 * np.abs(one).max())


def _kw(layout: Layout) -> dict:
    return dict(tensor_parallel_size=layout.tensor_parallel_size,
                data_parallel_size=layout.data_parallel_size,
                enable_expert_parallel=layout.enable_expert_parallel)


class _Recorder:
    """Wraps CheckpointReader.read_into (every file read goes through it): (file, start, end)."""

    def __init__(self, monkeypatch):
        self.ranges = []
        self._lock = threading.Lock()
        orig = CheckpointReader.read_into

        def read_into(reader, fname, offset, bufs, what=""):
            with self._lock:
                self.ranges.append((fname, offset, offset + sum(len(b) for b in bufs)))
            return orig(reader, fname, offset, bufs, what)

        monkeypatch.setattr(CheckpointReader, "read_into", read_into)

    def overlapping(self, info):
        """The parts of the recorded reads inside a tensor's bytes."""
        return sorted((max(a, info.begin), min(b, info.end)) for f, a, b in self.ranges
                      if f == info.file and a < info.end and b > info.begin)


@pytest.mark.parametrize("max_gap", [0, None], ids=["exact", "gaps-coalesced"])
def test_ep_reads_each_needed_byte_once_and_nothing_else(ckpt, monkeypatch, max_gap):
    if max_gap is not None:     # reads never bridge the small unused tensors between needed ones
        monkeypatch.setattr(loader, "_MAX_GAP", max_gap)
    rec = _Recorder(monkeypatch)
    stats = loader.LoadStats()
    _load(ckpt, DP8_EP, stats=stats)
    with CheckpointReader(ckpt) as r:
        needed = [r.info(c) for c in layout_lib.expected_tensors(CFG) if not c.endswith(".weight_shape")]
        unused = [i for i in r.tensors.values() if i not in needed]      # vision, weight_shape
    # replicated parameters: one read for all 8 devices; experts: only by the device holding them
    for info in needed:
        assert rec.overlapping(info) and sum(b - a for a, b in rec.overlapping(info)) == info.nbytes, info.name
    assert stats.bytes_read == sum(b - a for _, a, b in rec.ranges)
    if max_gap == 0:
        assert stats.bytes_read == sum(i.nbytes for i in needed)
        assert unused and not any(rec.overlapping(i) for i in unused)
    else:                       # at most the small unused tensors between needed ones, once
        assert stats.bytes_read <= sum(i.nbytes for i in needed) + sum(i.nbytes for i in unused)


def test_tp_row_slices_read_only_their_rows(ckpt, monkeypatch):
    rec = _Recorder(monkeypatch)
    _load(ckpt, TP8)
    with CheckpointReader(ckpt) as r:
        info = r.info("model.layers.0.self_attn.q_b_proj.weight")     # [N*(H+R), Q]: rows split 8 ways
    parts = rec.overlapping(info)
    assert sum(b - a for a, b in parts) == info.nbytes                 # every byte once, no more
    assert all(a[1] <= b[0] for a, b in zip(parts, parts[1:]))


def test_progress_bar_and_read_errors_leave_nothing_behind(ckpt, tmp_path, capsys):
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    before = _live()
    with CheckpointReader(path) as reader:
        reader.validate(loader.expected_for(reader, CFG))
        shard = os.path.join(path, "model-00003-of-00003.safetensors")
        with open(shard, "r+b") as f:                    # cut after validation: fails mid-load
            f.truncate(os.path.getsize(shard) // 2)
        with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors: truncated file: "
                                                  r"tensor '[^']+'"):
            loader.load_params(reader, CFG, _specs(DP2_TP4_EP), progress=True)
    assert _new_since(before) == []                      # every array placed before the error: deleted
    assert "loading" in capsys.readouterr().err          # the tqdm bar ran


# ---- bad input: one line naming file and tensor -------------------------------------------------
def _rewrite(ckpt, tmp_path, change, cfg=CFG, num_shards=3):
    with CheckpointReader(ckpt) as r:
        tensors = {c: r.read(c) for c in layout_lib.expected_tensors(CFG)}
    change(tensors)
    path = str(tmp_path / "bad")
    write_checkpoint_from_tensors(path, cfg, tensors, layout="k25", num_shards=num_shards, strict=False)
    return path


def _shard_of(path, name):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][name]


def _one_line_error(path, layout=DP2_TP4_EP, match=None) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        LLM(path, dtype="float32", **_kw(layout))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_shard(ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    msg = _one_line_error(path, match="does not exist")
    assert "model.safetensors.index.json" in msg and "model-00002-of-00003.safetensors" in msg
    assert "tensor 'language_model.model." in msg


def test_truncated_file(ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    shard = os.path.join(path, "model-00001-of-00003.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    msg = _one_line_error(path, match="truncated file")
    cut = msg.split("tensor '")[1].split("'")[0]
    assert shard in msg and _shard_of(path, cut) == "model-00001-of-00003.safetensors"


def test_wrong_shape(ckpt, tmp_path):
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"
    path = _rewrite(ckpt, tmp_path, lambda t: t.update({name: t[name][:, :-1]}))
    msg = _one_line_error(path, match="shape")
    assert "language_model." + name in msg and _shard_of(path, "language_model." + name) in msg


def test_wrong_dtype(ckpt, tmp_path):
    name = "model.layers.2.mlp.experts.9.up_proj.weight_packed"
    path = _rewrite(ckpt, tmp_path, lambda t: t.update({name: t[name].astype(np.int16)}))
    msg = _one_line_error(path, match="dtype int16, expected int32")
    assert "language_model." + name in msg and _shard_of(path, "language_model." + name) in msg


def test_config_disagreeing_with_weights_is_caught_before_any_allocation(ckpt, tmp_path, monkeypatch):
    """config.json says 16 experts, the files hold 12: validate refuses before anything is placed."""
    def drop(t):
        for n in [n for n in t if ".mlp.experts." in n and int(n.split(".experts.")[1].split(".")[0]) >= 12]:
            del t[n]
        for n in [n for n in t if n.endswith("mlp.gate.weight") or n.endswith("e_score_correction_bias")]:
            t[n] = t[n][:12]
    path = _rewrite(ckpt, tmp_path, drop)                  # config.json: CFG (16 experts)

    def no_load(*a, **k):
        raise AssertionError("load_params ran: validation did not catch the config/weights mismatch")
    monkeypatch.setattr(loader, "load_params", no_load)
    before = _live()
    msg = _one_line_error(path)
    assert "model.safetensors.index.json: missing tensor 'language_model.model.layers.1.mlp.experts.12." in msg
    assert "the checkpoint has 12 routed experts in layer 1 but config.json says n_routed_experts=16" in msg
    assert _new_since(before) == []


# ---- orbax ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def orbax_tp8(ckpt, tmp_path_factory):
    """An orbax checkpoint written from a model loaded under tp=8 (8 devices)."""
    out = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    model, _ = _load(ckpt, TP8)
    meta = orbax_io.save(out, param_arrays(model), CFG.to_hf_dict(), source=ckpt, layout_name=TP8.name)
    assert meta["written_by"]["layout"] == "TP8" and meta["written_by"]["devices"] == 8
    del model
    return out


def test_orbax_written_under_tp8_restores_onto_dp2_tp4_ep(ckpt, orbax_tp8, dp2_logits):
    assert orbax_io.is_orbax_checkpoint(orbax_tp8) and not orbax_io.is_orbax_checkpoint(ckpt)
    assert os.path.isfile(os.path.join(orbax_tp8, "config.json"))
    restored = LLM(orbax_tp8, dtype="float32", **_kw(DP2_TP4_EP))
    got = restored.logits(IDS)
    assert np.array_equal(got, dp2_logits)                # same weights, same layout: identical logits
    model, sh = _load(orbax_tp8, DP2_TP4_EP)
    ref, _ = _load(ckpt, DP2_TP4_EP)
    ref = _params(ref)
    for path, arr in _params(model).items():
        assert arr.sharding == sh[path] and _same_bits(arr, ref[path]), path


def test_orbax_checkpoint_of_another_model_is_refused(orbax_tp8, tmp_path):
    other = CFG.replace(n_routed_experts=8)
    before = _live()
    with pytest.raises(CheckpointError, match="written for another model") as e:
        load_model(orbax_tp8, other, Layout(), jnp.float32)
    msg = str(e.value)
    assert "\n" not in msg and os.path.join(orbax_tp8, "state") in msg
    assert "parameter 'moe_layers.mlp." in msg and "[2, 16," in msg and "[2, 8," in msg
    assert _new_since(before) == []
    # same shapes, a field that changes the math: named
    with pytest.raises(CheckpointError, match="config field 'rope_theta' is 10000.0 in the checkpoint"):
        load_model(orbax_tp8, CFG.replace(rope_theta=50000.0), Layout(), jnp.float32)
    # LLM(dir) with a config.json for another model
    path = str(tmp_path / "swapped")
    shutil.copytree(orbax_tp8, path)
    from checkpoints.synthetic import hf_config_dict
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(other, "k25"), f)
    with pytest.raises(CheckpointError, match="parameter 'moe_layers.mlp."):
        LLM(path, dtype="float32")


def test_convert_cli_exit_status_2_on_bad_input(ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    shard = os.path.join(path, "model-00002-of-00003.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(100)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "launch.convert", f"--model={path}",
                        f"--out={tmp_path / 'o'}"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    err = [line for line in p.stderr.splitlines() if line.startswith("kimi-convert: error:")]
    assert len(err) == 1 and shard in err[0] and "truncated" in err[0]
    assert not os.path.exists(tmp_path / "o")


# ---- the synthetic writer at scale ------------------------------------------------------------------
def test_writer_streams_large_tensors_in_bounded_memory(tmp_path):
    """A 128 MB embedding is written in 16 MB pieces (tracemalloc sees numpy's buffers: one piece and
    one temporary at a time); the files
    read back through the safetensors library; 'fast' values are finite and about std in size."""
    cfg = preset("tiny").replace(vocab_size=1 << 20, quantization=QuantConfig())
    path = str(tmp_path / "big")
    tracemalloc.start()
    write_checkpoint(path, cfg, values="fast", num_shards=2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 40 << 20, peak
    from safetensors import safe_open
    with CheckpointReader(path) as r:
        info = r.info("lm_head.weight")
        with safe_open(os.path.join(path, info.file), framework="numpy") as f:
            lib = f.get_tensor("lm_head.weight")
        ours = r.read_slice("lm_head.weight", (slice(1000, 1010),))
        assert _same_bits(ours, lib[1000:1010])
        w = lib.astype(np.float32)
        assert np.isfinite(w).all() and 0.005 < np.abs(w).mean() < 0.05




def test_prefaulting_never_overwrites_what_was_read(ckpt, monkeypatch):
    """The loader's prefault thread writes a zero in each page of a buffer that a read will fill:
    held back (each touch 20 ms late) it still runs before that read, and every parameter is the
    stored bits. (bfloat16, as LLM loads it: JAX's CPU arrays adopt the staging buffers, so a touch
    after its read zeroed the low byte of a page's first value in the loaded model.)"""
    import time
    state = nnx.split(abstract_model(CFG, jnp.bfloat16, Layout().moe_parallel()))[1]
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in param_arrays(state).items()}
    real, late = loader._touch, []

    def slow_touch(arr):
        time.sleep(0.02)
        late.append(arr.nbytes)
        real(arr)
    monkeypatch.setattr(loader, "_touch", slow_touch)
    got = loader.load_arrays(ckpt, specs, CFG)
    assert late, "no buffer was large enough to be prefaulted"
    with CheckpointReader(ckpt) as r:
        for p, v in specs.items():
            want = np.empty(v.shape, v.dtype)
            for idx, name in layout_lib.hf_names_for(p, CFG.num_dense_layers, v.shape):
                want[idx] = np.asarray(r.read(name)).astype(v.dtype)
            assert _same_bits(got[p], want), p
