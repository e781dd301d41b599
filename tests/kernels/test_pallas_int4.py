"""INT4 W4A16 Pallas kernels (pallas_kernels/) on CPU, in Pallas interpret mode.

Every check compares against a float32 reference computed from the dequantized weights
(int4_ref.dequantize, exact q * scale in f32) with fresh seeded random inputs.

Tolerance: relative Frobenius error <= 1e-2. The kernels round each dequantized weight q*s to bf16
(as compressed-tensors' own `q.to(bf16) * scale` does; <= 2^-9 relative per weight), feed bf16
operands to the MMA with f32 accumulation, round the SiLU(gate)*up intermediate to bf16 (as the
XLA path does) and return bf16 (2^-9 relative per element). Those roundings give ~2-4e-3 here; an
indexing or layout bug gives O(1). NaN never passes.

Unwritten outputs: in interpret mode Pallas allocates outputs filled with NaN (checked below), so
an element a kernel forgets to write stays NaN and fails the finite + allclose checks.

Interpret mode cannot run the inline-PTX dequantizer; it runs the bit-identical 'f32' one. The
'asm' path is covered here by lowering every kernel to Triton IR for CUDA (no GPU needed) and on the
H200 by `kimi-bench int4` (section "check").
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.int4 import matmul as im
from pallas_kernels.int4 import reference as int4_ref
from pallas_kernels.int4 import tile
from pallas_kernels.int4 import moe_gmm as mg


def _key(*tags):
    # fresh inputs per test case, reproducible: the seed is derived from the case's parameters
    seed = np.random.SeedSequence([zlib.crc32(str(t).encode()) for t in tags]).generate_state(1)[0]
    return jax.random.PRNGKey(int(seed))


def _rel(y, ref):
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.all(np.isfinite(y)), "non-finite (unwritten?) output elements"
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def test_interpret_outputs_start_poisoned():
    """The premise of the unwritten-element checks: an output a kernel never writes is NaN."""
    def kernel(x_ref, o_ref):
        o_ref[0:2, :] = x_ref[0:2, :]            # rows 2..7 left unwritten
    y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       interpret=True)(jnp.ones((8, 128), jnp.float32))
    assert np.all(np.isfinite(np.asarray(y[:2])))
    assert np.all(np.isnan(np.asarray(y[2:])))


def test_unpack_matches_layout():
    q = np.random.default_rng(0).integers(-8, 8, size=(3, 64))
    packed = int4_ref.pack_int4_np(q)
    # element k of a row lives in word k//8, bits 4*(k%8), stored as q + 8
    assert ((packed[1, 2].view(np.uint32) >> 12) & 0xF) == q[1, 8 * 2 + 3] + 8
    np.testing.assert_array_equal(np.asarray(int4_ref.unpack_int4(jnp.asarray(packed))), q)


# ---------------------------------------------------------------------------------------------
# dense INT4 matmul

@pytest.mark.parametrize("m", [1, 7, 16, 129])
def test_int4_matmul_default(m):
    n, k = 128, 1024      # K a multiple of 4 x 256: M <= 8 takes the one-launch split-K default
    p, s = int4_ref.random_int4(_key("dense", m, "w"), (n, k))
    x = jax.random.normal(_key("dense", m, "x"), (m, k), jnp.bfloat16)
    y = im.int4_matmul(x, p, s)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    assert _rel(y, im.int4_matmul_reference(x, p, s)) <= 1e-2


@pytest.mark.parametrize("m", [1, 2, 5])
def test_int4_matmul_default_one_launch_at_large_k(m):
    """K >= 4096 at M <= 8: the default is the one-launch 'cta' kernel (4 K-slices for M <= 2, 2 above):
    one pallas_call and no zero fill / cast around it."""
    n, k = 64, 4096
    cfg = im.default_config(m, n, k)
    assert cfg.split_reduce == "cta" and cfg.split_k == (4 if m <= 2 else 2)
    p, s = int4_ref.random_int4(_key("dense_cta", m, "w"), (n, k))
    x = jax.random.normal(_key("dense_cta", m, "x"), (m, k), jnp.bfloat16)
    assert _rel(im.int4_matmul(x, p, s), im.int4_matmul_reference(x, p, s)) <= 1e-2
    eqns = jax.make_jaxpr(lambda *a: im.int4_matmul(*a))(x, p, s).jaxpr.eqns[0].params["jaxpr"].eqns
    names = [e.primitive.name for e in eqns]
    assert names.count("pallas_call") == 1 and "broadcast_in_dim" not in names, names


@pytest.mark.parametrize("m", [9, 16])
@pytest.mark.parametrize("n,k,kind", [(64, 1024, "cta"), (64, 4096, "split4")])
def test_int4_matmul_default_m9_to_16(m, n, k, kind):
    """8 < M <= 16: K < 4096 takes the 'cta' kernel (2 slices, 2 * 16 token columns), K >= 4096 split-K 4
    over 64-row programs summed by XLA; both against the reference."""
    cfg = im.default_config(m, n, k)
    assert (cfg.split_reduce, cfg.split_k) == (("cta", 2) if kind == "cta" else ("xla", 4))
    p, s = int4_ref.random_int4(_key("dense_m16", m, k, "w"), (n, k))
    x = jax.random.normal(_key("dense_m16", m, k, "x"), (m, k), jnp.bfloat16)
    assert _rel(im.int4_matmul(x, p, s), im.int4_matmul_reference(x, p, s)) <= 1e-2


@pytest.mark.parametrize("name,m,cfg", [
    ("swap_bm8_split2", 3, im.Int4MatmulConfig(block_m=8, block_n=64, block_k=256, swap_ab=True,
                                               split_k=2)),
    ("swap_bm8_split4_m9", 9, im.Int4MatmulConfig(block_m=8, block_n=64, block_k=128,
                                                  swap_ab=True, split_k=4)),
    ("natural_x", 7, im.Int4MatmulConfig(block_n=32, block_k=256, x_layout="natural")),
    ("bm16_split2_f32", 16, im.Int4MatmulConfig(block_n=32, block_k=512, split_k=2,
                                                dequant="f32")),
    # single-launch variants: x permuted in registers ('shuffle'), split-K summed by f32 atomics
    ("shuffle_x", 7, im.Int4MatmulConfig(block_n=32, block_k=256, x_layout="shuffle")),
    ("swap_bm8_split4_atomic_shuffle", 3, im.Int4MatmulConfig(
        block_m=8, block_n=64, block_k=128, swap_ab=True, split_k=4, split_reduce="atomic",
        x_layout="shuffle")),
    ("bm16_split2_atomic_m17", 17, im.Int4MatmulConfig(block_n=32, block_k=256, split_k=2,
                                                       split_reduce="atomic")),
    # the K split inside the program (one launch, no atomics): MMA rows = K-slices x real rows, the
    # tokens' slices on the other side; odd M (padded token columns), 2 / 4 / 8 slices, M = 16 (64 columns)
    ("cta_split4_shuffle_m1", 1, im.Int4MatmulConfig(block_n=64, block_k=128, swap_ab=True, split_k=4,
                                                     split_reduce="cta", x_layout="shuffle")),
    ("cta_split4_perm_m3", 3, im.Int4MatmulConfig(block_n=64, block_k=128, swap_ab=True, split_k=4,
                                                  split_reduce="cta")),
    ("cta_split2_w2_m7", 7, im.Int4MatmulConfig(block_n=32, block_k=256, num_warps=2, swap_ab=True, split_k=2,
                                                split_reduce="cta", x_layout="shuffle")),
    ("cta_split8_w8_m2", 2, im.Int4MatmulConfig(block_n=128, block_k=128, num_warps=8, swap_ab=True, split_k=8,
                                                split_reduce="cta", x_layout="shuffle")),
    ("cta_split4_m16", 16, im.Int4MatmulConfig(block_n=64, block_k=128, swap_ab=True, split_k=4,
                                               split_reduce="cta", x_layout="shuffle")),
])
def test_int4_matmul_configs(name, m, cfg):
    n, k = 128, 1024
    p, s = int4_ref.random_int4(_key("cfg", name, "w"), (n, k))
    x = jax.random.normal(_key("cfg", name, "x"), (m, k), jnp.bfloat16)
    assert _rel(im.int4_matmul(x, p, s, config=cfg), im.int4_matmul_reference(x, p, s)) <= 1e-2


def test_int4_matmul_int16_view_and_group64():
    m, n, k = 5, 64, 512
    p, s = int4_ref.random_int4(_key("g64", "w"), (n, k), group=64)
    x = jax.random.normal(_key("g64", "x"), (m, k), jnp.bfloat16)
    ref = im.int4_matmul_reference(x, p, s)
    y32 = im.int4_matmul(x, p, s)
    y16 = im.int4_matmul(x, im.repack(p), s)
    assert _rel(y32, ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y16, np.float32))


def test_split_planes_is_perm_columns():
    """The in-register x permutation ('shuffle') gives the same pair-planes as XLA's perm_columns."""
    from pallas_kernels.int4 import tile
    x = jax.random.normal(_key("split_planes"), (8, 256), jnp.bfloat16)
    got = jnp.concatenate(tile.split_planes(x), axis=1)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(tile.perm_columns(x), np.float32))


def test_int4_matmul_cta_rejects_what_it_cannot_tile():
    p, s = int4_ref.random_int4(_key("cta_bad", "w"), (128, 1024))
    cfg = im.Int4MatmulConfig(block_n=64, block_k=128, swap_ab=True, split_k=4, split_reduce="cta")
    x = jnp.zeros((17, 1024), jnp.bfloat16)                  # 4 slices x 32 padded tokens > 64 columns
    with pytest.raises(ValueError, match="M=17"):
        im.int4_matmul(x, p, s, config=cfg)
    with pytest.raises(ValueError, match="swap_ab"):
        im.int4_matmul(x[:1], p, s, config=im.Int4MatmulConfig(split_k=4, split_reduce="cta"))


def test_int4_config_rejects_unknown_modes():
    with pytest.raises(ValueError, match="x_layout"):
        im.Int4MatmulConfig(x_layout="transposed")
    with pytest.raises(ValueError, match="split_reduce"):
        im.Int4MatmulConfig(split_reduce="tree")
    with pytest.raises(ValueError, match="decode"):
        mg.MoeGmmConfig(decode="persistent")


# ---------------------------------------------------------------------------------------------
# grouped INT4 matmul (rows sorted by expert)

@pytest.mark.parametrize("sizes", [
    [3, 0, 17, 1, 0, 2],          # odd group sizes, experts with zero rows
    [0, 0, 23, 0, 0, 0],          # all rows on one expert (several tiles of one expert)
    [1, 1, 1, 1, 1, 1],
])
def test_grouped_int4_matmul(sizes):
    e_, n, k = len(sizes), 64, 256
    p, s = int4_ref.random_int4(_key("gmm", sizes, "w"), (e_, n, k))
    gs = jnp.asarray(sizes, jnp.int32)
    x = jax.random.normal(_key("gmm", sizes, "x"), (int(sum(sizes)), k), jnp.bfloat16)
    y = mg.grouped_int4_matmul(x, gs, p, s, config=mg.MoeGmmConfig(block_n_down=32,
                                                                   block_k_down=128))
    assert _rel(y, mg.grouped_int4_matmul_reference(x, gs, p, s)) <= 1e-2


def test_make_tiles_skips_idle_experts():
    sizes = jnp.asarray([0, 9, 0, 0, 1, 16, 0], jnp.int32)
    t = mg.make_tiles(sizes, 26, 8)
    valid = np.asarray(t.end) > np.asarray(t.start)
    got = sorted(zip(np.asarray(t.expert)[valid].tolist(), np.asarray(t.start)[valid].tolist(),
                     np.asarray(t.end)[valid].tolist()))
    assert got == [(1, 0, 8), (1, 8, 9), (4, 9, 10), (5, 10, 18), (5, 18, 26)]


# ---------------------------------------------------------------------------------------------
# MoE layer

E, D, F, TOPK = 10, 256, 128, 4


@pytest.fixture(scope="module")
def experts():
    key = _key("moe-experts")
    g = int4_ref.random_int4(jax.random.fold_in(key, 1), (E, F, D))
    u = int4_ref.random_int4(jax.random.fold_in(key, 2), (E, F, D))
    dn = int4_ref.random_int4(jax.random.fold_in(key, 3), (E, D, F))
    return g, u, dn


def _moe_case(t, mode):
    key = _key("moe", t, mode)
    x = jax.random.normal(jax.random.fold_in(key, 0), (t, D), jnp.bfloat16)
    if mode == "distinct":      # router-like: distinct experts per token, some experts idle
        idx = jax.vmap(lambda kk: jax.random.permutation(kk, E - 3)[:TOPK])(
            jax.random.split(jax.random.fold_in(key, 1), t))
    elif mode == "one_expert":  # every (token, k) pair on expert 5
        idx = jnp.full((t, TOPK), 5)
    else:                       # arbitrary ids, duplicates allowed
        idx = jax.random.randint(jax.random.fold_in(key, 1), (t, TOPK), 0, E)
    w = jax.random.uniform(jax.random.fold_in(key, 2), (t, TOPK), minval=0.1, maxval=1.0)
    return x, idx.astype(jnp.int32), w


@pytest.mark.parametrize("t,mode", [(1, "distinct"), (3, "random"), (7, "distinct"),
                                    (16, "random"), (9, "one_expert")])
def test_moe_experts_default(experts, t, mode):
    g, u, dn = experts
    x, idx, w = _moe_case(t, mode)
    y = mg.moe_experts(x, idx, w, *g, *u, *dn)
    assert y.shape == (t, D) and y.dtype == jnp.bfloat16
    assert _rel(y, mg.moe_experts_reference(x, idx, w, *g, *u, *dn)) <= 1e-2


@pytest.mark.parametrize("name,t,cfg", [
    ("sorted_decode", 2, mg.MoeGmmConfig(pair_tiles_max_t=0)),
    ("bm16_mma_rows_tokens", 7, mg.MoeGmmConfig(block_m=16, swap_ab=False, num_warps=4)),
    ("bm16_swap_w2", 12, mg.MoeGmmConfig(block_m=16, block_n_gate_up=32, num_warps=2)),
    ("natural_x_f32", 5, mg.MoeGmmConfig(x_layout="natural", dequant="f32",
                                         pair_tiles_max_t=0)),
])
def test_moe_experts_configs(experts, name, t, cfg):
    g, u, dn = experts
    x, idx, w = _moe_case(t, "random")
    y = mg.moe_experts(x, idx, w, *g, *u, *dn, config=cfg)
    assert _rel(y, mg.moe_experts_reference(x, idx, w, *g, *u, *dn)) <= 1e-2


def test_moe_experts_invariant_gives_a_token_the_same_bits_in_any_batch(experts):
    """invariant=True (ExecPlan.batch_invariant): three tokens alone and among 64 (whose default
    config takes 64-row tiles and shorter K steps) give the same bits; without it they differ."""
    g, u, dn = experts
    x, idx, w = _moe_case(64, "random")
    picks = [0, 17, 63]
    for invariant in (True, False):
        batched = np.asarray(mg.moe_experts(x, idx, w, *g, *u, *dn, invariant=invariant),
                             np.float32)
        alone = np.concatenate([np.asarray(mg.moe_experts(
            x[i:i + 1], idx[i:i + 1], w[i:i + 1], *g, *u, *dn, invariant=invariant), np.float32)
            for i in picks])
        assert (alone == batched[picks]).all() == invariant, invariant
    with pytest.raises(ValueError, match="must not depend on T"):
        mg.moe_experts(x, idx, w, *g, *u, *dn, invariant=True, config=mg.MoeGmmConfig())


FUSED = mg.MoeGmmConfig(decode="fused")
SINGLE = mg.MoeGmmConfig(decode="single", block_n_down=128)


@pytest.mark.parametrize("name,t,mode,topk,cfg", [
    ("t1", 1, "distinct", TOPK, FUSED),
    ("t3_random", 3, "random", TOPK, FUSED),
    ("t4_one_expert", 4, "one_expert", TOPK, FUSED),
    ("t2_topk3_shuffle", 2, "random", 3, mg.MoeGmmConfig(decode="fused", x_layout="shuffle")),
    ("t4_natural_d32_w2_k64", 4, "random", TOPK, mg.MoeGmmConfig(
        decode="fused", x_layout="natural", block_n_down=32, num_warps_down=2, block_k_down=64,
        num_stages_down=4)),
    ("t3_sorted_shuffle", 3, "random", TOPK, mg.MoeGmmConfig(x_layout="shuffle",
                                                             pair_tiles_max_t=0)),
    # single launch (moe_decode_single): F slices of 64 (2 per expert) and 128 (the whole F here)
    ("single_t1", 1, "distinct", TOPK, SINGLE),
    ("single_t4_one_expert", 4, "one_expert", TOPK, SINGLE),
    ("single_t3_topk3_shuffle_f128_d128", 3, "random", 3, mg.MoeGmmConfig(
        decode="single", x_layout="shuffle", block_n_gate_up=128, block_n_down=128)),
    ("single_t2_natural_k64", 2, "random", TOPK, mg.MoeGmmConfig(
        decode="single", x_layout="natural", block_k_gate_up=64, block_n_down=32, num_warps=2)),
    ("fused_t1_split4", 1, "distinct", TOPK, mg.MoeGmmConfig(decode="fused", split_k_down=4)),
    ("fused_t3_topk3_split3_shuffle", 3, "random", 3, mg.MoeGmmConfig(
        decode="fused", x_layout="shuffle", split_k_down=3, block_k_down=128)),
    # stream-K down: 3 / 7 programs share the blocks' K loops, so programs end one block mid-loop and
    # start the next (and, at T = 3, one program holds several whole blocks)
    ("fused_t1_stream3", 1, "distinct", TOPK, mg.MoeGmmConfig(decode="fused", stream_k_down=3)),
    ("fused_t3_topk3_stream7", 3, "random", 3, mg.MoeGmmConfig(decode="fused", stream_k_down=7,
                                                               block_k_down=64)),
    # chained (one launch, tickets, in-kernel wait): one block per down share, and stream-K shares
    ("chained_t1", 1, "distinct", TOPK, mg.MoeGmmConfig(decode="chained")),
    ("chained_t3_topk3_stream7_shuffle", 3, "random", 3, mg.MoeGmmConfig(
        decode="chained", stream_k_down=7, block_k_down=64, x_layout="shuffle")),
    ("chained_t4_one_expert", 4, "one_expert", TOPK, mg.MoeGmmConfig(decode="chained", stream_k_down=5)),
    # gate and up rows in separate programs (pair tiles), silu(gate) * up by XLA
    ("split_gu_t1", 1, "distinct", TOPK, mg.MoeGmmConfig(split_gate_up=True)),
    ("split_gu_t3_topk3_shuffle", 3, "random", 3, mg.MoeGmmConfig(split_gate_up=True, x_layout="shuffle")),
    ("split_gu_t4_one_expert_bn32_w2", 4, "one_expert", TOPK, mg.MoeGmmConfig(
        split_gate_up=True, block_n_gate_up=32, num_warps=2)),
    ("single_t3_store", 3, "random", TOPK, mg.MoeGmmConfig(decode="single", single_reduce="store")),
    ("single_t1_relaxed", 1, "distinct", TOPK, mg.MoeGmmConfig(decode="single",
                                                                single_reduce="relaxed")),
])
def test_moe_experts_fused_decode(experts, name, t, mode, topk, cfg):
    """Fused decode (moe_decode.py): routing read in-kernel, down sums the token's experts in one
    K loop and writes y directly; odd top-k (padded id vector), duplicates, in-register x perm."""
    g, u, dn = experts
    x, idx, w = _moe_case(t, mode)
    idx, w = idx[:, :topk], w[:, :topk]
    y = mg.moe_experts(x, idx, w, *g, *u, *dn, config=cfg)
    assert y.shape == (t, D) and y.dtype == jnp.bfloat16
    assert _rel(y, mg.moe_experts_reference(x, idx, w, *g, *u, *dn)) <= 1e-2


@pytest.mark.parametrize("name,t,mode,topk,bf,cfg", [
    ("t1_f64_d128", 1, "distinct", TOPK, 64, SINGLE),
    ("t3_topk3_shuffle_f128_relaxed", 3, "random", 3, 128, mg.MoeGmmConfig(
        decode="single", x_layout="shuffle", block_n_gate_up=128, block_n_down=64, single_reduce="relaxed")),
    ("t4_one_expert_store", 4, "one_expert", TOPK, 64, mg.MoeGmmConfig(decode="single",
                                                                               single_reduce="store")),
])
def test_moe_single_blocked_down(experts, name, t, mode, topk, bf, cfg):
    """The single launch reading the down weight in block_down's layout (each program's D x BF slice one
    contiguous block) gives the reference's y: a block read at the wrong F slice or expert moves y by far
    more than the 1e-2 bound (a bf16 h and f32 accumulation are ~3e-3)."""
    g, u, dn = experts
    x, idx, w = _moe_case(t, mode)
    idx, w = idx[:, :topk], w[:, :topk]
    dn_blk = mg.block_down(*dn, bf)
    y = mg.moe_experts(x, idx, w, *g, *u, *dn_blk, config=cfg)
    assert y.shape == (t, D) and y.dtype == jnp.bfloat16
    assert _rel(y, mg.moe_experts_reference(x, idx, w, *g, *u, *dn)) <= 1e-2


@pytest.mark.parametrize("name,t,mode,held,cfg", [
    ("t1_one_held_pair", 1, "distinct", 1, mg.MoeGmmConfig(pairs_cta=2)),
    ("t3_two_held_w2", 3, "random", 2, mg.MoeGmmConfig(pairs_cta=2, num_warps=2, block_k_gate_up=64)),
    ("t4_one_expert_all_held", 4, "one_expert", TOPK, mg.MoeGmmConfig(pairs_cta=2)),
    ("t2_split1", 2, "random", 3, mg.MoeGmmConfig(pairs_cta=1)),
])
def test_moe_pairs_cta(experts, name, t, mode, held, cfg):
    """Dense-style programs per pair (`pairs_cta`, for steps holding few pairs): the first `held` pairs of
    each token are on this device, the rest carry id E (skipped, as expert parallelism passes them);
    y matches the reference on the same ids. A program reading the wrong activation row (pair instead of
    token), expert rows or K slice moves y far past the 1e-2 bound (bf16 h and output: ~3e-3)."""
    g, u, dn = experts
    x, idx, w = _moe_case(t, mode)
    idx = idx.at[:, held:].set(E)
    y = mg.moe_experts(x, idx, w, *g, *u, *dn, config=cfg)
    assert y.shape == (t, D) and y.dtype == jnp.bfloat16
    assert _rel(y, mg.moe_experts_reference(x, idx, w, *g, *u, *dn)) <= 1e-2


def test_block_down_layout_and_errors(experts):
    """block_down is a pure relayout (block j of expert e holds columns [j*BF, (j+1)*BF) of every D row,
    words and scales alike, for int32 words and their int16 view); the paths that cannot read it and a
    block size other than the call's say so."""
    g, u, (dp, ds) = experts
    bf = 64
    bp, bs = mg.block_down(dp, ds, bf)
    e_, d_, words = dp.shape
    assert bp.shape == (e_, words * 8 // bf, d_, bf // 8) and bs.shape[:3] == bp.shape[:3]
    np.testing.assert_array_equal(np.asarray(bp[3, 1]), np.asarray(dp[3, :, bf // 8:2 * bf // 8]))
    gs = ds.shape[-1] * bf // (words * 8)              # scale groups per block
    np.testing.assert_array_equal(np.asarray(bs[3, 1]), np.asarray(ds[3, :, gs:2 * gs]))
    b16, _ = mg.block_down(mg.repack(dp), ds, bf)
    np.testing.assert_array_equal(np.asarray(mg.repack(bp)), np.asarray(b16))
    with pytest.raises(ValueError, match="block_f=48"):
        mg.block_down(dp, ds, 48)
    x, idx, w = _moe_case(1, "distinct")
    with pytest.raises(ValueError, match="only the single-launch decode path"):
        mg.moe_experts(x, idx, w, *g, *u, bp, bs, config=FUSED)
    with pytest.raises(ValueError, match="block_f=128"):
        mg.moe_experts(x, idx, w, *g, *u, bp, bs, config=mg.MoeGmmConfig(decode="single", block_n_gate_up=128))


def test_split_gate_up_matches_fused_epilogue(experts):
    """Separate gate / up programs give the same h as the fused kernel's epilogue: both accumulate the
    same f32 dots in the same order and round silu(gate) * up to bf16 once, so y agrees to float32
    rounding of the XLA-side silu (1e-6 relative; a swapped gate/up half, a wrong column order or a
    program writing the other weight's rows moves y by > 1e-2)."""
    g, u, dn = experts
    x, idx, w = _moe_case(2, "random")
    y0 = mg.moe_experts(x, idx, w, *g, *u, *dn)
    y1 = mg.moe_experts(x, idx, w, *g, *u, *dn, config=mg.MoeGmmConfig(split_gate_up=True))
    assert y1.shape == y0.shape and y1.dtype == y0.dtype
    assert _rel(y1, y0) <= 1e-6


@pytest.mark.parametrize("decode,kernels,extra_ops", [
    ("fused", 2, ()),
    ("single", 1, ("broadcast_in_dim", "slice")),     # the f32 output's zero fill, its final slice
])
def test_moe_decode_paths_are_only_their_kernels(experts, decode, kernels, extra_ops):
    """The point of the fused (two launches) and single (one launch) decode paths: one jitted call is
    the Pallas kernels and nothing else (no x permute, routing plan or sum over k) when x is already
    in natural order ('shuffle')."""
    g, u, dn = experts
    x, idx, w = _moe_case(1, "distinct")
    cfg = mg.MoeGmmConfig(decode=decode, x_layout="shuffle")
    jaxpr = jax.make_jaxpr(lambda *a: mg.moe_experts(*a, config=cfg))(x, idx, w, *g, *u, *dn)
    eqns = jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns          # inside moe_experts' jit
    names = [e.primitive.name for e in eqns]
    assert names.count("pallas_call") == kernels
    light = ("pallas_call", "reshape", "bitcast_convert_type", "convert_element_type") + extra_ops
    heavy = [n for n in names if n not in light]
    assert heavy == [], heavy


def test_relaxed_atomic_add_lowers_relaxed(monkeypatch):
    """`single_reduce='relaxed'` lowers its atomics with relaxed order and 'atomic' keeps Pallas'
    acquire-release (records the `sem` of every Triton atomic built while lowering for cuda)."""
    S = jax.ShapeDtypeStruct
    if not tile.RELAXED_ATOMIC_OK:
        pytest.skip("the relaxed-atomic lowering rule could not be installed on this jax")
    from jax._src.pallas.triton import lowering as tlow
    seen = []
    stock = tlow.tt_dialect.atomic_rmw

    def spy(*a, **kw):
        seen.append(str(kw.get("sem")))
        return stock(*a, **kw)

    monkeypatch.setattr(tlow.tt_dialect, "atomic_rmw", spy)
    e_, d, f, t = 8, 512, 256, 1
    args = [S((t, d), jnp.bfloat16), S((t, 2), jnp.int32), S((t, 2), jnp.float32),
            S((e_, f, d // 8), jnp.int32), S((e_, f, d // 32), jnp.bfloat16),
            S((e_, f, d // 8), jnp.int32), S((e_, f, d // 32), jnp.bfloat16),
            S((e_, d, f // 8), jnp.int32), S((e_, d, f // 32), jnp.bfloat16)]
    for reduce in ("relaxed", "atomic"):
        seen.clear()
        cfg = mg.MoeGmmConfig(decode="single", single_reduce=reduce)
        try:
            jax.jit(lambda *a, c=cfg: mg.moe_experts(*a, config=c, interpret=False)).trace(
                *args).lower(lowering_platforms=("cuda",))
        except RuntimeError as e:
            if "No supported GPU devices found" in str(e):
                pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
            raise
        assert seen, reduce
        want = "relaxed" if reduce == "relaxed" else "acq_rel"
        assert all(want in v.lower() for v in seen), (reduce, seen)


@pytest.mark.parametrize("t,cfg", [(1, FUSED), (4, FUSED), (1, SINGLE), (4, SINGLE),
                                   (4, mg.MoeGmmConfig(decode="fused", split_k_down=2)),
                                   (4, mg.MoeGmmConfig(decode="fused", stream_k_down=6)),
                                   (3, mg.MoeGmmConfig(decode="chained", stream_k_down=6))])
def test_moe_fused_decode_skips_foreign_ids(experts, t, cfg):
    """ids >= E and < 0 (held elsewhere / other layers of a stacked array) add 0 and read nothing."""
    g, u, dn = experts
    x, idx, w = _moe_case(t, "random")
    foreign = jax.random.bernoulli(_key("foreign_fused", t), 0.4, idx.shape).at[0, 0].set(True)
    idx = jnp.where(foreign, jnp.where(jnp.arange(TOPK) % 2 == 0, E + 5, -1), idx)
    y = mg.moe_experts(x, idx, w, *g, *u, *dn, config=cfg)
    ref_local = mg.moe_experts_reference(x, jnp.where(foreign, 0, idx),
                                         jnp.where(foreign, 0.0, w), *g, *u, *dn)
    assert _rel(y, ref_local) <= 1e-2


@pytest.mark.parametrize("t", [2, 11])
def test_moe_experts_skips_foreign_ids(experts, t):
    """Expert-parallel convention: ids >= E (held elsewhere) contribute nothing and read nothing."""
    g, u, dn = experts
    x, idx, w = _moe_case(t, "random")
    foreign = jax.random.bernoulli(_key("foreign", t), 0.4, idx.shape)
    idx = jnp.where(foreign, E, idx)
    y = mg.moe_experts(x, idx, w, *g, *u, *dn)
    ref = mg.moe_experts_reference(x, idx, w, *g, *u, *dn)
    assert _rel(y, ref) <= 1e-2
    w_local = jnp.where(foreign, 0.0, w)
    ref_local = mg.moe_experts_reference(x, jnp.where(foreign, 0, idx), w_local, *g, *u, *dn)
    assert _rel(y, ref_local) <= 1e-2


def test_moe_experts_int16_view_matches(experts):
    g, u, dn = experts
    x, idx, w = _moe_case(6, "random")
    y32 = mg.moe_experts(x, idx, w, *g, *u, *dn)
    rp = lambda a: (mg.repack(a[0]), a[1])
    y16 = mg.moe_experts(x, idx, w, *rp(g), *rp(u), *rp(dn))
    np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y16, np.float32))


# ---------------------------------------------------------------------------------------------
# GPU lowering (Triton IR for CUDA, built on CPU): covers the inline-PTX dequantizer's lowering

def test_kernels_lower_for_cuda():
    S = jax.ShapeDtypeStruct
    m, n, k = 4, 256, 1024
    dense = jax.jit(lambda x, p, s: im.int4_matmul(x, p, s, interpret=False))
    try:
        dense.trace(S((m, k), jnp.bfloat16), S((n, k // 8), jnp.int32),
                    S((n, k // 32), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:   # jax >= 0.11's Triton lowering asks a GPU for its compute capability
        if "No supported GPU devices found" in str(e):
            pytest.skip(f"this jax lowers Pallas Triton only with a GPU present ({jax.__version__})")
        raise
    moe = jax.jit(lambda *a: mg.moe_experts(*a, interpret=False))
    e_, d, f, t = 8, 512, 256, 3
    args = [S((t, d), jnp.bfloat16), S((t, 2), jnp.int32), S((t, 2), jnp.float32),
            S((e_, f, d // 8), jnp.int32), S((e_, f, d // 32), jnp.bfloat16),
            S((e_, f, d // 8), jnp.int32), S((e_, f, d // 32), jnp.bfloat16),
            S((e_, d, f // 8), jnp.int32), S((e_, d, f // 32), jnp.bfloat16)]
    moe.trace(*args).lower(lowering_platforms=("cuda",))
    # the single-launch variants (in-register x perm, atomics, fused decode) lower too
    cfg = im.Int4MatmulConfig(block_m=8, block_n=64, block_k=256, swap_ab=True, split_k=2,
                              split_reduce="atomic", x_layout="shuffle")
    jax.jit(lambda x, p, s: im.int4_matmul(x, p, s, config=cfg, interpret=False)).trace(
        S((m, k), jnp.bfloat16), S((n, k // 8), jnp.int32),
        S((n, k // 32), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    for decode, split, stream in (("fused", 1, 0), ("single", 1, 0), ("fused", 2, 0), ("fused", 1, 132),
                                  ("chained", 1, 0), ("chained", 1, 132)):
        cfg = mg.MoeGmmConfig(decode=decode, x_layout="shuffle", split_k_down=split, stream_k_down=stream)
        jax.jit(lambda *a, c=cfg: mg.moe_experts(*a, config=c, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",))
