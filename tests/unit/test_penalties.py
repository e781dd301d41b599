"""Logits adjustments (kimi_jax.engine.penalties) against plain numpy loops written from vLLM's
documented semantics, on fixed logits; the sampler with a -100 logit_bias; SamplingParams validation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.engine import penalties
from kimi_jax.engine.sampling import SamplingArrays, SamplingParams, sample

V = 32


def reference(logits, params, prompt, outputs, banned, stops, step):
    """One row, plain Python: bans and logit_bias, min_tokens, then repetition (prompt and output
    tokens), frequency and presence (output tokens)."""
    x = [float(v) for v in logits]
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for t in banned:
        x[t] = -np.inf
    if step < params.min_tokens:
        for t in stops:
            x[t] = -np.inf
    for t in range(len(x)):
        count = outputs.count(t)
        if t in prompt or count:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return np.asarray(x, np.float32)


def test_adjustments_match_the_reference():
    """Four rows with different mixes (and one row adjusting nothing), counts from random prompts and
    outputs; float32 arithmetic on both sides: equal to 1e-6 (one rounding of a division or product)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, V)).astype(np.float32)
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3),
              SamplingParams(repetition_penalty=0.6, logit_bias={3: 5.0, 7: -2.5}),
              SamplingParams(frequency_penalty=1.5, min_tokens=4, max_tokens=8),
              SamplingParams(presence_penalty=2.0, min_tokens=2, logit_bias={0: 100.0}),
              SamplingParams()]
    prompts = [rng.integers(0, V, 6).tolist() for _ in params]
    outputs = [rng.integers(0, V, 9).tolist() for _ in params]
    stops, steps = (1, 2), np.asarray([0, 5, 3, 2, 1], np.int32)
    banned = [[], [9], [], [4, 5], []]
    rows, occ = [], np.zeros((len(params) + 1, V), np.int32)
    for b, (p, pr, out) in enumerate(zip(params, prompts, outputs)):
        adj = penalties.row_adjust(p, stops, [])
        rows.append(None if adj is None else (adj, banned[b], b if adj.has_penalties else -1, 1))
        occ[b] = penalties.occurrence_row(V, pr, out)
    assert rows[-1] is None
    adj = penalties.build(rows, penalty_pad_row=len(params))
    got = np.asarray(penalties.adjust_logits(jnp.asarray(logits), adj, jnp.asarray(steps),
                                             jnp.asarray(occ)[adj.occ_row]))
    for b, p in enumerate(params):
        want = reference(logits[b], p, prompts[b], outputs[b], banned[b], stops if p.min_tokens else (), steps[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-6, err_msg=f"row {b}")
    # the pool after sampling: +2 at each counted row's token, padding slot untouched for counted rows
    tokens = jnp.asarray([3, 4, 5, 6, 7], jnp.int32)
    after = np.asarray(penalties.count_sampled(jnp.asarray(occ), adj, tokens))
    expect = occ.copy()
    for b in range(len(params)):
        if rows[b] is not None and rows[b][2] >= 0:
            expect[b, int(tokens[b])] += 2
        elif adj.occ_row[b] == len(params):
            expect[len(params), int(tokens[b])] += 2 * int(adj.counts[b])
    np.testing.assert_array_equal(after, expect)


def test_bad_words_follow_vllm_rules():
    """Tokenized as written and with a leading space (kept when it gives a different first token and
    the same length); a single-token word is always banned, a longer one when its other tokens end
    the output (never matched against the prompt)."""
    class Tok:
        table = {"ab": [1, 2], " ab": [3, 2], "c": [4], " c": [5, 6]}

        def encode(self, text):
            return self.table[text]

    assert penalties.bad_words_token_ids(["ab", " c"], Tok()) == [[1, 2], [3, 2], [4]]
    words = [(1, 2), (3, 2), (7, 8, 9)]
    assert penalties.banned_now(words, []) == []
    assert penalties.banned_now(words, [5, 1]) == [2]
    assert penalties.banned_now(words, [3]) == [2]
    assert penalties.banned_now(words, [7, 8]) == [9]
    assert penalties.banned_now(words, [7, 8, 1]) == [2]
    adj = penalties.row_adjust(SamplingParams(), (), [[4], [1, 2]])
    assert adj.bias == {4: -np.inf} and adj.bad_words == ((1, 2),)


def test_logit_bias_minus_100_is_never_sampled():
    """The most likely token (p = 0.5) with bias -100 (p < e^-100 relative): 2000 temperature-1 draws
    never pick it, and greedy picks the next best."""
    logits = np.log(np.asarray([0.05, 0.5, 0.2, 0.25], np.float32))
    for temperature, n in ((1.0, 2000), (0.0, 1)):
        p = SamplingParams(temperature=temperature, logit_bias={1: -100.0})
        adj = penalties.build([(penalties.row_adjust(p, (), []), [], -1, 1)], 0)
        sp = SamplingArrays.build([p], [7], adjust=adj)
        f = jax.jit(jax.vmap(lambda s: sample(penalties.adjust_logits(jnp.asarray(logits)[None], adj,
                                                                      jnp.full((1,), s)), sp, jnp.full((1,), s))))
        draws = np.asarray(f(jnp.arange(n)))
        assert 1 not in draws
        if temperature == 0.0:
            assert draws.ravel().tolist() == [3]
        else:
            assert set(np.unique(draws)) == {0, 2, 3}


@pytest.mark.parametrize("kw, field", [
    (dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"), (dict(best_of=2, temperature=0.0), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=4), "min_tokens"), (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(bad_words="word"), "bad_words"), (dict(bad_words=[""]), "bad_words")])
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw).validate()
