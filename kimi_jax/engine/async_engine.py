"""AsyncLLM: an engine core behind an asyncio API (for the OpenAI server).

One engine thread owns the EngineCore: between steps it adds the requests handed over and carries
out aborts, runs one `step`, and hands each sample's new tokens to its asyncio queue, all of a
step's deltas in ONE `loop.call_soon_threadsafe` callback; idle, it sleeps on a condition variable.
Requests are validated on the caller's thread (`EngineCore.make_request`), so a bad one raises at
once; a request is one prompt's samples; `max_queue` bounds the samples waiting for a slot
(QueueFull).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import AsyncIterator, Optional

from kimi_jax.engine.core import EngineCore
from kimi_jax.engine.requests import Request
from kimi_jax.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than max_queue allows; retry later."""


class EngineDead(RuntimeError):
    """The engine thread stopped (an error in a step, or shutdown); no request can be served."""


@dataclasses.dataclass
class Delta:
    """New output of one request since its previous delta."""
    request_id: str
    token_ids: list[int]
    logprobs: list                         # one entry per token when the request asked for logprobs
    finished: bool = False
    request: Optional[Request] = None      # the finished request (set with finished=True)
    # the engine failed or shut down before the request finished
    error: Optional[str] = None


@dataclasses.dataclass
class _Tracked:
    req: Request
    queue: asyncio.Queue
    sent: int = 0


class AsyncLLM:
    """Serves an EngineCore from a background thread. `start()` from inside a running event loop;
    `generate` streams a sample's Deltas."""

    def __init__(self, core: EngineCore, *, max_queue: Optional[int] = None):
        self.core = core
        self.max_queue = max_queue
        self._cv = threading.Condition()
        self._inbox: collections.deque[list[_Tracked]] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[BaseException] = None
        # handed over, not yet admitted by the engine thread
        self._n_pending = 0
        self._n_open = 0                           # handed over and not finished (under _cv)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kimi-jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still unfinished get an error delta."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ---- load (read from any thread; lengths are atomic reads) ----------------------------------
    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting) + self._n_pending

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of cache pages in use (0..1)."""
        pool = self.core.scheduler.pool
        return (pool.num_pages - pool.num_free) / pool.num_pages

    # ---- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     seed: Optional[int] = None, prompt: Optional[str] = None) -> list[Request]:
        """One prompt's validated samples (`EngineCore.make_request`; RequestError names what is
        wrong); the seed is params.seed, else `seed`, else drawn from the core's stream."""
        return self.core.make_request(request_id, prompt_ids, params, seed=seed, prompt=prompt)

    def submit(
        self, samples: list[Request], queue: Optional[asyncio.Queue] = None
    ) -> asyncio.Queue:
        """Hand one prompt's samples to the engine thread; their Deltas arrive on `queue` (a new one
        when None; several requests may share one), which is returned. Raises QueueFull when
        max_queue samples are already waiting, EngineDead when the engine stopped."""
        if not self.alive:
            raise EngineDead(
                f"the engine is not running{': ' + repr(self.error) if self.error else ''}"
            )
        now = time.time()
        queue = queue if queue is not None else asyncio.Queue()
        tracked = []
        for r in samples:
            r.arrival_time = now
            tracked.append(_Tracked(r, queue))
        with self._cv:
            # waiting for a slot: the open samples beyond max_num_seqs (those just handed over too)
            waiting = self._n_open - self.core.scheduler.max_num_seqs
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(
                    f"{waiting} requests are waiting for a slot (max_queue={self.max_queue})"
                )
            self._n_open += len(tracked)
            self._n_pending += len(tracked)
            self._inbox.append(tracked)
            self._cv.notify()
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages before the engine's next step (none once finished)."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    async def generate(self, samples: list[Request]) -> AsyncIterator[Delta]:
        """Submit one prompt's samples and stream their Deltas until each has finished. Aborts the
        unfinished ones if the consumer stops early (or is cancelled)."""
        queue = self.submit(samples)
        left = {r.request_id for r in samples}
        try:
            while left:
                delta = await queue.get()
                if delta.finished or delta.error is not None:
                    left.discard(delta.request_id)
                yield delta
        finally:
            for rid in left:
                self.abort(rid)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        be = self.core
        try:
            while True:
                if not be.has_unfinished():
                    # a decode step past every request's end (outside the lock)
                    be.drain()
                with self._cv:
                    while not (self._stop or self._inbox or self._aborts or be.has_unfinished()):
                        self._cv.wait()
                    if self._stop:
                        break
                    new, self._inbox = list(self._inbox), collections.deque()
                    aborts, self._aborts = list(self._aborts), collections.deque()
                    for tracked in new:
                        for t in tracked:
                            self._tracked[t.req.request_id] = t
                        be.add([t.req for t in tracked])
                        self._n_pending -= len(tracked)
                out, closed = [], 0
                for rid in aborts:
                    r = be.abort(rid)
                    t = self._tracked.pop(rid, None)
                    if t is not None:
                        closed += 1
                        if r is not None:
                            out.append((t.queue, Delta(rid, [], [], finished=True, request=r)))
                finished = be.step() if be.has_unfinished() else []
                deltas = self._deltas(finished)
                out += deltas
                closed += sum(1 for _, d in deltas if d.finished)
                if closed:
                    with self._cv:
                        self._n_open -= closed
                if out:
                    self._loop.call_soon_threadsafe(_deliver, out)
        except BaseException as e:          # a failed step: every request gets the error
            log.exception("engine thread failed")
            self.error = e
        finally:
            self._stop = True
            self._fail_all(
                "the engine stopped" if self.error is None else f"engine error: {self.error!r}"
            )

    def _deltas(self, finished: list[Request]) -> list:
        out = []
        done = {id(r) for r in finished}
        for rid, t in list(self._tracked.items()):
            r = t.req
            n = len(r.output_ids)
            fin = id(r) in done
            if n > t.sent or fin:
                lps = r.logprobs[t.sent:n] if r.params.logprobs is not None else []
                out.append((t.queue, Delta(rid, r.output_ids[t.sent:n], lps, finished=fin,
                                           request=r if fin else None)))
                t.sent = n
            if fin:
                del self._tracked[rid]
        return out

    def _fail_all(self, message: str) -> None:
        with self._cv:
            pending = [t for tracked in self._inbox for t in tracked] + list(self._tracked.values())
            self._inbox.clear()
            self._tracked.clear()
            self._n_pending = self._n_open = 0
        out = [(t.queue, Delta(t.req.request_id, [], [], error=message)) for t in pending]
        if out and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_deliver, out)
            except RuntimeError:            # the loop closed meanwhile
                pass


def _deliver(out) -> None:
    for queue, delta in out:
        queue.put_nowait(delta)
