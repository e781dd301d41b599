"""In-kernel pieces shared by `int4_matmul` and `moe_gmm` (Pallas, Triton backend).

Tile arithmetic ("pair-planes"). The kernels read the packed weights as int16 half-words: half-word
h of word i holds nibbles 4h..4h+3, i.e. weight columns 8i+4h .. 8i+4h+3. For j in 0..3 the
dequantizer emits pair-plane P_j[n, c] (c = 2i + h) = w[n, 8i + 4h + j]: one `lop3` on the 32-bit
word (mask 0x000F000F, magic exponent 0x43004300) yields P_j[n, 2i] and P_j[n, 2i+1] already packed
in one register, exactly as a bf16 MMA operand wants consecutive K elements. The kernel runs 4 MMAs
per K step against activation pair-planes X_j[m, c] = x[m, 8i + 4h + j], kept in the "perm" column
order (column j*(K/4) + c), so y[m, n] = sum_j sum_c X_j[m, c] P_j[n, c]. The group-g scale of
half-word c is scale[n, c // (g/4)], broadcast in-register.

Dequantization modes:
  'asm'  : PTX per packed word (GPU only): 3 shifts + 4 lop3 build four bf16x2 registers of 128+u,
           then per register fma.rn.bf16x2 (x1, -136; exact: q = u - 8) and a bf16x2 multiply by the
           scale: 15 instructions per 8 weights and no int->float conversion or re-packing.
           q * s is rounded once to bf16: bit-identical to the reference `q.to(bf16) * s`.
  'f32'  : plain jnp: shift/and, float32 magic-number conversion (u | 0x4B000000) - (2^23 + 8),
           multiply by scale in f32, round to bf16. Same values as 'asm'. Used in interpret mode.
"""
from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

DEQUANT_MODES = ("asm", "f32")
NPLANES = 4

# pack=2: $4 = the packed word (two int16 elements), $5 = (scale, scale) as bf16x2;
# $0..$3 = pair-planes j=0..3 of this word, each a bf16x2 register (lo: nibble j, hi: nibble j+4).
_ASM = """
{
.reg .b32 t0, t1, t2, t3, w, one, m136;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
lop3.b32 t0, $4, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $4, 4;
lop3.b32 t1, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $4, 8;
lop3.b32 t2, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $4, 12;
lop3.b32 t3, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, m136;
fma.rn.bf16x2 t1, t1, one, m136;
fma.rn.bf16x2 t2, t2, one, m136;
fma.rn.bf16x2 t3, t3, one, m136;
mul.rn.bf16x2 $0, t0, $5;
mul.rn.bf16x2 $1, t1, $5;
mul.rn.bf16x2 $2, t2, $5;
mul.rn.bf16x2 $3, t3, $5;
}
"""


def _install_multi_result_inline_asm_lowering() -> bool:
    """Pallas-Triton's lowering of `elementwise_inline_asm` wraps the op's results in a 1-element list,
    so asm with several outputs fails to lower (jax 0.10.2: "8 outvars do not match 1 outvals").
    Register a rule that returns every result; single-result calls keep the stock rule. Private API:
    guarded, and if it cannot be installed the 'asm' mode simply fails to compile (use 'f32')."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.interpreters import mlir as jmlir
        from jax._src.pallas.triton import lowering as tlow
        from jax._src.pallas.triton import primitives as tprim
        prim = tprim.elementwise_inline_asm_p
        stock = tlow.triton_lowering_rules[prim]
    except Exception:  # noqa: BLE001
        return False
    if getattr(stock, "_int4_multi_result_fix", False):
        return True

    def rule(ctx, *args, asm, constraints, pack, result_shape_dtypes):
        if len(ctx.avals_out) == 1:
            return stock(ctx, *args, asm=asm, constraints=constraints, pack=pack,
                         result_shape_dtypes=result_shape_dtypes)
        types = [ir.RankedTensorType.get(a.shape, jmlir.dtype_to_ir_type(a.dtype))
                 for a in ctx.avals_out]
        op = tt_dialect.ElementwiseInlineAsmOp(result=types, asm_string=asm,
                                               constraints=constraints, pure=True,
                                               packed_element=pack, args=list(args))
        return list(op.results)

    rule._int4_multi_result_fix = True
    tlow.triton_lowering_rules[prim] = rule
    return True


MULTI_RESULT_ASM_OK = _install_multi_result_inline_asm_lowering()


class _RelaxedAtomic(enum.Enum):
    """`atomic_type` of an atomic_rmw that lowers with relaxed memory order (see below)."""
    ADD = "add"


def _install_relaxed_atomic_add_lowering() -> bool:
    """Pallas-Triton lowers every atomic with acquire-release order at GPU scope, which orders the
    atomic after all of the thread's earlier memory operations; an accumulation needs no ordering
    (the kernel's end makes every add visible). Register a rule that lowers atomic_rmw with
    `atomic_type=_RelaxedAtomic.ADD` as a relaxed add and passes every other atomic to the stock
    rule unchanged. Private API: guarded; if it cannot be installed `atomic_add_relaxed` falls back to
    the acquire-release add."""
    try:
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tlow
        from jax._src.pallas.triton import primitives as tprim
        prim = tprim.atomic_rmw_p
        stock = tlow.triton_lowering_rules[prim]
        stock_rmw = tlow._atomic_rmw
        relaxed = tt_dialect.MemSemantic.RELAXED
        add = tprim.AtomicOpType.ADD
    except Exception:  # noqa: BLE001
        return False
    if getattr(stock, "_int4_relaxed_add", False):
        return True

    def rule(ctx, *args, args_tree, atomic_type):
        if atomic_type is not _RelaxedAtomic.ADD:
            return stock(ctx, *args, args_tree=args_tree, atomic_type=atomic_type)
        tlow._atomic_rmw = functools.partial(stock_rmw, semantic=relaxed)   # read by the stock rule
        try:
            return stock(ctx, *args, args_tree=args_tree, atomic_type=add)
        finally:
            tlow._atomic_rmw = stock_rmw

    rule._int4_relaxed_add = True
    tlow.triton_lowering_rules[prim] = rule
    return True


RELAXED_ATOMIC_OK = _install_relaxed_atomic_add_lowering()


def atomic_add_relaxed(ref, idx, val, mask=None):
    """ref[idx] += val with relaxed memory order on the GPU (acquire-release where the rule above is
    not installed). Not for interpret mode (its discharge rule knows only the stock types)."""
    if not RELAXED_ATOMIC_OK:
        return plt.atomic_add(ref, idx, val, mask=mask)
    from jax._src.pallas.triton import primitives as tprim
    from jax._src.state import primitives as state_primitives
    x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
    args_flat, args_tree = jax.tree_util.tree_flatten((x_ref, transforms, val, mask))
    return tprim.atomic_rmw_p.bind(*args_flat, args_tree=args_tree, atomic_type=_RelaxedAtomic.ADD)


def atomic_accumulate(ref, idx, val, live, *, interp: bool, relaxed: bool):
    """ref[idx] += val with f32 atomics from a tile whose `live` lanes (broadcast to val's shape) hold
    real values. On the GPU only live lanes add (relaxed order if `relaxed`, else Pallas' acquire-
    release); interpret mode's atomics take no mask, so every lane adds: the caller gives the other
    lanes distinct padded rows and zeros (duplicate indices would drop adds there)."""
    if interp:
        return plt.atomic_add(ref, idx, val)
    mask = jnp.broadcast_to(live, val.shape)
    if relaxed:
        return atomic_add_relaxed(ref, idx, val, mask=mask)
    return plt.atomic_add(ref, idx, val, mask=mask)


def resolve_interpret(interpret) -> bool:
    """None -> interpret everywhere except on GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def compiler_params(num_warps: int, num_stages: int, interpret: bool):
    if interpret:
        return None
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load(ref_at, mask=None, other=None):
    """Triton-backend load (works in interpret mode too)."""
    if mask is None:
        return plt.load(ref_at)
    return plt.load(ref_at, mask=mask, other=other)


def store(ref_at, value, mask=None):
    if mask is None:
        plt.store(ref_at, value)
    else:
        plt.store(ref_at, value, mask=mask)


def expand_scale(s: jax.Array, words: int) -> jax.Array:
    """scale tile [BN, words/4] -> [BN, words] (one scale per packed word; group 32 = 4 words)."""
    bn, g = s.shape
    rep = words // g
    if rep == 1:
        return s
    return jnp.broadcast_to(s[:, :, None], (bn, g, rep)).reshape(bn, words)


def as_int16(packed: jax.Array) -> jax.Array:
    """int32 [..., N, K/8] -> int16 [..., N, K/4] view (same bytes, little-endian half-words).

    Outside a kernel this is an XLA bitcast-convert; do it once at load (see `repack`) if it is not
    free. int16 input passes through unchanged.
    """
    if packed.dtype == jnp.int16:
        return packed
    if packed.dtype != jnp.int32:
        raise TypeError(f"packed INT4 weights must be int32 (or their int16 view), got {packed.dtype}")
    v = lax.bitcast_convert_type(packed, jnp.int16)
    return v.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def repack(packed: jax.Array) -> jax.Array:
    """Optional one-time load step: the int16 view of the checkpoint's int32 words (same bytes, same
    0.5 B/weight). The kernels read int16 half-words; passing int32 works too but then each call
    starts with an XLA bitcast-convert, which may or may not be free (see NOTES.md)."""
    return as_int16(packed)


def dequant_pairs(w16: jax.Array, s_exp: jax.Array, mode: str) -> list[jax.Array]:
    """w16 int16 [BN, C] (C = 2 * words), s_exp bf16 [BN, C] -> 4 bf16 pair-planes [BN, C]."""
    if mode == "asm":
        s16 = lax.bitcast_convert_type(s_exp, jnp.int16)
        outs = plt.elementwise_inline_asm(
            _ASM, args=[w16, s16], constraints="=r,=r,=r,=r,r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(w16.shape, jnp.int16)] * NPLANES)
        return [lax.bitcast_convert_type(o, jnp.bfloat16) for o in outs]
    if mode == "f32":
        sf = s_exp.astype(jnp.float32)
        w = w16.astype(jnp.int32) & 0xFFFF
        planes = []
        for j in range(NPLANES):
            u = lax.shift_right_logical(w, jnp.int32(4 * j)) & 0xF
            q = lax.bitcast_convert_type(u | 0x4B000000, jnp.float32) - 8388616.0   # 2^23 + 8
            planes.append((q * sf).astype(jnp.bfloat16))
        return planes
    raise ValueError(f"unknown dequant mode {mode!r}; expected one of {DEQUANT_MODES}")


def plane_dot(plane: jax.Array, xp: jax.Array, swap_ab: bool) -> jax.Array:
    """plane bf16 [BN, C], xp bf16 [BM, C] -> f32 [BN, BM] if swap_ab else [BM, BN]."""
    dn = (((1,), (1,)), ((), ()))
    if swap_ab:
        return lax.dot_general(plane, xp, dn, preferred_element_type=jnp.float32)
    return lax.dot_general(xp, plane, dn, preferred_element_type=jnp.float32)


def pick_block_k(k: int, want: int) -> int:
    """Largest power-of-two block <= want that divides k, at least 64 (16 columns per pair-plane)."""
    bk = want
    while bk > 64 and k % bk:
        bk //= 2
    if k % bk or bk < 64:
        raise ValueError(f"K={k} must be a multiple of 64 for the INT4 kernels")
    return bk


def perm_columns(a: jax.Array) -> jax.Array:
    """[..., K] -> [..., K] in pair-plane order: column j*(K/4) + 2i + h holds a[..., 8i + 4h + j]."""
    *lead, k = a.shape
    r = a.reshape(*lead, k // 8, 2, 4)
    return jnp.moveaxis(r, -1, -3).reshape(*lead, k)


def perm_index(f: jax.Array, k: int) -> jax.Array:
    """Column of natural index f in the perm order (int32 arithmetic, bit ops only)."""
    return (f & 3) * (k // 4) + ((f >> 3) << 1) + ((f >> 2) & 1)


def natural_index(j: int, c: jax.Array) -> jax.Array:
    """Natural column of pair-plane j, position c."""
    return ((c >> 1) << 3) + ((c & 1) << 2) + j


X_LAYOUTS = ("perm", "natural", "shuffle")


def split_planes(xn: jax.Array) -> list[jax.Array]:
    """Activation tile in natural column order [BM, BK] -> its 4 pair-planes [BM, BK/4] (plane j,
    column c = 2i + h holds natural column 8i + 4h + j), in registers: two size-2 unstacks (Triton
    `split`) of one contiguous load, instead of an XLA permute per call ('perm') or a strided
    per-element gather ('natural', which compiles to scalar LDG.U16, see NOTES.md)."""
    bm, bk = xn.shape
    r = xn.reshape(bm, bk // 8, 2, 2, 2)          # [BM, i, h, a, b]: natural column 8i + 4h + 2a + b
    planes = [None] * NPLANES
    for b, rb in enumerate(lax.unstack(r, axis=4)):          # [BM, i, h, a]
        for a, rab in enumerate(lax.unstack(rb, axis=3)):    # [BM, i, h]
            planes[2 * a + b] = rab.reshape(bm, bk // 4)
    return planes


def load_x_planes(x_ref, rows, valid, kk, c0, k: int, bk: int, layout: str) -> list[jax.Array]:
    """The 4 activation pair-planes [BM, BK/4] of K step kk (c0 = kk * BK/4) for rows [BM, 1]
    (masked by valid [BM, 1]; masked rows read nothing and give 0), from x in `layout`:
    'perm' (columns already in pair-plane order), 'natural' (strided gather) or 'shuffle'
    (natural order, one contiguous load split in registers)."""
    if layout == "shuffle":
        cols = kk * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
        return split_planes(load(x_ref.at[rows, cols], mask=valid, other=0.0))
    ic = jnp.arange(bk // 4, dtype=jnp.int32)[None, :]
    out = []
    for p in range(NPLANES):
        if layout == "perm":
            cols = p * (k // 4) + c0 + ic
        elif layout == "natural":
            cols = kk * bk + natural_index(p, ic)
        else:
            raise ValueError(f"unknown x_layout {layout!r}; expected one of {X_LAYOUTS}")
        out.append(load(x_ref.at[rows, cols], mask=valid, other=0.0))
    return out
