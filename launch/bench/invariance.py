r"""kimi-bench invariance: batch invariance checked and priced. Every request runs alone, then all of
them again in random batches among each other; a request whose tokens or logprobs (top-k and ranks
included) are not the same bits both times is a mismatch. Once with `batch_invariant` on, once off.

  kimi-bench invariance --requests 200 --max_num_seqs 8                       # the demo model
  kimi-bench invariance --preset kimi-k2.5-61x16 --layers 4 --requests 200    # random weights, GPU
  kimi-bench invariance --requests 6 --max_tokens 4 --max_num_seqs 3          # a quick CPU check

Requests: prompts of 4 to --max_prompt random tokens, --max_tokens tokens each, half greedy, half
sampled at temperature 1 with their own seed, --logprobs top logprobs. The batches: the requests
shuffled and cut into runs of 1 to --max_num_seqs (one `LLM.generate` a run). Prefix caching stays
on, so a batched request hits the cache its alone run filled. Rows (stdout and OUT/invariance.json):
per setting the mismatched requests, the first one's first differing token, and the output tokens/s
of the alone and the batched pass (wall time; the engine's programs compiled first, `precompile`,
and every batch size run once).
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from absl import flags

from launch.bench.harness import write_json

flags.DEFINE_string("model", None, "checkpoint directory (default: the demo model)")
flags.DEFINE_string("preset", None, "instead of --model: a synthetic checkpoint of this preset "
                    "(random weights, written to a temporary directory)")
flags.DEFINE_integer("layers", 0, "with --preset: num_hidden_layers (0: the preset's)")
flags.DEFINE_string("dtype", "bfloat16", "model dtype")
flags.DEFINE_enum("layout", "ragged", ["padded", "ragged"], "the step layout (EngineConfig.step_layout)")
flags.DEFINE_integer("requests", 200, "requests")
flags.DEFINE_integer("max_num_seqs", 8, "the largest batch")
flags.DEFINE_integer("max_prompt", 64, "the longest prompt (tokens)")
flags.DEFINE_integer("max_tokens", 16, "tokens a request")
flags.DEFINE_integer("logprobs", 5, "top logprobs a token")
flags.DEFINE_list("settings", ["on", "off"], "batch_invariant settings to run: on, off")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_bool("precompile", True, "compile the engine's programs before the timed passes "
                  "(--noprecompile: on first use, inside the timings)")
flags.DEFINE_string("out", os.environ.get("OUT", "out"), "results directory")

FLAGS = flags.FLAGS


def workload(vocab: int, n: int, max_prompt: int, max_tokens: int, logprobs: int, seed: int):
    """(prompts, params) of n requests: half greedy, half seeded samples (see the module doc)."""
    from kimi_jax import SamplingParams
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, vocab, int(rng.integers(4, max_prompt + 1))).tolist()
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=None if i % 2 == 0 else i,
                             max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
              for i in range(n)]
    return prompts, params


def batches(n: int, largest: int, seed: int) -> list[list[int]]:
    """The request indices shuffled and cut into runs of 1 to `largest`."""
    rng = np.random.default_rng(seed + 1)
    order, out = rng.permutation(n).tolist(), []
    while order:
        k = int(rng.integers(1, largest + 1))
        out.append(order[:k])
        order = order[k:]
    return out


def seen(out) -> tuple:
    """A request's output as compared: its tokens and every token's (id, logprob, rank) triples."""
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in d.items()))
                                     for d in c.logprobs)


def first_difference(a: tuple, b: tuple) -> int:
    """The first token index where two outputs (`seen`) differ in id or logprobs."""
    for i, (x, y) in enumerate(zip(zip(*a), zip(*b))):
        if x != y:
            return i
    return min(len(a[0]), len(b[0]))


def measure(model: str, invariant: bool, runs) -> dict:
    from kimi_jax import LLM
    llm = LLM(model, dtype=FLAGS.dtype, max_num_seqs=FLAGS.max_num_seqs,
              step_layout=FLAGS.layout, batch_invariant=invariant,
              enable_prefix_caching=True, precompile=FLAGS.precompile)
    # prompt ids the tokenizer can decode (a vocabulary may be padded past it)
    vocab = llm.frontend.steps.vocab_limit or llm.config.vocab_size
    prompts, params = workload(vocab, FLAGS.requests, FLAGS.max_prompt, FLAGS.max_tokens,
                               FLAGS.logprobs, FLAGS.seed)
    # a warm-up of every batch size (its own prompts: nothing they leave in the cache is hit)
    warm, warm_params = workload(vocab, FLAGS.max_num_seqs, FLAGS.max_prompt,
                                 FLAGS.max_tokens, FLAGS.logprobs, FLAGS.seed + 7)
    for k in range(1, FLAGS.max_num_seqs + 1):
        llm.generate(warm[:k], warm_params[:k], use_tqdm=False)
    t0 = time.perf_counter()
    alone = [seen(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    alone_s = time.perf_counter() - t0
    batched: dict[int, tuple] = {}
    t0 = time.perf_counter()
    for run in runs:
        outs = llm.generate([prompts[i] for i in run], [params[i] for i in run], use_tqdm=False)
        batched.update({i: seen(o) for i, o in zip(run, outs)})
    batched_s = time.perf_counter() - t0
    bad = [i for i in range(len(prompts)) if batched[i] != alone[i]]
    tokens = len(prompts) * FLAGS.max_tokens
    return {"batch_invariant": invariant, "requests": len(prompts), "mismatched": len(bad),
            "mismatched_greedy": sum(params[i].temperature == 0.0 for i in bad),
            "first_mismatch": None if not bad else {
                "request": bad[0], "token": first_difference(alone[bad[0]], batched[bad[0]])},
            "alone_tok_s": tokens / alone_s, "batched_tok_s": tokens / batched_s,
            "batches": len(runs)}


def main(argv):
    del argv
    import jax
    from kimi_jax.entrypoints.llm import demo_model_path
    for s in FLAGS.settings:
        if s not in ("on", "off"):
            raise SystemExit(f"kimi-bench invariance: error: --settings: {s!r} is not on or off")
    model, tmp = FLAGS.model, None
    if FLAGS.preset:
        from checkpoints.synthetic import write_checkpoint
        from kimi_jax.config import preset
        cfg = preset(FLAGS.preset)
        if FLAGS.layers:
            cfg = cfg.replace(num_hidden_layers=FLAGS.layers)
        tmp = tempfile.TemporaryDirectory(prefix="kimi_invariance_")
        model = tmp.name
        write_checkpoint(model, cfg, seed=FLAGS.seed, std=0.02)
    model = model or demo_model_path()
    rows = []
    try:
        for s in FLAGS.settings:
            row = measure(model, s == "on", batches(FLAGS.requests, FLAGS.max_num_seqs, FLAGS.seed))
            row.update(dtype=FLAGS.dtype, step_layout=FLAGS.layout,
                       max_num_seqs=FLAGS.max_num_seqs, jax=jax.__version__,
                       device=jax.devices()[0].device_kind)
            rows.append(row)
            print(row, flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"wrote {write_json(FLAGS.out, 'invariance.json', rows)}")



def run(argv=None) -> None:
    from absl import app
    app.run(main, argv)


if __name__ == "__main__":
    run()
