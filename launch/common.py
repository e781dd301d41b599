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

from absl import flags

FLAGS = flags.FLAGS

flags.DEFINE_integer("tensor_parallel_size", 1, "devices that split heads / FFN width (TP)")
flags.DEFINE_integer("data_parallel_size", 1, "devices that split the batch (DP attention)")
flags.DEFINE_bool("enable_expert_parallel", False, "whole experts per device (EP) instead of TP slices")
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
        from kimi_jax.distributed import initialize
        initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def layout_kwargs() -> dict:
    """The LLM(...) layout arguments from the flags."""
    return dict(tensor_parallel_size=FLAGS.tensor_parallel_size, data_parallel_size=FLAGS.data_parallel_size,
                enable_expert_parallel=FLAGS.enable_expert_parallel)
