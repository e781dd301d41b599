"""Flags and start-up shared by every launcher (absl lives only in launch/).

`setup()` must run before JAX touches a device: it sets the XLA options that let collectives overlap
compute and starts multi-process JAX when asked.

XLA options set by default on GPU (--xla_perf, on by default):
  JAX optimization level O1 (jax_optimization_level / JAX_OPTIMIZATION_LEVEL): turns on XLA:GPU's
    latency-hiding scheduler (async collectives are scheduled to overlap independent compute),
    collective pipelining, the SOL latency estimator on Hopper and while-loop double buffering.
  --xla_gpu_enable_latency_hiding_scheduler=true: the same scheduler, explicitly, for jax versions
    without optimization levels.
  NCCL_NVLS_ENABLE=0: NVLink multicast stays off (required on this project's machines).
"""
from __future__ import annotations

import os
import sys

from absl import flags

FLAGS = flags.FLAGS

flags.DEFINE_integer("tensor_parallel_size", 1, "devices that split heads / FFN width (TP)")
flags.DEFINE_integer("data_parallel_size", 1, "devices that split the batch (DP attention)")
flags.DEFINE_bool("enable_expert_parallel", False, "whole experts per device (EP) instead of TP slices")
flags.DEFINE_integer("prefill_chunk", None, "prompt tokens of one request per prefill step (a longer prompt "
                     "takes several steps, interleaved with decode steps); default: LLM's")
flags.DEFINE_integer("max_prefill_tokens", None, "prompt tokens of all requests per prefill step; default: LLM's")
flags.DEFINE_bool("check_finite_weights", True, "check every loaded weight for NaN / Inf (one fused "
                  "reduction per tensor on its devices) and refuse a checkpoint that has one")
flags.DEFINE_bool("xla_perf", True, "set XLA options that overlap collectives with compute (see launch/common.py)")
flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0")
flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
flags.DEFINE_integer("process_id", None, "multi-host: this process's index")


def setup() -> None:
    """XLA options and multi-process start; call first in every launcher's main()."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if FLAGS.xla_perf:
        os.environ.setdefault("JAX_OPTIMIZATION_LEVEL", "O1")
        xf = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_enable_latency_hiding_scheduler" not in xf:
            os.environ["XLA_FLAGS"] = (xf + " --xla_gpu_enable_latency_hiding_scheduler=true").strip()
    if FLAGS.num_processes and FLAGS.num_processes > 1:
        from kimi_jax.parallel.distributed import initialize
        initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def layout_kwargs() -> dict:
    """The LLM(...) layout arguments from the flags."""
    return dict(tensor_parallel_size=FLAGS.tensor_parallel_size, data_parallel_size=FLAGS.data_parallel_size,
                enable_expert_parallel=FLAGS.enable_expert_parallel)


def engine_kwargs() -> dict:
    """The LLM(...) layout arguments and the scheduling ones given on the command line (the others keep
    LLM's defaults)."""
    sched = {k: getattr(FLAGS, k) for k in ("prefill_chunk", "max_prefill_tokens") if getattr(FLAGS, k) is not None}
    return dict(layout_kwargs(), **sched, check_finite_weights=FLAGS.check_finite_weights)


def fail(prog: str, message) -> None:
    """A user error (bad checkpoint, config, layout, flag or input): one line on stderr, exit status 2."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    sys.exit(2)


def flags_parser(prog: str, positional_hint: str = ""):
    """An absl flags_parser for app.run: a bad flag is one line on stderr and exit status 2."""
    def parse(argv):
        try:
            rest = FLAGS(argv)
        except flags.Error as e:
            fail(prog, f"{e} (see --helpshort)")
        if len(rest) > 1:
            fail(prog, f"unexpected positional arguments {rest[1:]!r}{positional_hint}")
        return rest
    return parse


def user_errors():
    """The exception types that launchers report as one line with exit status 2."""
    from checkpoints.safetensors_io import CheckpointError
    from kimi_jax.config import ConfigError
    from kimi_jax.parallel.sharding import LayoutError
    return (CheckpointError, ConfigError, LayoutError)
