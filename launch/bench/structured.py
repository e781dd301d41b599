"""kimi-bench structured: structured-output costs: llguidance vs xgrammar (grammar compile per schema,
per-step bitmask fill at batch 1 / 16 / 64), and the on-device mask's cost inside a jitted sampling
step, at the demo vocabulary (4,096) and Kimi's (163,840).

  kimi-bench structured --out=/tmp/structured.json
  kimi-bench structured --dry --batches=1,2 --steps=2 --reps=1 --noxgrammar --out=/tmp/x   # CPU, demo vocabulary only

The 163,840-token tokenizer is synthetic (Kimi's shape: 163,584 byte-level ranks then 258 special ids
with the tool-call markers at Kimi's offsets): the 256 bytes, the demo checkpoint's ranks, then
seeded random words (ASCII with and without a leading space, capitalised), CJK runs, digit runs,
punctuation and whitespace runs, until 163,584 distinct tokens. Its token strings are not a trained
vocabulary's; the mask cost depends on the vocabulary size and its prefix structure, which this
reproduces roughly. Each matcher follows a valid instance of its schema token by token; a step's
time is the fill of every row's mask (the token consumption after it is timed apart; close_ms: the
budget close's check of every row, as near the end of a request's max_tokens, on a copy of the mask).
xgrammar needs torch (imported here only). Writes the results as JSON (--out: a directory, then
structured.json in it, or a .json file).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import time

from absl import flags

from launch.bench.harness import synthetic_tokenizer, write_json

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "out"), "bench_structured"),
                    "results directory (structured.json in it) or .json file")
flags.DEFINE_list("batches", ["1", "16", "64"], "batch sizes")
flags.DEFINE_bool("xgrammar", True, "also measure xgrammar (needs torch)")
flags.DEFINE_integer("reps", 5, "timed repetitions of each jitted step")
flags.DEFINE_integer("steps", 20, "timed engine decode steps per (model, batch, mask)")
flags.DEFINE_list("parts", ["grammar", "sampler", "engine"], "what to measure")
flags.DEFINE_bool("dry", False, "CPU dry run: the demo vocabulary only (no 163,840-token tokenizer or model)")

KIMI_VOCAB = 163_840

SCHEMAS = {
    "enum_flat": ({"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["unit", "city", "days"], "additionalProperties": False},
                  {"unit": "celsius", "city": "Paris", "days": 3}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                                  "address": {"type": "object", "properties": {
                                                      "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                      "required": ["street", "zip"]}},
                 "required": ["name", "age", "address"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
        {"user": {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "zip": "10001"}}, "active": True}),
    "arrays": ({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                              "required": ["x", "y"]}}},
        "required": ["tags", "points"]},
        {"tags": ["alpha", "beta", "gamma"], "points": [{"x": 1.5, "y": -2}, {"x": 0, "y": 3.25}]}),
    "anyof_required": ({"type": "object", "properties": {
        "id": {"type": "string"}, "kind": {"enum": ["a", "b", "c"]},
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}, {"type": "null"}]},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}}},
        "required": ["id", "kind", "value"]},
        {"id": "req-42", "kind": "b", "value": "forty two", "meta": {"source": "bench", "lang": "en"}}),
}


def _median_ms(xs):
    return round(1e3 * statistics.median(xs), 4)


def bench_llguidance(tok, batches):
    import llguidance as llg
    import numpy as np
    from kimi_jax.engine.runner import CLOSE_WINDOW
    from kimi_jax.engine.structured import StructuredBackend
    from kimi_jax.engine.structured_params import StructuredOutputsParams
    backend = StructuredBackend(tok, KIMI_VOCAB if tok.vocab_size > 100_000 else 4096)
    t0 = time.perf_counter()
    backend._lltok                                   # built on first use
    out = {"tokenizer_build_s": round(time.perf_counter() - t0, 3), "compile_ms": {}, "mask_ms": {}, "consume_ms": {},
           "close_ms": {}}
    grammars = {}
    for name, (schema, _) in SCHEMAS.items():
        g = StructuredOutputsParams(json=schema, disable_any_whitespace=True).to_grammar()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            m = llg.LLMatcher(backend._lltok, g, log_level=0)
            assert not m.is_error(), m.get_error()
            times.append(time.perf_counter() - t0)
        out["compile_ms"][name] = _median_ms(times)
        grammars[name] = g
    names = list(SCHEMAS)
    seqs = {n: tok.encode(json.dumps(SCHEMAS[n][1], separators=(",", ":"))) for n in names}
    for B in batches:
        rows = [backend.matcher(StructuredOutputsParams(json=SCHEMAS[names[b % len(names)]][0], disable_any_whitespace=True))
                for b in range(B)]
        seq = [seqs[names[b % len(names)]] for b in range(B)]
        steps = min(len(s) for s in seq)
        fill, consume, close = [], [], []
        buffer = np.empty((B, backend.words), np.int32)     # filled in place, as the runner's
        scratch = np.empty_like(buffer)
        for k in range(steps):
            t0 = time.perf_counter()
            mask = backend.fill_bitmask(rows, out=buffer)
            fill.append(time.perf_counter() - t0)
            # every row inside the runner's close window (its widest): the check on a copy
            np.copyto(scratch, mask)
            t0 = time.perf_counter()
            for b in range(B):
                backend.bitmask_closing(scratch[b], rows[b], CLOSE_WINDOW)
            close.append(time.perf_counter() - t0)
            for b in range(B):       # the instance's token must be allowed
                t = seq[b][k]
                assert (mask[b, t // 32] >> (t % 32)) & 1, (names[b % len(names)], k)
            t0 = time.perf_counter()
            for b in range(B):
                assert rows[b].accept(seq[b][k]), rows[b].error()
            consume.append(time.perf_counter() - t0)
        out["mask_ms"][B], out["consume_ms"][B] = _median_ms(fill), _median_ms(consume)
        out["close_ms"][B] = _median_ms(close)
    return out


def bench_xgrammar(tok, batches):
    import torch  # noqa: F401  (xgrammar's masks are torch tensors)
    import xgrammar as xgr
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=tok.stop_token_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {"tokenizer_build_s": round(time.perf_counter() - t0, 3), "compile_ms": {}, "mask_ms": {}, "consume_ms": {}}
    compiled = {}
    for name, (schema, _) in SCHEMAS.items():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            c = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
            times.append(time.perf_counter() - t0)
        out["compile_ms"][name] = _median_ms(times)
        compiled[name] = c
    names = list(SCHEMAS)
    seqs = {n: tok.encode(json.dumps(SCHEMAS[n][1], separators=(",", ":"))) for n in names}
    for B in batches:
        ms = [xgr.GrammarMatcher(compiled[names[b % len(names)]]) for b in range(B)]
        seq = [seqs[names[b % len(names)]] for b in range(B)]
        batch = xgr.BatchGrammarMatcher() if B > 1 else None
        bitmask = xgr.allocate_token_bitmask(B, tok.vocab_size)
        steps = min(len(s) for s in seq)
        fill, consume = [], []
        for k in range(steps):
            t0 = time.perf_counter()
            if batch is not None:
                batch.batch_fill_next_token_bitmask(ms, bitmask)
            else:
                ms[0].fill_next_token_bitmask(bitmask, 0)
            fill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for b in range(B):
                assert ms[b].accept_token(seq[b][k]), (names[b % len(names)], k)
            consume.append(time.perf_counter() - t0)
        out["mask_ms"][B], out["consume_ms"][B] = _median_ms(fill), _median_ms(consume)
    return out


def bench_sampling_step(batches, vocabs, reps):
    """The jitted greedy sampler (argmax) with and without `apply_token_bitmask`: the mask's own cost."""
    import jax
    import numpy as np
    from kimi_jax.engine.sampling import SamplingArrays, SamplingParams, sample
    from kimi_jax.engine.token_mask import apply_token_bitmask, mask_words
    plain = jax.jit(lambda l, sp, s: sample(l, sp, s, "greedy"))
    masked = jax.jit(lambda l, m, sp, s: sample(apply_token_bitmask(l, m), sp, s, "greedy"))
    out = {}
    rng = np.random.default_rng(0)
    for V in vocabs:
        for B in batches:
            logits = jax.device_put(rng.standard_normal((B, V), np.float32))
            mask = rng.integers(-2**31, 2**31 - 1, (B, mask_words(V)), dtype=np.int64).astype(np.int32)
            sp = SamplingArrays.build([SamplingParams(temperature=1.0)] * B, list(range(B)))
            steps = np.zeros((B,), np.int32)
            res = {}
            for name, f, args in (("no_mask", plain, (logits, sp, steps)), ("mask", masked, (logits, mask, sp, steps))):
                f(*args).block_until_ready()
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    f(*args).block_until_ready()
                    ts.append(time.perf_counter() - t0)
                res[name] = _median_ms(ts)
            out[f"V={V},B={B}"] = res
    return out


def bench_decode_step(batches, steps: int, context: int = 64, kimi_vocab: bool = True):
    """The engine's serving decode step (`step_adapters.paged_step`, T = 1, greedy, host inputs and
    fetch: what the scheduler calls) with mask_Bw None and with a mask, on the demo model and (kimi_vocab)
    on the tiny preset at a 163,840-token vocabulary (float32, CPU)."""
    import jax.numpy as jnp
    import numpy as np
    from kimi_jax.config import preset
    from kimi_jax.engine.steps import ModelSteps, bucket
    from kimi_jax.engine.token_mask import mask_words
    from kimi_jax.entrypoints.llm import LLM, demo_model_path
    from kimi_jax.parallel.sharding import Layout
    from kimi_jax.tools.profiling import paged_args, random_engine
    from kimi_jax.tools.step_adapters import paged_step
    engines = {"demo_4096": LLM(demo_model_path(), dtype="float32").frontend.steps}
    if kimi_vocab:
        engines["tiny_163840"] = random_engine(preset("tiny").replace(vocab_size=KIMI_VOCAB), Layout(1), jnp.float32)
    out = {}
    for label, engine in engines.items():
        V = engine.cfg.vocab_size
        for B in batches:
            pages, tok, table, sp = paged_args(engine, Layout(1), B, bucket(context + steps + 8))
            last = np.zeros((B,), np.int32)
            mask = np.full((B, mask_words(V)), -1, np.int32)
            ts = {"no_mask": [], "mask": []}
            for i in range(steps + 3):                       # alternating, so load spikes hit both alike
                for name, m in (("no_mask", None), ("mask", mask)):
                    pos = np.full(tok.shape, context + i, np.int32)
                    t0 = time.perf_counter()
                    step_B = np.full((B,), i, np.int32)
                    pages, o = paged_step(engine, pages, tok, pos, table, last, sp, step_B, None,
                                          mask_Bw=m)
                    ts[name].append(time.perf_counter() - t0)
            res = {k: _median_ms(v[3:]) for k, v in ts.items()}    # the first 3 compile and warm up
            out[f"{label},B={B}"] = res
            print(label, B, res, flush=True)
    return out


def main(argv):
    del argv
    import jax
    batches = [int(b) for b in FLAGS.batches]
    result = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    from kimi_jax.entrypoints.llm import demo_model_path
    from kimi_jax.text.tokenizer import Tokenizer
    if "grammar" in FLAGS.parts:
        tokenizers = [("demo_4096", Tokenizer.from_pretrained(demo_model_path()))]
        if not FLAGS.dry:
            t0 = time.perf_counter()
            tokenizers.append(("kimi_163840", synthetic_tokenizer()))
            result["synthetic_tokenizer_s"] = round(time.perf_counter() - t0, 2)
        for label, tok in tokenizers:
            result[f"llguidance_{label}"] = bench_llguidance(tok, batches)
            print(label, "llguidance", json.dumps(result[f"llguidance_{label}"]), flush=True)
            if FLAGS.xgrammar:
                result[f"xgrammar_{label}"] = bench_xgrammar(tok, batches)
                print(label, "xgrammar", json.dumps(result[f"xgrammar_{label}"]), flush=True)
    if "sampler" in FLAGS.parts:
        vocabs = (4096,) if FLAGS.dry else (4096, KIMI_VOCAB)
        result["sampling_step_ms"] = bench_sampling_step(batches, vocabs, FLAGS.reps)
        print("sampling", json.dumps(result["sampling_step_ms"]), flush=True)
    if "engine" in FLAGS.parts:
        result["decode_step_ms"] = bench_decode_step(batches, FLAGS.steps, kimi_vocab=not FLAGS.dry)
    print(f"wrote {write_json(FLAGS.out, 'structured.json', result)}")


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench structured", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
