"""Off-GPU tuning aid: lower the INT4 kernels to Triton IR for CUDA on a CPU machine, compile them for
sm_90 with a local `triton` wheel (it ships ptxas/nvdisasm/cuobjdump) and print registers, shared
memory, spills and the SASS instruction mix. No GPU needed.

  pip install --target /tmp/tritonlib triton==3.6.0          # once (matches the GPU image)
  JAX_PLATFORMS=cpu PYTHONPATH=. python -m pallas_kernels.mla.sass_probe --triton_path=/tmp/tritonlib \\
      --op=moe --t=16          # or --op=dense --m=1 --n=4096 --k=7168
      # or --op=mla --heads=8 --batch=8 --context=32768 (the Triton MLA decode and finish kernels)

"alu/word" = ALU+FMA-pipe instructions in the whole kernel / packed words each thread dequantizes
per K step; the main loop alone costs ~23 per word (15 of them the dequantizer). A config whose
MMA layout replicates the weight operand across warps shows ~2x that (a weight dequantized twice).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("triton_path", "/tmp/tritonlib", "directory holding a `triton` package")
flags.DEFINE_string("op", "moe", "moe | dense | mla (the Triton MLA decode kernel and the finish kernel)")
flags.DEFINE_integer("heads", 8, "mla: query heads per device")
flags.DEFINE_integer("batch", 8, "mla: batch rows")
flags.DEFINE_integer("context", 32768, "mla: cached tokens per row")
flags.DEFINE_integer("t", 16, "MoE tokens")
flags.DEFINE_integer("m", 1, "dense rows")
flags.DEFINE_integer("n", 4096, "dense N")
flags.DEFINE_integer("k", 7168, "dense K")
flags.DEFINE_string("moe_config", "", "moe: MoeGmmConfig fields as JSON (default: the automatic config), e.g. "
                    "'{\"decode\": \"fused\", \"num_stages_down\": 5}'")
flags.DEFINE_string("dense_config", "", "dense: Int4MatmulConfig fields as JSON (default: default_config), e.g. "
                    "'{\"split_k\": 4, \"split_reduce\": \"cta\", \"swap_ab\": true, \"block_n\": 64}'")
flags.DEFINE_bool("blocked_down", False, "moe, decode='single': the down weight in moe_gmm.block_down's layout "
                  "(F slices of block_n_gate_up)")
flags.DEFINE_string("workdir", "", "where to keep .ttir/.ptx/.cubin/.sass (default: a temp dir)")

_COMPILE = r'''
import sys, triton
from triton.compiler import compile as tcompile
from triton.backends.compiler import GPUTarget
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = tcompile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
base = path.rsplit(".", 1)[0]
for key in ("ttgir", "ptx"):
    open(base + "." + key, "w").write(k.asm[key])
open(base + ".cubin", "wb").write(k.asm["cubin"])
print(k.metadata.shared)
'''

_ALU = ("LOP3", "SHF", "PRMT", "HFMA2", "HMUL2", "IMAD", "IADD3", "FADD", "FMUL", "FFMA", "F2FP",
        "I2F", "LEA", "MOV", "SEL", "ISETP", "VIADD")


def lower_to_ttir(fn, args, workdir, name):
    """Trace fn for the cuda platform and write each Pallas kernel's Triton IR; returns paths."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg
    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def hook(*a, **k):
        res = orig(*a, **k)
        captured.append(res)
        return res
    reg.lowering.lower_jaxpr_to_triton_module = hook
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    paths = []
    for i, r in enumerate(captured):
        p = os.path.join(workdir, f"{name}_{i}.ttir")
        with open(p, "w") as f:
            f.write(str(r.module))
        paths.append(p)
    return paths


def sass_stats(ttir_path, num_warps, num_stages, words_per_thread, triton_path):
    env = {**os.environ, "PYTHONPATH": triton_path}
    r = subprocess.run([sys.executable, "-c", _COMPILE, ttir_path, str(num_warps), str(num_stages)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        return f"COMPILE FAILED: {r.stderr[-1500:]}"
    smem = r.stdout.strip().split()[-1]
    bind = os.path.join(triton_path, "triton", "backends", "nvidia", "bin")
    cubin = ttir_path.rsplit(".", 1)[0] + ".cubin"
    res = subprocess.run([os.path.join(bind, "cuobjdump"), "--dump-resource-usage", cubin],
                         capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    sass = subprocess.run([os.path.join(bind, "nvdisasm"), "-c", cubin],
                          capture_output=True, text=True).stdout
    with open(cubin[:-6] + ".sass", "w") as f:
        f.write(sass)
    ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)",
                                         sass))
    alu = sum(v for k, v in ops.items() if k in _ALU)
    top = " ".join(f"{k}:{v}" for k, v in ops.most_common(12))
    return (f"regs={regs.group(1) if regs else '?'} smem={smem} spills(STL)={ops['STL']} "
            f"mma={ops['HMMA'] + ops['HGMMA']} alu/word={alu / max(words_per_thread, 1):.1f}  {top}")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4 import matmul as im
    from pallas_kernels.int4 import moe_gmm as mg
    S = jax.ShapeDtypeStruct
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="sass_probe")
    os.makedirs(workdir, exist_ok=True)
    if FLAGS.op == "dense":
        m, n, k = FLAGS.m, FLAGS.n, FLAGS.k
        import json
        explicit = im.Int4MatmulConfig(**json.loads(FLAGS.dense_config)) if FLAGS.dense_config else None
        cfg = explicit or im.default_config(m, n, k)
        paths = lower_to_ttir(lambda x, p, s: im.int4_matmul(x, p, s, config=explicit, interpret=False),
                              (S((m, k), jnp.bfloat16), S((n, k // 8), jnp.int32),
                               S((n, k // 32), jnp.bfloat16)), workdir, "dense")
        wpt = [cfg.block_n * cfg.block_k / 8 / (32 * cfg.num_warps)]
    elif FLAGS.op == "mla":
        from pallas_kernels.mla import decode as md
        from pallas_kernels.mla import finish as mf
        B, N, ctx, page = FLAGS.batch, FLAGS.heads, FLAGS.context, 16
        P = ctx // page
        cfg = md.resolve_config(md.MlaDecodeConfig(finish="kernel"), B, N, P * page)
        args = (S((B, 1, N, 512), jnp.bfloat16), S((B, 1, N, 64), jnp.bfloat16), S((B, 1, 576), jnp.bfloat16),
                S((B * P, page, 576), jnp.bfloat16), S((B, P), jnp.int32), S((B, 1), jnp.int32))
        paths = lower_to_ttir(lambda *a: md.mla_paged_attention(*a, 0.07, config=cfg, interpret=False), args,
                              workdir, "mla")
        wpt = [0, 0]       # no packed words: alu/word is meaningless here
        print("finish blocks (block_k, block_a):", mf._blocks(B * N, cfg.num_splits, 512))
    else:
        e_, d, f, t, kk = 384, 7168, 2048, FLAGS.t, 8
        import json
        explicit = mg.MoeGmmConfig(**json.loads(FLAGS.moe_config)) if FLAGS.moe_config else None
        cfg = explicit or mg.default_config(t * kk, e_)
        args = ([S((t, d), jnp.bfloat16), S((t, kk), jnp.int32), S((t, kk), jnp.float32)]
                + [S((e_, f, d // 8), jnp.int32), S((e_, f, d // 32), jnp.bfloat16)] * 2
                + [S((e_, d, f // 8), jnp.int32), S((e_, d, f // 32), jnp.bfloat16)])
        if FLAGS.blocked_down:
            bf = cfg.block_n_gate_up
            args[-2:] = [S((e_, f // bf, d, bf // 8), jnp.int32), S((e_, f // bf, d, bf // 32), jnp.bfloat16)]
        paths = lower_to_ttir(lambda *a: mg.moe_experts(*a, config=explicit, interpret=False), args, workdir,
                              "moe")
        warps_down = cfg.num_warps_down or cfg.num_warps
        wpt = [2 * cfg.block_n_gate_up * cfg.block_k_gate_up / 8 / (32 * cfg.num_warps),
               cfg.block_n_down * cfg.block_k_down / 8 / (32 * warps_down)]
    print("config:", cfg)
    # (warps, stages) per kernel: the MoE down kernel may have its own (num_warps_down / num_stages_down)
    launch = [(cfg.num_warps, cfg.num_stages)] * len(paths)
    if FLAGS.op == "moe" and len(paths) > 1:
        launch[1] = (cfg.num_warps_down or cfg.num_warps, cfg.num_stages_down or cfg.num_stages)
    for p, w, (warps, stages) in zip(paths, wpt, launch):
        print(os.path.basename(p), f"warps={warps} stages={stages}", sass_stats(p, warps, stages, w, FLAGS.triton_path))
    print("files in", workdir)


if __name__ == "__main__":
    app.run(main)
