r"""kimi-bench layout_depth: the decode step of the padded and the ragged step layout at depth, through
the engine core, in one process on one model: ms a step and a profiler census of its kernels.

  kimi-bench layout_depth --layers 61 --context 1024 --batches 1,32                  # 61x16, one GPU
  kimi-bench layout_depth --layers 8 --layouts padded,ragged,ragged:balanced
  kimi-bench layout_depth --tiny --layers 2 --context 256 --batches 1 --steps 4      # CPU

Per layout and batch: `EngineCore.run` (overlap scheduling on, fixed buffers) decodes --steps greedy
tokens for each of `batch` requests whose prompts of context - max(steps, page) - 1 tokens are already
in the pool (random latents), after a warm-up run of 3 tokens and one untimed run of --steps; ms a
step = wall / engine steps of a second timed run. Then --profile_steps more steps under jax.profiler:
the kernels' busy time and their count a step, and the most expensive kernels by name. A layout
`ragged:SCHEDULE` runs the ragged step with `ExecPlan.mla_schedule` SCHEDULE (the decode kernel's
work split); the padded rows keep the plan's own. The model is `--preset` with random weights
(`kimi_jax.tools.profiling.random_engine`), bfloat16 (the tiny preset in float32 with --tiny).
A layout with `+invariant` (`ragged+invariant`, `padded+invariant`, `ragged:rows+invariant`) runs
it with `ExecPlan.batch_invariant` on: the switch's cost beside the same layout without it.
`--check` first compares the ragged attention op under the plan's impl with its XLA path on random
inputs (the largest absolute difference). Rows: stdout and OUT/layout_depth.json.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import tempfile
import time

from absl import flags

from launch.bench.harness import random_pages, write_json

flags.DEFINE_string("preset", "kimi-k2.5-61x16", "model preset (kimi_jax.config.preset)")
flags.DEFINE_integer("layers", 0, "num_hidden_layers (0: the preset's)")
flags.DEFINE_list("batches", ["1", "32"], "decode batches")
flags.DEFINE_list("layouts", ["padded", "ragged"], "step layouts: padded, ragged or ragged:SCHEDULE")
flags.DEFINE_integer("context", 1024, "cached tokens per row (+ the decoded ones)")
flags.DEFINE_integer("steps", 20, "decode steps per timed run")
flags.DEFINE_integer("profile_steps", 8, "decode steps under the profiler (0: none)")
flags.DEFINE_integer("top", 15, "kernels listed per row")
flags.DEFINE_bool("check", False, "first compare the ragged attention op with its XLA path")
flags.DEFINE_bool("tiny", False, "CPU dry run: the tiny preset in float32")
flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_layout_depth"), "results")
FLAGS = flags.FLAGS

PAGE_SIZE = 16


def check_attention(plan) -> list[dict]:
    """The ragged attention op under `plan` against its XLA path: random bfloat16 rows (decode rows
    over long contexts, prompt chunks, a padding row), 64 and 8 heads."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    out = []
    spans = [(1000, 1), (0, 7), (300, 9), (0, 0), (2047, 1), (33, 1)]     # (cached, this step's)
    rng = np.random.default_rng(0)
    for heads in (64, 8):
        T, X, page = 32, 400, PAGE_SIZE
        ks = jax.random.split(jax.random.PRNGKey(heads), 4)
        bf = jnp.bfloat16
        q_lat = jax.random.normal(ks[0], (1, T, heads, 512)).astype(bf)
        q_pe = jax.random.normal(ks[1], (1, T, heads, 64)).astype(bf)
        new = jax.random.normal(ks[2], (1, T, 576)).astype(bf)
        pool = jax.random.normal(ks[3], (2, X, page, 576)).astype(bf)
        max_pages = max(-(-(c + n) // page) for c, n in spans)
        ids, fields, pages = rng.permutation(X), [[], [], [], []], []
        positions = np.full((1, T), -1, np.int32)
        start = 0
        for c, n in spans:
            held = -(-(c + n) // page)
            for f, v in zip(fields, (start, n, c, len(pages))):
                f.append(v)
            pages += list(ids[len(pages):len(pages) + held])
            positions[0, start:start + n] = c + np.arange(n)
            start += n
        pages_X = np.zeros((len(spans) * max_pages,), np.int32)
        pages_X[:len(pages)] = pages
        rows = ops.RaggedRows(*(np.asarray(f, np.int32) for f in fields), pages_X)

        def run(p):
            return jax.jit(lambda *a: ops.mla_ragged_attention(
                *a, 0.05, max_pages=max_pages, plan=p, layer=1))(q_lat, q_pe, new, pool, rows,
                                                                 positions).astype(jnp.float32)
        got, want = run(plan), run(dataclasses.replace(plan, impl="xla"))
        out.append(dict(kind="check", heads=heads, impl=plan.impl,
                        max_abs_diff=float(jnp.abs(got - want).max()),
                        max_abs=float(jnp.abs(want).max())))
    return out


def parse_layout(spec: str) -> tuple[str, str, bool]:
    """'LAYOUT[:SCHEDULE][+invariant]' -> (layout, schedule or '', batch_invariant)."""
    head, plus, tail = spec.partition("+")
    layout, _, schedule = head.partition(":")
    if plus and tail != "invariant":
        return "", "", False                  # not a layout: the caller names the spec
    return layout, schedule, bool(plus)


def measure(engine, layout: str, batch: int, context: int, steps: int, profile_steps: int,
            top: int) -> dict:
    """One row (see the module docstring)."""
    import jax
    import numpy as np
    from kimi_jax.engine.args import CacheConfig, SchedulerConfig
    from kimi_jax.engine.core import EngineCore
    from kimi_jax.engine.sampling import SamplingParams
    from kimi_jax.tools.profiling import device_op_events, find_trace_file
    cfg = engine.cfg
    prompt_len = context - max(steps, PAGE_SIZE) - 1
    cache = CacheConfig(PAGE_SIZE, batch * (-(-context // PAGE_SIZE)) + 8, engine.cache_dtype)
    sc = SchedulerConfig(batch, context, 256, 2048, overlap_scheduling=True,
                         step_layout=parse_layout(layout)[0], max_num_batched_tokens=256)
    core = EngineCore(engine, sc, cache)
    pool = core.scheduler.pool
    core.runner.pages = random_pages(engine, pool.num_pages)
    rng = np.random.default_rng(0)

    def one(n: int, tag: str) -> tuple[float, int]:
        for i in range(batch):
            ids = [int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len)]
            [r] = core.make_request(f"{tag}{i}", ids, SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True), seed=i)
            r.num_computed = prompt_len - 1     # prompt cached but its last token: decode only
            r.pages = pool.take(-(-r.num_computed // PAGE_SIZE))
            core.add([r])
        s0, t0 = core.stats["steps"], time.perf_counter()
        core.run()
        return time.perf_counter() - t0, core.stats["steps"] - s0

    one(3, "w")
    one(steps, "v")
    wall, n = one(steps, "t")
    row = dict(kind="step", layout=layout, batch=batch, layers=cfg.num_hidden_layers,
               context=context, batch_invariant=engine.exec_plan.batch_invariant,
               ms_per_step=1e3 * wall / n, engine_steps=n)
    if profile_steps:
        tdir = tempfile.mkdtemp(prefix="kimi_layout_")
        with jax.profiler.trace(tdir):
            _, n = one(profile_steps, "p")
        per, count = collections.defaultdict(float), collections.Counter()
        for o in device_op_events(find_trace_file(tdir)):
            if o.dur_us > 0:
                per[o.kernel or o.name] += o.dur_us / n
                count[o.kernel or o.name] += 1
        row.update(busy_ms_per_step=sum(per.values()) / 1e3,
                   kernels_per_step=sum(count.values()) / n,
                   top=[(k, round(v, 1), round(count[k] / n, 1))
                        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]])
    core.runner.resident.clear()          # the next row's core needs the device memory
    return row


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from kimi_jax.config import preset
    from kimi_jax.ops import ExecPlan
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.tools.profiling import random_engine
    from launch import common
    common.setup()
    for spec in FLAGS.layouts:
        layout, schedule, _ = parse_layout(spec)
        if layout not in ("padded", "ragged") or (schedule and layout != "ragged"):
            common.fail("kimi-bench layout_depth", f"--layouts: {spec!r} is not padded, ragged "
                        "or ragged:SCHEDULE, each with an optional +invariant")
    cfg = preset("tiny" if FLAGS.tiny else FLAGS.preset)
    if FLAGS.layers:
        cfg = cfg.replace(num_hidden_layers=FLAGS.layers)
    t0 = time.perf_counter()
    engine = random_engine(cfg, Layout(1), jnp.float32 if FLAGS.tiny else jnp.bfloat16,
                           plan=ExecPlan.for_backend())
    jax.block_until_ready(jax.tree.leaves(engine.state))
    base = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                preset="tiny" if FLAGS.tiny else FLAGS.preset)
    rows = [dict(kind="build", seconds=time.perf_counter() - t0, **base)]
    plan = engine.exec_plan
    if FLAGS.check:
        rows += [dict(r, **base) for r in check_attention(plan)]
    for spec in FLAGS.layouts:
        layout, schedule, invariant = parse_layout(spec)
        engine.exec_plan = dataclasses.replace(
            plan, batch_invariant=invariant,
            mla_schedule=schedule or None if layout == "ragged" else plan.mla_schedule)
        for b in (int(x) for x in FLAGS.batches):
            rows.append(dict(measure(engine, spec, b, FLAGS.context, FLAGS.steps,
                                     FLAGS.profile_steps, FLAGS.top), **base))
    for r in rows:
        if r["kind"] == "check":
            print(f"check {r['heads']} heads ({r['impl']} vs xla): max |diff| "
                  f"{r['max_abs_diff']:.4g} at values up to {r['max_abs']:.4g}")
        elif r["kind"] == "step":
            busy = f", kernels {r['busy_ms_per_step']:.2f} ms / {r['kernels_per_step']:.0f}" \
                if "busy_ms_per_step" in r else ""
            print(f"{r['layout']:16} B{r['batch']:<3} {r['ms_per_step']:.2f} ms a step{busy}")
            for k, v, c in r.get("top", []):
                print(f"    {v:9.1f} us  x{c:6.1f}  {k}")
    print("wrote", write_json(FLAGS.out, "layout_depth.json", rows), flush=True)


def run(argv=None) -> None:
    from absl import app
    app.run(main, argv)


if __name__ == "__main__":
    run()
