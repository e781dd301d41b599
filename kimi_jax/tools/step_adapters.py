"""The engine's step over loose arguments, for the profiler and the benchmarks (the runner lays out
its own StepBatch): `paged_step` (one step, host inputs and outputs), `decode_step_async` (one
decode step left in flight), `decode_batch` (a decode step's StepBatch), all on `Engine.step_jit`,
the program the runner drives; and `decode_jit`, the contiguous-cache reference step the profiler
lowers, a jitted function of its own."""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional

import jax
import numpy as np

from kimi_jax import ops
from kimi_jax.engine.sampling import SamplingArrays
from kimi_jax.engine.sampling import sample_mode as sample_mode_of
from kimi_jax.engine.steps import (_OCC, Engine, Occurrences, StepBatch, StepOutput, _constrain, _merge,
                                   _sample_out, is_fresh, step_schedule)


def _i32(a) -> np.ndarray:
    """Step inputs stay numpy: jit takes them through its C++ fast path."""
    return np.asarray(a, np.int32)


def decode_batch(tokens_B, positions_B, block_table_BP, sp: SamplingArrays, steps_B) -> StepBatch:
    """A decode step's StepBatch: one token per row at positions_B [B] (-1: padding), each row
    sampling from its only column. Host inputs become int32 numpy; device or traced arrays stay."""
    arr = lambda a: a if isinstance(a, jax.Array) else _i32(a)         # noqa: E731
    positions_B = arr(positions_B)
    B = positions_B.shape[0]
    return StepBatch(arr(tokens_B), positions_B[:, None], arr(block_table_BP), np.zeros((B,), np.int32),
                     arr(steps_B), sp)


def scheduled_plan(plan: ops.ExecPlan, mla_schedule: Optional[str]) -> ops.ExecPlan:
    """plan with a decode step's MLA schedule (`mla_schedule.step_schedule`), as the runner sets it."""
    if mla_schedule == plan.mla_schedule:
        return plan
    return dataclasses.replace(plan, mla_schedule=mla_schedule)


def paged_step(engine: Engine, pages, tokens_BT, positions_BT, block_table_BP, last_B, sp: SamplingArrays,
               steps_B, n_logprobs: Optional[int], occ: Optional[Occurrences] = None,
               n_prompt_logprobs: Optional[int] = None, targets_BT=None, mask_Bw=None):
    """One step over the paged cache with host inputs, its outputs fetched: (pages, StepOutput).
    T = 1 decodes (absorbed MLA), T > 1 prefills (fresh when no row has cached tokens). occ: the
    occurrence pool, when sp's adjustments have penalties (updated in place). With
    n_prompt_logprobs: targets_BT [B, T] (see `steps._step`). mask_Bw: structured outputs' packed
    int32 token bitmask [B, ceil(V / 32)] (None: no row is constrained; a separate compiled
    program, so unconstrained batches pay nothing)."""
    T = tokens_BT.shape[1]
    targets = None if n_prompt_logprobs is None else _i32(targets_BT)
    batch = StepBatch(_i32(tokens_BT), _i32(positions_BT), _i32(block_table_BP), _i32(last_B), _i32(steps_B),
                      sp, targets, None if mask_Bw is None else _i32(mask_Bw))
    pages, out = engine.step_jit(engine.weights, pages, batch, _occ_in(occ, sp),
                                 kind="decode" if T == 1 else "prefill", n_logprobs=n_logprobs,
                                 n_prompt_logprobs=n_prompt_logprobs, fresh=T > 1 and is_fresh(positions_BT),
                                 sample_mode=sample_mode_of(sp), plan=engine.plan)
    _occ_out(occ, out)
    return pages, _to_host(out)


def decode_step_async(engine: Engine, pages, tokens_B, positions_B, block_table_BP, sp: SamplingArrays,
                      steps_B, n_logprobs: Optional[int], sample_mode: Optional[str] = None,
                      occ: Optional[Occurrences] = None):
    """One decode step (one token per row) dispatched without waiting for it, on the MLA schedule the
    runner picks (`mla_schedule.step_schedule`): tokens_B [B] may be a device array (the previous
    step's `out["tokens"]`); positions_B [B] (-1: padding row). Returns (pages, outputs as device
    arrays: {tokens [B], and with n_logprobs: logprob, rank, top_ids, top_vals}), their copy to the
    host already started. sample_mode: as `paged_step` derives it (pass it when sp is reused, to skip
    the host check)."""
    if not isinstance(tokens_B, jax.Array):
        host = _i32(tokens_B)            # committed like a step's own output tokens (Engine.token_sharding)
        tokens_B = jax.make_array_from_callback(host.shape, engine.token_sharding, lambda i: host[i])
    positions_B = _i32(positions_B)
    plan = scheduled_plan(engine.plan, step_schedule(engine.plan, positions_B))
    pages, out = engine.step_jit(engine.weights, pages, decode_batch(tokens_B, positions_B, block_table_BP, sp,
                                                                     steps_B),
                                 _occ_in(occ, sp), kind="decode", n_logprobs=n_logprobs,
                                 sample_mode=sample_mode or sample_mode_of(sp), plan=plan)
    _occ_out(occ, out)
    for o in out.values():
        if o.is_fully_addressable:
            o.copy_to_host_async()
    return pages, out


def _decode(graphdef, shard, state, cache, tokens_B, positions_B, sp, step_B, n_logprobs, sample_mode=None, *,
            plan: ops.ExecPlan):
    """One token per row at its position, absorbed MLA over a contiguous cache {kind: [L, B, S, A+R]}
    (the profiler's and planner's reference step; generation runs the paged `Engine.step_jit`)."""
    model = _merge(graphdef, state)
    tokens_B = _constrain(tokens_B, shard.get("batch1"))
    logits, cache = model(tokens_B[:, None], positions_B[:, None], cache, absorbed=True, plan=plan)
    cache = {k: _constrain(v, shard.get("cache")) for k, v in cache.items()}
    return cache, _sample_out(logits[:, 0], sp, step_B, n_logprobs, shard, sample_mode)


_DECODE_JITS: "weakref.WeakKeyDictionary[Engine, object]" = weakref.WeakKeyDictionary()


def decode_jit(engine: Engine):
    """The engine's contiguous-cache reference step, jitted once per engine:
    `(state, cache, tokens_B, positions_B, sp, step_B, n_logprobs, sample_mode=None, *, plan)`, the
    cache donated."""
    if engine not in _DECODE_JITS:
        _DECODE_JITS[engine] = jax.jit(functools.partial(_decode, engine.graphdef, engine._shard),
                                       static_argnames=("n_logprobs", "sample_mode", "plan"),
                                       donate_argnames=("cache",))
    return _DECODE_JITS[engine]


def _occ_in(occ: Optional[Occurrences], sp: SamplingArrays):
    """The pool array a step takes: only when its adjustments have penalties."""
    return occ.pool if occ is not None and sp.adjust is not None and sp.adjust.has_penalties else None


def _occ_out(occ: Optional[Occurrences], out: dict) -> None:
    if _OCC in out:
        occ.pool = out.pop(_OCC)


def _to_host(out: dict) -> StepOutput:
    out = jax.device_get(out)
    return StepOutput(**{k: np.asarray(o) for k, o in out.items()})
