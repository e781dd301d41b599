r"""kimi-bench gemv: the bf16 projections of Kimi-K2.5's decode step at their TP8 shard shapes, against
a copy of the same bytes in the same run.

  kimi-bench gemv --rows 1,16
  kimi-bench gemv --dry --rows 1 --max_copies 2 --reps 1 --out /tmp/x   # CPU, 1/16 of every dimension

Each case is y[M, N] = x[M, K] @ W[N, K]^T as the model runs it (`jnp.einsum` with bf16 output,
float32 accumulation: kimi_jax.ops.linear). So that the weights come from device memory rather than
the L2 cache, one executable runs R copies of the case back to back, each over its own weights
(R x bytes >= --rotate_mb), and the baseline is one XLA `W + 0` over those R weights (bytes read +
written). Times are the profiler's kernel durations per case (device time), the span per case (first
kernel start to last end, / R: the launch gaps of a run of such kernels included) and the wall time
per case of the whole executable. `pct_copy` = (weight bytes / kernel time) / (2 x bytes / copy
kernel time): the fraction of the copy bandwidth the matmul streams its weights at (the planner's
gemv_efficiency). The q_a + kv_a row is the concatenated [1536 + 576, 7168] weight in one matmul,
against the two separate rows above it.
"""
from __future__ import annotations

import json
import os

from absl import flags

from launch.bench import harness

flags.DEFINE_list("rows", ["1", "16"], "M: token rows per matmul")
flags.DEFINE_integer("rotate_mb", 512, "weights per executable, MB (several times the L2 cache)")
flags.DEFINE_integer("max_copies", 128, "at most this many weight copies per executable")
flags.DEFINE_integer("reps", 10, "timed executions per case (wall time; median)")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_gemv"), "results directory")
flags.DEFINE_bool("dry", False, "CPU dry run at 1/16 of every dimension")
FLAGS = flags.FLAGS

# (name, N, K) for Kimi-K2.5 (D 7168, 64 heads, q_lora 1536, kv_lora 512 + rope 64, expert F 2048,
# dense F 18432) split over 8 devices the way kimi_jax.parallel.sharding splits them (q_a and kv_a
# replicated; heads, FFN widths split)
SHAPES = (
    ("q_a 7168->1536", 1536, 7168),
    ("kv_a 7168->576", 576, 7168),
    ("q_a+kv_a fused 7168->2112", 2112, 7168),
    ("q_b shard 1536->1536", 64 * 192 // 8, 1536),
    ("kv_b shard 512->2048", 64 * 256 // 8, 512),
    ("o_proj shard 1024->7168", 7168, 64 * 128 // 8),
    ("shared gate|up shard 7168->256", 2048 // 8, 7168),
    ("shared gate+up fused 7168->512", 2 * 2048 // 8, 7168),
    ("shared down shard 256->7168", 7168, 2048 // 8),
)


def cases(dry: bool):
    return [(n, N // 16, K // 16) if dry else (n, N, K) for n, N, K in SHAPES]


def run_case(name, N, K, M, *, rotate_bytes, max_copies, reps, seed=0) -> dict:
    import jax
    import jax.numpy as jnp
    wbytes = N * K * 2
    R = int(max(2, min(max_copies, -(-rotate_bytes // wbytes))))
    kw, kx = jax.random.split(jax.random.PRNGKey(seed))
    ws = jax.random.normal(kw, (R, N, K), jnp.bfloat16)
    xs = jax.random.normal(kx, (R, M, K), jnp.bfloat16)

    def mats(xs, ws):
        return tuple(jnp.einsum("mk,nk->mn", xs[r], ws[r], preferred_element_type=jnp.bfloat16) for r in range(R))

    def copy(ws):
        return ws + jnp.bfloat16(0)

    res = dict(case=name, M=M, N=N, K=K, weight_mb=wbytes / 1e6, copies=R)
    for what, f, args in (("gemv", mats, (xs, ws)), ("copy", copy, (ws,))):
        t = harness.timed(f, args, R, reps)
        res.update({f"{what}_{k}": v for k, v in t.items() if k != "kernel_names"})
        if what == "gemv":
            res["gemv_kernel_names"] = t["kernel_names"][:3]
    copy_bw = 2 * wbytes / (res["copy_kernel_us"] * 1e-6) if res["copy_kernel_us"] else float("nan")
    res["copy_tbps"] = copy_bw / 1e12
    res["gemv_tbps"] = wbytes / (res["gemv_kernel_us"] * 1e-6) / 1e12 if res["gemv_kernel_us"] else float("nan")
    res["pct_copy"] = 100 * res["gemv_tbps"] / res["copy_tbps"]
    res["pct_copy_span"] = 100 * (wbytes / (res["gemv_span_us"] * 1e-6) / 1e12) / res["copy_tbps"]
    return res


def table(rows) -> str:
    lines = [f"{'case':32} {'M':>3} {'MB':>6} {'R':>4} {'kernel us':>9} {'span us':>8} {'wall us':>8} "
             f"{'TB/s':>5} {'copy TB/s':>9} {'%copy':>6} {'%copy span':>10}"]
    for r in rows:
        lines.append(f"{r['case'][:32]:32} {r['M']:3d} {r['weight_mb']:6.2f} {r['copies']:4d} "
                     f"{r['gemv_kernel_us']:9.2f} {r['gemv_span_us']:8.2f} {r['gemv_wall_us']:8.2f} "
                     f"{r['gemv_tbps']:5.2f} {r['copy_tbps']:9.2f} {r['pct_copy']:5.1f}% {r['pct_copy_span']:9.1f}%")
    return "\n".join(lines)


def main(argv):
    del argv
    import jax
    os.makedirs(FLAGS.out, exist_ok=True)
    rows = []
    for M in map(int, FLAGS.rows):
        for name, N, K in cases(FLAGS.dry):
            r = run_case(name, N, K, M, rotate_bytes=FLAGS.rotate_mb * 2 ** 20 // (16 if FLAGS.dry else 1),
                         max_copies=FLAGS.max_copies, reps=FLAGS.reps)
            r.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(FLAGS.out, "gemv_rows.jsonl"), "a") as f:
                f.write(json.dumps(r) + "\n")
    print(table(rows), flush=True)


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench gemv", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
