"""Small driver for profilers (ncu) and for a per-kernel device-time breakdown of the INT4 ops.

  python -m pallas_kernels.int4.profile_int4 --mode=ncu        # a few launches of each kernel, for ncu -k
  python -m pallas_kernels.int4.profile_int4 --mode=trace      # jax.profiler trace -> per-op device time

ncu replays each kernel, saving and restoring the memory it may touch: with 384 experts (~10 GB) that
took minutes per kernel, so give it fewer experts (16 already holds 400 MB, far past the 50 MB L2, and
T = 1 touches 8 of them); the twelfth session's stall breakdown (BENCHMARKS.md) came from

  ncu --clock-control none -k regex:moe_ --launch-skip 2 --launch-count 2 \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum" \
      python -m pallas_kernels.int4.profile_int4 --mode=ncu --experts=16 --batches=1 --ms=
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("mode", "trace", "ncu | trace")
flags.DEFINE_list("batches", ["1", "16"], "MoE token counts")
flags.DEFINE_list("ms", ["1"], "dense token counts")
flags.DEFINE_integer("experts", 384, "MoE: Kimi-shaped INT4 experts in the layer (fewer for ncu)")
flags.DEFINE_string("out", os.environ.get("OUT", "out/profile"), "output directory")


def _setup(key, e_):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4 import reference as int4_ref
    from pallas_kernels.int4 import moe_gmm as mg
    d, f = 7168, 2048
    g = int4_ref.random_int4(jax.random.fold_in(key, 1), (e_, f, d))
    u = int4_ref.random_int4(jax.random.fold_in(key, 2), (e_, f, d))
    dn = int4_ref.random_int4(jax.random.fold_in(key, 3), (e_, d, f))
    return [(mg.repack(p), s) for p, s in (g, u, dn)]


def _routing(key, t, e_=384, topk=8):
    import jax
    import jax.numpy as jnp
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, e_)[:topk])(jax.random.split(key, t))
    w = jax.random.uniform(jax.random.fold_in(key, 1), (t, topk))
    return idx.astype(jnp.int32), w


def device_time_breakdown(fn, args, n_calls, label):
    """Trace n_calls of fn; return {op name: device us per call} from the perfetto trace."""
    import jax
    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="int4trace")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n_calls):
            out = fn(*args)
        jax.block_until_ready(out)
    files = glob.glob(os.path.join(d, "**", "*perfetto*"), recursive=True) + \
        glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": f"no trace file under {d}: {os.listdir(d)}"}
    path = files[0]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        tr = json.load(fh)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    pid_names = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, nm in pid_names.items() if "GPU" in nm or "gpu" in nm or "/device:" in nm}
    if not gpu_pids:
        print("   process names in trace:", sorted(set(pid_names.values()))[:20], flush=True)
    tot = collections.Counter()
    first, last = None, None
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            tot[e["name"]] += e["dur"]
            first = e["ts"] if first is None else min(first, e["ts"])
            last = e["ts"] + e["dur"] if last is None else max(last, e["ts"] + e["dur"])
    res = {k: v / n_calls for k, v in tot.most_common(25)}
    res["_busy_total_us"] = sum(tot.values()) / n_calls
    if first is not None:
        res["_span_us"] = (last - first) / n_calls
    print(f"== {label}: device us per call (busy {res['_busy_total_us']:.1f}, "
          f"span {res.get('_span_us', 0):.1f})", flush=True)
    for k, v in list(res.items())[:18]:
        if not k.startswith("_"):
            print(f"   {v:9.1f}  {k[:90]}", flush=True)
    return res


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4 import matmul as im
    from pallas_kernels.int4 import reference as int4_ref
    from pallas_kernels.int4 import moe_gmm as mg
    key = jax.random.PRNGKey(0)
    experts = _setup(key, FLAGS.experts)
    os.makedirs(FLAGS.out, exist_ok=True)
    results = {}
    for t in [int(v) for v in FLAGS.batches]:
        x = jax.random.normal(jax.random.fold_in(key, 5), (t, 7168), jnp.bfloat16)
        routes = [_routing(jax.random.fold_in(key, 100 + r), t, FLAGS.experts) for r in range(4)]
        fn = jax.jit(lambda x, routes, ex: [mg.moe_experts(x, i, w, *ex[0], *ex[1], *ex[2])
                                            for i, w in routes])
        if FLAGS.mode == "ncu":
            for _ in range(2):
                jax.block_until_ready(fn(x, routes[:1], experts))
        else:
            results[f"moe T={t}"] = device_time_breakdown(fn, (x, routes, experts), len(routes),
                                                          f"moe T={t}")
    for m in [int(v) for v in FLAGS.ms]:
        ws = [int4_ref.random_int4(jax.random.fold_in(key, 50 + i), (4096, 7168)) for i in range(8)]
        ws = [(im.repack(p), s) for p, s in ws]
        xs = [jax.random.normal(jax.random.fold_in(key, 60 + i), (m, 7168), jnp.bfloat16)
              for i in range(8)]
        fn = jax.jit(lambda xs, ws: [im.int4_matmul(x, p, s) for x, (p, s) in zip(xs, ws)])
        if FLAGS.mode == "ncu":
            for _ in range(2):
                jax.block_until_ready(fn(xs[:1], ws[:1]))
        else:
            results[f"dense gate_up M={m}"] = device_time_breakdown(fn, (xs, ws), len(ws),
                                                                    f"dense gate_up M={m}")
    if results:
        with open(os.path.join(FLAGS.out, "breakdown.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
