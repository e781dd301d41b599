"""On-device sampling: greedy rows, filtered rows and unfiltered rows in one batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.engine.sampling import SamplingArrays, SamplingParams, sample

V = 6
LOGITS = np.log(np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10], np.float32))


def _draws(params, n=4000, seed=0):
    """n draws per row (step 0..n-1) of `sample` over the same logits in every row: [n, B]."""
    sp = SamplingArrays.build(params, [seed + i for i in range(len(params))])
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (len(params), V))
    f = jax.jit(jax.vmap(lambda s: sample(logits, sp, jnp.full((len(params),), s, jnp.int32))))
    return np.asarray(f(jnp.arange(n)))


def test_rows_follow_their_own_parameters_and_not_their_batch_mates():
    """Row 0 greedy, row 1 plain temperature 1, row 2 top_k 2. Checks: greedy is the argmax; top-k draws
    only the 2 best tokens, in their renormalized ratio; the plain row follows softmax(logits) (chi-square,
    5 dof, 4000 draws: the 1e-3 critical value is 20.5; a row drawn from the wrong distribution, e.g. the
    top-k one, gives chi2 > 500); and the plain row's tokens are identical when the batch has no filtered
    row (the sort-free path) and when it has one (the sorted path runs for the batch)."""
    plain, topk, greedy = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
                           SamplingParams(temperature=0.0))
    mixed = _draws([greedy, plain, topk])
    assert (mixed[:, 0] == np.argmax(LOGITS)).all()
    assert set(np.unique(mixed[:, 2])) <= {1, 3}
    frac1 = (mixed[:, 2] == 1).mean()
    assert abs(frac1 - 0.30 / 0.55) < 0.03          # binomial sd 0.008 at n=4000: > 3.5 sd
    counts = np.bincount(mixed[:, 1], minlength=V)
    expected = np.exp(LOGITS) / np.exp(LOGITS).sum() * len(mixed)
    assert ((counts - expected) ** 2 / expected).sum() < 20.5
    alone = _draws([greedy, plain, greedy])        # same keys for rows 0, 1; no filtered row
    assert (alone[:, 1] == mixed[:, 1]).all()


def test_static_modes_match_the_device_decision():
    """The engine picks the sampler path on the host (`sample_mode`: no device conditional in the step);
    each static path gives exactly the tokens of the lax.cond path, for batches that need it."""
    from kimi_jax.engine.sampling import sample_mode
    plain, topk, greedy = (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.5),
                           SamplingParams(temperature=0.0))
    logits = jax.random.normal(jax.random.PRNGKey(3), (3, 50))
    for params, mode in (([greedy] * 3, "greedy"), ([greedy, plain, greedy], "plain"),
                         ([greedy, plain, topk], "filtered")):
        sp = SamplingArrays.build(params, [11, 12, 13])
        assert sample_mode(sp) == mode
        steps = jnp.arange(3, dtype=jnp.int32)
        for s in range(20):
            dev = sample(logits, sp, steps + s)
            static = jax.jit(sample, static_argnames="mode")(logits, sp, steps + s, mode=mode)
            assert (np.asarray(dev) == np.asarray(static)).all(), (mode, s)
