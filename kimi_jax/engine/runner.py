"""The runner: lays a StepPlan out as one StepBatch, runs its compiled program, owns the device
state (the page pool, the occurrence pool, each program's fixed input and output buffers) and
overlap dispatch; the programs it declares and precompiles are `ProgramSet`'s
(kimi_jax/engine/program_set.py).

Fixed buffers: a program's inputs and outputs stay at one address, so XLA never records its CUDA
graph again (docs/ARCHITECTURE.md, "Fixed buffers")."""
# Over 600 lines: the one owner of the device state: both step layouts' batches, buffers, calls.
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Optional

import jax
import numpy as np

from kimi_jax.engine import penalties
from kimi_jax.engine.requests import StepPlan, n_logprobs, prompt_targets, samples_with_extras
from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
from kimi_jax.engine.sampling import sample_mode as sample_mode_of
from kimi_jax.engine.shapes import bucket
from kimi_jax.engine.mla_schedule import step_schedule
from kimi_jax import ops
from kimi_jax.engine.program_set import ADJUST_ENTRIES, ADJUST_STOPS, ProgramKey, ProgramSet
from kimi_jax.engine.steps import (ModelSteps, RaggedBatch, SampleInputs, StepBatch, StepOutput,
                                   is_fresh)

# A constrained request with at most this many tokens left checks each step whether closing its
# output (kimi_jax.engine.structured.StructuredBackend.bitmask_closing) must begin.
CLOSE_WINDOW = 96


@dataclasses.dataclass
class _InFlight:
    plan: StepPlan
    out: dict
    batch: StepBatch
    key: ProgramKey


class Runner(ProgramSet):
    """Runs a core's plans and holds its device state: the page and occurrence pools, each program's
    fixed buffers, the step in flight, and the structured-outputs backend (`structured`, shared by
    the cores of one model; None: no structured outputs) with the masks it fills."""

    def __init__(
        self,
        steps: ModelSteps,
        *,
        num_pages: int,
        page_size: int,
        cache_dtype,
        max_num_seqs: int,
        max_logprobs: int = 20,
        fixed_buffers: bool = True,
        structured=None,
        row_pages: int = 1,
        spec_width: int = 1,
    ):
        self.steps, self.page_size, self.max_num_seqs = steps, page_size, max_num_seqs
        # a ragged step of an engine with speculation samples this many logits a row (its last
        # token, then each draft: 1 + num_speculative_tokens)
        self.spec_width = spec_width
        # a ragged step: the most pages a row holds (static), a rank's pages (its padding slot)
        self.row_pages, self.rank_pages = row_pages, num_pages // steps.dp
        # a ragged step's widest row count (RaggedShapes.max_rows): the sampled tokens' shape
        self.ragged_rows = steps.batch_size(steps.dp * -(-max_num_seqs // steps.dp))
        self._no_prev = None              # zeros [ragged_rows]: no token fed from a step in flight
        self.structured = structured
        self.max_logprobs = max_logprobs
        self.fixed_buffers = fixed_buffers
        # (key, batch shapes: wide logits adjustments compile their own) -> device (inputs, outputs)
        self.resident: dict[tuple, tuple[StepBatch, object]] = {}
        self.pages = steps.init_pages(num_pages, page_size, cache_dtype)
        self.occ = None                   # the occurrence pool, made when a request first needs it
        self.inflight: Optional[_InFlight] = None
        # a split step's forward half: (logits, batch, key)
        self._forward: Optional[tuple] = None
        # batch -> the host mask buffer its steps fill in place
        self._masks: dict[int, np.ndarray] = {}
        self.compiled: dict = {}          # precompiled executables, kept alive for jax's cache

    # ---- device state the scheduler asks for ----------------------------------------------------
    def apply(self, effects: list) -> None:
        """Carry out the scheduler's device writes in order: ('occ', pool row, row_V) or ('copy',
        src, dst, rank)."""
        for e in effects:
            if e[0] == "occ":
                self.steps.set_occurrences(self.occurrences(), e[1], e[2])
            else:
                self.pages = self.steps.copy_pages(self.pages, *e[1:])

    def occurrences(self):
        if self.occ is None:
            self.occ = self.steps.new_occurrences(self.max_num_seqs)
        return self.occ

    # ---- one plan --------------------------------------------------------------------------------
    def matcher(self, constraint, budget: Optional[int] = None):
        """A request's grammar state within `budget` tokens (RequestError: it cannot compile)."""
        from kimi_jax.engine.structured_params import StructuredOutputError
        from kimi_jax.engine.validation import RequestError
        if self.structured is None:
            raise RequestError(
                "structured outputs need the model's tokenizer, and this engine has none",
                "structured_outputs",
            )
        try:
            return self.structured.matcher(constraint, budget)
        except StructuredOutputError as e:
            raise RequestError(str(e)) from None

    def run(self, plan: StepPlan) -> list[tuple[StepPlan, object]]:
        """Run (or, plan.overlap, dispatch) a plan; returns the (plan, host outputs) pairs read now:
        its own, none (dispatched), or, chained, the step in flight's. A split plan dispatches its
        forward half here and its sampling half at `sample`, once the outputs read here are
        booked."""
        if plan.kind == "ragged":
            return self._run_ragged(plan)
        if plan.split:
            return self._run_forward(plan)
        if plan.chained:
            f = self.inflight
            batch = self._layout_chained(plan, f)
            key = dataclasses.replace(f.key, table=plan.table, mla_schedule=step_schedule(
                self.steps.exec_plan, np.asarray(batch.positions_BT)[:, 0]))
        else:
            batch, key = self.batch_for(plan)
        out = self._call(batch, key, snapshot=plan.overlap)
        if not plan.overlap:
            return [(plan, _host(out))]
        for o in out.values():
            if o.is_fully_addressable:
                o.copy_to_host_async()
        prev, self.inflight = self.inflight, _InFlight(plan, out, batch, key)
        return [] if prev is None or not plan.chained else [(prev.plan, _host(prev.out))]

    def _run_forward(self, plan: StepPlan) -> list[tuple[StepPlan, object]]:
        f, self.inflight = self.inflight, None
        if plan.chained:
            batch = self._layout_chained(plan, f)
            key = dataclasses.replace(f.key, table=plan.table, mla_schedule=step_schedule(
                self.steps.exec_plan, np.asarray(batch.positions_BT)[:, 0]))
        else:
            batch, key = self._forward_batch(plan)
        self._forward = (self._call_forward(batch, key), batch, key)
        return [] if f is None or not plan.chained else [(f.plan, _host(f.out))]

    def sample(self, plan: StepPlan) -> None:
        """Dispatch a split plan's sampling half, laid out from the requests as booked now (masks,
        bans); rows that finished meanwhile sample unconstrained, their tokens discarded."""
        (logits, batch, key), self._forward = self._forward, None
        ragged = plan.kind == "ragged"
        inputs, skey = (self._ragged_sample_inputs if ragged else self._sample_inputs)(plan)
        out = self._call_sample(logits, inputs, skey)
        for o in out.values():
            if o.is_fully_addressable:
                o.copy_to_host_async()
        self.inflight = (_InFlight(plan, out, (batch, inputs), (key, skey)) if ragged
                         else _InFlight(plan, out, batch, key))

    def _forward_batch(self, plan: StepPlan) -> tuple[StepBatch, ProgramKey]:
        """A split decode plan's forward inputs (no sampling arrays) and program."""
        B, P = plan.batch, plan.table
        tokens, z = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        positions, table = np.full((B, 1), -1, np.int32), np.zeros((B, P), np.int32)
        for row in plan.live:
            tokens[row.batch_row], positions[row.batch_row, 0] = row.tokens[0], row.start
            table[row.batch_row, :len(row.pages)] = row.pages
        key = ProgramKey(
            "decode",
            B,
            1,
            P,
            mla_schedule=step_schedule(self.steps.exec_plan, positions[:, 0]),
            part="forward",
        )
        return StepBatch(self._decode_tokens(tokens), positions, table, z, z, None), key

    def _sample_inputs(self, plan: StepPlan) -> tuple[SampleInputs, ProgramKey]:
        B = plan.batch
        live = [row for row in plan.live if row.req.finish_reason is None]
        steps, keys, params, adjust = _sampling_rows(B, live, lambda row: 1)
        adj = penalties.build(
            adjust, self.max_num_seqs, ADJUST_ENTRIES, ADJUST_STOPS, with_penalties=True
        )
        sp = SamplingArrays.build(params, None, keys=keys, adjust=adj)
        n_lp = n_logprobs([row.req for row in live])
        key = ProgramKey(
            "decode",
            B,
            1,
            0,
            sampled=sample_mode_of(sp) != "greedy",
            logprobs=self._top(n_lp or 0),
            part="sample",
        )
        return SampleInputs(sp, steps, self._mask(plan)), key

    # ---- a ragged step -------------------------------------------------------------------------
    def _run_ragged(self, plan: StepPlan) -> list[tuple[StepPlan, object]]:
        """A ragged plan's forward and sampling programs, run now; its host outputs with prompt
        logprobs laid out [B, row's tokens] as a padded step's. plan.overlap: dispatched, its
        outputs read by the next run (chained: rows without tokens fed the step in flight's
        sampled tokens on the device) or by `drain`."""
        f = self.inflight
        batch, key = self.ragged_batch(plan, f if plan.chained else None)
        if plan.split:        # sampled by `sample` once f's outputs, read here, are booked
            self.inflight, self._forward = None, (self._call_ragged(batch, key), batch, key)
            return [] if f is None or not plan.chained else [(f.plan, self._read(f))]
        inputs, skey = self._ragged_sample_inputs(plan)
        forward = self._call_ragged(batch, key)
        logits, prompt = forward if key.prompt_logprobs is not None else (forward, None)
        out = self._call_sample(logits, inputs, skey, snapshot=plan.overlap)
        if plan.overlap:
            for o in out.values():
                if o.is_fully_addressable:
                    o.copy_to_host_async()
            self.inflight = _InFlight(plan, out, (batch, inputs), (key, skey))
            return [] if f is None or not plan.chained else [(f.plan, self._read(f))]
        host = self._ragged_host(plan, out)
        if prompt is not None:
            prompt = {k: np.asarray(v) for k, v in jax.device_get(prompt).items()}
            index = self._ragged_index(plan)
            for k, v in prompt.items():
                setattr(host, k, v[index])
        return [(plan, host)]

    def _ragged_host(self, plan: StepPlan, out) -> StepOutput:
        """A ragged step's host outputs, its tokens [B] cut from the sampling half's wide ones."""
        host, dp = _host(out), self.steps.dp
        host.tokens = host.tokens.reshape(dp, -1)[:, :plan.batch // dp].reshape(-1)
        return host

    def _read(self, f: _InFlight):
        return self._ragged_host(f.plan, f.out) if f.plan.kind == "ragged" else _host(f.out)

    def _ragged_spans(self, plan: StepPlan) -> list[tuple[object, int, int]]:
        """(row, its first token on the flat axis, its first entry in pages_X) of each live row:
        each rank's rows one after another in its blocks."""
        dp = self.steps.dp
        t, b, x = plan.width // dp, plan.batch // dp, plan.table // dp
        tok, pg, out = [0] * dp, [0] * dp, []
        for row in sorted(plan.live, key=lambda row: row.batch_row):
            k = row.batch_row // b
            out.append((row, k * t + tok[k], k * x + pg[k]))
            tok[k] += row.n
            pg[k] += -(-(row.start + row.n) // self.page_size)
        return out

    def _ragged_index(self, plan: StepPlan) -> np.ndarray:
        """[B, widest row] flat-axis index of each row's tokens (0 past a row's end)."""
        spans = self._ragged_spans(plan)
        index = np.zeros((plan.batch, max(row.n for row, _, _ in spans)), np.int32)
        for row, g, _ in spans:
            index[row.batch_row, :row.n] = np.arange(g, g + row.n)
        return index

    def ragged_batch(self, plan: StepPlan,
                     f: Optional[_InFlight] = None) -> tuple[RaggedBatch, ProgramKey]:
        """A ragged plan's RaggedBatch (kimi_jax.engine.steps) and its forward program; a row
        without tokens (a chained plan's) is fed the token its request samples in f, the step in
        flight: from_prev_T its row in f's plan, local to the rank's block."""
        B, T, X, dp, p = plan.batch, plan.width, plan.table, self.steps.dp, self.page_size
        t, x = T // dp, X // dp
        spans = self._ragged_spans(plan)
        live, R = [row for row, _, _ in spans], len(spans)
        # per row (R): its tokens, first position, first token on the flat axis, first entry
        # in pages_X, batch row, rank, pages held through this step
        n_R = np.fromiter((row.n for row in live), np.int32, R)
        pos0_R = np.fromiter((row.start for row in live), np.int32, R)
        g_R = np.fromiter((g for _, g, _ in spans), np.int32, R)
        pg_R = np.fromiter((pg for _, _, pg in spans), np.int32, R)
        b_R = np.fromiter((row.batch_row for row in live), np.int32, R)
        k_R, held_R = g_R // t, -(-(pos0_R + n_R) // p)
        held = np.fromiter(itertools.chain.from_iterable(
            row.pages[:h] for row, h in zip(live, held_R.tolist())), np.int32, int(held_R.sum()))
        held_at = np.cumsum(held_R) - held_R          # each row's first page in `held`
        pages = np.zeros((X,), np.int32)
        of_page = np.repeat(np.arange(R), held_R)
        pages[pg_R[of_page] + np.arange(len(held)) - held_at[of_page]] = held
        # per token of the rows (their tokens one after another): flat index, position, slot
        of_tok = np.repeat(np.arange(R), n_R)
        within = np.arange(int(n_R.sum())) - (np.cumsum(n_R) - n_R)[of_tok]
        flat, pos = g_R[of_tok] + within, pos0_R[of_tok] + within
        positions = np.full((T,), -1, np.int32)
        positions[flat] = pos
        slots = np.full((T,), self.rank_pages * p, np.int32)
        slots[flat] = held[held_at[of_tok] + pos // p] * p + pos % p
        fed = np.fromiter((bool(row.tokens) for row in live), bool, R)
        tokens = np.zeros((T,), np.int32)
        tokens[flat[fed[of_tok]]] = np.fromiter(itertools.chain.from_iterable(
            row.tokens for row in live if row.tokens), np.int32, int(n_R[fed].sum()))
        # a row without tokens: fed from its row in f's plan (rank k's rows in its block there too)
        from_prev = np.full((T,), -1, np.int32)
        if not fed.all():
            prev_rows = {id(row.req): row.batch_row for row in f.plan.live}
            prev_per = f.plan.batch // dp
            from_prev[g_R[~fed]] = [prev_rows[id(row.req)] - int(k) * prev_per
                                    for row, k in zip(live, k_R) if not row.tokens]
        start, length, cached, page_start = (np.zeros((B,), np.int32) for _ in range(4))
        start[b_R], length[b_R], cached[b_R] = g_R - k_R * t, n_R, pos0_R
        page_start[b_R] = pg_R - k_R * x
        # the tokens each row samples: its last; with speculation spec_width of them, a row
        # verifying d drafts its last d + 1 (then its last again), any other its last each time
        S = self.spec_width
        sample = np.zeros((B, S), np.int32)
        d_R = np.fromiter((row.drafts for row in live), np.int32, R)
        last_R = g_R - k_R * t + n_R - 1
        sample[b_R] = np.minimum(last_R[:, None] - d_R[:, None] + np.arange(S), last_R[:, None])
        sample = sample.reshape(-1)
        n_plp, targets = prompt_targets([(row.req, int(n)) for row, n in zip(live, n_R)],
                                        b_R.tolist(), (B, int(n_R.max())))
        targets_T = None
        if n_plp is not None:
            targets_T = np.full((T,), -1, np.int32)
            targets_T[flat] = targets[b_R[of_tok], within]
        rows = ops.RaggedRows(start, length, cached, page_start, pages)
        key = ProgramKey("ragged", B, T, X, prompt_logprobs=self._top(n_plp), part="forward")
        prev = self._zero_prev() if f is None else f.out["tokens"]
        return RaggedBatch(self._decode_tokens(tokens), positions, slots, rows, sample,
                           targets_T, from_prev, prev), key

    def _zero_prev(self) -> jax.Array:
        if self._no_prev is None:
            self._no_prev = self._decode_tokens(np.zeros((self.ragged_rows,), np.int32))
        return self._no_prev

    def _ragged_sample_inputs(self, plan: StepPlan) -> tuple[SampleInputs, ProgramKey]:
        """The sampling half of a ragged plan's rows: greedy, sampled or (logprobs, adjustments,
        masks) extras; a row inside its prompt samples a token no one reads."""
        B = plan.batch
        # a split step's rows whose request finished meanwhile sample unconstrained (discarded)
        live = [row for row in plan.live if row.req.finish_reason is None]
        reqs = [row.req for row in live]
        # counts: the row samples its next token (a chained row: always)
        steps, keys, params, adjust = _sampling_rows(
            B, live, lambda row: int(not row.tokens or row.start + row.n == len(row.req.tokens)))
        n_lp = n_logprobs(reqs)
        extras = any(samples_with_extras(r) for r in reqs)
        adj = mask = None
        if extras:
            adj = penalties.build(
                adjust, self.max_num_seqs, ADJUST_ENTRIES, ADJUST_STOPS, with_penalties=True
            )
            mask = self._mask(plan)
        sp = SamplingArrays.build(params, None, keys=keys, adjust=adj)
        # greedy rows (adjusted, masked or not) sample by argmax: no sort of the vocabulary
        key = ProgramKey("ragged", B, 1, 0, sampled=sample_mode_of(sp) != "greedy",
                         logprobs=self._top(n_lp or 0) if extras else None, part="sample")
        drafts = n_draft = None
        if self.spec_width > 1 and not extras:     # the plain halves verify (rows without: 0)
            drafts = np.zeros((B, self.spec_width - 1), np.int32)
            n_draft = np.zeros((B,), np.int32)
            for row in live:
                if row.drafts:
                    drafts[row.batch_row, :row.drafts] = row.tokens[-row.drafts:]
                    n_draft[row.batch_row] = row.drafts
        return SampleInputs(sp, steps, mask, drafts, n_draft), key

    def _call_ragged(self, batch: RaggedBatch, key: ProgramKey):
        """A ragged step's forward: its logits [B, V] (with prompt logprobs: (logits, their
        dict)), the pool updated, in its program's fixed buffers."""
        steps, kw = self.steps, self._ragged_kw(key)
        self._commit_pages()
        if not self.fixed_buffers:
            self.pages, out = steps.ragged_jit(steps.weights, self.pages, batch, **kw)
            return out
        io, prev = self._ragged_resident(key, batch)
        self.pages, out = steps.ragged_jit(steps.weights, self.pages, io, prev, **kw)
        self.resident[_buffer_key(key, batch)] = (io, out)
        return out

    def _commit_pages(self) -> None:
        """The pool committed to `ModelSteps.pool_sharding`, as a ragged forward returns it (a
        pool made on one device is not), so its first call runs the program of the rest."""
        if not all(a.committed for a in jax.tree.leaves(self.pages)):
            self.pages = jax.device_put(self.pages, self.steps.pool_sharding)

    def _ragged_kw(self, key: ProgramKey) -> dict:
        return dict(plan=self.steps.exec_plan, max_pages=self.row_pages,
                    n_prompt_logprobs=key.prompt_logprobs)

    def _forward_resident(self, key: ProgramKey, batch: StepBatch) -> tuple:
        """batch in its split decode forward's fixed buffers: (inputs, outputs' buffers)."""
        steps, kw = self.steps, dict(plan=self._exec_plan(key))
        return self._resident(
            key, batch,
            lambda io: jax.eval_shape(lambda *a: steps.forward_jit(*a, **kw)[1], steps.weights,
                                      self.pages, io),
            steps.logits_sharding)

    def _ragged_resident(self, key: ProgramKey, batch: RaggedBatch) -> tuple:
        """batch in its ragged forward's fixed buffers: (inputs, outputs' buffers)."""
        steps, kw = self.steps, self._ragged_kw(key)

        def shape(io):
            return jax.eval_shape(lambda *a: steps.ragged_jit(*a, **kw)[1], steps.weights,
                                  self.pages, io)
        shardings = (steps.logits_sharding, steps.token_sharding)
        return self._resident(key, batch, shape,
                              shardings if key.prompt_logprobs is not None else shardings[0])

    def drain(self) -> list[tuple[StepPlan, object]]:
        """Read the step in flight, if any."""
        f, self.inflight = self.inflight, None
        return [] if f is None else [(f.plan, self._read(f))]

    def batch_for(self, plan: StepPlan) -> tuple[StepBatch, ProgramKey]:
        """The plan's padded StepBatch and the program that runs it."""
        B, T, P = plan.batch, plan.width, plan.table
        tokens = np.zeros((B, T), np.int32)
        positions = np.full((B, T), -1, np.int32)
        table = np.zeros((B, P), np.int32)
        last = np.zeros((B,), np.int32)
        for row in plan.live:
            b = row.batch_row
            tokens[b, :len(row.tokens)] = row.tokens
            positions[b, :row.n] = np.arange(row.start, row.start + row.n)
            table[b, :len(row.pages)] = row.pages
            last[b] = row.n - 1
        # counts: the row samples its next token (its last token is its request's last)
        steps, keys, params, adjust = _sampling_rows(
            B, plan.live, lambda row: int(row.start + row.n == len(row.req.tokens)))
        reqs = [row.req for row in plan.live]
        verify = plan.kind == "verify"
        n_plp, targets = (None, None) if verify else prompt_targets(
            [(row.req, row.n) for row in plan.live], [row.batch_row for row in plan.live], (B, T))
        n_lp = n_logprobs(reqs)
        extras = not verify and (
            n_lp is not None
            or n_plp is not None
            or any(a is not None for a in adjust)
            or any(r.structured is not None for r in reqs)
        )
        adj = mask = n_draft = None
        if extras:
            adj = penalties.build(
                adjust, self.max_num_seqs, ADJUST_ENTRIES, ADJUST_STOPS, with_penalties=True
            )
            mask = self._mask(plan)
        if verify:
            n_draft = np.zeros((B,), np.int32)
            n_draft[[row.batch_row for row in plan.live]] = [
                len(row.tokens) - 1 for row in plan.live
            ]
        sp = SamplingArrays.build(params, None, keys=keys, adjust=adj)
        fresh = (
            plan.kind == "prefill"
            and not self.steps.exec_plan.absorbs_chunk(T)
            and is_fresh(positions)
        )
        key = ProgramKey(
            plan.kind,
            B,
            T,
            P,
            fresh=fresh,
            sampled=extras or (not verify and sample_mode_of(sp) != "greedy"),
            logprobs=self._top(n_lp or 0) if extras else None,
            prompt_logprobs=self._top(n_plp),
            mla_schedule=step_schedule(self.steps.exec_plan, positions[:, 0])
            if plan.kind == "decode"
            else None,
        )
        batch = StepBatch(
            self._decode_tokens(tokens[:, 0]) if plan.kind == "decode" else tokens,
            positions,
            table,
            last,
            steps,
            sp,
            targets,
            mask,
            n_draft,
        )
        return batch, key

    def _layout_chained(self, plan: StepPlan, f: _InFlight) -> StepBatch:
        """A decode step fed the step in flight's sampled tokens (device arrays), its sampling
        arrays reused; rows that end with the step in flight are padding."""
        B = plan.batch
        positions = np.full((B, 1), -1, np.int32)
        steps = np.zeros((B,), np.int32)
        table = np.zeros((B, plan.table), np.int32)
        for row in plan.live:
            positions[row.batch_row, 0], steps[row.batch_row] = row.start, row.step
            table[row.batch_row, :len(row.pages)] = row.pages
        return dataclasses.replace(
            f.batch,
            tokens=f.out["tokens"],
            positions_BT=positions,
            block_table_BP=table,
            step_B=steps,
        )

    def _top(self, n: Optional[int]) -> Optional[int]:
        """Top logprobs a program returns: max_logprobs for any request within it (sliced on the
        host), so logprobs 0 .. max_logprobs share one program."""
        return None if n is None else self.max_logprobs if n <= self.max_logprobs else bucket(n, 1)

    def _decode_tokens(self, host_B: np.ndarray) -> jax.Array:
        """Host-fed decode tokens committed as a step's own output tokens: one program for both."""
        return jax.make_array_from_callback(
            host_B.shape, self.steps.token_sharding, lambda i: host_B[i]
        )

    def _mask(self, plan: StepPlan) -> Optional[np.ndarray]:
        """The step's packed token bitmask [B, ceil(V / 32)] (unconstrained rows: every token); a
        row near the end of its budget narrows its mask to a greedy close."""
        rows = [
            row
            for row in plan.live
            if row.req.structured is not None and row.req.finish_reason is None
        ]
        structured = self.structured
        if not rows or structured is None:
            return np.full((plan.batch, -(-self.steps.cfg.vocab_size // 32)), -1, np.int32)
        matchers = [None] * plan.batch
        for row in rows:
            matchers[row.batch_row] = row.req.structured
        # the step reads its copy of the buffer before the next fill (a step's outputs read first)
        buffer = self._masks.setdefault(
            plan.batch, np.empty((plan.batch, structured.words), np.int32)
        )
        mask = structured.fill_bitmask(matchers, out=buffer)
        for row in rows:
            left = row.req.max_new - len(row.req.output_ids)
            if left <= CLOSE_WINDOW:
                structured.bitmask_closing(mask[row.batch_row], row.req.structured, left)
        return mask

    def _step_args(self, batch: StepBatch, key: ProgramKey) -> tuple[tuple, dict]:
        """The occurrence pool and static arguments of `ModelSteps.step_jit` for key's program."""
        eng = self.steps
        occ = self.occurrences().pool if key.logprobs is not None else None
        plan = (
            eng.exec_plan
            if key.mla_schedule == eng.exec_plan.mla_schedule
            else dataclasses.replace(eng.exec_plan, mla_schedule=key.mla_schedule)
        )
        return (occ,), dict(
            kind=key.kind,
            n_logprobs=key.logprobs,
            n_prompt_logprobs=key.prompt_logprobs,
            fresh=key.fresh,
            sample_mode=("filtered" if key.sampled else "greedy") if key.kind != "verify" else None,
            plan=plan,
        )

    def _call(self, batch: StepBatch, key: ProgramKey, snapshot: bool = True):
        eng = self.steps
        args, kw = self._step_args(batch, key)
        if not self.fixed_buffers:
            self.pages, out = eng.step_jit(eng.weights, self.pages, batch, *args, **kw)
            return self._take_occ(out)
        bkey, io, prev = self._place(batch, key, args, kw)
        self.pages, out = eng.step_jit(eng.weights, self.pages, io, *args, prev, **kw)
        out = self._take_occ(out)
        self.resident[bkey] = (io, out)
        return eng.snapshot(out) if snapshot else out

    def _call_forward(self, batch: StepBatch, key: ProgramKey):
        """The forward half's logits (the pool updated), in its program's fixed buffers."""
        steps = self.steps
        kw = dict(plan=self._exec_plan(key))
        if not self.fixed_buffers:
            self.pages, logits = steps.forward_jit(steps.weights, self.pages, batch, **kw)
            return logits
        io, prev = self._forward_resident(key, batch)
        self.pages, logits = steps.forward_jit(steps.weights, self.pages, io, prev, **kw)
        self.resident[_buffer_key(key, batch)] = (io, logits)
        return logits

    def _sample_kw(self, key: ProgramKey) -> dict:
        """sample_jit's static arguments for key (a ragged step's: its tokens as wide as the
        widest step's, `ragged_rows`)."""
        kw = dict(n_logprobs=key.logprobs, sample_mode="filtered" if key.sampled else "greedy")
        if key.kind != "ragged":
            return kw
        return {**kw, "rows": self.ragged_rows, "spec_width": self.spec_width}

    def _call_sample(self, logits, inputs: SampleInputs, key: ProgramKey, snapshot: bool = True):
        steps = self.steps
        occ = self.occurrences().pool if key.logprobs is not None else None
        kw = self._sample_kw(key)
        if not self.fixed_buffers:
            return self._take_occ(steps.sample_jit(logits, inputs, occ, **kw))

        def shape(io):
            out = jax.eval_shape(lambda *a: steps.sample_jit(*a, **kw), logits, io, occ)
            out.pop("occurrences", None)
            return out
        io, prev = self._resident(key, inputs, shape)
        out = self._take_occ(steps.sample_jit(logits, io, occ, prev, **kw))
        self.resident[_buffer_key(key, inputs)] = (io, out)
        return steps.snapshot(out) if snapshot else out

    def _resident(self, key: ProgramKey, inputs, out_shape: Callable, out_sharding=None) -> tuple:
        """`inputs` written into key's program's buffers (made at the first call): (inputs',
        outputs')."""
        steps, bkey = self.steps, _buffer_key(key, inputs)
        if bkey not in self.resident:
            def place(a, sharding=steps.token_sharding):
                return jax.device_put(np.zeros(a.shape, a.dtype), sharding)
            io = jax.tree.map(place, inputs)
            out = out_shape(io)
            if isinstance(out_sharding, tuple):      # one sharding per output
                out = tuple(jax.tree.map(lambda a, s=s: place(a, s), o)
                            for s, o in zip(out_sharding, out))
            else:
                out = jax.tree.map(lambda a: place(a, out_sharding or steps.token_sharding), out)
            self.resident[bkey] = (io, out)
        io, prev = self.resident[bkey]
        io = steps.put_batch(io, inputs)
        self.resident[bkey] = (io, prev)
        return io, prev

    def _exec_plan(self, key: ProgramKey):
        plan = self.steps.exec_plan
        return (
            plan
            if key.mla_schedule == plan.mla_schedule
            else dataclasses.replace(plan, mla_schedule=key.mla_schedule)
        )

    def _take_occ(self, out):
        if isinstance(out, dict) and "occurrences" in out:
            self.occ.pool = out.pop("occurrences")
        return out

    def _place(
        self, batch: StepBatch, key: ProgramKey, args: tuple, kw: dict
    ) -> tuple[tuple, StepBatch, object]:
        """batch written into its program's buffers (made at the first call): (its key, inputs,
        outputs' buffers)."""
        eng, bkey = self.steps, _buffer_key(key, batch)
        if bkey not in self.resident:
            place = lambda a: jax.device_put(  # noqa: E731
                np.zeros(a.shape, a.dtype), eng.token_sharding
            )
            io = jax.tree.map(place, batch)
            out = jax.eval_shape(
                lambda *a: eng.step_jit(*a, **kw)[1], eng.weights, self.pages, io, *args
            )
            if isinstance(out, dict):
                out.pop("occurrences", None)
            self.resident[bkey] = (io, jax.tree.map(place, out))
        io, prev = self.resident[bkey]
        io = eng.put_batch(io, batch)
        self.resident[bkey] = (io, prev)
        return bkey, io, prev

    # ---- speculation's pass costs ---------------------------------------------------------------
    def measure_passes(
        self, decode: StepPlan, verify: StepPlan, reps: int = 5
    ) -> tuple[float, float]:
        """(decode pass seconds, verification pass seconds) on these rows (medians; the decode pass
        without logits adjustments, which would count occurrences; the verification pass feeds only
        the last token, so nothing is written beyond the rows' cache)."""
        dec, dkey = self.batch_for(decode)
        dec = dataclasses.replace(
            dec, sp=dataclasses.replace(dec.sp, adjust=None), targets_BT=None, mask_Bw=None
        )
        dkey = dataclasses.replace(dkey, logprobs=None, prompt_logprobs=None)
        ver, vkey = self.batch_for(verify)
        runs = [
            lambda: jax.block_until_ready(self._call(dec, dkey)),
            lambda: jax.block_until_ready(self._call(ver, vkey)),
        ]
        return self._median_times(runs, reps)

    def measure_ragged(self, plan0: StepPlan, plan1: StepPlan, reps: int = 5
                       ) -> tuple[float, float]:
        """(seconds, seconds) of two ragged plans of the same decode rows at two widths (medians
        of forward and sampling half; each writes only its rows' last token's latents, as the
        step that follows writes them)."""
        def run(plan):
            batch, key = self.ragged_batch(plan)
            inputs, skey = self._ragged_sample_inputs(plan)
            return lambda: jax.block_until_ready(
                self._call_sample(self._call_ragged(batch, key), inputs, skey))
        runs = [run(plan0), run(plan1)]
        return self._median_times(runs, reps)

    def _median_times(self, runs: list[Callable], reps: int) -> tuple[float, float]:
        """Each of two calls' median seconds over reps (after a call that compiles), the same on
        every process."""
        for f in runs:
            f()
        times = [[], []]
        for _ in range(reps):
            for i, f in enumerate(runs):
                t0 = time.perf_counter()
                f()
                times[i].append(time.perf_counter() - t0)
        costs = np.asarray([np.median(t) for t in times], np.float64)
        if jax.process_count() > 1:           # every process must take the same decisions
            from jax.experimental import multihost_utils
            costs = np.asarray(multihost_utils.broadcast_one_to_all(costs))
        return float(costs[0]), float(costs[1])


def _sampling_rows(B: int, rows, counts: Callable) -> tuple:
    """The per-row sampling inputs of `rows` in a batch of B: (steps [B], sample keys [B, 2],
    SamplingParams [B], adjustments [B]: (adjustments, bans by the output so far, occurrence row,
    counts(row): whether the row's token is counted) or None; padding rows greedy, unadjusted)."""
    steps, keys = np.zeros((B,), np.int32), np.zeros((B, 2), np.uint32)
    params, adjust = [SamplingParams(temperature=0.0)] * B, [None] * B
    for row in rows:
        b, r = row.batch_row, row.req
        steps[b], keys[b], params[b] = row.step, r.key, r.params
        if r.adjust is not None:
            adjust[b] = (r.adjust, penalties.banned_now(r.adjust.bad_words, r.output_ids),
                         r.occ_row, counts(row))
    return steps, keys, params, adjust


def _buffer_key(key: ProgramKey, batch: StepBatch) -> tuple:
    return key, tuple(np.shape(x) for x in jax.tree.leaves(batch))


def _host(out):
    """Host copy of a step's outputs: a StepOutput, or (accepted, next) of a verification pass."""
    if isinstance(out, tuple):
        return tuple(np.asarray(o) for o in jax.device_get(out))
    return StepOutput(**{k: np.asarray(o) for k, o in jax.device_get(out).items()})
