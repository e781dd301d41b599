"""What several kimi-bench suites share: a timed run of requests through the continuous-batching
engine, device and wall time of one executable, and writing a suite's JSON result."""
from __future__ import annotations

import json
import os
import statistics
import time


def run_prompts(llm, prompts, sp):
    """`prompts` (token id lists) through a fresh batch engine of `llm` with SamplingParams `sp`:
    request i is named str(i) and seeded i; all are added at once (every request arrives at the start,
    so queueing behind the batch is in its time to first token) and run until every one finished.
    Returns (wall seconds from the first add to the end, the requests, the engine's stats)."""
    be = llm.batch_engine()
    reqs = [be.make_request(str(i), p, sp, seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        be.add(r)
    be.run()
    return time.perf_counter() - t0, reqs, be.stats


def write_json(out: str, name: str, obj) -> str:
    """Write `obj` as JSON to `out` when it names a .json file, else to `out`/`name` (the directory
    made as needed). Returns the path."""
    path = out if out.endswith(".json") else os.path.join(out, name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    return path


def timed(f, args, copies: int, reps: int) -> dict:
    """f(*args) (an executable of `copies` calls) compiled and run: per call, the profiler's kernel time
    (kernel_us), the span of its device ops (span_us), the median wall time over `reps` runs (wall_us);
    the kernels per executable (kernels) and their names, most expensive first."""
    import jax
    from kimi_jax.tools.profiling import device_ops_per_call
    compiled = jax.jit(f).lower(*args).compile()
    per_op, span, _ = device_ops_per_call(compiled, args, 1)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls.append(time.perf_counter() - t0)
    return dict(kernel_us=sum(per_op.values()) / copies, span_us=span / copies,
                wall_us=1e6 * statistics.median(walls) / copies, kernels=len(per_op), kernel_names=list(per_op))
