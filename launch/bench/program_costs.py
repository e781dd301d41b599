r"""kimi-bench program_costs: what merging or widening step programs would cost, per step.

  python3 -m launch.bench.program_costs                  # GPU: preset kimi-k2.5-61x16 cut to 4 layers
  python3 -m launch.bench.program_costs --tiny --out /tmp/x   # CPU dry run (tiny preset, float32)

The runner's declared program set (kimi_jax.engine.runner.Runner.programs) is the product of the shapes
and variants it keeps apart; each row here times one program over rows at a given cached length, so
two rows differing in one key tell what sharing that program would cost:
- decode at block-table widths 16 / 256 / 2048 pages over 256-token rows (and 4,096-token rows),
- decode greedy / sampled (temperature 0.8, top-p 0.9, top-k 50) / extras (logprobs 20, adjustments, mask),
- chunk prefill (cached tokens before the chunk) at table widths 16 / 256 / 2048, and fresh prefill,
- chunk and fresh prefill expanded (gathered table, cuDNN) against absorbed (the decode kernel:
  ExecPlan.absorbed_chunk_tokens), and the prefill sampler's variants.
ms per step: the least of three means over --steps back-to-back calls (device-bound: the host
keeps ahead at these sizes), the program's compile seconds beside it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import flags

flags.DEFINE_integer("layers", 4, "num_hidden_layers of the preset")
flags.DEFINE_string("preset", "kimi-k2.5-61x16", "model preset (kimi_jax.config.preset)")
flags.DEFINE_list("batches", ["1", "32"], "decode batches")
flags.DEFINE_integer("steps", 30, "calls per timing")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_program_costs"), "results directory")
flags.DEFINE_bool("tiny", False, "CPU dry run: the tiny preset in float32, small tables, 2 steps")
FLAGS = flags.FLAGS
PAGE = 16


def cases(batches, tiny: bool):
    """(ProgramKey fields, cached tokens + T, sampled params, chunk absorbed) per row."""
    wide = (16, 32) if tiny else (16, 256, 2048)
    ctx = 256
    out = []
    for B in batches:
        out += [(dict(kind="decode", batch=B, width=1, table=P), ctx, False, False) for P in wide]
        if not tiny:
            out += [(dict(kind="decode", batch=B, width=1, table=P), 4096, False, False) for P in (256, 2048)]
        out += [(dict(kind="decode", batch=B, width=1, table=16, sampled=True), ctx, True, False),
                (dict(kind="decode", batch=B, width=1, table=16, sampled=True, logprobs=20), ctx, True, False)]
    out += [(dict(kind="prefill", batch=1, width=16, table=P), ctx, False, False) for P in wide]
    out += [(dict(kind="prefill", batch=1, width=16, table=16, fresh=True), 16, False, False)]
    long = (4096, 256)          # absorbed rows take the decode table of 4K rows (GPU only: a Pallas plan)
    for B, T, total, P in [] if tiny else [(1, 16, ctx, 16), (1, 64, ctx, 16), (1, 64, *long), (8, 64, *long),
                                           (1, 128, *long), (8, 16, *long)]:
        out += [(dict(kind="prefill", batch=B, width=T, table=P), total, False, False),
                (dict(kind="prefill", batch=B, width=T, table=256), total, False, True)]
    for B, T in [] if tiny else [(1, 16), (1, 64), (8, 64), (32, 16)]:      # fresh prompts: cuDNN or absorbed
        out += [(dict(kind="prefill", batch=B, width=T, table=16, fresh=True), T, False, False),
                (dict(kind="prefill", batch=B, width=T, table=256), T, False, True)]
        out += [(dict(kind="prefill", batch=B, width=T, table=256, sampled=True, logprobs=lp), T, True, True)
                for lp in (None, 20) if T == 16]
    return out


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax.config import preset
    from kimi_jax.engine.runner import ProgramKey, Runner
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.tools.profiling import random_engine

    os.makedirs(FLAGS.out, exist_ok=True)
    tiny = FLAGS.tiny
    cfg = preset("tiny") if tiny else preset(FLAGS.preset).replace(num_hidden_layers=FLAGS.layers)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    engine = random_engine(cfg, Layout(1), dtype)
    batches = [int(b) for b in FLAGS.batches]
    max_table = 32 if tiny else 2048
    runner = Runner(engine, num_pages=max(batches) * max_table + 64, page_size=PAGE, cache_dtype=dtype,
                    max_num_seqs=max(batches))
    steps = 2 if tiny else FLAGS.steps

    def batch_for(key, ctx, sampled):
        b = runner._dummy(key)
        B, T, P = key.batch, key.width, key.table
        pos = np.broadcast_to(np.arange(ctx - T, ctx, dtype=np.int32), (B, T)).copy()
        table = np.zeros((B, P), np.int32)
        need = -(-ctx // PAGE)
        table[:, :need] = np.arange(B)[:, None] * max_table + np.arange(need)[None]
        sp = b.sp
        if sampled:
            sp = dataclasses.replace(sp, temperature=np.full((B,), 0.8, np.float32),
                                     top_p=np.full((B,), 0.9, np.float32), top_k=np.full((B,), 50, np.int32))
        tokens = b.tokens if key.kind == "decode" else np.ones((B, T), np.int32)
        return dataclasses.replace(b, positions_BT=pos, block_table_BP=table, sp=sp, tokens=tokens)

    rows, base = [], engine.exec_plan
    for fields, ctx, sampled, absorbed in cases(batches, tiny):
        key = ProgramKey(**fields)
        engine.exec_plan = dataclasses.replace(base, absorbed_chunk_tokens=key.width if absorbed else 0)
        batch = batch_for(key, ctx, sampled)
        t0 = time.perf_counter()
        jax.block_until_ready(runner._call(batch, key))
        compile_s = time.perf_counter() - t0
        means = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                out = runner._call(batch, key)
            jax.block_until_ready(out)
            means.append((time.perf_counter() - t0) / steps * 1e3)
        r = dict(fields, context=ctx, absorbed=absorbed, compile_s=round(compile_s, 2), ms=round(min(means), 4),
                 layers=cfg.num_hidden_layers, device=jax.devices()[0].device_kind, jax=jax.__version__)
        rows.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(FLAGS.out, "program_costs_rows.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench program_costs", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
