"""Continuous batching over a paged latent cache: the Scheduler plans each pass as a StepPlan
(admission, prefix cache, preemption, the speculation decision), the runner (kimi_jax.engine.runner)
runs it, and the Scheduler books its outputs (`update`); the EngineCore (kimi_jax.engine.core)
drives the two. Who runs and which pages they hold is kimi_jax.engine.admission's.
docs/ARCHITECTURE.md ('One step') describes the passes, overlap, preemption and data parallelism."""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

from kimi_jax.engine.admission import Admission
from kimi_jax.engine.page_pool import chain_hashes
from kimi_jax.engine.args import CacheConfig, SchedulerConfig
from kimi_jax.engine.ragged_planning import RaggedPlanning, needs_host
from kimi_jax.engine.requests import (Request, Row, StepPlan, append_token, prefill_shape,
                                      prompt_entries_left, score_prompt, wants_chunk)
from kimi_jax.engine.shapes import Limits, RaggedShapes, Shapes
from kimi_jax.engine.speculative import propose_drafts


class Scheduler(RaggedPlanning):
    """The policy: `schedule()` returns the iteration's next StepPlan (None: the iteration is done),
    `update(plan, outputs)` books a plan's host outputs and returns the requests that finished. No
    device state: its writes wait in `effects`. measure(decode, verify): two passes' seconds."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, *, vocab_size: int,
                 batch_size: Callable[[int], int], dp: int, exec_plan, tokenizer=None, eos_ids=(),
                 pass_costs: Optional[dict] = None, measure: Optional[Callable] = None):
        self.config, self.cache = config, cache
        self.vocab_size, self.batch_size, self.dp, self.tokenizer = (
            vocab_size,
            batch_size,
            dp,
            tokenizer,
        )
        self.max_logprobs = config.max_logprobs   # the cap on logprobs / prompt_logprobs (-1: none)
        self.page_size, self.max_num_seqs = cache.page_size, config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.prefill_chunk, self.max_prefill_tokens = (
            config.prefill_chunk,
            config.max_prefill_tokens,
        )
        self.eos_ids = frozenset(eos_ids)
        self.ragged = config.step_layout == "ragged"
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "preemptions": 0,
                      "drafted": 0, "accepted": 0, "prefill_passes": 0, "decode_passes": 0,
                      "verify_passes": 0, "ragged_passes": 0, "cost_calibrations": 0,
                      "spec_steps": 0,       # steps that verified drafts (either layout)
                      "overlapped_steps": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}   # tokens, as vLLM counts
        self.admission = adm = Admission(
            num_pages=cache.num_pages,
            page_size=cache.page_size,
            dp=dp,
            max_num_seqs=config.max_num_seqs,
            prefill_chunk=config.prefill_chunk if not self.ragged else (
                config.long_prefill_token_threshold
                or max(1, (config.max_num_batched_tokens or config.max_prefill_tokens) // dp)),
            vocab_size=vocab_size,
            caching=cache.enable_prefix_caching,
            stats=self.stats,
        )
        # the admission's own containers, read by the planning below and by the engine's clients
        self.pool, self.waiting, self.running, self.effects = (
            adm.pool,
            adm.waiting,
            adm.running,
            adm.effects,
        )
        speculative = config.speculative_config
        self.spec = speculative
        self.drafter = speculative.drafter() if speculative else None
        # overlap scheduling; drafts need the tokens on the host, so not with speculation
        self.overlap = bool(config.overlap_scheduling) and speculative is None
        # a ragged step samples this many logits a row (its last token, then each draft)
        self.spec_width = 1 + speculative.num_speculative_tokens if (
            speculative and self.ragged) else 1
        self.shapes = Shapes.for_limits(self.limits(), dp, exec_plan)
        self.ragged_shapes = RaggedShapes.for_limits(self.limits(), dp)
        self.inflight: Optional[StepPlan] = None     # the overlapped decode plan not yet booked
        self._next: Optional[StepPlan] = None        # the ragged plan chained onto it
        self.pass_costs = {} if pass_costs is None else pass_costs
        self.measure = measure
        self._phase, self._verify_plan = 0, None

    def limits(self, max_logprobs: int = 20) -> Limits:
        """The bounds of the workloads planned here (max_logprobs: the runner's)."""
        return Limits(self.max_num_seqs, self.max_model_len, self.page_size, self.prefill_chunk,
                      self.max_prefill_tokens, max_logprobs,
                      self.spec.num_speculative_tokens if self.spec else 0,
                      pages_per_rank=self.pool.per_part, split_decode=self.overlap,
                      step_layout=self.config.step_layout,
                      max_num_batched_tokens=self.config.max_num_batched_tokens)

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self) -> Optional[StepPlan]:
        """The iteration's next pass: a chained decode step while the overlapped batch stays the
        same (`overlap_continues`), else admission and a prefill pass, then a decode and / or a
        verification pass; None ends the iteration (the next call starts another). The ragged
        layout: admission and one ragged step (`_ragged_plan`; with a step in flight, the one
        `overlap_continues` planned)."""
        if self.ragged:
            self._phase ^= 1
            if not self._phase:
                return None
            if self.inflight is not None:
                return self._chain_plan()
            self.admission.admit()
            plan = self._ragged_plan()
            self._phase = int(plan is not None)
            return plan
        while True:
            phase, self._phase = self._phase, self._phase + 1
            if phase == 0:
                if self.inflight is not None:
                    self._phase = 3
                    return self._chain_plan()
                self.admission.admit()
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

    def pop_effects(self) -> list:
        out = list(self.effects)
        self.effects.clear()
        return out

    # ---- requests (kimi_jax.engine.admission) ---------------------------------------------------
    def add(self, req: Request) -> None:
        self.admission.add(req)

    def has_unfinished(self) -> bool:
        return self.admission.has_unfinished()

    def abort(self, request_id: str) -> Optional[Request]:
        return self.admission.abort(request_id)

    def take_stopped(self) -> list[Request]:
        return self.admission.take_stopped()

    def unblock(self) -> Request:
        return self.admission.unblock()

    def _plan(
        self, kind: str, feeds: list[tuple[Request, list[int]]], T: int, overlap: bool = False
    ) -> StepPlan:
        """A plan for rows that feed these tokens at their next positions, padded to T per row."""
        B, batch_rows = self._batch_rows([r for r, _ in feeds])
        P = self.shapes.table(
            kind, max(len(r.pages) for r, _ in feeds), T, not any(r.num_computed for r, _ in feeds)
        )
        rows = tuple(
            Row(
                r, b, tuple(int(t) for t in feed), r.num_computed, tuple(r.pages), len(r.output_ids)
            )
            for (r, feed), b in zip(feeds, batch_rows)
        )
        return StepPlan(kind, rows, B, T, P, overlap=overlap)

    def _prefill_plan(self) -> Optional[StepPlan]:
        """Prompt chunks: at most prefill_chunk tokens of each prompt, max_prefill_tokens in all,
        rows after the first while the pass `Shapes.prefill_fits`."""
        budget, rows, filling = self.max_prefill_tokens, [], set()
        for r in [
            r for r in self.running if wants_chunk(r)
        ]:
            if self._waits_for_prefix(r, filling) or (
                r.pending <= 1 and not prompt_entries_left(r)
            ):
                continue    # (a cached prefix leaving one token: a decode row)
            n = min(r.pending, self.prefill_chunk, budget)
            shape = prefill_shape(rows + [(r, n)], self.page_size)
            if (
                n <= 0
                or rows
                and not self.shapes.prefill_fits(
                    self._batch_rows([q for q, _ in rows] + [r])[0], *shape
                )
            ):
                break
            if r in self.running and self.admission.ensure_pages(
                r, r.num_computed + n, [q for q, _ in rows]
            ):
                rows.append((r, n))
                budget -= n
                self._fills(r, n, filling)
            elif r in self.running and self.admission.alone(r):
                self.admission.stop(r)
        if not rows:
            return None
        T = prefill_shape(rows, self.page_size)[0]
        return self._plan("decode" if T == 1 else "prefill",
                          [(r, r.tokens[r.num_computed:r.num_computed + n]) for r, n in rows], T)

    def _waits_for_prefix(self, r: Request, filling: set) -> bool:
        """Prefix caching: r takes its cached prefix with its first chunk (True: it waits a step for
        a page another row computes), not a row scoring a prompt (no cached logits)."""
        if not (
            self.pool.caching
            and r.prompt_logprobs is None
            and r.num_computed
            == r.num_registered * self.page_size
            == len(r.pages) * self.page_size
        ):
            return False
        self.admission.take_cached_prefix(r)
        nxt = r.num_computed // self.page_size
        return nxt < len(r.page_hashes) and r.page_hashes[nxt] in filling

    def _fills(self, r: Request, n: int, filling: set) -> None:
        """Note the full pages r's chunk of n tokens computes (prefix caching)."""
        if self.pool.caching:
            chain_hashes(r.tokens, self.page_size, r.page_hashes)
            p = self.page_size
            filling.update(r.page_hashes[r.num_computed // p:(r.num_computed + n) // p])

    def _decode_plans(self) -> Optional[StepPlan]:
        """The decode pass of the rows with one token pending; with speculation, when drafts pay,
        the others verify their drafts in one verification pass (kept for the next phase)."""
        ready = []
        for r in [
            r
            for r in self.running
            if r.pending == 1 and r.finish_reason is None and not prompt_entries_left(r)
        ]:
            if r in self.running and self.admission.ensure_pages(r, r.num_computed + 1, ready):
                ready.append(r)
            elif r in self.running and self.admission.alone(r):
                self.admission.stop(r)
        if not ready:
            return None
        drafts = {
            id(r): propose_drafts(r, self.drafter, self.spec, self.max_model_len) for r in ready
        }
        # any drafts worth it: every ready row goes through ONE verification pass (rows without
        # drafts just decode in it), never a decode pass and a verification pass
        speculate = any(drafts.values()) and self._verify_pays(ready, drafts)
        # plain: decode rows outside verification (rows wanting logprobs)
        rows, plain = [], []
        for r in ready:
            d = drafts[id(r)]
            if not speculate:
                r.spec.offer_shadow(len(r.output_ids), d)     # scored once its tokens are known
                plain.append(r)
            elif r.params.logprobs is not None or r.adjust is not None or r.structured is not None:
                plain.append(r)
            else:
                if d and not self.admission.ensure_pages(r, r.num_computed + 1 + len(d), ready):
                    d = []
                rows.append((r, d))
        if rows:
            self._verify_plan = self._plan("verify", [(r, [r.tokens[-1], *d]) for r, d in rows],
                                           self.spec.num_speculative_tokens + 1)
        if not plain:
            return None
        # multi-token bad words are banned by the last output tokens, and a constrained row's mask
        # needs its previous token: under overlap such a batch splits its step, sampling once booked
        overlap = self.overlap
        plan = self._plan(
            "decode", [(r, [r.tokens[r.num_computed]]) for r in plain], 1, overlap=overlap
        )
        if overlap and any(needs_host(r) for r in plain):
            plan = dataclasses.replace(plan, split=True)
        if overlap:
            self.inflight = plan
        return plan

    # ---- overlap scheduling ---------------------------------------------------------------------
    def overlap_continues(self) -> bool:
        """Whether the next decode step can run on the rows in flight before that step is read: none
        of them finished, no other request is running or could be admitted, some row is not certain
        to end with the step in flight, and every page the next step needs is free (no
        preemption). A ragged step in flight: whether `_ragged_chain` plans the next one (kept for
        `_chain_plan`)."""
        if self.inflight.kind == "ragged":
            self._next = self._ragged_chain()
            return self._next is not None
        rows = [row.req for row in self.inflight.rows]
        if len(rows) != len(self.running) or any(r.finish_reason is not None for r in rows):
            return False
        if {id(r) for r in rows} != {id(r) for r in self.running} or self.admission.admissible():
            return False
        live = [r for r in rows if not self._ends_in_flight(r)]
        need = collections.Counter()
        for r in live:
            need[r.rank] += max(0, self.admission.pages_short(r, r.num_computed + 2))
        return bool(live) and all(n <= self.pool.free_in(k) for k, n in need.items())

    def _chain_plan(self) -> StepPlan:
        """The next decode step of the rows in flight, fed their tokens on the device; rows ending
        with the step in flight are padding. The ragged layout: `_ragged_chain`'s plan."""
        f, rows = self.inflight, []
        if f.kind == "ragged":         # planned by overlap_continues
            plan, self._next = self._next or self._ragged_chain(), None
            if plan is not None:
                self.inflight = plan
            return plan
        for row in f.rows:
            r = row.req
            if self._ends_in_flight(r):
                rows.append(dataclasses.replace(row, live=False))
                continue
            need = self.admission.pages_short(r, r.num_computed + 2)
            if need > 0:
                r.pages += self.pool.take(need, r.rank)   # checked free by overlap_continues
            # the step in flight feeds position num_computed, samples output number len(output_ids)
            rows.append(
                Row(r, row.batch_row, (), r.num_computed + 1, tuple(r.pages), len(r.output_ids) + 1)
            )
        P = self.shapes.table("decode", max(len(row.pages) for row in rows if row.live))
        self.inflight = StepPlan("decode", tuple(rows), f.batch, 1, P, chained=True, overlap=True,
                                 split=f.split)
        return self.inflight

    # ---- admission, pages, preemption -----------------------------------------------------------
    def _batch_rows(self, reqs: list[Request]) -> tuple[int, list[int]]:
        """(padded batch B, each request's batch row): in order, each in its data-parallel rank's
        block of B / dp rows (with dp = 1: rows 0, 1, ...)."""
        count = collections.Counter(r.rank for r in reqs)
        B = self.batch_size(self.dp * max(count.values()))
        per, seen, batch_rows = B // self.dp, collections.Counter(), []
        for r in reqs:
            batch_rows.append(r.rank * per + seen[r.rank])
            seen[r.rank] += 1
        return B, batch_rows

    def _fork(self, p: Request) -> None:
        """A samples group's prefill is done: each sample starts from copies of its pages, or, with
        no free slot or pages, waits to prefill alone."""
        self.admission.leave(p)
        src, dst, late = [], [], []
        for c in p.forks:
            if p.prompt_logprobs is not None:
                c.prompt_logprobs = list(p.prompt_logprobs)
            load = sum(q.rank == p.rank for q in self.running)
            got = (
                self.pool.take(len(p.pages), p.rank)
                if len(self.running) < self.max_num_seqs and load < self.admission.seqs_per_rank
                else None
            )
            if got is None:
                late.append(c)
                continue
            src += p.pages
            dst += got
            c.pages, c.num_computed, c.rank = got, p.num_computed, p.rank
            self.admission.enter(c)
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
            self.admission.release(r)
        return finished

    def _book(self, plan: StepPlan, out) -> list[Request]:
        """n tokens of each row are now cached; rows done with their prompt get the sampled token.
        Rows that finished before (overlap: a step ran past their end) are skipped, their token
        discarded."""
        finished = []
        for row in plan.rows:
            r, n, b = row.req, row.n, row.batch_row
            if r.finish_reason is not None:
                continue
            if row.drafts:
                self._book_drafts(r, list(row.tokens[-row.drafts:]), int(out.accepted[b]),
                                  int(out.tokens[b]), finished)
                continue
            prompt_left = len(r.prompt_ids) - r.num_computed
            self.stats["prompt_tokens"] += max(0, min(n, prompt_left))
            if out.prompt_logprob is not None and prompt_entries_left(r):
                score_prompt(r, out, b, r.num_computed, n)
            r.num_computed += n
            self.pool.register_filled(r, self.page_size)
            # a chunk in the middle of a prompt (or of a recompute): no token yet
            if r.pending > 0:
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
            b = row.batch_row
            self._book_drafts(row.req, list(row.tokens[1:]), int(n_acc[b]), int(nxt[b]), finished)
        return finished

    def _book_drafts(self, r: Request, drafts: list[int], a: int, nxt: int,
                     finished: list[Request]) -> None:
        """A verifying row: its first a drafts accepted, then its token nxt."""
        if drafts:
            r.spec.record(len(drafts), a)
        self.stats["drafted"] += len(drafts)
        self.stats["accepted"] += a
        r.num_computed += a + 1          # the last token and the accepted drafts are now cached
        self.pool.register_filled(r, self.page_size)
        for t in [*drafts[:a], nxt]:
            self._append(r, t)
            if r.finish_reason is not None:
                finished.append(r)
                break

    def _ends_in_flight(self, r: Request) -> bool:
        """The step in flight gives r its last token (max_tokens / max_model_len)."""
        return len(r.output_ids) + 1 >= r.max_new

    def _verify_pays(self, ready: list[Request], drafts: dict) -> bool:
        """Verify when A > n (t_verify / t_decode - 1): n ready rows, A their expected accepted
        drafts, the pass costs measured once per batch / page-table bucket (`_pass_costs`)."""
        if not self.spec.adaptive:
            return True
        t_decode, t_verify = self._pass_costs(ready)
        gain = sum(r.spec.expected_accepted(len(drafts[id(r)])) for r in ready)
        return gain > len(ready) * (t_verify / t_decode - 1.0)

    def _pass_costs(self, ready: list[Request]) -> tuple[float, float]:
        """(decode pass seconds, verification pass seconds) at this step's batch and page-table
        bucket, measured on the step's own rows the first time the engine meets the bucket and kept
        in pass_costs (shared by the engine's schedulers), so later runs take the same decisions."""
        key = (
            self._batch_rows(ready)[0],
            self.shapes.table("decode", max(len(r.pages) for r in ready)),
        )
        if key not in self.pass_costs:
            feeds = [(r, [r.tokens[-1]]) for r in ready]
            self.pass_costs[key] = self.measure(
                self._plan("decode", feeds, 1),
                self._plan("verify", feeds, self.spec.num_speculative_tokens + 1),
            )
            self.stats["cost_calibrations"] += 1
        return self.pass_costs[key]

    def _append(self, r: Request, t: int, out=None, b: int = 0) -> None:
        self.stats["generated_tokens"] += 1
        append_token(r, t, out, b, self.tokenizer)
