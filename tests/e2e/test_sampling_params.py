"""vLLM's SamplingParams through the engine (tiny checkpoint): n and best_of over one shared prefill,
penalties against a host loop over llm.logits, min_tokens, logit_bias, bad_words, prompt_logprobs
and Logprob fields against llm.logits, prompt dicts, dtype "auto", and penalties under overlap
scheduling and preemption."""
from __future__ import annotations

import numpy as np
import pytest

from kimi_jax import SamplingParams
from kimi_jax.config import preset
from kimi_jax.engine.args import EngineConfig

CFG = preset("tiny")


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


PROMPT = list(range(5, 40))           # 35 tokens: three prompt chunks of 16


def use_tokenizer(monkeypatch, llm, tokenizer):
    """`tokenizer` for everything of llm that reads one (the tiny checkpoint has none): its frontend
    (the cores it makes), input and output processors; generate's kept core is made anew."""
    for owner in (llm, llm.frontend, llm.inputs, llm.outputs):
        monkeypatch.setattr(owner, "tokenizer", tokenizer)
    monkeypatch.setattr(llm, "_core", None)


def run(llm, groups, num_pages=None, **changes):
    """Requests of (prompt, params, seed) through one fresh engine core (num_pages: its pool, default
    the fixture's; changes: its other make_core overrides), each group's samples added together."""
    if num_pages is not None:
        changes["num_pages"] = num_pages
    core = llm.frontend.make_core(**changes)
    out = [core.make_request(str(i), p, sp, seed=seed) for i, (p, sp, seed) in enumerate(groups)]
    for g in out:
        core.add(g)
    core.run()
    s = core.scheduler
    assert len(s.pool.free) == s.pool.num_pages and not s.running
    return out, core.stats


def test_n_samples_share_one_prefill(pool_llm):
    """n = 3 with a seed: distinct, reproducible samples with indices 0..2; the prompt but its last
    token is prefilled once (prompt tokens counted: 34 + 3 x 1) and each sample's tokens equal those
    it gets prefilling alone (the copied pages hold the same latents)."""
    sp = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=6, ignore_eos=True)
    a = pool_llm.generate([PROMPT], sp)[0]
    b = pool_llm.generate([{"prompt_token_ids": PROMPT}], sp)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    toks = [o.token_ids for o in a.outputs]
    assert toks == [o.token_ids for o in b.outputs]
    assert len({tuple(t) for t in toks}) == 3
    (shared,), stats = run(pool_llm, [(PROMPT, sp, 11)], num_pages=64)
    assert stats["prompt_tokens"] == len(PROMPT) - 1 + 3 and stats["preemptions"] == 0, stats
    core = pool_llm.frontend.make_core(num_pages=64)
    alone = core.make_request("x", PROMPT, sp, seed=11)
    for r in alone:
        core.add([r])                 # each sample on its own: its own prefill of the whole prompt
    core.run()
    assert [r.output_ids for r in shared] == [r.output_ids for r in alone] == toks


@pytest.mark.slow
def test_best_of_keeps_the_highest_cumulative_logprob(pool_llm):
    """best_of = 4, n = 2 returns the two of the four samples (the same streams as n = 4) with the
    highest cumulative logprob, best first."""
    four = pool_llm.generate([PROMPT], SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=5, logprobs=0,
                                                 ignore_eos=True))[0].outputs
    best = pool_llm.generate([PROMPT], SamplingParams(temperature=1.0, n=2, best_of=4, seed=5, max_tokens=5,
                                                 logprobs=0, ignore_eos=True))[0].outputs
    want = sorted(four, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in want]
    assert [o.index for o in best] == [0, 1]


def test_penalties_match_a_host_loop_over_llm_logits(pool_llm):
    """Greedy with repetition, frequency and presence penalties and a logit_bias: each token is the
    argmax of llm.logits(prompt + output so far) adjusted in numpy (vLLM's formulas)."""
    prompt = [7, 8, 9, 7, 8, 9, 10]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8,
                        frequency_penalty=0.7, presence_penalty=0.4, logit_bias={11: 3.0})
    got = pool_llm.generate([prompt], sp)[0].outputs[0].token_ids
    out = []
    for _ in range(10):
        x = pool_llm.logits(prompt + out)[-1].astype(np.float64)
        x[11] += 3.0
        counts = np.bincount(out, minlength=x.size)
        seen = (counts > 0) | np.isin(np.arange(x.size), prompt)
        x = np.where(seen, np.where(x > 0, x / 1.8, x * 1.8), x) - 0.7 * counts - 0.4 * (counts > 0)
        out.append(int(x.argmax()))
    assert got == out
    assert got != pool_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.slow
def test_min_tokens_logit_bias_and_bad_words(pool_llm, monkeypatch, word_tokenizer):
    """A +100 bias on eos ends a request at once; min_tokens = 3 holds eos (and stop_token_ids) off
    for 3 tokens. A -100 bias keeps the greedy first token out of every sampled row. bad_words: a
    single-token word never appears; a two-token word's second token never follows its first."""
    eos = pool_llm.config.eos_token_id[0]
    forced = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0})
    assert pool_llm.generate([PROMPT], forced)[0].outputs[0].token_ids == [eos]
    held = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3,
                          stop_token_ids=[eos + 1])
    o = pool_llm.generate([PROMPT], held)[0].outputs[0]
    assert len(o.token_ids) == 4 and o.token_ids[-1] == eos and o.finish_reason == "stop"
    assert eos not in o.token_ids[:3] and eos + 1 not in o.token_ids[:3]
    greedy = pool_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    first = greedy.token_ids[0]
    sampled = pool_llm.generate([PROMPT], SamplingParams(temperature=1.0, n=6, seed=3, max_tokens=6, ignore_eos=True,
                                                    logit_bias={first: -100.0}))[0].outputs
    assert all(first not in s.token_ids for s in sampled)
    use_tokenizer(monkeypatch, pool_llm, word_tokenizer)
    g = greedy.token_ids
    banned = pool_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   bad_words=[f"w{g[0]}", f"w{g[2]} w{g[3]}"]))[0].outputs[0]
    t = banned.token_ids
    assert g[0] not in t and not any(a == g[2] and b == g[3] for a, b in zip(t, t[1:])), (g, t)


def test_prompt_logprobs_and_logprob_fields_equal_llm_logits(pool_llm, monkeypatch, word_tokenizer):
    """prompt_logprobs (the prompt spans three chunks; and through the shared prefill of n = 2): None
    first, then per position the prompt token's logprob and rank and the top-3, equal to
    log_softmax(llm.logits) to 2e-5 (float32 logits of two attention paths); the output's Logprob
    entries (token, rank, top-2, decoded_token) likewise against llm.logits of prompt + output."""
    use_tokenizer(monkeypatch, pool_llm, word_tokenizer)
    ref = log_softmax(pool_llm.logits(PROMPT))
    for n in (1, 2):
        res = pool_llm.generate([PROMPT], SamplingParams(temperature=0.0, n=n, max_tokens=3, logprobs=2,
                                                    prompt_logprobs=3, ignore_eos=True))[0]
        plp = res.prompt_logprobs
        assert plp[0] is None and len(plp) == len(PROMPT)
        for p in range(1, len(PROMPT)):
            row, tok = ref[p - 1], PROMPT[p]
            entry = plp[p]
            top = np.argsort(-row)[:3]
            assert set(entry) == {tok, *top.tolist()}
            assert entry[tok].rank == 1 + int((row > row[tok] + 1e-5).sum()) or abs(
                row[np.argsort(-row)[entry[tok].rank - 1]] - row[tok]) < 1e-5
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t]) < 2e-5 and lp.decoded_token == f" w{t}"
    out = res.outputs[0]
    for j, (t, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = log_softmax(pool_llm.logits(PROMPT + out.token_ids[:j])[-1])
        assert next(iter(entry)) == t and entry[t].rank == 1        # greedy: the argmax, listed first
        assert set(entry) == {t, *np.argsort(-row)[:2].tolist()}
        assert all(abs(v.logprob - row[i]) < 2e-5 for i, v in entry.items())


def test_prompt_dicts_and_dtype_auto(pool_llm):
    """vLLM's prompt dicts (one or a list) give the token-list results; bad ones fail with a clear
    error. dtype 'auto': the checkpoint's torch_dtype on an accelerator, float32 on CPU."""
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = pool_llm.generate([PROMPT[:5], PROMPT[:7]], sp)
    got = pool_llm.generate([{"prompt_token_ids": PROMPT[:5]}, {"prompt_token_ids": PROMPT[:7]}], sp)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert pool_llm.generate({"prompt_token_ids": PROMPT[:5]}, sp)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="request 0: a text prompt needs a tokenizer"):
        pool_llm.generate({"prompt": "hello"}, sp)
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        pool_llm.generate([{"tokens": [1, 2]}], sp)
    with pytest.raises(ValueError, match="request 1: a prompt is a string"):
        pool_llm.generate([[1, 2], 3.5], sp)
    assert EngineConfig(dtype="auto").resolve_dtype("cpu") == "float32"
    assert EngineConfig(pool_llm.model_path, dtype="auto").resolve_dtype("gpu") == "bfloat16"   # its torch_dtype
    assert pool_llm.dtype.__name__ == "float32"
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        EngineConfig(dtype="float16")


@pytest.mark.slow
def test_penalties_under_overlap_and_preemption(pool_llm):
    """Seeded and greedy rows with penalties, a logit_bias and min_tokens, more requests than slots,
    pages short enough to preempt: overlap on and off give the same tokens (the device counts
    follow the tokens it feeds itself), and so does a pool with room for everything (a preempted
    request's counts are rebuilt from its output)."""
    rng = np.random.default_rng(2)
    ps = [rng.integers(2, CFG.vocab_size, int(rng.integers(3, 30))).tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0.9 if i % 2 else 0.0, max_tokens=int(m), ignore_eos=True,
                             repetition_penalty=1.5, frequency_penalty=0.6 * (i % 3), presence_penalty=0.5,
                             logit_bias={int(i): 2.0}, min_tokens=1)
              for i, m in enumerate(rng.integers(8, 16, len(ps)))]
    results = {}
    for overlap, pages in ((False, 24), (True, 24), (False, 400)):
        groups = [(p, sp, 100 + i) for i, (p, sp) in enumerate(zip(ps, params))]
        reqs, stats = run(pool_llm, groups, pages, overlap_scheduling=overlap)
        results[overlap, pages] = [r.output_ids for (r,) in reqs]
        if pages == 24:
            assert stats["preemptions"] > 0, stats
        if overlap:
            assert stats["overlapped_steps"] > 0, stats
    assert results[True, 24] == results[False, 24] == results[False, 400]


def test_max_logprobs_is_enforced_by_generate_and_the_engine_core(pool_llm):
    """LLM's max_logprobs (vLLM's 20) caps a request's logprobs in LLM.generate and in the engine core
    the server and kimi-batch submit to."""
    from kimi_jax.engine.validation import RequestError
    assert pool_llm.max_logprobs == 20
    with pytest.raises(ValueError, match="request 0: logprobs 25 exceeds max_logprobs 20"):
        pool_llm.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=25))
    sp, core = SamplingParams(max_tokens=1, prompt_logprobs=21), pool_llm.frontend.make_core()
    with pytest.raises(RequestError, match="prompt_logprobs 21 exceeds max_logprobs 20"):
        core.make_request("x", [1, 2], sp, seed=0)


@pytest.mark.parametrize("layout", [{}, dict(step_layout="ragged")], ids=["padded", "ragged"])
def test_a_vocabulary_padded_past_the_tokenizer_never_returns_an_undecodable_id(layout):
    """A model of 8,192 vocabulary rows with the demo's tokenizer (4,098 ids; random weights, so the
    padded rows get as much mass as any): no sampled, greedy, constrained, top-logprob or
    prompt-top-logprob id is >= 4,098, and every output decodes (none did before: the first such id
    raised in the detokenizer, losing the whole batch)."""
    from kimi_jax import LLM
    from kimi_jax.engine.structured_params import StructuredOutputsParams
    llm = LLM(CFG.replace(vocab_size=8192), tokenizer="checkpoints/demo", dtype="float32",
              max_num_seqs=4, max_model_len=128, **layout)
    limit = llm.tokenizer.vocab_size
    assert llm.frontend.steps.vocab_limit == limit == 4098
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=1),
              SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, prompt_logprobs=3),
              SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(
                  json={"type": "array", "items": {"type": "string"}}))]
    out = llm.generate(["hello there", "the world", "a list"], params)
    for o in out:
        assert max(o.outputs[0].token_ids) < limit and isinstance(o.outputs[0].text, str)
    assert all(i < limit for d in out[1].outputs[0].logprobs for i in d)
    assert all(i < limit for d in out[1].prompt_logprobs[1:] for i in d)
