"""The persistent JAX compilation cache; `enable` must run before the first compilation. Every
program is cached however quick to compile (min compile time 0 unless set): small programs dominate
a CPU start."""
from __future__ import annotations

import os
from typing import Optional

ENV = "KIMI_JAX_CACHE_DIR"
OFF = ("none", "", "off", "0", "false")

__all__ = ["ENV", "default_dir", "resolve", "enable"]


def default_dir() -> str:
    """$XDG_CACHE_HOME/kimi_jax/xla, ~/.cache/kimi_jax/xla without XDG_CACHE_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kimi_jax", "xla")


def resolve(path: Optional[str] = None) -> Optional[str]:
    """The cache directory for `path` (None: $KIMI_JAX_CACHE_DIR, else default_dir()); None: off."""
    if path is None:
        path = os.environ.get(ENV)
    if path is None:
        return default_dir()
    if path.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(path))


def enable(path: Optional[str] = None, *, config=None) -> Optional[str]:
    """Point JAX's cache at resolve(path) unless the user configured one through JAX (kept) or it is
    off; an explicit `path` overrides the environment. Returns the directory in use (None: none, or
    unwritable)."""
    if config is None:
        import jax
        config = jax.config
    cfg = config
    if path is None:
        if not cfg.jax_enable_compilation_cache:
            return None
        if cfg.jax_compilation_cache_dir:
            return cfg.jax_compilation_cache_dir
    where = resolve(path)
    if where is None:
        cfg.update("jax_enable_compilation_cache", False)
        return None
    try:
        os.makedirs(where, exist_ok=True)
    except OSError:
        return None
    cfg.update("jax_enable_compilation_cache", True)
    cfg.update("jax_compilation_cache_dir", where)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        cfg.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return where
