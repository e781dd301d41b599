"""kimi-bench: the benchmarks that measure the product, one suite per command.

  kimi-bench                                   # the suites
  kimi-bench SUITE --help                      # a suite's own flags
  kimi-bench int4 --dry --sections=moe --out=/tmp/int4

Each suite writes its rows under its --out directory (results.jsonl and a markdown table, or the
suite's JSON); the numbers go in BENCHMARKS.md with the command, device, JAX version and date.
Every suite has a CPU dry run (tiny shapes or the tiny preset) that a test runs (tests/e2e/test_bench_scripts.py,
test_bench_full_depth.py; the mla suite's --combine_sweep: tests/kernels/test_mla_combine.py).
"""
from __future__ import annotations

import importlib
import sys
import textwrap
from typing import Optional, Sequence

PROG = "kimi-bench"

# name -> (module, what it measures)
SUITES = {
    "int4": ("launch.bench.int4", "INT4 expert kernels: dense matmul and MoE sweeps against XLA, ragged_dot, "
                                  "torch and cuBLAS baselines, with copy / matmul ceilings"),
    "mla": ("launch.bench.mla", "MLA paged decode and prefill attention: kernels vs XLA vs the copy ceiling, "
                                "kernel config sweeps, device ops per call"),
    "engine": ("launch.bench.engine", "the engine's decode step per layout and batch on a true-geometry Kimi "
                                      "slice, beside the planner's prediction"),
    "throughput": ("launch.bench.throughput", "continuous batching: output tokens/s, TTFT and TPOT at several "
                                              "max batch sizes"),
    "spec": ("launch.bench.spec", "speculative (n-gram) decoding off vs on, repetitive and non-repetitive "
                                  "workloads"),
    "loading": ("launch.bench.loading", "checkpoint loading against the raw read speed of the same files, "
                                        "peak host memory, orbax save and restore"),
    "prefix_cache": ("launch.bench.prefix_cache", "prefix caching on vs off: a shared-prefix workload (prefill "
                                                  "tokens computed, wall time) and a distinct-prompt one (the "
                                                  "cost of hashing)"),
    "program_costs": ("launch.bench.program_costs", "what sharing a step program would cost: decode block-table "
                                                    "widths, sampler variants, chunk prefill widths"),
    "full_depth": ("launch.bench.full_depth", "all 61 layers of Kimi-K2.5 in one decode step on one device: "
                                              "compile, dispatch and device time, command-buffer variants, "
                                              "the scheduler with overlap on and off"),
    "gemv": ("launch.bench.gemv", "the decode step's bf16 projections at their TP8 shard shapes against a copy "
                                  "of the same bytes"),
    "small_ops": ("launch.bench.small_ops", "the decode step's router and residual add + RMSNorm: XLA against "
                                            "their Pallas launches, kernels per call, device time"),
    "constrained": ("launch.bench.constrained", "decode steps with grammar-constrained rows in the batch: "
                                                "overlap scheduling's split step against the same batch "
                                                "unconstrained and the synchronous path"),
    "structured": ("launch.bench.structured", "structured outputs: llguidance vs xgrammar grammar compile and "
                                              "mask fill, the mask's cost in the sampler and the decode step"),
    "dtype": ("launch.bench.dtype", "the demo model's greedy decoding in each dtype: tokens/s end to end and "
                                    "the jitted step alone"),
    "lowering": ("launch.bench.lowering", "seconds to trace and lower (not compile) the serving step at 1 to 61 "
                                          "layers, over shapes only"),
    "step_layout": ("launch.bench.step_layout", "the padded and the ragged step layout on the demo model: cold "
                                                "and warm start, precompile, kimi-generate, decode, kimi-serve"),
    "invariance": ("launch.bench.invariance", "batch invariance checked and priced: every request alone "
                                              "and in random batches, mismatches and tokens/s with "
                                              "batch_invariant on and off"),
    "layout_depth": ("launch.bench.layout_depth", "the padded and the ragged step layout's decode step at "
                                                  "depth through the engine core: ms a step and a kernel "
                                                  "census"),
    "program_set": ("launch.bench.program_set", "how many step programs the padded and the ragged step "
                                                "layouts declare at given limits, GPU and CPU plans"),
}
HELP_ARGS = ("--help", "-h", "-help", "--helpshort", "--helpfull", "-?")


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [f"usage: {PROG} SUITE [flags]     ({PROG} SUITE --help: the suite's flags)", "", "suites:"]
    for name, (_, what) in SUITES.items():
        lines += textwrap.wrap(what, 96, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
    return "\n".join(lines) + "\n"


def run(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point: `kimi-bench SUITE [flags]` (also `--suite=SUITE` / `--suite SUITE`)."""
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if args and args[0].startswith("--suite"):
        name, eq, value = args[0].partition("=")
        args = ([value] if eq else args[1:2]) + (args[1:] if eq else args[2:])
    if not args or args[0] in HELP_ARGS:
        sys.stdout.write(__doc__.split("\n\n", 1)[0] + "\n\n" + usage())
        sys.exit(0)
    name = args[0]
    if name not in SUITES:
        sys.stderr.write(f"{PROG}: error: unknown suite {name!r} (suites: {', '.join(SUITES)})\n")
        sys.exit(2)
    importlib.import_module(SUITES[name][0]).run([f"{PROG} {name}"] + args[1:])


if __name__ == "__main__":
    run()
