"""Tuning sweep of the balanced schedule's combine kernel (pallas_kernels/mla/combine.py) on the GPU.

    PYTHONPATH=. python -m launch.sweep_mla_combine [--cases=B:M:items:long:short,...]
    PYTHONPATH=. python -m launch.sweep_mla_combine --interpret --a=32 --cases=4:2:8:300:20   # CPU dry run

Each case is a balanced table (`decode.balanced_items`) over one row of `long` cached tokens and B - 1
rows of `short` (long = short: equal rows), M query rows, A (512) columns. Every config (warps x block_a
x block_g) and the XLA contraction are checked against `combine_items_xla` on the device first, then
timed by device time per call of every op they run (jax.profiler; `calls` calls in one executable, the
partials L2-warm as after the decode kernel that wrote them; wall clock over such an executable is
dominated by launch gaps). Exits non-zero when a config fails or disagrees with the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from pallas_kernels.mla.combine import combine_items, combine_items_xla

flags.DEFINE_list("cases", ["64:64:128:4096:4096", "64:64:128:32768:1024", "64:8:256:4096:4096",
                            "16:64:128:4096:4096", "16:8:128:131072:4096", "8:64:128:131072:4096",
                            "8:8:128:131072:4096"], "B:M:items:long:short")
flags.DEFINE_list("warps", ["1", "2", "4"], "num_warps values")
flags.DEFINE_list("block_as", ["0", "128", "512"], "block_a values (0: automatic)")
flags.DEFINE_list("block_gs", ["0", "4"], "block_g values (0: automatic)")
flags.DEFINE_integer("calls", 20, "calls per timed executable")
flags.DEFINE_integer("a", 512, "latent columns")
flags.DEFINE_bool("interpret", False, "interpret mode (a CPU dry run of the sweep)")


def _parse_case(spec: str) -> tuple[int, int, int, int, int]:
    try:
        B, M, items, long, short = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"--cases: {spec!r} is not B:M:items:long:short (five integers)") from None
    if B < 1 or M < 1 or items < B or min(long, short) < 0:
        raise ValueError(f"--cases: {spec!r} needs B, M >= 1, items >= B and lengths >= 0")
    return B, M, items, long, short


def _case(spec: str, seed: int = 0, A: int = 512):
    B, M, items, long, short = _parse_case(spec)
    from pallas_kernels.mla import decode as md
    work = md.balanced_items(jnp.asarray([long] + [short] * (B - 1), jnp.int32), items, 64)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    used = (work[2] > work[1])[:, None]
    o = jnp.where(used[..., None], jax.random.normal(ks[0], (items, M, A), jnp.float32), 0.0)
    lse = jnp.where(used, 4.0 * jax.random.normal(ks[1], (items, M), jnp.float32), -jnp.inf)
    o_new = jax.random.normal(ks[2], (B, M, A), jnp.float32)
    lse_new = 4.0 * jax.random.normal(ks[3], (B, M), jnp.float32)
    return work, o, lse, o_new, lse_new


def main(argv):
    del argv
    from kimi_jax.tools import profiling
    f = flags.FLAGS
    for spec in f.cases:                  # before any work
        try:
            _parse_case(spec)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    configs = [(w, a, g) for w in (int(v) for v in f.warps) for a in (int(v) for v in f.block_as)
               for g in (int(v) for v in f.block_gs)]
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
    failed = 0
    print(f"{'case B:M:items:long:short':<28} {'MB':>6} {'config (warps, block_a, block_g)':<34} "
          f"{'us':>8} {'GB/s':>7} check")
    for spec in f.cases:
        work, o, lse, o_new, lse_new = _case(spec, A=f.a)
        B = o_new.shape[0]
        nbytes = o.size * 4 + lse.size * 4 + 2 * o_new.size * 4
        news = [lse_new + 0.001 * i for i in range(f.calls)]      # distinct calls: no CSE
        want = combine_items_xla(o, lse, work[0], o_new, lse_new)
        runs = [("xla", lambda n: combine_items_xla(o, lse, work[0], o_new, n))]
        for w, a, g in configs:
            runs.append(((w, a, g), lambda n, w=w, a=a, g=g: combine_items(
                o, lse, work[3, :B], work[4, :B], o_new, n, num_warps=w, block_a=a, block_g=g,
                interpret=f.interpret)))
        for name, fn in runs:
            try:
                got = jax.jit(fn)(lse_new)
                err = max(float(jnp.max(jnp.abs(got[0] - want[0]))),
                          float(jnp.max(jnp.where(jnp.isfinite(want[1]), jnp.abs(got[1] - want[1]), 0.0))))
                many = jax.jit(lambda ns, fn=fn: [fn(n) for n in ns]).lower(news).compile()
                per_op, _, _ = profiling.device_ops_per_call(many, (news,), f.calls)
                t = max(sum(per_op.values()), 1e-3) * 1e-6
                top = ", ".join(f"{k[:24]} {v:.1f}" for k, v in list(per_op.items())[:3])
                print(f"{spec:<28} {nbytes / 1e6:6.1f} {str(name):<34} {t * 1e6:8.1f} "
                      f"{nbytes / t / 1e9:7.0f} {'OK' if err < 1e-4 else 'FAIL'} {err:.1e}  [{top}]", flush=True)
                failed += err >= 1e-4   # f32 sums in another order differ by ~1e-6 here; a part
                #                             merged into the wrong row or dropped moves an output by O(1)
            except Exception as e:  # noqa: BLE001
                print(f"{spec:<28} {str(name):<34} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                failed += 1
    if failed:
        raise SystemExit(f"mla_combine sweep: {failed} config(s) failed or disagreed with the reference")


if __name__ == "__main__":
    app.run(main)
