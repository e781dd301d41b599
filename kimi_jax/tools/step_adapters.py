"""`ModelSteps.step_jit` over loose arguments for the profiler and benchmarks, and `decode_jit`, the
contiguous-cache reference step the profiler lowers."""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional

import jax
import numpy as np

from kimi_jax import ops
from kimi_jax.engine.mla_schedule import step_schedule
from kimi_jax.engine.sampling import SamplingArrays
from kimi_jax.engine.sampling import sample_mode as sample_mode_of
from kimi_jax.engine.steps import (_OCC, ModelSteps, Occurrences, StepBatch, StepOutput, _constrain,
                                   _merge, _sample_out, is_fresh)


def _i32(a) -> np.ndarray:
    """Step inputs stay numpy: jit takes them through its C++ fast path."""
    return np.asarray(a, np.int32)


def decode_batch(tokens_B, positions_B, block_table_BP, sp: SamplingArrays, steps_B) -> StepBatch:
    """A decode step's StepBatch (positions_B [B], -1: padding); host inputs become int32 numpy."""
    arr = lambda a: a if isinstance(a, jax.Array) else _i32(a)         # noqa: E731
    positions_B = arr(positions_B)
    B = positions_B.shape[0]
    return StepBatch(arr(tokens_B), positions_B[:, None], arr(block_table_BP),
                     np.zeros((B,), np.int32), arr(steps_B), sp)


def scheduled_plan(plan: ops.ExecPlan, mla_schedule: Optional[str]) -> ops.ExecPlan:
    """plan with a decode step's MLA schedule (`step_schedule`), as the runner sets it."""
    if mla_schedule == plan.mla_schedule:
        return plan
    return dataclasses.replace(plan, mla_schedule=mla_schedule)


def paged_step(engine: ModelSteps, pages, tokens_BT, positions_BT, block_table_BP, last_B,
               sp: SamplingArrays, steps_B, n_logprobs: Optional[int],
               occ: Optional[Occurrences] = None, n_prompt_logprobs: Optional[int] = None,
               targets_BT=None, mask_Bw=None):
    """One step with host inputs, outputs fetched: (pages, StepOutput); T = 1 decodes, T > 1
    prefills. occ: the occurrence pool when sp has penalties (updated in place); mask_Bw: the
    packed token bitmask [B, ceil(V / 32)] (None: no row constrained, its own program)."""
    T = tokens_BT.shape[1]
    targets = None if n_prompt_logprobs is None else _i32(targets_BT)
    mask = None if mask_Bw is None else _i32(mask_Bw)
    batch = StepBatch(_i32(tokens_BT), _i32(positions_BT), _i32(block_table_BP), _i32(last_B),
                      _i32(steps_B), sp, targets, mask)
    pages, out = engine.step_jit(engine.weights, pages, batch, _occ_in(occ, sp),
                                 kind="decode" if T == 1 else "prefill", n_logprobs=n_logprobs,
                                 n_prompt_logprobs=n_prompt_logprobs,
                                 fresh=T > 1 and is_fresh(positions_BT),
                                 sample_mode=sample_mode_of(sp), plan=engine.exec_plan)
    _occ_out(occ, out)
    return pages, _to_host(out)


def decode_step_async(engine: ModelSteps, pages, tokens_B, positions_B, block_table_BP,
                      sp: SamplingArrays, steps_B, n_logprobs: Optional[int],
                      sample_mode: Optional[str] = None, occ: Optional[Occurrences] = None):
    """One decode step dispatched without a wait, on the runner's MLA schedule (`step_schedule`):
    tokens_B [B] may be the previous step's device tokens. Returns (pages, device outputs), their
    copy to the host started; sample_mode: pass it when sp is reused (skips the host check)."""
    if not isinstance(tokens_B, jax.Array):
        host = _i32(tokens_B)            # committed like a step's own output tokens
        tokens_B = jax.make_array_from_callback(host.shape, engine.token_sharding,
                                                lambda i: host[i])
    positions_B = _i32(positions_B)
    plan = scheduled_plan(engine.exec_plan, step_schedule(engine.exec_plan, positions_B))
    batch = decode_batch(tokens_B, positions_B, block_table_BP, sp, steps_B)
    pages, out = engine.step_jit(engine.weights, pages, batch, _occ_in(occ, sp), kind="decode",
                                 n_logprobs=n_logprobs,
                                 sample_mode=sample_mode or sample_mode_of(sp), plan=plan)
    _occ_out(occ, out)
    for o in out.values():
        if o.is_fully_addressable:
            o.copy_to_host_async()
    return pages, out


def _decode(graphdef, shard, state, cache, tokens_B, positions_B, sp, step_B, n_logprobs,
            sample_mode=None, *, plan: ops.ExecPlan):
    """One token per row, absorbed MLA over a contiguous cache {kind: [L, B, S, A+R]} (the
    profiler's and planner's reference step; generation runs the paged `ModelSteps.step_jit`)."""
    model = _merge(graphdef, state)
    tokens_B = _constrain(tokens_B, shard.get("batch1"))
    logits, cache = model(tokens_B[:, None], positions_B[:, None], cache, absorbed=True, plan=plan)
    cache = {k: _constrain(v, shard.get("cache")) for k, v in cache.items()}
    return cache, _sample_out(logits[:, 0], sp, step_B, n_logprobs, shard, sample_mode)


_DECODE_JITS: "weakref.WeakKeyDictionary[ModelSteps, object]" = weakref.WeakKeyDictionary()


def decode_jit(engine: ModelSteps):
    """The engine's contiguous-cache reference step `_decode`, jitted once per engine."""
    if engine not in _DECODE_JITS:
        _DECODE_JITS[engine] = jax.jit(functools.partial(_decode, engine.graphdef, engine._shard),
                                       static_argnames=("n_logprobs", "sample_mode", "plan"),
                                       donate_argnames=("cache",))
    return _DECODE_JITS[engine]


def _occ_in(occ: Optional[Occurrences], sp: SamplingArrays):
    """The pool array a step takes: only when its adjustments have penalties."""
    has = occ is not None and sp.adjust is not None and sp.adjust.has_penalties
    return occ.pool if has else None


def _occ_out(occ: Optional[Occurrences], out: dict) -> None:
    if _OCC in out:
        occ.pool = out.pop(_OCC)


def _to_host(out: dict) -> StepOutput:
    out = jax.device_get(out)
    return StepOutput(**{k: np.asarray(o) for k, o in out.items()})
