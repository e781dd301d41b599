"""Orbax checkpoints of a model already in the engine's layout, restorable onto any mesh.

A directory written by `save` (and `kimi-convert`) holds:
  state/               the orbax PyTree checkpoint of the nnx state as a pure dict: stacked layers
                       (dense_layers.*, moe_layers.*), INT4 experts packed as the engine keeps them
  kimi_jax_orbax.json  what was written: format, the ModelConfig (HF dict), dtype, a fingerprint of
                       the model (config + every parameter's path and shape), every parameter's
                       shape/dtype, the layout and device count of the writer; written last, so a
                       directory without it is not (yet) a checkpoint
  config.json, tokenizer files  copied from the source checkpoint, so `LLM(dir)` works as for the
                       source (ModelConfig.from_pretrained, Tokenizer.from_pretrained)

`restore_params` checks the checkpoint against the model that `cfg` describes before any device
memory is allocated (a parameter missing, extra, of another shape or of an integer/float dtype
mismatch, or a config field that changes the math: one line naming the parameter or field), then
restores with orbax onto the target shardings (`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`):
any layout, any device count, each process reading only what its devices hold. Floating parameters
may be restored in another dtype than written (orbax casts).
"""
from __future__ import annotations

import hashlib
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

from checkpoints.safetensors_io import CONFIG_FILE, CheckpointError
from kimi_jax.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

META_FILE = "kimi_jax_orbax.json"
STATE_DIR = "state"
FORMAT = "kimi_jax.orbax"
VERSION = 1
# config fields that do not change the model's math (not compared on restore)
_IGNORED_FIELDS = ("architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id",
                   "pad_token_id", "max_position_embeddings")
_TOKENIZER_SKIP = (".safetensors", ".safetensors.index.json", ".py", CONFIG_FILE)

__all__ = ["is_orbax_checkpoint", "check_output", "save", "check_compatible", "restore_params", "load_model", "read_metadata",
           "fingerprint", "META_FILE", "STATE_DIR"]


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


def _math_config(cfg: ModelConfig) -> dict:
    return {k: v for k, v in cfg.to_hf_dict().items() if k not in _IGNORED_FIELDS}


def fingerprint(cfg: ModelConfig, shapes: Mapping[str, Any]) -> str:
    """sha256 of the config fields that change the math and every parameter's path and shape."""
    blob = json.dumps({"config": _math_config(cfg),
                       "params": {k: list(v) for k, v in sorted(shapes.items())}},
                      sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def _pure(model_or_pure):
    from flax import nnx
    if isinstance(model_or_pure, nnx.Module):
        return nnx.to_pure_dict(nnx.split(model_or_pure)[1])
    if isinstance(model_or_pure, nnx.State):
        return nnx.to_pure_dict(model_or_pure)
    return model_or_pure


def _checkpointer(largest_bytes: Optional[int] = None):
    """An orbax PyTree checkpointer. INT4 words and bf16 weights barely compress, so no zstd (it
    would only cost CPU time). With `largest_bytes` (the largest parameter), orbax's limits on bytes
    in flight (device-to-host copies on save, reads on restore) are set to that parameter + 1 GB
    (orbax refuses a single array above its limit). Measured on CPU (out/loading_bench.md), a save
    still held ~0.75x the model in host copies and a restore ~0.5x."""
    import orbax.checkpoint as ocp
    kw = {}
    if largest_bytes:
        gb = int(math.ceil(largest_bytes / 1e9)) + 1
        kw = dict(save_device_host_concurrent_gb=gb, restore_concurrent_gb=gb)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, **kw))


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


def save(path: str, model, cfg: ModelConfig, *, source: Optional[str] = None, overwrite: bool = False,
         layout_name: Optional[str] = None) -> dict:
    """Write the model (an nnx.Module, nnx.State or pure dict of jax.Arrays in the engine layout) as
    an orbax checkpoint at `path`, plus kimi_jax_orbax.json, config.json and (from `source`, a
    checkpoint directory) the tokenizer files. Returns the metadata written (with 'seconds')."""
    path = os.path.abspath(os.fspath(path))
    if check_output(path, overwrite) and jax.process_index() == 0:
        shutil.rmtree(path)
    pure = _pure(model)
    flat = dict(_flat(pure))
    dtypes = {jnp.dtype(v.dtype).name for v in flat.values() if _is_float(v.dtype)}
    t0 = time.perf_counter()
    import orbax.checkpoint as ocp
    ckptr = _checkpointer(max(v.size * jnp.dtype(v.dtype).itemsize for v in flat.values()))
    ckptr.save(os.path.join(path, STATE_DIR), args=ocp.args.PyTreeSave(pure))
    ckptr.close()
    seconds = time.perf_counter() - t0
    shapes = {_key(k): tuple(int(d) for d in v.shape) for k, v in flat.items()}
    meta = {
        "format": FORMAT, "version": VERSION,
        "config": cfg.to_hf_dict(), "model_type": cfg.model_type,
        "dtype": sorted(dtypes - {"float32"})[0] if dtypes - {"float32"} else "float32",
        "fingerprint": fingerprint(cfg, shapes),
        "params": {_key(k): {"shape": list(shapes[_key(k)]), "dtype": jnp.dtype(v.dtype).name}
                   for k, v in flat.items()},
        "bytes": int(sum(v.size * jnp.dtype(v.dtype).itemsize for v in flat.values())),
        "written_by": {"layout": layout_name, "devices": jax.device_count(),
                       "processes": jax.process_count(), "jax": jax.__version__},
        "source": os.path.abspath(source) if source else None,
    }
    if jax.process_index() == 0:
        _write_side_files(path, cfg, source)
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, META_FILE))
    return {**meta, "seconds": seconds}


def _write_side_files(path: str, cfg: ModelConfig, source: Optional[str]) -> None:
    src_cfg = os.path.join(source, CONFIG_FILE) if source else None
    if src_cfg and os.path.isfile(src_cfg):
        shutil.copy2(src_cfg, os.path.join(path, CONFIG_FILE))
    else:
        from checkpoints.synthetic import hf_config_dict
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(hf_config_dict(cfg, "k25" if cfg.model_type == "kimi_k25" else "k2"), f, indent=2)
    if source and os.path.isdir(source):
        for f in sorted(os.listdir(source)):
            src = os.path.join(source, f)
            if (os.path.isfile(src) and not f.endswith(_TOKENIZER_SKIP) and f != META_FILE
                    and not f.startswith("model-")):
                shutil.copy2(src, os.path.join(path, f))


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
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{f}: metadata version {meta.get('version')!r}, this kimi_jax reads {VERSION}")
    for k in ("config", "params", "fingerprint"):
        if k not in meta:
            raise CheckpointError(f"{f}: metadata has no {k!r}")
    return meta


def _stored_arrays(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{param: (shape, dtype)} from orbax's own metadata of the state (not our json)."""
    state = os.path.join(path, STATE_DIR)
    try:
        md = _checkpointer().metadata(state)
        tree = md.item_metadata.tree if hasattr(md, "item_metadata") else md
        tree = getattr(tree, "tree", tree)
        return {_key(k): (tuple(int(d) for d in v.shape), jnp.dtype(v.dtype).name)
                for k, v in _flat(tree)}
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{state}: cannot read the orbax checkpoint's metadata ({first})") from None


def check_compatible(path: str, cfg: ModelConfig, wanted: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict:
    """Refuse (one line, naming the parameter or config field) a checkpoint written for another
    model than `cfg` / `wanted` {param: (shape, dtype)}. Returns the metadata."""
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    where = os.path.join(path, STATE_DIR)
    stored = _stored_arrays(path)
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
    try:
        written = ModelConfig.from_hf_dict(meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{os.path.join(path, META_FILE)}: config ({e})") from None
    a, b = _math_config(written), _math_config(cfg)
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        k = diff[0]
        raise CheckpointError(f"{os.path.join(path, META_FILE)}: config field {k!r} is {a.get(k)!r} in "
                              f"the checkpoint but {b.get(k)!r} in the model config (the checkpoint was "
                              f"written for another model)")
    return meta


def restore_params(path: str, cfg: ModelConfig, abstract_state, shardings) -> dict:
    """Pure dict of jax.Arrays restored from an orbax checkpoint onto `shardings` ({param path:
    Sharding}; each param in the dtype of `abstract_state`, an nnx.State of ShapeDtypeStructs),
    after check_compatible."""
    import orbax.checkpoint as ocp
    from flax import nnx
    path = os.path.abspath(os.fspath(path))
    pure = nnx.to_pure_dict(abstract_state) if isinstance(abstract_state, nnx.State) else abstract_state
    flat = dict(_flat(pure))
    check_compatible(path, cfg, {_key(k): (tuple(v.shape), v.dtype) for k, v in flat.items()})
    targets: dict = {}
    for k, v in flat.items():
        node = targets
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=shardings[k])
    args = ocp.args.PyTreeRestore(item=targets,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(targets))
    ckptr = _checkpointer(max(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for v in flat.values()))
    try:
        out = ckptr.restore(os.path.join(path, STATE_DIR), args=args)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{os.path.join(path, STATE_DIR)}: orbax restore failed ({first})") from None
    finally:
        ckptr.close()
    return out


def load_model(path: str, *, dtype=jnp.bfloat16, cfg: Optional[ModelConfig] = None, shardings=None,
               place=None, parallel=None, progress=None, stats=None):
    """(ModelConfig, Transformer) restored from an orbax checkpoint directory (see restore_params).
    shardings default: the first local device; `place(path, host_array)` (legacy) is applied to each
    restored parameter when given without shardings."""
    from flax import nnx
    from jax.sharding import SingleDeviceSharding
    from kimi_jax.model.transformer import Transformer
    cfg = cfg or ModelConfig.from_pretrained(path)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0), parallel=parallel))
    graphdef, state = nnx.split(abstract)
    legacy = shardings is None and place is not None
    if shardings is None:
        one = SingleDeviceSharding(jax.local_devices()[0])
        shardings = {k: one for k, _ in _flat(nnx.to_pure_dict(state))}
    t0 = time.perf_counter()
    pure = restore_params(path, cfg, state, shardings)
    if legacy:
        for k, v in list(_flat(pure)):
            node = pure
            for part in k[:-1]:
                node = node[part]
            node[k[-1]] = place(k, np.asarray(v))
    if stats is not None:
        stats.bytes_read += int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                                    for _, v in _flat(pure)))
        stats.seconds += time.perf_counter() - t0
        stats.params += sum(1 for _ in _flat(pure))
    nnx.replace_by_pure_dict(state, pure)
    return cfg, nnx.merge(graphdef, state)
