"""Prefix caching benchmark: the same workloads with caching on and off, side by side in one run.

  shared:   N requests sharing a P-token prefix (a system prompt, tool declarations) with distinct
            Q-token questions: prefill tokens computed and wall time, on and off;
  distinct: N requests with no common prefix: the cost of hashing and the cache's bookkeeping when
            nothing hits (on / off wall time).

Each configuration is timed `--repeats` times on a fresh batch engine (fresh page pool: nothing
cached from an earlier repeat) after a warm-up that compiles every shape, on and off alternating so
that both see the same machine; the minimum is reported. With caching on, the host time spent in the
cache's own bookkeeping (page hashes, lookups, registration, reference counts) is also measured
directly (`cache_s`): wall-time differences of a few percent are within a shared machine's noise, the
bookkeeping time is not. Greedy outputs of on and off are compared token by token. Random weights of
the demo model's geometry, with room for the prompts (its context is raised to the workload's length).

  kimi-bench prefix_cache --requests=64 --prefix=1024 --question=32
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import numpy as np


def workloads(n: int, prefix: int, question: int, vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, vocab, prefix).tolist()
    return {"shared": [shared + rng.integers(2, vocab, question).tolist() for _ in range(n)],
            "distinct": [rng.integers(2, vocab, prefix + question).tolist() for _ in range(n)]}


@contextlib.contextmanager
def timed_cache_bookkeeping(clock: list):
    """Add the seconds spent in the prefix cache's host bookkeeping to clock[0] while inside: the
    scheduler's page hashing and the page pool's lookups, registration and reference counts."""
    from kimi_jax.engine import page_pool, scheduler

    depth = [0]                      # a timed call inside another (acquire -> peek) counts once

    def timed(fn):
        def wrapper(*a, **k):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    clock[0] += time.perf_counter() - t0
        return wrapper

    saved = [(scheduler, "chain_hashes", scheduler.chain_hashes)]
    saved += [(page_pool.PagePool, name, getattr(page_pool.PagePool, name))
              for name in ("peek", "acquire", "register", "give", "take")]
    for owner, name, fn in saved:
        setattr(owner, name, timed(fn))
    try:
        yield clock
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_once(llm, prompts, gen_tokens: int):
    """(wall seconds, the engine core's stats, outputs, seconds in the cache's bookkeeping)."""
    from kimi_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    be = llm.frontend.make_core()
    reqs = [r for i, p in enumerate(prompts) for r in be.make_request(str(i), p, sp, seed=i)]
    with timed_cache_bookkeeping([0.0]) as clock:
        t0 = time.perf_counter()
        for r in reqs:
            be.add([r])
        be.run()
        wall = time.perf_counter() - t0
    return wall, be.stats, [r.output_ids for r in reqs], clock[0]


def prefix_cache_rows(model, *, requests: int, prefix: int, question: int, gen_tokens: int,
                      max_num_seqs: int, repeats: int, dtype: str) -> list[dict]:
    from kimi_jax import LLM
    from kimi_jax.config import ModelConfig
    from kimi_jax.entrypoints.llm import demo_model_path
    if model is None:
        cfg = ModelConfig.from_pretrained(demo_model_path())
        model = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                                     2 * (prefix + question + gen_tokens)))
    llms = {on: LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, enable_prefix_caching=on)
            for on in (False, True)}
    rows = []
    for name, prompts in workloads(requests, prefix, question, llms[False].config.vocab_size).items():
        for llm in llms.values():          # compile every shape of the workload
            run_once(llm, prompts, gen_tokens)
        best, outs, walls = {}, {}, {False: [], True: []}
        for _ in range(repeats):           # on and off alternate, so both see the same machine load
            for on, llm in llms.items():
                wall, stats, outs[on], cache_s = run_once(llm, prompts, gen_tokens)
                walls[on].append(wall)
                if on not in best or wall < best[on][0]:
                    best[on] = (wall, stats, cache_s)
        for on in (False, True):
            wall, stats, cache_s = best[on]
            rows.append({"workload": name, "caching": on, "requests": requests,
                         "prompt_tokens": sum(map(len, prompts)), "prefill_tokens_computed": stats["prompt_tokens"],
                         "cache_hit_tokens": stats["prefix_cache_hits"], "wall_s": round(wall, 4),
                         "wall_s_all": [round(w, 4) for w in walls[on]],
                         "cache_s": round(cache_s, 5) if on else None,
                         "prefill_passes": stats["prefill_passes"], "steps": stats["steps"]})
        rows[-1]["tokens_equal_off"] = outs[True] == outs[False]
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'workload':>9} {'caching':>7} {'prompt tok':>10} {'computed':>9} {'hits':>8} {'wall s':>8} "
            f"{'vs off':>7} {'cache s':>8}")
    lines, off = [head], {}
    for r in rows:
        if not r["caching"]:
            off[r["workload"]] = r["wall_s"]
        ratio = r["wall_s"] / off[r["workload"]] if r["workload"] in off else float("nan")
        lines.append(f"{r['workload']:>9} {('on' if r['caching'] else 'off'):>7} {r['prompt_tokens']:>10} "
                     f"{r['prefill_tokens_computed']:>9} {r['cache_hit_tokens']:>8} {r['wall_s']:>8.3f} {ratio:>7.3f} "
                     + (f"{r['cache_s']:>8.4f}" if r["caching"] else f"{'-':>8}")
                     + ("" if "tokens_equal_off" not in r else f"  tokens equal: {r['tokens_equal_off']}"))
    return "\n".join(lines)


def main(argv):
    del argv
    from absl import flags
    from launch import common
    FLAGS = flags.FLAGS
    common.setup()
    import jax
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  jax {jax.__version__}", flush=True)
    rows = prefix_cache_rows(FLAGS.model, requests=FLAGS.requests, prefix=FLAGS.prefix, question=FLAGS.question,
                             gen_tokens=FLAGS.gen_tokens, max_num_seqs=FLAGS.max_num_seqs,
                             repeats=FLAGS.repeats, dtype=FLAGS.dtype)
    print(format_rows(rows))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


def define_flags() -> None:
    from absl import flags
    if "question" in flags.FLAGS:
        return
    flags.DEFINE_integer("requests", 64, "requests per workload")
    flags.DEFINE_integer("prefix", 1024, "shared prefix length (tokens)")
    flags.DEFINE_integer("question", 32, "distinct question length after the prefix (tokens)")
    flags.DEFINE_integer("gen_tokens", 4, "output tokens per request (greedy, ignore_eos)")
    flags.DEFINE_integer("max_num_seqs", 64, "batch slots")
    flags.DEFINE_integer("repeats", 3, "timed runs per configuration, on and off alternating (the minimum is "
                         "reported)")
    flags.DEFINE_string("dtype", "float32", "model dtype")
    flags.DEFINE_string("model", None, "checkpoint dir or preset (default: the demo model's geometry, random "
                        "weights)")
    flags.DEFINE_string("json_out", None, "write the rows as JSON here")


def run(argv=None) -> None:
    from launch import common
    define_flags()
    common.run(main, "kimi-bench prefix_cache", __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
