"""What several kimi-bench suites share: a timed run of requests through the continuous-batching
engine, device and wall time of one executable, the host's cost of an executable's arguments, and writing
a suite's JSON result."""
from __future__ import annotations

import json
import os
import random
import statistics
import time


def run_prompts(llm, prompts, sp, **core):
    """`prompts` (token id lists) through a fresh engine core of `llm` (core: its settings,
    `Frontend.make_core`) with SamplingParams `sp`:
    request i is named str(i) and seeded i; all are added at once (every request arrives at the start,
    so queueing behind the batch is in its time to first token) and run until every one finished.
    Returns (wall seconds from the first add to the end, the requests, the engine's stats)."""
    engine = llm.frontend.make_core(**core)
    groups = [engine.make_request(str(i), p, sp, seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for g in groups:
        engine.add(g)
    engine.run()
    return time.perf_counter() - t0, [r for g in groups for r in g], engine.stats


def write_json(out: str, name: str, obj) -> str:
    """Write `obj` as JSON to `out` when it names a .json file, else to `out`/`name` (the directory
    made as needed). Returns the path."""
    path = out if out.endswith(".json") else os.path.join(out, name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    return path


def timed(f, args, copies: int, reps: int) -> dict:
    """f(*args) (an executable of `copies` calls) compiled and run: per call, the profiler's kernel time
    (kernel_us), the span of its device ops (span_us), the median wall time over `reps` runs (wall_us);
    the kernels per executable (kernels) and their names, most expensive first."""
    import jax
    from kimi_jax.tools.profiling import device_ops_per_call
    compiled = jax.jit(f).lower(*args).compile()
    per_op, span, _ = device_ops_per_call(compiled, args, 1)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls.append(time.perf_counter() - t0)
    return dict(kernel_us=sum(per_op.values()) / copies, span_us=span / copies,
                wall_us=1e6 * statistics.median(walls) / copies, kernels=len(per_op), kernel_names=list(per_op))


def dispatch_cost(state, calls: int = 200, repeats: int = 5) -> dict:
    """The host's share of a dispatch that is the arguments' alone: an executable that takes `state` (every
    leaf kept) and a token vector and adds one to the tokens, enqueued `calls` times back to back, against
    the same executable without `state`. us per call, the median of `repeats` loops."""
    import jax
    import jax.numpy as jnp
    with_state = jax.jit(lambda s, x: x + 1, keep_unused=True)
    alone = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8,), jnp.int32)
    res = dict(arguments=len(jax.tree.leaves(state)))
    for name, call in (("with_weights_us", lambda y: with_state(state, y)), ("alone_us", alone)):
        y = jax.block_until_ready(call(x))
        loops = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                y = call(y)
            loops.append((time.perf_counter() - t0) / calls)
            jax.block_until_ready(y)
        res[name] = 1e6 * statistics.median(loops)
    res["per_argument_us"] = (res["with_weights_us"] - res["alone_us"]) / max(res["arguments"], 1)
    return res


def random_pages(engine, num_pages: int, seed: int = 0, page_size: int = 16):
    """A page pool as `ModelSteps.init_pages` places it, filled with random latents (0.1 x normal)."""
    import jax
    import jax.numpy as jnp
    pages = engine.init_pages(num_pages, page_size)
    fill = jax.jit(lambda p, k: {n: (0.1 * jax.random.normal(jax.random.fold_in(k, i), v.shape, jnp.float32)
                                     ).astype(v.dtype) for i, (n, v) in enumerate(sorted(p.items()))},
                   donate_argnums=0)
    return jax.block_until_ready(fill(pages, jax.random.PRNGKey(seed)))


def synthetic_ranks(n_base: int = 163_584, seed: int = 0) -> dict:
    """The byte-level ranks of a Kimi-shaped tokenizer of n_base ranks: the 256 bytes, the demo
    tokenizer's merges, then random words, CJK, numbers, punctuation and whitespace runs (seeded)."""
    from kimi_jax.entrypoints.llm import demo_model_path
    from kimi_jax.text.tokenizer import load_tiktoken_ranks
    demo = os.path.join(demo_model_path(), "tiktoken.model")
    toks = [bytes([b]) for b in range(256)]
    seen = set(toks)
    for t, _ in sorted(load_tiktoken_ranks(demo).items(), key=lambda kv: kv[1]):
        if t not in seen:
            seen.add(t), toks.append(t)
    if n_base < len(toks):
        raise ValueError(f"{n_base} ranks are fewer than the 256 bytes and the demo tokenizer's "
                         f"merges ({len(toks)}); a vocabulary of at least {len(toks) + 256} is needed")
    rng = random.Random(seed)
    lower = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12, 9, 8, 7.5, 7, 6.7, 6.3, 6, 5.9, 4.3, 4, 2.8, 2.8, 2.4, 2.4, 2.2, 2, 2, 1.9, 1.5, 1, .8, .2, .2, .1, .1]
    punct = list('{}[]":,.()-_/\\!?;\'*#@&%$+=<>|')
    while len(toks) < n_base:
        r = rng.random()
        if r < 0.6:
            w = "".join(rng.choices(lower, weights, k=rng.randint(2, 10)))
            if rng.random() < 0.2:
                w = w.capitalize()
            s = (" " + w) if rng.random() < 0.6 else w
        elif r < 0.72:
            s = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        elif r < 0.77:
            s = str(rng.randint(0, 999))
        elif r < 0.9:
            s = (" " if rng.random() < 0.3 else "") + "".join(rng.choices(punct, k=rng.randint(1, 4)))
        elif r < 0.95:
            s = rng.choice([" ", "\n", "\t"]) * rng.randint(2, 16)
        else:
            s = "".join(chr(rng.randint(0x00C0, 0x04FF)) for _ in range(rng.randint(1, 6)))
        b = s.encode("utf-8")
        if b not in seen:
            seen.add(b), toks.append(b)
    return {t: i for i, t in enumerate(toks)}


def synthetic_tokenizer(n_base: int = 163_584, seed: int = 0):
    """A Kimi-shaped tokenizer with n_base ranks (`synthetic_ranks`) and Kimi's special tokens."""
    from checkpoints.bpe import KIMI_SPECIAL_TOKEN_OFFSETS, NON_SPECIAL_TOKENS
    from kimi_jax.text.tokenizer import NUM_RESERVED_SPECIAL_TOKENS, Tokenizer
    ranks = synthetic_ranks(n_base, seed)
    named = {n_base + off: name for name, off in KIMI_SPECIAL_TOKEN_OFFSETS.items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + NUM_RESERVED_SPECIAL_TOKENS + 2)}
    return Tokenizer(ranks, specials, pad_token="[PAD]", unk_token="[UNK]", non_special=NON_SPECIAL_TOKENS)
