r"""kimi-bench program_set: how many step programs each step layout declares, no timing.

  python3 -m launch.bench.program_set                     # the default limits, GPU and CPU plans
  python3 -m launch.bench.program_set --limits=64:4096:256:2048,256:131072:d:8192 --plans=gpu

Counts `Runner.programs(limits)` (what `precompile` builds and a workload within the limits can
run) for step_layout "padded" and "ragged" at each --limits entry SEQS:LEN[:CHUNK[:TOKENS]]
(max_num_seqs, max_model_len, prefill_chunk, max_prefill_tokens; CHUNK 'd': kimi-serve's default
for the plan, `frontend.default_prefill_chunk` of --preset in bfloat16 on the GPU plan and the demo
model's float32 on the CPU plan; TOKENS default 2048). The ragged budget (max_num_batched_tokens)
is max(TOKENS, SEQS), EngineConfig's default. The engine is a stand-in over shapes only (no
weights, no device arrays): the plans are `ExecPlan.for_backend('gpu', hopper=True)` (the H100 /
H200 plan: Pallas kernels, chunks of up to 64 tokens absorbed) and `ExecPlan.for_backend('cpu')`.
Overlap scheduling on (kimi-serve's default: split decode halves), no speculation, 16-token pages,
--num_pages pages. Rows go to stdout and --out/program_set.json.
"""
from __future__ import annotations

import json
import os
import types

from absl import flags

DEFAULT_LIMITS = ["8:2048:16:128", "32:4096:32:256", "64:4096:256:2048", "64:4096:512:2048",
                  "64:4096:d:2048", "64:8192:d:2048", "256:131072:d:8192"]
flags.DEFINE_list("limits", DEFAULT_LIMITS,
                  "SEQS:LEN[:CHUNK[:TOKENS]] entries (CHUNK d: the default)")
flags.DEFINE_list("plans", ["gpu", "cpu"], "ExecPlan.for_backend backends to count under")
flags.DEFINE_integer("num_pages", 16448,
                     "cache pages of the engine (a row's table is capped by them)")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_bool("overlap", True, "overlap scheduling (the padded set's split decode halves)")
flags.DEFINE_string("preset", "kimi-k2.5-61x16",
                    "model whose head dims set the GPU plan's default chunk")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_program_set"), "results directory")
FLAGS = flags.FLAGS


class ShapeSteps:
    """The part of a ModelSteps a Runner reads to declare its programs: dp, the plan, batch
    buckets; the page pool is empty (nothing is allocated)."""

    def __init__(self, plan, dp: int = 1):
        self.cfg = types.SimpleNamespace(vocab_size=16)
        self.dp, self.exec_plan, self.pass_costs = dp, plan, {}

    def batch_size(self, n: int) -> int:
        from kimi_jax.engine.shapes import bucket
        return -(-bucket(n, 1) // self.dp) * self.dp

    def init_pages(self, num_pages, page_size, dtype=None):
        return {}


def parse_limits(entry: str) -> tuple:
    """(seqs, max_model_len, chunk or None (the default), prefill tokens) of one --limits
    entry SEQS:LEN[:CHUNK[:TOKENS]]."""
    from absl import app
    parts = entry.split(":")
    if not 2 <= len(parts) <= 4 or not all(p.isdigit() or (i == 2 and p in ("d", "-"))
                                           for i, p in enumerate(parts)):
        raise app.UsageError(f"--limits entry {entry!r}: expected SEQS:LEN[:CHUNK[:TOKENS]] of "
                             "integers (CHUNK 'd': the default)")
    seqs, length = int(parts[0]), int(parts[1])
    chunk = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
    tokens = int(parts[3]) if len(parts) > 3 else 2048
    if min(seqs, length, tokens, chunk or 1) < 1 or length < 2:
        raise app.UsageError(f"--limits entry {entry!r}: every number must be >= 1 (LEN >= 2)")
    return seqs, length, chunk, tokens


def plan_of(backend: str):
    from kimi_jax import ops
    return ops.ExecPlan.for_backend(backend, hopper=backend == "gpu")


def default_chunk(backend: str, plan) -> int:
    """kimi-serve's prefill_chunk on this plan: --preset in bfloat16 (GPU), the demo model's
    float32 (CPU: the einsum path, whatever the head dims)."""
    import jax.numpy as jnp
    from kimi_jax.config import preset
    from kimi_jax.entrypoints.frontend import default_prefill_chunk
    dtype = jnp.bfloat16 if backend == "gpu" else jnp.float32
    return default_prefill_chunk(preset(FLAGS.preset), dtype, plan)


def count(plan, seqs: int, length: int, chunk: int, tokens: int, layout: str) -> dict:
    """The declared programs of one layout at these limits, by kind."""
    from kimi_jax.engine.runner import Runner
    from kimi_jax.engine.shapes import Limits
    runner = Runner(ShapeSteps(plan), num_pages=FLAGS.num_pages, page_size=FLAGS.page_size,
                    cache_dtype=None, max_num_seqs=seqs)
    limits = Limits(seqs, length, FLAGS.page_size, chunk, tokens, 20, 0,
                    pages_per_rank=FLAGS.num_pages, split_decode=FLAGS.overlap, step_layout=layout,
                    max_num_batched_tokens=max(tokens, seqs))
    progs = runner.programs(limits)
    if len(set(progs)) != len(progs):
        raise AssertionError(f"{layout} at {limits}: {len(progs) - len(set(progs))} duplicates")
    kinds: dict[str, int] = {}
    for k in progs:
        name = k.kind
        if k.kind == "prefill":
            name = "prefill fresh" if k.fresh else "prefill after cached"
        name += f" {k.part}" if k.part else ""
        kinds[name] = kinds.get(name, 0) + 1
    widths = sorted({k.width for k in progs if k.kind == "ragged" and k.part == "forward"})
    return dict(programs=len(progs), whole=sum(k.part is None for k in progs), kinds=kinds,
                widths=widths)


def main(argv):
    del argv
    import jax
    from absl import app
    entries = [parse_limits(e) for e in FLAGS.limits]
    for backend in FLAGS.plans:
        if backend not in ("gpu", "cpu"):
            raise app.UsageError(f"--plans: {backend!r} is not 'gpu' or 'cpu'")
    os.makedirs(FLAGS.out, exist_ok=True)
    rows = []
    print(f"# Runner.programs per layout; overlap {FLAGS.overlap}, {FLAGS.num_pages} pages of "
          f"{FLAGS.page_size} tokens; jax {jax.__version__}", flush=True)
    print(f"{'plan':4} {'seqs':>5} {'max_model_len':>13} {'chunk':>6} {'tokens':>6} "
          f"{'padded':>11} {'ragged':>5}  padded: all (whole-step programs), by kind / "
          "ragged T ladder", flush=True)
    for backend in FLAGS.plans:
        plan = plan_of(backend)
        for seqs, length, chunk, tokens in entries:
            c = chunk or default_chunk(backend, plan)
            padded = count(plan, seqs, length, c, tokens, "padded")
            ragged = count(plan, seqs, length, c, tokens, "ragged")
            row = dict(plan=backend, impl=plan.impl, max_num_seqs=seqs, max_model_len=length,
                       prefill_chunk=c, chunk_default=chunk is None, max_prefill_tokens=tokens,
                       max_num_batched_tokens=max(tokens, seqs), padded=padded, ragged=ragged)
            rows.append(row)
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(padded["kinds"].items()))
            star = "*" if chunk is None else " "
            print(f"{backend:4} {seqs:5d} {length:13d} {c:6d}{star}{tokens:6d} "
                  f"{padded['programs']:5d} ({padded['whole']}) {ragged['programs']:5d}  {kinds} / "
                  f"T {ragged['widths']}", flush=True)
    print("# * the plan's default prefill_chunk")
    with open(os.path.join(FLAGS.out, "program_set.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, num_pages=FLAGS.num_pages, page_size=FLAGS.page_size,
                       overlap=FLAGS.overlap, rows=rows), f, indent=1)


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench program_set", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
