r"""kimi-bench lowering: seconds to trace and lower (not compile) the engine's serving step at depth.

  python3 -m launch.bench.lowering                         # kimi-k2.5-61x16 at 1, 4, 16, 61 layers
  python3 -m launch.bench.lowering --layers=2 --tiny       # CPU dry run (the tiny preset's shapes)
  PYTHONPATH=/other/tree python3 /this/tree/launch/bench/lowering.py   # the same rows for another tree

`ModelSteps.step_jit` is lowered over shapes only (the weights, pages and batch as ShapeDtypeStructs: nothing is
allocated, so any depth runs on a CPU) for a decode program (one token per row), a fresh prefill and a
prefill chunk after cached tokens, under the plan the flags give (default: the unrolled loop over
per-layer weights, the GPU plan's loop). jax's caches are cleared before each program, so every row is a
cold trace + lowering, as the first program of a process pays it. With --compile each program is also
compiled (seconds, and the optimized module's instruction count: equal counts across two trees say the
layer calls were inlined away). Rows go to stdout and --out/lowering_rows.jsonl.
"""
from __future__ import annotations

import json
import os
import time

from absl import flags

flags.DEFINE_list("layers", ["1", "4", "16", "61"], "num_hidden_layers to lower at")
flags.DEFINE_string("preset", "kimi-k2.5-61x16", "model preset (kimi_jax.config.preset)")
flags.DEFINE_list("programs", ["decode", "prefill", "chunk"], "decode, prefill (fresh) and/or chunk (after cached)")
flags.DEFINE_integer("batch", 8, "rows per program")
flags.DEFINE_integer("width", 512, "prefill tokens per row")
flags.DEFINE_integer("table", 256, "block-table pages per row")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_enum("layer_loop", "unroll", ["unroll", "scan"], "ExecPlan.layer_loop")
flags.DEFINE_enum("layer_weights", "auto", ["auto", "per_layer", "stacked"],
                  "ExecPlan.layer_weights (auto: per_layer under unroll)")
flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas"], "ExecPlan.impl (auto: pallas on a GPU)")
flags.DEFINE_integer("repeat", 1, "cold lowerings per program; the row is the fastest (other load only adds)")
flags.DEFINE_bool("compile", False, "also compile each lowered program")
flags.DEFINE_bool("tiny", False, "CPU dry run: the tiny preset, small shapes")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_lowering"), "results directory")
FLAGS = flags.FLAGS


def abstract_serving_engine(cfg, plan, dtype):
    """An ModelSteps over ShapeDtypeStructs with the plan's weight layout (per-layer weights split over shapes)."""
    import jax
    from flax import nnx
    from kimi_jax.engine.steps import ModelSteps
    from kimi_jax.model import layer_weights
    from kimi_jax.model.transformer import abstract_model

    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    if plan.layer_weights == "per_layer":
        def split(s):
            layer_weights.split_layers(s, cfg)
            return s
        state = jax.eval_shape(split, state)
    return ModelSteps(nnx.merge(graphdef, state), cfg, None, plan=plan)


def program_args(engine, program: str, batch: int, width: int, table: int, page_size: int):
    """(pages, StepBatch, static kwargs) of one step program, all ShapeDtypeStructs."""
    import jax
    import numpy as np
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    from kimi_jax.engine.steps import StepBatch
    cfg = engine.cfg
    B, T = batch, 1 if program == "decode" else width
    P = -(-T // page_size) if program == "prefill" else table
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)   # noqa: E731
    pages = {k: jax.ShapeDtypeStruct((n, B * P, page_size, cfg.latent_dim), engine.cache_dtype)
             for k, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)) if n}
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * B, None, keys=np.zeros((B, 2), np.uint32))
    sp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), sp)
    step = StepBatch(i32(B) if program == "decode" else i32(B, T), i32(B, T), i32(B, P), i32(B), i32(B), sp)
    kind = "decode" if program == "decode" else "prefill"
    return pages, step, dict(kind=kind, fresh=program == "prefill", sample_mode="greedy")


def measure(cfg, plan, dtype, program: str, *, compile_too: bool) -> dict:
    import jax
    jax.clear_caches()
    engine = abstract_serving_engine(cfg, plan, dtype)
    pages, step, static = program_args(engine, program, FLAGS.batch, FLAGS.width, FLAGS.table, FLAGS.page_size)
    t0 = time.perf_counter()
    traced = engine.step_jit.trace(engine.state, pages, step, None, plan=plan, **static)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    row = dict(program=program, layers=cfg.num_hidden_layers, trace_s=round(t1 - t0, 3), lower_s=round(t2 - t1, 3),
               total_s=round(t2 - t0, 3), stablehlo_chars=len(lowered.as_text()))
    if compile_too:
        compiled = lowered.compile()
        row.update(compile_s=round(time.perf_counter() - t2, 2),
                   hlo_instructions=sum(" = " in line for line in compiled.as_text().splitlines()))
    return row


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from kimi_jax import ops
    from kimi_jax.config import preset

    os.makedirs(FLAGS.out, exist_ok=True)
    if FLAGS.tiny:
        FLAGS.batch, FLAGS.width, FLAGS.table = 2, 16, 4
    base = preset("tiny" if FLAGS.tiny else FLAGS.preset)
    dtype = jnp.float32 if FLAGS.tiny else jnp.bfloat16
    weights = FLAGS.layer_weights
    if weights == "auto":
        weights = "per_layer" if FLAGS.layer_loop == "unroll" else "stacked"
    plan = ops.ExecPlan.for_backend(layer_loop=FLAGS.layer_loop, layer_weights=weights, impl=FLAGS.impl)
    print(f"# plan: impl={plan.impl} layer_loop={plan.layer_loop} layer_weights={plan.layer_weights}; "
          f"batch {FLAGS.batch}, prefill width {FLAGS.width}, table {FLAGS.table} pages; "
          f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    print(f"{'program':8} {'layers':>6} {'trace s':>8} {'lower s':>8} {'total s':>8}"
          + (f" {'compile s':>9} {'HLO instrs':>10}" if FLAGS.compile else ""), flush=True)
    for n in (int(x) for x in FLAGS.layers):
        cfg = base.replace(num_hidden_layers=n, first_k_dense_replace=min(base.first_k_dense_replace, n - 1))
        for program in FLAGS.programs:
            r = min((measure(cfg, plan, dtype, program, compile_too=FLAGS.compile) for _ in range(FLAGS.repeat)),
                    key=lambda row: row["total_s"])
            r.update(impl=plan.impl, layer_loop=plan.layer_loop, layer_weights=plan.layer_weights,
                     preset="tiny" if FLAGS.tiny else FLAGS.preset, batch=FLAGS.batch, jax=jax.__version__,
                     device=jax.devices()[0].device_kind)
            print(f"{program:8} {n:6d} {r['trace_s']:8.3f} {r['lower_s']:8.3f} {r['total_s']:8.3f}"
                  + (f" {r['compile_s']:9.2f} {r['hlo_instructions']:10d}" if FLAGS.compile else ""), flush=True)
            with open(os.path.join(FLAGS.out, "lowering_rows.jsonl"), "a") as f:
                f.write(json.dumps(r) + "\n")


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench lowering", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
