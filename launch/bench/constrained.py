"""kimi-bench constrained: decode steps of a batch in which some rows are grammar-constrained, through the
engine core with overlap scheduling (each such step split in two: the forward half dispatched before the
previous token is read, the sampling half once the grammars have advanced) against the same batch
unconstrained and against the synchronous path (overlap off), in one process on one model.

  kimi-bench constrained --batches 1,16 --constrained 1,4 --steps 20                  # 61x16, one GPU
  kimi-bench constrained --preset kimi-k2.5-tp8-shard --layers 30 --batches 1,16 --constrained 1,4
  kimi-bench constrained --tiny --batches 1,4 --constrained 1,2 --context 256 --steps 4   # CPU
  kimi-bench constrained --step_layout ragged --layers 8 --batches 1,16 --constrained 1,4

Rows (ms per step = wall / engine steps, medians of --repeats runs): `mode` unconstrained (overlap on),
overlap (c rows constrained, overlap on), sync (the same, overlap off), bad_words (c rows with a
multi-token bad word, overlap on); `same_tokens`: overlap's tokens equal sync's, row by row (greedy).
The constraint is the regex `[a-z ]+` (stop tokens biased away, so every row decodes --steps tokens) over a
synthetic Kimi-shaped tokenizer of the model's vocabulary (launch.bench.harness.synthetic_tokenizer;
the demo tokenizer with --tiny). Requests enter with their prompt already cached (random latents) and decode only; a
row's ms per step is the wall time of --steps engine steps after its first, the last one read. Results: OUT/constrained.json.
"""
from __future__ import annotations

import gc
import os
import statistics
import time

from absl import flags

# launch.common defines --step_layout (the engine's; ragged: a budget of max(256, batch) tokens)
from launch import common  # noqa: F401
from launch.bench.harness import write_json

flags.DEFINE_string("preset", "kimi-k2.5-61x16", "model preset (kimi_jax.config.preset)")
flags.DEFINE_integer("layers", 0, "num_hidden_layers (0: the preset's)")
flags.DEFINE_list("batches", ["1", "16"], "decode batches")
flags.DEFINE_list("constrained", ["1", "4"], "constrained rows of each batch (one per batch)")
flags.DEFINE_integer("context", 4096, "cached tokens per row")
flags.DEFINE_integer("steps", 20, "decode steps per timed run")
flags.DEFINE_integer("repeats", 3, "timed runs per row (the median is reported)")
flags.DEFINE_bool("tiny", False, "CPU dry run: the tiny preset (demo vocabulary) in float32")
flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_constrained"), "results")
FLAGS = flags.FLAGS

PAGE_SIZE = 16
REGEX = "[a-z ]+"


def model(preset_name: str, layers: int, tiny: bool):
    """(steps over random weights, tokenizer, structured-outputs backend)."""
    import jax.numpy as jnp
    from kimi_jax.config import preset
    from kimi_jax.engine.structured import StructuredBackend
    from kimi_jax.ops import ExecPlan
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.text.tokenizer import Tokenizer
    from kimi_jax.tools.profiling import random_engine
    from launch.bench.harness import synthetic_tokenizer
    if tiny:
        from kimi_jax.entrypoints.frontend import demo_model_path
        tok = Tokenizer.from_pretrained(demo_model_path())
        cfg = preset("tiny").replace(vocab_size=tok.vocab_size)
    else:
        cfg = preset(preset_name)
        tok = synthetic_tokenizer(cfg.vocab_size - 256)
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    steps = random_engine(cfg, Layout(1), jnp.float32 if tiny else jnp.bfloat16, plan=ExecPlan.for_backend())
    return steps, tok, StructuredBackend(tok, cfg.vocab_size)


def measure(steps, tok, backend, batch: int, constrained: int, mode: str, context: int, n_steps: int,
        repeats: int) -> dict:
    """One row: `batch` requests decoding n_steps tokens each, `constrained` of them constrained
    (or with a bad word) unless mode is 'unconstrained'."""
    import numpy as np
    from kimi_jax.engine.args import CacheConfig, SchedulerConfig
    from kimi_jax.engine.core import EngineCore
    from kimi_jax.engine.runner import CLOSE_WINDOW
    from kimi_jax.engine.sampling import SamplingParams
    from kimi_jax.engine.structured_params import StructuredOutputsParams
    from launch.bench.harness import random_pages
    cfg = steps.cfg
    prompt_len = context - n_steps - 2 * PAGE_SIZE
    cache = CacheConfig(PAGE_SIZE, batch * (context // PAGE_SIZE), steps.cache_dtype)
    sc = SchedulerConfig(batch, context, 256, 2048, overlap_scheduling=mode != "sync",
                         step_layout=FLAGS.step_layout or "padded",
                         max_num_batched_tokens=max(256, batch))
    core = EngineCore(steps, sc, cache, tokenizer=tok, structured=backend)
    pool = core.scheduler.pool
    core.runner.pages = random_pages(steps, pool.num_pages)
    rng = np.random.default_rng(0)
    word = next(w for w in ("the quick", "brown fox", "lazy dog") if len(tok.encode(w)) > 1)

    def params(i: int) -> SamplingParams:
        # no row ends within the timed steps (nor begins closing its grammar: CLOSE_WINDOW)
        kw = dict(temperature=0.0, max_tokens=n_steps + CLOSE_WINDOW + 8, ignore_eos=True)
        if i < constrained and mode in ("overlap", "sync"):
            # the regex accepts a stop token anywhere: biased away
            kw["structured_outputs"] = StructuredOutputsParams(regex=REGEX)
            kw["logit_bias"] = {t: -100.0 for t in tok.stop_token_ids}
        elif i < constrained and mode == "bad_words":
            kw["bad_words"] = [word]
        return SamplingParams(**kw)

    def one(n: int, tag: str):
        """n engine steps of the batch in its steady state (then every request aborted)."""
        reqs = []
        for i in range(batch):
            ids = [int(t) for t in rng.integers(0, min(cfg.vocab_size, tok.vocab_size) - 300, prompt_len)]
            [r] = core.make_request(f"{tag}{i}", ids, params(i), seed=i)
            r.num_computed = prompt_len - 1     # prompt cached but its last token: decode only
            r.pages = pool.take(-(-r.num_computed // PAGE_SIZE))
            core.add([r])
            reqs.append(r)
        core.step()                             # admission and the first decode step
        s0, o0 = core.stats["steps"], core.stats["overlapped_steps"]
        t0 = time.perf_counter()
        while core.stats["steps"] - s0 < n:
            core.step()
        core.drain()
        wall = time.perf_counter() - t0
        steps_run, overlapped = core.stats["steps"] - s0, core.stats["overlapped_steps"] - o0
        tokens = [list(r.output_ids) for r in reqs]
        for r in reqs:
            core.abort(r.request_id)
        return wall, steps_run, overlapped, tokens

    one(n_steps, "w")                  # compiles every program the timed runs take
    runs = [one(n_steps, f"t{k}") for k in range(repeats)]
    core.runner.resident.clear()            # the next row's core needs the device memory
    ms = [1e3 * w / n for w, n, _, _ in runs]
    return dict(batch=batch, constrained=0 if mode == "unconstrained" else constrained, mode=mode,
                ms_per_step=statistics.median(ms), ms_all=ms, engine_steps=runs[0][1],
                overlapped_steps=runs[0][2], tokens=runs[0][3])


def main(argv):
    del argv
    import jax
    from launch import common
    common.setup()
    batches = [int(b) for b in FLAGS.batches]
    constrained = [int(c) for c in FLAGS.constrained]
    if len(constrained) != len(batches) or any(not 0 < c <= b for b, c in zip(batches, constrained)):
        common.fail("kimi-bench constrained", "--constrained: one count per batch, each 1 .. its batch")
    steps, tok, backend = model(FLAGS.preset, FLAGS.layers, FLAGS.tiny)
    rows = []
    for b, c in zip(batches, constrained):
        got = {}
        for mode in ("unconstrained", "overlap", "sync", "bad_words"):
            got[mode] = row = measure(steps, tok, backend, b, c, mode, FLAGS.context, FLAGS.steps, FLAGS.repeats)
            gc.collect()                        # that row's core and its pool
            row.update(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       layers=steps.cfg.num_hidden_layers, context=FLAGS.context,
                       step_layout=FLAGS.step_layout or "padded",
                       preset="tiny" if FLAGS.tiny else FLAGS.preset)
            print({k: v for k, v in row.items() if k != "tokens"}, flush=True)
            rows.append(row)
        same = got["overlap"]["tokens"] == got["sync"]["tokens"]
        for row in got.values():
            row["same_tokens"] = same
        base = got["unconstrained"]["ms_per_step"]
        print(f"batch {b}, {c} constrained: unconstrained {base:.2f} ms, overlap "
              f"{got['overlap']['ms_per_step']:.2f} ({got['overlap']['ms_per_step'] / base - 1:+.1%}), sync "
              f"{got['sync']['ms_per_step']:.2f} ({got['sync']['ms_per_step'] / base - 1:+.1%}), bad words "
              f"{got['bad_words']['ms_per_step']:.2f}; overlap tokens == sync: {same}", flush=True)
    for row in rows:
        row.pop("tokens")
    print("wrote", write_json(FLAGS.out, "constrained.json", rows))


def run(argv=None) -> None:
    from absl import app
    app.run(main, argv)


if __name__ == "__main__":
    run()
