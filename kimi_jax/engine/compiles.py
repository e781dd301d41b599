"""A process-wide count of the programs jax builds (jax.monitoring: each jit cache miss lowers one,
even when the persistent compilation cache then serves its executable), for checking that nothing
compiles after start-up. `install()` registers the listener once; `compile_count()` reads it."""
from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_state = {"installed": False, "count": 0}


def _listener(event: str, duration: float, **kw) -> None:
    if event == _EVENT:
        with _lock:
            _state["count"] += 1


def install() -> None:
    """Start counting (idempotent)."""
    with _lock:
        if not _state["installed"]:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _state["installed"] = True


def compile_count() -> int:
    """Programs lowered since `install()`."""
    if not _state["installed"]:
        raise RuntimeError("kimi_jax.engine.compiles.install() was not called")
    return _state["count"]
