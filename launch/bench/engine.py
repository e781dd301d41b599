"""ModelSteps benchmark on a true-geometry Kimi-K2.5 slice (D 7168, 384 INT4 experts, MLA 64 heads):
decode step time per layout and batch, tokens/s, the profiler's breakdown (collective count and
share), the planner's prediction beside each measurement, and the copy-bandwidth roofline of the run.

  kimi-bench engine --layers 3 --layouts single,tp2,tp2_ep,dp2_ep --batches 1,16,64,256
  kimi-bench engine --layers 61 --layouts tp8_ep --multi_batches 1,64,256 --steps 5 --context 2048
  kimi-bench engine --layers 61 --layouts dp8_ep --multi_batches 8,64,256,512 --steps 5 --context 2048

The last two: full-size Kimi-K2.5 (all 61 layers and 384 experts at the published shapes, random
values made on the devices) on 8 x H200, one layout per command (tp8, tp8_ep or dp8_ep; a DP layout
needs batch % 8 == 0). 595 GB of weights do not fit the machine's disk
as a synthetic checkpoint, so the loading path is measured on a slice (kimi-bench loading).

Weights are random (kimi_jax.tools.profiling.random_engine: the model's initializers, made on each layout's devices), or, with
--checkpoint, a real-format checkpoint (e.g. `kimi-make-synthetic --preset kimi-k2.5 --num_layers 3`)
streamed onto the devices of each layout by the loader; a decode
step is the engine's jitted step (contiguous latent cache at --context tokens, sampling included),
timed by wall clock per step with the sampled tokens fetched to the host (what generation pays).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import time

from absl import app, flags

from launch import common

flags.DEFINE_integer("layers", 3, "num_hidden_layers of the slice (first is dense)")
flags.DEFINE_list("layouts", ["single", "tp2", "tp2_ep", "dp2_ep"], "layouts to run")
flags.DEFINE_list("batches", ["1", "16", "64", "256"], "batches for the single-device layout")
flags.DEFINE_list("multi_batches", ["1", "64"], "batches for multi-device layouts")
flags.DEFINE_integer("context", 1024, "tokens already in the cache")
flags.DEFINE_integer("steps", 10, "timed decode steps per case")
flags.DEFINE_bool("paged", True, "time the serving step (paged cache, decode kernel); --nopaged: the "
                  "contiguous-cache reference step")
flags.DEFINE_integer("top_ops", 0, "print this many of each case's most expensive device ops")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_engine"), "results directory")
flags.DEFINE_string("hardware", "h200", "planner hardware preset for the predictions")
flags.DEFINE_bool("tiny", False, "CPU dry run on the tiny preset")
flags.DEFINE_list("mixed", [], "also time the engine's decode step (step_adapters.decode_step_async, "
                  "what generation runs) on mixed-length batches B:long:short (one row of `long` cached tokens, B - 1 of `short`), "
                  "on the first layout, with the engine's per-step MLA schedule choice and with the rows schedule")
flags.DEFINE_string("checkpoint", None, "load this safetensors/orbax checkpoint under each layout "
                    "instead of random weights (its config.json sets the model)")
FLAGS = flags.FLAGS

def parse_layout(name: str) -> tuple[int, int, bool]:
    """'single' | 'tp8' | 'tp8_ep' | 'dp8_ep' | 'dp2_tp4_ep' -> (tp, dp, ep)."""
    if name == "single":
        return 1, 1, False
    tp = dp = 1
    ep = False
    for part in name.split("_"):
        if part == "ep":
            ep = True
        elif part.startswith("tp") and part[2:].isdigit():
            tp = int(part[2:])
        elif part.startswith("dp") and part[2:].isdigit():
            dp = int(part[2:])
        else:
            raise ValueError(f"--layouts: cannot parse {name!r} (e.g. single, tp8, tp8_ep, dp8_ep, dp2_tp4_ep)")
    return tp, dp, ep


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the roofline of this run)."""
    import jax
    import jax.numpy as jnp
    n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 22)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * 4 * n / statistics.median(ts)


def parse_mixed(spec: str) -> tuple[int, int, int]:
    try:
        B, long, short = (int(v) for v in spec.split(":"))
    except ValueError:
        raise app.UsageError(f"--mixed: {spec!r} is not B:long:short (three integers)") from None
    if B < 2 or not 0 <= short <= long:
        raise app.UsageError(f"--mixed: {spec!r} needs B >= 2 and 0 <= short <= long")
    return B, long, short


def time_mixed(engine, layout, spec: str, steps: int) -> dict:
    """Seconds per decode step (`step_adapters.decode_step_async`, each step's tokens fed to the
    next, one wait at the end) for one long row among short ones: as the engine schedules the MLA kernels
    (`kimi_jax.engine.mla_schedule.mla_schedule_for`) and with its balanced choice switched off (rows
    schedule)."""
    import dataclasses
    import jax
    import numpy as np
    from kimi_jax.engine.mla_schedule import step_schedule
    from kimi_jax.tools.profiling import paged_args
    from kimi_jax.tools.step_adapters import decode_step_async
    B, long, short = parse_mixed(spec)
    cache_len = long + steps + 2
    pages, tokens, table, sp = paged_args(engine, layout, B, cache_len)
    start = np.asarray([long] + [short] * (B - 1), np.int32)
    base = engine.exec_plan
    row = dict(mixed=spec, batch=B, cached_tokens=int(start.sum()),
               chosen=step_schedule(base, start))
    for name, plan in (("engine", base), ("rows", dataclasses.replace(base, mla_schedule="rows"))):
        engine.exec_plan = plan                                 # a static argument of the step: its own compile
        try:
            tok = tokens[:, 0]
            for i in range(2 + steps):                     # 2 warm-up steps (compile), then timed
                if i == 2:
                    jax.block_until_ready(tok)
                    t0 = time.perf_counter()
                step_B = np.full(B, i, np.int32)
                pos = start + i
                pages, out = decode_step_async(engine, pages, tok, pos, table, sp, step_B, None)
                tok = out["tokens"]
            jax.block_until_ready(tok)
            row[f"{name}_ms"] = (time.perf_counter() - t0) / steps * 1e3
        finally:
            engine.exec_plan = base
    return row


def load_engine(path, cfg, layout, dtype):
    """An ModelSteps over a checkpoint, each device reading only its own slices (checkpoints.loader)."""
    from kimi_jax.engine.steps import ModelSteps
    from kimi_jax.entrypoints.weights import load_model
    return ModelSteps(load_model(path, cfg, layout, dtype), cfg, layout)


def main(argv):
    del argv
    for spec in FLAGS.mixed:           # before any engine is built
        parse_mixed(spec)
    common.setup()
    import jax
    import jax.numpy as jnp
    from kimi_jax.tools import hardware
    from kimi_jax.tools import planner
    from kimi_jax.config import preset
    from kimi_jax.tools.profiling import profile_decode, random_engine
    from kimi_jax.parallel.sharding import Layout

    if FLAGS.checkpoint:
        from kimi_jax.entrypoints.weights import read_checkpoint_config
        cfg = read_checkpoint_config(FLAGS.checkpoint)
    else:
        cfg = preset("tiny") if FLAGS.tiny else preset("kimi-k2.5").replace(num_hidden_layers=FLAGS.layers)
    os.makedirs(FLAGS.out, exist_ok=True)
    bw = copy_bandwidth()
    hw = hardware.get(FLAGS.hardware)
    rows, mixed_rows = [], []
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  jax {jax.__version__}  "
          f"copy {bw / 1e12:.2f} TB/s  model: {cfg.num_hidden_layers} layers", flush=True)
    for name in FLAGS.layouts:
        tp, dp, ep = parse_layout(name)
        layout = Layout(tp, dp, ep)
        if layout.world > jax.device_count():
            print(f"skip {name}: needs {layout.world} devices", flush=True)
            continue
        t0 = time.time()
        dtype = jnp.float32 if FLAGS.tiny else jnp.bfloat16
        if FLAGS.checkpoint:
            engine = load_engine(FLAGS.checkpoint, cfg, layout, dtype)
            how = f"loaded from {FLAGS.checkpoint}"
        else:
            engine = random_engine(cfg, layout, dtype=dtype)
            how = "random, placed"
        print(f"{layout.name}: weights {how} in {time.time() - t0:.1f}s", flush=True)
        batches = FLAGS.batches if layout.world == 1 else FLAGS.multi_batches
        for b in map(int, batches):
            rep = profile_decode(engine, layout, batch=b, context=FLAGS.context, steps=FLAGS.steps,
                                 out_dir=os.path.join(FLAGS.out, f"{name}_b{b}"), model_name="kimi-slice",
                                 paged=FLAGS.paged)
            for op in rep.top_ops[:FLAGS.top_ops]:
                print(f"  {name} b{b} {op['category']:<10} {1e3 * op['ms_per_step']:9.1f} us  {op['op'][:70]}",
                      flush=True)
            p = planner.plan(cfg, hw, layout, b, FLAGS.context)
            coll_ms = sum(rep.ms_per_step.get(k, 0.0) for k in ("all-reduce", "all-gather", "reduce-scatter",
                                                                  "all-to-all", "collective-permute"))
            n_coll = sum(rep.collectives_program.values())
            wbytes = sum(t.bytes for t in p.terms)       # bytes one device must read per step
            row = dict(layout=layout.name, batch=b, step_ms=rep.step_ms, device_ms=rep.device_step_ms,
                       tok_s=b / (rep.step_ms / 1e3), collectives=n_coll,
                       collective_ms=coll_ms, collective_share=coll_ms / rep.device_step_ms if rep.device_step_ms else 0,
                       pred_ms=p.step_s * 1e3, pred_collectives=p.count(),
                       read_bytes_per_device=wbytes, gbps=wbytes / (rep.step_ms / 1e3) / 1e9,
                       pct_copy=100 * wbytes / (rep.step_ms / 1e3) / bw, shares=rep.share)
            rows.append(row)
            print(json.dumps(row, default=float), flush=True)
            with open(os.path.join(FLAGS.out, "engine_rows.partial.jsonl"), "a") as f:   # survives a timeout
                f.write(json.dumps(row, default=float) + "\n")
        if FLAGS.mixed and name == FLAGS.layouts[0]:
            for spec in FLAGS.mixed:
                row = time_mixed(engine, layout, spec, FLAGS.steps)
                print(f"mixed {spec}: step {row['engine_ms']:.3f} ms as the engine schedules it "
                      f"({row['chosen'] or 'rows'}), {row['rows_ms']:.3f} ms on the rows schedule", flush=True)
                mixed_rows.append(dict(layout=layout.name, **row))
        del engine
        gc.collect()
    with open(os.path.join(FLAGS.out, "engine_rows.json"), "w") as f:
        json.dump(dict(copy_Bps=bw, jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows,
                       mixed=mixed_rows), f,
                  indent=1, default=float)
    print(f"\n{'layout':10} {'B':>4} {'step ms':>8} {'dev ms':>7} {'tok/s':>8} {'coll':>5} {'coll %':>6} "
          f"{'pred ms':>8} {'pred coll':>9} {'GB/s':>7} {'%copy':>6}")
    for r in rows:
        print(f"{r['layout']:10} {r['batch']:4d} {r['step_ms']:8.2f} {r['device_ms']:7.2f} {r['tok_s']:8.1f} "
              f"{r['collectives']:5d} {100 * r['collective_share']:5.1f}% {r['pred_ms']:8.2f} "
              f"{r['pred_collectives']:9d} {r['gbps']:7.0f} {r['pct_copy']:5.1f}%")


def run(argv=None) -> None:
    common.run(main, "kimi-bench engine", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
