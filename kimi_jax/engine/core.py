"""The engine core: a policy-only Scheduler and a Runner that owns every device resource, composed,
under the one request API of every front end (docs/ARCHITECTURE.md, 'One step')."""
from __future__ import annotations

import random
import threading
import time
from typing import Callable, Optional

from kimi_jax.engine.args import CacheConfig, SchedulerConfig
from kimi_jax.engine.requests import Request, new_request, prefill_parent
from kimi_jax.engine.runner import Runner
from kimi_jax.engine.sampling import SamplingParams, key_data_for_seed
from kimi_jax.engine.scheduler import Scheduler
from kimi_jax.engine.shapes import Limits
from kimi_jax.engine.steps import ModelSteps
from kimi_jax.engine.validation import RequestError

_PASSES = {"prefill": "prefill_passes", "decode": "decode_passes", "verify": "verify_passes",
           "ragged": "ragged_passes"}


class EngineCore:
    """Requests in, finished samples out: `scheduler` plans and books (host state), `runner` runs
    the plans (device state). steps: the model's jitted steps, shared by the cores of one model;
    structured: the structured-outputs backend (None: none); seed: seeds requests without one."""

    def __init__(
        self,
        steps: ModelSteps,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        tokenizer=None,
        eos_ids=(),
        structured=None,
        seed: int = 0,
        fixed_buffers: bool = True,
    ):
        self.steps = steps
        self.scheduler_config, self.cache_config = scheduler_config, cache_config
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            vocab_size=steps.cfg.vocab_size,
            batch_size=steps.batch_size,
            dp=steps.dp,
            exec_plan=steps.exec_plan,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            pass_costs=steps.pass_costs,
            measure=self._measure,
        )
        lp = scheduler_config.max_logprobs
        self.runner = Runner(steps, num_pages=self.scheduler.pool.num_pages,
                             page_size=cache_config.page_size, cache_dtype=cache_config.dtype,
                             max_num_seqs=scheduler_config.max_num_seqs,
                             max_logprobs=lp if lp is not None and lp >= 0 else 20,
                             fixed_buffers=fixed_buffers, structured=structured,
                             row_pages=self.scheduler.ragged_shapes.max_pages,
                             spec_width=self.scheduler.spec_width)
        self._seeds = random.Random(seed)
        self._seed_lock = threading.Lock()

    # ---- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids, params: SamplingParams, *,
                     seed: Optional[int] = None, prompt: Optional[str] = None) -> list[Request]:
        """One prompt's params.num_samples (n, or best_of) validated samples (RequestError names
        what is wrong): sample i keyed by the seed's stream i, id f"{i}_{request_id}" (one:
        request_id). The seed is params.seed, else `seed`, else drawn here. Safe from any thread."""
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        s = self.scheduler
        params.validate(vocab_size=s.vocab_size, max_logprobs=s.max_logprobs)
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            with self._seed_lock:
                seed = self._seeds.getrandbits(31)
        k = params.num_samples
        ids = [request_id] if k == 1 else [f"{i}_{request_id}" for i in range(k)]
        reqs = [self._request(rid, prompt_ids, params, seed, prompt) for rid in ids]
        if k > 1:
            for i, r in enumerate(reqs):
                r.key, r.sample_index, r.group_id = key_data_for_seed(seed, i), i, request_id
        return reqs

    def _request(self, request_id: str, prompt_ids, params: SamplingParams, seed: int,
                 prompt: Optional[str]) -> Request:
        s = self.scheduler
        r = new_request(request_id, prompt_ids, params, seed, prompt, vocab_size=s.vocab_size,
                        max_model_len=s.max_model_len, page_size=s.page_size,
                        pages_per_rank=s.pool.per_part, dp=s.dp, eos_ids=s.eos_ids,
                        tokenizer=self.tokenizer, max_logprobs=s.max_logprobs)
        if params.structured_outputs is not None:
            r.structured = self.runner.matcher(params.structured_outputs, r.max_new)
        return r

    def add(self, samples: list[Request]) -> None:
        """Queue one prompt's samples; several prefill their prompt once (`prefill_parent`)."""
        now = time.time()
        for r in samples:
            r.arrival_time = r.arrival_time or now
        if len(samples) == 1 or len(samples[0].prompt_ids) < 2:
            for r in samples:
                self.scheduler.add(r)
        else:
            self.scheduler.add(prefill_parent(samples))

    def add_request(self, request_id: str, prompt_ids, params: SamplingParams, *,
                    seed: Optional[int] = None, prompt: Optional[str] = None) -> list[Request]:
        """`make_request` and `add` in one; returns the samples."""
        samples = self.make_request(request_id, prompt_ids, params, seed=seed, prompt=prompt)
        self.add(samples)
        return samples

    def abort(self, request_id: str) -> Optional[Request]:
        """Stop an unfinished sample and free its pages (None: no such sample); between steps."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def stats(self) -> dict:
        return self.scheduler.stats

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration's plans in turn; returns the samples that finished (overlap scheduling: a
        decode step may still be in flight, read by the next call)."""
        s, finished = self.scheduler, []
        if s.inflight is not None and not s.overlap_continues():
            finished += self.drain()
        while (plan := s.schedule()) is not None:
            self.runner.apply(s.pop_effects())
            s.stats["steps"] += 1
            s.stats[_PASSES[plan.kind]] += 1
            s.stats["overlapped_steps"] += plan.chained
            s.stats["spec_steps"] += plan.kind == "verify" or any(r.drafts for r in plan.rows)
            for done, out in self.runner.run(plan):
                finished += s.update(done, out)
            # sampled once the step before is booked (its grammars advanced)
            if plan.split:
                self.runner.sample(plan)
        return finished + s.take_stopped()

    def drain(self) -> list[Request]:
        """Book a decode step still in flight (overlap scheduling); returns the finished samples."""
        return [r for plan, out in self.runner.drain() for r in self.scheduler.update(plan, out)]

    def run(self, on_finish: Optional[Callable[[Request], None]] = None,
            feed: Optional[Callable[[], bool]] = None) -> None:
        """Step until every request is done; `feed()` adds requests while slots are free (False: no
        more)."""
        s = self.scheduler
        more = feed is not None
        idle = 0                  # consecutive steps that ran no pass and finished nothing
        while True:
            if more and len(s.waiting) < s.max_num_seqs:
                more = feed()
            if not s.has_unfinished():
                if not more:
                    break
                continue
            steps0 = s.stats["steps"]
            done = self.step()
            busy = done or s.stats["steps"] != steps0 or s.inflight is not None
            idle = 0 if busy else idle + 1
            if idle >= 3:         # no request can make progress: the first one ends where it is
                done = [s.unblock()]
                idle = 0
            for r in done:
                if on_finish is not None:
                    on_finish(r)
        for r in self.drain():      # a step past every request's end: nothing left to report
            if on_finish is not None:
                on_finish(r)

    def _measure(self, decode, verify) -> tuple[float, float]:
        self.runner.apply(self.scheduler.pop_effects())
        if decode.kind == "ragged":
            return self.runner.measure_ragged(decode, verify)
        return self.runner.measure_passes(decode, verify)

    # ---- the program set ------------------------------------------------------------------------
    def limits(self) -> Limits:
        """The bounds of this core's workloads (`Runner.programs`)."""
        return self.scheduler.limits(self.runner.max_logprobs)

    def programs(self) -> list:
        return self.runner.programs(self.limits())

    def precompile(self, progress: Optional[Callable] = None) -> int:
        """Compile every program of `programs()` (the pool unchanged); returns how many."""
        programs = self.programs()
        self.runner.precompile(programs, progress)
        return len(programs)
