"""Fresh-prefill attention on the GPU (issue #8): cuDNN flash attention vs the XLA einsum path.

    PYTHONPATH=. python -m launch.check_prefill --out=$OUT/prefill          # one H200, < 2 minutes
    PYTHONPATH=. python -m launch.check_prefill --out=/tmp/prefill --tiny   # CPU: small shapes, the
                                                                           # 'xla' stand-in for cuDNN

1. Op check and timing, Kimi shapes (64 heads, qk 192 = 128 nope + 64 rope, v 128, bf16), causal
   fresh prefills B x T in --cases (default 1x4096, 4x2048 with ragged rows, 1x16384, and 8x256 with
   ragged rows: the largest fresh step the engine took with its former default prefill_chunk=256):
   `ops.mla_prefill_attention`'s two paths, called directly: 'cudnn' (V zero-padded to 192, one
   jax.nn.dot_product_attention call) and 'einsum' (two einsums, masked float32 softmax, one einsum).
   Error: max |cudnn - reference| / max |reference| over the real tokens of two query slices (the
   first 256 and the last 512 queries of every row), the reference being the einsum path run on those
   slices only (the full einsum path at 16K needs ~128 GiB of scores and may not fit; its timing is
   then recorded as failed). bf16 tolerance --tol (default 2e-2: probabilities are rounded to bf16
   before the PV product in both paths). Also timed when available: cuDNN without the V padding
   (jax's private cuDNN entry point accepts qk 192 / v 128 directly on Hopper with cuDNN >= 9.10).
   Times: median of --reps calls after a warmup call, each call blocked on.
2. Model prefill (--model): a 2-layer slice of Kimi-K2.5 (1 dense + 1 MoE layer of 384 INT4 experts,
   vocab cut to 4096), the engine's jitted paged step (prefill of --model_tokens tokens, one row,
   sampling included) three ways: 'paged' (fresh=False: keys gathered from the page table, as before
   the fresh path existed), 'fresh einsum' and 'fresh cudnn' (the automatic choice on a GPU).
   Then a later prompt chunk (256 tokens after --chunk_prefix cached tokens, fresh=False) three ways:
   'chunk einsum', 'chunk cudnn' (one masked dot_product_attention call) and 'chunk cudnn_split' (two
   unmasked calls merged by log-sum-exp; the automatic choice on a GPU).
3. Time to first token (--ttft_tokens L): one prompt of L tokens through `LLM.generate` (max_tokens 1,
   greedy) on the same 2-layer slice, at each --ttft_chunks prefill_chunk (max_prefill_tokens the same):
   the prompt takes ceil(L / chunk) engine steps, each reading every weight once. A warm-up generate
   of the same prompt compiles each step shape first; the first sampled tokens must agree.
Prints one table; writes check_prefill.json under --out. Exit status 1 if a check fails.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/check_prefill"), "output directory")
flags.DEFINE_bool("tiny", False, "CPU dry run: small shapes, jax.nn.dot_product_attention('xla') for cuDNN")
flags.DEFINE_list("cases", ["1x4096", "4x2048", "1x16384", "8x256"], "B x T fresh prefills")
flags.DEFINE_integer("reps", 7, "timed calls per case (median)")
flags.DEFINE_float("tol", 2e-2, "max error relative to max |reference| (bf16)")
flags.DEFINE_bool("model", True, "time a model prefill through the engine with the path on and off")
flags.DEFINE_integer("model_tokens", 2048, "tokens of the model prefill")
flags.DEFINE_integer("chunk_prefix", 16384, "cached tokens before the model's later-chunk case")
flags.DEFINE_integer("ttft_tokens", 0, "if > 0: time to first token of one prompt this long through LLM.generate "
                     "on the 2-layer slice, at each --ttft_chunks prefill_chunk")
flags.DEFINE_list("ttft_chunks", ["256", "1024", "2048"], "prefill_chunk values for --ttft_tokens")
flags.DEFINE_float("budget_s", 100.0, "skip what is left after this many seconds")

_T0 = time.time()


def log(*a):
    print(f"[{time.time() - _T0:6.1f}s]", *a, flush=True)


def time_fn(fn, *args, reps):
    import jax
    jax.block_until_ready(fn(*args))                 # compile + warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _lengths(B, T):
    """Row lengths: full rows, or for B > 1 ragged ones (the padding after them is what a batch has)."""
    if B == 1:
        return [T]
    return [T, (3 * T) // 4, T // 3, 1][:B] + [T] * max(0, B - 4)


def op_case(B, T, dims, impl, reps):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax import ops
    from kimi_jax.ops import prefill_attention
    N, H, R, V = dims
    dtype = jnp.bfloat16
    scale = (H + R) ** -0.5
    ks = jax.random.split(jax.random.PRNGKey(B * 100003 + T), 5)
    q_nope = jax.random.normal(ks[0], (B, T, N, H), dtype)
    q_pe = jax.random.normal(ks[1], (B, T, N, R), dtype)
    k = jax.random.normal(ks[2], (B, T, N, H), dtype)
    kpe = jax.random.normal(ks[3], (B, T, R), dtype)
    v = jax.random.normal(ks[4], (B, T, N, V), dtype)
    lengths = np.asarray(_lengths(B, T), np.int32)
    pos_np = np.where(np.arange(T)[None] < lengths[:, None], np.arange(T)[None], -1).astype(np.int32)
    pos = jnp.asarray(pos_np)

    def mask_of(pos_q, pos_k):
        return (pos_k[:, None, :] <= pos_q[:, :, None]) & (pos_k[:, None, :] >= 0)

    fused = jax.jit(lambda qn, qp, k, kp, v: prefill_attention._mla_prefill_attention_dpa(qn, qp, k, kp, v, scale,
                                                                                          impl, None))
    einsum = jax.jit(lambda qn, qp, k, kp, v, pos: prefill_attention._mla_prefill_attention_einsum(
        qn, qp, k, kp, v, mask_of(pos, pos), scale))
    args = (q_nope, q_pe, k, kpe, v)
    flops = 2 * N * (H + R + V) * float(np.sum(lengths.astype(np.float64) * (lengths + 1) / 2))
    row = dict(B=B, T=T, N=N, qk=H + R, v=V, lengths=lengths.tolist(), impl=impl, flops=flops, finite=True)

    # error on query slices (the reference is the einsum path on those queries only)
    out = fused(*args)
    errs = []
    for lo, hi in ((0, min(T, 256)), (max(0, T - 512), T)):
        ref = jax.jit(lambda qn, qp, k, kp, v, pos: prefill_attention._mla_prefill_attention_einsum(
            qn[:, lo:hi], qp[:, lo:hi], k, kp, v, mask_of(pos[:, lo:hi], pos), scale))(*args, pos)
        ref = np.asarray(ref, np.float32)
        got = np.asarray(out[:, lo:hi], np.float32)
        valid = (pos_np[:, lo:hi] >= 0)[..., None, None]
        if not valid.any():
            continue
        den = float(np.max(np.abs(np.where(valid, ref, 0))))
        errs.append(float(np.max(np.abs(np.where(valid, got - ref, 0)))) / max(den, 1e-30))
        row["finite"] = bool(np.isfinite(got).all()) and row["finite"]
    del out
    row["rel_err"] = max(errs)
    row["ok"] = row["rel_err"] <= FLAGS.tol and row["finite"]

    for name, fn, a in (("fused", fused, args), ("einsum", einsum, args + (pos,))):
        try:
            row[f"t_{name}"] = time_fn(fn, *a, reps=reps)
        except Exception as e:  # noqa: BLE001  (the einsum path at 16K may not fit)
            row[f"t_{name}"] = None
            row[f"err_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"B={B} T={T} {name}: failed {row[f'err_{name}']}")
    if impl == "cudnn":                           # V not padded: jax's private cuDNN entry point
        try:
            from jax._src.cudnn import fused_attention_stablehlo as fa

            @jax.jit
            def nopad(qn, qp, k, kp, v):
                q = jnp.concatenate([qn, qp], -1)
                kk = jnp.concatenate([k, jnp.broadcast_to(kp[:, :, None], (*kp.shape[:2], N, R))], -1)
                return fa.dot_product_attention(q, kk, v, scale=scale, mask_type=fa.MaskType.CAUSAL)

            o = np.asarray(nopad(*args)[:, -512:], np.float32)
            o_ref = np.asarray(fused(*args)[:, -512:], np.float32)
            valid = (pos_np[:, -512:] >= 0)[..., None, None]
            row["nopad_vs_fused"] = float(np.max(np.abs(np.where(valid, o - o_ref, 0)))) / max(
                float(np.max(np.abs(np.where(valid, o_ref, 0)))), 1e-30)
            row["t_nopad"] = time_fn(nopad, *args, reps=reps)
        except Exception as e:  # noqa: BLE001
            row["t_nopad"] = None
            row["err_nopad"] = f"{type(e).__name__}: {str(e)[:200]}"
    tf, te, tn = row.get("t_fused"), row.get("t_einsum"), row.get("t_nopad")
    log(f"B={B} T={T}: rel err {row['rel_err']:.2e} ({'ok' if row['ok'] else 'FAILED'}); "
        f"{impl} {tf * 1e3 if tf else float('nan'):.2f} ms, einsum {te * 1e3 if te else float('nan'):.2f} ms, "
        f"{impl} unpadded-V {tn * 1e3 if tn else float('nan'):.2f} ms")
    return row


def _slice_config(tiny):
    """The model of sections 2 and 3: Kimi-K2.5's first two layers (1 dense + 1 MoE), vocab cut to 4096."""
    from kimi_jax.config import preset
    if tiny:
        return preset("tiny")
    return preset("kimi-k2.5").replace(num_hidden_layers=2, first_k_dense_replace=1, vocab_size=4096)


def model_case(T, tiny, reps):
    import dataclasses
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from kimi_jax import ops
    from kimi_jax.engine.steps import Engine
    from kimi_jax.model.transformer import init_pages
    from kimi_jax.tools.profiling import random_engine
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams
    from kimi_jax.parallel.sharding import Layout
    cfg = _slice_config(tiny)
    layout = Layout()
    base = random_engine(cfg, layout, jnp.bfloat16)
    page = 16
    sp = SamplingArrays.build([SamplingParams(temperature=0.0)], None, keys=np.zeros((1, 2), np.uint32))
    fused_name = "xla" if tiny else "cudnn"
    row = dict(T=T, layers=cfg.num_hidden_layers, auto_path=ops.prefill_attention_path(
        cfg.qk_head_dim, cfg.v_head_dim, jnp.bfloat16, causal=True))
    toks = {}

    def timed(name, field, choice, start, n, fresh, seed):
        """One row's step over n new tokens at positions start.. (start cached tokens before them, their
        pages zero), with the plan's `field` (prefill_attention / chunk_attention) set to `choice`:
        time, first sampled token."""
        if time.time() - _T0 > FLAGS.budget_s:
            log(f"model {name}: skipped (budget)")
            return
        P, rng = -(-(start + n) // page), np.random.default_rng(seed)
        box = [init_pages(cfg, P + 1, page, jnp.bfloat16)]
        plan = dataclasses.replace(base.plan, **{field: choice})
        eng = Engine(nnx.merge(base.graphdef, base.state), cfg, layout, plan=plan)   # same weights
        args = (rng.integers(2, cfg.vocab_size, (1, n)).astype(np.int32),
                start + np.arange(n, dtype=np.int32)[None], np.arange(P, dtype=np.int32)[None],
                np.array([n - 1], np.int32), sp, np.zeros((1,), np.int32))

        def step():
            box[0], out = eng._step(eng.state, box[0], *args, n_logprobs=None, absorbed=False, fresh=fresh,
                                    plan=eng.plan)
            return out
        try:
            step()       # the first call's fresh pages are laid out unlike the step's output: 2 compiles
            row[f"t_{name}"] = time_fn(step, reps=reps)
            toks[name] = int(np.asarray(step()[0])[0])
        except Exception as e:  # noqa: BLE001
            row[f"t_{name}"] = None
            row[f"err_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
        t = row[f"t_{name}"]
        log(f"model {name} ({n} tokens after {start}): {t * 1e3 if t else float('nan'):.1f} ms")

    for name, choice, fresh in (("paged", "einsum", False), ("fresh_einsum", "einsum", True),
                                ("fresh_" + fused_name, fused_name, True)):
        timed(name, "prefill_attention", choice, 0, T, fresh, seed=0)   # the same prompt each time
    # a later prompt chunk (the scheduler's default 256 tokens) after --chunk_prefix cached tokens: the
    # einsum path, the masked dot_product_attention call and the split one (the plan's chunk_attention)
    C, prefix = (16, 48) if tiny else (256, FLAGS.chunk_prefix)
    row.update(chunk=C, chunk_prefix=prefix)
    for choice in ("einsum", fused_name, fused_name + "_split"):
        timed("chunk_" + choice, "chunk_attention", choice, prefix, C, False, seed=1)
    row["tokens"] = toks
    return row


def ttft_case(tiny):
    """Time to first token of one long prompt at each prefill_chunk (section 3 of the docstring)."""
    import numpy as np
    from kimi_jax import LLM, SamplingParams
    cfg = _slice_config(tiny)
    L = 200 if tiny else FLAGS.ttft_tokens
    chunks = [16, 64] if tiny else [int(c) for c in FLAGS.ttft_chunks]
    llm = LLM(cfg, dtype="bfloat16", max_num_seqs=1, max_model_len=L + 16)
    prompt = np.random.default_rng(2).integers(2, cfg.vocab_size, L).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = dict(tokens=L, chunks={}, first_tokens={})
    for c in chunks:
        if time.time() - _T0 > FLAGS.budget_s:
            log(f"ttft chunk={c}: skipped (budget)")
            continue
        llm.prefill_chunk = llm.max_prefill_tokens = c
        try:
            llm.generate([prompt], sp, use_tqdm=False)                         # compiles the step shapes
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                res = llm.generate([prompt], sp, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            out["chunks"][c] = min(times)
            out["first_tokens"][c] = res[0].outputs[0].token_ids[0]
        except Exception as e:  # noqa: BLE001
            out["chunks"][c] = None
            log(f"ttft chunk={c}: failed {type(e).__name__}: {str(e)[:200]}")
            continue
        log(f"ttft L={L} chunk={c}: {out['chunks'][c] * 1e3:.1f} ms ({-(-L // c)} steps), "
            f"first token {out['first_tokens'][c]}")
    out["agree"] = len(set(out["first_tokens"].values())) <= 1
    return out


def table(rows, model_row):
    lines = ["| B x T | rows | rel err | ok | fused ms | einsum ms | einsum / fused | fused TFLOP/s | unpadded-V ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tf, te, tn = r.get("t_fused"), r.get("t_einsum"), r.get("t_nopad")
        ms = lambda t: f"{t * 1e3:.2f}" if t else "failed"
        lines.append(f"| {r['B']}x{r['T']} | {r['lengths']} | {r['rel_err']:.1e} | {'yes' if r['ok'] else 'NO'} | "
                     f"{ms(tf)} | {ms(te)} | {te / tf if tf and te else float('nan'):.2f} | "
                     f"{r['flops'] / tf / 1e12 if tf else float('nan'):.0f} | {ms(tn) if 't_nopad' in r else '-'} |")
    if model_row:
        lines += ["", f"model prefill, {model_row['layers']} layers, T={model_row['T']} "
                      f"(automatic path: {model_row['auto_path']}):"]
        for k, v in model_row.items():
            if k.startswith("t_"):
                lines.append(f"  {k[2:]:14s} {v * 1e3:.1f} ms" if v else f"  {k[2:]:14s} failed")
        lines.append(f"  first sampled token per variant: {model_row.get('tokens')}")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    common.setup()
    import jax
    os.makedirs(FLAGS.out, exist_ok=True)
    log("devices", jax.devices(), "jax", jax.__version__)
    impl = "xla" if FLAGS.tiny else "cudnn"
    dims = (4, 16, 8, 16) if FLAGS.tiny else (64, 128, 64, 128)
    cases = ["1x64", "3x48"] if FLAGS.tiny else FLAGS.cases
    reps = 2 if FLAGS.tiny else FLAGS.reps
    rows = []
    for c in cases:
        B, T = (int(x) for x in c.lower().split("x"))
        if time.time() - _T0 > FLAGS.budget_s:
            log(f"B={B} T={T}: skipped (budget)")
            continue
        try:
            rows.append(op_case(B, T, dims, impl, reps))
        except Exception as e:  # noqa: BLE001
            log(f"B={B} T={T}: failed {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(B=B, T=T, lengths=[], rel_err=float("nan"), ok=False, flops=0,
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
    model_row = None
    if FLAGS.model:
        try:
            model_row = model_case(32 if FLAGS.tiny else FLAGS.model_tokens, FLAGS.tiny, reps)
        except Exception as e:  # noqa: BLE001
            log(f"model prefill: failed {type(e).__name__}: {str(e)[:300]}")
            model_row = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    ttft = None
    if FLAGS.ttft_tokens or FLAGS.tiny:
        try:
            ttft = ttft_case(FLAGS.tiny)
        except Exception as e:  # noqa: BLE001
            log(f"ttft: failed {type(e).__name__}: {str(e)[:300]}")
            ttft = dict(error=f"{type(e).__name__}: {str(e)[:300]}", agree=False)
    t = table(rows, model_row if model_row and "T" in model_row else None)
    if ttft and "chunks" in ttft:
        t += "\n\n" + f"time to first token, one prompt of {ttft['tokens']} tokens (2-layer slice):\n" + "\n".join(
            f"  prefill_chunk {c:5d}: " + (f"{v * 1e3:.1f} ms" if v else "failed") for c, v in ttft["chunks"].items())
        t += f"\n  first tokens agree: {ttft['agree']}"
    print(t, flush=True)
    ok = all(r["ok"] for r in rows) and (ttft is None or ttft["agree"])
    with open(os.path.join(FLAGS.out, "check_prefill.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, impl=impl, dims=dims, ops=rows,
                       model=model_row, ttft=ttft, ok=ok, seconds=time.time() - _T0), f, indent=1)
    with open(os.path.join(FLAGS.out, "table.md"), "w") as f:
        f.write(t + "\n")
    log("checks", "OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
