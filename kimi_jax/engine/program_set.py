"""The program set of a runner: `ProgramKey` (one compiled step program), what a runner declares
for given limits (`programs`: every program a workload within them can run) and how it builds them
before the first request (`precompile`). `ProgramSet` is mixed into `kimi_jax.engine.runner.Runner`,
whose device state (steps, pools, fixed buffers) and calls it uses."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
from typing import Callable, Optional

import jax
import numpy as np

from kimi_jax import ops
from kimi_jax.engine.mla_schedule import can_balance
from kimi_jax.engine.sampling import SamplingArrays, SamplingParams, key_data_for_seed
from kimi_jax.engine.shapes import Limits, RaggedShapes, Shapes, bucket
from kimi_jax.engine.steps import RaggedBatch, SampleInputs, StepBatch
from kimi_jax.engine import penalties

# Logits adjustments are laid out at least this wide (bias entries, stop ids), so the declared
# programs cover the usual requests; wider ones compile their own program.
ADJUST_ENTRIES, ADJUST_STOPS = 16, 8


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """One compiled step program: the static arguments and padded shapes of `ModelSteps.step_jit`.
    logprobs: None for a plain program; else an extras program, which serves every row that wants
    logprobs (top-n, n <= logprobs), logits adjustments or a token mask: all rows get the
    adjustments (no-ops for rows without), a mask (all tokens for unconstrained rows) and the
    filtered sampler. prompt_logprobs: top-n of every position (extras programs of prefill steps
    only). part: one half of a split decode step ('forward', 'sample'; None: the whole step), or
    of a ragged step (kind 'ragged': batch B, width T, table the pages_X width; see
    `ragged_programs`)."""
    kind: str
    batch: int
    width: int
    table: int
    fresh: bool = False
    sampled: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    mla_schedule: Optional[str] = None
    part: Optional[str] = None


class ProgramSet:
    """The runner's programs: declared (`programs`, `ragged_programs`) and built (`precompile`)."""
    def programs(self, limits: Limits) -> list[ProgramKey]:
        """Every step program a workload within `limits` can run (the scheduler's `Shapes`): per
        padded shape a greedy, a sampled and an extras program (sampler costs differ: BENCHMARKS.md,
        'Program set'), prefill shapes also extras with prompt logprobs, the balanced schedule where
        reachable. The ragged layout: `ragged_programs`."""
        if limits.step_layout == "ragged":
            return self.ragged_programs(limits)
        eng, plan = self.steps, self.steps.exec_plan
        shapes = Shapes.for_limits(limits, eng.dp, plan)
        batches = sorted(
            {eng.batch_size(eng.dp * c) for c in range(1, -(-limits.max_num_seqs // eng.dp) + 1)}
        )
        chunk = min(limits.prefill_chunk, limits.max_prefill_tokens, limits.max_model_len - 1)
        widths = sorted({bucket(n, 16) for n in range(2, chunk + 1)})
        n_lp = self._top(limits.max_logprobs)
        plain, prompt = (
            [(False, None, None), (True, None, None), (True, n_lp, None)],
            [(True, n_lp, n_lp)],
        )
        out, halves = [], []
        for B, P in itertools.product(batches, shapes.tables("decode")):
            tokens = min(P * limits.page_size, limits.max_model_len)
            auto = plan.pallas and plan.mla_schedule is None and can_balance(B, tokens)
            schedules = [None, "balanced"] if auto else [plan.mla_schedule]
            out += [ProgramKey("decode", B, 1, P, False, s, lp, None, sched)
                    for sched in schedules for s, lp, _ in plain]
            if limits.speculative_tokens:
                out.append(ProgramKey("verify", B, limits.speculative_tokens + 1, P))
            if limits.split_decode:
                halves += [
                    ProgramKey("decode", B, 1, P, mla_schedule=sched, part="forward")
                    for sched in schedules
                ]
        # a split decode step's halves (constrained rows under overlap)
        if limits.split_decode:
            halves += [ProgramKey("decode", B, 1, 0, sampled=s, logprobs=n_lp, part="sample")
                       for B in batches for s in (False, True)]
        for B, T, fresh in itertools.product(batches, widths or [16], (False, True)):
            for P in [] if fresh and plan.absorbs_chunk(T) else shapes.tables("prefill", T, fresh):
                if B == batches[0] or shapes.prefill_fits(B, T, P, fresh):
                    out += [ProgramKey("prefill", B, T, P, fresh, s, lp, plp)
                            for s, lp, plp in (plain + prompt if widths else prompt)]
        return out + halves

    def ragged_programs(self, limits: Limits) -> list[ProgramKey]:
        """The ragged layout's programs (`RaggedShapes`): per ladder width T a forward (and from
        `RaggedShapes.prompt_tokens` up its prompt-logprobs variant); per row count B(T) a greedy
        and a sampled sampling half, each plain and extras."""
        shapes = RaggedShapes.for_limits(limits, self.steps.dp)
        n_lp = self._top(limits.max_logprobs)
        ladder, wide = shapes.ladder(), shapes.prompt_tokens()
        out = [ProgramKey("ragged", shapes.rows(T), T, shapes.pages(T), prompt_logprobs=plp,
                          part="forward")
               for T in ladder for plp in ((None, n_lp) if T >= wide else (None,))]
        return out + [ProgramKey("ragged", B, 1, 0, sampled=s, logprobs=lp, part="sample")
                      for B in sorted({shapes.rows(T) for T in ladder})
                      for s, lp in itertools.product((False, True), (None, n_lp))]

    def precompile(
        self,
        programs: list[ProgramKey],
        progress: Optional[Callable[[int, int, ProgramKey], None]] = None,
        threads: Optional[int] = None,
    ) -> None:
        """Build each program: the first plain and extras ones by a call on padding rows (so the
        pool and occurrences are step outputs, as later calls see them), the rest lowered here
        (tracing holds the GIL) and compiled on `threads` threads into jax's executable cache (a
        ragged set's then called once each on padding rows); then the occurrence row write, the
        pool's page copy and a sample's key, which requests call between steps.
        progress(i, n, key)."""
        n, done, pending = len(programs), 0, {}
        first = {
            next((k for k in programs if (k.logprobs is None) == plain and k.part is None), None)
            for plain in (True, False)
        }
        # a ragged set: its first forward and extras sampling half by a call (nothing written)
        first |= {next((k for k in programs if k.kind == "ragged" and k.part == part
                        and (k.logprobs is not None) == (part == "sample")), None)
                  for part in ("forward", "sample")}
        for key in [k for k in programs if k in first]:
            if key.kind == "ragged":
                jax.block_until_ready(self._call_ragged_dummy(key))
            else:
                jax.block_until_ready(self._call(self._dummy(key), key))
            done += 1
            if progress is not None:
                progress(done, n, key)

        def report(futures) -> None:
            nonlocal done
            for f in futures:
                self.compiled[pending.pop(f)] = f.result()
                done += 1
                if progress is not None:
                    progress(done, n, key_of[f])

        key_of = {}
        with concurrent.futures.ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
            for key in [k for k in programs if k not in first]:
                f = pool.submit(self._lower(key).compile)
                pending[f] = key_of[f] = key
                report([f for f in list(pending) if f.done()])
            report(concurrent.futures.as_completed(list(pending)))
        # a ragged set (a handful of programs): each of the rest run once on padding rows too, so
        # what a program's first call does beyond its compile (its fixed buffers made, on a GPU its
        # first execution's setup) happens before the engine says ready, not in a first request
        for key in [k for k in programs if k.kind == "ragged" and k not in first]:
            jax.block_until_ready(self._call_ragged_dummy(key))
        occ = self.occurrences()  # its row write, at the padding row (which stays zero)
        self.steps.set_occurrences(
            occ, occ.pad_row, np.zeros((self.steps.cfg.vocab_size,), np.int32)
        )
        # the pool's page copy (n > 1 forks), of a page onto itself: nothing changes; and a
        # sample's own key (n > 1: jax.random.fold_in)
        self._commit_pages()
        self.pages = self.steps.copy_pages(self.pages, [0], [0])
        key_data_for_seed(0, 1)

    def _lower(self, key: ProgramKey):
        """`_call`'s program for key, lowered over padding rows (or key's fixed buffers)."""
        if key.part is not None:
            return self._lower_half(key)
        eng, batch = self.steps, self._dummy(key)
        args, kw = self._step_args(batch, key)
        if not self.fixed_buffers:
            return eng.step_jit.lower(eng.weights, self.pages, batch, *args, **kw)
        _, io, prev = self._place(batch, key, args, kw)
        eng.snapshot(prev)
        return eng.step_jit.lower(eng.weights, self.pages, io, *args, prev, **kw)

    def _ragged_dummy(self, key: ProgramKey) -> RaggedBatch:
        """Padding rows in the layout of a ragged forward program (no slot written)."""
        B, T, X = key.batch, key.width, key.table
        z = np.zeros((B,), np.int32)
        return RaggedBatch(
            self._decode_tokens(np.zeros((T,), np.int32)), np.full((T,), -1, np.int32),
            np.full((T,), self.rank_pages * self.page_size, np.int32),
            ops.RaggedRows(z, z, z, z, np.zeros((X,), np.int32)),
            np.zeros((B * self.spec_width,), np.int32),
            np.full((T,), -1, np.int32) if key.prompt_logprobs is not None else None,
            np.full((T,), -1, np.int32), self._zero_prev())

    def _call_ragged_dummy(self, key: ProgramKey):
        """key's ragged program called on padding rows (a sampling half: on zero logits)."""
        if key.part == "forward":
            return self._call_ragged(self._ragged_dummy(key), key)
        return self._call_sample(*self._sample_dummy(key), key)

    def _sample_dummy(self, key: ProgramKey) -> tuple:
        """A sampling half's inputs for key over padding rows: (zero logits, SampleInputs)."""
        d = self._dummy(dataclasses.replace(key, part=None))
        S = self.spec_width if key.kind == "ragged" else 1
        logits = jax.device_put(
            np.zeros((key.batch * S, self.steps.cfg.vocab_size), np.float32),
            self.steps.logits_sharding)
        drafts = n_draft = None
        if S > 1 and key.logprobs is None:
            drafts, n_draft = np.zeros((key.batch, S - 1), np.int32), d.step_B
        return logits, SampleInputs(d.sp, d.step_B, d.mask_Bw, drafts, n_draft)

    def _lower_half(self, key: ProgramKey):
        """A split step's half for key, lowered over padding rows (or its fixed buffers)."""
        steps, B = self.steps, key.batch
        z = np.zeros((B,), np.int32)
        if key.kind == "ragged" and key.part == "forward":
            batch, kw = self._ragged_dummy(key), self._ragged_kw(key)
            self._commit_pages()
            if not self.fixed_buffers:
                return steps.ragged_jit.lower(steps.weights, self.pages, batch, **kw)
            io, prev = self._ragged_resident(key, batch)
            return steps.ragged_jit.lower(steps.weights, self.pages, io, prev, **kw)
        if key.part == "forward":
            batch = StepBatch(self._decode_tokens(z), np.full((B, 1), -1, np.int32),
                              np.zeros((B, key.table), np.int32), z, z, None)
            kw = dict(plan=self._exec_plan(key))
            if not self.fixed_buffers:
                return steps.forward_jit.lower(steps.weights, self.pages, batch, **kw)
            io, prev = self._forward_resident(key, batch)
            return steps.forward_jit.lower(steps.weights, self.pages, io, prev, **kw)
        logits, inputs = self._sample_dummy(key)
        kw = self._sample_kw(key)
        occ = self.occurrences().pool if key.logprobs is not None else None
        if not self.fixed_buffers:
            return steps.sample_jit.lower(logits, inputs, occ, **kw)

        def shape(io):
            out = jax.eval_shape(lambda *a: steps.sample_jit(*a, **kw), logits, io, occ)
            out.pop("occurrences", None)
            return out
        io, prev = self._resident(key, inputs, shape)
        steps.snapshot(prev)
        return steps.sample_jit.lower(logits, io, occ, prev, **kw)

    def _dummy(self, key: ProgramKey) -> StepBatch:
        """Padding rows in the layout of key's program."""
        B, T, P = key.batch, key.width, key.table
        z = np.zeros((B,), np.int32)
        adj = mask = None
        if key.logprobs is not None:
            adj = penalties.build(
                [None] * B, self.max_num_seqs, ADJUST_ENTRIES, ADJUST_STOPS, with_penalties=True
            )
            mask = np.full((B, -(-self.steps.cfg.vocab_size // 32)), -1, np.int32)
        sp = SamplingArrays.build(
            [SamplingParams(temperature=0.0)] * B,
            None,
            keys=np.zeros((B, 2), np.uint32),
            adjust=adj,
        )
        tokens = self._decode_tokens(z) if key.kind == "decode" else np.zeros((B, T), np.int32)
        return StepBatch(
            tokens,
            np.full((B, T), -1, np.int32),
            np.zeros((B, P), np.int32),
            z,
            z,
            sp,
            np.full((B, T), -1, np.int32) if key.prompt_logprobs is not None else None,
            mask,
            z if key.kind == "verify" else None,
        )
