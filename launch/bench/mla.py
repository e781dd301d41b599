"""kimi-bench mla: MLA paged decode benchmark: copy ceiling, GPU correctness, kernel vs XLA, prefill.

    kimi-bench mla --out=$OUT          # one H200, < 4 minutes
    kimi-bench mla --out=/tmp/x --dry  # tiny shapes on CPU (the script itself)
    kimi-bench mla --sweep --out=$OUT --budget_s=270   # kernel config sweep
    kimi-bench mla --sweep --dry --out=/tmp/x          # the sweep on CPU
    kimi-bench mla --profile=64:32768:64,8:131072:64 --out=$OUT   # device ops per call
    kimi-bench mla --check_schedules --out=$OUT        # the Mosaic GPU op's schedules, about a minute
    kimi-bench mla --combine_sweep --out=$OUT          # the balanced schedule's combine kernel configs
    kimi-bench mla --check_schedules --dry --out=/tmp/x  # (either) on CPU: interpreted kernels, tiny cases

--sweep (instead of the sections below): copy bandwidth; then per heads (8, 64) every candidate
config of SWEEP (the auto default, the first version LEGACY, other tilings / stage counts / split
policies) is checked against the float32 reference on a small ragged case on the device (a failing
or non-compiling candidate is dropped); then for each case B x context x heads the default, LEGACY
and the XLA path are timed (phase 1, all cases), then the other candidates (phase 2, as the budget
allows). One table row per case: the best config, its us, GB/s, % of copy, default and legacy us,
XLA us and XLA / best. Files under --out: results.jsonl (rows as they come), sweep.json, table.md.

--check_schedules (instead of the sections; no copy measurement): `mla_paged_attention_mgpu` on a
ragged batch (empty, 1-token, page +- 1 and long rows: lengths 1, 4000, 37, 20000, 0, 515, 63, 64), T = 1
and 2 (64 and 128 query rows), pages 16 and 64, the served config and the same with every score
masked, under the 'rows' and 'balanced' schedules, against the float32 reference; then rows of the
same batch alone under `serving_config(1)` (the one-launch finish). max |o - ref| < 3e-2 (bf16 output
of values up to ~3). One line and one results.jsonl row per case; exits non-zero when a case fails.

--combine_sweep (instead of the sections; no copy measurement): the balanced schedule's combine kernel
(pallas_kernels/mla/combine.py). Each --combine_cases entry B:M:items:long:short is a balanced table
(`decode.balanced_items`) over one row of `long` cached tokens and B - 1 rows of `short`, M query rows,
512 latent columns. Every config (--combine_warps x --combine_block_as x --combine_block_gs) and the
XLA contraction are checked against `combine_items_xla` on the device first, then timed by device time
per call of every op they run (jax.profiler; --combine_calls calls in one executable, the partials
L2-warm as after the decode kernel that wrote them; wall clock over such an executable is dominated by
launch gaps). Exits non-zero when a config fails or disagrees with the reference.

Sections, in order:
  1. copy bandwidth in this run: XLA `x ^ 1` over 2 GiB (bytes read + written), and a read-only sum.
  2. correctness on the device: the Pallas kernel vs the float32 reference on ragged rows (a
     one-token row, a row ending exactly on a page, long rows), heads 8 and 64, T = 1 and 4, pages
     of 16 and 64; and vs kimi_jax.ops' 'xla' implementation.
  3. decode: batch 1, 8, 64 x context 4K, 32K, 128K x heads 64 and 8 (T = 1, page 16). Each timed
     call runs L layers of one pool (block table offset per layer, as in the engine; unrolled as the
     engine's layer loop on GPU, or a lax.scan with --layer_loop=scan), so
     no case is served from L2. Bytes = cached tokens x 576 x 2 per layer. Prints GB/s, % of copy
     and the XLA path's time over the kernel's. A few tilings are tried on the largest cases.
  4. prefill (expanded form, qk 192 / v 128): XLA einsum path vs cuDNN flash attention through
     jax.nn.dot_product_attention (v zero-padded to 192: the public API wants equal head dims).
Writes results.jsonl and a markdown table (table.md) under --out.
"""
# Over 600 lines: one kimi-bench suite: its cases, their references, timing and report.
from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "/tmp/bench_mla", "output directory")
flags.DEFINE_bool("dry", False, "tiny shapes on CPU (checks the script, not the speed)")
flags.DEFINE_integer("reps", 5, "timed repetitions (median)")
flags.DEFINE_float("budget_s", 200.0, "skip remaining decode cases after this many seconds")
flags.DEFINE_bool("prefill", True, "run the prefill section")
flags.DEFINE_bool("prefill_only", False, "only the prefill section (fresh prefills and chunks after cached tokens)")
flags.DEFINE_list("chunk_cases", ["1:4096:256", "1:32768:256", "4:32768:256"],
                  "prefill chunks after cached tokens, B:cached prefix:chunk tokens")
flags.DEFINE_bool("sweep", False, "kernel config sweep instead of the sections (see the docstring)")
flags.DEFINE_list("heads", ["8", "64"], "--sweep: head counts")
flags.DEFINE_list("batches", ["1", "8", "64"], "--sweep: batch sizes")
flags.DEFINE_list("contexts", ["4096", "32768", "131072"], "--sweep: context lengths")
flags.DEFINE_list("candidates", [], "--sweep: only these candidate names (default and legacy always)")
flags.DEFINE_list("pages", ["16"], "decode section: page sizes (each case runs on a pool of each); "
                  "--heads / --batches / --contexts given explicitly also narrow the decode grid")
flags.DEFINE_list("profile", [], "instead of the sections: B:context:heads[:kernel] cases or 'grid' (the "
                  "acceptance grid; kernel: auto, "
                  "triton, mgpu, triton_fin, mgpu_fin); each op's device time per call from a profiler trace of "
                  "one executable of 20 calls, and the calls' device span vs their ops (what a fixed cost per "
                  "call is made of)")
flags.DEFINE_integer("profile_copies", 0, "--profile: pool copies read in turn by consecutive calls (0: enough "
                     "for >= 2 GiB of pages, 2 to 8); the decode grid's harness reads 8 distinct regions")
flags.DEFINE_bool("profile_wall", True, "--profile: also time the same executable by wall clock (`time_fn`) "
                  "and print it beside the device span")
flags.DEFINE_bool("two_waves", False, "decode section: also time the Mosaic GPU serving config with CTAs for two "
                  "rounds of one per SM ('mgpu_2w': batch 8 uses all 132 SMs instead of 128)")
flags.DEFINE_bool("finish_variants", False, "decode section: also time the one-launch finish of the step "
                  "(mla_finish.py) after the Triton kernel ('fin') and the Mosaic GPU kernel ('mgpu_fin')")
flags.DEFINE_enum("layer_loop", "unrolled", ["unrolled", "scan"], "decode timings: L layers per call as "
                  "static calls (the engine's loop on GPU) or a lax.scan")
TABLE_ORDERS = ("random", "sequential", "interleaved")
flags.DEFINE_list("table_orders", ["random"], "decode section: where each row's pages lie in the pool "
                  f"({', '.join(TABLE_ORDERS)}: see _table); each case runs with each")
flags.DEFINE_list("check_cases", [], "check section: N:T:page cases instead of the built-in list "
                  "(8:1:16, 64:1:16, 64:4:16, 8:1:64, 64:1:64)")
flags.DEFINE_list("mixed", [], "decode section: also mixed-length batches, B:long:short:heads cases (one row of "
                  "`long` cached tokens, B - 1 rows of `short`), e.g. 8:131072:4096:64; --mixed_only skips the grid")
flags.DEFINE_bool("mixed_only", False, "decode section: only the --mixed cases")
flags.DEFINE_bool("new_token_einsum", False, "the step's new token in the general einsum form at T = 1 too "
                  "(the decode wrappers' one_new_token_elementwise=False), to time both")
flags.DEFINE_bool("balanced", False, "decode section: also time both kernels on the balanced schedule "
                  "(MlaDecodeConfig / MgpuConfig schedule='balanced'; the --mixed cases always do)")
flags.DEFINE_integer("combine_xla_max_macs", None, "the decode wrappers' combine_xla_max_macs for this run "
                     "(the balanced schedule's merge: the XLA contraction up to this many multiply-adds, "
                     "the kernel above; 0: always the kernel)")

flags.DEFINE_bool("check_schedules", False, "instead of the sections: the Mosaic GPU op under both work "
                  "schedules and the one-row config against the float32 reference (see the docstring)")
flags.DEFINE_bool("combine_sweep", False, "instead of the sections: the balanced schedule's combine kernel, "
                  "each config checked and timed (see the docstring)")
flags.DEFINE_list("combine_cases", ["64:64:128:4096:4096", "64:64:128:32768:1024", "64:8:256:4096:4096",
                                    "16:64:128:4096:4096", "16:8:128:131072:4096", "8:64:128:131072:4096",
                                    "8:8:128:131072:4096"], "--combine_sweep: B:M:items:long:short cases "
                  "(--dry: 4:2:8:300:20 unless given)")
flags.DEFINE_list("combine_warps", ["1", "2", "4"], "--combine_sweep: num_warps values")
flags.DEFINE_list("combine_block_as", ["0", "128", "512"], "--combine_sweep: block_a values (0: automatic)")
flags.DEFINE_list("combine_block_gs", ["0", "4"], "--combine_sweep: block_g values (0: automatic)")
flags.DEFINE_integer("combine_calls", 20, "--combine_sweep: calls per timed executable")

_T0 = time.time()
A, R, C = 512, 64, 576


def log(*a):
    print(f"[{time.time() - _T0:6.1f}s]", *a, flush=True)


def record(**row):
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def time_fn(fn, *args, inner: int = 5, reps: int = 0):
    """Median over `reps` (0: --reps) of (wall of `inner` calls enqueued back to back) / inner: the
    host's dispatch and the final sync are paid once per `inner` calls, not per call (one call per
    timing put them into every time: the 2 GiB copy then read ~15% below the other harnesses)."""
    import jax
    jax.block_until_ready(fn(*args))
    inner = 1 if FLAGS.dry else inner
    ts = []
    for _ in range(1 if FLAGS.dry else (reps or FLAGS.reps)):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / inner)
        del outs
    return statistics.median(ts)


def gpu_clocks() -> dict:
    """GPU 0's SM and memory clocks (MHz), power (W) and temperature (C) from `nvidia-smi` (read
    only; {} where there is none). The 64-head kernel's time moves ~10% between machine starts on the
    H200 while the copy does not: the SM clock is the suspect these readings test (the kernel holds
    the board at its power limit, BENCHMARKS.md 'MLA decode attention')."""
    import subprocess
    fields = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=10).stdout
        vals = [float(v) for v in out.strip().split(",")]
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return dict(zip(("sm_mhz", "mem_mhz", "power_w", "temp_c"), vals)) if len(vals) == 4 else {}


def layers_fn(op, L: int, per_layer: int, copies: int = 0):
    """One jitted call of `op` over L layers of one pool (layer l reads block table + l * per_layer,
    so consecutive layers miss L2; with `copies`, layer l reads copy l % copies), each layer's output
    the next one's latent query: every column of every output is used, and layers run in order, as
    in the engine. (A sum over a few of the 512 output columns would let XLA narrow its own finishing
    ops to them, but not a kernel's.) --layer_loop=unrolled (default): L static
    calls, as the engine's layer loop on GPU (the ExecPlan's layer_loop 'unroll'); 'scan':
    a lax.scan (on the H200: 734 us per layer at 64 heads 64 x 32K where a profiler trace of the
    same op, called alone, spans 687 us)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def f(q_lat, q_pe, new, pool, table, pos):
        def layer(q, l):      # the next layer's latent query is this layer's output, all of it
            return op(q, q_pe, new, pool, table + (l % copies if copies else l) * per_layer,
                      pos).astype(q.dtype)
        if FLAGS.layer_loop == "scan":
            q = lax.scan(lambda q, l: (layer(q, l), None), q_lat, jnp.arange(L))[0]
        else:
            for l in range(L):
                q_lat = layer(q_lat, l)
            q = q_lat
        return q.astype(jnp.float32).sum()
    return jax.jit(f)


def section_copy(when: str = "start"):
    """The copy ceiling: XLA `x ^ 1` over 2 GiB (read + write) and a read-only sum, each the median of
    max(--reps, 10) timings. Runs at the start and again at the end of a decode run (`when`); the
    table divides by the higher of the two: one process read 3,762 GB/s where the one before it on
    the same GPU read 4,104, and a low ceiling would inflate every "% of copy"."""
    import jax
    import jax.numpy as jnp
    n = (1 << 20) if FLAGS.dry else (1 << 29)          # uint32 words: 2 GiB
    x = jax.random.bits(jax.random.PRNGKey(0), (n,), jnp.uint32)
    reps = max(FLAGS.reps, 10)
    f = jax.jit(lambda v: v ^ jnp.uint32(1))
    copy = 2 * 4 * n / time_fn(f, x, reps=reps)
    g = jax.jit(lambda v: jnp.sum(v, dtype=jnp.uint32))
    read = 4 * n / time_fn(g, x, reps=reps)
    del x
    clocks = gpu_clocks()
    log(f"copy ({when}) {copy / 1e9:.0f} GB/s (read+write), read-only {read / 1e9:.0f} GB/s"
        + (f"; clocks {clocks}" if clocks else ""))
    record(section="copy", when=when, copy_bps=copy, read_bps=read, device=str(jax.devices()[0]),
           jax=jax.__version__, clocks=clocks)
    return copy, read


def _table(key, B, pages_per_row, pool_pages, order: str = "random"):
    """Distinct pages of [0, pool_pages) per row: 'random' (a permutation: a pool after churn),
    'sequential' (row b owns pages [b P, (b + 1) P): one run per sequence) or 'interleaved' (page j
    of row b is j B + b: B sequences growing in lockstep from one FIFO free list, as
    kimi_jax.engine.scheduler.PagePool hands them out on a fresh engine)."""
    import jax
    import jax.numpy as jnp
    n = B * pages_per_row
    if order == "random":
        return jax.random.permutation(key, pool_pages)[:n].reshape(B, pages_per_row)
    ids = jnp.arange(n, dtype=jnp.int32)
    if order == "sequential":
        return ids.reshape(B, pages_per_row)
    if order == "interleaved":
        return ids.reshape(pages_per_row, B).T
    raise ValueError(f"--table_orders: {order!r} is not random, sequential or interleaved")


def _inputs(key, B, T, N, page, lengths, pages_per_row, pool_pages, dtype, order: str = "random"):
    """Random queries / new latents, a table of distinct pages per row (`_table`), cached = lengths."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(key, 4)
    q_lat = jax.random.normal(ks[0], (B, T, N, A), jnp.float32).astype(dtype)
    q_pe = jax.random.normal(ks[1], (B, T, N, R), jnp.float32).astype(dtype)
    new = jax.random.normal(ks[2], (B, T, C), jnp.float32).astype(dtype)
    table = _table(ks[3], B, pages_per_row, pool_pages, order)
    first = jnp.asarray(lengths, jnp.int32)
    pos = first[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return q_lat, q_pe, new, table.astype(jnp.int32), pos


def _pool(key, pages, page, dtype):
    """A pool of `pages` pages: one random block tiled (generating all of it would need 2x memory)."""
    import jax
    import jax.numpy as jnp
    blk = min(pages, 4096)
    base = jax.random.normal(key, (blk, page, C), jnp.float32).astype(dtype)
    reps = -(-pages // blk)
    return jax.jit(lambda b: jnp.tile(b, (reps, 1, 1))[:pages])(base)


def section_check():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    from pallas_kernels.mla import decode as md
    ok_all = True
    key = jax.random.PRNGKey(1)
    cases = [(8, 1, 16), (64, 1, 16), (64, 4, 16), (8, 1, 64), (64, 1, 64)] if not FLAGS.dry else [(8, 1, 16)]
    if FLAGS.check_cases:
        cases = [tuple(int(v) for v in c.split(":")) for c in FLAGS.check_cases]
    for N, T, page in cases:
        lengths = [0, page * 3, 1000, 20000] if not FLAGS.dry else [0, page, 37]
        P = -(-(max(lengths) + T) // page)
        pool = _pool(jax.random.fold_in(key, 7), len(lengths) * P + 8, page, jnp.bfloat16)
        pool = pool + jax.random.normal(jax.random.fold_in(key, N + page), pool.shape, jnp.bfloat16) * 0.5
        args = _inputs(jax.random.fold_in(key, N * T), len(lengths), T, N, page, lengths, P,
                       pool.shape[0], jnp.bfloat16)
        args = args[:3] + (pool,) + args[3:]
        scale = 192 ** -0.5
        got = md.mla_paged_attention(*args, scale, **_thresholds())
        want = md.mla_paged_attention_reference(*args, scale)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        try:   # (XLA:CPU cannot run one of the xla path's bf16 dots: the --dry run skips it)
            xla = ops.mla_paged_attention(*args, scale, plan=_plan(impl="xla"))
            err_xla = float(jnp.max(jnp.abs(xla.astype(jnp.float32) - want.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001
            err_xla = float("nan")
            log(f"  xla path failed: {type(e).__name__}: {str(e)[:100]}")
        finite = bool(np.isfinite(np.asarray(got, np.float32)).all())
        ok = finite and err <= 3e-2        # bf16: p and the output rounded to bf16 (tests/test_mla_decode.py)
        err_mgpu = None
        variants = []
        if (T * N) % 64 == 0 and jax.default_backend() == "gpu":   # the Mosaic GPU kernel, via ops
            variants.append("mgpu")
        if FLAGS.finish_variants:
            variants += ["fin"] + (["mgpu_fin"] if "mgpu" in variants else [])
        if FLAGS.two_waves and "mgpu" in variants:
            variants.append("mgpu_2w")
        for name in variants:
            got_v = _op(name, md.MlaDecodeConfig(finish="kernel") if name == "fin" else None, scale)(*args)
            err_v = float(jnp.max(jnp.abs(got_v.astype(jnp.float32) - want.astype(jnp.float32))))
            ok = ok and bool(np.isfinite(np.asarray(got_v, np.float32)).all()) and err_v <= 3e-2
            err_mgpu = err_v if name == "mgpu" else err_mgpu
            if name != "mgpu":
                log(f"  check {name}: max|{name}-ref|={err_v:.2e}")
        ok_all &= ok
        log(f"check N={N} T={T} page={page} lengths={lengths}: max|kernel-ref|={err:.2e} "
            f"max|mgpu-ref|={f'{err_mgpu:.2e}' if err_mgpu is not None else 'n/a (rows not a multiple of 64)'} "
            f"max|xla-ref|={err_xla:.2e} {'OK' if ok else 'FAIL'}")
        record(section="check", N=N, T=T, page=page, lengths=lengths, err=err, err_mgpu=err_mgpu,
               err_xla=err_xla, ok=ok)
    return ok_all


def _thresholds() -> dict:
    """This run's kernel-side dispatch thresholds (--combine_xla_max_macs, --new_token_einsum), as the
    keyword arguments of the decode kernels' wrappers."""
    kw = {"one_new_token_elementwise": not FLAGS.new_token_einsum}
    if FLAGS.combine_xla_max_macs is not None:
        kw["combine_xla_max_macs"] = FLAGS.combine_xla_max_macs
    return kw


def _plan(**fields):
    """The ExecPlan of this run's kimi_jax.ops calls: the machine's, with the run's thresholds and `fields`."""
    from kimi_jax import ops
    return ops.ExecPlan.for_backend(**_thresholds(), **fields)


# Named variants of the Mosaic GPU serving config: the fields they change.
MGPU_VARIANTS = {"mgpu_fin": {"finish": "kernel"}, "mgpu_bal": {"schedule": "balanced"}, "mgpu_2w": {"waves": 2},
                 "mgpu_mask": {"mask_tail_only": False}}               # every score masked


def _op(name, cfg, scale):
    """The op a named variant times, (q_lat, q_pe, new, pool, table, positions) -> o: 'auto' /
    'triton' / 'mgpu' = kimi_jax.ops as the engine calls it (auto: its own choice; call under
    a plan forcing `name`); 'mgpu_fin' = the Mosaic GPU serving config with the one-launch finish
    (mla_finish.py); 'mgpu_bal' = it on the balanced schedule; 'mgpu_2w' = it with CTAs for two rounds
    of one per SM; 'mgpu_mask' = it with every score masked; any other name = the Triton kernel with
    `cfg` (None: its automatic config)."""
    from kimi_jax import ops
    from pallas_kernels.mla import decode as md
    if name in ("auto", "triton", "mgpu"):
        plan = _plan(impl="pallas", mla_decode_kernel=name)
        return lambda *a: ops.mla_paged_attention(*a, scale, plan=plan)
    if name in MGPU_VARIANTS:
        import dataclasses
        from pallas_kernels.mla import decode_mgpu as mg
        import jax
        cfg = dataclasses.replace(mg.serving_config(2), **MGPU_VARIANTS[name])
        interpret = jax.default_backend() == "cpu"          # --dry on CPU: the Mosaic GPU interpreter
        return lambda *a: mg.mla_paged_attention_mgpu(*a, scale, config=cfg, interpret=interpret, **_thresholds())
    return lambda *a: md.mla_paged_attention(*a, scale, config=cfg, **_thresholds())


def _decode_case(B, ctx, N, copy_bps, pool, page, configs, key, order="random", lengths=None):
    """One grid case: B rows of ctx - 1 cached tokens (or `lengths`, a mixed batch; ctx is then
    the longest row + 1), each variant timed over L layers; returns the record."""
    import jax.numpy as jnp
    from kimi_jax import ops
    T = 1
    P = -(-ctx // page)
    per_layer = B * P
    L = max(1, min(8, pool.shape[0] // per_layer))
    lengths = list(lengths) if lengths is not None else [ctx - T] * B
    q_lat, q_pe, new, table, pos = _inputs(key, B, T, N, page, lengths, P, per_layer, jnp.bfloat16,
                                           order)
    scale = 192 ** -0.5
    nbytes = L * sum(lengths) * C * 2

    row = dict(section="decode", B=B, ctx=ctx, N=N, page=page, layers=L, table_order=order,
               bytes_per_row=(ctx - T) * C * 2, lengths=None if len(set(lengths)) == 1 else lengths,
               bytes=nbytes)
    args = (q_lat, q_pe, new, pool, table, pos)
    best = None
    for name, cfg in configs:
        try:
            t = time_fn(layers_fn(_op(name, cfg, scale), L, per_layer), *args) / L
        except Exception as e:  # noqa: BLE001
            log(f"  B={B} ctx={ctx} N={N} {name}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        row[f"t_{name}"] = t
        if best is None or t < best[1]:
            best = (name, t)
    try:
        t_xla = time_fn(layers_fn(lambda *a: ops.mla_paged_attention(*a, scale, plan=_plan(impl="xla")), L, per_layer),
                        *args) / L
    except Exception as e:  # noqa: BLE001
        log(f"  xla path failed: {type(e).__name__}: {str(e)[:120]}")
        t_xla = None
    row["clocks"] = gpu_clocks()      # right after this case's timings
    # what kimi_jax.ops picks for this case in the engine ('triton' = the default config here)
    serving = ops.mla_decode_kernel(T * N, A, R, page, jnp.bfloat16, batch=B, context=P * page)
    row.update(t_xla=t_xla, serving=serving,
               t_serving=row.get("t_mgpu" if serving == "mgpu" else "t_default"))
    if best:
        row.update(best=best[0], t_kernel=best[1], kernel_bps=nbytes / L / best[1],
                   pct_copy=100 * nbytes / L / best[1] / copy_bps,
                   xla_over_kernel=(t_xla / best[1]) if t_xla else None,
                   t_default=row.get("t_default"))
    record(**row)
    return row


def section_decode(copy_bps):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.mla.decode import MlaDecodeConfig as Cfg
    if FLAGS.dry:
        batches, ctxs, heads = [1, 2], [64, 256], [8, 16]
    else:
        batches, ctxs, heads = [1, 8, 64], [4096, 32768, 131072], [64, 8]
    explicit = lambda name, default: ([int(v) for v in FLAGS[name].value] if FLAGS[name].present  # noqa: E731
                                      else default)
    batches, ctxs, heads = explicit("batches", batches), explicit("contexts", ctxs), explicit("heads", heads)
    # Triton tilings tried on the largest cases (8 heads; at 64 heads the Mosaic GPU kernel is timed)
    sweep = {8: [("bk64", Cfg(block_k=64)), ("bk32s3", Cfg(block_k=32, num_stages=3))]}
    rows = []
    for page in [int(p) for p in FLAGS.pages]:
        # 24 GiB pool: >= 2 layers of the largest case; pages scattered over all of it
        pool_pages = 2 * 256 // page * 2 if FLAGS.dry else (24 << 30) // (page * C * 2)
        pool = _pool(jax.random.PRNGKey(3), pool_pages, page, jnp.bfloat16)
        if not FLAGS.mixed_only:
            rows += _decode_grid(copy_bps, pool, page, heads, batches, ctxs, sweep)
        rows += _decode_mixed(copy_bps, pool, page)
        del pool
    return rows


def _decode_grid(copy_bps, pool, page, heads, batches, ctxs, sweep):
    import jax
    from pallas_kernels.mla.decode import MlaDecodeConfig as Cfg
    rows = []
    for N in heads:
        for B in batches:
            for ctx in ctxs:
                if time.time() - _T0 > FLAGS.budget_s:
                    log(f"budget reached: skipping B={B} ctx={ctx} N={N}")
                    continue
                configs = [("default", None)]
                if _mgpu_runs(N):
                    configs.append(("mgpu", None))      # rows a multiple of 64: the Mosaic GPU kernel
                    if FLAGS.finish_variants:
                        configs.append(("mgpu_fin", None))
                    if FLAGS.two_waves:
                        configs.append(("mgpu_2w", None))
                if FLAGS.finish_variants:
                    configs.append(("fin", Cfg(finish="kernel")))
                configs += _balanced_configs(N) if FLAGS.balanced else []
                if (B, ctx) in ((1, 131072), (8, 131072), (64, 32768)) and not FLAGS.dry:   # try tilings
                    configs += sweep.get(N, [])
                for order in FLAGS.table_orders:
                    r = _decode_case(B, ctx, N, copy_bps, pool, page, configs, jax.random.PRNGKey(B + ctx + N),
                                     order)
                    rows.append(r)
                    clk = r.get("clocks") or {}
                    log(f"decode page={page} B={B:3d} ctx={ctx:6d} N={N:2d} {order}"
                        + (f" (sm {clk['sm_mhz']:.0f} MHz, {clk['power_w']:.0f} W)" if clk else "") + ": "
                        + _case_summary(r))
    return rows


def _check_mixed(spec, N, page, pool, configs, key, lengths):
    """Each variant's output on one layer of a mixed case against the XLA path (bf16 outputs: the
    same 1.6e-2 bound the check section's kernels meet); logged, and recorded as section 'check'."""
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    B, P = len(lengths), -(-(max(lengths) + 1) // page)
    args = _inputs(key, B, 1, N, page, lengths, P, B * P, jnp.bfloat16)
    scale = 192 ** -0.5
    ref = np.asarray(ops.mla_paged_attention(*args[:3], pool, *args[3:], scale, plan=_plan(impl="xla")), np.float32)
    errs = {}
    for name, cfg in configs:
        out = _op(name, cfg, scale)(*args[:3], pool, *args[3:])
        errs[name] = float(np.abs(np.asarray(out, np.float32) - ref).max())
    ok = all(e <= 1.6e-2 for e in errs.values())
    log(f"check mixed {spec}: max|variant-xla| " + " ".join(f"{k}={v:.2e}" for k, v in errs.items())
        + (" OK" if ok else " FAILED"))
    record(section="check", mixed=spec, errs=errs, ok=ok)


def _case_summary(r):
    """A decode case's log line: the serving kernel, the best variant, the XLA path, and every
    variant's time ('name=us'; the table shows the best only)."""
    if "t_kernel" not in r:
        return "failed"
    nan = float("nan")
    variants = " ".join(f"{k[2:]}={v * 1e6:.1f}" for k, v in r.items()
                        if k.startswith("t_") and k not in ("t_kernel", "t_serving") and isinstance(v, float))
    return (f"serving {r['serving']} {(r['t_serving'] or nan) * 1e6:8.1f} us; best "
            f"{r['t_kernel'] * 1e6:8.1f} us ({r['best']}) {r['kernel_bps'] / 1e9:6.0f} GB/s "
            f"{r['pct_copy']:5.1f}% of copy; xla {r['t_xla'] * 1e6 if r['t_xla'] else nan:8.1f} us; {variants}")


def _mgpu_runs(N):
    """Whether the Mosaic GPU kernel can be timed for N heads here (64-row tiles, a GPU)."""
    import jax
    return N % 64 == 0 and jax.default_backend() == "gpu"


def _balanced_configs(N):
    """The balanced-schedule variants of a case: Triton ('bal') and, at 64-row multiples on a GPU,
    the Mosaic GPU serving config ('mgpu_bal')."""
    from pallas_kernels.mla.decode import MlaDecodeConfig as Cfg
    return [("bal", Cfg(schedule="balanced"))] + ([("mgpu_bal", None)] if _mgpu_runs(N) else [])


def _parse_mixed(spec):
    try:
        B, long, short, N = (int(v) for v in spec.split(":"))
    except ValueError:
        raise app.UsageError(f"--mixed: {spec!r} is not B:long:short:heads (four integers)") from None
    if B < 2 or not 0 <= short <= long or N < 1:
        raise app.UsageError(f"--mixed: {spec!r} needs B >= 2, 0 <= short <= long, heads >= 1")
    return B, long, short, N


def _decode_mixed(copy_bps, pool, page):
    """--mixed: one long row and B - 1 short ones, the kernels the engine picks (for the longest
    row, as kimi_jax.ops does) against the XLA path; % of copy over the bytes actually cached."""
    import jax
    rows = []
    for spec in FLAGS.mixed:
        B, long, short, N = _parse_mixed(spec)
        if _over_budget():
            log(f"budget reached: skipping mixed {spec}")
            continue
        configs = [("default", None)] + ([("mgpu", None)] if _mgpu_runs(N) else []) + _balanced_configs(N)
        key = jax.random.PRNGKey(B + long + short + N)
        lengths = [long] + [short] * (B - 1)
        _check_mixed(spec, N, page, pool, configs, key, lengths)
        r = _decode_case(B, long + 1, N, copy_bps, pool, page, configs, key, lengths=lengths)
        rows.append(r)
        log(f"mixed page={page} B={B} 1 x {long} + {B - 1} x {short} N={N}: " + _case_summary(r))
    return rows


# ----------------------------------------------------------------------------------------------
# --sweep: candidate kernel configs.

def sweep_candidates(N):
    """(name, config) in priority order: phase 2 runs them candidate by candidate, so a budget cut
    drops the last ones. 'default' = resolve_config's automatic choice, 'legacy' = the first version."""
    from pallas_kernels.mla.decode import ONE_PAGE_BUFFER as LEGACY, MlaDecodeConfig as Cfg
    if N <= 16:   # 16-row tiles (8 heads x T = 1): bandwidth / latency
        extra = [("s3", Cfg(num_stages=3)),                  # pages single-buffered (bt prefetched)
                 ("s7", Cfg(num_stages=7)),                  # 3 page buffers
                 ("fuse", Cfg(fuse_new=True)),               # new tokens as the last split's extra block
                 ("t264", Cfg(target_programs=264)),         # ~2 programs per SM instead of 4
                 ("split256", Cfg(min_split_tokens=256)),    # fewer, longer splits at short contexts
                 ("k64", Cfg(block_k=64)),
                 ("k16s7", Cfg(block_k=16, num_stages=7)),
                 ("legacy_s5", Cfg(num_stages=5, target_programs=264, min_split_tokens=512,
                                   fuse_new=False)),
                 # batch 1 at long context (TP8's single stream): 528 splits of ~250 tokens write 8.6
                 # MB of f32 partials at 1 x 128K and fill 5 of 8 steps with the pipeline's prologue
                 ("t132", Cfg(target_programs=132)),         # one program per SM, 4x longer splits
                 ("t1056", Cfg(target_programs=1056)),       # 8 per SM, shorter splits
                 ("split1k", Cfg(min_split_tokens=1024)),    # at least 1K tokens a split
                 # the split rule before the few-rows rule (batch <= FEW_ROWS: 2 per SM, >= 256 tokens)
                 ("t528s64", Cfg(target_programs=528, min_split_tokens=64)),
                 ("t264s256", Cfg(target_programs=264, min_split_tokens=256)),   # the few-rows rule
                 # the rounding before whole waves: batch 32 / 64 took ceil(528 / B) splits
                 ("n17", Cfg(num_splits=17)), ("n9", Cfg(num_splits=9)),
                 ("untrimmed", Cfg(trim_splits=False))]   # splits left empty by the rounding to steps kept
    else:         # 64 heads: MMA work ~121 flops per cache byte
        extra = [("m64a256w8", Cfg(block_m=64, block_a=256, num_warps=8)),   # wgmma, 2 column halves
                 ("m32w8", Cfg(block_m=32, num_warps=8)),
                 ("m64a128w8", Cfg(block_m=64, block_a=128, num_warps=8)),
                 ("s7", Cfg(num_stages=7)),
                 ("t264", Cfg(target_programs=264)),
                 ("split1k", Cfg(min_split_tokens=1024)),
                 ("m64a256w8s3", Cfg(block_m=64, block_a=256, num_warps=8, num_stages=3)),
                 ("m32a256w4", Cfg(block_m=32, block_a=256, num_warps=4)),
                 ("fuse", Cfg(fuse_new=True))]
    if FLAGS.candidates:
        extra = [c for c in extra if c[0] in FLAGS.candidates]
    return [("default", None), ("legacy", LEGACY)] + extra


def _over_budget():
    return time.time() - _T0 > FLAGS.budget_s


def _check_candidate(N, name, cfg, key):
    """A small ragged case on the device (T = 1, page 16): a padding row (position -1), a one-token
    row, a row ending on a page, rows of several splits. Returns (ok, max error)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.mla import decode as md
    page, T = 16, 1
    lengths = [0, 1, 3 * page, 37] if FLAGS.dry else [0, 1, 3 * page, 1000, 3001]
    P = -(-(max(lengths) + T) // page)
    pool = _pool(jax.random.fold_in(key, 7), len(lengths) * P + 8, page, jnp.bfloat16)
    pool = pool + jax.random.normal(jax.random.fold_in(key, 9), pool.shape, jnp.bfloat16) * 0.5
    q_lat, q_pe, new, table, pos = _inputs(jax.random.fold_in(key, N), len(lengths), T, N, page, lengths,
                                           P, pool.shape[0], jnp.bfloat16)
    pos = pos.at[0].set(-1)                                  # a padding row
    args = (q_lat, q_pe, new, pool, table, pos)
    scale = 192 ** -0.5
    got = md.mla_paged_attention(*args, scale, config=cfg, **_thresholds())
    want = md.mla_paged_attention_reference(*args, scale)
    valid = np.asarray(pos >= 0)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = float(np.max(np.abs(g[valid] - w[valid])))
    ok = bool(np.isfinite(g).all()) and err <= 3e-2
    return ok, err


class _Case:
    """Inputs of one decode case and a timer for any op on them (scan over L layers of the pool)."""

    def __init__(self, B, ctx, N, pool, page, key):
        import jax.numpy as jnp
        T = 1
        self.P = -(-ctx // page)
        self.per_layer = B * self.P
        self.L = max(1, min(8, pool.shape[0] // self.per_layer))
        q_lat, q_pe, new, table, pos = _inputs(key, B, T, N, page, [ctx - T] * B, self.P,
                                               self.per_layer, jnp.bfloat16)
        self.args = (q_lat, q_pe, new, pool, table, pos)
        self.nbytes_layer = B * (ctx - T) * C * 2

    def time(self, op):
        return time_fn(layers_fn(op, self.L, self.per_layer), *self.args) / self.L


def section_sweep(copy_bps):
    import jax
    import jax.numpy as jnp
    from kimi_jax import ops
    from pallas_kernels.mla import decode as md
    page = 16
    if FLAGS.dry:
        batches, ctxs, heads = [1, 2], [64], [8, 32]
        pool_pages = 2 * 256 // page * 2
    else:
        batches, ctxs = [int(x) for x in FLAGS.batches], [int(x) for x in FLAGS.contexts]
        heads = [int(x) for x in FLAGS.heads]
        pool_pages = (24 << 30) // (page * C * 2)             # 24 GiB: >= 2 layers of the largest case
    scale = 192 ** -0.5
    out = dict(copy_bps=copy_bps, device=str(jax.devices()[0]), jax=jax.__version__, checks={},
               cases=[], skipped=[])

    # Correctness of every candidate on the device first.
    cands = {}
    for N in heads:
        ok_list = []
        for name, cfg in sweep_candidates(N):
            try:
                ok, err = _check_candidate(N, name, cfg, jax.random.PRNGKey(11))
            except Exception as e:  # noqa: BLE001 (compile failure: out of shared memory, ...)
                ok, err = False, f"{type(e).__name__}: {str(e)[:300]}"
            out["checks"][f"N{N}/{name}"] = dict(ok=ok, err=err)
            record(section="sweep_check", N=N, name=name, config=str(cfg), ok=ok, err=err)
            log(f"check N={N} {name}: {'OK' if ok else 'FAIL'} {err if isinstance(err, str) else f'{err:.2e}'}")
            if ok:
                ok_list.append((name, cfg))
        cands[N] = ok_list

    pool = _pool(jax.random.PRNGKey(3), pool_pages, page, jnp.bfloat16)
    keys = [(N, B, ctx) for N in heads for B in batches for ctx in ctxs]
    rows = {}
    cases = {}

    def run(k, name, fn):
        N, B, ctx = k
        if k not in cases:
            cases[k] = _Case(B, ctx, N, pool, page, jax.random.PRNGKey(B + ctx + N))
            rows[k] = dict(B=B, ctx=ctx, N=N, layers=cases[k].L, bytes_layer=cases[k].nbytes_layer, t={},
                           failed={})
        try:
            t = cases[k].time(fn)
            rows[k]["t"][name] = t
        except Exception as e:  # noqa: BLE001
            rows[k]["failed"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"  N={N} B={B} ctx={ctx} {name}: failed {rows[k]['failed'][name][:150]}")
            return
        record(section="sweep_time", N=N, B=B, ctx=ctx, name=name, t=t,
               pct_copy=100 * cases[k].nbytes_layer / t / copy_bps)
        log(f"  N={N:2d} B={B:3d} ctx={ctx:6d} {name:14s} {t * 1e6:9.1f} us "
            f"{100 * cases[k].nbytes_layer / t / copy_bps:5.1f}% of copy")

    def kernel(cfg):
        return lambda *a: md.mla_paged_attention(*a, scale, config=cfg, **_thresholds())

    # Phase 1: default, legacy and XLA on every case. Phase 2: the other candidates, one at a time.
    for k in keys:
        todo = [(n, kernel(c)) for n, c in cands[k[0]] if n in ("default", "legacy")]
        todo.append(("xla", lambda *a: ops.mla_paged_attention(*a, scale, plan=_plan(impl="xla"))))
        for name, fn in todo:
            if _over_budget():
                out["skipped"].append(f"{k} {name}")
                continue
            run(k, name, fn)
    n_extra = max((len(cands[N]) for N in heads), default=0)
    for ci in range(n_extra):
        for k in keys:
            if ci >= len(cands[k[0]]) or cands[k[0]][ci][0] in ("default", "legacy"):
                continue
            name, cfg = cands[k[0]][ci]
            if _over_budget():
                out["skipped"].append(f"{k} {name}")
                continue
            run(k, name, kernel(cfg))
    if out["skipped"]:
        log(f"budget {FLAGS.budget_s:.0f}s reached: skipped {len(out['skipped'])} timings "
            f"(first: {out['skipped'][0]})")

    lines = [f"copy {copy_bps / 1e9:.0f} GB/s (XLA x^1, read+write); {out['device']}; jax {out['jax']}", "",
             "| B | context | heads | MB/layer | best | best us | GB/s | % copy | default us | legacy us "
             "| XLA us | XLA/best | timed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for k in keys:
        if k not in rows:
            continue
        r = rows[k]
        kt = {n: t for n, t in r["t"].items() if n != "xla"}
        if kt:
            best = min(kt, key=kt.get)
            r.update(best=best, t_best=kt[best], best_bps=r["bytes_layer"] / kt[best],
                     pct_copy=100 * r["bytes_layer"] / kt[best] / copy_bps,
                     xla_over_best=(r["t"]["xla"] / kt[best]) if "xla" in r["t"] else None)
        out["cases"].append(r)
        if not kt:
            lines.append(f"| {r['B']} | {r['ctx']} | {r['N']} | | failed | | | | | | | | |")
            continue
        us = lambda n: r["t"].get(n, nan) * 1e6
        lines.append(f"| {r['B']} | {r['ctx']} | {r['N']} | {r['bytes_layer'] / 1e6:.1f} | {r['best']} | "
                     f"{r['t_best'] * 1e6:.1f} | {r['best_bps'] / 1e9:.0f} | {r['pct_copy']:.1f} | "
                     f"{us('default'):.1f} | {us('legacy'):.1f} | {us('xla'):.1f} | "
                     f"{r['xla_over_best'] or nan:.2f} | {len(kt)} |")
    tbl = "\n".join(lines)
    print(tbl, flush=True)
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "table.md"), "w") as f:
        f.write(tbl + "\n")
    with open(os.path.join(FLAGS.out, "sweep.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return out


def section_prefill():
    """Expanded-form causal attention, qk 192 / v 128, one sequence, 64 heads, bf16."""
    import jax
    import jax.numpy as jnp
    rows = []
    N, W, U = (64, 192, 128)
    for S in ([128] if FLAGS.dry else [4096, 16384]):
        ks = jax.random.split(jax.random.PRNGKey(S), 3)
        q = jax.random.normal(ks[0], (1, S, N, W), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, S, N, W), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, S, N, U), jnp.bfloat16)
        scale = W ** -0.5

        @jax.jit
        def xla(q, k, v):
            s = jnp.einsum("btnw,bsnw->bnts", q, k, preferred_element_type=jnp.float32) * scale
            mask = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
            p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1).astype(q.dtype)
            return jnp.einsum("bnts,bsnu->btnu", p, v, preferred_element_type=jnp.float32).astype(q.dtype)

        @jax.jit
        def cudnn(q, k, v):
            vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, W - U)))
            o = jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=True, implementation="cudnn")
            return o[..., :U]

        flops = 2 * N * S * S * (W + U) / 2                       # causal half
        row = dict(section="prefill", S=S, N=N, W=W, U=U, flops=flops)
        ref = None
        for name, fn in (("xla", xla), ("cudnn_padv", cudnn)):
            try:
                t = time_fn(fn, q, k, v)
                out = fn(q, k, v)
                if ref is None:
                    ref = out
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                row.update({f"t_{name}": t, f"tflops_{name}": flops / t / 1e12, f"err_{name}": err})
                log(f"prefill S={S} {name}: {t * 1e3:.2f} ms {flops / t / 1e12:.0f} TFLOP/s max|diff vs xla|={err:.1e}")
            except Exception as e:  # noqa: BLE001
                row[f"t_{name}"] = None
                log(f"prefill S={S} {name}: failed {type(e).__name__}: {str(e)[:160]}")
        record(**row)
        rows.append(row)
    rows += _prefill_chunks()
    return rows


def _prefill_chunks():
    """A prompt chunk after cached tokens (the scheduler's later chunks; 2048 tokens per row by default
    on a GPU):
    `ops.mla_prefill_attention` on its einsum path (f32 scores [B, N, T, S] materialized) against the
    masked dot_product_attention call (the plan's chunk_attention 'cudnn') and the two unmasked calls merged
    ('cudnn_split'), checked against the einsum path, Kimi's head dims (nope 128, rope 64, v 128), 64 heads, bf16."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    from kimi_jax.ops import prefill_attention
    rows = []
    N, H, R, U = 64, 128, 64, 128
    # 'cudnn_split' (two unmasked calls through jax's private cuDNN entry point, merged): does the entry
    # point take our call here? (If not, the op falls back to einsums and its timing would mislead.)
    split_ok = not FLAGS.dry
    if split_ok:
        try:
            x = jnp.ones((1, 128, 2, 192), jnp.bfloat16)
            n = jnp.full((1,), 100, jnp.int32)
            lse = prefill_attention.attention_lse_cudnn
            jax.block_until_ready(jax.jit(lambda x, n: lse(x, x, x, n, n, 0.1, causal=True))(x, n))
        except Exception as e:  # noqa: BLE001
            split_ok = False
            log(f"prefill chunk cudnn_split: cuDNN entry point failed {type(e).__name__}: {str(e)[:200]}")
    cases = [(3, 64, 16)] if FLAGS.dry else [tuple(int(x) for x in c.split(":")) for c in FLAGS.chunk_cases]
    for B, prefix, T in cases:
        S = prefix + T
        ks = jax.random.split(jax.random.PRNGKey(prefix + B), 5)
        bf = jnp.bfloat16
        args = (jax.random.normal(ks[0], (B, T, N, H), bf), jax.random.normal(ks[1], (B, T, N, R), bf),
                jax.random.normal(ks[2], (B, S, N, H), bf), jax.random.normal(ks[3], (B, S, R), bf),
                jax.random.normal(ks[4], (B, S, N, U), bf))
        cached = np.asarray([prefix - 7 * b for b in range(B)])        # ragged prefixes
        n_new = np.asarray([T - 5 * b for b in range(B)])               # ... and chunks: padding queries
        old = np.broadcast_to((np.arange(prefix)[None, :] < cached[:, None])[:, None, :], (B, T, prefix))
        real = np.arange(T)[None, :] < n_new[:, None]                   # [B, T]
        new = np.tril(np.ones((T, T), bool))[None] & real[:, None, :]
        mask = jnp.asarray(np.concatenate([old, new], -1))
        valid = real[:, :, None, None]                                  # compare real queries only
        scale = (H + R) ** -0.5
        flops = 2 * B * N * T * S * (H + R + U)
        row = dict(section="prefill_chunk", B=B, prefix=prefix, T=T, N=N, flops=flops)
        lens = (jnp.asarray(cached, jnp.int32), jnp.asarray(n_new, jnp.int32))
        ref, ref_name = None, None     # the first path that ran (einsum, unless its scores do not fit)
        for name in ("einsum", "cudnn", "cudnn_split"):
            if name == "cudnn_split" and not split_ok:
                continue
            try:
                plan = _plan(impl="pallas", chunk_attention=name)
                fn = jax.jit(lambda *a: ops.mla_prefill_attention(*a, mask, scale, plan=plan, chunk_lens=lens))
                t = time_fn(fn, *args)
                out = np.where(valid, np.asarray(fn(*args)), 0.0)
                if ref is None:
                    ref, ref_name = out, name
                err = float(np.max(np.abs(out - ref)))
                row.update({f"t_{name}": t, f"err_{name}": err, "err_vs": ref_name})
                log(f"prefill chunk B={B} prefix={prefix} T={T} {name}: {t * 1e3:.2f} ms "
                    f"{flops / t / 1e12:.0f} TFLOP/s max|diff vs {ref_name}|={err:.1e}")
            except Exception as e:  # noqa: BLE001
                row[f"t_{name}"] = None
                log(f"prefill chunk B={B} prefix={prefix} {name}: failed {type(e).__name__}: {str(e)[:160]}")
        record(**row)
        rows.append(row)
    return rows


def table(copy_bps, read_bps, rows):
    lines = [f"copy {copy_bps / 1e9:.0f} GB/s (XLA x^1, read+write; the higher of the start and end "
             f"measurements), read-only {read_bps / 1e9:.0f} GB/s", "",
             "| B | context | heads | page | pages | layers | MB/layer | serving kernel | serving us | serving % copy | "
             "best us | best | best GB/s | best % copy | Triton default us | XLA us | XLA/serving |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "t_kernel" not in r:
            lines.append(f"| {r['B']} | {r['ctx']} | {r['N']} | {r.get('page')} | {r.get('table_order')} | | | "
                         "failed | | | | | | | | | |")
            continue
        tx, ts = r["t_xla"], r.get("t_serving")
        mb = r["bytes"] / r["layers"]
        nan = float("nan")
        ln = r.get("lengths")
        ctx = f"1 x {ln[0]} + {len(ln) - 1} x {ln[1]}" if ln else r["ctx"]
        lines.append(f"| {r['B']} | {ctx} | {r['N']} | {r.get('page')} | {r.get('table_order')} | "
                     f"{r['layers']} | {mb / 1e6:.1f} | "
                     f"{r.get('serving')} | {ts * 1e6 if ts else nan:.1f} | "
                     f"{100 * mb / ts / copy_bps if ts else nan:.1f} | "
                     f"{r['t_kernel'] * 1e6:.1f} | {r['best']} | {r['kernel_bps'] / 1e9:.0f} | {r['pct_copy']:.1f} | "
                     f"{(r.get('t_default') or nan) * 1e6:.1f} | "
                     f"{tx * 1e6 if tx else nan:.1f} | {tx / ts if tx and ts else nan:.2f} |")
    return "\n".join(lines)


def device_copy_bps(calls: int = 8) -> float:
    """The copy ceiling by device time, as --profile measures the op: `calls` XLA `x ^ 1` over 2 GiB
    (each call's output the next one's input) traced; bytes read + written over the median kernel
    duration. A wall-clock copy pays the host's start of each timing, which the profiled op's span
    does not. (One executable of chained copies does not work: XLA fuses the chain into one pass.)"""
    import statistics
    import tempfile
    import jax
    import jax.numpy as jnp
    from kimi_jax.tools import profiling
    n = (1 << 16) if FLAGS.dry else (1 << 29)          # uint32 words: 2 GiB
    x = jax.random.bits(jax.random.PRNGKey(0), (n,), jnp.uint32)
    f = jax.jit(lambda v: v ^ jnp.uint32(1))
    x = jax.block_until_ready(f(x))
    tdir = tempfile.mkdtemp(prefix="kimi_copy_")
    with jax.profiler.trace(tdir):
        for _ in range(calls):
            x = f(x)
        jax.block_until_ready(x)
    durs = [o.dur_us for o in profiling.device_op_events(profiling.find_trace_file(tdir)) if o.dur_us > 0]
    del x
    if len(durs) < calls:
        raise RuntimeError(f"device copy: {len(durs)} device ops traced for {calls} copies")
    return 2 * 4 * n / (statistics.median(durs) * 1e-6)


def _profile_specs():
    """--profile entries as (B, context, heads, kernel); 'grid' = the acceptance grid (B 1 / 8 / 64 x
    context 4K / 32K / 128K x heads 64 / 8, the kernel ops picks)."""
    specs = []
    for spec in FLAGS.profile:
        if spec == "grid":
            specs += [(B, ctx, N, "auto") for N in (64, 8) for B in (1, 8, 64) for ctx in (4096, 32768, 131072)]
            continue
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise app.UsageError(f"--profile={spec}: want B:context:heads[:kernel]")
        kernel = parts[3] if len(parts) == 4 else "auto"
        kernels = ("auto", "triton", "mgpu", "triton_fin", "triton_bal", *MGPU_VARIANTS)
        if kernel not in kernels:
            raise app.UsageError(f"--profile={spec}: kernel one of {', '.join(kernels)}")
        specs.append((*(int(v) for v in parts[:3]), kernel))
    return specs


def profile_table(rows, dev_copy_bps) -> str:
    """The --profile cases against the device-time copy: span (the op's every device op, first start
    to last end, per call), its largest op (the kernel), the rest, and the wall clock of the same
    executable; % of copy = the cache's bytes over the span (and over the kernel alone); the SM clock and
    board power sampled while the case ran (kimi_jax.tools.telemetry: 'capped' = samples under the power cap)."""
    from kimi_jax.tools import telemetry
    lines = [f"copy by device time {dev_copy_bps / 1e9:.0f} GB/s (XLA x^1 over 2 GiB, read + write)", "",
             "| B | context | heads | kernel | MB/layer | span us | kernel us | other ops us | wall us | "
             "% copy (span) | % copy (kernel) | SM clock, power while timed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = max(r["ops_us"].values())
        wall = f"{r['wall_us']:.1f}" if r.get("wall_us") else "-"
        lines.append(f"| {r['B']} | {r['ctx']} | {r['N']} | {r['serving'] if r['kernel'] == 'auto' else r['kernel']} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['span_us']:.1f} | {k:.1f} | {r['busy_us'] - k:.1f} | {wall} | "
                     f"{100 * r['bytes'] / (r['span_us'] * 1e-6) / dev_copy_bps:.1f} | "
                     f"{100 * r['bytes'] / (k * 1e-6) / dev_copy_bps:.1f} | "
                     f"{telemetry.describe(r.get('gpu') or {})} |")
    return "\n".join(lines)


def section_profile(copy_bps):
    """--profile: for each case, one executable of `calls` layers of the engine's op
    (kimi_jax.ops.mla_paged_attention; `layers_fn`: pool copies in turn so consecutive layers miss
    L2, each layer's output the next one's query) under jax.profiler; per call: every device op's
    time (kernels and XLA fusions by name), their sum, and the span from the first op's start to the
    last op's end over calls (span - sum = idle gaps between ops inside the executable, as in the
    engine; the first version timed separately dispatched calls, whose gaps were the host's below
    ~150 us per call)."""
    import jax
    import jax.numpy as jnp
    from kimi_jax import ops
    from kimi_jax.tools import profiling
    from kimi_jax.tools import telemetry
    from pallas_kernels.mla.decode import MlaDecodeConfig
    page, T, calls = 16, 1, 4 if FLAGS.dry else 20
    rows = []
    specs = _profile_specs()
    dev_copy = device_copy_bps()
    log(f"copy by device time {dev_copy / 1e9:.0f} GB/s (read+write)")
    record(section="copy_device", copy_bps=dev_copy)
    for B, ctx, N, kernel in specs:
        if time.time() - _T0 > FLAGS.budget_s:
            log(f"budget reached: skipping profile B={B} ctx={ctx} N={N}")
            continue
        P = -(-ctx // page)
        copies = FLAGS.profile_copies or max(2, min(8, (2 << 30) // max(1, B * P * page * C * 2)))   # >= 2 GiB in turn
        pool = _pool(jax.random.PRNGKey(5), copies * B * P, page, jnp.bfloat16)
        q_lat, q_pe, new, table, pos = _inputs(jax.random.PRNGKey(B + ctx + N), B, T, N, page,
                                               [ctx - T] * B, P, B * P, jnp.bfloat16)
        scale = 192 ** -0.5
        fin = {"triton_fin": MlaDecodeConfig(finish="kernel"),
               "triton_bal": MlaDecodeConfig(schedule="balanced")}.get(kernel)
        args = (q_lat, q_pe, new, pool, table, pos)
        f = layers_fn(_op(kernel, fin, scale), calls, B * P, copies).lower(*args).compile()
        with telemetry.GpuSampler() as gpu:     # clocks / power while it runs
            per_op, span, tdir = profiling.device_ops_per_call(f, args, calls)
            wall = time_fn(f, *args) / calls * 1e6 if FLAGS.profile_wall else None
        busy = sum(per_op.values())
        nbytes = B * (ctx - T) * C * 2
        row = dict(section="profile", B=B, ctx=ctx, N=N, kernel=kernel,
                   serving=ops.mla_decode_kernel(T * N, A, R, page, jnp.bfloat16, batch=B, context=P * page),
                   calls=calls, ops_us=per_op, busy_us=busy,
                   span_us=span, wall_us=wall, copies=copies, bytes=nbytes, copy_us=nbytes / copy_bps * 1e6,
                   trace_dir=tdir, gpu=gpu.summary)
        record(**row)
        rows.append(row)
        log(f"profile B={B} ctx={ctx} N={N} kernel={kernel}: span {span:.1f} us/call, device ops "
            f"{busy:.1f} us, gaps {span - busy:.1f} us"
            + (f", wall {wall:.1f} us/call" if wall is not None else "")
            + f" ({copies} pool copies); the cache at copy speed {row['copy_us']:.1f} us; "
            + f"GPU while timed: {telemetry.describe(gpu.summary)}")
        for name, us in list(row["ops_us"].items())[:10]:
            log(f"    {us:9.1f} us  {name[:110]}")
        del pool, args
    t = profile_table(rows, dev_copy)
    print(t, flush=True)
    with open(os.path.join(FLAGS.out, "profile_table.md"), "w") as f:
        f.write(t + "\n")
    return rows


# ----------------------------------------------------------------------------------------------
# --check_schedules: the Mosaic GPU op under both work schedules.

def section_schedules() -> bool:
    """--check_schedules (the docstring): prints and records one line per case; returns whether all
    passed. --dry: lengths 1, 37, 0, page 16, T = 1, the served config only, one row alone (on CPU the
    Mosaic GPU interpreter runs: each call takes many seconds)."""
    import dataclasses
    import jax
    import numpy as np
    from pallas_kernels.mla import decode as md
    from pallas_kernels.mla import decode_mgpu as mg
    lengths, pages, ts = ([1, 37, 0], (16,), (1,)) if FLAGS.dry else \
        ([1, 4000, 37, 20000, 0, 515, 63, 64], (16, 64), (1, 2))
    configs = {"serving": mg.serving_config(2)}
    if not FLAGS.dry:
        configs["mask"] = mg.MgpuConfig(mask_tail_only=False)          # every score masked
    interpret = jax.default_backend() == "cpu"
    scale, ok = 192 ** -0.5, True

    def check(label, args, ref, cfg):
        nonlocal ok
        o = np.asarray(mg.mla_paged_attention_mgpu(*args, scale, config=cfg, interpret=interpret), np.float32)
        err = float(np.max(np.abs(o - ref)))
        good = bool(np.all(np.isfinite(o)) and err < 3e-2)
        ok &= good
        log(f"schedules {label} max|o-ref|={err:.2e} {'OK' if good else 'FAIL'}")
        record(section="schedules", case=label, err=err, ok=good)

    for page in pages:
        for t in ts:
            args = md.make_case(jax.random.key(3 + page + t), lengths, heads=64, t=t, page=page)
            ref = np.asarray(md.mla_paged_attention_reference(*args, scale), np.float32)
            for sched in ("rows", "balanced"):
                for name, base in configs.items():
                    check(f"page={page} T={t} {sched} {name}", args, ref, dataclasses.replace(base, schedule=sched))
            # one row: serving_config(1) (the one-launch finish), rows of the same batch alone
            for r in [1] if FLAGS.dry else sorted({0, 1, len(lengths) // 2, int(np.argmax(lengths))}):
                one = [x if i == 3 else x[r:r + 1] for i, x in enumerate(args)]   # args[3]: the pool
                check(f"page={page} T={t} row {r} (length {lengths[r]}) alone serving_config(1)", one,
                      ref[r:r + 1], mg.serving_config(1))
    log("schedules", "ALL OK" if ok else "SOME FAILED")
    return ok


# ----------------------------------------------------------------------------------------------
# --combine_sweep: the balanced schedule's combine kernel.

def _parse_combine_case(spec: str) -> tuple[int, int, int, int, int]:
    try:
        B, M, items, long, short = (int(v) for v in spec.split(":"))
    except ValueError:
        raise app.UsageError(f"--combine_cases: {spec!r} is not B:M:items:long:short (five integers)") from None
    if B < 1 or M < 1 or items < B or min(long, short) < 0:
        raise app.UsageError(f"--combine_cases: {spec!r} needs B, M >= 1, items >= B and lengths >= 0")
    return B, M, items, long, short


def _combine_cases() -> list[str]:
    """--combine_cases; under --dry without it, one small case."""
    return FLAGS.combine_cases if FLAGS["combine_cases"].present or not FLAGS.dry else ["4:2:8:300:20"]


def _combine_case(spec: str, a: int, seed: int = 0):
    """The inputs of one --combine_cases entry: (work table, partials o, lse, new-token o, lse)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.mla import decode as md
    B, M, items, long, short = _parse_combine_case(spec)
    work = md.balanced_items(jnp.asarray([long] + [short] * (B - 1), jnp.int32), items, 64)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    used = (work[2] > work[1])[:, None]
    o = jnp.where(used[..., None], jax.random.normal(ks[0], (items, M, a), jnp.float32), 0.0)
    lse = jnp.where(used, 4.0 * jax.random.normal(ks[1], (items, M), jnp.float32), -jnp.inf)
    o_new = jax.random.normal(ks[2], (B, M, a), jnp.float32)
    lse_new = 4.0 * jax.random.normal(ks[3], (B, M), jnp.float32)
    return work, o, lse, o_new, lse_new


def section_combine_sweep() -> int:
    """--combine_sweep (the docstring): one line and one results.jsonl row per (case, config); returns
    how many configs failed or disagreed with the reference. --dry: 32 latent columns, interpreted."""
    import jax
    import jax.numpy as jnp
    from kimi_jax.tools import profiling
    from pallas_kernels.mla.combine import combine_items, combine_items_xla
    ints = lambda xs: [int(v) for v in xs]   # noqa: E731
    configs = [(w, a, g) for w in ints(FLAGS.combine_warps) for a in ints(FLAGS.combine_block_as)
               for g in ints(FLAGS.combine_block_gs)]
    interpret = jax.default_backend() == "cpu"
    width, calls = (32 if FLAGS.dry else A), FLAGS.combine_calls
    failed = 0
    log(f"{'case B:M:items:long:short':<28} {'MB':>6} {'config (warps, block_a, block_g)':<34} "
        f"{'us':>8} {'GB/s':>7} check")
    for spec in _combine_cases():
        work, o, lse, o_new, lse_new = _combine_case(spec, width)
        B = o_new.shape[0]
        nbytes = o.size * 4 + lse.size * 4 + 2 * o_new.size * 4
        news = [lse_new + 0.001 * i for i in range(calls)]      # distinct calls: no CSE
        want = combine_items_xla(o, lse, work[0], o_new, lse_new)
        runs = [("xla", lambda n: combine_items_xla(o, lse, work[0], o_new, n))]
        for w, a, g in configs:
            runs.append(((w, a, g), lambda n, w=w, a=a, g=g: combine_items(
                o, lse, work[3, :B], work[4, :B], o_new, n, num_warps=w, block_a=a, block_g=g,
                interpret=interpret)))
        for name, fn in runs:
            try:
                got = jax.jit(fn)(lse_new)
                err = max(float(jnp.max(jnp.abs(got[0] - want[0]))),
                          float(jnp.max(jnp.where(jnp.isfinite(want[1]), jnp.abs(got[1] - want[1]), 0.0))))
                many = jax.jit(lambda ns, fn=fn: [fn(n) for n in ns]).lower(news).compile()
                per_op, _, _ = profiling.device_ops_per_call(many, (news,), calls)
                t = max(sum(per_op.values()), 1e-3) * 1e-6
                top = ", ".join(f"{k[:24]} {v:.1f}" for k, v in list(per_op.items())[:3])
                good = err < 1e-4    # f32 sums in another order differ by ~1e-6 here; a part merged into
                #                      the wrong row or dropped moves an output by O(1)
                log(f"{spec:<28} {nbytes / 1e6:6.1f} {str(name):<34} {t * 1e6:8.1f} "
                    f"{nbytes / t / 1e9:7.0f} {'OK' if good else 'FAIL'} {err:.1e}  [{top}]")
                record(section="combine_sweep", case=spec, config=str(name), us=t * 1e6, bytes=nbytes, err=err,
                       ok=good, ops_us=per_op)
                failed += not good
            except Exception as e:  # noqa: BLE001
                log(f"{spec:<28} {str(name):<34} failed: {type(e).__name__}: {str(e)[:100]}")
                record(section="combine_sweep", case=spec, config=str(name), ok=False,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
                failed += 1
    return failed


def main(argv):
    del argv
    if FLAGS.dry:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    bad = [o for o in FLAGS.table_orders if o not in TABLE_ORDERS]
    if bad:
        raise app.UsageError(f"--table_orders: {bad[0]!r} is not random, sequential or interleaved")
    for spec in FLAGS.mixed:           # before any section runs
        _parse_mixed(spec)
    for spec in _combine_cases() if FLAGS.combine_sweep else ():
        _parse_combine_case(spec)
    import jax
    if FLAGS.combine_xla_max_macs is not None or FLAGS.new_token_einsum:
        log("kernel thresholds of this run:", _thresholds())
    log("devices", jax.devices(), "jax", jax.__version__)
    if FLAGS.check_schedules:
        if not section_schedules():
            raise SystemExit("mla --check_schedules: some cases failed")
        return
    if FLAGS.combine_sweep:
        failed = section_combine_sweep()
        if failed:
            raise SystemExit(f"mla --combine_sweep: {failed} config(s) failed or disagreed with the reference")
        return
    copy_bps, read_bps = section_copy()
    if FLAGS.profile:
        section_profile(copy_bps)
        log("profile done", f"total {time.time() - _T0:.0f}s")
        return
    if FLAGS.sweep:
        section_sweep(copy_bps)
        log("sweep done", f"total {time.time() - _T0:.0f}s")
        return
    if FLAGS.prefill_only:
        section_prefill()
        log("prefill done", f"total {time.time() - _T0:.0f}s")
        return
    ok = section_check()
    rows = section_decode(copy_bps)
    copy_end, read_end = section_copy("end")
    copy_bps, read_bps = max(copy_bps, copy_end), max(read_bps, read_end)
    for r in rows:                     # "% of copy" against the higher ceiling
        if "t_kernel" in r:
            r["pct_copy"] = 100 * r["kernel_bps"] / copy_bps
    t = table(copy_bps, read_bps, rows)
    print(t, flush=True)
    with open(os.path.join(FLAGS.out, "table.md"), "w") as f:
        f.write(t + "\n")
    if FLAGS.prefill:
        section_prefill()
    log("correctness", "OK" if ok else "FAILED", "total", f"{time.time() - _T0:.0f}s")


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench mla", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
