r"""kimi-bench step_layout: the padded and the ragged step layout on the demo model, one process a
layout and a measurement, the same limits for both.

  python3 -m launch.bench.step_layout                      # every part, both layouts (CPU: ~10 min)
  python3 -m launch.bench.step_layout --parts=decode --layouts=ragged
  python3 -m launch.bench.step_layout --child=decode --layout=ragged --dry   # one part, here

Parts (--parts), each run for each layout in --layouts, a fresh process each:
- first: `LLM(...)` (import, load) then its first generate (one prompt, --tokens greedy tokens),
  with an empty persistent compilation cache (KIMI_JAX_CACHE_DIR, a fresh directory), then again
  with it warm.
- precompile: `LLM(...).precompile()` of the whole set (`Runner.programs`: seconds, programs, the
  programs jax lowered) at --precompile_limits, cold then warm as above; then a mixed workload
  (greedy, sampled and logprobs requests) whose lowerings must be 0 (the set covers it).
- generate: `python -m launch.generate --step_layout L` (kimi-generate: the demo, its default
  prompt, 64 sampled tokens), wall clock of the whole process, cold (an empty cache) then warm.
- decode: greedy decoding at each --batches (16-token prompts, --tokens tokens each) and a mixed
  load (--mixed_prompts prompts of --mixed_len tokens, --tokens out each, --seqs rows): the fastest
  of --reps timed runs after a warm-up run of the same shapes (other prompts); ms a step (wall / the
  engine's steps), output tokens/s, steps, and a digest of the tokens (the same in both layouts).
- serve: `python -m launch.serve --step_layout L` on 127.0.0.1 (a free port; the cache the
  precompile and decode parts filled, one directory a layout: other shapes compile on first use), then `python -m launch.bench_serve` at each
  --serve_concurrency (--serve_prompts prompts of --serve_input_len tokens, --tokens out, as many
  warm-up requests as the concurrency); the server's kimi_jax:compiled_programs_total at ready and
  after each load, and bench_serve's count over its timed run; the server is stopped by its PID.
Rows go to stdout and --out/step_layout.json. On the CPU the ragged step's attention is the
portable jnp path (a gather of each token's pages), not a kernel.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import flags

PARTS = ("first", "precompile", "generate", "decode", "serve")
flags.DEFINE_list("layouts", ["padded", "ragged"], "step layouts to measure")
flags.DEFINE_list("parts", list(PARTS), f"what to measure: {', '.join(PARTS)}")
flags.DEFINE_enum("child", None, ["first", "precompile", "decode"],
                  "run one part for --layout in this process")
flags.DEFINE_enum("layout", "padded", ["padded", "ragged"], "the layout of --child")
flags.DEFINE_integer("seqs", 8, "max_num_seqs of every engine")
flags.DEFINE_integer("model_len", 1024, "max_model_len of every engine")
flags.DEFINE_integer("chunk", 256, "prefill_chunk of every engine")
flags.DEFINE_integer("prefill_tokens", 512,
                     "max_prefill_tokens (the ragged budget: max(this, seqs))")
flags.DEFINE_list("precompile_limits", ["4", "512", "64", "128"],
                  "the precompile part's max_num_seqs, max_model_len, prefill_chunk, "
                  "max_prefill_tokens (smaller: the padded set compiles for minutes on a CPU)")
flags.DEFINE_integer("tokens", 64, "output tokens per request")
flags.DEFINE_list("batches", ["1", "8"], "decode batches")
flags.DEFINE_integer("reps", 2, "timed runs per decode case (the fastest is kept)")
flags.DEFINE_integer("mixed_prompts", 16, "prompts of the mixed load")
flags.DEFINE_list("mixed_len", ["200", "600"],
                  "the mixed load's prompt lengths: LOW,HIGH (uniform)")
flags.DEFINE_integer("serve_prompts", 32, "requests per kimi-bench-serve run")
flags.DEFINE_integer("serve_input_len", 256, "prompt tokens per served request")
flags.DEFINE_list("serve_concurrency", ["1", "8"], "kimi-bench-serve --max_concurrency values")
flags.DEFINE_float("ready_timeout_s", 900.0, "seconds the server may take to report ready")
flags.DEFINE_bool("dry", False,
                  "quick check: 4 tokens, batches 1 and 2, 2 mixed prompts of 20-40 tokens")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_step_layout"), "results directory")
FLAGS = flags.FLAGS
PROMPT = "The with statement"


def engine_kwargs(layout: str, precompile: bool = False) -> dict:
    limits = ([int(x) for x in FLAGS.precompile_limits] if precompile
              else [FLAGS.seqs, FLAGS.model_len, FLAGS.chunk, FLAGS.prefill_tokens])
    return dict(zip(("max_num_seqs", "max_model_len", "prefill_chunk", "max_prefill_tokens"),
                    limits), dtype="float32", step_layout=layout)


def digest(outputs) -> str:
    ids = [list(c.token_ids) for o in outputs for c in o.outputs]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def mixed_prompts(rng, vocab: int) -> list:
    low, high = (int(x) for x in FLAGS.mixed_len)
    return [rng.integers(2, vocab, int(n)).tolist()
            for n in rng.integers(low, high + 1, FLAGS.mixed_prompts)]


# ---- one part in this process -------------------------------------------------------------------
def child_first() -> dict:
    t0 = time.perf_counter()
    from kimi_jax import LLM, SamplingParams
    from kimi_jax.engine import compiles
    compiles.install()
    t1 = time.perf_counter()
    llm = LLM(**engine_kwargs(FLAGS.layout))
    t2 = time.perf_counter()
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=FLAGS.tokens,
                                              ignore_eos=True), use_tqdm=False)
    t3 = time.perf_counter()
    return dict(import_s=t1 - t0, llm_s=t2 - t1, first_generate_s=t3 - t2, total_s=t3 - t0,
                lowered=compiles.compile_count(), tokens=digest(out))


def child_precompile() -> dict:
    import numpy as np
    from kimi_jax import LLM, SamplingParams
    from kimi_jax.engine import compiles
    compiles.install()
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(FLAGS.layout, precompile=True))
    t1 = time.perf_counter()
    n = llm.precompile()
    t2 = time.perf_counter()
    lowered = compiles.compile_count()
    # a workload within the limits: every program it runs must be in the set
    rng = np.random.default_rng(1)
    prompts = [p[:llm.max_model_len - FLAGS.tokens]
               for p in mixed_prompts(rng, llm.config.vocab_size)[:2 * llm.max_num_seqs]]
    params = [SamplingParams(temperature=0.0, max_tokens=FLAGS.tokens, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=FLAGS.tokens, seed=3),
              SamplingParams(temperature=0.0, max_tokens=FLAGS.tokens, logprobs=2)]
    llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
    return dict(llm_s=t1 - t0, precompile_s=t2 - t1, programs=n, lowered=lowered,
                lowered_by_workload=compiles.compile_count() - lowered)


def child_decode() -> dict:
    import numpy as np
    from kimi_jax import LLM, SamplingParams
    llm = LLM(**engine_kwargs(FLAGS.layout))
    core, vocab = llm.engine_core(), llm.config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    cases = [(f"batch {B}", lambda B=B: [rng.integers(2, vocab, 16).tolist() for _ in range(B)])
             for B in map(int, FLAGS.batches)]
    cases.append(("mixed", lambda: mixed_prompts(rng, vocab)))
    rows = []
    for name, make in cases:
        llm.generate(make(), sp, use_tqdm=False)           # the same shapes: compiled here
        best, digests = None, []
        for _ in range(FLAGS.reps):
            prompts = make()
            steps0 = core.stats["steps"]
            t0 = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            digests.append(digest(out))
            if best is None or wall < best["wall_s"]:
                steps = core.stats["steps"] - steps0
                n_out = sum(len(c.token_ids) for o in out for c in o.outputs)
                best = dict(case=name, wall_s=wall, steps=steps, ms_per_step=1e3 * wall / steps,
                            output_tokens=n_out, out_tok_s=n_out / wall,
                            prompt_tokens=sum(map(len, prompts)))
        rows.append(dict(best, tokens=digests))     # every timed run's tokens, in order
    return dict(cases=rows, overlapped_steps=core.stats["overlapped_steps"])


# ---- the driver ---------------------------------------------------------------------------------
def _flag_args() -> list:
    names = ("seqs", "model_len", "chunk", "prefill_tokens", "tokens", "reps", "mixed_prompts")
    args = [f"--{n}={getattr(FLAGS, n)}" for n in names]
    return args + [f"--{n}={','.join(getattr(FLAGS, n))}"
                   for n in ("batches", "mixed_len", "precompile_limits")]


def _env(cache: str) -> dict:
    env = dict(os.environ, KIMI_JAX_CACHE_DIR=cache)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def spawn_child(part: str, layout: str, cache: str) -> dict:
    cmd = [sys.executable, "-m", "launch.bench.step_layout", f"--child={part}",
           f"--layout={layout}", f"--out={FLAGS.out}"] + _flag_args()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    row = json.loads(r.stdout.strip().splitlines()[-1])
    return dict(row, process_s=wall)


def run_generate(layout: str, cache: str) -> dict:
    cmd = [sys.executable, "-m", "launch.generate", f"--step_layout={layout}"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return dict(process_s=wall, text=r.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str):
    """The server's kimi_jax:compiled_programs_total."""
    import asyncio
    from launch.bench_serve import compiled_programs
    return asyncio.run(compiled_programs(url, {}))


def run_serve(layout: str, cache: str, work: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(FLAGS.out, f"serve_{layout}.log"), "w")
    cmd = [sys.executable, "-m", "launch.serve", "--host=127.0.0.1", f"--port={port}",
           "--dtype=float32", f"--step_layout={layout}", f"--max_num_seqs={FLAGS.seqs}",
           f"--max_model_len={FLAGS.model_len}", f"--prefill_chunk={FLAGS.chunk}",
           f"--max_prefill_tokens={FLAGS.prefill_tokens}", "--noaccess_log"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(cache), stdout=log, stderr=subprocess.STDOUT)
    row = dict(port=port, pid=proc.pid, loads=[])
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} before ready "
                                   f"(log: {log.name})")
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > FLAGS.ready_timeout_s:
                raise RuntimeError(f"the server was not ready in {FLAGS.ready_timeout_s} s")
            time.sleep(0.5)
        row.update(ready_s=time.perf_counter() - t0, compiled_at_ready=metric(url))
        for c in map(int, FLAGS.serve_concurrency):
            res = os.path.join(work, f"serve_{layout}_c{c}.json")
            bench = [sys.executable, "-m", "launch.bench_serve", f"--base_url={url}",
                     f"--num_prompts={FLAGS.serve_prompts}", f"--max_concurrency={c}",
                     f"--input_len={FLAGS.serve_input_len}", f"--output_len={FLAGS.tokens}",
                     f"--num_warmups={c}", f"--result_json={res}"]
            r = subprocess.run(bench, env=_env(cache), capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(bench)} exited {r.returncode}: {r.stderr[-2000:]}")
            got = json.load(open(res))
            row["loads"].append(dict(
                concurrency=c, out_tok_s=got["output_throughput"], errors=got["errors"],
                ttft_ms={k: got["ttft_ms"][k] for k in ("p50", "p99")},
                tpot_ms={k: got["tpot_ms"][k] for k in ("p50", "p99")},
                compiles_during_run=got["compiles_during_run"], compiled_after=metric(url)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            row["exit"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            row["exit"] = proc.wait()
        log.close()
    return row


def driver() -> None:
    from absl import app
    for name, allowed in (("parts", PARTS), ("layouts", ("padded", "ragged"))):
        bad = [x for x in getattr(FLAGS, name) if x not in allowed]
        if bad:
            raise app.UsageError(f"--{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
    os.makedirs(FLAGS.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kimi_step_layout_")
    caches = {}
    result = dict(started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), parts={},
                  limits=dict(max_num_seqs=FLAGS.seqs, max_model_len=FLAGS.model_len,
                              prefill_chunk=FLAGS.chunk, max_prefill_tokens=FLAGS.prefill_tokens))
    try:
        for part in [p for p in PARTS if p in FLAGS.parts]:
            rows = result["parts"].setdefault(part, [])
            for layout in FLAGS.layouts:
                load = os.getloadavg()[0]
                if part in ("first", "precompile", "generate"):
                    cache = tempfile.mkdtemp(prefix=f"{part}_{layout}_", dir=work)
                    if part == "precompile":
                        caches[layout] = cache
                    for state in ("cold", "warm"):
                        row = (run_generate(layout, cache) if part == "generate"
                               else spawn_child(part, layout, cache))
                        rows.append(dict(row, layout=layout, cache=state, load=load))
                        print(json.dumps(rows[-1]), flush=True)
                    continue
                cache = caches.get(layout) or tempfile.mkdtemp(prefix=f"{part}_{layout}_", dir=work)
                caches[layout] = cache
                row = spawn_child(part, layout, cache) if part == "decode" else run_serve(
                    layout, cache, work)
                rows.append(dict(row, layout=layout, load=load, load_after=os.getloadavg()[0]))
                print(json.dumps(rows[-1]), flush=True)
        import jax
        result.update(jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                      cpus=os.cpu_count())
    finally:
        with open(os.path.join(FLAGS.out, "step_layout.json"), "w") as f:
            json.dump(result, f, indent=1)
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {os.path.join(FLAGS.out, 'step_layout.json')}")


def main(argv):
    del argv
    if FLAGS.dry:
        FLAGS.tokens, FLAGS.batches, FLAGS.reps = 4, ["1", "2"], 1
        FLAGS.mixed_prompts, FLAGS.mixed_len = 2, ["20", "40"]
    if FLAGS.child is None:
        return driver()
    row = dict(first=child_first, precompile=child_precompile, decode=child_decode)[FLAGS.child]()
    print(json.dumps(dict(row, layout=FLAGS.layout, part=FLAGS.child)), flush=True)


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench step_layout", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
