"""GPU check of the Mosaic GPU MLA decode op under both work schedules and the one-row config.

    PYTHONPATH=. python -m launch.check_mla_schedules          # one H200, about a minute
    PYTHONPATH=. python -m launch.check_mla_schedules --interpret --lengths=1,37,0 --pages=16 --ts=1   # CPU

`mla_paged_attention_mgpu` on a ragged batch (empty, 1-token, page +- 1 and long rows), T = 1 and 2 (64
and 128 query rows), pages 16 and 64, under 'rows' and 'balanced', against the float32 reference; then
rows of the same batch alone under `serving_config(1)`. Exits non-zero when a case fails.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from absl import app, flags

from pallas_kernels.mla import decode as md
from pallas_kernels.mla import decode_mgpu as mg

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1", "4000", "37", "20000", "0", "515", "63", "64"], "cached tokens per row")
flags.DEFINE_list("pages", ["16", "64"], "page sizes")
flags.DEFINE_list("ts", ["1", "2"], "new tokens per row")
flags.DEFINE_bool("interpret", False, "the Mosaic GPU interpreter (a CPU dry run)")


def check_schedules(configs=None, interpret: bool = False, lengths=(1, 4000, 37, 20000, 0, 515, 63, 64),
                    pages=(16, 64), ts=(1, 2)) -> bool:
    """GPU check of whole ops (`mla_paged_attention_mgpu`) under both schedules ('rows', 'balanced'):
    a ragged batch (empty, 1-token, page +- 1 and long rows), T = 1 and 2 (64 and 128 query rows), pages
    16 and 64, against the f32 reference; then a few of its rows alone under `serving_config(1)` (the
    one-launch finish); max |o - ref| < 3e-2 (bf16 output of values up to ~3, as the tests). Prints one
    line per case; returns whether all passed. `configs`: {name: MgpuConfig} (default: the served config
    and the same with every score masked)."""
    configs = configs or {"serving": mg.serving_config(2), "mask": mg.MgpuConfig(mask_tail_only=False)}
    scale, ok = 1.0 / math.sqrt(192.0), True

    def check(label, args, ref, cfg):
        nonlocal ok
        o = np.asarray(mg.mla_paged_attention_mgpu(*args, scale, config=cfg, interpret=interpret), np.float32)
        err = float(np.max(np.abs(o - ref)))
        good = bool(np.all(np.isfinite(o)) and err < 3e-2)
        ok &= good
        print(f"{label} max|o-ref|={err:.2e} {'OK' if good else 'FAIL'}", flush=True)

    for page in pages:
        for t in ts:
            args = md.make_case(jax.random.key(3 + page + t), list(lengths), heads=64, t=t, page=page)
            ref = np.asarray(md.mla_paged_attention_reference(*args, scale), np.float32)
            for sched in ("rows", "balanced"):
                for name, base in configs.items():
                    check(f"page={page} T={t} {sched:8s} {name:8s}", args, ref,
                          dataclasses.replace(base, schedule=sched))
            # one row: serving_config(1) (the one-launch finish), rows of the same batch alone
            for r in sorted({0, 1, len(lengths) // 2, int(np.argmax(lengths))}):
                one = [x if i == 3 else x[r:r + 1] for i, x in enumerate(args)]   # args[3]: the pool
                check(f"page={page} T={t} row {r} (length {lengths[r]}) alone, serving_config(1):", one,
                      ref[r:r + 1], mg.serving_config(1))
    print("ALL OK" if ok else "SOME FAILED", flush=True)
    return ok


def main(argv):
    del argv
    ok = check_schedules(interpret=FLAGS.interpret, lengths=tuple(int(v) for v in FLAGS.lengths),
                         pages=tuple(int(v) for v in FLAGS.pages), ts=tuple(int(v) for v in FLAGS.ts))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
