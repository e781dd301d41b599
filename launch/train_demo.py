r"""Train the shipped demo model: a small Kimi-K2-architecture model on Python's own documentation.

No real Kimi weights can be downloaded here, so `kimi-generate` and `LLM()` default to this model. It
is a DeepSeek-V3 / Kimi-K2 model in every respect that changes the math (MLA with query compression,
YaRN rope with mscale = mscale_all_dim = 1, one dense first layer, MoE layers of sigmoid-routed
experts with `e_score_correction_bias` and a shared expert, routed experts stored as compressed-tensors
INT4 group 32), only small, and it is written in the published checkpoint layout, so it loads through
the same path as Kimi-K2.5.

Steps (all deterministic for a given `--seed` and Python version):

1. Corpus: English text that ships with every CPython: the `pydoc_data.topics` language-reference
   pages and the docstrings (module, class, method, function) of a fixed, sorted list of standard-library
   modules (`STDLIB_MODULES`), whitespace-normalized (paragraphs joined to single lines, blank line
   between paragraphs), deduplicated, in a fixed order. Long pages are cut into passages of at most
   `MAX_PASSAGE_CHARS` at paragraph ends. Every `HELD_OUT_EVERY`-th passage is held out (never trained
   on) for the held-out loss. From the training docstrings, short chat conversations are made
   ("What does json.dumps do?" -> the docstring's first paragraph), rendered with the checkpoint's own
   chat template, so that the model learns the Kimi chat format and to end its turn with <|im_end|>.
2. Tokenizer: byte-level BPE (`checkpoints.bpe.train_bpe`, Kimi's pre-tokenization pattern) with
   `vocab_size - 256` ranks, then Kimi's special tokens from id `vocab_size - 256` on (as Kimi-K2:
   163584 ranks + 256 embedding rows of specials), `tiktoken.model` + `tokenizer_config.json` +
   `chat_template.jinja`.
3. Model: `demo_config()` (flags below). Trained in float32 through kimi_jax's own Transformer modules
   (`kimi_jax.model.transformer`): `forward_with_loads` is the Transformer forward pass (the same
   embedding, `scan_layers`, MLA, Router, routed-experts op, final norm and LM head) that also returns
   each MoE layer's expert loads; at start-up it is checked against `Transformer.__call__`.
   Loss: next-token cross-entropy on random `seq_len + 1` windows of the token stream (documents
   separated by [EOS]). Optimizer: optax AdamW (weight decay on matrices only), linear warmup then
   cosine decay, gradient clipping. Aux-loss-free load balancing as DeepSeek-V3: the router bias gets
   no gradient; after every step `bias_e += u * sign(mean_load - load_e)` per MoE layer (it only changes
   which experts are chosen, never the expert weights).
4. Export: parameters -> canonical HF tensor names (`checkpoints.layout.hf_names_for`), floating weights
   bf16, the router bias float32, routed experts quantized with `checkpoints.int4.pack_weight`
   (compressed-tensors pack-quantized INT4, group 32), written with
   `checkpoints.synthetic.write_checkpoint_from_tensors` plus the tokenizer files to `--out_dir`
   (default checkpoints/demo). `training_log.json` records the config, seed, steps, losses, wall time,
   the corpus description and its sha256, and fixed probe passages the tests use.
5. Evaluation of the written checkpoint (loaded with `kimi_jax.LLM`): next-token top-1 accuracy and
   greedy next-word accuracy on training-text probes, held-out loss, and greedy agreement of the INT4
   checkpoint with its bf16-dequantized twin (`--bf16_out_dir` keeps that twin).

Usage (1200 steps at ~0.7 s/step on 2 idle CPU cores, ~15 minutes; the committed artifact took 29
minutes of training on a shared 2-core machine, 1.44 s/step):
  python -m launch.train_demo                      # writes checkpoints/demo/ (+ out/demo_params.npz)
  python -m launch.train_demo --steps 20 --out_dir /tmp/demo_smoke   # a quick smoke run
  python -m launch.train_demo --from_params out/demo_params.npz      # redo export + evaluation only
  python -m launch.train_demo --eval_only          # re-evaluate checkpoints/demo, update its log
"""
# Over 600 lines: the demo model's whole recipe (corpus, tokenizer, model, training loop, export) in one script.
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import warnings

from absl import app, flags, logging

FLAGS = flags.FLAGS
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFAULT_OUT = os.path.join(_REPO, "checkpoints", "demo")


def define_flags() -> None:
    """The script's flags (defined only when run as a script, so tests can import this module)."""
    flags.DEFINE_string("out_dir", _DEFAULT_OUT, "Where to write the INT4 checkpoint (published layout).")
    flags.DEFINE_string("bf16_out_dir", "", "Also keep the bf16-dequantized twin of the checkpoint here.")
    flags.DEFINE_bool("eval_only", False, "Only (re-)evaluate the checkpoint in --out_dir and update its log.")
    flags.DEFINE_integer("seed", 0, "Seed for initialization and batch sampling.")
    flags.DEFINE_string("params_out", os.path.join(_REPO, "out", "demo_params.npz"),
                        "Save the trained float32 parameters here before exporting ('' : don't).")
    flags.DEFINE_string("from_params", "", "Skip training: export and evaluate these saved parameters "
                        "(a --params_out file of a run with the same flags).")
    # data / tokenizer
    flags.DEFINE_integer("vocab_size", 4096, "Model vocabulary: BPE ranks + 256 special-token rows.")
    flags.DEFINE_integer("seq_len", 256, "Training sequence length (= YaRN original_max_position_embeddings).")
    flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
    # model
    flags.DEFINE_integer("hidden_size", 256, "D (a multiple of 32: the INT4 group).")
    flags.DEFINE_integer("num_layers", 4, "Decoder layers; the first is dense, the rest MoE.")
    flags.DEFINE_integer("num_heads", 4, "Attention heads N.")
    flags.DEFINE_integer("intermediate_size", 768, "Dense-layer FFN width.")
    flags.DEFINE_integer("moe_intermediate_size", 64, "Per-expert FFN width F (a multiple of 32).")
    flags.DEFINE_integer("n_routed_experts", 8, "Routed experts per MoE layer.")
    flags.DEFINE_integer("num_experts_per_tok", 2, "Routed experts per token (top-k).")
    flags.DEFINE_integer("kv_lora_rank", 64, "MLA latent width A.")
    flags.DEFINE_integer("q_lora_rank", 96, "MLA query compression rank.")
    flags.DEFINE_integer("qk_nope_head_dim", 32, "Per-head no-rope query/key width.")
    flags.DEFINE_integer("qk_rope_head_dim", 16, "Per-head rope query/key width.")
    flags.DEFINE_integer("v_head_dim", 32, "Per-head value width.")
    flags.DEFINE_float("yarn_factor", 4.0, "YaRN factor: max_position_embeddings = factor * seq_len.")
    flags.DEFINE_float("routed_scaling_factor", 2.5, "Scale on the normalized routed-expert weights.")
    # optimization
    flags.DEFINE_integer("steps", 1200, "Optimizer steps.")
    flags.DEFINE_float("lr", 3e-3, "Peak learning rate.")
    flags.DEFINE_integer("warmup_steps", 100, "Linear warmup steps.")
    flags.DEFINE_float("min_lr_ratio", 0.05, "Final learning rate / peak (cosine decay).")
    flags.DEFINE_float("weight_decay", 0.05, "AdamW weight decay (matrices only).")
    flags.DEFINE_float("grad_clip", 1.0, "Global gradient-norm clip.")
    flags.DEFINE_float("bias_update_rate", 1e-2, "u in bias += u * sign(mean_load - load) (aux-loss-free; "
                      "DeepSeek-V3 used 1e-3 over far more steps).")
    flags.DEFINE_integer("log_every", 25, "Print the loss every this many steps.")
    flags.DEFINE_integer("eval_every", 400, "Held-out loss every this many steps (0: only at the end).")


# ---- corpus ---------------------------------------------------------------------------------------

#: Fixed, sorted; only modules present in every CPython >= 3.11 build (no tkinter, no idlelib).
STDLIB_MODULES = tuple(sorted("""
abc argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks asyncio.queues
asyncio.streams asyncio.subprocess asyncio.tasks base64 bdb binascii bisect builtins bz2 calendar cmd
code codecs collections collections.abc colorsys concurrent.futures compileall configparser contextlib
copy copyreg csv dataclasses datetime decimal difflib dis doctest email.charset email.generator
email.header email.message email.parser email.policy email.utils enum filecmp fileinput fnmatch
fractions ftplib functools gc getopt getpass gettext glob graphlib gzip hashlib heapq hmac html
html.parser http.client http.cookiejar http.cookies http.server imaplib importlib importlib.abc
importlib.machinery importlib.metadata importlib.resources importlib.util inspect io ipaddress
itertools json json.decoder json.encoder keyword linecache locale logging logging.config
logging.handlers lzma mailbox math mimetypes modulefinder multiprocessing.connection
multiprocessing.pool multiprocessing.process multiprocessing.queues netrc numbers opcode operator
optparse os os.path pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint
profile pstats py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter runpy sched secrets
selectors shelve shlex shutil signal site smtplib socket socketserver sqlite3 ssl stat statistics
string struct subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap threading time
timeit token tokenize trace traceback tracemalloc types typing unicodedata unittest.case unittest.loader
unittest.mock unittest.result unittest.runner unittest.suite urllib.error urllib.parse urllib.request
urllib.response urllib.robotparser uuid warnings wave weakref webbrowser xml.dom.minidom
xml.dom.pulldom xml.etree.ElementTree xml.sax.handler xml.sax.saxutils xmlrpc.client xmlrpc.server
zipapp zipfile zipimport zlib zoneinfo
""".split()))

MAX_PASSAGE_CHARS = 2000
MIN_DOC_CHARS = 40
HELD_OUT_EVERY = 40          # passage i is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2
CHAT_QUESTIONS = ("What does {} do?", "Explain {}.", "What is {}?", "Describe {} briefly.",
                  "Tell me about {}.", "What is {} used for?")
CHAT_ANSWER_CHARS = 320
CHAT_EVERY = 3               # a conversation from every third named training docstring
NUM_PROBES = 32              # training-text passages the tests continue
NUM_HELD_PROBES = 16         # held-out passages for the INT4-vs-bf16 agreement check
PROBE_PROMPT_WORDS = 16
SAMPLE_PROMPTS = ("The for statement", "Return a new", "This module provides")
LOG_FILE = "training_log.json"


@dataclasses.dataclass
class Passage:
    name: str        # "json.dumps", "topic:for#2", ...
    kind: str        # "doc" | "topic"
    text: str


_RULE_LINE = re.compile(r"^\s*[*=~^-]{3,}\s*$", re.M)


def normalize(text: str) -> str:
    """Paragraphs (split at blank lines) joined to one line each, runs of whitespace -> one space."""
    text = _RULE_LINE.sub("", text.replace("\r\n", "\n"))
    paras = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paras if p)


def _split_long(text: str, limit: int = MAX_PASSAGE_CHARS) -> list[str]:
    out, cur = [], ""
    for p in text.split("\n\n"):
        if cur and len(cur) + 2 + len(p) > limit:
            out.append(cur)
            cur = p
        else:
            cur = f"{cur}\n\n{p}" if cur else p
    if cur:
        out.append(cur)
    return out


def _docstring_items(modname: str):
    """(qualified name, doc) for a module, its public classes/functions and their public methods."""
    mod = importlib.import_module(modname)
    yield modname, inspect.getdoc(mod)
    names = vars(mod)
    for k in sorted(names):
        v = names[k]
        if k.startswith("_") or getattr(v, "__module__", None) not in (mod.__name__, modname):
            continue
        if inspect.isclass(v):
            yield f"{modname}.{k}", inspect.getdoc(v)
            for a in sorted(vars(v)):
                f = vars(v)[a]
                if a.startswith("_"):
                    continue
                if isinstance(f, (staticmethod, classmethod)):
                    f = f.__func__
                if isinstance(f, property):
                    f = f.fget
                if inspect.isfunction(f) or inspect.ismethoddescriptor(f) or inspect.isbuiltin(f):
                    yield f"{modname}.{k}.{a}", inspect.getdoc(f)
        elif inspect.isfunction(v) or inspect.isbuiltin(v):
            yield f"{modname}.{k}", inspect.getdoc(v)


def build_passages() -> list[Passage]:
    """The corpus, in a fixed order: language-reference topics (sorted), then docstrings by module."""
    import pydoc_data.topics
    passages: list[Passage] = []
    seen: set[str] = set()
    for key in sorted(pydoc_data.topics.topics):
        for j, chunk in enumerate(_split_long(normalize(pydoc_data.topics.topics[key]))):
            if chunk not in seen:
                seen.add(chunk)
                passages.append(Passage(f"topic:{key}#{j}", "topic", chunk))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in STDLIB_MODULES:
            try:
                items = list(_docstring_items(modname))
            except ImportError:          # a stripped-down build; recorded in the corpus sha256
                continue
            for name, doc in items:
                if not doc:
                    continue
                doc = normalize(doc)
                if len(doc) < MIN_DOC_CHARS or doc in seen:
                    continue
                seen.add(doc)
                for j, chunk in enumerate(_split_long(doc)):
                    passages.append(Passage(name if j == 0 else f"{name}#{j}", "doc", chunk))
    return passages


def is_held_out(i: int) -> bool:
    return i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2


def chat_conversations(train: list[Passage]) -> list[list[dict]]:
    """One Q/A conversation per named training docstring: the answer is its first paragraph."""
    convs = []
    named = [q for q in train if q.kind == "doc" and "#" not in q.name]
    for i, p in enumerate(named[::CHAT_EVERY]):
        answer = p.text.split("\n\n")[0]
        if len(answer) > CHAT_ANSWER_CHARS:      # cut at the last sentence end that fits
            cut = answer[:CHAT_ANSWER_CHARS]
            k = cut.rfind(". ")
            answer = cut[: k + 1] if k > 40 else cut.rsplit(" ", 1)[0] + " ..."
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(p.name)
        convs.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return convs


# ---- model ----------------------------------------------------------------------------------------

def demo_config(bos: int, eos: int, pad: int):
    from kimi_jax.config import ModelConfig, QuantConfig, RopeScaling
    return ModelConfig(
        vocab_size=FLAGS.vocab_size, hidden_size=FLAGS.hidden_size, intermediate_size=FLAGS.intermediate_size,
        moe_intermediate_size=FLAGS.moe_intermediate_size, num_hidden_layers=FLAGS.num_layers,
        num_attention_heads=FLAGS.num_heads, n_routed_experts=FLAGS.n_routed_experts,
        num_experts_per_tok=FLAGS.num_experts_per_tok, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=FLAGS.kv_lora_rank, q_lora_rank=FLAGS.q_lora_rank,
        qk_nope_head_dim=FLAGS.qk_nope_head_dim, qk_rope_head_dim=FLAGS.qk_rope_head_dim,
        v_head_dim=FLAGS.v_head_dim, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=FLAGS.routed_scaling_factor, rms_norm_eps=1e-5, rope_theta=50000.0,
        # Kimi-K2.5's YaRN settings (beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 1), scaled down
        rope_scaling=RopeScaling("yarn", FLAGS.yarn_factor, FLAGS.seq_len, 32.0, 1.0, 1.0, 1.0),
        max_position_embeddings=int(FLAGS.yarn_factor * FLAGS.seq_len),
        bos_token_id=bos, eos_token_id=(eos,), pad_token_id=pad, quantization=QuantConfig(group_size=32),
        model_type="kimi_k2")


def forward_with_loads(model, tokens_BT):
    """Transformer.__call__ (prefill, no cache) that also returns the expert loads [L_moe, E].

    Same modules and order as DecoderLayer.__call__: h = x + MLA(norm(x)); out = h + MoE(norm(h)); the
    router is evaluated once more on the MoE input to count its choices (no gradient flows through it).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from kimi_jax.model.transformer import scan_layers

    B, T = tokens_BT.shape
    E = model.cfg.n_routed_experts
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = jnp.take(model.embed_tokens.weight[...], tokens_BT, axis=0)
    if model.dense_layers is not None:
        x, _ = scan_layers(model.dense_layers, x, pos, None, absorbed=False)
    graphdef, state = nnx.split(model.moe_layers)

    def body(x, layer_state):
        layer = nnx.merge(graphdef, layer_state)
        a, _ = layer.self_attn(layer.input_layernorm(x), pos, None)
        h = x + a
        hn = layer.post_attention_layernorm(h)
        idx_TK, _ = layer.mlp.gate(jax.lax.stop_gradient(hn).reshape(-1, hn.shape[-1]))
        return h + layer.mlp(hn), jnp.bincount(idx_TK.reshape(-1), length=E)

    x, loads = jax.lax.scan(body, x, state)
    return model.logits(model.norm(x)), loads


def is_router_bias(path, _value) -> bool:
    return bool(path) and path[-1] == "e_score_correction_bias"


def export_tensors(params_pure: dict, cfg, train_cfg) -> dict:
    """Canonical HF name -> numpy array as the checkpoint stores it (INT4 experts when cfg says so)."""
    import ml_dtypes
    import numpy as np
    from checkpoints import int4, layout

    np_dtypes = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}

    expected = layout.expected_tensors(cfg)
    out: dict = {}
    for path, value in _flat(params_pure):
        path = tuple(map(str, path))
        value = np.asarray(value, np.float32)
        for idx, name in layout.hf_names_for(path, train_cfg.num_dense_layers, value.shape):
            w = value[idx]
            if name in expected:
                out[name] = w.astype(np_dtypes[expected[name][1]])
                continue
            base = name[: -len(".weight")]                  # an INT4 routed expert
            packed, scale = int4.pack_weight(w, cfg.quantization.group_size)
            out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scale
            out[base + ".weight_shape"] = np.array(w.shape, np.int32)
    missing = set(expected) - set(out)
    if missing:
        raise RuntimeError(f"export: no value for {sorted(missing)[:3]}")
    return out


def dequantized_twin(tensors: dict, cfg):
    """(bf16 config, tensors) with every INT4 expert replaced by its dequantized bf16 weight."""
    from checkpoints import int4
    from checkpoints.synthetic import BF16
    out = {}
    for name, a in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out[base + ".weight"] = int4.dequantize(a, tensors[base + ".weight_scale"],
                                                    cfg.quantization.group_size, BF16)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            out[name] = a
    return cfg.replace(quantization=None), out


# ---- evaluation (shared with tests/test_demo_model.py) --------------------------------------------

def probe_prompt(text: str, n_words: int = PROBE_PROMPT_WORDS) -> tuple[str, str]:
    """(first n_words words of the passage's first line, the rest), cut at a space."""
    words = text.split(" ")
    return " ".join(words[:n_words]), " " + " ".join(words[n_words:])


def first_word(s: str) -> str:
    m = re.match(r"\s*(\S+)", s)
    return m.group(1) if m else ""


def teacher_forced_accuracy(llm, texts) -> tuple[float, int]:
    """Next-token top-1 accuracy over every position after the first, pooled over texts."""
    import numpy as np
    hits = total = 0
    for t in texts:
        ids = llm.tokenizer.encode(t)
        pred = np.argmax(llm.logits(ids), axis=-1)[:-1]
        hits += int((pred == np.asarray(ids[1:])).sum())
        total += len(ids) - 1
    return hits / total, total


def next_word_accuracy(llm, texts, max_tokens: int = 6) -> tuple[float, list]:
    """Greedy-continue each probe's prompt; the fraction whose first generated word is the true one."""
    from kimi_jax.engine.sampling import SamplingParams
    prompts, truths = zip(*(probe_prompt(t) for t in texts))
    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    rows = [(p, first_word(o.outputs[0].text), first_word(c)) for p, o, c in zip(prompts, outs, truths)]
    return sum(g == w for _, g, w in rows) / len(rows), rows


def greedy_agreement(llm_a, llm_b, texts) -> tuple[float, int]:
    """Fraction of positions where the two models' teacher-forced argmax tokens agree."""
    import numpy as np
    same = total = 0
    for t in texts:
        ids = llm_a.tokenizer.encode(t)
        a = np.argmax(llm_a.logits(ids), -1)
        b = np.argmax(llm_b.logits(ids), -1)
        same += int((a == b).sum())
        total += len(ids)
    return same / total, total


# ---- main -----------------------------------------------------------------------------------------

def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.eval_only:
        evaluate(FLAGS.out_dir, FLAGS.bf16_out_dir or None)
        return
    if FLAGS.hidden_size % 32 or FLAGS.moe_intermediate_size % 32:
        raise app.UsageError("--hidden_size and --moe_intermediate_size must be multiples of 32 (INT4 group)")
    if FLAGS.num_layers < 3:
        raise app.UsageError("--num_layers must be >= 3 (a dense layer and at least 2 MoE layers)")
    t_start = time.time()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    # Everything the later steps need is imported now: a broken import fails before training, not after.
    from checkpoints import bpe, int4, layout, loader, safetensors_io  # noqa: F401
    from checkpoints.synthetic import write_checkpoint_from_tensors
    from kimi_jax.entrypoints import llm as api
    from kimi_jax.engine import sampling  # noqa: F401
    from kimi_jax.text.chat_template import ChatTemplate
    from kimi_jax.model.transformer import Transformer
    from kimi_jax.text.tokenizer import Tokenizer

    # 1. corpus
    passages = build_passages()
    train = [p for i, p in enumerate(passages) if not is_held_out(i)]
    held = [p for i, p in enumerate(passages) if is_held_out(i)]
    corpus_sha = hashlib.sha256("\x00".join(p.name + "\x01" + p.text for p in passages).encode()).hexdigest()
    n_chars = sum(len(p.text) for p in passages)
    logging.info("corpus: %d passages (%d held out), %.2f MB, sha256 %s", len(passages), len(held),
                 n_chars / 1e6, corpus_sha[:16])

    # 2. tokenizer
    tok_dir = tempfile.mkdtemp(prefix="kimi_demo_tok_")
    n_ranks = FLAGS.vocab_size - 256
    t0 = time.time()
    ranks = bpe.train_bpe((p.text for p in train), n_ranks)
    if len(ranks) != n_ranks:
        raise RuntimeError(f"BPE stopped at {len(ranks)} ranks (< {n_ranks}); lower --vocab_size")
    max_len = int(FLAGS.yarn_factor * FLAGS.seq_len)
    bpe.write_tokenizer_files(tok_dir, ranks, model_max_length=max_len)
    tok = Tokenizer.from_pretrained(tok_dir)
    template = ChatTemplate.from_pretrained(tok_dir)
    logging.info("BPE: %d ranks in %.0fs", len(ranks), time.time() - t0)
    eos, bos, pad = tok.eos_id, tok.bos_id, tok.pad_id
    convs = chat_conversations(train)
    docs = [tok.encode(p.text) for p in train]
    chats = [tok.encode(template.render(c, add_generation_prompt=False), allow_special=True) for c in convs]
    # one stream: documents and conversations in a seeded shuffle, each followed by [EOS]
    rng = np.random.default_rng(FLAGS.seed)
    pieces = docs + chats
    order = rng.permutation(len(pieces))
    stream = np.fromiter((t for i in order for t in (*pieces[i], eos)), np.int32)
    held_stream = np.fromiter((t for p in held for t in (*tok.encode(p.text), eos)), np.int32)
    n_doc_tokens, n_chat_tokens = sum(map(len, docs)), sum(map(len, chats))
    logging.info("tokens: %d train (%d docs, %d chat in %d conversations), %d held out",
                 len(stream), n_doc_tokens, n_chat_tokens, len(chats), len(held_stream))

    # 3. model
    cfg = demo_config(bos, eos, pad)
    train_cfg = cfg.replace(quantization=None)
    model = Transformer(train_cfg, dtype=jnp.float32, rngs=nnx.Rngs(FLAGS.seed))
    graphdef, bias, params = nnx.split(model, is_router_bias, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    S, B = FLAGS.seq_len, FLAGS.batch_size

    probe = jnp.asarray(stream[: 2 * S].reshape(2, S))
    ref, _ = model(probe, jnp.broadcast_to(jnp.arange(S), (2, S)))
    mine, _ = forward_with_loads(model, probe)
    err = float(jnp.max(jnp.abs(ref - mine)))
    if err > 1e-4:
        raise RuntimeError(f"forward_with_loads differs from Transformer.__call__ by {err}")

    warmup = min(FLAGS.warmup_steps, FLAGS.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, warmup, FLAGS.steps,
                                                  FLAGS.lr * FLAGS.min_lr_ratio)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(FLAGS.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=FLAGS.weight_decay, mask=decay_mask))
    opt_state = tx.init(params)

    def loss_fn(params, bias, tokens):
        m = nnx.merge(graphdef, bias, params)
        logits, loads = forward_with_loads(m, tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, loads

    @jax.jit
    def train_step(params, bias, opt_state, tokens):
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bias, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loads_f = loads.astype(jnp.float32)
        delta = FLAGS.bias_update_rate * jnp.sign(loads_f.mean(-1, keepdims=True) - loads_f)
        bias = jax.tree.map(lambda b: b + delta, bias)
        imbalance = loads_f.max(-1) / loads_f.mean(-1)             # max-load / mean-load per MoE layer
        return params, bias, opt_state, loss, imbalance, optax.global_norm(grads)

    @jax.jit
    def eval_loss(params, bias, tokens):
        return loss_fn(params, bias, tokens)[0]

    def windows(a: np.ndarray, n: int) -> np.ndarray:
        k = min(n, (len(a) - 1) // (S + 1))
        return a[: k * (S + 1)].reshape(k, S + 1)

    def mean_loss(params, bias, w: np.ndarray) -> float:
        return float(np.mean([eval_loss(params, bias, jnp.asarray(w[i: i + B]))
                              for i in range(0, len(w) - B + 1, B)]))

    held_windows = windows(held_stream, 64)
    train_windows = windows(stream, 64)
    curve, evals = [], []
    logging.info("model: %d parameters (%.1fM); %d steps of %d x %d tokens", n_params, n_params / 1e6,
                 FLAGS.steps, B, S)
    t_train = time.time()
    acc_loss, acc_n = 0.0, 0
    steps = range(1, FLAGS.steps + 1)
    if FLAGS.from_params:                      # resume at the export: trained weights + their stats
        params, bias, meta = load_trained(FLAGS.from_params, graphdef, params, bias)
        curve, evals, train_time = meta["loss_curve"], meta["held_out_curve"], meta["train_wall_time_s"]
        if meta["steps"] != FLAGS.steps or meta["seed"] != FLAGS.seed:
            raise app.UsageError(f"{FLAGS.from_params} was trained with other --steps/--seed")
        steps = ()
        logging.info("loaded trained parameters from %s", FLAGS.from_params)
    for step in steps:
        starts = rng.integers(0, len(stream) - S - 1, size=B)
        batch = np.stack([stream[s: s + S + 1] for s in starts])
        params, bias, opt_state, loss, imb, gnorm = train_step(params, bias, opt_state, jnp.asarray(batch))
        acc_loss, acc_n = acc_loss + float(loss), acc_n + 1
        if step % FLAGS.log_every == 0 or step == FLAGS.steps:
            el = time.time() - t_train
            curve.append({"step": step, "loss": round(acc_loss / acc_n, 4), "time_s": round(el, 1)})
            logging.info("step %5d  loss %.4f  lr %.2e  |g| %.2f  load max/mean %s  %.2fs/step",
                         step, acc_loss / acc_n, float(schedule(step)), float(gnorm),
                         " ".join(f"{x:.2f}" for x in np.asarray(imb)), el / step)
            print(f"step {step} loss {acc_loss / acc_n:.4f} ({el:.0f}s)", flush=True)
            acc_loss, acc_n = 0.0, 0
        if FLAGS.eval_every and step % FLAGS.eval_every == 0 and step != FLAGS.steps:
            h = mean_loss(params, bias, held_windows)
            evals.append({"step": step, "held_out_loss": round(h, 4)})
            logging.info("step %5d  held-out loss %.4f", step, h)
    if not FLAGS.from_params:
        train_time = time.time() - t_train
        final_held = mean_loss(params, bias, held_windows)
        evals.append({"step": FLAGS.steps, "held_out_loss": round(final_held, 4)})
        if FLAGS.params_out:
            save_trained(FLAGS.params_out, params, bias, {
                "steps": FLAGS.steps, "seed": FLAGS.seed, "loss_curve": curve, "held_out_curve": evals,
                "train_wall_time_s": round(train_time, 1)})
            logging.info("saved trained parameters to %s", FLAGS.params_out)
    final_train = mean_loss(params, bias, train_windows)
    final_held = mean_loss(params, bias, held_windows)
    logging.info("final: train loss %.4f, held-out loss %.4f, %.0fs", final_train, final_held, train_time)

    # 4. export
    model = nnx.merge(graphdef, bias, params)
    tensors = export_tensors(nnx.to_pure_dict(nnx.state(model)), cfg, train_cfg)
    out_dir = FLAGS.out_dir
    os.makedirs(out_dir, exist_ok=True)
    write_checkpoint_from_tensors(out_dir, cfg, tensors, tokenizer_dir=tok_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)
    long_paras = [t for t in (p.text.split("\n\n")[0] for p in train)
                  if len(t.split(" ")) >= PROBE_PROMPT_WORDS + 8]
    probe_texts = [long_paras[i] for i in np.linspace(0, len(long_paras) - 1, NUM_PROBES).astype(int)]
    held_texts = [p.text.split("\n\n")[0] for p in held if len(p.text) >= 200][:NUM_HELD_PROBES]
    log = {
        "description": "kimi_jax demo model: a small Kimi-K2-architecture model trained by launch/train_demo.py",
        "command": " ".join(["python -m launch.train_demo"] + sys.argv[1:]),
        "seed": FLAGS.seed,
        "flags": {f.name: f.value for f in FLAGS.get_flags_for_module(sys.modules[__name__])
                  if f.name not in ("out_dir", "bf16_out_dir", "eval_only", "params_out", "from_params")},
        "config": cfg.to_hf_dict(),
        "parameters": int(n_params),
        "corpus": {
            "source": "pydoc_data.topics language-reference pages + docstrings of STDLIB_MODULES "
                      "(launch/train_demo.py), whitespace-normalized; plus chat conversations made "
                      "from the docstrings (CHAT_QUESTIONS)",
            "python": platform.python_version(), "passages": len(passages), "held_out_passages": len(held),
            "chars": n_chars, "sha256": corpus_sha, "train_tokens": int(len(stream)),
            "doc_tokens": n_doc_tokens, "chat_tokens": n_chat_tokens, "chat_conversations": len(chats),
            "held_out_tokens": int(len(held_stream)),
        },
        "steps": FLAGS.steps, "tokens_seen": FLAGS.steps * B * S,
        "epochs": round(FLAGS.steps * B * S / len(stream), 2),
        "final_train_loss": round(final_train, 4), "final_held_out_loss": round(final_held, 4),
        "train_wall_time_s": round(train_time, 1), "total_wall_time_s": round(time.time() - t_start, 1),
        "platform": f"{platform.machine()}, {os.cpu_count()} cpus, jax {jax.__version__}",
        "loss_curve": curve, "held_out_curve": evals,
        "probes": {"train": probe_texts, "held_out": held_texts},
    }
    _write_log(out_dir, log)
    evaluate(out_dir, FLAGS.bf16_out_dir or None)


def _flat(tree: dict, prefix: tuple = ()):
    """(path tuple, leaf) for a nested dict (an nnx pure dict), keys in their own types."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def save_trained(path: str, params, bias, meta: dict) -> None:
    """The trained float32 parameters ('/'-joined paths) and the training stats, as one .npz."""
    import numpy as np
    from flax import nnx
    arrays = {f"{prefix}/" + "/".join(map(str, keys)): np.asarray(v)
              for prefix, state in (("params", params), ("bias", bias))
              for keys, v in _flat(nnx.to_pure_dict(state))}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)


def load_trained(path: str, graphdef, params, bias):
    """Inverse of save_trained, into states shaped like (params, bias); returns (params, bias, meta)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    data = np.load(path)
    for prefix, state in (("params", params), ("bias", bias)):
        pure = nnx.to_pure_dict(state)
        for keys, _ in list(_flat(pure)):
            d = pure
            for k in keys[:-1]:
                d = d[k]
            d[keys[-1]] = jnp.asarray(data[f"{prefix}/" + "/".join(map(str, keys))])
        nnx.replace_by_pure_dict(state, pure)
    return params, bias, json.loads(str(data["__meta__"]))


def _write_log(out_dir: str, log: dict) -> None:
    with open(os.path.join(out_dir, LOG_FILE), "w") as f:
        json.dump(log, f, indent=1, ensure_ascii=False)
        f.write("\n")


def bf16_twin_checkpoint(int4_dir: str, out_dir: str) -> None:
    """Write the bf16-dequantized twin of an INT4 checkpoint (same weights, experts dequantized)."""
    from checkpoints import layout
    from checkpoints.safetensors_io import CheckpointReader
    from checkpoints.synthetic import write_checkpoint_from_tensors
    from kimi_jax.config import ModelConfig
    cfg = ModelConfig.from_pretrained(int4_dir)
    with CheckpointReader(int4_dir) as reader:
        tensors = {n: reader.read(n) for n in layout.expected_tensors(cfg)}
    bf16_cfg, bf16_tensors = dequantized_twin(tensors, cfg)
    write_checkpoint_from_tensors(out_dir, bf16_cfg, bf16_tensors, tokenizer_dir=int4_dir)


def evaluate(out_dir: str, bf16_out_dir: str | None = None) -> dict:
    """Evaluate the written checkpoint (through kimi_jax.LLM) and record the numbers in its log;
    bf16_out_dir: keep the bf16-dequantized twin there (default: a temporary directory)."""
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.engine.sampling import SamplingParams
    with open(os.path.join(out_dir, LOG_FILE)) as f:
        log = json.load(f)
    probe_texts, held_texts = log["probes"]["train"], log["probes"]["held_out"]
    bf16_dir = bf16_out_dir or tempfile.mkdtemp(prefix="kimi_demo_bf16_")
    bf16_twin_checkpoint(out_dir, bf16_dir)
    llm = LLM(out_dir, dtype="float32", max_num_seqs=NUM_PROBES)
    llm_bf16 = LLM(bf16_dir, dtype="float32", max_num_seqs=1)
    tf_acc, tf_n = teacher_forced_accuracy(llm, probe_texts)
    nw_acc, rows = next_word_accuracy(llm, probe_texts)
    agree, agree_n = greedy_agreement(llm, llm_bf16, held_texts + probe_texts)
    for p, g, w in rows[:8]:
        logging.info("probe ...%r -> %r (true %r)", p[-40:], g, w)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        samples[prompt] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48))[0].outputs[0].text
        logging.info("sample %r -> %r", prompt, samples[prompt])
    chat = llm.chat([{"role": "user", "content": "What does json.dumps do?"}],
                    SamplingParams(temperature=0.0, max_tokens=96))[0].outputs[0]
    logging.info("chat -> %r (finish %s)", chat.text, chat.finish_reason)
    logging.info("probes: next-token accuracy %.3f over %d tokens; next-word accuracy %.3f over %d prompts; "
                 "INT4 vs bf16 greedy agreement %.4f over %d positions", tf_acc, tf_n, nw_acc, len(rows),
                 agree, agree_n)
    if not bf16_out_dir:
        shutil.rmtree(bf16_dir, ignore_errors=True)
    log["eval"] = {"probe_next_token_accuracy": round(tf_acc, 4), "probe_tokens": tf_n,
                   "probe_next_word_accuracy": round(nw_acc, 4), "probe_prompts": len(rows),
                   "int4_vs_bf16_greedy_agreement": round(agree, 4), "agreement_positions": agree_n,
                   "greedy_samples": samples,
                   "chat": {"user": "What does json.dumps do?", "reply": chat.text,
                            "finish_reason": chat.finish_reason}}
    _write_log(out_dir, log)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"done: {out_dir} {size / 1e6:.2f} MB; train loss {log['final_train_loss']}, held-out loss "
          f"{log['final_held_out_loss']}; probe next-token acc {tf_acc:.3f}, next-word acc {nw_acc:.3f}; "
          f"INT4 vs bf16 agreement {agree:.4f}", flush=True)
    return log


if __name__ == "__main__":
    define_flags()
    app.run(main)
