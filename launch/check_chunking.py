"""Does prefill chunking change what the model computes? The first sampled token of the same prompts
under several prefill settings, compared by its log-probabilities.

    # one H200: the 3-layer Kimi-K2.5 slice, the long-prompt workload of BENCHMARKS.md "Prefill chunk size"
    PYTHONPATH=. python -m launch.check_chunking --num_layers=3 --min_prompt=2048 --max_prompt=8192 \\
        --settings=8192:65536:auto,2048:2048:auto,2048:2048:cudnn,256:2048:einsum,256:2048:auto
    # CPU: a Kimi-shaped model small enough for the XLA paths (--small), bf16 or float32
    python -m launch.check_chunking --small --dtype=float32 --settings=512:512:auto,32:256:einsum,32:256:xla_split

Each setting is prefill_chunk:max_prefill_tokens:chunk-attention path (the ExecPlan's chunk_attention: auto,
einsum, cudnn, cudnn_split, xla, xla_split). The prompts are the throughput suite's (--requests prompts,
log-uniform lengths in [--min_prompt, --max_prompt], seed 0), at most --max_num_seqs running, so the
steps of a small chunk hold several rows. Every setting runs on a fresh engine over the same weights
(its own compiled programs: the path is read at trace time) and samples one greedy token with its
top-2 log-probabilities. Prints, per setting, the requests whose top token differs from the first
setting's ("flips") and the largest and median |difference| of the top log-probability.

In float32 chunking must not change the result: the run fails (exit status 1) if any setting differs
from the first by more than --tol or flips a token. In bf16 it reports: the rounding of a step's
values depends on the step's shapes, and a random-weight router's near-tied top-k choices can turn
that into visible differences (BENCHMARKS.md). --fixed_routing is the control for the latter: every
token then picks the same experts, so what differences remain come from elsewhere. --reference is the
control for rounding: one setting run again in float32 over the same (upcast) weights, and every setting's
distance to it; if the chunked settings are no further from it than the whole-prompt one, chunking
changes the result only as much as bf16 rounding does.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "kimi-k2.5", "preset or checkpoint directory")
flags.DEFINE_integer("num_layers", 3, "with a preset: layers of its slice")
flags.DEFINE_bool("small", False, "the preset at a CPU-sized geometry (hidden 1024, 8 heads, 64 experts top-8, "
                  "vocab 8192), keeping its structure (MLA, INT4 experts, sigmoid router)")
flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
flags.DEFINE_integer("requests", 16, "prompts")
flags.DEFINE_integer("min_prompt", 100, "shortest prompt (log-uniform lengths)")
flags.DEFINE_integer("max_prompt", 400, "longest prompt")
flags.DEFINE_integer("max_num_seqs", 8, "requests running at once")
flags.DEFINE_list("settings", ["512:512:auto", "32:256:einsum", "32:256:xla_split"],
                  "prefill_chunk:max_prefill_tokens:path; the others are compared to the first")
flags.DEFINE_bool("fixed_routing", False, "control: every MoE layer's e_score_correction_bias set so that "
                  "every token picks experts 0..k-1 (no near-tied top-k choice can flip); the routing weights "
                  "still follow the scores")
flags.DEFINE_string("reference", "", "a setting (prefill_chunk:max_prefill_tokens:path) run once more in float32 over the "
                    "same weights (the --dtype ones, upcast): each setting's distance to it is reported, so a chunked "
                    "result can be told apart from rounding (is it further from float32 than the first setting?)")
flags.DEFINE_float("tol", 1e-4, "float32: largest allowed |difference| of the top log-probability")
flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/check_chunking"), "output directory")

_T0 = time.time()


def log(*a):
    print(f"[{time.time() - _T0:6.1f}s]", *a, flush=True)


def parse_setting(text: str) -> tuple[int, int, str]:
    from kimi_jax import ops
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        raise app.UsageError(f"--settings: {text!r} is not prefill_chunk:max_prefill_tokens:path")
    chunk, budget, path = int(parts[0]), int(parts[1]), parts[2]
    if chunk < 1 or budget < 1 or path not in ("auto",) + ops.CHUNK_ATTENTION_CHOICES:
        raise app.UsageError(f"--settings: {text!r}: sizes must be >= 1 and the path one of auto, "
                             f"{', '.join(ops.CHUNK_ATTENTION_CHOICES)}")
    return chunk, budget, path


def compare(ref: list, got: list) -> dict:
    """Top-1 flips and |difference| of the top log-probability, `got` against `ref` (per request:
    [(token, logprob), ...] best first)."""
    import numpy as np
    d = np.asarray([abs(a[0][1] - b[0][1]) for a, b in zip(ref, got)])
    return dict(flips=[i for i, (a, b) in enumerate(zip(ref, got)) if a[0][0] != b[0][0]],
                max_diff=float(d.max()), median_diff=float(np.median(d)),
                largest=[int(i) for i in np.argsort(-d)[:3]])


def main(argv):
    del argv
    import jax
    from flax import nnx

    from kimi_jax import LLM, SamplingParams
    from kimi_jax.config import ModelConfig, preset
    from kimi_jax.engine.steps import Engine
    from launch.bench_throughput import random_prompts

    settings = [parse_setting(s) for s in FLAGS.settings]
    if FLAGS.reference:
        parse_setting(FLAGS.reference)           # a bad --reference fails before any model is built
    model = FLAGS.model
    if os.path.isdir(model):
        cfg = ModelConfig.from_pretrained(model)
    else:
        cfg = preset(model).replace(num_hidden_layers=FLAGS.num_layers)
        if FLAGS.small:
            cfg = cfg.replace(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                              n_routed_experts=64, num_attention_heads=8, vocab_size=8192, q_lora_rank=512)
        model = cfg
    n = FLAGS.requests
    lens, prompts = random_prompts(0, n, FLAGS.min_prompt, FLAGS.max_prompt, cfg.vocab_size)
    pages = int(FLAGS.max_num_seqs * -(-(int(lens.max()) + 2) // 16) + 16)
    llm = LLM(model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs, max_model_len=int(lens.max()) + 2,
              num_pages=pages)
    log(f"model: {llm.config.num_hidden_layers} layers, {FLAGS.dtype}; {n} prompts of {lens.min()}-{lens.max()} "
        f"tokens")
    base = llm.engine
    if FLAGS.fixed_routing:
        from kimi_jax.model.moe import pin_routing
        if not pin_routing(base.state, llm.config.num_experts_per_tok):
            raise app.UsageError("--fixed_routing: the model has no router (e_score_correction_bias)")
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
    rows, ref, ok = [], None, True
    for chunk, budget, path in settings:
        plan = dataclasses.replace(base.plan, chunk_attention=path)
        llm.engine = Engine(nnx.merge(base.graphdef, base.state), base.cfg, llm.layout, plan=plan)
        llm.prefill_chunk, llm.max_prefill_tokens = chunk, budget
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        top = [sorted(((int(t), float(v)) for t, v in o.outputs[0].logprobs[0].items()), key=lambda kv: -kv[1])
               for o in outs]
        row = dict(setting=f"{chunk}:{budget}:{path}", seconds=time.perf_counter() - t0, top=top)
        if ref is None:
            ref = top
        else:
            row.update(compare(ref, top))
            bad = FLAGS.dtype == "float32" and (row["flips"] or row["max_diff"] > FLAGS.tol)
            ok = ok and not bad
            log(f"{row['setting']}: flips {row['flips']}, |d top logprob| max {row['max_diff']:.4f} "
                f"median {row['median_diff']:.4f}, largest at requests {row['largest']}" + ("  FAIL" if bad else ""))
        rows.append(row)
    shown = list(rows)
    if FLAGS.reference:
        chunk, budget, path = parse_setting(FLAGS.reference)
        # the same weights in float32: a float32 engine's own (random) state replaced by the upcast one
        ref_llm = LLM(model, dtype="float32", max_num_seqs=FLAGS.max_num_seqs, max_model_len=int(lens.max()) + 2,
                      num_pages=pages)
        e32 = ref_llm.engine
        state = jax.tree.map(lambda a32, a: a.astype(a32.dtype), e32.state, base.state)
        ref_llm.engine = e32 = Engine(nnx.merge(e32.graphdef, state), e32.cfg, ref_llm.layout,
                                      plan=dataclasses.replace(e32.plan, chunk_attention=path))
        del state
        ref_llm.prefill_chunk, ref_llm.max_prefill_tokens = chunk, budget
        # full float32 dots: on GPUs XLA's default precision may run float32 dots as TF32
        with jax.default_matmul_precision("highest"):
            outs = ref_llm.generate(prompts, sp)
        del ref_llm, e32
        top32 = [sorted(((int(t), float(v)) for t, v in o.outputs[0].logprobs[0].items()), key=lambda kv: -kv[1])
                 for o in outs]
        reference = dict(setting=f"float32 {chunk}:{budget}:{path}", top=top32)
        log(f"against the reference ({reference['setting']}, same weights):")
        for row in rows:
            row["vs_reference"] = d = compare(top32, row["top"])
            log(f"  {row['setting']}: flips {d['flips']}, |d top logprob| max {d['max_diff']:.4f} "
                f"median {d['median_diff']:.4f}, largest at requests {d['largest']}")
        shown.append(reference)
    log("per request (prompt tokens): top token and log-probability per setting"
        + (" (last: the float32 reference)" if FLAGS.reference else ""))
    for i in range(n):
        log(f"  {i:2d} ({lens[i]:5d}): " + " | ".join(f"{r['top'][i][0][0]} {r['top'][i][0][1]:.3f}" for r in shown))
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "check_chunking.json"), "w") as f:
        json.dump(dict(dtype=FLAGS.dtype, lens=[int(x) for x in lens], rows=rows, ok=ok,
                       reference=shown[-1] if FLAGS.reference else None), f, indent=1)
    log("OK" if ok else "FAILED: chunking changed a float32 result")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
