"""The paged MLA decode kernels inside the engine (issue #8): the same greedy workload under each kernel.

    PYTHONPATH=. python -m launch.check_decode_kernel --kernels=triton,mgpu     # one H200, ~2 minutes
    python -m launch.check_decode_kernel --kernels=auto,triton --model=tiny --prompt_len=64  # CPU dry run

Builds one Kimi-K2.5 slice (--num_layers; 1 = the dense first layer only: MLA attention over the paged
cache without the 9.5 GB of experts a MoE layer adds), then for each kernel in --kernels
(the ExecPlan's mla_decode_kernel: triton, mgpu or auto; xla: the plan's impl="xla", the reference
path of every op) a fresh engine over the same weights
generates --gen_tokens greedy tokens for --requests prompts of --prompt_len tokens, twice (the first run
compiles). Prints wall time and output tok/s per kernel and each later kernel's token-by-token agreement
with the first (bench_throughput.agreement: bf16 kernels that sum in another order may flip a near-tie
late; a wrong kernel disagrees from the first token).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "kimi-k2.5", "preset or checkpoint directory")
flags.DEFINE_integer("num_layers", 1, "layers of the preset's slice")
flags.DEFINE_list("kernels", ["xla", "triton", "mgpu"], "decode kernels: triton, mgpu, auto, or xla (every op on "
                  "its XLA reference path)")
flags.DEFINE_integer("requests", 8, "prompts")
flags.DEFINE_integer("prompt_len", 4096, "tokens per prompt")
flags.DEFINE_integer("gen_tokens", 32, "greedy tokens per request")
flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/check_decode_kernel"), "output directory")

_T0 = time.time()


def log(*a):
    print(f"[{time.time() - _T0:6.1f}s]", *a, flush=True)


def main(argv):
    del argv
    import numpy as np
    from flax import nnx

    from kimi_jax import LLM, SamplingParams
    from kimi_jax.config import preset
    from kimi_jax.engine.steps import Engine
    from launch.bench_throughput import agreement

    model = FLAGS.model
    if FLAGS.num_layers and not os.path.isdir(model):
        model = preset(model).replace(num_hidden_layers=FLAGS.num_layers)
    n, L = FLAGS.requests, FLAGS.prompt_len
    pages = n * -(-(L + FLAGS.gen_tokens) // 16) + 16
    llm = LLM(model, max_num_seqs=n, max_model_len=L + FLAGS.gen_tokens, num_pages=pages)
    log("model built", llm.config.num_hidden_layers, "layers")
    base = llm.engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, llm.config.vocab_size, L).tolist() for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.gen_tokens, ignore_eos=True)
    rows, first = [], None
    for kernel in FLAGS.kernels:
        # the ops reference path for 'xla', else the GPU kernels with this decode kernel; same weights
        plan = (dataclasses.replace(base.plan, impl="xla") if kernel == "xla"
                else dataclasses.replace(base.plan, mla_decode_kernel=kernel))
        llm.engine = Engine(nnx.merge(base.graphdef, base.state), base.cfg, plan=plan)
        row = {"kernel": kernel}
        try:
            for attempt in range(2):                                      # compile, then time
                t0 = time.perf_counter()
                outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
                row[f"wall_s_{attempt}"] = time.perf_counter() - t0
            row["tok_s"] = n * FLAGS.gen_tokens / row["wall_s_1"]
            if first is None:
                first = outs
            else:
                row["agreement"] = agreement(first, outs)
        except Exception as e:  # noqa: BLE001 - report and go on with the next kernel
            row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        log(json.dumps(row))
        rows.append(row)
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "check_decode_kernel.json"), "w") as f:
        json.dump({"requests": n, "prompt_len": L, "gen_tokens": FLAGS.gen_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
