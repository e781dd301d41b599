"""The ragged layout's planning (mixed into the Scheduler, kimi_jax.engine.scheduler): one step an
iteration over a flat token axis, every decode row first (with speculation, its drafts beside it),
then prompt chunks, within the token budget; under overlap the next step planned while one runs.
docs/ARCHITECTURE.md ('One step') describes the layout."""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from kimi_jax.engine.requests import (Request, Row, StepPlan, prompt_entries_left,
                                      samples_with_extras, wants_chunk)
from kimi_jax.engine.speculative import propose_drafts


class RaggedPlanning:
    """The Scheduler's ragged plans: `_ragged_plan` (an iteration's step), `_ragged_chain` (the
    step planned while one is in flight), `_ragged_layout` (rows -> a 'ragged' StepPlan) and the
    speculation decision in it (`_ragged_drafts`). Reads the Scheduler's state (running, admission,
    ragged_shapes, spec, drafter, pass_costs, measure, stats, overlap, inflight)."""

    def _ragged_plan(self) -> Optional[StepPlan]:
        """One ragged step within the token budget, in vLLM v1's order: every running request with
        one token pending (a decode row), then prompt chunks in running order (partial prompts
        before newly admitted ones), each at most long_prefill_token_threshold tokens (0: the
        budget); each data-parallel rank's rows within its share of the budget. Pages, preemption
        and the prefix cache as the padded passes."""
        shapes, adm = self.ragged_shapes, self.admission
        left = [shapes.rank_tokens] * self.dp
        cap = self._chunk_cap()
        rows: list[tuple[Request, int]] = []

        def take(r: Request, n: int) -> bool:
            if adm.ensure_pages(r, r.num_computed + n, [q for q, _ in rows]):
                rows.append((r, n))
                left[r.rank] -= n
                return True
            if r in self.running and adm.alone(r):
                adm.stop(r)
            return False

        for r in [r for r in self.running if r.pending == 1 and r.finish_reason is None
                  and not prompt_entries_left(r)]:
            if r in self.running and left[r.rank] >= 1:
                take(r, 1)
        drafts = self._ragged_drafts(rows, left) if self.spec else {}
        filling: set = set()
        for r in [r for r in self.running if wants_chunk(r)]:
            if r not in self.running or left[r.rank] < 1 or self._waits_for_prefix(r, filling):
                continue
            n = min(r.pending, cap, left[r.rank])
            if take(r, n):
                self._fills(r, n, filling)
        if not rows:
            return None
        plan = self._ragged_layout(rows, drafts=drafts)
        # overlap: a step none of whose rows scores its prompt is dispatched without waiting; the
        # next one is planned while it runs (split when a row needs its last token on the host)
        if self.overlap and self._overlaps([r for r, _ in rows]):
            plan = self.inflight = dataclasses.replace(plan, overlap=True,
                                                       split=_splits(r for r, _ in rows))
        return plan

    def _ragged_drafts(self, rows: list[tuple[Request, int]], left: list[int]) -> dict:
        """Speculation in a ragged step: the decode rows taken so far (rows, one token each) verify
        their drafts in it when drafts pay (`_ragged_verify_pays`) and no running request samples
        with extras (logprobs, logits adjustments, a grammar: their sampling half reads one token a
        row); each such row then feeds its last token and its drafts within its rank's token
        budget. -> id(request) -> its drafts (rows extended in place, left charged)."""
        if any(samples_with_extras(r) for r in self.running):
            return {}
        proposed = {id(r): propose_drafts(r, self.drafter, self.spec, self.max_model_len)
                    for r, _ in rows}
        if not any(proposed.values()) or not self._ragged_verify_pays(rows, proposed):
            for r, _ in rows:
                r.spec.offer_shadow(len(r.output_ids), proposed[id(r)])
            return {}
        out = {}
        for i, (r, _) in enumerate(rows):
            d = proposed[id(r)][:max(0, left[r.rank])]
            if d and self.admission.ensure_pages(r, r.num_computed + 1 + len(d),
                                                 [q for q, _ in rows]):
                rows[i] = (r, 1 + len(d))
                left[r.rank] -= len(d)
                out[id(r)] = d
        return out

    def _ragged_verify_pays(self, rows: list[tuple[Request, int]], proposed: dict) -> bool:
        """Verify when A > n (t1 / t0 - 1), as `_verify_pays`: t0 and t1 the ragged step of these
        decode rows at the step's width without and with the drafts, measured once per pair of
        widths and kept in pass_costs. The width counts the prompt chunks that would follow (each
        running prompt's next chunk, within the rank's budget): when the drafts leave it as it is
        (a step already wide with prompt tokens, or drafts within the width's padding), they are
        free."""
        if not self.spec.adaptive:
            return True
        reqs, shapes, cap = [r for r, _ in rows], self.ragged_shapes, self._chunk_cap()
        base, drafts = collections.Counter(), collections.Counter()
        for r, n in rows:
            base[r.rank] += n
            drafts[r.rank] += len(proposed[id(r)])
        taken = {id(r) for r in reqs}
        prompts = [r for r in self.running if id(r) not in taken and wants_chunk(r)]
        for r in prompts:
            base[r.rank] += min(r.pending, cap)
        scores = any(prompt_entries_left(r) for r in prompts)
        width = [shapes.tokens(max(min(shapes.rank_tokens, base[k] + extra[k]) for k in base),
                               scores) for extra in (collections.Counter(), drafts)]
        if width[0] == width[1]:
            return True
        plan0, plan1 = (self._ragged_layout(rows, width=w) for w in width)
        key = ("ragged", *width)
        if key not in self.pass_costs:
            self.pass_costs[key] = self.measure(plan0, plan1)
            self.stats["cost_calibrations"] += 1
        t0, t1 = self.pass_costs[key]
        gain = sum(r.spec.expected_accepted(len(proposed[id(r)])) for r in reqs)
        return gain > len(reqs) * (t1 / t0 - 1.0)

    def _chunk_cap(self) -> int:
        """The most tokens of one prompt a ragged step takes (long_prefill_token_threshold; 0:
        the rank's budget)."""
        return self.config.long_prefill_token_threshold or self.ragged_shapes.rank_tokens

    @staticmethod
    def _overlaps(reqs) -> bool:
        return not any(prompt_entries_left(r) for r in reqs)

    def _ragged_chain(self) -> Optional[StepPlan]:
        """The next ragged step planned while the one in flight runs (None: it must be read
        first): its rows that sample a token and do not end with it decode that token (fed on the
        device), then the other running requests as `_ragged_plan` takes them (decode rows, then
        prompt chunks; an in-flight chunk's request continues after it). None when a row scores
        its prompt, or pages run out but for requests in flight (no preemption of a request in
        flight). Split (its sampling half dispatched once the step in flight is booked) when a
        row needs its last token on the host: a grammar's mask, multi-token bad words."""
        f, shapes, adm = self.inflight, self.ragged_shapes, self.admission
        adm.admit()
        flight = {id(row.req): row for row in f.live}
        left = [shapes.rank_tokens] * self.dp
        cap = self._chunk_cap()
        rows, at = [], {}
        protected = [row.req for row in f.live]

        def take(r: Request, start: int, n: int) -> bool:
            if not adm.ensure_pages(r, start + n, protected + [q for q, _ in rows]):
                return False
            rows.append((r, n))
            left[r.rank] -= n
            return True

        live = [r for r in self.running if r.finish_reason is None]
        if not self._overlaps(live):
            return None
        for r in live:
            row = flight.get(id(r))
            if row is None or r.prefill_only or row.start + row.n < _known(r):
                continue                      # (not sampling in flight)
            if row.step + 1 >= r.max_new or left[r.rank] < 1:
                continue                      # ends with the step in flight
            at[id(r)] = (row.start + row.n, row.step + 1, True)
            if not take(r, row.start + row.n, 1):
                return None
        for r in live:
            if r not in self.running:
                continue                      # (preempted for a row taken above)
            if id(r) not in flight and r.pending == 1 and not prompt_entries_left(r):
                if left[r.rank] >= 1 and not take(r, r.num_computed, 1):
                    return None
        filling: set = set()
        for r in live:
            row = flight.get(id(r))
            if r not in self.running or row is None and (
                    r.pending <= 1 or self._waits_for_prefix(r, filling)):
                continue                      # (preempted, or a decode row taken above)
            start = r.num_computed if row is None else row.start + row.n
            if start >= _known(r) or left[r.rank] < 1:
                continue                      # (sampling in flight: taken above)
            n = min(_known(r) - start, cap, left[r.rank])
            at[id(r)] = (start, len(r.output_ids), False)
            if not take(r, start, n):
                return None
            if row is None:
                self._fills(r, n, filling)
        if not rows:
            return None
        plan = self._ragged_layout(rows, at)
        return dataclasses.replace(plan, chained=True, overlap=True,
                                   split=_splits(r for r, _ in rows))

    def _ragged_layout(self, rows: list[tuple[Request, int]], at: Optional[dict] = None,
                       drafts: Optional[dict] = None, width: Optional[int] = None) -> StepPlan:
        """The plan of a ragged step's rows: each rank's rows in its block of B / dp batch rows (in
        the order taken), T from the busiest rank's tokens (or width). at: id(request) -> (its
        first position, its step, fed by the step in flight: no tokens) where not its
        num_computed's; drafts: id(request) -> the drafts its row feeds after its last token."""
        shapes, drafts = self.ragged_shapes, drafts or {}
        tokens = collections.Counter()
        for r, n in rows:
            tokens[r.rank] += n
        T = width or shapes.tokens(max(tokens.values()),
                                   any(prompt_entries_left(r) for r, _ in rows))
        B = shapes.rows(T)
        per, seen, out = B // self.dp, collections.Counter(), []
        for r, n in sorted(rows, key=lambda q: q[0].rank):
            start, step, fed = (at or {}).get(id(r), (r.num_computed, len(r.output_ids), False))
            d = drafts.get(id(r), [])
            feed = () if fed else tuple(int(t) for t in r.tokens[start:start + n - len(d)] + d)
            out.append(Row(r, r.rank * per + seen[r.rank], feed, start, tuple(r.pages), step,
                           drafts=len(d)))
            seen[r.rank] += 1
        return StepPlan("ragged", tuple(out), B, T, shapes.pages(T))


def _splits(reqs) -> bool:
    """Whether an overlapped step of these requests samples only once the step before is booked."""
    return any(needs_host(r) for r in reqs)


def needs_host(r: Request) -> bool:
    """r's next sampling needs its last token on the host (grammar mask, multi-token bad words)."""
    return r.structured is not None or (r.adjust is not None and bool(r.adjust.bad_words))


def _known(r: Request) -> int:
    """r's tokens known on the host (len(r.tokens), without building the list)."""
    return len(r.prompt_ids) + len(r.output_ids)
