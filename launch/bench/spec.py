"""Speculative decoding benchmark: n-gram drafting on a repetitive workload and a non-repetitive one,
at several batch sizes, speculation off vs on, on one model (the same weights and compiled programs
serve both: only the scheduler's speculative config changes).

  kimi-bench spec --batches 1,16 --gen_tokens 48 --dtype float32                  # CPU, the demo model
  kimi-bench spec --model=kimi-k2.5 --num_layers=3 --batches=1,16 --out=$OUT/spec  # GPU
  kimi-bench spec --step_layout ragged --batches 1,16                             # drafts in the ragged step

Workloads. non-repetitive: distinct prompts (passages of the standard library's docs with the demo
model's tokenizer; random token ids for a model without one). repetitive ("say it again"): each
prompt followed by the model's own greedy continuation and then the prompt again, so the text to
produce next already stands in the context (the editing / quoting-back case); built from the model's
own output, so acceptance is real with random weights too.

Method. Each (batch, workload) first runs off and on once untimed: that compiles every program and
lets the scheduler measure its pass costs (kimi_jax.engine.scheduler._pass_costs); the timed runs take the
same path (greedy decisions are deterministic given those costs), and the compile events inside them
are counted and reported (expected 0). Then `reps` timed pairs (off, on), alternating; tokens/s is the
median, the ratio is the median of the per-pair ratios, with its min and max (the spread of a shared
machine). Mean accepted length = tokens emitted per verified row step (1 + accepted / verified rows).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from launch.bench.harness import run_prompts, write_json


def workloads(llm, n: int, gen_tokens: int, seed: int = 0, prompt_len=(20, 80)):
    """{"repetitive": [ids...], "non-repetitive": [ids...]}, n prompts each (see the module doc)."""
    from kimi_jax import SamplingParams
    rng = np.random.default_rng(seed)
    if llm.tokenizer is not None:
        import inspect
        import textwrap
        docs = " ".join(inspect.getdoc(m) or "" for m in (json, inspect, time, textwrap)).split()
        starts = rng.integers(0, len(docs) - 40, n)
        plain = [llm.tokenizer.encode(" ".join(docs[s:s + int(rng.integers(12, 40))])) for s in starts]
    else:
        plain = [rng.integers(2, llm.config.vocab_size, int(rng.integers(*prompt_len))).tolist() for _ in range(n)]
    first = llm.generate(plain, SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True),
                         use_tqdm=False)
    repetitive = [p + o.outputs[0].token_ids + p for p, o in zip(plain, first)]
    return {"repetitive": repetitive, "non-repetitive": plain}


class _Compiles:
    """Counts XLA backend compiles while active."""

    def __init__(self):
        from jax import monitoring
        self.n, self.on = 0, False
        monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event, duration, **kw):
        if self.on and event.endswith("backend_compile_duration"):
            self.n += 1


def _generate(llm, prompts, sp, spec) -> dict:
    """One run through a fresh engine core: wall time, token ids, speculation counts, engine stats."""
    wall, reqs, stats = run_prompts(llm, prompts, sp, speculative_config=spec)
    return dict(wall=wall, tokens=sum(len(r.output_ids) for r in reqs), ids=[r.output_ids for r in reqs],
                drafted=sum(r.spec.drafted for r in reqs), accepted=sum(r.spec.accepted for r in reqs),
                verified_rows=sum(r.spec.verify_steps for r in reqs), stats=dict(stats))


def spec_rows(model, batches, *, gen_tokens: int = 48, k: int = 4, dtype: str = "float32", reps: int = 3,
              max_model_len: int = 1024, prompt_len=(20, 80), budget_s: float = float("inf"),
              log=print, step_layout: str = "padded") -> list[dict]:
    """model: a checkpoint dir, preset name, ModelConfig (random weights) or None (the demo model).
    Cases not started within budget_s seconds are skipped (logged). step_layout 'ragged': the drafts
    verified inside the ragged step (its gate's costs keyed by the widths without and with them)."""
    from kimi_jax import LLM, SamplingParams
    from kimi_jax.engine.speculative import SpeculativeConfig
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3)
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, max_num_seqs=max(batches), max_model_len=max_model_len,
              step_layout=step_layout)
    log(f"[{time.perf_counter() - t0:6.1f}s] model built")
    compiles = _Compiles()
    rows = []
    for B in batches:
        if time.perf_counter() - t0 > budget_s:
            log(f"budget of {budget_s:.0f}s spent: skipping batch {B}")
            continue
        for name, prompts in workloads(llm, B, gen_tokens, prompt_len=prompt_len).items():
            for s in (None, spec):
                _generate(llm, prompts, sp, s)              # compile; the scheduler measures its pass costs
            log(f"[{time.perf_counter() - t0:6.1f}s] batch {B} {name}: warmed up")
            runs = {"off": [], "on": []}
            compiles.n, compiles.on = 0, True
            for _ in range(reps):
                runs["off"].append(_generate(llm, prompts, sp, None))
                runs["on"].append(_generate(llm, prompts, sp, spec))
            compiles.on = False
            ratios = [(on["tokens"] / on["wall"]) / (off["tokens"] / off["wall"])
                      for off, on in zip(runs["off"], runs["on"])]
            on, off = runs["on"][-1], runs["off"][-1]
            row = dict(batch=B, workload=name, step_layout=step_layout,
                       tok_s_off=statistics.median(r["tokens"] / r["wall"] for r in runs["off"]),
                       tok_s_on=statistics.median(r["tokens"] / r["wall"] for r in runs["on"]),
                       speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                       mean_accepted_len=1 + on["accepted"] / on["verified_rows"] if on["verified_rows"] else 1.0,
                       drafted=on["drafted"], accepted=on["accepted"],
                       identical=all(r["ids"] == off["ids"] for r in runs["on"] + runs["off"]),
                       verify_passes=on["stats"]["spec_steps"],
                       decode_passes=on["stats"]["decode_passes"],
                       decode_passes_off=off["stats"]["decode_passes"], timed_compiles=compiles.n)
            rows.append(row)
            log(f"[{time.perf_counter() - t0:6.1f}s] " + json.dumps(row, default=float))
    costs = {(f"T{k[1]}_T{k[2]}" if k[0] == "ragged" else f"B{k[0]}_P{k[1]}"):
             dict(decode_ms=d * 1e3, verify_ms=v * 1e3, ratio=v / d)
             for k, (d, v) in sorted(llm.frontend.steps.pass_costs.items(), key=str)}
    log("measured pass costs (batch bucket, page-table bucket; ragged: the widths without and with "
        "the drafts): " + json.dumps(costs))
    for r in rows:
        r["pass_costs"] = costs
    return rows


def format_rows(rows) -> str:
    out = ["| batch | workload | off tok/s | on tok/s | on / off (min-max) | mean accepted length | drafted | "
           "accepted | steps verifying | compiles timed | identical tokens |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['workload']} | {r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | "
                   f"{r['speedup']:.2f} ({r.get('speedup_min', r['speedup']):.2f}-"
                   f"{r.get('speedup_max', r['speedup']):.2f}) | {r['mean_accepted_len']:.2f} | {r['drafted']} | "
                   f"{r['accepted']} | {r.get('verify_passes', '-')} | {r.get('timed_compiles', '-')} | "
                   f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(out)


def main(argv):
    del argv
    from absl import flags
    from launch import common
    FLAGS = flags.FLAGS
    common.setup()
    import jax
    from kimi_jax.config import PRESETS, preset
    model = FLAGS.model
    if model in PRESETS and FLAGS.num_layers:
        model = preset(model).replace(num_hidden_layers=FLAGS.num_layers)   # random weights, true geometry
    log = lambda s: print(s, flush=True)
    log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  jax {jax.__version__}  model: "
        f"{FLAGS.model}{f' ({FLAGS.num_layers} layers)' if FLAGS.num_layers else ''}  dtype {FLAGS.dtype}")
    rows = spec_rows(model, [int(b) for b in FLAGS.batches], gen_tokens=FLAGS.gen_tokens, k=FLAGS.k,
                     dtype=FLAGS.dtype, reps=FLAGS.reps, max_model_len=FLAGS.max_model_len,
                     prompt_len=(FLAGS.prompt_min, FLAGS.prompt_max), budget_s=FLAGS.budget_s, log=log,
                     step_layout=FLAGS.step_layout or "padded")
    path = write_json(FLAGS.out, "spec_rows.json",
                      dict(jax=jax.__version__, device=jax.devices()[0].device_kind, model=FLAGS.model,
                           num_layers=FLAGS.num_layers, dtype=FLAGS.dtype, rows=rows))
    print(format_rows(rows))
    print(f"wrote {path}")


def define_flags() -> None:
    from absl import flags
    if "prompt_min" in flags.FLAGS:
        return
    flags.DEFINE_string("model", None, "checkpoint dir or preset (default: the demo model)")
    flags.DEFINE_integer("num_layers", None, "with a preset: a slice of this many layers, random weights")
    flags.DEFINE_list("batches", ["1", "16"], "batch sizes (max_num_seqs = the largest)")
    flags.DEFINE_integer("gen_tokens", 32, "output tokens per request")
    flags.DEFINE_integer("k", 4, "num_speculative_tokens")
    flags.DEFINE_integer("reps", 3, "timed (off, on) pairs per case")
    flags.DEFINE_integer("max_model_len", 1024, "bounds the page pool")
    flags.DEFINE_integer("prompt_min", 20, "prompt length range without a tokenizer")
    flags.DEFINE_integer("prompt_max", 80, "prompt length range without a tokenizer")
    flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
    flags.DEFINE_float("budget_s", 200.0, "start no new batch size after this many seconds")
    flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_spec"), "JSON dir (or .json file)")


def run(argv=None) -> None:
    from launch import common
    define_flags()
    common.run(main, "kimi-bench spec", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
