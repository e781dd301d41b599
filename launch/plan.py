"""kimi-plan: what a layout costs before it runs (bytes per device, fit, decode step time, tokens/s).

  kimi-plan --model=kimi-k2.5 --hardware=h200 --tensor_parallel_size=8 --batch=16 --context=8192
  kimi-plan --model=kimi-k2.5 --hardware=h200 --world=8 --batch=16      # every layout, ranked
  kimi-plan --anchor                                                   # the published RTX PRO 6000 case
  kimi-plan --engine=vllm --hardware=rtx-pro-6000 --tensor_parallel_size=8 --allreduce_us=78   # vLLM's TP step
  kimi-plan --hardware=calibration.json ...                            # measured numbers (launch/bench/int4.py)

With no layout flag given, every layout of --world devices is planned and those that fit are ranked
by tokens/s. --compiled_counts also compiles the engine's decode step for the layout on simulated CPU
devices (shapes only, no weights) and prints the collective counts of the compiled program beside the
planner's rules. The model behind the numbers: docs/PLANNER.md.
"""
from __future__ import annotations

import json
import os
import sys

from absl import flags

from launch import common  # (layout flags: --tensor_parallel_size, --data_parallel_size, ...)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "kimi-k2.5", "preset name or checkpoint directory (its config.json)")
flags.DEFINE_list("config_override", [], "config fields to replace, e.g. num_hidden_layers=4,n_routed_experts=64")
flags.DEFINE_string("hardware", "h200", "hardware preset (h200, h100, b200, rtx-pro-6000) or calibration .json")
flags.DEFINE_integer("batch", 1, "sequences decoded together")
flags.DEFINE_integer("context", 4096, "tokens per sequence (prompt + generated) the cache must hold")
flags.DEFINE_integer("world", 8, "devices, when no layout flag is given (plans every layout)")
flags.DEFINE_float("allreduce_us", None, "time per all-reduce in us (as profiled); replaces the hardware model")
flags.DEFINE_enum("impl", "pallas", ["pallas", "xla"], "expert kernels: fused INT4 (pallas) or XLA dequant")
flags.DEFINE_float("mem_fraction", 0.92, "fraction of device memory the engine may use")
flags.DEFINE_bool("engine_artifacts", True, "include what the current engine adds beyond the design "
                  "(collectives; see kimi_jax.tools.planner)")
flags.DEFINE_enum("engine", "kimi_jax", ["kimi_jax", "vllm"], "whose decode step's collectives to plan: this "
                  "engine's, or vLLM's tensor-parallel step (sources in kimi_jax.tools.planner.VLLM_TP_SOURCES)")
flags.DEFINE_bool("anchor", False, "plan the published case (Kimi-K2.5 INT4, 8 x RTX PRO 6000, TP8 on vLLM, "
                  "78 us all-reduce) and print it beside the published profile")
flags.DEFINE_bool("compiled_counts", False, "also count collectives in the compiled decode step (CPU, shapes only)")
flags.DEFINE_string("json", None, "write the plan(s) as JSON here")


def _layout_given() -> bool:
    return any(FLAGS[f].present for f in ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel"))


def _config():
    from kimi_jax.tools.planner import parse_config_overrides, preset_or_checkpoint
    cfg, name = preset_or_checkpoint(FLAGS.model)
    if FLAGS.config_override:
        cfg = cfg.replace(**parse_config_overrides(FLAGS.config_override, cfg))
        name += " (" + ",".join(FLAGS.config_override) + ")"
    return cfg, name


def main(argv):
    del argv
    from kimi_jax.tools import hardware
    from kimi_jax.tools import planner
    from kimi_jax.parallel.sharding import Layout
    if FLAGS.anchor:
        a = planner.ANCHOR_RTX6KPRO
        cfg, name = planner.preset_or_checkpoint(a["model"])
        hw = hardware.get(a["hardware"])
        opts = planner.PlanOptions(allreduce_us=a["allreduce_us"], mem_fraction=FLAGS.mem_fraction,
                                   engine=a["engine"])
        p = planner.plan(cfg, hw, Layout(a["tensor_parallel_size"]), a["batch"], a["context"], opts, model_name=name)
        print(p.table())
        print()
        print(planner.anchor_report(p))
        _dump([p])
        return
    cfg, name = _config()
    hw = hardware.get(FLAGS.hardware)
    opts = planner.PlanOptions(impl=FLAGS.impl, allreduce_us=FLAGS.allreduce_us, mem_fraction=FLAGS.mem_fraction,
                               engine_artifacts=FLAGS.engine_artifacts, engine=FLAGS.engine)
    print(hw.describe())
    if _layout_given():
        layout = Layout(FLAGS.tensor_parallel_size, FLAGS.data_parallel_size, FLAGS.enable_expert_parallel)
        p = planner.plan(cfg, hw, layout, FLAGS.batch, FLAGS.context, opts, model_name=name)
        print(p.table())
        if FLAGS.compiled_counts and FLAGS.engine == "kimi_jax":
            _print_compiled(cfg, layout, p)
        _dump([p])
        return
    fits, rejected = planner.rank_layouts(cfg, hw, FLAGS.world, FLAGS.batch, FLAGS.context, opts, model_name=name)
    print(f"kimi-plan: {name} on {FLAGS.world} x {hw.name}, batch {FLAGS.batch}, context {FLAGS.context}: "
          f"{len(fits)} layouts fit")
    print(planner.ranking_table(fits, rejected))
    if fits:
        print()
        print(fits[0].table())
    _dump(fits)


def _print_compiled(cfg, layout, p):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    common.add_xla_flag(f"--xla_force_host_platform_device_count={layout.world}")
    from kimi_jax.tools import planner
    from kimi_jax.tools.profiling import count_decode_collectives
    counts = count_decode_collectives(cfg, layout, p.batch_padded, min(p.cache_len, 256))
    rule = planner.collective_counts(planner.collective_plan(cfg, layout, p.batch_padded, program="cpu"))
    compiled = counts.by_kind()
    print("collectives per step, compiled here on CPU:   " + "  ".join(f"{k} {rule[k]}/{compiled[k]}" for k in rule)
          + "   (planner's CPU rule / compiled program; the plan above uses the GPU rule)")
    trivial = {k: v - compiled[k] for k, v in counts.by_kind(trivial=True).items() if v - compiled[k]}
    if trivial:
        print(f"  also in the program, over groups of one device (nothing moves): {trivial}")
    if rule != compiled:
        print("  MISMATCH: the compiled program differs from the planner's rules for this layout")


def _dump(plans):
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump([p.to_json() for p in plans], f, indent=1, default=str)
        print(f"wrote {FLAGS.json}", file=sys.stderr)


def run(argv=None):
    """Console-script entry point (`kimi-plan`): a bad --model, --hardware, override or layout is one
    line on stderr, exit status 2."""
    common.run(main, "kimi-plan", __name__, __doc__, argv=argv, errors=(ValueError, OSError))


if __name__ == "__main__":
    run()
