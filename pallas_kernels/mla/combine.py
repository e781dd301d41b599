"""The flash-decoding combine of the balanced schedule's work items, one Pallas (Triton) launch.

Under `schedule='balanced'` (`mla_decode.balanced_items`) the decode kernels' B x K programs each
read one work item: part of ONE row's cached tokens, items of a row contiguous and in row order, a
long row holding many more items than a short one. Each item wrote its normalized output
o [G, M, A] (f32, G = B x K items, M = T x N query rows) and its log-sum-exp lse [G, M]. Row b's
answer merges its items g in [first_b, first_b + count_b) and the step's new-token part
(o_new [B, M, A], lse_new [B, M]) by their log-sum-exps:

    o_b = sum_parts exp(lse_part - mx) o_part / sum_parts exp(lse_part - mx),  lse_b = mx + ln(den)

`combine_items_xla` writes that as XLA: per-row maxima and sums over a [B, G] row mask, the
numerator a one-hot contraction at full f32 precision. Its cost is B x G x M x A multiply-adds, which
at batch 64 x 2 splits x 64 heads (537 MFLOP of f32) made the balanced schedule 0-20% slower than
the rows schedule on equal lengths (BENCHMARKS.md MLA round 11). `combine_items` is the same merge
reading each item once (`combine` picks one by size): grid (B, M, A / block_a), one program per
(row, query row, column block) walks the row's items in chunks of `block_g` ([block_g, block_a]
loads, an online max across chunks; a row of at most FEW_ITEMS items one item at a time), in item
order (deterministic). Items past count_b are masked; a row with no items and no new-token part gives
o = 0, lse = -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile


def combine_items_xla(o_GMA, lse_GM, row_G, o_new_BMA, lse_new_BM):
    """The merge in XLA (the kernel's reference, and `combine`'s choice for small shapes): each row's
    items (row_G; unused items carry lse = -inf) and its new-token part, by their lse."""
    B = o_new_BMA.shape[0]
    mask_BG = row_G[None, :] == jnp.arange(B, dtype=row_G.dtype)[:, None]
    mx_BM = jnp.max(jnp.where(mask_BG[:, :, None], lse_GM[None], -jnp.inf), axis=1)
    mx_BM = jnp.maximum(mx_BM, lse_new_BM)
    mx_BM = jnp.where(jnp.isfinite(mx_BM), mx_BM, 0.0)
    w_GM = jnp.exp(lse_GM - mx_BM[row_G])                           # 0 for empty items
    w_new_BM = jnp.exp(lse_new_BM - mx_BM)
    den_BM = jnp.where(mask_BG[:, :, None], w_GM[None], 0.0).sum(axis=1) + w_new_BM
    num_BMA = jnp.einsum("bgm,gma->bma", jnp.where(mask_BG[:, :, None], w_GM[None], 0.0), o_GMA,
                         precision=lax.Precision.HIGHEST) + w_new_BM[..., None] * o_new_BMA
    has = den_BM > 0
    den_BM = jnp.where(has, den_BM, 1.0)
    return num_BMA / den_BM[..., None], jnp.where(has, mx_BM + jnp.log(den_BM), -jnp.inf)


def _kernel(span_ref, o_ref, lse_ref, onew_ref, lsenew_ref, out_ref, lseout_ref, *, n_rows: int, a: int,
            ba: int, bg: int):
    # Flattened refs, scalar-first indices (as the Triton lowering wants): span_ref [2 * B] int32 (each
    # row's first item, then each row's item count), o_ref [G, M * A], lse_ref [G * M],
    # onew_ref [B, M * A], lsenew_ref [B * M]; out_ref [B, M * A], lseout_ref [B * M].
    b, m, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    B = pl.num_programs(0)
    first = tile.load(span_ref.at[b])
    count = tile.load(span_ref.at[B + b])
    cols = m * a + j * ba + jnp.arange(ba, dtype=jnp.int32)
    lse_new = tile.load(lsenew_ref.at[b * n_rows + m])
    has_new = lse_new > -jnp.inf
    mx = lse_new                                                     # running max (-inf: none yet)
    acc = jnp.where(has_new, tile.load(onew_ref.at[b, cols]), 0.0)   # sum w o, relative to mx
    den = jnp.where(has_new, jnp.ones((ba,), jnp.float32), 0.0)   # [ba], equal lanes (a scalar
    #                                                  select from a bool lowers to i1 in Triton)
    ig = jnp.arange(bg, dtype=jnp.int32)

    def chunk(c, carry):
        mx, acc, den = carry
        g = first + c * bg + ig
        valid = g < first + count
        g = jnp.where(valid, g, first)                               # masked lanes stay in bounds
        lse = tile.load(lse_ref.at[g * n_rows + m], mask=valid, other=-jnp.inf)
        o = tile.load(o_ref.at[g[:, None], cols[None, :]], mask=valid[:, None], other=0.0)
        mx_new = jnp.maximum(mx, lse.max())
        live = mx_new > -jnp.inf
        scale = jnp.where(live & (mx > -jnp.inf), jnp.exp(mx - mx_new), 0.0)
        w = jnp.where(live & (lse > -jnp.inf), jnp.exp(lse - mx_new), 0.0)
        return mx_new, acc * scale + jnp.sum(w[:, None] * o, axis=0), den * scale + jnp.sum(w)

    # A row of few items (every row of an equal-length batch: the rows schedule's splits) is merged in
    # one step: its FEW_ITEMS [ba] loads (masked past count) issued together, no masked chunk lanes
    # and no load waiting on the previous one. A longer row is walked in chunks of bg items below.
    few = count <= FEW_ITEMS
    lse_i, o_i = [], []
    for i in range(FEW_ITEMS):
        ok = few & (i < count)
        g = jnp.where(ok, first + i, 0)                              # masked loads stay in bounds
        lse_i.append(tile.load(lse_ref.at[g * n_rows + m], mask=ok, other=-jnp.inf))
        o_i.append(tile.load(o_ref.at[g, cols], mask=jnp.full((ba,), ok), other=0.0))
    mx_new = functools.reduce(jnp.maximum, lse_i, mx)
    live = mx_new > -jnp.inf
    scale = jnp.where(live & (mx > -jnp.inf), jnp.exp(mx - mx_new), 0.0)
    acc, den = acc * scale, den * scale
    for lse, o in zip(lse_i, o_i):
        w = jnp.where(live & (lse > -jnp.inf), jnp.exp(lse - mx_new), 0.0)
        acc, den = acc + w * o, den + w
    # (not few: every lse_i is -inf, so mx_new = mx and acc / den are unchanged)
    mx, acc, den = lax.fori_loop(0, jnp.where(few, 0, pl.cdiv(count, bg)), chunk, (mx_new, acc, den))
    has = den > 0.0
    tile.store(out_ref.at[b, cols], jnp.where(has, acc / jnp.where(has, den, 1.0), 0.0))

    @pl.when(j == 0)
    def _():
        d = jnp.max(den)
        tile.store(lseout_ref.at[b * n_rows + m], jnp.where(d > 0.0, mx + jnp.log(jnp.maximum(d, 1e-30)),
                                                             -jnp.inf))


# `combine` takes the XLA contraction up to this many B x G x M x A multiply-adds, the kernel above:
# measured on the H200 (BENCHMARKS.md MLA round 11) the contraction was the faster at batch <= 8
# (8 x 128 items x 64 heads: 34M) and 20-100 us slower at batch 64 (268M).
XLA_MAX_MACS = 1 << 27
# A row of at most this many items is merged item by item ([block_a] loads) instead of in chunks of
# block_g: at batch 64 x 2 splits a [16, 512] chunk held 2 live items and 14 masked ones.
FEW_ITEMS = 4
_PROGRAMS = 2048          # the kernel's automatic block_a aims for about this many programs
NUM_WARPS = 4


def combine(o_GMA, lse_GM, work, o_new_BMA, lse_new_BM, *, interpret: bool):
    """The balanced schedule's merge (`work`: `mla_decode.balanced_items`' table): the XLA
    contraction for small shapes, else the kernel. Returns o [B, M, A] f32 and lse [B, M] f32."""
    G, M, A = o_GMA.shape
    B = o_new_BMA.shape[0]
    if B * G * M * A <= XLA_MAX_MACS:
        return combine_items_xla(o_GMA, lse_GM, work[0], o_new_BMA, lse_new_BM)
    return combine_items(o_GMA, lse_GM, work[3, :B], work[4, :B], o_new_BMA, lse_new_BM, interpret=interpret)


def _auto_blocks(B: int, M: int, A: int):
    """(block_a, block_g): columns split until there are ~_PROGRAMS programs (a long row's items are
    walked by M x A / block_a programs in parallel), at least 64 columns; ~8K values per chunk load."""
    s = 1
    while B * M * s * 2 <= _PROGRAMS and A // (2 * s) >= 64 and A % (2 * s) == 0:
        s *= 2
    ba = A // s
    return ba, max(16, min(64, 8192 // ba))


@functools.partial(jax.jit, static_argnames=("interpret", "block_a", "block_g", "num_warps"))
def combine_items(o_GMA, lse_GM, first_B, count_B, o_new_BMA, lse_new_BM, *, interpret: bool = False,
                  block_a: int = 0, block_g: int = 0, num_warps: int = NUM_WARPS):
    """`combine_items_xla` in one launch: rows' items given as [first_B, first_B + count_B)
    (from `mla_decode.balanced_items`). Returns o [B, M, A] f32 and lse [B, M] f32."""
    G, M, A = o_GMA.shape
    B = o_new_BMA.shape[0]
    auto_a, auto_g = _auto_blocks(B, M, A)
    ba, block_g = block_a or auto_a, block_g or auto_g
    if A % ba or ba & (ba - 1) or block_g & (block_g - 1):
        raise ValueError(f"combine_items: block_a={ba} must be a power of two dividing A={A} and "
                         f"block_g={block_g} a power of two")
    f32 = jnp.float32
    spans = jnp.concatenate([first_B, count_B]).astype(jnp.int32)
    out, lse = pl.pallas_call(
        functools.partial(_kernel, n_rows=M, a=A, ba=ba, bg=block_g),
        grid=(B, M, A // ba),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, M * A), f32), jax.ShapeDtypeStruct((B * M,), f32)],
        interpret=interpret,
        compiler_params=tile.compiler_params(num_warps, 3, interpret),
        name="mla_combine_items",
    )(spans, o_GMA.reshape(G, M * A).astype(f32), lse_GM.reshape(G * M).astype(f32),
      o_new_BMA.reshape(B, M * A).astype(f32), lse_new_BM.reshape(B * M).astype(f32))
    return out.reshape(B, M, A), lse.reshape(B, M)


# ----------------------------------------------------------------------------------------------
# Benchmark sweep (GPU): python -m pallas_kernels.mla.combine [--cases=B:M:items:long:short,...]
# Each case is a balanced table (`mla_decode.balanced_items`) over one row of `long` cached tokens
# and B - 1 rows of `short` (long = short: equal rows), M query rows, A (512) columns; every config
# is checked against `combine_items_xla` on the device first, then timed: device time per call of
# every op it runs (jax.profiler; `calls` calls in one executable, the partials L2-warm as after the
# decode kernel that wrote them). Wall clock over the executable was dominated by launch gaps.

def _parse_case(spec: str) -> tuple[int, int, int, int, int]:
    try:
        B, M, items, long, short = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"--cases: {spec!r} is not B:M:items:long:short (five integers)") from None
    if B < 1 or M < 1 or items < B or min(long, short) < 0:
        raise ValueError(f"--cases: {spec!r} needs B, M >= 1, items >= B and lengths >= 0")
    return B, M, items, long, short


def _case(spec: str, seed: int = 0, A: int = 512):
    B, M, items, long, short = _parse_case(spec)
    from pallas_kernels.mla import decode as md
    work = md.balanced_items(jnp.asarray([long] + [short] * (B - 1), jnp.int32), items, 64)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    used = (work[2] > work[1])[:, None]
    o = jnp.where(used[..., None], jax.random.normal(ks[0], (items, M, A), jnp.float32), 0.0)
    lse = jnp.where(used, 4.0 * jax.random.normal(ks[1], (items, M), jnp.float32), -jnp.inf)
    o_new = jax.random.normal(ks[2], (B, M, A), jnp.float32)
    lse_new = 4.0 * jax.random.normal(ks[3], (B, M), jnp.float32)
    return work, o, lse, o_new, lse_new


def main(argv):
    del argv
    from absl import app, flags
    from kimi_jax.tools import profiling
    f = flags.FLAGS
    for spec in f.cases:                  # before any work
        try:
            _parse_case(spec)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    configs = [(w, a, g) for w in (int(v) for v in f.warps) for a in (int(v) for v in f.block_as)
               for g in (int(v) for v in f.block_gs)]
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
    failed = 0
    print(f"{'case B:M:items:long:short':<28} {'MB':>6} {'config (warps, block_a, block_g)':<34} "
          f"{'us':>8} {'GB/s':>7} check")
    for spec in f.cases:
        work, o, lse, o_new, lse_new = _case(spec, A=f.a)
        B = o_new.shape[0]
        nbytes = o.size * 4 + lse.size * 4 + 2 * o_new.size * 4
        news = [lse_new + 0.001 * i for i in range(f.calls)]      # distinct calls: no CSE
        want = combine_items_xla(o, lse, work[0], o_new, lse_new)
        runs = [("xla", lambda n: combine_items_xla(o, lse, work[0], o_new, n))]
        for w, a, g in configs:
            runs.append(((w, a, g), lambda n, w=w, a=a, g=g: combine_items(
                o, lse, work[3, :B], work[4, :B], o_new, n, num_warps=w, block_a=a, block_g=g,
                interpret=f.interpret)))
        for name, fn in runs:
            try:
                got = jax.jit(fn)(lse_new)
                err = max(float(jnp.max(jnp.abs(got[0] - want[0]))),
                          float(jnp.max(jnp.where(jnp.isfinite(want[1]), jnp.abs(got[1] - want[1]), 0.0))))
                many = jax.jit(lambda ns, fn=fn: [fn(n) for n in ns]).lower(news).compile()
                per_op, _, _ = profiling.device_ops_per_call(many, (news,), f.calls)
                t = max(sum(per_op.values()), 1e-3) * 1e-6
                top = ", ".join(f"{k[:24]} {v:.1f}" for k, v in list(per_op.items())[:3])
                print(f"{spec:<28} {nbytes / 1e6:6.1f} {str(name):<34} {t * 1e6:8.1f} "
                      f"{nbytes / t / 1e9:7.0f} {'OK' if err < 1e-4 else 'FAIL'} {err:.1e}  [{top}]", flush=True)
                failed += err >= 1e-4   # f32 sums in another order differ by ~1e-6 here; a part
                #                             merged into the wrong row or dropped moves an output by O(1)
            except Exception as e:  # noqa: BLE001
                print(f"{spec:<28} {str(name):<34} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                failed += 1
    if failed:
        raise SystemExit(f"mla_combine sweep: {failed} config(s) failed or disagreed with the reference")


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_list("cases", ["64:64:128:4096:4096", "64:64:128:32768:1024", "64:8:256:4096:4096",
                                "16:64:128:4096:4096", "16:8:128:131072:4096", "8:64:128:131072:4096",
                                "8:8:128:131072:4096"], "B:M:items:long:short")
    flags.DEFINE_list("warps", ["1", "2", "4"], "num_warps values")
    flags.DEFINE_list("block_as", ["0", "128", "512"], "block_a values (0: automatic)")
    flags.DEFINE_list("block_gs", ["0", "4"], "block_g values (0: automatic)")
    flags.DEFINE_integer("calls", 20, "calls per timed executable")
    flags.DEFINE_integer("a", 512, "latent columns")
    flags.DEFINE_bool("interpret", False, "interpret mode (a CPU dry run of the sweep)")
    app.run(main)
