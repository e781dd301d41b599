"""Load a published-layout checkpoint (HF safetensors, optional compressed-tensors INT4 experts) into
the kimi_jax Transformer.

The model's parameter paths mirror the HF names, with layers of one kind stacked:
  model.layers.{i}.REST            -> dense_layers.REST[j]  (i < first_k_dense_replace, j = i)
                                      moe_layers.REST[j]    (j = i - first_k_dense_replace)
  ...mlp.experts.{e}.P.weight        -> moe_layers.mlp.experts.P[j, e]
  ...mlp.experts.{e}.P.weight_packed -> moe_layers.mlp.experts.P_packed[j, e]   (int32, as stored)
  ...mlp.experts.{e}.P.weight_scale  -> moe_layers.mlp.experts.P_scale[j, e]
Floating tensors are cast to the parameter dtype (the router stays float32); INT4 words are kept
packed (the kernels consume them; the XLA path dequantizes on the fly).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints import layout as layout_lib
from checkpoints.safetensors_io import CheckpointError, CheckpointReader
from kimi_jax.config import ModelConfig

log = logging.getLogger(__name__)
_FLOATS = ("float32", "bfloat16", "float16")
_STACKS = {"dense_layers": 0, "moe_layers": 1}


def hf_names_for(path: tuple[str, ...], cfg: ModelConfig, shape: tuple[int, ...]):
    """Yield (index into the parameter, canonical HF tensor name) for one model parameter path."""
    head = path[0]
    if head not in _STACKS:
        yield (), ".".join(("model",) + path if head in ("embed_tokens", "norm") else path)
        return
    first = 0 if head == "dense_layers" else cfg.num_dense_layers
    rest = path[1:]
    if rest[:2] == ("mlp", "experts"):
        proj = rest[2]
        suffix = "weight"
        for s in ("_packed", "_scale"):
            if proj.endswith(s):
                proj, suffix = proj[: -len(s)], "weight" + s
        for j in range(shape[0]):
            for e in range(shape[1]):
                yield (j, e), f"model.layers.{first + j}.mlp.experts.{e}.{proj}.{suffix}"
        return
    for j in range(shape[0]):
        yield (j,), f"model.layers.{first + j}." + ".".join(rest)


def _flat_params(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_params(v, prefix + (str(k),))
        else:
            yield prefix + (str(k),), v


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def load_params(reader: CheckpointReader, cfg: ModelConfig, abstract_state,
                place: Optional[Callable[[tuple[str, ...], np.ndarray], jax.Array]] = None):
    """Read every parameter of `abstract_state` (an nnx.State of ShapeDtypeStructs) from `reader`.

    `place(path, host_array)` puts one parameter on its devices (default: jnp.asarray).
    Returns a pure dict of arrays for nnx.replace_by_pure_dict.
    """
    place = place or (lambda path, a: jnp.asarray(a))
    pure = nnx.to_pure_dict(abstract_state)
    for path, spec in list(_flat_params(pure)):
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        host = np.empty(shape, dtype)
        for idx, name in hf_names_for(path, cfg, shape):
            t = reader.read(name)
            if t.shape != host[idx].shape:
                info = reader.info(name)
                raise CheckpointError(f"{reader.path}/{info.file}: tensor {info.name!r} has shape "
                                      f"{list(t.shape)}, the model expects {list(host[idx].shape)}")
            host[idx] = t.astype(dtype, copy=False)
        _set(pure, path, place(path, host))
    return pure


def expected_for(reader: CheckpointReader, cfg: ModelConfig) -> dict:
    """The tensors cfg needs; floating tensors may be stored in any float dtype (HF writes float32)."""
    exp = dict(layout_lib.expected_tensors(cfg))
    for name, (shape, dtype) in exp.items():
        if dtype in _FLOATS and name in reader and reader.info(name).dtype in _FLOATS:
            exp[name] = (shape, reader.info(name).dtype)
    return exp


def load_model(path: str, *, dtype=jnp.bfloat16, cfg: Optional[ModelConfig] = None, place=None,
               parallel=None):
    """(ModelConfig, Transformer) from a checkpoint directory, every tensor validated first.
    `place(path, host_array)` puts each parameter on its devices; `parallel` as for Transformer."""
    from kimi_jax.model.transformer import Transformer
    cfg = cfg or ModelConfig.from_pretrained(path)
    with CheckpointReader(path) as reader:
        reader.validate(expected_for(reader, cfg))
        abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0), parallel=parallel))
        graphdef, state = nnx.split(abstract)
        pure = load_params(reader, cfg, state, place)
    nnx.replace_by_pure_dict(state, pure)
    return cfg, nnx.merge(graphdef, state)
