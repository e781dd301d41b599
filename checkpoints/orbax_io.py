"""Orbax checkpoints of a model already in the engine's layout, restorable onto any mesh.

(One file over 600 lines: the writer and the reader share the block layout of large parameters.)

A directory written by `save` (and `kimi-convert`) holds:
  state/               the nnx state as a pure dict (stacked layers: dense_layers.*, moe_layers.*; INT4
                       experts packed as the engine keeps them), written in bounded memory (format
                       version 2): every parameter larger than `chunk_bytes` (default 2 GiB) is cut into
                       entries of at most that size along its leading axes (layers first, then experts,
                       ...), and the entries are grouped into parts of at most `chunk_bytes`, each part
                       its own orbax PyTree checkpoint, state/part-NNNNN/ (orbax keys: the parameter's
                       path + 'cNNNN'). Save and restore go one part at a time, so neither holds more
                       than about one part in host memory (nor, for the slices / the entries being
                       placed, in device memory) whatever the size of the model.
  kimi_jax_orbax.json  what was written: format, version, the model config (HF dict), dtype, a fingerprint
                       of the model (config + every parameter's path and shape), every parameter's
                       shape/dtype, the parts and their entries (parameter, start, shape), the layout
                       and device count of the writer; written last, so a directory without it is not
                       (yet) a checkpoint
  config.json, tokenizer files  copied from the source checkpoint, so `LLM(dir)` works as for the
                       source (ModelConfig.from_pretrained, Tokenizer.from_pretrained)

Version 1 (state/ one orbax PyTree of whole parameters, written before the chunked format) is still
read, whole arrays at a time (host memory up to the largest parameter and more).

`save` takes the arrays ({parameter path: array}, or the nested dict of them) and the model config
as its HF dict (ModelConfig.to_hf_dict()); `restore_params` returns {parameter path: jax.Array} for a
spec {parameter path: ShapeDtypeStruct} it is given. Neither builds a model.

`restore_params` checks the checkpoint against the model that `config` and the spec describe before any device
memory is allocated (a parameter missing, extra, of another shape or of an integer/float dtype
mismatch, or a config field that changes the math: one line naming the parameter or field), then
restores with orbax onto the target shardings (`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`):
any layout, any device count, each process reading only what its devices hold. A parameter stored
in several entries is assembled on device: each entry is restored onto a sharding derived from the
parameter's target sharding (the same spec, an axis the entry does not divide evenly replicated) and
written into the target array in place (a jitted dynamic_update_slice with the target donated), so
device memory holds the model plus one part. Floating parameters may be restored in another dtype
than written (orbax casts).
"""
# Over 600 lines: save and restore of one format, with the checks both directions share.
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import time
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import checksums
from checkpoints.safetensors_io import CONFIG_FILE, CheckpointError

log = logging.getLogger(__name__)

META_FILE = "kimi_jax_orbax.json"
STATE_DIR = "state"
FORMAT = "kimi_jax.orbax"
VERSION = 2                    # 2: chunked entries in parts (state/part-NNNNN); 1: one PyTree of whole arrays
READS = (1, 2)                 # versions restore_params reads
PART_FMT = "part-{:05d}"
# the most bytes of one stored entry and of one part (one orbax save / restore step); host memory of
# a save or restore is about this much (times a small factor: see save), whatever the model's size
DEFAULT_CHUNK_BYTES = 2 << 30
CHUNK_BYTES_ENV = "KIMI_JAX_ORBAX_CHUNK_BYTES"
# config fields that do not change the model's math (not compared on restore)
_IGNORED_FIELDS = ("architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id",
                   "pad_token_id", "max_position_embeddings")
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".py", ".bin", ".pt", ".pth")

__all__ = ["is_orbax_checkpoint", "check_output", "save", "check_compatible", "restore_params", "read_metadata",
           "fingerprint", "chunk_plan", "flat_arrays", "META_FILE", "STATE_DIR", "DEFAULT_CHUNK_BYTES"]


def is_orbax_checkpoint(path) -> bool:
    """Whether `path` is a directory written by `save` (it has kimi_jax_orbax.json)."""
    return os.path.isfile(os.path.join(os.fspath(path), META_FILE))


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flat(v, prefix + (str(k),))
        else:
            yield prefix + (str(k),), v


def _is_float(dtype) -> bool:
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def _key(path) -> str:
    return ".".join(path)


def _math_config(config: Mapping[str, Any]) -> dict:
    return {k: v for k, v in config.items() if k not in _IGNORED_FIELDS}


def fingerprint(config: Mapping[str, Any], shapes: Mapping[str, Any]) -> str:
    """sha256 of the config fields (HF dict) that change the math and every parameter's path and shape."""
    blob = json.dumps({"config": _math_config(config),
                       "params": {k: list(v) for k, v in sorted(shapes.items())}},
                      sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def flat_arrays(arrays: Mapping) -> dict[tuple[str, ...], Any]:
    """{parameter path: array} of a nested dict of arrays (a flat {path tuple: array} is returned as is)."""
    if all(isinstance(k, tuple) for k in arrays):
        return dict(arrays)
    return dict(_flat(arrays))


def _checkpointer(concurrent_bytes: Optional[int] = None):
    """An orbax PyTree checkpointer. INT4 words and bf16 weights barely compress, so no zstd (it
    would only cost CPU time). `concurrent_bytes` (at least the largest single read: orbax waits for
    room before each read) bounds the bytes a restore reads at once. On save, orbax 0.12's device-to-host
    limit (save_device_host_concurrent_gb) does not bind (its default callback transfers every array
    of a save at once), so a save is bounded by what it is given: one part (see `save`)."""
    import orbax.checkpoint as ocp
    kw = {}
    if concurrent_bytes:
        kw = dict(restore_concurrent_gb=(int(concurrent_bytes) + (1 << 20)) / 1e9)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, **kw))


def _default_chunk_bytes() -> int:
    env = os.environ.get(CHUNK_BYTES_ENV)
    if env:
        try:
            n = int(float(env))
        except ValueError:
            raise CheckpointError(f"{CHUNK_BYTES_ENV}={env!r}: not a number of bytes") from None
        if n > 0:
            return n
    return DEFAULT_CHUNK_BYTES


def chunk_plan(shape, itemsize: int, chunk_bytes: int, shard_shape=None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """[(start, size)] tiling an array of `shape` into row-major blocks of at most `chunk_bytes` (one
    block when it fits). The split is along the first axis d whose trailing block (shape[d+1:]) fits:
    one index of every axis before d, and along d a run of rows, preferably a divisor of shape[d] (equal
    entries: one compiled update on restore). With `shard_shape` (of the array's sharding) the run also
    divides the shard's extent along d, so that no block crosses a shard edge: each device then slices
    its part of a block from its own shard. Only an innermost row larger than chunk_bytes makes an
    entry larger than chunk_bytes."""
    shape = tuple(int(n) for n in shape)
    nd = len(shape)
    if nd == 0 or math.prod(shape) * itemsize <= chunk_bytes or 0 in shape:
        return [((0,) * nd, shape)]
    d = 0
    while d < nd - 1 and math.prod(shape[d + 1:]) * itemsize > chunk_bytes:
        d += 1
    row = math.prod(shape[d + 1:]) * itemsize
    n = shape[d]
    w = int(shard_shape[d]) if shard_shape is not None and 0 < int(shard_shape[d]) < n else n
    most = max(1, min(w, chunk_bytes // row))
    block = next(b for b in range(most, 0, -1) if w % b == 0)
    if 2 * block <= most and w == n:            # no divisor near the budget (a prime length): uneven tail
        block = most
    out = []
    for lead in itertools.product(*(range(k) for k in shape[:d])):
        for s in range(0, n, block):
            out.append((tuple(lead) + (s,) + (0,) * (nd - d - 1),
                        (1,) * d + (min(block, n - s),) + shape[d + 1:]))
    return out


# An entry (a block [start, start + size) of a parameter) is moved between the parameter's devices
# and orbax shard by shard, never through an SPMD slice / update of the whole array (with a sharded
# axis and a dynamic offset XLA gathers the whole parameter onto every device). On save the entry is
# put together from slices of the devices' own shards, on restore each device reads its part of the
# entry and writes it into its own shard; both need a sharding of the entry under which every device
# holds what it can slice from / needs for its shard (`_block_sharding`).
Box = tuple  # ((start, stop), ...) per axis


def _box(index, shape) -> Box:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape)) if index else ()


def _meet(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) or not out else None


def _inside(a: Box, b: Box) -> bool:
    return all(y0 <= x0 and x1 <= y1 for (x0, x1), (y0, y1) in zip(a, b))


def _block_sharding(sharding, full_shape, start, size):
    """For a NamedSharding (or one device): a sharding of the block [start, start + size) over the
    sub-mesh of the devices whose shards it touches, under which each of them holds exactly the block's
    part of its own shard; None when the block's edges cut a sharded axis in a way a sub-mesh cannot
    express (then the caller falls back)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
    full_shape, start, size = tuple(full_shape), tuple(start), tuple(size)
    if size == full_shape:
        return sharding
    if len(sharding.device_set) == 1:
        return SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=sharding.memory_kind)
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(full_shape) - len(sharding.spec))
    pick: dict = {name: slice(None) for name in mesh.axis_names}
    for i, (n, a, m) in enumerate(zip(full_shape, start, size)):
        if spec[i] is None or m == n:
            continue
        axes = spec[i] if isinstance(spec[i], tuple) else (spec[i],)
        k = math.prod(mesh.shape[ax] for ax in axes)
        if n % k:
            return None
        w = n // k                                     # shard width along axis i
        if a // w == (a + m - 1) // w:                 # inside one shard: fix the mesh coordinates
            c = a // w
            for ax in reversed(axes):
                pick[ax] = c % mesh.shape[ax]
                c //= mesh.shape[ax]
            spec[i] = None
        elif len(axes) == 1 and a % w == 0 and m % w == 0:   # whole shards: a range of one mesh axis
            pick[axes[0]] = slice(a // w, (a + m) // w)
        else:
            return None
    devices = mesh.devices[tuple(pick[name] for name in mesh.axis_names)]
    keep = [j for j, name in enumerate(mesh.axis_names) if not isinstance(pick[name], int)]
    if not keep:
        one = devices.item() if isinstance(devices, np.ndarray) else devices
        return SingleDeviceSharding(one, memory_kind=sharding.memory_kind)
    kw = {}
    if getattr(mesh, "axis_types", None) is not None:
        kw["axis_types"] = tuple(mesh.axis_types[j] for j in keep)
    sub = Mesh(devices, tuple(mesh.axis_names[j] for j in keep), **kw)
    return NamedSharding(sub, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _parts_needed(sharding, full_shape, start, size) -> dict:
    """{device: (box of the block within the parameter, box within that device's shard)} for every
    device of `sharding` whose shard meets the block."""
    block = tuple((a, a + m) for a, m in zip(start, size))
    out = {}
    for dev, index in sharding.devices_indices_map(tuple(full_shape)).items():
        shard = _box(index, full_shape)
        part = _meet(block, shard)
        if part is not None:
            out[dev] = (part, shard)
    return out


def _fits(sub, full_shape, start, size, need: dict, exact: bool) -> bool:
    """Whether under `sub` (a sharding of the block) every device of `need` holds (exact: exactly)
    its part of the block, and no other device holds anything."""
    if sub is None:
        return False
    got = {dev: _box(index, size) for dev, index in sub.devices_indices_map(tuple(size)).items()}
    if set(got) != set(need):
        return False
    for dev, (part, shard) in need.items():
        rel = tuple((x0 - a, x1 - a) for (x0, x1), a in zip(part, start))
        if (got[dev] != rel) if exact else not _inside(rel, got[dev]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _slicer(size: tuple, sharding=None):
    from jax import lax
    kw = {} if sharding is None else dict(out_shardings=sharding)
    return jax.jit(lambda x, start: lax.dynamic_slice(x, start, size), **kw)


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _updater():
    from jax import lax
    return jax.jit(lambda full, part, start: lax.dynamic_update_slice(full, part, start), donate_argnums=0)


def _local(data, box_in_data: Box):
    """`data` (one device's array) cut to `box_in_data`, on its device."""
    if all(x0 == 0 and x1 == n for (x0, x1), n in zip(box_in_data, data.shape)):
        return data
    return _slicer(tuple(x1 - x0 for x0, x1 in box_in_data))(data, tuple(x0 for x0, _ in box_in_data))


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * jnp.dtype(dtype).itemsize


def _entry_key(i: int) -> str:
    return f"c{i:04d}"


def _nest(flat_items) -> dict:
    """The nested dict of (key tuple, value) pairs (the inverse of `_flat`)."""
    from flax import traverse_util
    return traverse_util.unflatten_dict(dict(flat_items))


# ---- saving -------------------------------------------------------------------------------------
def check_output(path: str, overwrite: bool) -> bool:
    """Refuse an output directory that exists (unless overwrite and it is an earlier kimi_jax orbax
    checkpoint, or empty). Returns whether it exists (and may be replaced)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        return False
    if not overwrite:
        raise CheckpointError(f"{path}: output directory exists (pass overwrite=True / --overwrite)")
    if not os.path.isdir(path) or (os.listdir(path) and not is_orbax_checkpoint(path)):
        raise CheckpointError(f"{path}: refusing to overwrite something that is not a kimi_jax orbax "
                              f"checkpoint (no {META_FILE})")
    return True


def save(path: str, arrays: Mapping, config: Mapping[str, Any], *, source: Optional[str] = None,
         overwrite: bool = False, layout_name: Optional[str] = None, chunk_bytes: Optional[int] = None,
         config_json: Optional[Mapping[str, Any]] = None) -> dict:
    """Write the arrays ({parameter path: jax.Array or numpy array}, or the nested dict of them, in
    the engine layout) of the model whose config is `config` (HF dict) as an orbax checkpoint at
    `path`, plus kimi_jax_orbax.json, config.json (copied from `source`, else `config_json`, else
    `config`) and (from `source`, a checkpoint directory) the tokenizer and template files. Returns
    the metadata written (with 'seconds').

    Bounded memory: parameters above `chunk_bytes` (default: $KIMI_JAX_ORBAX_CHUNK_BYTES, else
    DEFAULT_CHUNK_BYTES = 2 GiB) are cut into entries (`chunk_plan`), and the entries grouped into
    parts of at most `chunk_bytes`, saved one part per orbax save: the entries of one part are sliced
    on device (a copy: at most chunk_bytes more device memory), orbax copies them to host (at most
    chunk_bytes, in pinned memory on GPU) and writes them, then the next part. Host memory is thus a
    few chunk_bytes (the host copy, tensorstore's write buffers), not a multiple of the model."""
    import orbax.checkpoint as ocp
    path = os.path.abspath(os.fspath(path))
    chunk_bytes = int(chunk_bytes or _default_chunk_bytes())
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if check_output(path, overwrite) and jax.process_index() == 0:
        shutil.rmtree(path)
    flat = flat_arrays(arrays)
    paths = {_key(k): k for k in flat}
    dtypes = {jnp.dtype(v.dtype).name for v in flat.values() if _is_float(v.dtype)}
    parts: list[dict] = []
    for k, v in flat.items():
        sharding = getattr(v, "sharding", None)
        plan = chunk_plan(v.shape, jnp.dtype(v.dtype).itemsize, chunk_bytes,
                          sharding.shard_shape(tuple(v.shape)) if sharding is not None else None)
        for i, (start, size) in enumerate(plan):
            nb = _nbytes(size, v.dtype)
            if not parts or (parts[-1]["entries"] and parts[-1]["bytes"] + nb > chunk_bytes):
                parts.append({"dir": PART_FMT.format(len(parts)), "bytes": 0, "entries": []})
            parts[-1]["entries"].append({"param": _key(k), "key": _entry_key(i), "start": list(start),
                                         "shape": list(size)})
            parts[-1]["bytes"] += nb
    state = os.path.join(path, STATE_DIR)
    os.makedirs(state, exist_ok=True)
    t0 = time.perf_counter()
    ckptr = _checkpointer()
    try:
        for part in parts:
            items = [(paths[e["param"]] + (e["key"],), _take(flat[paths[e["param"]]], e["start"], e["shape"]))
                     for e in part["entries"]]
            ckptr.save(os.path.join(state, part["dir"]), args=ocp.args.PyTreeSave(_nest(items)))
            del items
    finally:
        ckptr.close()
    seconds = time.perf_counter() - t0
    shapes = {_key(k): tuple(int(d) for d in v.shape) for k, v in flat.items()}
    meta = {
        "format": FORMAT, "version": VERSION,
        "config": dict(config), "model_type": config.get("model_type"),
        "dtype": sorted(dtypes - {"float32"})[0] if dtypes - {"float32"} else "float32",
        "fingerprint": fingerprint(config, shapes),
        "params": {_key(k): {"shape": list(shapes[_key(k)]), "dtype": jnp.dtype(v.dtype).name}
                   for k, v in flat.items()},
        "bytes": int(sum(v.size * jnp.dtype(v.dtype).itemsize for v in flat.values())),
        "chunk_bytes": chunk_bytes,
        "written_by": {"layout": layout_name, "devices": jax.device_count(),
                       "processes": jax.process_count(), "jax": jax.__version__},
        "source": os.path.abspath(source) if source else None,
        "parts": parts,
    }
    if jax.process_index() == 0:
        meta["checksums"] = checksums.digest_tree(state)
        _write_side_files(path, config_json if config_json is not None else config, source)
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, META_FILE))
    return {**meta, "seconds": seconds}


def _take(v, start, size):
    """The block [start, start + size) of `v` (itself when it is the whole array): a numpy view, or for
    a jax.Array an array put together from slices of the devices' own shards (no communication; an
    SPMD slice onto one device when the block cannot be expressed that way)."""
    start, size = tuple(int(s) for s in start), tuple(int(n) for n in size)
    if size == tuple(v.shape):
        return v
    if isinstance(v, np.ndarray):
        return v[tuple(slice(s, s + n) for s, n in zip(start, size))]
    sub = _block_sharding(v.sharding, v.shape, start, size)
    need = _parts_needed(v.sharding, v.shape, start, size)
    # every device of the sub-mesh must hold exactly the block's part of its own shard
    if not _fits(sub, v.shape, start, size, need, exact=True):
        from jax.sharding import SingleDeviceSharding
        one = SingleDeviceSharding(sorted(v.sharding.device_set, key=lambda d: d.id)[0])
        return _slicer(size, one)(v, start)
    shards = {sh.device: sh for sh in v.addressable_shards}
    pieces = []
    for dev in sub.addressable_devices:
        part, shard = need[dev]
        pieces.append(_local(shards[dev].data, tuple((x0 - s0, x1 - s0) for (x0, x1), (s0, _) in zip(part, shard))))
    return jax.make_array_from_single_device_arrays(size, sub, pieces)


def side_files(source: str) -> list[str]:
    """The files of a checkpoint directory that `save` copies beside the state: config.json, the
    tokenizer and template files and any other small file (everything but the weights, their index
    and code)."""
    out = []
    for f in sorted(os.listdir(source)):
        if not os.path.isfile(os.path.join(source, f)) or f == META_FILE or f.startswith("model-"):
            continue
        if f.endswith(_WEIGHT_SUFFIXES):
            continue
        out.append(f)
    return out


def _write_side_files(path: str, config_json: Mapping[str, Any], source: Optional[str]) -> None:
    copied = side_files(source) if source and os.path.isdir(source) else []
    for f in copied:
        shutil.copy2(os.path.join(source, f), os.path.join(path, f))
    if CONFIG_FILE not in copied:
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(dict(config_json), f, indent=2)


# ---- restoring ----------------------------------------------------------------------------------
def read_metadata(path: str) -> dict:
    """kimi_jax_orbax.json of a checkpoint written by `save` (CheckpointError if absent or invalid)."""
    f = os.path.join(os.fspath(path), META_FILE)
    if not os.path.isfile(f):
        raise CheckpointError(f"{f}: missing (not a kimi_jax orbax checkpoint, or an incomplete one)")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a kimi_jax orbax metadata file (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") not in READS:
        raise CheckpointError(f"{f}: metadata version {meta.get('version')!r}, this kimi_jax reads "
                              f"versions {', '.join(map(str, READS))}")
    for k in ("config", "params", "fingerprint") + (("parts",) if meta["version"] >= 2 else ()):
        if k not in meta:
            raise CheckpointError(f"{f}: metadata has no {k!r}")
    return meta


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _orbax_arrays(ckptr, where: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} from orbax's own metadata of the PyTree checkpoint at `where`."""
    try:
        md = ckptr.metadata(where)
        tree = md.item_metadata.tree if hasattr(md, "item_metadata") else md
        tree = getattr(tree, "tree", tree)
        return {_key(k): (tuple(int(d) for d in v.shape), jnp.dtype(v.dtype).name)
                for k, v in _flat(tree)}
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise CheckpointError(f"{where}: cannot read the orbax checkpoint's metadata ({_first_line(e)})") from None


def _stored_arrays(path: str, meta: Optional[dict] = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """{param: (shape, dtype)} of what is stored, from orbax's own metadata of the state (version 1)
    or of every part, checked against the entries that kimi_jax_orbax.json lists (version 2: each
    entry present with its shape and the parameter's dtype, inside the parameter, and the entries of
    every parameter covering it)."""
    state = os.path.join(path, STATE_DIR)
    ckptr = _checkpointer()
    if meta is None or meta.get("version", 1) == 1:
        return _orbax_arrays(ckptr, state)
    params = meta["params"]
    covered = {k: 0 for k in params}
    for part in meta["parts"]:
        where = os.path.join(state, part["dir"])
        got = _orbax_arrays(ckptr, where)
        for e in part["entries"]:
            name, p = f"{e['param']}.{e['key']}", params.get(e["param"])
            if p is None:
                raise CheckpointError(f"{where}: entry {name!r} belongs to no parameter in {META_FILE}")
            if name not in got:
                raise CheckpointError(f"{where}: entry {name!r} listed in {META_FILE} is not in the part "
                                      f"(an incomplete or altered checkpoint)")
            shape, dtype = got[name]
            inside = len(e["start"]) == len(shape) == len(p["shape"]) and all(
                0 <= s and s + n <= full for s, n, full in zip(e["start"], shape, p["shape"]))
            if shape != tuple(e["shape"]) or dtype != p["dtype"] or not inside:
                raise CheckpointError(f"{where}: entry {name!r} is {dtype}{list(shape)}, but {META_FILE} "
                                      f"says {p['dtype']}{list(e['shape'])} at {list(e['start'])} of "
                                      f"{list(p['shape'])} (an altered checkpoint)")
            covered[e["param"]] += math.prod(shape)
    for k, p in params.items():
        if covered[k] != math.prod(p["shape"]):
            raise CheckpointError(f"{state}: parameter {k!r} {list(p['shape'])}: its entries hold "
                                  f"{covered[k]} of {math.prod(p['shape'])} elements (an incomplete "
                                  f"or altered checkpoint)")
    return {k: (tuple(int(d) for d in p["shape"]), p["dtype"]) for k, p in params.items()}


def check_compatible(path: str, config: Mapping[str, Any],
                     wanted: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict:
    """Refuse (one line, naming the parameter or config field) a checkpoint written for another
    model than `config` (HF dict) / `wanted` {param: (shape, dtype)}. Returns the metadata."""
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    where = os.path.join(path, STATE_DIR)
    stored = _stored_arrays(path, meta)
    problems = []
    for k, (shape, dtype) in wanted.items():
        if k not in stored:
            problems.append(f"{where}: parameter {k!r} (the model needs {jnp.dtype(dtype).name}"
                            f"{list(shape)}) is not in the checkpoint")
            continue
        s_shape, s_dtype = stored[k]
        want = jnp.dtype(dtype)
        # floating parameters may be restored in another float dtype (orbax casts); others exactly
        same_kind = (want == jnp.dtype(s_dtype) or
                     (_is_float(want) and _is_float(s_dtype)))
        if tuple(s_shape) != tuple(shape) or not same_kind:
            problems.append(f"{where}: parameter {k!r} is {s_dtype}{list(s_shape)} in the checkpoint, "
                            f"the model needs {want.name}{list(shape)}")
    for k in stored:
        if k not in wanted:
            problems.append(f"{where}: parameter {k!r} in the checkpoint is not part of the model")
    if problems:
        more = f" [+{len(problems) - 1} more]" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + " (the checkpoint was written for another model)" + more)
    if not isinstance(meta["config"], Mapping):
        raise CheckpointError(f"{os.path.join(path, META_FILE)}: config is not a JSON object")
    a, b = _math_config(meta["config"]), _math_config(config)
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        k = diff[0]
        raise CheckpointError(f"{os.path.join(path, META_FILE)}: config field {k!r} is {a.get(k)!r} in "
                              f"the checkpoint but {b.get(k)!r} in the model config (the checkpoint was "
                              f"written for another model)")
    return meta


def restore_params(path: str, config: Mapping[str, Any], specs: Mapping, *,
                   verify: bool = True) -> dict[tuple[str, ...], jax.Array]:
    """{parameter path: jax.Array} restored from an orbax checkpoint for `specs` ({parameter path:
    ShapeDtypeStruct}: each parameter in its spec's dtype, onto its spec's sharding, None: the first
    local device), after check_compatible against `config` (HF dict). Version 2: one part at a time
    (host memory: about one part; device memory: the model plus one part); version 1: in one orbax
    restore of whole arrays. verify: first compare every file of state/ with its recorded sha256."""
    path = os.path.abspath(os.fspath(path))
    flat = flat_arrays(specs)
    one = _one(jax.local_devices()[0])
    shardings = {k: getattr(v, "sharding", None) or one for k, v in flat.items()}
    meta = check_compatible(path, config, {_key(k): (tuple(v.shape), v.dtype) for k, v in flat.items()})
    if verify and meta["version"] >= 2 and "checksums" in meta:      # recorded by the version 2 writer
        checksums.verify_tree(os.path.join(path, STATE_DIR), meta["checksums"])
    elif verify:
        log.warning("%s: no data checksums recorded; restoring unverified", os.path.join(path, META_FILE))
    if meta["version"] == 1:
        return _restore_whole(path, flat, shardings)
    return _restore_parts(path, meta, flat, shardings)


def _restore_args(targets: dict):
    import orbax.checkpoint as ocp
    return ocp.args.PyTreeRestore(item=targets,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(targets))


def _restore_whole(path: str, flat: dict, shardings) -> dict:
    """Version 1: state/ is one PyTree of whole parameters; orbax's read limit is the largest + 1 GB."""
    targets = _nest((k, jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=shardings[k]))
                    for k, v in flat.items())
    largest = max(_nbytes(v.shape, v.dtype) for v in flat.values())
    ckptr = _checkpointer(int(math.ceil(largest / 1e9) + 1) * 10**9)
    try:
        return dict(_flat(ckptr.restore(os.path.join(path, STATE_DIR), args=_restore_args(targets))))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{os.path.join(path, STATE_DIR)}: orbax restore failed ({_first_line(e)})") from None
    finally:
        ckptr.close()


def _restore_parts(path: str, meta: dict, flat: dict, shardings) -> dict:
    """Version 2: restore part by part. An entry that is a whole parameter lands on its target
    sharding directly. The entries of a split parameter are restored onto `_block_sharding` of the
    target (each device reads the entry's part of its own shard; where the entry's edges do not allow
    that, every device whose shard it meets reads the whole entry) and each device writes its part into
    its own shard buffer (in place); the buffers become the parameter after its last entry."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    paths = {_key(k): k for k in flat}
    stored = meta["params"]
    left = {}
    for part in meta["parts"]:
        for e in part["entries"]:
            left[e["param"]] = left.get(e["param"], 0) + 1
    largest = max(_nbytes(e["shape"], stored[e["param"]]["dtype"]) for part in meta["parts"]
                  for e in part["entries"])
    ckptr = _checkpointer(max(int(meta.get("chunk_bytes") or 0), largest))
    out: dict = {}
    bufs: dict = {}
    state = os.path.join(path, STATE_DIR)
    try:
        for part in meta["parts"]:
            where = os.path.join(state, part["dir"])
            targets, plans = [], {}
            for e in part["entries"]:
                k = paths[e["param"]]
                v, sh = flat[k], shardings[k]
                start, size = tuple(e["start"]), tuple(e["shape"])
                if size == tuple(v.shape):
                    sub = sh
                else:
                    need = _parts_needed(sh, v.shape, start, size)
                    sub = _block_sharding(sh, v.shape, start, size)
                    if not _fits(sub, v.shape, start, size, need, exact=False):
                        devs = sorted(need, key=lambda d: d.id)
                        sub = NamedSharding(Mesh(np.array(devs), ("block",)), PartitionSpec())
                    plans[e["param"], e["key"]] = need
                targets.append((k + (e["key"],), jax.ShapeDtypeStruct(size, v.dtype, sharding=sub)))
            try:
                got = dict(_flat(ckptr.restore(where, args=_restore_args(_nest(targets)))))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{where}: orbax restore failed ({_first_line(e)})") from None
            for e in part["entries"]:
                k = paths[e["param"]]
                arr = got.pop(k + (e["key"],))
                if (e["param"], e["key"]) not in plans:
                    out[k] = arr
                    continue
                v, sh, start = flat[k], shardings[k], tuple(e["start"])
                need = plans[e["param"], e["key"]]
                mine = bufs.setdefault(k, {})
                for piece in arr.addressable_shards:
                    part_box, shard = need[piece.device]
                    held = _box(piece.index, arr.shape)      # relative to the entry
                    data = _local(piece.data, tuple((x0 - a - h0, x1 - a - h0) for (x0, x1), a, (h0, _)
                                                    in zip(part_box, start, held)))
                    if piece.device not in mine:
                        mine[piece.device] = _zeros(tuple(x1 - x0 for x0, x1 in shard), jnp.dtype(v.dtype),
                                                    _one(piece.device))()
                    mine[piece.device] = _updater()(mine[piece.device], data,
                                                    tuple(x0 - s0 for (x0, _), (s0, _) in zip(part_box, shard)))
                del arr
                left[e["param"]] -= 1
                if left[e["param"]] == 0:
                    arrays = bufs.pop(k)
                    out[k] = jax.make_array_from_single_device_arrays(
                        tuple(v.shape), sh, [arrays[d] for d in sh.addressable_devices])
            del got
    finally:
        ckptr.close()
    return {k: out[k] for k in flat}


def _one(device):
    from jax.sharding import SingleDeviceSharding
    return SingleDeviceSharding(device)
