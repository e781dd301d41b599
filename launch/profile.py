"""kimi-profile: where each decode step's time goes, from the JAX profiler, for one model and layout.

  kimi-profile --model=/path/to/checkpoint --tensor_parallel_size=8 --batch=8 --context=1024 --steps=5
  kimi-profile --model=tiny --config_override=num_attention_heads=8,n_routed_experts=16 \
      --cpu_devices=8 --tensor_parallel_size=8 --out=out/profile          # 8 simulated CPU devices
  kimi-profile --model=kimi-k2.5 --tensor_parallel_size=8 --compile_only --cpu_devices=8   # counts only

Runs --steps decode steps (after 2 warm-up steps) of the engine's jitted decode step under
jax.profiler.trace and prints, per step: total time, time and count of each kind of collective,
matmuls, attention and the rest, with shares; the collective counts also come from the compiled
program (trip counts of the layer loops applied), so they do not depend on the trace. Writes
OUT/report.json, OUT/breakdown.png (stacked bars: each traced step and the mean) and the raw trace
under OUT/trace (open the .trace.json.gz in Perfetto, or the directory in XProf / TensorBoard).
A preset model runs with random weights; a checkpoint directory loads through its Frontend.
--compile_only compiles the step over shapes alone (no weights), for models too big to run here.
"""
from __future__ import annotations

import gzip
import json
import os

from absl import flags

from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "preset name or checkpoint directory")
flags.DEFINE_list("config_override", [], "config fields to replace (presets), e.g. num_attention_heads=8")
flags.DEFINE_integer("batch", 8, "rows decoded together")
flags.DEFINE_integer("context", 256, "position of the decoded tokens (cache length: next power of two)")
flags.DEFINE_integer("steps", 5, "traced decode steps")
flags.DEFINE_string("out", "out/profile", "output directory (report.json, breakdown.png, trace/)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "parameter dtype")
flags.DEFINE_integer("cpu_devices", 0, "run on this many simulated CPU devices (0: the default backend)")
flags.DEFINE_bool("paged", True, "profile the serving step (paged latent cache; on a GPU the MLA decode kernel); "
                  "--nopaged: the contiguous-cache reference step")
flags.DEFINE_bool("compile_only", False, "count collectives in the compiled step (shapes only); no trace")


def main(argv):
    del argv
    if FLAGS.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        common.add_xla_flag(f"--xla_force_host_platform_device_count={FLAGS.cpu_devices}")
    common.setup()
    import jax
    import jax.numpy as jnp
    from kimi_jax.tools import profiling
    from kimi_jax.tools.planner import (collective_counts, collective_plan, padded_batch, parse_config_overrides,
                                  preset_or_checkpoint)
    from kimi_jax.parallel.sharding import Layout

    cfg, name = preset_or_checkpoint(FLAGS.model)
    if FLAGS.config_override:
        cfg = cfg.replace(**parse_config_overrides(FLAGS.config_override, cfg))
        name += " (" + ",".join(FLAGS.config_override) + ")"
    layout = Layout(**common.layout_kwargs())
    if layout.world > jax.device_count():
        common.fail("kimi-profile", f"layout {layout.name} needs {layout.world} devices; {jax.device_count()} "
                    f"{jax.default_backend()} device(s) visible (--cpu_devices={layout.world} simulates them)")
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[FLAGS.dtype]
    batch = padded_batch(FLAGS.batch, layout.data_parallel_size)
    rule = collective_counts(collective_plan(cfg, layout, batch, program=jax.default_backend()
                                             if jax.default_backend() in ("cpu", "gpu") else "gpu"))
    if FLAGS.compile_only:
        from kimi_jax.engine.steps import bucket
        counts = profiling.count_decode_collectives(cfg, layout, batch, bucket(FLAGS.context + 1), dtype)
        print(f"kimi-profile --compile_only: {name}, layout {layout.name}, batch {batch}, "
              f"{jax.device_count()} x {jax.default_backend()}")
        print(f"{'collective':<20}{'per step':>10}{'planner':>10}{'ops in HLO':>12}")
        static = counts.static_by_kind()
        for k, v in counts.by_kind().items():
            print(f"{k:<20}{v:>10}{rule[k]:>10}{static[k]:>12}")
        os.makedirs(FLAGS.out, exist_ok=True)
        with open(os.path.join(FLAGS.out, "collectives.json"), "w") as f:
            json.dump({"model": name, "layout": layout.name, "batch": batch, **counts.to_json()}, f, indent=1)
        with gzip.open(os.path.join(FLAGS.out, "decode_step.hlo.txt.gz"), "wt") as f:
            f.write(counts.hlo_text)
        return
    if os.path.isdir(FLAGS.model):
        from kimi_jax.entrypoints.frontend import Frontend
        engine = Frontend.from_config(common.engine_config()).steps
    else:
        engine = profiling.random_engine(cfg, layout, dtype)
    report = profiling.profile_decode(engine, layout, batch=batch, context=FLAGS.context, steps=FLAGS.steps,
                                      out_dir=FLAGS.out, model_name=name, paged=FLAGS.paged)
    print(report.table())
    print("planner rule (collectives per step): " + ", ".join(f"{k} {v}" for k, v in rule.items() if v))
    print(f"wrote {os.path.join(FLAGS.out, 'report.json')} and {os.path.join(FLAGS.out, 'breakdown.png')}")


def run(argv=None):
    """Console-script entry point (`kimi-profile`): a bad --model, override or layout is one line on
    stderr, exit status 2."""
    common.run(main, "kimi-profile", __name__, __doc__, argv=argv, errors=(ValueError, OSError))


if __name__ == "__main__":
    run()
