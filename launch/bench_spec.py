"""Speculative-decoding case of launch/bench.py (`--suite=spec`): n-gram drafting on a repetitive
workload (the model is asked to continue a text that repeats a passage, so the continuation can be
quoted back from the prompt) and on a non-repetitive one (distinct random-text prompts), at batch 1
and 16, speculation off vs on. Reports output tokens/s, the ratio, and the mean accepted length
(tokens emitted per verification step, 1 + accepted drafts)."""
from __future__ import annotations

import time

import numpy as np


def workloads(llm, n: int, gen_tokens: int, seed: int = 0):
    """non-repetitive: distinct prompts (text from the standard library's docs when the model has a
    tokenizer). repetitive ("say it again"): each prompt is followed by the model's own greedy
    continuation and then the prompt again, so the text to produce next already stands in the context
    (the editing / quoting-back case)."""
    from kimi_jax import SamplingParams
    rng = np.random.default_rng(seed)
    if llm.tokenizer is not None:
        import inspect
        import json
        import textwrap
        docs = " ".join(inspect.getdoc(m) or "" for m in (json, inspect, time, textwrap)).split()
        starts = rng.integers(0, len(docs) - 40, n)
        plain = [llm.tokenizer.encode(" ".join(docs[s:s + int(rng.integers(12, 40))])) for s in starts]
    else:
        plain = [rng.integers(2, llm.config.vocab_size, int(rng.integers(20, 80))).tolist() for _ in range(n)]
    first = llm.generate(plain, SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True))
    repetitive = [p + o.outputs[0].token_ids + p for p, o in zip(plain, first)]
    return {"repetitive": repetitive, "non-repetitive": plain}


def spec_rows(model, batches, *, gen_tokens: int = 48, k: int = 4, dtype: str = "float32") -> list[dict]:
    from kimi_jax import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    rows = []
    for B in batches:
        base = LLM(model, dtype=dtype, max_num_seqs=B)
        spec = LLM(model, dtype=dtype, max_num_seqs=B,
                   speculative_config={"num_speculative_tokens": k, "prompt_lookup_max": 3})
        for name, prompts in workloads(base, B, gen_tokens).items():
            res = {}
            for label, llm in (("off", base), ("on", spec)):
                llm.generate(prompts, sp)                      # compile every shape first
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp)
                wall = time.perf_counter() - t0
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                steps = sum(o.metrics["spec_verify_steps"] for o in outs)
                acc = sum(o.metrics["spec_accepted"] for o in outs)
                res[label] = dict(tok_s=toks / wall, ids=[o.outputs[0].token_ids for o in outs],
                                  mean_len=(1 + acc / steps) if steps else 1.0, drafted=sum(
                                      o.metrics["spec_drafted"] for o in outs), accepted=acc)
            rows.append(dict(batch=B, workload=name, tok_s_off=res["off"]["tok_s"], tok_s_on=res["on"]["tok_s"],
                             speedup=res["on"]["tok_s"] / res["off"]["tok_s"], mean_accepted_len=res["on"]["mean_len"],
                             drafted=res["on"]["drafted"], accepted=res["on"]["accepted"],
                             identical=res["on"]["ids"] == res["off"]["ids"]))
    return rows


def format_rows(rows) -> str:
    out = [f"{'batch':>5} {'workload':>15} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>7} {'mean len':>8} "
           f"{'drafted':>7} {'accepted':>8} {'same tokens':>11}"]
    for r in rows:
        out.append(f"{r['batch']:5d} {r['workload']:>15} {r['tok_s_off']:9.1f} {r['tok_s_on']:9.1f} "
                   f"{r['speedup']:7.2f} {r['mean_accepted_len']:8.2f} {r['drafted']:7d} {r['accepted']:8d} "
                   f"{str(r['identical']):>11}")
    return "\n".join(out)
