"""Does a layer loop copy each layer's weights out of a stacked [L, ...] array on this backend?

Times one decode-like pass (three matmuls per layer: Kimi's q_a, q_b and o_proj shapes) over L layers
four ways: lax.scan over the stacked weights, fori_loop with dynamic indexing, a Python loop with static
slices, and a Python loop over separate per-layer arrays (the no-copy ideal). Prints time, the bytes the
weights alone must move, GB/s, and how many fusions of the compiled program only slice (copies).

  python -m launch.probe_layer_loop                 # then again with
  XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python -m launch.probe_layer_loop
"""
from __future__ import annotations

import os
import re
import statistics
import time

from absl import app, flags

flags.DEFINE_integer("layers", 8, "layers")
flags.DEFINE_list("batches", ["1", "64"], "rows")
flags.DEFINE_bool("dry", False, "tiny shapes (CPU)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    L = FLAGS.layers
    D, Q, NQ, NV = (7168, 1536, 12288, 8192) if not FLAGS.dry else (64, 32, 96, 64)
    shapes = {"a": (Q, D), "b": (NQ, Q), "o": (D, NV)}
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    stacked = {n: (0.02 * jax.random.normal(k, (L, *s), jnp.float32)).astype(jnp.bfloat16)
               for (n, s), k in zip(shapes.items(), keys)}
    separate = [{n: w[i] + 0 for n, w in stacked.items()} for i in range(L)]
    wbytes = sum(w.size * 2 for w in stacked.values())

    def layer(x, w):
        h = x @ w["a"].T
        h = (h @ w["b"].T)[:, :NV]
        return x + 0.01 * (h @ w["o"].T)

    def scan(x, ws):
        return jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0]

    def fori(x, ws):
        return jax.lax.fori_loop(0, L, lambda i, c: layer(c, jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), ws)), x)

    def static(x, ws):
        for i in range(L):
            x = layer(x, jax.tree.map(lambda a: a[i], ws))
        return x

    def per_layer(x, wl):
        for w in wl:
            x = layer(x, w)
        return x

    variants = [("scan", scan, stacked), ("fori", fori, stacked), ("static slices", static, stacked),
                ("separate arrays", per_layer, separate)]
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}  jax {jax.__version__}  {jax.devices()[0].device_kind}")
    print(f"{'variant':16} {'B':>3} {'ms':>8} {'weights GB':>10} {'GB/s':>7} {'slice-only fusions':>18}")
    for name, fn, ws in variants:
        for b in map(int, FLAGS.batches):
            x = jnp.ones((b, D), jnp.bfloat16)
            f = jax.jit(fn)
            text = f.lower(x, ws).compile().as_text()
            copies = len(re.findall(r"ROOT %[\w.\-]+ = \S+ (?:dynamic-slice|slice)\(", text))
            f(x, ws).block_until_ready()
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                f(x, ws).block_until_ready()
                ts.append(time.perf_counter() - t0)
            t = statistics.median(ts)
            print(f"{name:16} {b:3d} {t * 1e3:8.3f} {wbytes / 1e9:10.3f} {wbytes / t / 1e9:7.0f} {copies:18d}",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
