r"""kimi-bench small_ops: the decode step's small per-layer ops, XLA against their Pallas launches.

  python3 -m launch.bench.small_ops                      # GPU: T = 1, 8, 32, 64; E = 384 and 16
  python3 -m launch.bench.small_ops --smoke --out /tmp/x # CPU, tiny shapes, kernels interpreted

Cases, at Kimi-K2.5's D = 7168, K = 8:
- router (kimi_jax.ops.route): 'xla' (the model's XLA router: gemv, bias add, sort, gather / normalize,
  pad), 'pallas' (XLA's gemv, then one launch for the rest) and 'pallas_gemv' (all in one launch), for
  E = 384 (the real model) and 16 (the kimi-k2.5-61x16 preset). W is float32 [E, D].
- add_rms_norm / rms_norm (kimi_jax.model.layers.RMSNorm with and without its residual): 'xla' (add,
  mean of squares, scale) against the fused kernel, bf16.

As in kimi-bench gemv, one executable runs R copies of a case back to back, each over its own arrays
(R x bytes >= --rotate_mb, at most --max_copies), so the weights come from device memory; times are per
call: the profiler's kernel time (device time), the span of the call's device ops and the wall time.
`kernels` is the number of device kernels ONE call launches (a one-copy executable, profiled). The copy
row is an XLA `a + 0` over the same bytes (bytes read + written), `pct_copy` the fraction of its
bandwidth the case moves its bytes at. `err` is the largest absolute difference of the case's outputs
from the XLA variant's (router weights; the norm's y and h), `idx_diff` the router ids that differ.
"""
from __future__ import annotations

import json
import os

from absl import flags

from launch.bench import harness

flags.DEFINE_list("tokens", ["1", "8", "32", "64"], "T: token rows per call")
flags.DEFINE_list("experts", ["384", "16"], "E: routed experts")
flags.DEFINE_integer("top_k", 8, "K: experts per token")
flags.DEFINE_integer("hidden", 7168, "D: hidden size")
flags.DEFINE_list("ops", ["router", "add_rms_norm", "rms_norm"], "which ops to time")
flags.DEFINE_integer("rotate_mb", 512, "bytes per executable, MB (several times the L2 cache)")
flags.DEFINE_integer("max_copies", 64, "at most this many copies per executable")
flags.DEFINE_integer("reps", 10, "timed executions per case (wall time; median)")
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench_small_ops"), "results directory")
flags.DEFINE_bool("smoke", False, "CPU smoke run: D = 64, E = 24, T = 1 and 5, K <= 4, 2 copies, 1 rep")
FLAGS = flags.FLAGS

ROUTERS = ("xla", "pallas", "pallas_gemv")
NORMS = ("xla", "pallas")


def _copies(bytes_per_call: int, rotate_bytes: int, max_copies: int) -> int:
    return int(max(1, min(max_copies, -(-rotate_bytes // bytes_per_call))))


def _measure(call, make_args, R: int, reps: int) -> tuple[dict, tuple]:
    """call(*one copy's args) timed as an executable of R copies; kernels per call from one copy."""
    args = make_args(R)
    t = harness.timed(lambda *a: tuple(call(*c) for c in zip(*a)), args, R, reps)
    t["kernels"] = harness.timed(lambda *a: tuple(call(*c) for c in zip(*a)), make_args(1), 1, 1)["kernels"]
    return t, args


def _copy_row(arrays, R: int, reps: int, nbytes: int) -> dict:
    """`a + 0` over every array of R copies; nbytes: the bytes one copy reads."""
    t = harness.timed(lambda *a: tuple(x + x.dtype.type(0) for x in a), arrays, R, reps)
    return dict(copy_kernel_us=t["kernel_us"], copy_tbps=2 * nbytes / (t["kernel_us"] * 1e-6) / 1e12
                if t["kernel_us"] else float("nan"))


def router_rows(T: int, E: int, D: int, K: int, *, rotate_bytes: int, max_copies: int, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    nbytes = E * D * 4 + T * D * 2 + E * 4 + T * K * 8
    R = _copies(nbytes, rotate_bytes, max_copies)

    def make_args(n):
        keys = jax.random.split(jax.random.PRNGKey(T * 1000 + E), 3 * n)
        xs = [jax.random.normal(keys[3 * r], (T, D), jnp.bfloat16) for r in range(n)]
        ws = [0.02 * jax.random.normal(keys[3 * r + 1], (E, D), jnp.float32) for r in range(n)]
        bs = [0.01 * jax.random.normal(keys[3 * r + 2], (E,), jnp.float32) for r in range(n)]
        return xs, ws, bs

    rows, ref = [], None
    for variant in ROUTERS:
        plan = ops.ExecPlan(router_kernel=variant)
        call = lambda x, w, b, plan=plan: ops.route(x, w, b, k=K, scaling=2.827, plan=plan)  # noqa: E731
        t, args = _measure(call, make_args, R, reps)
        idx, wt = jax.jit(call)(args[0][0], args[1][0], args[2][0])
        ref = ref or (idx, wt)
        row = dict(op="router", variant=variant, T=T, E=E, D=D, K=K, copies=R, bytes=nbytes,
                   err=float(jnp.abs(wt - ref[1]).max()), idx_diff=int(np.sum(np.asarray(idx != ref[0]))))
        row.update(t, kernel_names=t["kernel_names"][:3])
        rows.append(row)
    copy = _copy_row(args[1], R, reps, E * D * 4)
    return [_finish(r, copy) for r in rows]


def norm_rows(op: str, T: int, D: int, *, rotate_bytes: int, max_copies: int, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from kimi_jax import ops
    from kimi_jax.model.layers import RMSNorm
    residual = op == "add_rms_norm"
    nbytes = (4 if residual else 2) * T * D * 2 + D * 2
    R = _copies(nbytes, rotate_bytes, max_copies)

    def make_args(n):
        keys = jax.random.split(jax.random.PRNGKey(T), 3 * n)
        xs = [jax.random.normal(keys[3 * r], (T, D), jnp.bfloat16) for r in range(n)]
        rs = [jax.random.normal(keys[3 * r + 1], (T, D), jnp.bfloat16) for r in range(n)]
        ws = [(1 + 0.1 * jax.random.normal(keys[3 * r + 2], (D,))).astype(jnp.bfloat16) for r in range(n)]
        return (xs, rs, ws) if residual else (xs, ws)

    def call_for(plan):
        def call(x, *rest):              # the model's module, given this copy's weight
            *r, w = rest
            norm = RMSNorm(D, 1e-5, dtype=jnp.bfloat16)
            norm.weight.set_value(w)
            return norm(x, r[0] if r else None, plan=plan)
        return call

    rows, ref = [], None
    for variant in NORMS:
        call = call_for(ops.ExecPlan(norm_kernel=variant))
        t, args = _measure(call, make_args, R, reps)
        out = jax.tree.leaves(jax.jit(call)(*(a[0] for a in args)))
        ref = ref or out
        err = max(float(jnp.abs(o.astype(jnp.float32) - q.astype(jnp.float32)).max()) for o, q in zip(out, ref))
        row = dict(op=op, variant=variant, T=T, E=0, D=D, K=0, copies=R, bytes=nbytes, err=err, idx_diff=0)
        row.update(t, kernel_names=t["kernel_names"][:3])
        rows.append(row)
    copy = _copy_row(args[0] + (args[1] if residual else []), R, reps, (2 if residual else 1) * T * D * 2)
    return [_finish(r, copy) for r in rows]


def _finish(row: dict, copy: dict) -> dict:
    row.update(copy)
    row["tbps"] = row["bytes"] / (row["kernel_us"] * 1e-6) / 1e12 if row["kernel_us"] else float("nan")
    row["pct_copy"] = 100 * row["tbps"] / copy["copy_tbps"]
    return row


def table(rows) -> str:
    lines = [f"{'op':13} {'variant':12} {'T':>3} {'E':>4} {'R':>3} {'MB':>6} {'kernels':>7} {'kernel us':>9} "
             f"{'span us':>8} {'wall us':>8} {'%copy':>6} {'err':>8} {'idx':>4}"]
    for r in rows:
        lines.append(f"{r['op']:13} {r['variant']:12} {r['T']:3d} {r['E']:4d} {r['copies']:3d} "
                     f"{r['bytes'] / 1e6:6.3f} {r['kernels']:7d} {r['kernel_us']:9.2f} {r['span_us']:8.2f} "
                     f"{r['wall_us']:8.2f} {r['pct_copy']:5.1f}% {r['err']:8.1e} {r['idx_diff']:4d}")
    return "\n".join(lines)


def main(argv):
    del argv
    import jax
    os.makedirs(FLAGS.out, exist_ok=True)
    if FLAGS.smoke:
        tokens, experts, D, K, copies, reps = [1, 5], [24], 64, min(FLAGS.top_k, 4), 2, 1
    else:
        tokens, experts, D, K = list(map(int, FLAGS.tokens)), list(map(int, FLAGS.experts)), FLAGS.hidden, FLAGS.top_k
        copies, reps = FLAGS.max_copies, FLAGS.reps
    kw = dict(rotate_bytes=FLAGS.rotate_mb * 2 ** 20, max_copies=copies, reps=reps)
    unknown = set(FLAGS.ops) - {"router", "add_rms_norm", "rms_norm"}
    if unknown:
        raise ValueError(f"--ops: unknown {sorted(unknown)}; expected router, add_rms_norm, rms_norm")
    rows = []
    for T in tokens:
        cases = []
        if "router" in FLAGS.ops:
            cases += [lambda E=E: router_rows(T, E, D, K, **kw) for E in experts]
        cases += [lambda op=op: norm_rows(op, T, D, **kw) for op in ("add_rms_norm", "rms_norm") if op in FLAGS.ops]
        for case in cases:
            for r in case():
                r.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
                rows.append(r)
                print(json.dumps(r), flush=True)
                with open(os.path.join(FLAGS.out, "small_ops_rows.jsonl"), "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(table(rows), flush=True)


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench small_ops", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
