"""The MLA decode schedule of a step, from the rows' host-side positions (`step_schedule`)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from kimi_jax import ops


# A decode step runs the MLA kernels on the balanced schedule when its rows' cached tokens total at
# least BALANCE_MIN_TOKENS and the longest row holds at least BALANCE_MIN_SKEW times the mean
# (BENCHMARKS.md, 'MLA decode with rows of mixed lengths').
BALANCE_MIN_TOKENS = 1 << 16
BALANCE_MIN_SKEW = 2.0


def mla_schedule_for(positions_B, pallas: bool) -> Optional[str]:
    """The decode step's MLA schedule from the rows' host-side positions (= cached tokens; < 0:
    padding): 'balanced' for a large, skewed batch on the Pallas kernels, else None (default)."""
    if not pallas:
        return None
    lengths = np.maximum(np.asarray(positions_B, np.int64), 0)
    total = int(lengths.sum())
    if total < BALANCE_MIN_TOKENS or lengths.max() * lengths.size < BALANCE_MIN_SKEW * total:
        return None
    return "balanced"


def can_balance(batch: int, row_tokens: int) -> bool:
    """Whether `mla_schedule_for` can pick 'balanced' for `batch` rows of < row_tokens tokens."""
    return batch >= BALANCE_MIN_SKEW and batch * row_tokens >= BALANCE_MIN_SKEW * BALANCE_MIN_TOKENS


def step_schedule(plan: ops.ExecPlan, positions_B) -> Optional[str]:
    """A decode step's MLA schedule: the plan's when it forces one, else `mla_schedule_for`'s."""
    if plan.mla_schedule is not None:
        return plan.mla_schedule
    return mla_schedule_for(positions_B, plan.pallas)
