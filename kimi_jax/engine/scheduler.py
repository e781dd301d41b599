"""Continuous batching over a paged latent cache: the Scheduler plans each pass as a StepPlan (admission,
prefix cache, preemption, the speculation decision), the runner (kimi_jax.engine.runner) runs it, and
the Scheduler books its outputs (`update`); BatchEngine drives the two. docs/ARCHITECTURE.md ('One
step') describes the passes, overlap scheduling, preemption and data parallelism."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from kimi_jax.engine import penalties
from kimi_jax.engine.page_pool import PagePool, cacheable_hashes, chain_hashes
from kimi_jax.engine.requests import (Request, Row, StepPlan, append_token, logprob_dict,  # noqa: F401
                                      n_logprobs, prefill_parent, prefill_shape, prompt_entries_left,
                                      prompt_targets, new_request, row_adjust_for, score_prompt, validate_prompt)
from kimi_jax.engine.runner import CLOSE_WINDOW, Limits, Runner  # noqa: F401
from kimi_jax.engine.shapes import Shapes
from kimi_jax.engine.steps import Engine
from kimi_jax.engine.sampling import SamplingParams, key_data_for_seed
from kimi_jax.engine.speculative import SpeculativeConfig, propose_drafts
from kimi_jax.engine.validation import RequestError, check_request  # noqa: F401

_PASSES = {"prefill": "prefill_passes", "decode": "decode_passes", "verify": "verify_passes"}


class Scheduler:
    """Requests, the page pool and the plan of every pass. `schedule()` returns the iteration's next
    StepPlan (prefill chunks, then decode or verification; None when the iteration is done) and
    `update(plan, outputs)` books a plan's host outputs and returns the requests that finished. Device
    writes it needs (occurrence rows, page copies) wait in `effects` for the runner."""
    pallas, absorbed_chunk = False, 0   # decode attention reads each row's length (`Shapes.table`)

    def __init__(self, *, vocab_size: int, batch_size: Callable[[int], int], dp: int, num_pages: int,
                 page_size: int, max_num_seqs: int, max_model_len: int, prefill_chunk: int = 256,
                 max_prefill_tokens: int = 2048, tokenizer=None, eos_ids=(),
                 speculative: Optional[SpeculativeConfig] = None, overlap: bool = False,
                 enable_prefix_caching: bool = False, structured=None, pass_costs: Optional[dict] = None,
                 measure: Optional[Callable] = None, max_logprobs: Optional[int] = None):
        self.vocab_size, self.batch_size, self.dp, self.tokenizer = vocab_size, batch_size, dp, tokenizer
        self.max_logprobs = max_logprobs       # the engine's cap on logprobs / prompt_logprobs (-1: none)
        self.structured = structured
        self.page_size, self.max_num_seqs, self.max_model_len = page_size, max_num_seqs, max_model_len
        self.prefill_chunk, self.max_prefill_tokens = prefill_chunk, max_prefill_tokens
        self.eos_ids = frozenset(eos_ids)
        # data parallelism: equal page partitions per rank; spare pages are dropped
        if num_pages < dp:
            raise ValueError(f"num_pages={num_pages} gives no page to some of the {dp} data-parallel ranks")
        num_pages -= num_pages % dp
        self.slots_per_rank = -(-max_num_seqs // dp)
        self.pool = PagePool(num_pages, dp, caching=enable_prefix_caching)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.spec = speculative
        self.drafter = speculative.drafter() if speculative else None
        # overlap scheduling; drafts need the tokens on the host, so not with speculation
        self.overlap = bool(overlap) and speculative is None
        self.inflight: Optional[StepPlan] = None     # the overlapped decode plan not yet booked
        self.pass_costs = {} if pass_costs is None else pass_costs
        self.measure = measure
        self.effects: list = []
        self._free_slots = collections.deque(range(max_num_seqs))   # occurrence-pool slots (penalties)
        self._phase, self._verify_plan, self._stopped = 0, None, []
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "preemptions": 0,
                      "drafted": 0, "accepted": 0, "prefill_passes": 0, "decode_passes": 0, "verify_passes": 0,
                      "cost_calibrations": 0, "overlapped_steps": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}    # tokens, as vLLM counts them

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                     prompt: Optional[str] = None) -> Request:
        """Validate and build a request; RequestError names what is wrong."""
        r = new_request(request_id, prompt_ids, params, seed, prompt, vocab_size=self.vocab_size,
                        max_model_len=self.max_model_len, page_size=self.page_size,
                        pages_per_rank=self.pool.per_part, dp=self.dp, eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                        max_logprobs=self.max_logprobs)
        if params.structured_outputs is not None:
            r.structured = self._matcher(params, r.max_new)
        return r

    def _matcher(self, params: SamplingParams, budget: Optional[int] = None):
        """The grammar state of a request with structured_outputs (RequestError when it cannot compile)."""
        from kimi_jax.engine.structured import StructuredBackend
        from kimi_jax.engine.structured_params import StructuredOutputError
        try:
            if self.structured is None:
                self.structured = StructuredBackend(self.tokenizer, self.vocab_size)
            return self.structured.matcher(params.structured_outputs, budget)
        except StructuredOutputError as e:
            raise RequestError(str(e)) from None

    def make_samples(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                     prompt: Optional[str] = None) -> list[Request]:
        """The params.num_samples requests of one prompt (n, or best_of), sample i with the seed folded
        with i and request id f"{i}_{request_id}" (one sample: the request itself). See `add_samples`."""
        k = params.num_samples
        if k == 1:
            return [self.make_request(request_id, prompt_ids, params, seed, prompt)]
        reqs = [self.make_request(f"{i}_{request_id}", prompt_ids, params, seed, prompt) for i in range(k)]
        for i, r in enumerate(reqs):
            r.key, r.sample_index, r.group_id = key_data_for_seed(seed, i), i, request_id
        return reqs

    def add_samples(self, reqs: list[Request]) -> None:
        """Queue one prompt's samples: all but its last token is prefilled once (`prefill_parent`), and
        each sample starts from a copy of those pages (`_fork`)."""
        if len(reqs) == 1 or len(reqs[0].prompt_ids) < 2:
            for r in reqs:
                self.add(r)
            return
        self.add(prefill_parent(reqs))

    def add(self, req: Request) -> None:
        if req.arrival_time is None:
            req.arrival_time = time.time()
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Optional[Request]:
        """Stop a waiting or running request now ("abort") and free its pages; returns it, or None when
        no unfinished request has that id. Safe with a decode step in flight (its token is discarded);
        call between steps, from the thread that steps."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                break
        else:
            r = next((q for q in self.running if q.request_id == request_id and q.finish_reason is None), None)
            if r is None:
                return None
        r.finish_reason, r.finished_time = "abort", time.time()
        self._release(r)
        return r

    num_free_pages = property(lambda self: self.pool.num_free)

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self) -> Optional[StepPlan]:
        """The iteration's next pass: a chained decode step while the overlapped batch stays the same
        (`overlap_continues`), else admission and a prefill pass, then a decode and / or a verification
        pass; None ends the iteration (the next call starts another)."""
        while True:
            phase, self._phase = self._phase, self._phase + 1
            if phase == 0:
                if self.inflight is not None:
                    self._phase = 3
                    return self._chain_plan()
                self._admit()
                plan = self._prefill_plan()
            elif phase == 1:
                plan = self._decode_plans()
            elif phase == 2:
                plan, self._verify_plan = self._verify_plan, None
            else:
                self._phase = 0
                return None
            if plan is not None:
                return plan

    def take_stopped(self) -> list[Request]:
        """Requests finished while planning (outgrown their rank's pool), released already."""
        out, self._stopped = self._stopped, []
        return out

    def pop_effects(self) -> list:
        out, self.effects = self.effects, []
        return out

    def _stop(self, r: Request) -> None:
        """Finish r where it is ("length"), its pages freed: it has outgrown the page pool of its rank."""
        r.finish_reason, r.finished_time = "length", time.time()
        self._release(r)
        self._stopped.append(r)

    def _plan(self, kind: str, feeds: list[tuple[Request, list[int]]], T: int, overlap: bool = False) -> StepPlan:
        """A plan for rows that feed these tokens at their next positions, padded to T per row."""
        B, slots = self._slots([r for r, _ in feeds])
        P = self.shapes().table(kind, max(len(r.pages) for r, _ in feeds), T, not any(r.num_computed for r, _ in feeds))
        rows = tuple(Row(r, b, tuple(int(t) for t in feed), r.num_computed, tuple(r.pages), len(r.output_ids))
                     for (r, feed), b in zip(feeds, slots))
        return StepPlan(kind, rows, B, T, P, overlap=overlap)

    def _prefill_plan(self) -> Optional[StepPlan]:
        """Prompt chunks: at most prefill_chunk tokens of each prompt, max_prefill_tokens in all, rows
        after the first while the pass `Shapes.prefill_fits`."""
        budget, rows, filling = self.max_prefill_tokens, [], set()
        for r in [r for r in self.running if r.pending > 1 or (r.pending == 1 and prompt_entries_left(r))]:
            if (self.pool.caching and r.prompt_logprobs is None
                    and r.num_computed == r.num_registered * self.page_size == len(r.pages) * self.page_size):
                # prefix caching: a request takes its cached prefix with its first chunk, or waits a step for a
                # page another row is computing (not one scoring its prompt: cached positions have no logits)
                self._take_cached_prefix(r)
                nxt = r.num_computed // self.page_size
                if nxt < len(r.page_hashes) and r.page_hashes[nxt] in filling:
                    continue
                if r.pending <= 1 and not prompt_entries_left(r):
                    continue
            n = min(r.pending, self.prefill_chunk, budget)
            shape = prefill_shape(rows + [(r, n)], self.page_size)
            if n <= 0 or rows and not self.shapes().prefill_fits(self._slots([q for q, _ in rows] + [r])[0], *shape):
                break
            if r in self.running and self._ensure_pages(r, r.num_computed + n, [q for q, _ in rows]):
                rows.append((r, n))
                budget -= n
                if self.pool.caching:
                    chain_hashes(r.tokens, self.page_size, r.page_hashes)
                    filling.update(r.page_hashes[r.num_computed // self.page_size:(r.num_computed + n) // self.page_size])
            elif r in self.running and self._alone(r):
                self._stop(r)
        if not rows:
            return None
        T = prefill_shape(rows, self.page_size)[0]
        return self._plan("decode" if T == 1 else "prefill",
                          [(r, r.tokens[r.num_computed:r.num_computed + n]) for r, n in rows], T)

    def _decode_plans(self) -> Optional[StepPlan]:
        """The decode pass of the rows with one token pending; with speculation, when drafts pay, the
        others verify their drafts in one verification pass (kept for the next phase)."""
        ready = []
        for r in [r for r in self.running if r.pending == 1 and r.finish_reason is None and not prompt_entries_left(r)]:
            if r in self.running and self._ensure_pages(r, r.num_computed + 1, ready):
                ready.append(r)
            elif r in self.running and self._alone(r):
                self._stop(r)
        if not ready:
            return None
        drafts = {id(r): propose_drafts(r, self.drafter, self.spec, self.max_model_len) for r in ready}
        # any drafts worth it: every ready row goes through ONE verification pass (rows without drafts
        # just decode in it), never a decode pass and a verification pass
        speculate = any(drafts.values()) and self._verify_pays(ready, drafts)
        rows, plain = [], []            # plain: decode rows outside verification (rows wanting logprobs)
        for r in ready:
            d = drafts[id(r)]
            if not speculate:
                r.spec.offer_shadow(len(r.output_ids), d)     # scored once its tokens are known
                plain.append(r)
            elif r.params.logprobs is not None or r.adjust is not None or r.structured is not None:
                plain.append(r)
            else:
                if d and not self._ensure_pages(r, r.num_computed + 1 + len(d), ready):
                    d = []
                rows.append((r, d))
        if rows:
            self._verify_plan = self._plan("verify", [(r, [r.tokens[-1], *d]) for r, d in rows],
                                           self.spec.num_speculative_tokens + 1)
        if not plain:
            return None
        # multi-token bad words are banned by the last output tokens, and a constrained row's mask needs
        # its previous token: the host must have read them
        overlap = self.overlap and not any((r.adjust is not None and r.adjust.bad_words) or r.structured is not None
                                           for r in plain)
        plan = self._plan("decode", [(r, [r.tokens[r.num_computed]]) for r in plain], 1, overlap=overlap)
        if overlap:
            self.inflight = plan
        return plan

    # ---- overlap scheduling ---------------------------------------------------------------------
    def overlap_continues(self) -> bool:
        """Whether the next decode step can run on the rows in flight before that step is read: none of
        them finished, no other request is running or could be admitted, some row is not certain to
        end with the step in flight, and every page the next step needs is free (no preemption)."""
        rows = [row.req for row in self.inflight.rows]
        if len(rows) != len(self.running) or any(r.finish_reason is not None for r in rows):
            return False
        if {id(r) for r in rows} != {id(r) for r in self.running} or self._admissible():
            return False
        live = [r for r in rows if not self._ends_in_flight(r)]
        need = collections.Counter()
        for r in live:
            need[r.rank] += max(0, self._pages_short(r, r.num_computed + 2))
        return bool(live) and all(n <= self.pool.free_in(k) for k, n in need.items())

    def _chain_plan(self) -> StepPlan:
        """The next decode step of the rows in flight, fed their tokens on the device; rows ending with
        the step in flight are padding."""
        f, rows = self.inflight, []
        for row in f.rows:
            r = row.req
            if self._ends_in_flight(r):
                rows.append(dataclasses.replace(row, live=False))
                continue
            need = self._pages_short(r, r.num_computed + 2)
            if need > 0:
                r.pages += self.pool.take(need, r.rank)   # checked free by overlap_continues
            # the step in flight feeds position num_computed and samples output number len(output_ids)
            rows.append(Row(r, row.slot, (), r.num_computed + 1, tuple(r.pages), len(r.output_ids) + 1))
        P = self.shapes().table("decode", max(len(row.pages) for row in rows if row.live))
        self.inflight = StepPlan("decode", tuple(rows), f.batch, 1, P, chained=True, overlap=True)
        return self.inflight

    # ---- admission, pages, preemption -----------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            rank = self._rank_for(self.waiting[0])
            if rank is None:
                break
            r = self.waiting.popleft()
            r.rank = rank
            self._enter(r)

    def _enter(self, r: Request) -> None:
        """r joins the running set; with penalties it takes an occurrence slot, written from its prompt
        and output so far."""
        self.running.append(r)
        if r.adjust is None or not r.adjust.has_penalties:
            return
        r.pen_slot = self._free_slots.popleft()
        self.effects.append(("occ", r.pen_slot, penalties.occurrence_row(self.vocab_size, r.prompt_ids, r.output_ids)))

    def _leave(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.pen_slot >= 0:
            self._free_slots.append(r.pen_slot)
            r.pen_slot = -1

    def _take_cached_prefix(self, r: Request) -> None:
        if not r.cache_queried:
            r.cache_queried = True
            self.stats["prefix_cache_queries"] += len(r.tokens)
        self.stats["prefix_cache_hits"] += self.pool.take_cached_prefix(r, self.page_size)

    def _rank_for(self, r: Request) -> Optional[int]:
        """The data-parallel rank a waiting request would join: among those with a free slot and the
        pages of its first chunk, the one running fewest requests (then: most free pages); None if none."""
        first = -(-min(r.pending, self.prefill_chunk) // self.page_size)
        load = collections.Counter(q.rank for q in self.running)
        fits = [k for k in range(self.dp) if load[k] < self.slots_per_rank and first <= self.pool.free_in(k)]
        if self.pool.caching and self.dp > 1 and r.num_computed == 0 and len(fits) > 1:
            hashes = cacheable_hashes(r, self.page_size)
            cached = {k: self.pool.peek(hashes, k) for k in fits}
            return min(fits, key=lambda k: (-cached[k], load[k], -self.pool.free_in(k), k))
        return min(fits, key=lambda k: (load[k], -self.pool.free_in(k), k), default=None)

    def _ensure_pages(self, r: Request, upto: int, protected=()) -> bool:
        """Pages for positions [0, upto) from r's rank; preempt its newest other request (never one in
        this step's batch) while the pool is dry."""
        need = self._pages_short(r, upto)
        while need > 0:
            got = self.pool.take(need, r.rank)
            if got is not None:
                r.pages += got
                return True
            victims = [v for v in self.running if v is not r and v not in protected and v.rank == r.rank]
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _alone(self, r: Request) -> bool:
        """No other running request holds pages of r's rank (none will ever be freed for it)."""
        return not any(v is not r and v.rank == r.rank for v in self.running)

    def _pages_short(self, r: Request, upto: int) -> int:
        """Pages r lacks to hold positions [0, upto) (<= 0: none)."""
        return -(-upto // self.page_size) - len(r.pages)

    def _preempt(self, r: Request) -> None:
        self._leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_computed, r.num_registered, r.cache_queried = [], 0, 0, False
        r.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(r)

    def _release(self, r: Request) -> None:
        self._leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_registered = [], 0

    def shapes(self) -> Shapes:
        return Shapes.of(self.max_model_len, self.page_size, self.max_prefill_tokens, self.pool.per_part, self.dp,
                         self.pallas, self.absorbed_chunk)

    def _slots(self, reqs: list[Request]) -> tuple[int, list[int]]:
        """(padded batch B, each request's batch row): in order, each in its data-parallel rank's
        block of B / dp rows (with dp = 1: rows 0, 1, ...)."""
        count = collections.Counter(r.rank for r in reqs)
        B = self.batch_size(self.dp * max(count.values()))
        per, seen, slots = B // self.dp, collections.Counter(), []
        for r in reqs:
            slots.append(r.rank * per + seen[r.rank])
            seen[r.rank] += 1
        return B, slots

    def _fork(self, p: Request) -> None:
        """A samples group's prefill is done: each sample starts from copies of its pages, or, with no
        free slot or pages, waits to prefill alone."""
        self._leave(p)
        src, dst, late = [], [], []
        for c in p.forks:
            if p.prompt_logprobs is not None:
                c.prompt_logprobs = list(p.prompt_logprobs)
            load = sum(q.rank == p.rank for q in self.running)
            got = (self.pool.take(len(p.pages), p.rank)
                   if len(self.running) < self.max_num_seqs and load < self.slots_per_rank else None)
            if got is None:
                late.append(c)
                continue
            src += p.pages
            dst += got
            c.pages, c.num_computed, c.rank = got, p.num_computed, p.rank
            self._enter(c)
        if src:
            self.effects.append(("copy", src, dst, p.rank))
        for c in reversed(late):
            self.waiting.appendleft(c)
        self.pool.give(p.pages, p.rank)
        p.pages = []

    # ---- bookkeeping ----------------------------------------------------------------------------
    def update(self, plan: StepPlan, out) -> list[Request]:
        """Book a plan's host outputs (a StepOutput; a verification pass: (accepted [B], next [B]));
        release and return the requests that finished."""
        if plan is self.inflight:
            self.inflight = None
        finished = self._book_verify(plan, *out) if plan.kind == "verify" else self._book(plan, out)
        for r in finished:
            self._release(r)
        return finished

    def _book(self, plan: StepPlan, out) -> list[Request]:
        """n tokens of each row are now cached; rows done with their prompt get the sampled token. Rows
        that finished before (overlap: a step ran past their end) are skipped, their token discarded."""
        finished = []
        for row in plan.rows:
            r, n, b = row.req, row.n, row.slot
            if r.finish_reason is not None:
                continue
            prompt_left = len(r.prompt_ids) - r.num_computed
            self.stats["prompt_tokens"] += max(0, min(n, prompt_left))
            if out.prompt_logprob is not None and prompt_entries_left(r):
                score_prompt(r, out, b, r.num_computed, n)
            r.num_computed += n
            self.pool.register_filled(r, self.page_size)
            if r.pending > 0:      # a chunk in the middle of a prompt (or of a recompute): no token yet
                continue
            if r.prefill_only:
                self._fork(r)
                continue
            self._append(r, int(out.tokens[b]), out, b)
            if r.finish_reason is not None:
                finished.append(r)
        return finished

    def _book_verify(self, plan: StepPlan, n_acc, nxt) -> list[Request]:
        finished = []
        for row in plan.rows:
            r, b, drafts = row.req, row.slot, list(row.tokens[1:])
            a = int(n_acc[b])
            if drafts:
                r.spec.record(len(drafts), a)
            self.stats["drafted"] += len(drafts)
            self.stats["accepted"] += a
            r.num_computed += a + 1          # the last token and the accepted drafts are now cached
            self.pool.register_filled(r, self.page_size)
            for t in [*drafts[:a], int(nxt[b])]:
                self._append(r, t)
                if r.finish_reason is not None:
                    finished.append(r)
                    break
        return finished

    def _ends_in_flight(self, r: Request) -> bool:
        """The step in flight gives r its last token (max_tokens / max_model_len)."""
        return len(r.output_ids) + 1 >= r.max_new

    def _admissible(self) -> bool:
        """`_admit` would admit a request now."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        return self._rank_for(self.waiting[0]) is not None

    def _verify_pays(self, ready: list[Request], drafts: dict) -> bool:
        """Verify when A > n (t_verify / t_decode - 1): n ready rows, A their expected accepted drafts,
        the pass costs measured once per batch / page-table bucket (`_pass_costs`)."""
        if not self.spec.adaptive:
            return True
        t_decode, t_verify = self._pass_costs(ready)
        gain = sum(r.spec.expected_accepted(len(drafts[id(r)])) for r in ready)
        return gain > len(ready) * (t_verify / t_decode - 1.0)

    def _pass_costs(self, ready: list[Request]) -> tuple[float, float]:
        """(decode pass seconds, verification pass seconds) at this step's batch and page-table bucket,
        measured on the step's own rows the first time the engine meets the bucket and kept in
        pass_costs (shared by the engine's schedulers), so later runs take the same decisions."""
        key = (self._slots(ready)[0], self.shapes().table("decode", max(len(r.pages) for r in ready)))
        if key not in self.pass_costs:
            feeds = [(r, [r.tokens[-1]]) for r in ready]
            self.pass_costs[key] = self.measure(self._plan("decode", feeds, 1),
                                                self._plan("verify", feeds, self.spec.num_speculative_tokens + 1))
            self.stats["cost_calibrations"] += 1
        return self.pass_costs[key]

    def _append(self, r: Request, t: int, out=None, b: int = 0) -> None:
        self.stats["generated_tokens"] += 1
        append_token(r, t, out, b, self.tokenizer)

    def _unblock(self) -> Request:
        """Finish the first running (else waiting) request at the pool's limit and free its pages."""
        self._stop(self.running[0] if self.running else self.waiting.popleft())
        return self._stopped.pop()


class BatchEngine(Scheduler):
    """The Scheduler driving a Runner: every `step` is schedule -> run -> update until the iteration's
    plans are done. max_logprobs: the top logprobs one program returns (larger requests compile their own)."""

    def __init__(self, engine: Engine, *, num_pages: int, page_size: int, max_num_seqs: int, max_model_len: int,
                 cache_dtype, max_logprobs: int = 20, fixed_buffers: bool = True, **kw):
        self.engine = engine
        dp = getattr(engine, "dp", 1)
        super().__init__(vocab_size=engine.cfg.vocab_size, batch_size=engine.batch_size, dp=dp,
                         num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, pass_costs=engine.pass_costs, measure=self._measure,
                         max_logprobs=max_logprobs, **kw)
        self.runner = Runner(engine, num_pages=self.pool.num_pages, page_size=page_size, cache_dtype=cache_dtype,
                             max_num_seqs=max_num_seqs, max_logprobs=max_logprobs if max_logprobs is not None and max_logprobs >= 0 else 20,
                             fixed_buffers=fixed_buffers)

    pages = property(lambda self: self.runner.pages, lambda self, v: setattr(self.runner, "pages", v))
    occ = property(lambda self: self.runner.occ)
    _inflight = property(lambda self: self.runner.inflight)
    pallas = property(lambda self: self.engine.plan.pallas)
    absorbed_chunk = property(lambda self: self.engine.plan.absorbed_chunk_tokens)

    def step(self) -> list[Request]:
        """One iteration: its plans run in turn; returns the requests that finished. With overlap
        scheduling a decode step may still be in flight on return (read by the next call)."""
        finished: list[Request] = []
        if self.inflight is not None and not self.overlap_continues():
            finished += self.drain()
        while (plan := self.schedule()) is not None:
            self.runner.apply(self.pop_effects())
            self.stats["steps"] += 1
            self.stats[_PASSES[plan.kind]] += 1
            self.stats["overlapped_steps"] += plan.chained
            for done, out in self.runner.run(plan, self.structured):
                finished += self.update(done, out)
        return finished + self.take_stopped()

    def drain(self) -> list[Request]:
        """Book a decode step still in flight (overlap scheduling); returns the requests that finished."""
        return [r for plan, out in self.runner.drain() for r in self.update(plan, out)]

    def _measure(self, decode: StepPlan, verify: StepPlan) -> tuple[float, float]:
        self.runner.apply(self.pop_effects())
        return self.runner.measure_passes(decode, verify)

    def limits(self) -> Limits:
        """The bounds of this engine's workloads (`Runner.programs`)."""
        return Limits(self.max_num_seqs, self.max_model_len, self.page_size, self.prefill_chunk,
                      self.max_prefill_tokens, self.runner.max_logprobs,
                      self.spec.num_speculative_tokens if self.spec else 0, pages_per_rank=self.pool.per_part)

    def precompile(self, progress: Optional[Callable] = None) -> int:
        """Compile every program this engine can run (`Runner.programs` at `limits()`; the pool is left
        as it is); returns how many."""
        programs = self.runner.programs(self.limits())
        self.runner.precompile(programs, progress)
        return len(programs)

    # ---- driving ------------------------------------------------------------------------------
    def run(self, on_finish: Optional[Callable[[Request], None]] = None, progress: bool = False,
            feed: Optional[Callable[[], bool]] = None) -> None:
        """Step until every request is done. `feed()` is called whenever slots are free so a caller
        can add requests lazily (returns False when it has no more)."""
        t0 = time.perf_counter()
        bar = __import__("tqdm").tqdm(desc="requests", unit="req", total=None) if progress else None
        more = feed is not None
        idle = 0                  # consecutive steps that ran no pass and finished nothing
        while True:
            if more and len(self.waiting) < self.max_num_seqs:
                more = feed()
            if not self.has_unfinished():
                if not more:
                    break
                continue
            steps0 = self.stats["steps"]
            done = self.step()
            idle = 0 if done or self.stats["steps"] != steps0 or self.inflight is not None else idle + 1
            if idle >= 3:         # no request can make progress: the first one ends where it is
                done = [self._unblock()]
                idle = 0
            for r in done:
                if on_finish is not None:
                    on_finish(r)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{self.stats['generated_tokens'] / max(time.perf_counter() - t0, 1e-9):.1f}",
                                    running=len(self.running))
        for r in self.drain():      # a step past every request's end: nothing left to report
            if on_finish is not None:
                on_finish(r)
        if bar is not None:
            bar.close()
