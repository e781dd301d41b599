"""The balanced schedule's combine kernel (pallas_kernels/mla/combine.py, interpret mode) vs its
XLA reference (`combine_items_xla`), both float32.

Tolerance 2e-6 absolute / 1e-5 relative: the same exponentials and sums in another order (the kernel
walks items in chunks with an online max; the reference takes the row max first), f32 rounding only
(~1e-7 relative seen). A part merged into the wrong row or dropped moves an output by O(1).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import combine as mc
from pallas_kernels.mla import decode as md


def _parts(seed, lengths, splits, M, A, quantum=16):
    """Item outputs for the balanced table of `lengths` (empty items: o = 0, lse = -inf as the
    decode kernels write them) and new-token parts (row 1's absent: lse -inf, o = 0)."""
    B = len(lengths)
    work = md.balanced_items(jnp.asarray(lengths), B * splits, quantum)
    I = B * splits
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    size = np.asarray(work[2] - work[1])
    o = jax.random.normal(ks[0], (I, M, A), jnp.float32)
    lse = 4.0 * jax.random.normal(ks[1], (I, M), jnp.float32)
    empty = jnp.asarray(size == 0)
    o = jnp.where(empty[:, None, None], 0.0, o)
    lse = jnp.where(empty[:, None], -jnp.inf, lse)
    o_new = jax.random.normal(ks[2], (B, M, A), jnp.float32)
    lse_new = 4.0 * jax.random.normal(ks[3], (B, M), jnp.float32)
    if B > 1:
        o_new, lse_new = o_new.at[1].set(0.0), lse_new.at[1].set(-jnp.inf)
    return work, o, lse, o_new, lse_new


@pytest.mark.parametrize("lengths,splits,M,A,block_a,block_g", [
    ([3000, 40, 0, 500], 4, 8, 64, 0, 4),        # a long row over many chunks of 4 items, an empty row
    ([100, 100, 100], 2, 12, 32, 16, 16),         # equal rows (the rows schedule's items), 2 column blocks
    ([0, 0], 3, 4, 32, 0, 2),                     # nothing cached: the new-token parts alone (row 1: none)
    ([70000], 5, 8, 64, 32, 8),                   # one row, every item its own
    ([5000, 7, 7, 7], 3, 4, 128, 0, 0),           # automatic blocks (columns split: few programs)
    ([640, 512, 600, 16], 4, 4, 32, 0, 2),        # 5 / 4 / 5 / 1 items: both sides of FEW_ITEMS
])
def test_kernel_matches_reference(lengths, splits, M, A, block_a, block_g):
    work, o, lse, o_new, lse_new = _parts(len(lengths) * 10 + splits, lengths, splits, M, A)
    B = len(lengths)
    got_o, got_lse = mc.combine_items(o, lse, work[3, :B], work[4, :B], o_new, lse_new, interpret=True,
                                      block_a=block_a, block_g=block_g)
    want_o, want_lse = mc.combine_items_xla(o, lse, work[0], o_new, lse_new)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=2e-6, rtol=1e-5)
    if B > 1 and lengths[1] == 0:          # row 1: no items, no new-token part
        assert np.all(np.asarray(got_o[1]) == 0) and np.all(np.isneginf(np.asarray(got_lse[1])))


def test_combine_picks_by_size():
    """`combine`: the XLA contraction for small shapes, the kernel above its `xla_max_macs`;
    both give the same merge (the kernel's shapes here are small: the threshold is lowered)."""
    work, o, lse, o_new, lse_new = _parts(5, [900, 30, 0], 2, 4, 32)
    want = mc.combine_items_xla(o, lse, work[0], o_new, lse_new)
    import unittest.mock as um
    calls = []
    real = mc.combine_items
    with um.patch.object(mc, "combine_items", lambda *a, **k: calls.append(1) or real(*a, **k)):
        small = mc.combine(o, lse, work, o_new, lse_new, interpret=True)
        big = mc.combine(o, lse, work, o_new, lse_new, interpret=True, xla_max_macs=0)
    assert len(calls) == 1
    for got in (small, big):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-6, rtol=1e-5)
    assert mc._auto_blocks(64, 64, 512) == (512, 16) and mc._auto_blocks(8, 8, 512) == (64, 64)


def test_spans_match_rows_and_bad_blocks():
    work = np.asarray(md.balanced_items(jnp.asarray([500, 0, 33, 2000]), 8, 16))
    row, start, end, first, count = work
    for b in range(4):
        mine = np.nonzero((row == b) & (end > start))[0]
        assert count[b] == len(mine) and (not len(mine) or first[b] == mine[0])
    with pytest.raises(ValueError, match="block_a"):
        mc.combine_items(jnp.zeros((2, 1, 48)), jnp.zeros((2, 1)), jnp.zeros(1, jnp.int32),
                         jnp.ones(1, jnp.int32), jnp.zeros((1, 1, 48)), jnp.zeros((1, 1)), interpret=True)


def test_sweep_checks_every_config_on_the_device_it_runs(tmp_path):
    """`kimi-bench mla --combine_sweep` (the GPU tuning sweep of this kernel) on the CPU (--dry: interpret
    mode, 32 latent columns): each config is checked against the reference before it is timed, and the
    run exits non-zero when one disagrees (here none does: a long row over chunks and equal rows); a
    malformed case is a usage error before any case runs. In a fresh interpreter: the sweep times each
    config under jax.profiler, which in a process where other tests already traced can take minutes."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}

    def bench(*args):
        return subprocess.run([sys.executable, "-m", "launch.bench", "mla", "--dry", "--combine_sweep", *args],
                              cwd=root, env=env, capture_output=True, text=True, timeout=300)
    r = bench("--combine_cases=4:2:8:300:20,3:2:6:64:64", "--combine_warps=1", "--combine_block_as=16",
              "--combine_block_gs=0", "--combine_calls=1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if " 4:2:8" in x or " 3:2:6" in x]
    assert len(lines) == 4 and all(" OK " in x for x in lines), r.stdout
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [(x["case"], x["config"], x["ok"]) for x in rows] == [
        (case, config, True) for case in ("4:2:8:300:20", "3:2:6:64:64") for config in ("xla", "(1, 16, 0)")]
    bad = bench("--combine_cases=4:2:8:300:20,4:2:3:5:5", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "'4:2:3:5:5' needs" in bad.stderr
    assert "4:2:8:300:20" not in bad.stdout                 # rejected before any case ran
