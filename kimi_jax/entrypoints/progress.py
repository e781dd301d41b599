"""One-line progress on stderr while a model loads and compiles ("loading weights ... 1.2 s",
"compiling step ... 0.8 s", "loading compiled step from the cache ... 0.1 s").

The library reports phases through the `kimi_jax.progress` logger (`phase`), and `enable()` (the
launchers call it) shows them, plus each XLA compilation as JAX reports it (jax.monitoring), on
stderr: on a terminal one status line rewritten in place, otherwise one line per finished phase and
per compilation of at least `min_seconds`. Nothing is shown without `enable()`.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from typing import Iterator

log = logging.getLogger("kimi_jax.progress")
_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

__all__ = ["phase", "enable", "pause", "log"]


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Report `what ...` at the start and `what ... N.N s` when it finishes (not when it fails)."""
    log.info("%s ...", what, extra={"kimi_done": False})
    t0 = time.perf_counter()
    yield
    log.info("%s ... %.1f s", what, time.perf_counter() - t0, extra={"kimi_done": True})


class _StatusLine(logging.Handler):
    """Started phases as a status line (on a terminal, rewritten in place); finished ones as lines
    when they took at least `min_seconds` (phases always), else the status line is cleared."""

    def __init__(self, stream, min_seconds: float):
        super().__init__(logging.INFO)
        self._stream, self.min_seconds = stream, min_seconds
        self.shown = False

    @property
    def stream(self):
        return self._stream or sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        s = self.stream
        tty = bool(getattr(s, "isatty", lambda: False)())
        done = getattr(record, "kimi_done", True)
        worth = getattr(record, "kimi_seconds", self.min_seconds) >= self.min_seconds
        bars = getattr(sys.modules.get("tqdm"), "tqdm", None)
        try:
            if bars is not None and getattr(bars, "_instances", None):    # a progress bar is drawn:
                # lines above it, none in it
                if done and worth:
                    bars.write(msg, file=s)
            elif tty:
                s.write("\r\x1b[K" + (msg + "\n" if done and worth else "" if done else msg))
                self.shown = not done
            elif done and worth:
                s.write(msg + "\n")
            s.flush()
        except Exception:  # noqa: BLE001 - progress never breaks the program
            pass

    def finish(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _name(kw) -> str:
    """'jit(_all_logits)' -> 'all logits'."""
    name = str(kw.get("fun_name", "a program"))
    m = re.fullmatch(r"\w+\((.*)\)", name)
    return (m.group(1) if m else name).strip("_").replace("_", " ")


class _CompileListener:
    """jax.monitoring callbacks: the start and end of each XLA compilation (or load of a compiled
    program from the persistent cache: JAX reports a cache hit inside the same span)."""

    def __init__(self):
        self.hit = False

    def start(self, event: str, value: float, **kw) -> None:
        if event == _COMPILE and log.isEnabledFor(logging.INFO):
            self.hit = False
            log.info("compiling %s ...", _name(kw), extra={"kimi_done": False})

    def event(self, event: str, **kw) -> None:
        if event == _CACHE_HIT:
            self.hit = True

    def end(self, event: str, seconds: float, **kw) -> None:
        if event == _COMPILE and log.isEnabledFor(logging.INFO):
            what = "loading compiled %s from the cache" if self.hit else "compiling %s"
            log.info(
                what + " ... %.1f s",
                _name(kw),
                seconds,
                extra={"kimi_done": True, "kimi_seconds": seconds},
            )
            self.hit = False


def pause() -> None:
    """Stop showing progress (e.g. before text is streamed to the same terminal)."""
    for h in log.handlers:
        if isinstance(h, _StatusLine):
            h.finish()
    log.setLevel(logging.WARNING)


def enable(stream=None, min_seconds: float = 0.5) -> None:
    """Show progress on `stream` (default stderr); idempotent. The status line clears at exit."""
    log.setLevel(logging.INFO)
    if any(isinstance(h, _StatusLine) for h in log.handlers):
        return
    import atexit

    import jax
    handler = _StatusLine(stream, min_seconds)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    listener = _CompileListener()
    jax.monitoring.register_scalar_listener(listener.start)
    jax.monitoring.register_event_listener(listener.event)
    jax.monitoring.register_event_duration_secs_listener(listener.end)
    atexit.register(handler.finish)
