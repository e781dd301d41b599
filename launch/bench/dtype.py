"""kimi-bench dtype: the demo model (`LLM()`) decoding greedy tokens at batch 1 and 16 in each dtype,
end to end (LLM.generate, tokens / s) and per decode step (the jitted step alone, the host loop's
share = the rest), after a warm-up run that compiles every shape.

  kimi-bench dtype --dtypes=bfloat16,float32 --batches=1,16 --tokens=64
  kimi-bench dtype --dtypes=float32 --batches=2 --tokens=4 --reps=1 --out=/tmp/x   # a quick CPU check

Writes the rows as JSON (--out: a directory, then dtype_rows.json in it, or a .json file).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

from launch.bench.harness import write_json

FLAGS = flags.FLAGS
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "dtypes to time")
flags.DEFINE_list("batches", ["1", "16"], "batch sizes")
flags.DEFINE_integer("tokens", 64, "greedy tokens per request")
flags.DEFINE_integer("prompt", 16, "prompt tokens per request")
flags.DEFINE_integer("reps", 3, "timed runs per case (the fastest is reported)")
flags.DEFINE_integer("step_reps", 20, "timed calls of the decode step alone per case (the fastest is reported)")
flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_dtype"),
                    "results directory (dtype_rows.json in it) or .json file")


def step_ms(llm, B: int, context: int, reps: int = 20) -> float:
    """Fastest wall ms of the jitted decode step alone at batch B (contexts of `context` tokens) over
    `reps` calls (the minimum: the machine is shared, and other load only adds time)."""
    import jax
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    from kimi_jax.tools.step_adapters import decode_step_async
    eng = llm.frontend.steps
    pages = eng.init_pages(B * (-(-(context + reps + 2) // llm.block_size)) + 1, llm.block_size)
    per = pages[next(iter(pages))].shape[1] // B
    table = np.arange(B * per, dtype=np.int32).reshape(B, per)
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)] * B, list(range(B)))
    tok = np.arange(2, 2 + B, dtype=np.int32)
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        pos = np.full(B, context + i, np.int32)
        step_B = np.full(B, i, np.int32)
        pages, out = decode_step_async(eng, pages, tok, pos, table, sp, step_B, None)
        jax.block_until_ready(out["tokens"])
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.min(times[3:]))


def main(argv):
    del argv
    import jax
    from kimi_jax import LLM, SamplingParams
    rows = []
    for dtype in FLAGS.dtypes:
        # no prefix caching: every timed run takes the warm-up run's shapes (a cached prefix compiles others)
        llm = LLM(dtype=dtype, max_num_seqs=max(map(int, FLAGS.batches)), enable_prefix_caching=False)
        rng = np.random.default_rng(0)
        for B in map(int, FLAGS.batches):
            prompts = [rng.integers(2, llm.config.vocab_size, FLAGS.prompt).tolist() for _ in range(B)]
            sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.tokens, ignore_eos=True)
            llm.generate(prompts, sp, use_tqdm=False)                    # compile every shape
            best = float("inf")
            for _ in range(FLAGS.reps):
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                best = min(best, time.perf_counter() - t0)
            row = dict(dtype=dtype, batch=B, tok_s=B * FLAGS.tokens / best, wall_s=best,
                       step_ms=step_ms(llm, B, FLAGS.prompt + FLAGS.tokens // 2, FLAGS.step_reps))
            row["loop_ms_per_step"] = 1e3 * best / FLAGS.tokens - row["step_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"jax": jax.__version__, "devices": str(jax.devices()), "rows": rows}
    print(json.dumps(result))
    print(f"wrote {write_json(FLAGS.out, 'dtype_rows.json', result)}")


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench dtype", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
