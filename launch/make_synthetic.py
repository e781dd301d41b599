r"""Write a synthetic checkpoint in the exact published format (safetensors shards + index +
config.json), of any preset's geometry, any number of layers and experts.

  kimi-make-synthetic --model kimi-k2.5 --num-layers 2 --out /tmp/k25-2l --num-shards 4
  kimi-make-synthetic --model tiny --out /tmp/tiny --layout k25 --values normal   (--preset: --model)
  kimi-make-synthetic --model kimi-k2.5 --noweights --synthetic_tokenizer --out /tmp/k25-tok

Tensors are streamed to disk (checkpoints.synthetic.write_safetensors): memory stays at about one
32 MB piece whatever the shard size. --values fast (default) fills large tensors from raw random bits
(INT4 words as drawn; bf16 numbers of the right magnitude), ~10x faster than normal samples quantized
to INT4; --values normal gives the weights tests use (same seed, same weights, any layout/sharding).
Prints the size before writing (kimi-k2.5's geometry: 9.8 GB per MoE layer; --num_experts
shrinks it), refuses a checkpoint larger than the free space at --out, then bytes written, seconds
and GB/s. Bad flags: one line on stderr, exit status 2.
"""
from __future__ import annotations

import math
import os
import sys
import time

from absl import flags

from launch import common

PROG = "kimi-make-synthetic"
FLAGS = flags.FLAGS
flags.DEFINE_string("model", "kimi-k2.5", "the geometry: a preset (kimi-k2.5, kimi-k2-thinking, deepseek-v3, tiny)")
flags.DEFINE_alias("preset", "model")
flags.DEFINE_integer("num_layers", None, "override num_hidden_layers (the first first_k_dense_replace "
                     "are dense, the rest MoE)")
flags.DEFINE_integer("num_experts", None, "override n_routed_experts")
flags.DEFINE_integer("first_k_dense_replace", None, "override the number of leading dense layers")
flags.DEFINE_integer("vocab_size", None, "override vocab_size")
flags.DEFINE_string("out", None, "output directory (earlier weights there are replaced)")
flags.DEFINE_integer("num_shards", 0, "safetensors shards; 0: about --shard_gb each")
flags.DEFINE_float("shard_gb", 4.0, "target shard size when --num_shards=0")
flags.DEFINE_enum("layout", "k2", ["k2", "k25"], "k2: DeepseekV3 names; k25: Kimi-K2.5 "
                  "(language_model. prefixes, nested config, dummy vision tensors)")
flags.DEFINE_integer("seed", 0, "weights depend only on (seed, tensor name)")
flags.DEFINE_enum("values", "fast", ["fast", "normal"], "random values: raw bits (fast) or normal "
                  "samples quantized like the real model (normal)")
flags.DEFINE_bool("int4", None, "INT4 routed experts (default: as the preset)")
flags.DEFINE_float("std", 0.02, "weight scale")
flags.DEFINE_string("tokenizer_dir", None, "copy tokenizer files from this directory")
flags.DEFINE_bool("synthetic_tokenizer", False, "write a Kimi-shaped tokenizer of the model's "
                  "vocabulary into --out (vocab_size - 256 byte-level ranks: the demo's merges, then "
                  "seeded random words; Kimi's special tokens above them)")
flags.DEFINE_bool("weights", True, "write the weights (--noweights --synthetic_tokenizer: only the "
                  "tokenizer, for kimi-serve --model PRESET --tokenizer DIR)")
LARGE_GB = 4.0          # a size printed as a warning line, with how to make it smaller


def fail(message) -> None:
    common.fail(PROG, message)



def config():
    from kimi_jax.config import QuantConfig, preset
    cfg = preset(FLAGS.model)
    over = {k: getattr(FLAGS, f) for k, f in (("num_hidden_layers", "num_layers"),
                                              ("n_routed_experts", "num_experts"),
                                              ("first_k_dense_replace", "first_k_dense_replace"),
                                              ("vocab_size", "vocab_size"))
            if getattr(FLAGS, f) is not None}
    for k, v in over.items():
        if v < (0 if k == "first_k_dense_replace" else 1):
            fail(f"--{k}={v} is out of range")
    if "n_routed_experts" in over:
        e = over["n_routed_experts"]
        over["num_experts_per_tok"] = min(cfg.num_experts_per_tok, e)
        if e % cfg.n_group:
            over["n_group"] = over["topk_group"] = 1
    cfg = cfg.replace(**over)
    if FLAGS.int4 is not None and FLAGS.int4 != (cfg.quantization is not None):
        cfg = cfg.replace(quantization=QuantConfig() if FLAGS.int4 else None)
    return cfg


def main(argv):
    del argv
    from checkpoints import layout as layout_lib
    from kimi_jax.config import ConfigError

    if not FLAGS.out:
        fail("--out is required")
    if FLAGS.synthetic_tokenizer and FLAGS.tokenizer_dir:
        fail("--synthetic_tokenizer and --tokenizer_dir both name the tokenizer; pass one")
    if not FLAGS.weights and not FLAGS.synthetic_tokenizer:
        fail("--noweights writes nothing without --synthetic_tokenizer")
    try:
        cfg = config()
        exp = layout_lib.expected_tensors(cfg)
    except (ConfigError, ValueError) as e:
        fail(e)
    if FLAGS.weights:
        write_weights(cfg, exp)
    if FLAGS.synthetic_tokenizer:
        write_tokenizer(cfg)


def write_tokenizer(cfg) -> None:
    """A synthetic Kimi-shaped tokenizer of cfg's vocabulary into --out."""
    from checkpoints.bpe import write_tokenizer_files
    from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL_TOKENS
    from launch.bench.harness import synthetic_ranks
    n_base = cfg.vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    t0 = time.perf_counter()
    try:
        ranks = synthetic_ranks(n_base)
        write_tokenizer_files(FLAGS.out, ranks, model_max_length=cfg.max_position_embeddings)
    except (ValueError, OSError) as e:
        fail(f"--synthetic_tokenizer: {e}")
    print(f"{PROG}: wrote a synthetic tokenizer of {n_base} ranks and Kimi's special ids above "
          f"them to {FLAGS.out} in {time.perf_counter() - t0:.1f}s", flush=True)


def write_weights(cfg, exp) -> None:
    from checkpoints.synthetic import write_checkpoint
    from checkpoints.safetensors_io import CheckpointError
    size = {"bfloat16": 2, "float32": 4, "int32": 4}
    total = sum(math.prod(s) * size[d] for s, d in exp.values())
    shards = FLAGS.num_shards or max(1, math.ceil(total / (FLAGS.shard_gb * 1e9)))
    shards = min(shards, len(exp))
    print(f"{PROG}: {FLAGS.model} with {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, "
          f"{cfg.num_moe_layers} MoE), {cfg.n_routed_experts} experts, "
          f"{'INT4' if cfg.quantization else 'bf16'} experts: {len(exp)} tensors, {total / 1e9:.2f} GB "
          f"in {shards} shard(s) -> {FLAGS.out}", flush=True)
    if total / 1e9 >= LARGE_GB:
        print(f"{PROG}: warning: {total / 1e9:.1f} GB to write (--num_layers / --num_experts make it smaller)",
              file=sys.stderr, flush=True)
    import shutil
    where = os.path.abspath(FLAGS.out)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if free < total:
        fail(f"{total / 1e9:.1f} GB to write and {free / 1e9:.1f} GB free at {where}")
    t0 = time.perf_counter()
    done = [0]

    def on_shard(fname, n):
        done[0] += n
        dt = time.perf_counter() - t0
        print(f"  {fname}: {n / 1e9:.2f} GB  (total {done[0] / 1e9:.2f} GB, {done[0] / 1e9 / dt:.2f} GB/s)",
              flush=True)

    try:
        write_checkpoint(FLAGS.out, cfg, seed=FLAGS.seed, layout=FLAGS.layout, num_shards=shards,
                         std=FLAGS.std, tokenizer_dir=FLAGS.tokenizer_dir, values=FLAGS.values,
                         on_shard=on_shard)
    except (CheckpointError, ValueError, OSError) as e:
        fail(e)
    dt = time.perf_counter() - t0
    print(f"{PROG}: wrote {done[0] / 1e9:.2f} GB in {dt:.1f}s ({done[0] / 1e9 / dt:.2f} GB/s, page "
          f"cache included; not fsynced)", flush=True)


def run(argv=None):
    """Console-script entry point (`kimi-make-synthetic`)."""
    common.run(main, PROG, __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
