r"""kimi-convert: write an orbax checkpoint of a model already in the engine's layout (stacked layers,
INT4 experts packed), from a published-layout (HF safetensors) checkpoint; or restore one onto a layout.

  kimi-convert --model /ckpt/Kimi-K2.5 --out /ckpt/Kimi-K2.5-orbax [--dtype bfloat16] [layout flags]
  kimi-convert --model /ckpt/Kimi-K2.5-orbax [layout flags]        # restore onto this layout, report

The source is loaded with the streamed loader onto the layout given by the shared flags
(--tensor_parallel_size, --data_parallel_size, --enable_expert_parallel; default one device), then
written with orbax; the directory also gets kimi_jax_orbax.json (config, dtype, fingerprint), the
source's config.json and tokenizer files, so `LLM(out)` / `kimi-generate --model out` load it, on any
mesh. --verify restores what was written onto the same layout and compares every parameter bit for bit.

A bad checkpoint, config or layout prints one line (`kimi-convert: error: ...`) and exits with status 2.
"""
from __future__ import annotations

import os
import sys
import time

from absl import flags, logging

from launch import common

PROG = "kimi-convert"
FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "source: a safetensors checkpoint directory (convert) or an orbax "
                    "directory written by kimi-convert (restore check)")
flags.DEFINE_string("out", None, "output directory for the orbax checkpoint")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "parameter dtype of the written model")
flags.DEFINE_bool("overwrite", False, "replace --out if it is an earlier kimi-convert output")
flags.DEFINE_bool("verify", False, "after writing, restore onto the layout and compare bit for bit")
flags.DEFINE_integer("workers", None, "reads in flight while loading safetensors")


def fail(message) -> None:
    common.fail(PROG, message)


user_errors = common.user_errors


def _say(msg: str) -> None:
    import jax
    if jax.process_index() == 0:
        print(msg, flush=True)


def convert() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from checkpoints import loader, orbax_io
    from kimi_jax.entrypoints.weights import load_model
    from kimi_jax.entrypoints.weights import read_checkpoint
    from kimi_jax.model.transformer import param_arrays
    from kimi_jax.parallel.sharding import Layout

    if not FLAGS.model:
        fail("--model is required (a checkpoint directory)")
    if not os.path.isdir(FLAGS.model):
        fail(f"--model {FLAGS.model}: checkpoint directory does not exist")
    restore_only = orbax_io.is_orbax_checkpoint(FLAGS.model)
    if not restore_only and not FLAGS.out:
        fail("--out is required to convert a safetensors checkpoint")
    if not restore_only:
        orbax_io.check_output(FLAGS.out, FLAGS.overwrite)      # before spending time loading
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[FLAGS.dtype]
    checkpoint = read_checkpoint(FLAGS.model)          # config.json and the index, read once
    cfg = checkpoint.config
    layout = Layout(**common.layout_kwargs())
    kw = {"progress": FLAGS.progress}
    if FLAGS.workers and not restore_only:
        kw["workers"] = FLAGS.workers
    stats = loader.LoadStats()
    t0 = time.perf_counter()
    net = load_model(checkpoint, cfg, layout, dtype, stats=stats, **kw)
    arrays = param_arrays(net)
    jax.block_until_ready(arrays)
    dt = time.perf_counter() - t0
    gb = stats.bytes_read / 1e9
    what = "restored orbax checkpoint" if restore_only else "loaded"
    _say(f"{PROG}: {what} {FLAGS.model} onto {layout.name} ({jax.device_count()} "
         f"{jax.devices()[0].platform} devices): {gb:.2f} GB in {dt:.1f}s ({gb / dt:.2f} GB/s)")
    if restore_only:
        return
    t0 = time.perf_counter()
    meta = orbax_io.save(FLAGS.out, arrays, cfg.to_hf_dict(), source=FLAGS.model, overwrite=FLAGS.overwrite,
                         layout_name=layout.name)
    dt = time.perf_counter() - t0
    _say(f"{PROG}: wrote {FLAGS.out} ({meta['bytes'] / 1e9:.2f} GB, {meta['fingerprint'][:19]}...) "
         f"in {dt:.1f}s ({meta['bytes'] / 1e9 / dt:.2f} GB/s)")
    if FLAGS.verify:
        t0 = time.perf_counter()
        back = param_arrays(load_model(FLAGS.out, cfg, layout, dtype))
        bad = [k for k, v in arrays.items() if not np.array_equal(np.asarray(v), np.asarray(back[k]))]
        if bad:
            fail(f"{FLAGS.out}: verification failed: parameter {'.'.join(bad[0])!r} differs "
                 f"[{len(bad)} parameter(s)]")
        _say(f"{PROG}: verified: every parameter restored bit for bit ({time.perf_counter() - t0:.1f}s)")


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)        # orbax logs every step at INFO
    common.setup()
    try:
        convert()
    except user_errors() as e:
        fail(e)


def run(argv=None):
    """Console-script entry point (`kimi-convert`)."""
    common.run(main, PROG, __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
