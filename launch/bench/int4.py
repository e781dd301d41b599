"""kimi-bench int4: the INT4 kernel acceptance table (one GPU run).
  kimi-bench int4 --out=$OUT/int4                         # one H200
  kimi-bench int4 --dry --sections=moe --out=/tmp/int4    # tiny shapes on CPU (the script itself)

Sections: device/versions, copy and matmul ceilings, GPU correctness of the kernels
against float32 references, the dense INT4 matmul sweep and the MoE layer sweep with baselines
(XLA bf16 matmul, XLA dequant path, jax.lax.ragged_dot bf16, torch._weight_int4pack_mm, cuBLAS bf16).

Timing method (JAX): one jitted function applies the op to R distinct weight sets (Python-unrolled,
so XLA emits R back-to-back kernels with no host round trip between them) and, for the dense case,
P distinct activations; the executable is enqueued `inner` times back to back and blocked once, so
host dispatch overlaps device work. time = median over `reps` of wall / (inner * calls). Torch
baselines: the same R calls captured in one CUDA graph, timed with CUDA events, median over reps.
Rotating over >= 64 weight sets (>= 1 GB) defeats the 60 MB L2.
"""
# Over 600 lines: one kimi-bench suite: its cases, their references, timing and report.
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.environ.get("OUT", "out/bench"), "directory for detailed results")
flags.DEFINE_list("sections", ["info", "ceil", "check", "moe", "dense"], "sections to run")
flags.DEFINE_integer("num_mats", 64, "distinct weight matrices rotated over (dense)")
flags.DEFINE_integer("rotations", 8, "distinct routings rotated over (MoE)")
KIMI_EXPERTS, KIMI_TOPK = 384, 8      # Kimi-K2.5's routed experts and top-k (the MoE section's shapes)
flags.DEFINE_integer("moe_experts", KIMI_EXPERTS, "MoE section: routed experts allocated (Kimi: 384; fewer spans less "
                     "memory with the same experts touched per call, e.g. to see what the weights' footprint "
                     "costs beyond the bytes read)")
flags.DEFINE_integer("moe_held_pairs", 0, "MoE section: of each token's top-8 pairs, how many have their expert on "
                     "this device (the rest get id E, as expert parallelism passes them: skipped, read nothing); "
                     "1 is EP8 at batch 1, where a device runs about one expert per token. 0: all 8 (one "
                     "device holds every expert). Below 8 the baselines (which would run every pair) are skipped")
flags.DEFINE_integer("moe_intermediate", 2048, "MoE section: each expert's intermediate width F (Kimi: 2048; one TP8 "
                     "shard's slice: 256)")
flags.DEFINE_integer("reps", 7, "timed repetitions (median)")
flags.DEFINE_list("ms", ["1", "4", "16"], "dense token counts")
flags.DEFINE_list("batches", ["1", "16", "64", "256"], "MoE token counts")
flags.DEFINE_string("dense_configs", "default", "name of a config list in DENSE_SWEEPS")
flags.DEFINE_string("moe_configs", "default", "name of a config list in MOE_SWEEPS")
flags.DEFINE_bool("baselines", True, "time the baselines too")
flags.DEFINE_list("sweep_layouts", ["i32"], "weight layouts every swept config is timed in (the default config "
                  "always in both): i32 = compressed-tensors' words as loaded, what the engine serves; i16 = "
                  "repacked half-words")
flags.DEFINE_list("check_tokens", ["1", "3", "7", "33"], "check section: MoE token counts every swept config is "
                  "checked at (random and all-on-one-expert routing each); fewer makes a wide sweep's check cheaper")
flags.DEFINE_bool("dense_profile", False, "dense section: also profile every timed config (i32): device us per op "
                  "and the span per call (at 8-17 MB per call the wall clock can spread by tens of percent between "
                  "runs)")
flags.DEFINE_bool("moe_profile", False, "moe section: also profile every timed config (i32) at each "
                  "T: device time per op and the gaps between them (kimi_jax.tools.profiling.device_ops_per_call)")
flags.DEFINE_bool("dry", False, "tiny shapes (CPU dry run of the script itself)")
flags.DEFINE_float("budget_s", 420.0, "stop starting new sections after this many seconds")

RESULTS: list[dict] = []
_T0 = time.time()


def log(*a):
    print(f"[{time.time() - _T0:7.1f}s]", *a, flush=True)


def record(**row):
    RESULTS.append(row)
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def record_failure(section, case, cname, layout, e: Exception):
    """A kernel config that failed: recorded with its error, logged, and the sweep goes on."""
    record(section=section, case=case, impl="pallas", config=cname, layout=layout,
           error=f"{type(e).__name__}: {str(e)[:2000]}")
    log(case, cname, "FAILED", type(e).__name__, str(e)[:500])


def median(xs):
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------
# timing helpers

def time_jax(fn, args, calls, inner=5, reps=None, gpu=None):
    """Median seconds per call over reps rounds of `inner` back-to-back executions of `calls` calls.
    gpu: a dict that receives the SM clock / power / power-cap share sampled while the rounds ran
    (kimi_jax.tools.telemetry; stays empty without nvidia-smi)."""
    import jax
    from kimi_jax.tools import telemetry
    reps = reps or FLAGS.reps
    jax.block_until_ready(fn(*args))
    ts = []
    with telemetry.GpuSampler() as sampler:
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = [fn(*args) for _ in range(inner)]
            jax.block_until_ready(outs)
            ts.append((time.perf_counter() - t0) / (inner * calls))
            del outs
    if gpu is not None:
        gpu.update(sampler.summary)
    return median(ts)


def time_torch_graph(body, calls, reps=None, replays=5):
    """body(): enqueues `calls` ops. Captured in a CUDA graph; returns median seconds per call."""
    import torch
    reps = reps or FLAGS.reps
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / (replays * calls))
    del g
    return median(ts)


# ---------------------------------------------------------------------------------------------
# config sweeps

def dense_sweep(name, k=7168):
    from pallas_kernels.int4.matmul import Int4MatmulConfig as C
    big = 7 if k % 7 == 0 else 8
    sweeps = {
        "default": [
            ("default", None),
            ("sw1_bm8_bn64_s1", C(block_m=8, block_n=64, block_k=512, swap_ab=True, split_k=1)),
            ("sw1_bm8_bn64_s2", C(block_m=8, block_n=64, block_k=512, swap_ab=True, split_k=2)),
            ("sw1_bm8_bn64_s4", C(block_m=8, block_n=64, block_k=256, swap_ab=True, split_k=4)),
            (f"sw1_bm8_bn64_s{big}", C(block_m=8, block_n=64, block_k=256, swap_ab=True,
                                       split_k=big)),
            ("sw0_bm16_bn32_k1024_st4", C(block_n=32, block_k=1024, num_stages=4)),
            ("sw0_bm16_bn32_k512_s2", C(block_n=32, block_k=512, split_k=2)),
        ],
        # single-launch variants against an XLA x permute + kernel and the best split-K kernel of the
        # 'default' list (+ XLA sum). 'shuffle': x permuted in registers (no XLA
        # op); 'atomic': split-K summed by f32 atomics (XLA zero fill + kernel + cast).
        "single_launch": [
            ("default", None),
            (f"sw1_bm8_bn64_s{big}", C(block_m=8, block_n=64, block_k=256, swap_ab=True,
                                       split_k=big)),
            ("shuf_bm16_bn32_k512_st4", C(block_n=32, block_k=512, num_stages=4,
                                          x_layout="shuffle")),
            ("shuf_bm16_bn16_w2_k512_st4", C(block_n=16, block_k=512, num_warps=2, num_stages=4,
                                             x_layout="shuffle")),
            (f"shuf_sw1_bm8_bn64_s{big}_xla", C(block_m=8, block_n=64, block_k=256, swap_ab=True,
                                                split_k=big, x_layout="shuffle")),
            ("shuf_sw1_bm8_bn64_s4_atomic", C(block_m=8, block_n=64, block_k=256, swap_ab=True,
                                              split_k=4, split_reduce="atomic",
                                              x_layout="shuffle")),
            (f"shuf_sw1_bm8_bn64_s{big}_atomic", C(block_m=8, block_n=64, block_k=256,
                                                   swap_ab=True, split_k=big,
                                                   split_reduce="atomic", x_layout="shuffle")),
            ("shuf_bm16_bn32_s4_st4_atomic", C(block_n=32, block_k=256, num_stages=4, split_k=4,
                                               split_reduce="atomic", x_layout="shuffle")),
        ],
        # the K split inside the program (split_reduce='cta'; one launch, bf16 out, no zero fill or
        # cast): under ncu the atomic split-K kernel alone beats tinygemm's, its two extra XLA launches
        # lose M = 1 (H200). SASS for sm_90, gate+up M = 1: 96 registers, 27 KB.
        "cta": [
            ("default", None),
            ("shuf_cta_s4_w4_k256", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta",
                                      x_layout="shuffle")),
            ("shuf_cta_s4_w4_k256_st4", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta",
                                          x_layout="shuffle", num_stages=4)),
            ("shuf_cta_s2_w4_k256", C(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta",
                                      x_layout="shuffle")),
            ("perm_cta_s4_w4_k256", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta")),
            ("shuf_cta_s4_w4_k128", C(block_n=64, block_k=128, swap_ab=True, split_k=4, split_reduce="cta",
                                      x_layout="shuffle")),
            ("shuf_cta_s4_w4_k128_st4", C(block_n=64, block_k=128, swap_ab=True, split_k=4, split_reduce="cta",
                                          x_layout="shuffle", num_stages=4)),
            ("default_again", C(block_m=8, block_n=64, block_k=256, swap_ab=True, split_k=4,
                                split_reduce="atomic", x_layout="shuffle")),
        ],
        # every K step of a program in flight at once. At M = 1 a gate+up program
        # streams 16 rows x 7168 in 7 steps with 2 in flight (3 stages): ~64 KB over a few us, so its
        # ramp is the kernel's time (ncu: 10.0 us for 16.5 MB, 38% of copy). SASS for sm_90, gate+up
        # M = 1: 8 stages = 96 registers, 91 KB shared memory (2 CTAs per SM, the 256 programs' one wave).
        "cta_deep": [
            ("default", None),
            ("shuf_cta_s4_k256_st5", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta",
                                       x_layout="shuffle", num_stages=5)),
            ("shuf_cta_s4_k256_st8", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta",
                                       x_layout="shuffle", num_stages=8)),
            ("shuf_cta_s2_k256_st5", C(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta",
                                       x_layout="shuffle", num_stages=5)),
            ("shuf_cta_s2_k256_st8", C(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta",
                                       x_layout="shuffle", num_stages=8)),
            ("default_again", None),
        ],
        # M = 4 and 16 by device time (--dense_profile). The default at M = 16 (32 rows per
        # program, 128 programs at gate+up) ran 14.5 us for 16.9 MB, near XLA's bf16 matmul; every program
        # re-reads x (M x K bf16) from L2, so 4096 / R programs move 4096 / R x 229 KB of activations at
        # M = 16: 29 MB at R = 32, 59 MB at R = 16 (the 4-slice 'cta' kernel) against 16.5 MB of weights.
        # More rows per program with split-K keeps the programs without the activation traffic.
        "m16": [
            ("default", None),
            ("cta_s2_shuf", C(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta",
                              x_layout="shuffle")),
            ("cta_s2_perm", C(block_n=64, block_k=256, swap_ab=True, split_k=2, split_reduce="cta")),
            ("cta_s4_shuf", C(block_n=64, block_k=256, swap_ab=True, split_k=4, split_reduce="cta",
                              x_layout="shuffle")),
            ("sw_bm16_bn64_s4_xla", C(block_m=16, block_n=64, block_k=256, swap_ab=True, split_k=4)),
            ("sw_bm16_bn64_s4_atomic_shuf", C(block_m=16, block_n=64, block_k=256, swap_ab=True, split_k=4,
                                              split_reduce="atomic", x_layout="shuffle")),
            ("sw_bm16_bn64_s8_k128_xla", C(block_m=16, block_n=64, block_k=128, swap_ab=True, split_k=8)),
            ("sw_bm16_bn128_w8_s4_xla", C(block_m=16, block_n=128, block_k=256, num_warps=8, swap_ab=True,
                                          split_k=4)),
            ("default_again", None),
        ],
        "small": [("default", None)],
    }
    return sweeps[name]


BLOCKED_SUFFIX = "_blk"


def down_for(cname, cfg, dn, cache):
    """The down weight a swept MoE config reads: moe_gmm.block_down's layout (blocked for the config's F
    slice, built once per slice width and kept in cache) for names ending in BLOCKED_SUFFIX, else dn."""
    if not cname.endswith(BLOCKED_SUFFIX):
        return dn
    from pallas_kernels.int4 import moe_gmm as mg
    bf = cfg.block_n_gate_up
    if bf not in cache:
        cache[bf] = mg.block_down(*dn, bf)
    return cache[bf]


def moe_sweep(name):
    from pallas_kernels.int4.moe_gmm import MoeGmmConfig as C
    sweeps = {
        "default": [
            ("default", None),
            ("bm8_gu64_d64_w4_s3", C()),
            ("bm8_gu64_d64_w4_s2", C(num_stages=2)),
            ("bm8_gu32_d64_w2_s3", C(block_n_gate_up=32, num_warps=2)),
            ("bm16_sw0_gu64_d64_w8", C(block_m=16, num_warps=8, swap_ab=False)),
            ("bm8_sorted_always", C(pair_tiles_max_t=0)),
        ],
        # decode in two launches (moe_decode.py; 'fused*' entries run only at T <= 4, where that
        # path applies) against the pair tiles ('tiles': 4 launches + routing ops).
        # d<BN>w<W>: down kernel columns per program / warps (grid T x D/BN); shuf: x permuted in
        # registers; tiles_shuf: the sorted/pair-tile path with the in-register x permute.
        "decode": [
            ("default", None),
            ("fused_perm_d64w4", C(decode="fused")),
            ("fused_shuf_d64w4", C(decode="fused", x_layout="shuffle")),
            ("fused_shuf_d32w2", C(decode="fused", x_layout="shuffle", block_n_down=32,
                                   num_warps_down=2)),
            ("fused_shuf_d32w2_s4", C(decode="fused", x_layout="shuffle", block_n_down=32,
                                      num_warps_down=2, num_stages_down=4)),
            ("fused_shuf_d16w1_s4", C(decode="fused", x_layout="shuffle", block_n_down=16,
                                      num_warps_down=1, num_stages_down=4)),
            ("fused_shuf_gu32w2_d32w2", C(decode="fused", x_layout="shuffle", block_n_gate_up=32,
                                          num_warps=2, block_n_down=32)),
            ("fused_shuf_k1024_d32w2", C(decode="fused", x_layout="shuffle", block_k_gate_up=1024,
                                         block_k_down=1024, block_n_down=32, num_warps_down=2)),
            ("tiles_shuf", C(x_layout="shuffle")),
        ],
        # the pair-tile decode path (T <= 4) with other K steps / stages / program
        # sizes: the down kernel ran at 66% of copy at T = 1 (896 programs of 4 K steps)
        "t1": [
            ("default", None),
            ("dk256", C(block_k_down=256)),
            ("dk1024", C(block_k_down=1024)),
            ("s4", C(num_stages=4)),
            ("s4_dk256", C(num_stages=4, block_k_down=256)),
            ("guk1024_s4", C(block_k_gate_up=1024, num_stages=4)),
            ("gu32_d32_w2", C(block_n_gate_up=32, block_n_down=32, num_warps=2)),
            ("gu32_d32_w2_s4", C(block_n_gate_up=32, block_n_down=32, num_warps=2, num_stages=4)),
            ("gu128_d128_w8", C(block_n_gate_up=128, block_n_down=128, num_warps=8)),
            # the two-launch path with x permuted by XLA (the 'decode' sweep timed only d64w4 with it)
            ("fused_perm_d32w2", C(decode="fused", block_n_down=32, num_warps_down=2)),
            ("fused_perm_d32w2_s4", C(decode="fused", block_n_down=32, num_warps_down=2,
                                      num_stages_down=4)),
            ("fused_perm_d16w1_s4", C(decode="fused", block_n_down=16, num_warps_down=1,
                                      num_stages_down=4)),
        ],
        # the whole layer in one launch (moe_decode_single; T <= 4 only). f<BF>: F
        # features per program (T=1: 8 x 2048/BF programs), d<BN>: D columns per down step (atomics
        # of one step), k: gate/up K step, w/s: warps / stages; against the default and the two-launch path.
        "single": [
            ("default", None),
            ("fused_perm_d64w4", C(decode="fused")),
            ("single_f128_d256", C(decode="single", block_n_gate_up=128, block_n_down=256)),
            ("single_f128_d256_shuf", C(decode="single", block_n_gate_up=128, block_n_down=256,
                                        x_layout="shuffle")),
            ("single_f128_d128", C(decode="single", block_n_gate_up=128, block_n_down=128)),
            ("single_f128_d512_w8", C(decode="single", block_n_gate_up=128, block_n_down=512,
                                      num_warps=8)),
            ("single_f64_d256", C(decode="single", block_n_gate_up=64, block_n_down=256)),
            ("single_f64_d128_s4", C(decode="single", block_n_gate_up=64, block_n_down=128,
                                     num_stages=4)),
            ("single_f128_k256_d256_s4", C(decode="single", block_n_gate_up=128, block_k_gate_up=256,
                                           block_n_down=256, num_stages=4)),
            ("single_f256_d256_w8", C(decode="single", block_n_gate_up=256, block_n_down=256,
                                      num_warps=8)),
        ],
        # is the single launch's down phase slowed by the atomics' order
        # (Pallas lowers them acquire-release) or by the atomics at all? _relaxed: relaxed-order
        # atomics; _store: each program stores its partial row and XLA sums them (no atomics)
        "single2": [
            ("default", None),
            ("single_f128_d512_w8", C(decode="single", block_n_gate_up=128, block_n_down=512,
                                      num_warps=8)),
            ("single_f128_d512_w8_relaxed", C(decode="single", block_n_gate_up=128, block_n_down=512,
                                              num_warps=8, single_reduce="relaxed")),
            ("single_f128_d512_w8_store", C(decode="single", block_n_gate_up=128, block_n_down=512,
                                            num_warps=8, single_reduce="store")),
            ("single_f128_d256_relaxed", C(decode="single", block_n_gate_up=128, block_n_down=256,
                                           single_reduce="relaxed")),
            ("single_f128_d128_relaxed", C(decode="single", block_n_gate_up=128, block_n_down=128,
                                           single_reduce="relaxed")),
            ("single_f128_d256_store", C(decode="single", block_n_gate_up=128, block_n_down=256,
                                         single_reduce="store")),
            ("single_f64_d256_relaxed", C(decode="single", block_n_gate_up=64, block_n_down=256,
                                          single_reduce="relaxed")),
        ],
        # the two-launch path with the down kernel's K loop
        # (8 experts x F/512 steps at Kimi's shape) split over sk programs per 64-column block, partials
        # added by relaxed f32 atomics (T=1: 112 x sk programs instead of 112)
        "fused_splitk": [
            ("default", None),
            ("fused_perm_d64w4", C(decode="fused")),
            ("fused_perm_d64w4_sk2", C(decode="fused", split_k_down=2)),
            ("fused_perm_d64w4_sk4", C(decode="fused", split_k_down=4)),
            ("fused_perm_d64w4_sk8", C(decode="fused", split_k_down=8)),
            ("fused_perm_d128w8_sk4", C(decode="fused", block_n_down=128, num_warps_down=8,
                                        split_k_down=4)),
            ("fused_shuf_d64w4_sk4", C(decode="fused", x_layout="shuffle", split_k_down=4)),
            ("fused_perm_d32w2_sk4", C(decode="fused", block_n_down=32, num_warps_down=2,
                                       split_k_down=4)),
        ],
        # an i32 sweep on the H200 put fused d32w2 sk4 at 70.5 us against the default's 76.7 (T=1), with
        # the default itself moving 72.8 -> 76.7 between runs: both timed twice, alternately
        "t1_pick": [
            ("default", None),
            ("fused_perm_d32w2_sk4", C(decode="fused", block_n_down=32, num_warps_down=2, split_k_down=4)),
            ("fused_perm_d64w4_sk2", C(decode="fused", split_k_down=2)),
            ("default_again", C()),
            ("fused_perm_d32w2_sk4_again", C(decode="fused", block_n_down=32, num_warps_down=2,
                                             split_k_down=4)),
            ("fused_perm_d64w4_sk2_again", C(decode="fused", split_k_down=2)),
        ],
        # (timed on the H200, not adopted) the two-launch path's down
        # kernel as stream-K (the T x 112 blocks' K loops cut into P equal shares; at T = 1 the 112
        # one-per-block programs leave 20 of the 132 SMs idle), against the default and the best split-K config
        "fused_stream": [
            ("default", None),
            ("fused_perm_d64w4_sk2", C(decode="fused", split_k_down=2)),
            ("fused_perm_d64w4_st132", C(decode="fused", stream_k_down=132)),
            ("fused_perm_d64w4_st264", C(decode="fused", stream_k_down=264)),
            ("fused_perm_d32w2_st264", C(decode="fused", block_n_down=32, num_warps_down=2,
                                         stream_k_down=264)),
            ("fused_perm_d64w4_st528", C(decode="fused", stream_k_down=528)),
            ("default_again", C()),
            ("fused_perm_d64w4_st264_again", C(decode="fused", stream_k_down=264)),
        ],
        # (timed on the H200: slower; its own list because a kernel that waited forever would stall the
        # whole run): both phases in one launch, down programs waiting in-kernel for their h
        "chained": [
            ("default", None),
            ("fused_perm_d64w4", C(decode="fused")),
            ("chained_d64w4", C(decode="chained")),
            ("chained_d64w4_st132", C(decode="chained", stream_k_down=132)),
            ("chained_d64w4_st264", C(decode="chained", stream_k_down=264)),
            ("default_again", C()),
            ("chained_d64w4_again", C(decode="chained")),
        ],
        "small": [("default", None)],
        # the T = 1 candidates read by device time per kernel (--moe_profile)
        # instead of wall clock (T = 1 wall timings spread ~5%): which gate/up and which down kernel
        "t1_device": [
            ("default", None),
            ("fused_perm_d64w4_sk2", C(decode="fused", split_k_down=2)),
            ("fused_perm_d32w2_sk4", C(decode="fused", block_n_down=32, num_warps_down=2, split_k_down=4)),
            ("fused_perm_d64w4_st264", C(decode="fused", stream_k_down=264)),
            ("dk256", C(block_k_down=256)),
            ("gu32_d32_w2", C(block_n_gate_up=32, block_n_down=32, num_warps=2)),
            ("gu128_d128_w8", C(block_n_gate_up=128, block_n_down=128, num_warps=8)),
            ("guk1024_s4", C(block_k_gate_up=1024, num_stages=4)),
        ],
        # (compiled for sm_90 off-GPU: no spills; smem in KB) the fused path's
        # down kernel, whose programs at T = 1 are long (8 experts x 4 K steps, 112 programs, one per SM),
        # with deeper pipelines. 3 stages keep at most 2 x 16 KB of weights in flight per SM, which by
        # Little's law covers ~1 us of latency at an SM's ~38 GB/s share: one candidate for down's 67% of
        # copy (gate/up keeps 2 x 32 KB in flight and reaches ~83%). Against it: the default tiles path's
        # down (896 short programs, several resident per SM) is at the same 67%. Read by device time
        # (--moe_profile). Timed on the H200: deeper pipelines make the fused down no faster (31.2 ->
        # 31.3 / 37.7 us at 5 / 7 stages); none beats the default's 23.2 us down.
        "t1_down": [
            ("default", None),
            ("fused_perm_d64w4", C(decode="fused")),                                      # 53 KB
            ("fused_perm_d64w4_ds5", C(decode="fused", num_stages_down=5)),               # 106 KB
            ("fused_perm_d64w4_ds7", C(decode="fused", num_stages_down=7)),               # 160 KB
            ("fused_perm_d64w4_dk1024", C(decode="fused", block_k_down=1024)),            # 106 KB
            ("fused_perm_d128w8_ds4", C(decode="fused", block_n_down=128, num_warps_down=8,
                                        num_stages_down=4)),                              # 135 KB
            ("fused_perm_d64w4_ds5_st264", C(decode="fused", num_stages_down=5, stream_k_down=264)),
            ("default_again", C()),
        ],
        # ncu at T = 1 shows gate/up issue-latency bound (54% issue-active, 1.9 warps per
        # scheduler: 2 CTAs per SM, held there by 90 KB of shared memory and 162 registers). Configs with
        # more CTAs per SM (SASS for sm_90: regs / smem -> CTAs per SM): s2 168 / 45 KB -> 3;
        # gate/up K step 256: 167 / 45 KB (s3), 68 KB (s4) -> 3; K step 128: 72 / 34 KB (s4) -> 6.
        # Timed on the H200: every one slower at T = 1 and 16; the default stays.
        "t1_occ": [
            ("default", None),
            ("s2", C(num_stages=2)),
            ("guk256", C(block_k_gate_up=256)),
            ("guk256_s4", C(block_k_gate_up=256, num_stages=4)),
            ("guk128_s4", C(block_k_gate_up=128, num_stages=4)),
            ("guk128_s6", C(block_k_gate_up=128, num_stages=6)),
            ("default_again", C()),
        ],
        # gate and up rows in separate programs (`split_gate_up`): one weight stream
        # per program halves the registers and shared memory at the same K step (SASS for sm_90:
        # 128 regs / 53 KB -> 4 CTAs = 16 warps per SM, against 2 CTAs = 8 warps for the fused pair),
        # so the latency-bound dequantizer gets twice the warps to hide behind; silu(gate) * up then
        # runs as one small XLA op. bn32_w2: 128 / 35 KB -> 6 CTAs of 2 warps; bn128_w8: 128 / 90 KB
        # -> 2 CTAs of 8 warps.
        "t1_split": [
            ("default", None),
            ("split_gu", C(split_gate_up=True)),
            ("split_gu_bn32_w2", C(split_gate_up=True, block_n_gate_up=32, num_warps=2, num_warps_down=4)),
            ("split_gu_bn128_w8", C(split_gate_up=True, block_n_gate_up=128, num_warps=8, num_warps_down=4)),
            ("default_again", C()),
        ],
        # the single launch with its down phase reading moe_gmm.block_down's layout (`_blk`: each
        # program's D x BF slice one contiguous block). The single launch over the plain layout
        # (95-152 us at T = 1) reads BF/2 bytes of every 1 KB down row and 4-byte scale runs out of 32-byte
        # sectors (8x over-fetch on scales at BF = 64); blocked, every byte it reads is one it uses, and
        # the layer is one wave with no phase barrier. SASS for sm_90: f64 d256 168 regs / 90 KB
        # (2 CTAs per SM, 256 programs at T = 1); f128 w8 254 regs / 160 KB (1 CTA per SM, 128 programs).
        "single_blk": [
            ("default", None),
            ("single_f64_d256_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=256,
                                              single_reduce="relaxed")),
            ("single_f64_d512_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=512,
                                              single_reduce="relaxed")),
            ("single_f64_d128_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=128,
                                              single_reduce="relaxed")),
            ("single_f64_d256_atomic_blk", C(decode="single", block_n_gate_up=64, block_n_down=256)),
            ("single_f64_d256_store_blk", C(decode="single", block_n_gate_up=64, block_n_down=256,
                                            single_reduce="store")),
            ("single_f128_d512_w8_relaxed_blk", C(decode="single", block_n_gate_up=128, block_n_down=512,
                                                  num_warps=8, single_reduce="relaxed")),
            ("single_f64_d256_relaxed", C(decode="single", block_n_gate_up=64, block_n_down=256,
                                          single_reduce="relaxed")),
            ("default_again", C()),
        ],
        # expert parallelism's decode share (--moe_held_pairs=1: one pair per token held
        # here): the default gives a lone pair 32 gate/up and 112 down programs; configs with more programs
        # per pair (32-row gate/up, gate and up in separate programs, split-K down) and the single launch
        "ep1": [
            ("default", None),
            ("gu32_d32_w2", C(block_n_gate_up=32, block_n_down=32, num_warps=2)),
            ("split_gu_bn32_w2", C(split_gate_up=True, block_n_gate_up=32, num_warps=2, num_warps_down=4)),
            ("fused_perm_d32w2_sk4", C(decode="fused", block_n_down=32, num_warps_down=2, split_k_down=4)),
            ("single_f64_d512_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=512,
                                              single_reduce="relaxed")),
            ("default_again", C(num_warps=4)),
        ],
        # the EP decode share through dense-style programs per pair (`pairs_cta`: int4_matmul's 'cta'
        # program aimed at one expert's rows, R = 16 rows with the K split 4 ways, or 32 rows split 2
        # ways); pt8: the pair path up to 8 tokens. Timed on the H200 (BENCHMARKS.md, "INT4 experts under
        # expert parallelism"): one held pair 23.6 us against 45.8 for the pair tiles, so `default` (whose
        # config follows the held share) IS pairs_cta4 where <= 2 pairs are held (pairs_cta2 where 3-4
        # are: 4 held pairs 42.9 / 51.2 us against 51.5 / 53.5); `default_again` stays the pair tiles.
        # one TP8 shard's experts (--moe_intermediate=256: every expert held, 256 wide): the pair tiles give
        # T = 1 only 8 x 256/64 = 32 gate/up programs; narrower tiles, gate and up apart, and the
        # dense-style pair programs with the K split (more programs per pair)
        "tp8": [
            ("default", None),
            ("gu32_d32_w2", C(block_n_gate_up=32, block_n_down=32, num_warps=2)),
            ("gu16_w1_d64_w4", C(block_n_gate_up=16, num_warps=1, num_warps_down=4)),
            ("split_gu_bn32_w2", C(split_gate_up=True, block_n_gate_up=32, num_warps=2, num_warps_down=4)),
            ("pairs_cta4", C(pairs_cta=4, block_k_gate_up=256, block_k_down=256)),
            ("pairs_cta2", C(pairs_cta=2, block_k_gate_up=256, block_k_down=256)),
            ("pairs_cta4_pt8", C(pairs_cta=4, block_k_gate_up=256, block_k_down=256, pair_tiles_max_t=8)),
            ("fused_d32w2_sk4", C(decode="fused", block_n_gate_up=32, num_warps=2, block_n_down=32,
                                  num_warps_down=2, split_k_down=4)),
            ("default_again", C()),
        ],
        "ep1_cta": [
            ("default", None),
            ("pairs_cta4", C(pairs_cta=4, block_k_gate_up=256, block_k_down=256)),
            ("pairs_cta2", C(pairs_cta=2, block_k_gate_up=256, block_k_down=256)),
            ("pairs_cta4_pt8", C(pairs_cta=4, block_k_gate_up=256, block_k_down=256, pair_tiles_max_t=8)),
            ("pairs_cta4_s4", C(pairs_cta=4, block_k_gate_up=256, block_k_down=256, num_stages=4)),
            ("default_again", C(num_warps=4)),
        ],
        # longer down steps (d1024: 219 regs, 2 CTAs per SM), the first down
        # tile loaded before the gate/up loop (timed as `_pf`, 254 regs: 58.5 us at T = 1 against 57.2, so the
        # option was removed), gate/up K step 1024 with 2 stages, 8 warps on 128-wide slices; T = 1 and 2
        "single_blk2": [
            ("default", None),
            ("single_f64_d512_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=512,
                                              single_reduce="relaxed")),
            ("single_f64_d1024_relaxed_blk", C(decode="single", block_n_gate_up=64, block_n_down=1024,
                                               single_reduce="relaxed")),
            ("single_f64_d512_guk1024_s2_relaxed_blk", C(decode="single", block_n_gate_up=64,
                                                         block_n_down=512, block_k_gate_up=1024,
                                                         num_stages=2, single_reduce="relaxed")),
            ("single_f128_d1024_w8_relaxed_blk", C(decode="single", block_n_gate_up=128, block_n_down=1024,
                                                   num_warps=8, single_reduce="relaxed")),
            ("default_again", C()),
            ("single_f64_d512_relaxed_again_blk", C(decode="single", block_n_gate_up=64, block_n_down=512,
                                                    single_reduce="relaxed", num_warps=4)),
        ],
    }
    return sweeps[name]


# ---------------------------------------------------------------------------------------------
# sections

CEIL = {}


def section_info():
    import jax
    info = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(), "python": sys.version.split()[0]}
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            p = torch.cuda.get_device_properties(0)
            info["sms"] = p.multi_processor_count
            info["mem_gb"] = round(p.total_memory / 1e9, 1)
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"unavailable: {e}"
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    from pallas_kernels.int4 import tile as int4_tile
    info["multi_result_asm_fix"] = int4_tile.MULTI_RESULT_ASM_OK
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    log("info", info)
    record(section="info", **info)


def section_ceil():
    """Copy bandwidth (bytes read + written; the best of several copy kernels), read-only
    bandwidth, and the bf16 tensor-core rate (cuBLAS 8192^3)."""
    import torch
    import jax
    import jax.numpy as jnp
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    CEIL["copy_torch_u8_graph"] = 2 * n / time_torch_graph(lambda: dst.copy_(src), 1, reps=7)
    del src, dst
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    CEIL["copy_torch_f32_graph"] = 2 * n / time_torch_graph(lambda: dst.copy_(src), 1, reps=7)
    CEIL["add_torch_f32_graph"] = 2 * n / time_torch_graph(lambda: torch.add(src, 1.0, out=dst), 1,
                                                           reps=7)
    red = torch.empty((), device="cuda")
    CEIL["read_torch_sum"] = n / time_torch_graph(lambda: red.copy_(src.sum()), 1, reps=7)
    del src, dst
    xs = jax.random.bits(jax.random.PRNGKey(0), (n // 4,), jnp.uint32)
    f = jax.jit(lambda v: v ^ jnp.uint32(1))
    CEIL["copy_jax_xor"] = 2 * n / time_jax(f, (xs,), 1, inner=3)
    del xs
    # run 2 (2026-11-29): torch copy_ (memcpy node) 2.77 TB/s, torch add kernel 4.25 TB/s; take the best
    CEIL["copy_bw"] = max(v for k, v in CEIL.items() if k.startswith(("copy_", "add_")))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    CEIL["bf16_flops"] = 2 * 8192 ** 3 / time_torch_graph(lambda: torch.matmul(a, b, out=c), 1, reps=7)
    del a, b, c
    # same-size copies (launch-gap-limited): 64 rotating copies of a gate+up- / down-sized weight
    for nm, nbytes in (("copy64x_16.5MB", 4096 * 7168 // 2 + 4096 * 224 * 2),
                       ("copy64x_8.3MB", 7168 * 2048 // 2 + 7168 * 64 * 2)):
        srcs = [torch.randn(nbytes // 4, device="cuda") for _ in range(64)]
        dsts = [torch.empty_like(s) for s in srcs]
        CEIL[nm] = 2 * nbytes / time_torch_graph(lambda: [torch.add(s, 1.0, out=d)
                                                          for d, s in zip(dsts, srcs)], 64)
        del srcs, dsts
    torch.cuda.empty_cache()
    log("ceilings", {k: f"{v / 1e12:.3f}T" for k, v in CEIL.items()})
    record(section="ceil", **CEIL)


def _rel(a, b):
    import jax.numpy as jnp
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# A config whose programs wait on each other in-kernel (decode='chained') is checked this many times:
# a missing memory order would show as an intermittent wrong answer, not a crash.
CHAINED_CHECK_REPEATS = 20


def _moe_check(mg, x, idx, w, g, u, dn, cfg, ref):
    """(max relative error over the repeats, all finite) of moe_experts against ref."""
    import jax.numpy as jnp
    reps = CHAINED_CHECK_REPEATS if cfg is not None and cfg.decode == "chained" else 1
    err, fin = 0.0, True
    for _ in range(reps):
        y = mg.moe_experts(x, idx, w, *g, *u, *dn, config=cfg)
        err, fin = max(err, _rel(y, ref)), fin and bool(jnp.isfinite(y).all())
    return err, fin


def section_check():
    """GPU correctness vs float32 references (fresh random inputs, several shapes and configs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.int4 import matmul as im
    from pallas_kernels.int4 import reference as int4_ref
    from pallas_kernels.int4 import moe_gmm as mg
    key = jax.random.PRNGKey(int(time.time()))
    ok = True
    dense_cfgs = [c for _, c in dense_sweep(FLAGS.dense_configs, 1024)]
    dense_shapes = [(1, 512, 1024), (7, 512, 1024), (16, 4096, 7168), (129, 512, 1024),
                    (1, 7168, 2048), (300, 1024, 2048)]
    if FLAGS.dry:
        dense_shapes = [(1, 256, 512), (7, 256, 512)]
    for (m, n, k) in dense_shapes:
        p, s = int4_ref.random_int4(jax.random.fold_in(key, m * 7 + n), (n, k))
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
        ref = im.int4_matmul_reference(x, p, s)
        cfgs = ([c for _, c in dense_sweep(FLAGS.dense_configs, k)]
                if (m, n, k) in ((16, 4096, 7168), (7, 512, 1024), (1, 7168, 2048)) else [None])
        for cfg in cfgs:
            try:
                y16 = im.int4_matmul(x, im.repack(p), s, config=cfg)
                err = _rel(y16, ref)
                if cfg is None:
                    y = im.int4_matmul(x, p, s, config=cfg)
                    err = max(err, _rel(y, ref))
                fin = bool(jnp.isfinite(y16).all())
                good = fin and err < 1e-2
            except Exception as e:  # noqa: BLE001
                err, fin, good = f"{type(e).__name__}: {str(e)[:300]}", False, False
            ok &= good
            record(section="check", op="int4_matmul", shape=(m, n, k), config=str(cfg), err=err,
                   finite=fin, ok=good)
            if not good:
                log("CHECK FAIL dense", (m, n, k), cfg, err)
    # MoE, small expert count, odd group sizes, empty experts, all tokens on one expert
    e_, d, f = (12, 512, 256) if FLAGS.dry else (12, 1024, 512)
    g = int4_ref.random_int4(jax.random.fold_in(key, 11), (e_, f, d))
    u = int4_ref.random_int4(jax.random.fold_in(key, 12), (e_, f, d))
    dn = int4_ref.random_int4(jax.random.fold_in(key, 13), (e_, d, f))
    moe_named = moe_sweep(FLAGS.moe_configs)[1:]
    for t in ((1, 7) if FLAGS.dry else [int(v) for v in FLAGS.check_tokens]):
        x = jax.random.normal(jax.random.fold_in(key, 100 + t), (t, d), jnp.bfloat16)
        for mode in ("random", "one_expert"):
            if mode == "random":
                idx = jax.vmap(lambda kk: jax.random.permutation(kk, e_ - 3)[:8])(
                    jax.random.split(jax.random.fold_in(key, 200 + t), t)).astype(jnp.int32)
            else:
                idx = jnp.full((t, 8), 5, jnp.int32)
            w = jax.random.uniform(jax.random.fold_in(key, 300 + t), (t, 8))
            ref = mg.moe_experts_reference(x, idx, w, *g, *u, *dn)
            cfgs = [("default", None), ("f32", mg.MoeGmmConfig(dequant="f32"))]
            if t in (3, 7) and mode == "random":      # t=3: the decode (T <= 4) paths
                cfgs += [(n, c) for n, c in moe_named       # block_down's layout: decode-path sizes only
                         if not (n.endswith(BLOCKED_SUFFIX) and t > c.pair_tiles_max_t)]
            blocked = {}
            for cname, cfg in cfgs:
                try:
                    err, fin = _moe_check(mg, x, idx, w, g, u, down_for(cname, cfg, dn, blocked), cfg, ref)
                    good = fin and err < 1e-2
                except Exception as ex:  # noqa: BLE001
                    err, fin, good = f"{type(ex).__name__}: {str(ex)[:300]}", False, False
                ok &= good
                record(section="check", op="moe_experts", shape=(t, e_, d, f), mode=mode,
                       config=str(cfg), err=err, finite=fin, ok=good)
                if not good:
                    log("CHECK FAIL moe", t, mode, cfg, err)
    sizes = jnp.array([3, 0, 17, 1, 0, 2, 0, 0, 9, 1, 0, 40], jnp.int32)
    xs = jax.random.normal(jax.random.fold_in(key, 77), (int(sizes.sum()), d), jnp.bfloat16)
    ref = mg.grouped_int4_matmul_reference(xs, sizes, *g)
    y = mg.grouped_int4_matmul(xs, sizes, *g)
    err = _rel(y, ref)
    ok &= err < 1e-2
    record(section="check", op="grouped_int4_matmul", err=err, ok=err < 1e-2)
    # Kimi-shaped MoE (384 experts) at T=4 against a reference on the touched experts
    e_, d, f = (24, 512, 256) if FLAGS.dry else (384, 7168, 2048)
    g = int4_ref.random_int4(jax.random.fold_in(key, 21), (e_, f, d))
    u = int4_ref.random_int4(jax.random.fold_in(key, 22), (e_, f, d))
    dn = int4_ref.random_int4(jax.random.fold_in(key, 23), (e_, d, f))
    t = 4
    x = jax.random.normal(jax.random.fold_in(key, 24), (t, d), jnp.bfloat16)
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, e_)[:8])(
        jax.random.split(jax.random.fold_in(key, 25), t)).astype(jnp.int32)
    w = jax.random.uniform(jax.random.fold_in(key, 26), (t, 8))
    ref = mg.moe_experts_reference(x, idx, w, *g, *u, *dn)
    blocked = {}
    for cname, cfg in [("default", None)] + moe_named:  # every swept config at the Kimi shape
        try:
            err, fin = _moe_check(mg, x, idx, w, g, u, down_for(cname, cfg, dn, blocked), cfg, ref)
            good = fin and err < 1e-2
        except Exception as ex:  # noqa: BLE001
            err, good = f"{type(ex).__name__}: {str(ex)[:300]}", False
        ok &= good
        record(section="check", op="moe_experts_kimi", shape=(t, e_, d, f), config=str(cfg),
               err=err, ok=good)
        if not good:
            log("CHECK FAIL moe kimi", cfg, err)
    log("check: all ok" if ok else "check: FAILURES (see results.jsonl)")
    record(section="check_summary", ok=ok)


def _torch_int4pack(p_jax, s_jax):
    """Our packed int32 [N, K/8] + scale [N, K/32] -> tinygemm (gpt-fast) int4pack + scales_and_zeros."""
    import torch
    p = torch.from_dlpack(p_jax)
    s = torch.from_dlpack(s_jax)
    n, kw = p.shape
    shifts = torch.arange(0, 32, 4, device=p.device, dtype=torch.int32)
    u = ((p[:, :, None] >> shifts) & 0xF).reshape(n, kw * 8)           # [N, K] in 0..15 (q + 8)
    u8 = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)
    wp = torch._convert_weight_to_int4pack(u8.contiguous(), 8)
    sz = torch.stack([s.to(torch.bfloat16), torch.zeros_like(s, dtype=torch.bfloat16)], dim=2)
    sz = sz.transpose(0, 1).contiguous()                                # [K/32, N, 2]
    return wp, sz


def section_dense():
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4 import matmul as im
    from pallas_kernels.int4 import reference as int4_ref
    nm = FLAGS.num_mats
    passes = 1
    key = jax.random.PRNGKey(1)
    copy_bw = CEIL.get("copy_bw")
    shapes = (("gate_up", 4096, 7168), ("down", 7168, 2048))
    if FLAGS.dry:
        shapes = (("gate_up", 256, 512), ("down", 512, 256))
    for shape_name, n, k in shapes:
        if time.time() - _T0 > FLAGS.budget_s:
            log("budget exhausted; skipping dense", shape_name)
            break
        ws = [int4_ref.random_int4(jax.random.fold_in(key, 1000 * n + i), (n, k)) for i in range(nm)]
        ps = [w[0] for w in ws]
        ss = [w[1] for w in ws]
        ps16 = [im.repack(p) for p in ps]
        wbytes = n * k // 2 + n * (k // 32) * 2
        # the ceiling of this harness at this size: nm rotated `x ^ 1` copies moving wbytes each
        # (read + write), timed exactly like the kernels (one jit, enqueued back to back)
        srcs = [jax.random.bits(jax.random.fold_in(key, 90000 + i), (wbytes // 8,), jnp.uint32)
                for i in range(nm)]
        copy_fn = jax.jit(lambda vs: [v ^ jnp.uint32(1) for v in vs])
        t = time_jax(copy_fn, (srcs,), nm)
        record(section="dense", case=f"dense {shape_name}", impl="copy_same_size", t=t,
               bytes=wbytes, gbps=wbytes / t / 1e9)
        log(f"dense {shape_name}", "same-size copy", f"{t * 1e6:.2f}us", f"{wbytes / t / 1e9:.0f}GB/s")
        if FLAGS.dense_profile:
            # the floor of any op that reads these bytes, by device time like the kernels' rows: the
            # same-size copy (reads and writes wbytes) and a same-size read (an XLA sum: reads wbytes)
            _profile_ops(f"dense {shape_name}", copy_fn, (srcs,), nm, t, section="dense_profile",
                         config="copy_same_size")
            read_fn = jax.jit(lambda vs: [jnp.sum(v, dtype=jnp.uint32) for v in vs])
            t_read = time_jax(read_fn, (srcs,), nm)
            record(section="dense", case=f"dense {shape_name}", impl="read_same_size", t=t_read,
                   bytes=wbytes, gbps=wbytes / t_read / 1e9)
            _profile_ops(f"dense {shape_name}", read_fn, (srcs,), nm, t_read, section="dense_profile",
                         config="read_same_size")
        del srcs
        for m in [int(v) for v in FLAGS.ms]:
            xs = [jax.random.normal(jax.random.fold_in(key, 7 + j), (m, k), jnp.bfloat16)
                  for j in range(passes * nm)]     # a distinct activation for every call
            nbytes = wbytes + m * k * 2 + m * n * 2
            flops = 2 * m * n * k
            case = f"dense {shape_name} M={m}"

            def run_ours(cfg, packed, gpu):
                fn = jax.jit(lambda xs, ps, ss: [
                    im.int4_matmul(xs[c], ps[c % nm], ss[c % nm], config=cfg)
                    for c in range(passes * nm)])
                return fn, time_jax(fn, (xs, packed, ss), passes * nm, gpu=gpu)

            for cname, cfg in dense_sweep(FLAGS.dense_configs, k):
                for layout, packed in (("i16", ps16), ("i32", ps)):
                    if layout not in FLAGS.sweep_layouts and cname != "default":
                        continue
                    try:
                        gpu = {}
                        fn, t = run_ours(cfg, packed, gpu)
                        if FLAGS.dense_profile and layout == "i32":
                            _profile_ops(case, fn, (xs, packed, ss), passes * nm, t, section="dense_profile",
                                         config=cname)
                        row = dict(section="dense", case=case, impl="pallas", config=cname,
                                   layout=layout, t=t, bytes=nbytes, flops=flops, gpu=gpu,
                                   gbps=nbytes / t / 1e9,
                                   pct_copy=(nbytes / t / copy_bw * 100) if copy_bw else None)
                        record(**row)
                        log(case, cname, layout, f"{t * 1e6:.2f}us", f"{nbytes / t / 1e9:.0f}GB/s")
                    except Exception as e:  # noqa: BLE001
                        record_failure("dense", case, cname, layout, e)
            if not FLAGS.baselines:
                continue
            # XLA bf16 matmul (rotating bf16 weights) and XLA's dequant path
            try:
                wb = [jax.random.normal(jax.random.fold_in(key, 50000 + i), (n, k), jnp.bfloat16)
                      for i in range(nm)]
                fn = jax.jit(lambda xs, wb: [jnp.einsum("mk,nk->mn", xs[c], wb[c % nm],
                                                        preferred_element_type=jnp.float32
                                                        ).astype(jnp.bfloat16)
                                             for c in range(passes * nm)])
                t = time_jax(fn, (xs, wb), passes * nm)
                record(section="dense", case=case, impl="xla_bf16", t=t,
                       bytes=n * k * 2 + m * k * 2 + m * n * 2, flops=flops)
                log(case, "xla_bf16", f"{t * 1e6:.2f}us")
                if FLAGS.dense_profile:
                    _profile_ops(case, fn, (xs, wb), passes * nm, t, section="dense_profile", config="xla_bf16")
                # cuBLAS bf16 (torch), same weights through dlpack
                import torch
                tw = [torch.from_dlpack(w) for w in wb]
                tx = torch.from_dlpack(xs[0])
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in tw]
                t = time_torch_graph(lambda: [torch.matmul(tx, w.t(), out=o)
                                              for w, o in zip(tw, outs)], nm)
                record(section="dense", case=case, impl="cublas_bf16", t=t,
                       bytes=n * k * 2 + m * k * 2 + m * n * 2, flops=flops)
                log(case, "cublas_bf16", f"{t * 1e6:.2f}us")
                del wb, tw, outs
            except Exception as e:  # noqa: BLE001
                log(case, "bf16 baselines FAILED", type(e).__name__, str(e)[:500])
            try:
                fn = jax.jit(lambda xs, ps, ss: [jnp.einsum(
                    "mk,nk->mn", xs[c], int4_ref.dequantize(ps[c % nm], ss[c % nm], jnp.bfloat16),
                    preferred_element_type=jnp.float32).astype(jnp.bfloat16)
                    for c in range(passes * nm)])
                t = time_jax(fn, (xs, ps, ss), passes * nm, inner=2, reps=3)
                record(section="dense", case=case, impl="xla_dequant", t=t, bytes=nbytes, flops=flops)
                log(case, "xla_dequant", f"{t * 1e6:.2f}us")
            except Exception as e:  # noqa: BLE001
                log(case, "xla_dequant FAILED", type(e).__name__, str(e)[:500])
            try:
                import torch
                tp = [_torch_int4pack(p, s) for p, s in zip(ps, ss)]
                tx = torch.from_dlpack(xs[0])
                # correctness of the torch path (our packing into tinygemm layout)
                yt = torch._weight_int4pack_mm(tx, tp[0][0], 32, tp[0][1])
                ref = im.int4_matmul_reference(xs[0], ps[0], ss[0])
                terr = _rel(jnp.asarray(jax.dlpack.from_dlpack(yt)), ref)
                t = time_torch_graph(lambda: [torch._weight_int4pack_mm(tx, wp, 32, sz)
                                              for wp, sz in tp], nm)
                record(section="dense", case=case, impl="torch_int4", t=t, bytes=nbytes,
                       flops=flops, err=terr)
                log(case, "torch_int4", f"{t * 1e6:.2f}us", f"err={terr:.2e}")
                del tp
            except Exception as e:  # noqa: BLE001
                log(case, "torch_int4 FAILED", type(e).__name__, str(e)[:500])
        del ws, ps, ss, ps16


def _routing(key, t, e_, topk):
    import jax
    import jax.numpy as jnp
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, e_)[:topk])(jax.random.split(key, t))
    w = jax.random.uniform(jax.random.fold_in(key, 1), (t, topk), minval=0.1, maxval=1.0)
    return idx.astype(jnp.int32), w / w.sum(-1, keepdims=True)


def _profile_ops(case, fn, args, calls, wall_t, section="moe_profile", **extra):
    """Where a MoE (or, section 'dense_profile', a dense) call's time goes: device us per op (by kernel),
    their sum, the span from the first op's start to the last op's end per call, and the gaps (span - ops:
    launch boundaries, ramps)."""
    from kimi_jax.tools import profiling
    per_op, span, tdir = profiling.device_ops_per_call(fn.lower(*args).compile(), args, calls)
    busy = sum(per_op.values())
    record(section=section, case=case, ops_us=per_op, busy_us=busy, span_us=span,
           wall_us=wall_t * 1e6, trace_dir=tdir, **extra)
    log(case, extra.get("config", ""), f"profile: wall {wall_t * 1e6:.1f} us/call, device span {span:.1f}, "
              f"ops {busy:.1f}, gaps {span - busy:.1f}")
    for name, us in list(per_op.items())[:8]:
        log(f"    {us:8.1f} us  {name[:110]}")


def section_moe():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax.tools import telemetry
    from pallas_kernels.int4 import reference as int4_ref
    from pallas_kernels.int4 import moe_gmm as mg
    e_, d, f, topk = (24, 512, 256, KIMI_TOPK) if FLAGS.dry else (FLAGS.moe_experts, 7168, FLAGS.moe_intermediate,
                                                                       KIMI_TOPK)
    key = jax.random.PRNGKey(2)
    g = int4_ref.random_int4(jax.random.fold_in(key, 1), (e_, f, d))
    u = int4_ref.random_int4(jax.random.fold_in(key, 2), (e_, f, d))
    dn = int4_ref.random_int4(jax.random.fold_in(key, 3), (e_, d, f))
    g16, u16, dn16 = [(mg.repack(p), s) for p, s in (g, u, dn)]
    per_expert = 3 * (f * d // 2 + f * (d // 32) * 2)
    copy_bw, peak = CEIL.get("copy_bw"), CEIL.get("bf16_flops")
    R = FLAGS.rotations
    wb = None
    blocked = {}                  # block_down's layouts of dn (i32 words), one per swept F slice width
    for t in [int(v) for v in FLAGS.batches]:
        if time.time() - _T0 > FLAGS.budget_s:
            log("budget exhausted; skipping moe T =", t)
            break
        held = FLAGS.moe_held_pairs or topk
        case = (f"moe T={t}" + (f" E={e_}" if FLAGS.moe_experts != KIMI_EXPERTS else "")
                + (f" held={held}/{topk}" if held < topk else ""))
        x = jax.random.normal(jax.random.fold_in(key, 10 + t), (t, d), jnp.bfloat16)
        routes = [_routing(jax.random.fold_in(key, 1000 * t + r), t, e_, topk) for r in range(R)]
        if held < topk:     # expert parallelism: pairs held elsewhere carry id E (skipped by the kernels)
            routes = [(i.at[:, held:].set(e_), w) for i, w in routes]
        touched = float(np.mean([np.unique(np.asarray(i)[np.asarray(i) < e_]).size for i, _ in routes]))
        nbytes = touched * per_expert + t * d * 2 * 2 + t * held * (f * 2 * 2 + d * 4)
        flops = 2 * t * held * 3 * f * d
        roof_bw = nbytes / copy_bw if copy_bw else None
        roof = max(roof_bw, flops / peak) if (copy_bw and peak) else roof_bw
        for cname, cfg in moe_sweep(FLAGS.moe_configs):
            if cname == "bm8_sorted_always" and t > 4:
                continue
            if cname.startswith(("fused", "single")) and t > (cfg.pair_tiles_max_t if cfg else 4):
                continue        # the fused decode path does not apply: same kernels as default
            for layout, (gg, uu, dd) in (("i16", (g16, u16, dn16)), ("i32", (g, u, dn))):
                if layout not in FLAGS.sweep_layouts and cname != "default":
                    continue
                if cname.endswith(BLOCKED_SUFFIX):
                    if layout != "i32":
                        continue
                    dd = down_for(cname, cfg, dn, blocked)
                try:
                    fn = jax.jit(lambda x, routes, gg, uu, dd, cfg=cfg: [
                        mg.moe_experts(x, i, w, *gg, *uu, *dd, config=cfg, held_share=held / topk)
                        for i, w in routes])
                    gpu = {}
                    tm = time_jax(fn, (x, routes, gg, uu, dd), R, gpu=gpu)
                    record(section="moe", case=case, impl="pallas", config=cname, layout=layout,
                           t=tm, bytes=nbytes, flops=flops, touched=touched, gpu=gpu,
                           gbps=nbytes / tm / 1e9, roofline_t=roof,
                           ratio_roof=(tm / roof) if roof else None,
                           pct_copy=(nbytes / tm / copy_bw * 100) if copy_bw else None)
                    log(case, cname, layout, f"{tm * 1e6:.1f}us", f"touched={touched:.1f}",
                        f"x{tm / roof:.2f} of roofline" if roof else "",
                        f"(GPU: {telemetry.describe(gpu)})" if gpu.get("samples") else "")
                    if FLAGS.moe_profile and layout == "i32":
                        _profile_ops(case, fn, (x, routes, gg, uu, dd), R, tm)
                except Exception as ex:  # noqa: BLE001
                    record_failure("moe", case, cname, layout, ex)
        if not FLAGS.baselines or held < topk:
            continue
        # kernel-only time of the default config (no routing plan / combine): grouped gate/up+down
        # is not separable without internals; skipped.
        # XLA dequant path (what kimi_jax.ops does off-GPU): dequantize all experts + ragged_dot
        reps_heavy = 3 if t <= 64 else 2
        try:
            if t > 64:   # dense-expanded ragged_dot over 384 dequantized experts: 45 GB temp (OOM)
                raise MemoryError("skipped: needs > 45 GB of temporaries (OOM in run 1)")

            def xla_path(x, idx, w, g, u, dn):
                tk = idx.size
                flat = idx.reshape(-1)
                order = jnp.argsort(flat, stable=True)
                xs = x[order // topk]
                sizes = jnp.bincount(flat, length=e_).astype(jnp.int32)

                def gmm(lhs, wq):
                    wd = jnp.swapaxes(int4_ref.dequantize(wq[0], wq[1], jnp.bfloat16), 1, 2)
                    return jax.lax.ragged_dot(lhs, wd, sizes, preferred_element_type=jnp.float32)
                h = (jax.nn.silu(gmm(xs, g)) * gmm(xs, u)).astype(x.dtype)
                ys = gmm(h, dn)
                ws = w.reshape(-1)[order]
                return jnp.zeros((x.shape[0], d), jnp.float32).at[order // topk].add(
                    ys * ws[:, None]).astype(x.dtype)
            fn = jax.jit(lambda x, routes, g, u, dn: [xla_path(x, i, w, g, u, dn)
                                                      for i, w in routes[:2]])
            tm = time_jax(fn, (x, routes, g, u, dn), 2, inner=1, reps=reps_heavy)
            record(section="moe", case=case, impl="xla_dequant_ragged", t=tm, bytes=nbytes,
                   flops=flops)
            log(case, "xla_dequant_ragged", f"{tm * 1e6:.1f}us")
        except Exception as ex:  # noqa: BLE001
            log(case, "xla_dequant_ragged FAILED", type(ex).__name__, str(ex)[:500])
        try:
            if wb is None:
                wb = [jax.random.normal(jax.random.fold_in(key, 90 + i), shp, jnp.bfloat16)
                      for i, shp in enumerate([(e_, d, f), (e_, d, f), (e_, f, d)])]

            def ragged_bf16(x, idx, w, wg, wu, wd):
                flat = idx.reshape(-1)
                order = jnp.argsort(flat, stable=True)
                xs = x[order // topk]
                sizes = jnp.bincount(flat, length=e_).astype(jnp.int32)
                rd = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)
                h = (jax.nn.silu(rd(xs, wg)) * rd(xs, wu)).astype(x.dtype)
                ys = rd(h, wd)
                ws = w.reshape(-1)[order]
                return jnp.zeros((x.shape[0], d), jnp.float32).at[order // topk].add(
                    ys * ws[:, None]).astype(x.dtype)
            fn = jax.jit(lambda x, routes, wb: [ragged_bf16(x, i, w, *wb) for i, w in routes[:2]])
            tm = time_jax(fn, (x, routes, wb), 2, inner=1, reps=reps_heavy)
            record(section="moe", case=case, impl="ragged_dot_bf16", t=tm,
                   bytes=touched * 3 * f * d * 2, flops=flops)
            log(case, "ragged_dot_bf16", f"{tm * 1e6:.1f}us")
        except Exception as ex:  # noqa: BLE001
            log(case, "ragged_dot_bf16 FAILED", type(ex).__name__, str(ex)[:500])
        # torch baselines: per-active-expert loops (int4 tinygemm, cuBLAS bf16), CUDA-graph captured
        try:
            import torch
            tx = torch.from_dlpack(x)
            plans = []
            for idx, w in routes:
                idx_np, w_np = np.asarray(idx), np.asarray(w)
                plan = []
                for e in np.unique(idx_np):
                    tok, kpos = np.nonzero(idx_np == e)
                    plan.append((int(e), torch.tensor(tok, device="cuda"),
                                 torch.tensor(w_np[tok, kpos], device="cuda",
                                              dtype=torch.bfloat16)[:, None]))
                plans.append(plan)
            experts_used = sorted({e for plan in plans for e, _, _ in plan})
            tb = [torch.from_dlpack(a) for a in wb]
            out = torch.zeros(t, d, device="cuda", dtype=torch.bfloat16)

            def moe_loop(mm_gu, mm_d, key_g, key_u, key_d):
                out.zero_()
                for plan in plans:
                    for e, tok, wt in plan:
                        xe = tx.index_select(0, tok)
                        h = torch.nn.functional.silu(mm_gu(xe, key_g, e)) * mm_gu(xe, key_u, e)
                        out.index_add_(0, tok, mm_d(h, key_d, e) * wt)
            bf = lambda a, which, e: torch.matmul(a, tb[which][e])
            tm = time_torch_graph(lambda: moe_loop(bf, bf, 0, 1, 2), R, replays=2)
            record(section="moe", case=case, impl="cublas_bf16_loop", t=tm,
                   bytes=touched * 3 * f * d * 2, flops=flops)
            log(case, "cublas_bf16_loop", f"{tm * 1e6:.1f}us")
            tp = {}
            for e in experts_used:
                tp[(0, e)] = _torch_int4pack(g[0][e], g[1][e])
                tp[(1, e)] = _torch_int4pack(u[0][e], u[1][e])
                tp[(2, e)] = _torch_int4pack(dn[0][e], dn[1][e])
            i4 = lambda a, which, e: torch._weight_int4pack_mm(a, tp[(which, e)][0], 32,
                                                                tp[(which, e)][1])
            tm = time_torch_graph(lambda: moe_loop(i4, i4, 0, 1, 2), R, replays=2)
            record(section="moe", case=case, impl="torch_int4_loop", t=tm, bytes=nbytes, flops=flops)
            log(case, "torch_int4_loop", f"{tm * 1e6:.1f}us")
            del tp, plans
            torch.cuda.empty_cache()
        except Exception as ex:  # noqa: BLE001
            log(case, "torch MoE baselines FAILED", type(ex).__name__, str(ex)[:500])
            traceback.print_exc()


# ---------------------------------------------------------------------------------------------
# table

def print_table():
    from kimi_jax.tools import telemetry
    copy_bw = CEIL.get("copy_bw")
    rows = [r for r in RESULTS if r.get("section") in ("dense", "moe") and "t" in r]
    cases = []
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
    lines = []
    hdr = ("| case | best config | time us | MB moved | GFLOP | GB/s | % copy | x roofline | "
           "vs XLA bf16 | vs XLA dequant | vs ragged_dot bf16 | vs torch int4 | vs cuBLAS bf16 | "
           "SM clock, power while timed |")
    lines.append(hdr)
    lines.append("|" + "---|" * 14)
    for c in cases:
        ours = [r for r in rows if r["case"] == c and r["impl"] == "pallas"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["t"])
        base = {r["impl"]: r["t"] for r in rows if r["case"] == c and r["impl"] != "pallas"}

        def ratio(*names):
            for nm in names:
                if nm in base:
                    return f"{base[nm] / best['t']:.2f}x"
            return "-"
        roof = best.get("ratio_roof")
        lines.append(
            f"| {c} | {best['config']}/{best.get('layout', '')} | {best['t'] * 1e6:.1f} | "
            f"{best['bytes'] / 1e6:.1f} | {best['flops'] / 1e9:.2f} | {best['bytes'] / best['t'] / 1e9:.0f} | "
            f"{(best['bytes'] / best['t'] / copy_bw * 100) if copy_bw else float('nan'):.0f}% | "
            f"{f'{roof:.2f}' if roof else '-'} | {ratio('xla_bf16')} | "
            f"{ratio('xla_dequant', 'xla_dequant_ragged')} | {ratio('ragged_dot_bf16')} | "
            f"{ratio('torch_int4', 'torch_int4_loop')} | {ratio('cublas_bf16', 'cublas_bf16_loop')} | "
            f"{telemetry.describe(best.get('gpu') or {})} |")
    lines.append("")
    lines.append("All variants (us): " + "; ".join(
        f"{r['case']}|{r.get('impl')}|{r.get('config', '')}|{r.get('layout', '')}={r['t'] * 1e6:.1f}"
        for r in rows))
    txt = "\n".join(lines)
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "table.md"), "w") as f:
        f.write(txt + "\n")
    print(txt)


# the H200's ceilings (copy and bf16 matmul, measured 2026-11-29): % copy / x roofline when --sections
# leaves out ceil
RUN2_CEIL = {"copy_bw": 4.25e12, "bf16_flops": 760e12}


def run_int4():
    sections = {"info": section_info, "ceil": section_ceil, "check": section_check,
                "dense": section_dense, "moe": section_moe}
    if "ceil" not in FLAGS.sections and not FLAGS.dry:
        CEIL.update(RUN2_CEIL)
        log("ceil not run: using the H200 ceilings measured earlier", RUN2_CEIL)
    for name in FLAGS.sections:
        if time.time() - _T0 > FLAGS.budget_s and name not in ("info",):
            log("budget exhausted; skipping section", name)
            continue
        log("== section", name)
        try:
            sections[name]()
        except Exception as e:  # noqa: BLE001
            log("section", name, "FAILED", type(e).__name__, str(e)[:1000])
            traceback.print_exc()
    log("ceilings", {k: f"{v / 1e12:.3f}T" for k, v in CEIL.items()})
    print_table()


def main(argv):
    del argv
    bad = [v for v in FLAGS.sweep_layouts if v not in ("i16", "i32")]
    if bad:
        raise app.UsageError(f"--sweep_layouts: {bad[0]!r} is not i16 or i32")
    if FLAGS.moe_experts < KIMI_TOPK:
        raise app.UsageError(f"--moe_experts={FLAGS.moe_experts}: fewer routed experts than top-{KIMI_TOPK}")
    if not 0 <= FLAGS.moe_held_pairs <= KIMI_TOPK:
        raise app.UsageError(f"--moe_held_pairs={FLAGS.moe_held_pairs}: not between 0 (all) and {KIMI_TOPK}")
    run_int4()


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench int4", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
