"""Orbax save / restore in bounded memory (checkpoints/orbax_io.py, format version 2): parameters
larger than `chunk_bytes` are stored as several entries, saved and restored one part (<= chunk_bytes)
at a time, and put back together on device onto any sharding, bit for bit.

Two kinds of checks:
  * what orbax is handed per step (in-process, exact): every orbax save / restore call gets at most
    chunk_bytes, however large the largest parameter; this is the mechanism that bounds host memory on
    a GPU machine (orbax copies whatever one save gets to host, in pinned memory; a restore reads what
    one call asks for).
  * the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) in a fresh subprocess, after a
    warm-up save/restore of a small array (imports, XLA compiles of the slice / update helpers,
    orbax's and tensorstore's per-process state: a fixed cost, independent of the model). On CPU the
    "device" arrays are host memory, so a restore's peak includes the restored model itself:
      save    <= 4 chunks + FIXED
      restore <= model + 4 chunks + FIXED
    4 chunks: one part's entries sliced on device, the host copy / read buffers of that part, and
    tensorstore's buffers. FIXED = 96 MB: measured ~70 MB on the 2-core CPU VM, the same for a 80 MB
    and a 272 MB model. The version 1 writer (one orbax call of whole arrays) measured
    restore = model + 260 MB here (2x the model: a whole-array host read buffer next to the device
    copy), over this bound.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from checkpoints import orbax_io  # noqa: E402
from checkpoints.safetensors_io import CheckpointError  # noqa: E402
from kimi_jax.config import preset  # noqa: E402

MB = 1 << 20
CFG = preset("tiny")
FIXED = 96 * MB


HF = CFG.to_hf_dict()


def _flat(tree):
    """(parameter path, array) pairs of a nested or flat dict of arrays."""
    return orbax_io.flat_arrays(tree).items()


def _nest(pairs) -> dict:
    from flax import traverse_util
    return traverse_util.unflatten_dict(dict(pairs))


def _host_arrays(layers: int, width: int, seed: int = 7) -> dict:
    """A stacked expert array [layers, 16, 64, width] uint32 (INT4-word-like bits), a float32 embedding,
    a norm: seeded, so the subprocesses regenerate the same bits."""
    rng = np.random.default_rng(seed)
    return {"moe": {"experts": rng.integers(0, 2**32, (layers, 16, 64, width), dtype=np.uint32),
                    "bias": rng.standard_normal((layers, 16), dtype=np.float32)},
            "embed": rng.standard_normal((1024, width // 2), dtype=np.float32),
            "norm": rng.standard_normal((64,), dtype=np.float32)}


def _put(host: dict, shardings: dict) -> dict:
    return _nest((k, jax.device_put(v, shardings[k])) for k, v in _flat(host))


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _save_shardings(devices) -> dict:
    """The writer's layout: experts split 8 ways along the expert axis (expert parallel)."""
    mesh = Mesh(np.asarray(devices), ("x",))
    return {("moe", "experts"): NamedSharding(mesh, P(None, "x")), ("moe", "bias"): NamedSharding(mesh, P()),
            ("embed",): NamedSharding(mesh, P(None, "x")), ("norm",): NamedSharding(mesh, P())}


def _restore_layouts(devices) -> dict:
    """Readers' layouts, none the writer's (whose entries are [1 layer, 2 experts, ...]), on a 2 x 4 mesh:
    experts split along the expert axis ('a': 8 per shard) and the width ('b'): each entry inside one
    shard, read by the sub-mesh of the devices holding it; the layer axis sharded: likewise; the expert
    axis over both mesh axes (2 per shard): the sub-mesh path cannot express it, so every device whose
    shard an entry meets reads the whole entry; and one device."""
    mesh = Mesh(np.asarray(devices).reshape(2, 4), ("a", "b"))
    base = {("moe", "bias"): NamedSharding(mesh, P("a")), ("embed",): NamedSharding(mesh, P("b", "a")),
            ("norm",): NamedSharding(mesh, P())}
    one = SingleDeviceSharding(devices[3])
    return {
        "experts_x_width": {**base, ("moe", "experts"): NamedSharding(mesh, P(None, "a", None, "b"))},
        "layers": {**base, ("moe", "experts"): NamedSharding(mesh, P("a", None, "b"))},
        "experts_ab": {**base, ("moe", "experts"): NamedSharding(mesh, P(None, ("a", "b")))},
        "one_device": {k: one for k in base} | {("moe", "experts"): one},
    }


def _abstract(host: dict, shardings=None) -> dict:
    """The restore spec of `host`: {parameter path: ShapeDtypeStruct on its sharding}."""
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=(shardings or {}).get(k)) for k, v in _flat(host)}


class _Recorder:
    """Wraps orbax_io._checkpointer: the bytes of every save / restore call."""

    def __init__(self, real):
        self.real, self.saves, self.restores = real, [], []

    def __call__(self, *a, **kw):
        ck, rec = self.real(*a, **kw), self

        class Proxy:
            def save(self, path, args):
                rec.saves.append(sum(v.nbytes for v in jax.tree.leaves(args.item)))
                return ck.save(path, args=args)

            def restore(self, path, args):
                rec.restores.append(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                                        for v in jax.tree.leaves(args.item)))
                return ck.restore(path, args=args)

            def __getattr__(self, name):
                return getattr(ck, name)
        return Proxy()


def test_chunk_plan_tiles_and_respects_shards():
    plan = orbax_io.chunk_plan((4, 16, 64, 1024), 4, 1 * MB)          # 256 KB per expert, 4 per entry
    assert len(plan) == 16 and all(size == (1, 4, 64, 1024) for _, size in plan)
    plan = orbax_io.chunk_plan((4, 16, 64, 1024), 4, 1 * MB, shard_shape=(4, 2, 64, 1024))
    assert len(plan) == 32 and all(size == (1, 2, 64, 1024) for _, size in plan)   # no shard edge crossed
    assert orbax_io.chunk_plan((3, 5), 4, 1 * MB) == [((0, 0), (3, 5))]
    plan = orbax_io.chunk_plan((13, 1000), 4, 12000)                  # prime length: 3 rows + a tail
    assert [s for s, _ in plan] == [(0, 0), (3, 0), (6, 0), (9, 0), (12, 0)] and plan[-1][1] == (1, 1000)


@pytest.mark.slow
def test_split_parameters_restore_bit_for_bit_onto_other_shardings(tmp_path, monkeypatch):
    devices = jax.devices()
    assert len(devices) == 8
    host = _host_arrays(4, 1024)                       # experts 16 MB, 1 MB chunks
    model = _put(host, _save_shardings(devices))
    rec = _Recorder(orbax_io._checkpointer)
    monkeypatch.setattr(orbax_io, "_checkpointer", rec)
    out = str(tmp_path / "ck")
    chunk = 1 * MB
    meta = orbax_io.save(out, model, HF, chunk_bytes=chunk)
    assert meta["version"] == 2 and meta["chunk_bytes"] == chunk
    n_parts = len(meta["parts"])
    assert n_parts == len(rec.saves) and n_parts >= 16 and max(rec.saves) <= chunk
    entries = [e for p in meta["parts"] for e in p["entries"] if e["param"] == "moe.experts"]
    assert len(entries) == 32                          # 4 layers x 8 shards of 2 experts
    assert sorted(os.listdir(os.path.join(out, "state"))) == [p["dir"] for p in meta["parts"]]
    for name, shardings in _restore_layouts(devices).items():
        rec.restores.clear()
        got = orbax_io.restore_params(out, HF, _abstract(host, shardings))
        assert len(rec.restores) == n_parts and max(rec.restores) <= chunk, name
        for k, v in _flat(got):
            ref = host[k[0]] if len(k) == 1 else host[k[0]][k[1]]
            assert v.sharding == shardings[k] and _same_bits(v, ref), (name, k)
    # written with the experts replicated (entries of 4 experts) and read with the expert axis split 8
    # ways over both mesh axes: entries span 2 shards of a two-axis split, which no sub-mesh expresses;
    # the fallback (each device whose shard an entry meets reads it whole) still gives the same bits
    mesh = Mesh(np.asarray(devices), ("x",))
    repl = _put(host, {k: NamedSharding(mesh, P()) for k, _ in _flat(host)})
    out2 = str(tmp_path / "ck2")
    meta2 = orbax_io.save(out2, repl, HF, chunk_bytes=chunk)
    assert {tuple(e["shape"]) for p in meta2["parts"] for e in p["entries"] if e["param"] == "moe.experts"} == {(1, 4, 64, 1024)}
    fits = []
    real_fits = orbax_io._fits
    monkeypatch.setattr(orbax_io, "_fits", lambda *a, **k: fits.append(real_fits(*a, **k)) or fits[-1])
    shardings = _restore_layouts(devices)["experts_ab"]
    got = orbax_io.restore_params(out2, HF, _abstract(host, shardings))
    assert False in fits
    for k, v in _flat(got):
        assert v.sharding == shardings[k] and _same_bits(v, host[k[0]] if len(k) == 1 else host[k[0]][k[1]]), k
    # floating parameters may come back in another float dtype (orbax casts), split ones included
    shardings = _restore_layouts(devices)["experts_x_width"]
    abstract = _abstract(host, shardings)
    abstract[("embed",)] = jax.ShapeDtypeStruct(host["embed"].shape, jnp.bfloat16, sharding=shardings[("embed",)])
    got = orbax_io.restore_params(out, HF, abstract)
    assert got[("embed",)].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got[("embed",)]),
                          np.asarray(jnp.asarray(host["embed"]).astype(jnp.bfloat16)))


@pytest.mark.slow
def test_model_written_under_tp8_with_small_chunks_loads_onto_dp2_tp4_ep(tmp_path):
    """The engine's own model (nnx, stacked layers) through save / load_model with entries everywhere."""
    from flax import nnx

    from kimi_jax.entrypoints.weights import load_model
    from kimi_jax.model.transformer import Transformer, abstract_model, param_arrays
    from kimi_jax.parallel.sharding import Layout, param_shardings

    def shardings(layout):
        return param_shardings(layout, nnx.split(abstract_model(CFG, jnp.float32, layout.moe_parallel()))[1])

    tp8 = Layout(8)
    sh8 = shardings(tp8)
    model = Transformer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(3), parallel=tp8.moe_parallel())
    state = {k: jax.device_put(v, sh8[k]) for k, v in param_arrays(model).items()}
    out = str(tmp_path / "m")
    meta = orbax_io.save(out, state, HF, layout_name="TP8", chunk_bytes=16 << 10)
    assert sum(len(p["entries"]) for p in meta["parts"]) > len(meta["params"])   # some were split
    dp2 = Layout(4, 2, True)
    sh = shardings(dp2)
    got = param_arrays(load_model(out, CFG, dp2, jnp.float32))
    for k, v in state.items():
        assert got[k].sharding == sh[k] and _same_bits(got[k], v), k


def test_version_1_checkpoint_still_restores_and_unknown_version_is_refused(tmp_path):
    import orbax.checkpoint as ocp
    devices = jax.devices()
    host = _host_arrays(2, 256)
    model = _put(host, _save_shardings(devices))
    v2 = str(tmp_path / "v2")
    meta = orbax_io.save(v2, model, HF, chunk_bytes=64 << 10)
    # the version 1 layout: state/ is one orbax PyTree of whole arrays, no parts in the json
    v1 = str(tmp_path / "v1")
    os.makedirs(v1)
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    ck.save(os.path.join(v1, "state"), args=ocp.args.PyTreeSave(model))
    ck.close()
    old = {k: v for k, v in meta.items() if k not in ("parts", "chunk_bytes", "seconds")}
    with open(os.path.join(v1, orbax_io.META_FILE), "w") as f:
        json.dump({**old, "version": 1}, f)
    shardings = _restore_layouts(devices)["experts_x_width"]
    got = orbax_io.restore_params(v1, HF, _abstract(host, shardings))
    for k, v in _flat(got):
        assert _same_bits(v, host[k[0]] if len(k) == 1 else host[k[0]][k[1]]), k
    # a version this code does not know: one line naming the file
    with open(os.path.join(v1, orbax_io.META_FILE), "w") as f:
        json.dump({**old, "version": 3}, f)
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(v1, orbax_io.META_FILE)) +
                       ": metadata version 3, this kimi_jax reads versions 1, 2") as e:
        orbax_io.restore_params(v1, HF, _abstract(host, shardings))
    assert "\n" not in str(e.value)
    # a part gone: named, before anything is restored
    shutil.rmtree(os.path.join(v2, "state", meta["parts"][3]["dir"]))
    with pytest.raises(CheckpointError, match=re.escape(os.path.join(v2, "state", meta["parts"][3]["dir"]))):
        orbax_io.restore_params(v2, HF, _abstract(host, shardings))


# ---- peak host memory, in a fresh process ----------------------------------------------------------
def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _child(mode: str, path: str, chunk: int) -> None:
    """Subprocess body: warm up, then save (or restore onto another layout) and print the peak RSS
    increase over the phase's start as JSON."""
    import gc
    devices = jax.devices()
    warm = {"w": jax.device_put(np.arange(1 << 16, dtype=np.float32).reshape(64, 1024),
                                NamedSharding(Mesh(np.asarray(devices), ("x",)), P(None, "x")))}
    orbax_io.save(path + "_warm", warm, HF, chunk_bytes=16 << 10)
    mesh24 = Mesh(np.asarray(devices).reshape(2, 4), ("a", "b"))
    orbax_io.restore_params(path + "_warm", HF, _abstract({"w": np.asarray(warm["w"])},
                                                         {("w",): NamedSharding(mesh24, P("b", "a"))}))
    shutil.rmtree(path + "_warm")
    host = _host_arrays(8, 8192)                        # experts 256 MB, model 272 MB
    model_bytes = sum(v.nbytes for _, v in _flat(host))
    if mode == "save":
        model = _put(host, _save_shardings(devices))
        jax.block_until_ready(model)
        del host
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    if mode == "save":
        orbax_io.save(path, model, HF, chunk_bytes=chunk)
        ok = True
    else:
        shardings = _restore_layouts(devices)["experts_x_width"]
        got = orbax_io.restore_params(path, HF, _abstract(host, shardings))
        jax.block_until_ready(got)
    peak = _rss("VmHWM") - base
    if mode != "save":
        ok = all(_same_bits(v, host[k[0]] if len(k) == 1 else host[k[0]][k[1]]) for k, v in _flat(got))
    print("RESULT " + json.dumps({"peak": peak, "model": model_bytes, "ok": ok}))


def _run_child(mode: str, path: str, chunk: int) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), mode, path, str(chunk)],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_peak_host_memory_of_save_and_restore_is_bounded(tmp_path):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs)")
    chunk = 16 * MB
    path = str(tmp_path / "big")
    save = _run_child("save", path, chunk)
    restore = _run_child("restore", path, chunk)
    model = save["model"]
    assert restore["ok"] and save["ok"]
    assert save["peak"] <= 4 * chunk + FIXED, (save["peak"] / MB, "MB during save")
    assert restore["peak"] <= model + 4 * chunk + FIXED, (restore["peak"] / MB, "MB during restore",
                                                          model / MB, "MB model")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
