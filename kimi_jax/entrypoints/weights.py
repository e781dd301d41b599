"""A model's weights placed on their devices under a layout: loaded from a checkpoint, or random."""
from __future__ import annotations

import functools
from typing import Union

import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig
from kimi_jax.parallel.sharding import Layout, check_fits, param_shardings


class Checkpoint:
    """A checkpoint's config.json parsed and checked by checkpoints.preflight; the first load_model
    of `config` reads the weights through the reader that check opened (index, headers parsed)."""

    def __init__(self, path: str, config: ModelConfig, reader=None, config_dict=None):
        self.path, self.config, self._reader, self._fresh = path, config, reader, True
        # config.json as read (its torch_dtype: dtype "auto")
        self.config_dict = config_dict

    def reader_for(self, cfg: ModelConfig):
        """That reader for the first load of `config`; else preflight.check of `cfg` again."""
        from checkpoints import preflight
        if self._fresh and cfg == self.config:
            self._fresh, reader, self._reader = False, self._reader, None
            return reader
        return preflight.check(self.path, cfg)


def read_checkpoint(path: str) -> Checkpoint:
    """Checkpoint directory `path` for load_model, its config.json checked against the weights and
    tokenizer files (what they cannot back is refused in milliseconds, before anything is built)."""
    from checkpoints import preflight
    cfg, raw = ModelConfig.parse_pretrained(path)
    return Checkpoint(path, cfg, preflight.check(path, cfg, config_dict=raw), raw)


def read_checkpoint_config(path: str) -> ModelConfig:
    """read_checkpoint(path).config."""
    return read_checkpoint(path).config


def load_model(path: Union[str, Checkpoint], cfg: ModelConfig, layout: Layout, dtype=jnp.bfloat16,
               *, check: bool = True, **load_kw):
    """The Transformer of checkpoint directory (or read_checkpoint) `path`, `cfg` checked by
    preflight, each parameter read onto its devices under `layout` by checkpoints.loader (load_kw:
    its load_arrays options); check: refuse a layout that does not fit first."""
    from flax import nnx
    from checkpoints import preflight
    from checkpoints.loader import load_arrays
    from kimi_jax.model.transformer import abstract_model
    if isinstance(path, Checkpoint):
        path, reader = path.path, path.reader_for(cfg)
    else:
        reader = preflight.check(path, cfg)
    layout.check_divisible(cfg)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, layout.moe_parallel()))
    if check:
        check_fits(layout, state)
    shardings = param_shardings(layout, state)
    specs = {}
    for p, var in nnx.to_flat_state(state):
        key, v = tuple(str(k) for k in p), var.get_value()
        specs[key] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[key])
    arrays = load_arrays(path, specs, cfg, reader=reader, **load_kw)
    for p, var in nnx.to_flat_state(state):
        var.set_value(arrays[tuple(str(k) for k in p)])
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=None)
def _fill(shape: tuple, dtype, kind: str, sharding):
    """A jitted init of one parameter (one compile per shape, dtype, kind and sharding)."""
    def fill(key):
        if kind == "bits":
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)
        if kind == "scale":
            return jnp.full(shape, 0.005, dtype)
        if kind in ("ones", "zeros"):
            return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(fill, out_shardings=sharding)


def _kind(names: list[str], dtype) -> str:
    """Which model initializer makes a parameter (kimi_jax.model.layers.param, RoutedExperts)."""
    if dtype == jnp.int32:
        return "bits"
    if names[-1].endswith("_scale"):
        return "scale"
    if names[-1] == "e_score_correction_bias":
        return "zeros"
    return "ones" if any("norm" in n for n in names[:-1]) else "normal"


def random_model(cfg: ModelConfig, layout: Layout, dtype, seed: int = 0):
    """A Transformer with random weights of the model's initializers' kinds, made on its devices by
    one jitted init per shape and sharding (BENCHMARKS.md "Full depth on one H200"); checks the fit
    first."""
    from flax import nnx
    from kimi_jax.model.transformer import abstract_model
    graphdef, state = nnx.split(abstract_model(cfg, dtype, layout.moe_parallel(), seed))
    check_fits(layout, state)
    shardings = param_shardings(layout, state)
    key = jax.random.PRNGKey(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        v, names = var.get_value(), [str(p) for p in path]
        fill = _fill(
            tuple(v.shape), jnp.dtype(v.dtype), _kind(names, v.dtype), shardings[tuple(names)]
        )
        var.set_value(fill(jax.random.fold_in(key, i)))
    return nnx.merge(graphdef, state)
