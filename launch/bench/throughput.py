"""kimi-bench throughput: N prompts with a length distribution through the continuous-batching
engine, at several max batch sizes.
  kimi-bench throughput --model=kimi-k2.5 --num_layers=3 --batches=1,16,64,256 --out=$OUT/throughput
  kimi-bench throughput --model=tiny --num_layers=2 --dtype=float32 --batches=2 --gen_tokens=3   # CPU


For each batch size B: N = max(2B, 8) requests with prompt lengths drawn from a log-uniform
distribution over [--min_prompt, --max_prompt] and --gen_tokens output tokens each (ignore_eos, so
every request produces exactly that many), run after a warm-up pass that compiles every shape.
Reports output tokens/s, the engine step count and the wall time per step (each running sequence
gains one token per step, so this is the time between a user's tokens; wall / gen_tokens would
overstate it whenever the requests outnumber the batch), and
the requests' own latencies (`RequestOutput.metrics`, as the host saw them): time to first token
(median and max; every request arrives at the start, so queueing behind the batch is included) and
time per output token after the first (median and max over requests).
`prefill_chunks` runs the workload at each prefill_chunk (None: LLM's default) on the one model.
`overlaps` runs each batch size under each scheduler (overlap scheduling on / off) on the one model,
so the comparison shares the weights and the compiled programs. Each row keeps the greedy outputs
(`outputs`, token ids per request) so two runs of the same workload under different kernels or
schedulers can be compared token by token (`agreement`).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from launch.bench.harness import run_prompts

PROG = "kimi-bench throughput"


def random_prompts(seed: int, n: int, min_prompt: int, max_prompt: int, vocab: int):
    """The workload's prompts: n lengths log-uniform in [min_prompt, max_prompt], then random token ids
    in [2, vocab) (one generator, seeded). Returns (lengths [n] int array, prompts as id lists)."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(np.log(min_prompt), np.log(max_prompt), n)).astype(int)
    return lens, [rng.integers(2, vocab, int(L)).tolist() for L in lens]


def throughput_rows(model, batches, *, n_min: int = 8, min_prompt: int = 16, max_prompt: int = 256,
                    gen_tokens: int = 32, dtype: str = "bfloat16", seed: int = 0,
                    overlaps: tuple[bool, ...] = (True,), prefill_chunks: tuple = (None,),
                    **llm_kw) -> list[dict]:
    from kimi_jax import LLM, SamplingParams
    from kimi_jax.entrypoints.llm import latency_metrics
    rows = []
    # one model for every batch size: the weights are made once and the compiled programs of the
    # smaller batches' buckets are shared
    t_start = time.perf_counter()
    progress = lambda *a: print(f"[throughput {time.perf_counter() - t_start:7.1f}s]", *a, flush=True)  # noqa: E731
    llm = LLM(model, dtype=dtype, max_num_seqs=max(batches), **llm_kw)
    default_chunk = llm.prefill_chunk
    progress("model ready")
    V = llm.config.vocab_size
    for B in batches:
        n = max(2 * B, n_min)
        lens, prompts = random_prompts(seed, n, min_prompt, max_prompt, V)
        sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)

        for chunk, overlap in [(c, o) for c in prefill_chunks for o in overlaps]:
            core = dict(max_num_seqs=B, overlap_scheduling=overlap, prefill_chunk=chunk or default_chunk)
            what = f"batch {B}, overlap {overlap}, prefill_chunk {core['prefill_chunk']}"
            progress(f"{what}: warm-up pass (compiles every bucket this workload hits)")
            run_prompts(llm, prompts, sp, **core)
            progress(f"{what}: timed pass")
            wall, reqs, stats = run_prompts(llm, prompts, sp, **core)   # all arrive at the start
            out_tok = stats["generated_tokens"]
            lat = [latency_metrics(r) for r in reqs]
            ttft = np.asarray([m["time_to_first_token"] for m in lat], float)
            tpot = np.asarray([m["time_per_output_token"] for m in lat if m["time_per_output_token"] is not None],
                              float)
            rows.append(dict(batch=B, overlap=overlap, prefill_chunk=core["prefill_chunk"], requests=n,
                             prompt_tokens=int(lens.sum()), output_tokens=out_tok, wall_s=wall,
                             tok_s=out_tok / wall, steps=stats["steps"],
                             step_ms=1e3 * wall / max(1, stats["steps"]),
                             ttft_p50_ms=1e3 * float(np.median(ttft)), ttft_max_ms=1e3 * float(ttft.max()),
                             tpot_p50_ms=1e3 * float(np.median(tpot)) if tpot.size else float("nan"),
                             tpot_max_ms=1e3 * float(tpot.max()) if tpot.size else float("nan"),
                             outputs=[list(r.output_ids) for r in reqs]))
    return rows


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token-by-token agreement of two runs' greedy outputs: requests identical, each request's first
    differing position (None: none), and the mean length of the common prefix as a fraction of the
    output (bf16 kernels that sum in another order can flip a near-tie and then diverge; a wrong kernel
    disagrees from the first token)."""
    diff = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
    prefix = [(min(len(x), len(y)) if d is None else d) / max(1, len(x)) for d, x, y in zip(diff, a, b)]
    first = sum(bool(x) and bool(y) and x[0] == y[0] for x, y in zip(a, b))
    return dict(identical=sum(x == y for x, y in zip(a, b)), requests=len(a), first_token_equal=first,
                mean_prefix=sum(prefix) / max(1, len(prefix)), first_difference=diff)


def format_rows(rows) -> str:
    out = [f"{'max batch':>9} {'overlap':>7} {'chunk':>5} {'requests':>8} {'prompt tok':>10} {'out tok':>8} "
           f"{'wall s':>7} {'out tok/s':>9} {'ms/step':>8} {'steps':>6} {'TTFT p50/max ms':>17} "
           f"{'TPOT p50/max ms':>17}"]
    for r in rows:
        out.append(f"{r['batch']:9d} {str(r.get('overlap', '')):>7} {r['prefill_chunk']:5d} {r['requests']:8d} "
                   f"{r['prompt_tokens']:10d} {r['output_tokens']:8d} "
                   f"{r['wall_s']:7.2f} {r['tok_s']:9.1f} {r['step_ms']:8.2f} {r['steps']:6d} "
                   f"{r['ttft_p50_ms']:8.1f}/{r['ttft_max_ms']:8.1f} {r['tpot_p50_ms']:8.2f}/{r['tpot_max_ms']:8.2f}")
    return "\n".join(out)


# ---- the command line ---------------------------------------------------------------------------------
def define_flags() -> None:
    from absl import flags
    if "mla_kernels" in flags.FLAGS:
        return
    flags.DEFINE_string("model", None, "checkpoint dir or preset (default: the demo model)")
    flags.DEFINE_integer("num_layers", None, "with a preset --model: a slice of this many layers (random weights "
                         "of the true geometry)")
    flags.DEFINE_list("batches", ["1", "16", "64", "256"], "max batch sizes")
    flags.DEFINE_integer("gen_tokens", 32, "output tokens per request")
    flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
    flags.DEFINE_integer("max_model_len", None, "LLM max_model_len")
    flags.DEFINE_integer("num_pages", None, "LLM num_pages (default: from free memory)")
    flags.DEFINE_list("mla_kernels", ["auto"], "paged MLA decode kernels to run the same workload under (auto, "
                      "triton, mgpu; the ExecPlan's mla_decode_kernel); later ones are compared token by token "
                      "with the first")
    flags.DEFINE_integer("min_prompt", 16, "shortest prompt (log-uniform lengths)")
    flags.DEFINE_integer("max_prompt", 256, "longest prompt")
    flags.DEFINE_bool("overlap", True, "overlap scheduling (LLM overlap_scheduling: decode step N+1 dispatched "
                      "before step N's tokens are read); --nooverlap for the synchronous scheduler")
    flags.DEFINE_list("prefill_chunks", [], "run the workload at each of these prefill_chunk values "
                      "(default: LLM's)")
    flags.DEFINE_bool("overlap_compare", False, "run every batch size with overlap scheduling on and off on one "
                      "model (shared weights and compiled programs) and compare their greedy outputs")
    flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_throughput"),
                        "directory for results.jsonl")


def main(argv):
    del argv
    from absl import flags
    from kimi_jax import ops
    from launch import common
    FLAGS = flags.FLAGS
    common.setup()
    model = FLAGS.model
    if FLAGS.num_layers:
        from kimi_jax.config import preset
        model = preset(model).replace(num_hidden_layers=FLAGS.num_layers)
    os.makedirs(FLAGS.out, exist_ok=True)
    first = None
    for kernel in FLAGS.mla_kernels:
        rows = throughput_rows(model, [int(b) for b in FLAGS.batches], gen_tokens=FLAGS.gen_tokens,
                               dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len, num_gpu_blocks_override=FLAGS.num_pages,
                               overlaps=(True, False) if FLAGS.overlap_compare else (FLAGS.overlap,),
                               min_prompt=FLAGS.min_prompt, max_prompt=FLAGS.max_prompt,
                               prefill_chunks=tuple(int(c) for c in FLAGS.prefill_chunks) or (None,),
                               exec_plan=ops.ExecPlan.for_backend(mla_decode_kernel=kernel))
        # the scheduler must not change what is generated: overlap on vs off, row pairs of one batch size
        sched = [(on["batch"], agreement(on["outputs"], off["outputs"]))
                 for on, off in zip(rows[0::2], rows[1::2])] if FLAGS.overlap_compare else []
        # ... nor the prefill chunk size: each row against the first chunk size's row of its batch / overlap
        base: dict = {}
        for r in rows:
            base.setdefault((r["batch"], r["overlap"]), r)
        chunked = [(r, agreement(base[(r["batch"], r["overlap"])]["outputs"], r["outputs"])) for r in rows
                   if base[(r["batch"], r["overlap"])] is not r]
        for i, r in enumerate(rows):
            outputs = r.pop("outputs")
            if first is None:
                r["outputs"] = outputs
            else:
                r["agreement"] = agreement(first[i]["outputs"], outputs)
            with open(os.path.join(FLAGS.out, "results.jsonl"), "a") as f:
                f.write(json.dumps(dict(suite="throughput", mla_kernel=kernel,
                                        **{k: v for k, v in r.items() if k != "outputs"}), default=str) + "\n")
        print(f"mla kernel: {kernel}")
        print(format_rows(rows))
        for r in rows:
            if "agreement" in r:
                print(f"  batch {r['batch']} overlap {r['overlap']} vs {FLAGS.mla_kernels[0]}: {r['agreement']}")
        for batch, a in sched:
            print(f"  batch {batch} overlap on vs off: {a}")
        for r, a in chunked:
            print(f"  batch {r['batch']} overlap {r['overlap']} prefill_chunk {r['prefill_chunk']} vs "
                  f"{base[(r['batch'], r['overlap'])]['prefill_chunk']}: {a}")
        first = first or rows


def run(argv=None) -> None:
    from launch import common
    define_flags()
    common.run(main, PROG, __name__, __doc__, argv=argv)


if __name__ == "__main__":
    run()
