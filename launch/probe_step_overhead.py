r"""Where the wall time of one decode step goes beyond the device work (the batch-1 gap: 4.5 ms wall vs
1.3 ms device on a 3-layer Kimi slice under the profiler). Times the paged serving step
(`Engine._step`, absorbed decode, T = 1) without the profiler, four ways per batch:

  sync      inputs from numpy, outputs fetched to the host every step (what the scheduler does)
  noinput   the same with the inputs already on the device (no host-to-device copies)
  nofetch   numpy inputs, no fetch: only block on the donated pages (no device-to-host copy)
  pipelined 20 steps enqueued back to back, then one block: the device-bound rate (host overlapped)

Run it once per XLA_FLAGS setting (flags are read when the backend starts), e.g.

  PYTHONPATH=. python -m launch.probe_step_overhead --layers 3 --batches 1,16
  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python -m launch.probe_step_overhead --tag nographs

Prints one JSON line per (batch, mode) and appends them to --out.
"""
from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 3, "num_hidden_layers of the Kimi-K2.5 slice (the first is dense)")
flags.DEFINE_list("batches", ["1", "16"], "batches to time")
flags.DEFINE_integer("context", 1024, "cached tokens per row")
flags.DEFINE_integer("steps", 30, "timed steps per mode")
flags.DEFINE_string("tag", "default", "label for this run (e.g. the XLA_FLAGS variant)")
flags.DEFINE_bool("tiny", False, "CPU dry run on the tiny preset")
flags.DEFINE_enum("sample_mode", "greedy", ["greedy", "plain", "filtered", ""], "static sampler path "
                  "('': decided on the device with lax.cond, as before)")
flags.DEFINE_string("out", None, "append the JSON lines here")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax.config import preset
    from kimi_jax.engine.steps import bucket
    from kimi_jax.tools.profiling import paged_args, random_engine
    from kimi_jax.parallel.sharding import Layout

    cfg = preset("tiny") if FLAGS.tiny else preset("kimi-k2.5").replace(num_hidden_layers=FLAGS.layers)
    layout = Layout(1)
    engine = random_engine(cfg, layout, dtype=jnp.float32 if FLAGS.tiny else jnp.bfloat16)
    rows = []
    for b in map(int, FLAGS.batches):
        pages, tok, table, sp = paged_args(engine, layout, b, bucket(FLAGS.context + 4 * FLAGS.steps + 8))
        zeros, ones = np.zeros((b,), np.int32), np.ones((b,), np.int32)

        def host_inputs(i):
            return (tok, np.full(tok.shape, FLAGS.context + i, np.int32), table, zeros, sp, ones * (i + 1))

        dev_inputs = jax.device_put(host_inputs(0))

        def run(pages, inputs, fetch):
            pages, out = engine._step(engine.state, pages, *inputs, n_logprobs=None, absorbed=True, fresh=False,
                                        sample_mode=FLAGS.sample_mode or None, plan=engine.plan)
            if fetch:
                np.asarray(out[0])
            return pages, out

        for _ in range(3):                                   # compile and warm up
            pages, out = run(pages, host_inputs(0), True)
        modes = {}
        for mode in ("sync", "noinput", "nofetch"):
            ts = []
            for i in range(FLAGS.steps):
                t0 = time.perf_counter()
                inputs = dev_inputs if mode == "noinput" else host_inputs(i)
                pages, out = run(pages, inputs, mode != "nofetch")
                if mode == "nofetch":
                    jax.block_until_ready(pages)
                ts.append(time.perf_counter() - t0)
            modes[mode] = 1e3 * statistics.median(ts)
        t0 = time.perf_counter()
        n = 20
        for i in range(n):
            pages, out = run(pages, dev_inputs, False)
        jax.block_until_ready((pages, out))
        modes["pipelined"] = 1e3 * (time.perf_counter() - t0) / n
        # host cost of one dispatch alone: enqueue without waiting (device busy with the previous ones)
        t0 = time.perf_counter()
        for i in range(n):
            pages, out = run(pages, dev_inputs, False)
        modes["enqueue_only"] = 1e3 * (time.perf_counter() - t0) / n
        jax.block_until_ready((pages, out))
        for mode, ms in modes.items():
            row = dict(tag=FLAGS.tag, batch=b, mode=mode, ms=round(ms, 4), layers=cfg.num_hidden_layers,
                       device=jax.devices()[0].device_kind, jax=jax.__version__,
                       xla_flags=os.environ.get("XLA_FLAGS", ""))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
