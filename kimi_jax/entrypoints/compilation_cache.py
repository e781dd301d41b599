"""The persistent JAX compilation cache: compiled programs written to disk and reused by later runs
(the second start of a model skips XLA compilation).

Where: `enable(path)`'s path, else $KIMI_JAX_CACHE_DIR, else $XDG_CACHE_HOME/kimi_jax/xla
(~/.cache/kimi_jax/xla); 'none' (or '', 'off', '0') turns it off. A cache the user configured
through JAX (jax.config / $JAX_COMPILATION_CACHE_DIR, or jax_enable_compilation_cache=False) is
left as it is. JAX reads this configuration at its first compilation, so `enable` must run before
anything is compiled (LLM calls it when created; the launchers in their start-up).

Every program is cached, however quick to compile (jax_persistent_cache_min_compile_time_secs 0
unless the user set it): on the CPU the small programs are what a start spends its time on.
"""
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
    """Point JAX's persistent compilation cache at resolve(path), unless the user configured one
    (then that one is kept) or it is off. An explicit `path` ('none' included) overrides the
    environment. config: the object to configure (default jax.config). Returns the directory in use
    (None: no cache)."""
    if config is None:
        import jax
        config = jax.config
    cfg = config
    if path is None:
        if not cfg.jax_enable_compilation_cache:
            return None                               # turned off by the user (or an earlier enable)
        if cfg.jax_compilation_cache_dir:
            return cfg.jax_compilation_cache_dir      # the user's own
    where = resolve(path)
    if where is None:
        cfg.update("jax_enable_compilation_cache", False)
        return None
    try:
        os.makedirs(where, exist_ok=True)
    except OSError:
        return None                                   # an unwritable cache directory: run without
    cfg.update("jax_enable_compilation_cache", True)
    cfg.update("jax_compilation_cache_dir", where)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        cfg.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return where
