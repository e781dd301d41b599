"""Admission: which requests run and which pages they hold (the queues, the page pool and its prefix
cache, ranks, occurrence-pool rows, preemption); the Scheduler plans and books around it."""
from __future__ import annotations

import collections
import time
from typing import Optional

from kimi_jax.engine import penalties
from kimi_jax.engine.page_pool import PagePool, cacheable_hashes
from kimi_jax.engine.requests import Request


class Admission:
    """The requests of one engine core and their pages: dp ranks share the pool in equal parts; at
    most max_num_seqs run. stats: the scheduler's counters; `effects`: device writes for the
    runner."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        dp: int,
        max_num_seqs: int,
        prefill_chunk: int,
        vocab_size: int,
        caching: bool,
        stats: dict,
    ):
        if num_pages < dp:
            raise ValueError(
                f"num_pages={num_pages} gives no page to some of the {dp} data-parallel " "ranks"
            )
        self.page_size, self.dp, self.max_num_seqs = page_size, dp, max_num_seqs
        self.prefill_chunk, self.vocab_size, self.stats = prefill_chunk, vocab_size, stats
        self.pool = PagePool(num_pages - num_pages % dp, dp, caching=caching)
        self.seqs_per_rank = -(-max_num_seqs // dp)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.effects: list = []
        self._free_occ_rows = collections.deque(range(max_num_seqs))   # occurrence-pool rows
        self._stopped: list[Request] = []

    def add(self, req: Request) -> None:
        if req.arrival_time is None:
            req.arrival_time = time.time()
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Optional[Request]:
        """Stop a waiting or running request now ("abort") and free its pages; returns it, or None
        when no unfinished request has that id. Safe with a decode step in flight (its token is
        discarded); call between steps, from the thread that steps."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                break
        else:
            r = next(
                (q for q in self.running if q.request_id == request_id and q.finish_reason is None),
                None,
            )
            if r is None:
                return self._abort_fork(request_id)
        r.finish_reason, r.finished_time = "abort", time.time()
        self.release(r)
        return r

    def _abort_fork(self, request_id: str) -> Optional[Request]:
        """Abort a sample whose prompt is still being prefilled for its group (`prefill_parent`);
        the prefill itself stops with its last sample."""
        for p in [*self.waiting, *self.running]:
            c = (
                next((c for c in p.forks if c.request_id == request_id), None)
                if p.prefill_only
                else None
            )
            if c is None:
                continue
            p.forks.remove(c)
            c.finish_reason, c.finished_time = "abort", time.time()
            if not p.forks:
                self.abort(p.request_id)
            return c
        return None

    def take_stopped(self) -> list[Request]:
        """Requests finished while planning (outgrown their rank's pool), released already."""
        out, self._stopped = self._stopped, []
        return out

    def stop(self, r: Request) -> None:
        """Finish r where it is ("length"), pages freed: it has outgrown its rank's page pool."""
        r.finish_reason, r.finished_time = "length", time.time()
        self.release(r)
        self._stopped.append(r)

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            rank = self.rank_for(self.waiting[0])
            if rank is None:
                break
            r = self.waiting.popleft()
            r.rank = rank
            self.enter(r)

    def enter(self, r: Request) -> None:
        """r joins the running set; with penalties it takes an occurrence-pool row, written from its
        prompt and output so far."""
        self.running.append(r)
        if r.adjust is None or not r.adjust.has_penalties:
            return
        r.occ_row = self._free_occ_rows.popleft()
        self.effects.append(
            (
                "occ",
                r.occ_row,
                penalties.occurrence_row(self.vocab_size, r.prompt_ids, r.output_ids),
            )
        )

    def leave(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.occ_row >= 0:
            self._free_occ_rows.append(r.occ_row)
            r.occ_row = -1

    def take_cached_prefix(self, r: Request) -> None:
        if not r.cache_queried:
            r.cache_queried = True
            self.stats["prefix_cache_queries"] += len(r.tokens)
        self.stats["prefix_cache_hits"] += self.pool.take_cached_prefix(r, self.page_size)

    def rank_for(self, r: Request) -> Optional[int]:
        """The data-parallel rank a waiting request would join: among those with a free slot and the
        pages of its first chunk, the one running fewest requests (then: most free pages); None if
        none."""
        first = -(-min(r.pending, self.prefill_chunk) // self.page_size)
        load = collections.Counter(q.rank for q in self.running)
        fits = [
            k
            for k in range(self.dp)
            if load[k] < self.seqs_per_rank and first <= self.pool.free_in(k)
        ]
        if self.pool.caching and self.dp > 1 and r.num_computed == 0 and len(fits) > 1:
            hashes = cacheable_hashes(r, self.page_size)
            cached = {k: self.pool.peek(hashes, k) for k in fits}
            return min(fits, key=lambda k: (-cached[k], load[k], -self.pool.free_in(k), k))
        return min(fits, key=lambda k: (load[k], -self.pool.free_in(k), k), default=None)

    def ensure_pages(self, r: Request, upto: int, protected=()) -> bool:
        """Pages for positions [0, upto) from r's rank; preempt its newest other request (never one
        in this step's batch) while the pool is dry."""
        need = self.pages_short(r, upto)
        while need > 0:
            got = self.pool.take(need, r.rank)
            if got is not None:
                r.pages += got
                return True
            victims = [
                v for v in self.running if v is not r and v not in protected and v.rank == r.rank
            ]
            if not victims:
                return False
            self.preempt(victims[-1])
        return True

    def alone(self, r: Request) -> bool:
        """No other running request holds pages of r's rank (none will ever be freed for it)."""
        return not any(v is not r and v.rank == r.rank for v in self.running)

    def pages_short(self, r: Request, upto: int) -> int:
        """Pages r lacks to hold positions [0, upto) (<= 0: none)."""
        return -(-upto // self.page_size) - len(r.pages)

    def preempt(self, r: Request) -> None:
        self.leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_computed, r.num_registered, r.cache_queried = [], 0, 0, False
        r.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(r)

    def release(self, r: Request) -> None:
        self.leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_registered = [], 0

    def admissible(self) -> bool:
        """`_admit` would admit a request now."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        return self.rank_for(self.waiting[0]) is not None

    def unblock(self) -> Request:
        """Finish the first running (else waiting) request at the pool's limit; free its pages."""
        self.stop(self.running[0] if self.running else self.waiting.popleft())
        return self._stopped.pop()
