"""DeepSeek-V3 / Kimi-K2 sigmoid top-k routing (no group limit) in one Pallas (Triton backend) launch.

  s = sigmoid(x W^T) (float32), choice = s + bias, the K best choices (lowest index first on ties,
  as `jax.lax.top_k`), weights = s there, / their sum (norm_topk_prob), * routed_scaling_factor.

XLA runs this as five small kernels per MoE layer (the gemv, the bias add, a sort, a gather /
normalize fusion and a pad: ~8 us of device time and ~10 us of host enqueue at batch 1 on an H200).
`sigmoid_topk` has two forms (`RouterConfig.gemv`):

- 'xla' (default): the logits from XLA's gemv (one kernel, ~2.3 us for Kimi's 11 MB float32 W),
  everything after it in one program per `block_t` tokens: two launches in all.
- 'kernel': the gemv in the same program too, looping over D in `block_d` columns (x widened to
  float32, products of [block_t, E, block_d] summed over D in float32): ONE launch, but a token
  block's program streams all of W by itself. That is cheap for 16 experts (0.46 MB) and slow for 384
  (11 MB through one SM: tens of us); a split of the gemv over programs needs a cross-program
  reduction (a second launch, or atomic tickets with a zeroed counter per call), i.e. the 'xla' form.

In the program E is padded to a power of two (Triton's tile shapes): padded experts read as -inf and
are never chosen. Top-K is K rounds of (row max, lowest index holding it, mask it out).
`sigmoid_topk_reference` is the XLA router (with the group limit too); the model's 'xla' path runs it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile

GEMVS = ("xla", "kernel")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """gemv: where the logits are computed (module docstring). block_t: tokens per program (0: up to
    16 for 'xla', 1 for 'kernel': every token block re-reads W). block_d: the 'kernel' form's D step
    (0: as many columns as keep a [block_t, E, block_d] product at 8K values)."""
    gemv: str = "xla"
    block_t: int = 0
    block_d: int = 0
    num_warps: int = 4

    def __post_init__(self):
        if self.gemv not in GEMVS:
            raise ValueError(f"RouterConfig.gemv={self.gemv!r}; expected one of {GEMVS}")
        for name in ("block_t", "block_d"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1):
                raise ValueError(f"RouterConfig.{name}={v} must be 0 (automatic) or a power of two")


def _select(s, choice, cols, *, k: int, kp: int, norm: bool, scaling: float):
    """s, choice [bt, ep] float32 (padded experts: choice -inf) -> (ids [bt, kp] int32, weights [bt, kp])."""
    ep = choice.shape[1]
    kk = jnp.arange(kp, dtype=jnp.int32)[None, :]
    ids = jnp.zeros((choice.shape[0], kp), jnp.int32)
    ws = jnp.zeros((choice.shape[0], kp), jnp.float32)
    for j in range(k):
        best = jnp.max(choice, axis=1, keepdims=True)
        i = jnp.min(jnp.where(choice == best, cols, ep), axis=1, keepdims=True)        # lowest index wins
        hit = cols == i
        w = jnp.sum(jnp.where(hit, s, 0.0), axis=1, keepdims=True)
        ids = jnp.where(kk == j, i, ids)
        ws = jnp.where(kk == j, w, ws)
        choice = jnp.where(hit, -jnp.inf, choice)
    if norm:
        ws = ws / (jnp.sum(ws, axis=1, keepdims=True) + 1e-20)
    return ids, ws * scaling


def _kernel(*refs, t: int, e: int, d: int, k: int, bt: int, bd: int, gemv: bool, norm: bool, scaling: float):
    # gemv: x_ref [T, D] (bf16 or f32), w_ref [E, D] f32; else logits_ref [T, E] f32. Then bias_ref [E] f32;
    # outputs idx_ref [T, K] int32, wt_ref [T, K] f32.
    *ins, bias_ref, idx_ref, wt_ref = refs
    f32 = jnp.float32
    ep, kp = pl.next_power_of_2(e), pl.next_power_of_2(k)
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    live = rows < t
    rc = jnp.minimum(rows, t - 1)
    e1 = jnp.arange(ep, dtype=jnp.int32)
    has_e1, ec1 = e1 < e, jnp.minimum(e1, e - 1)
    cols, has_e = e1[None, :], has_e1[None, :]                            # [1, ep]
    if gemv:
        x_ref, w_ref = ins
        kd = jnp.arange(bd, dtype=jnp.int32)

        def step(i, acc):
            dd = i * bd + kd
            xb = tile.load(x_ref.at[rc[:, None], dd[None, :]]).astype(f32)                  # [bt, bd]
            wb = tile.load(w_ref.at[ec1[:, None], dd[None, :]], mask=has_e1[:, None], other=0.0)  # [ep, bd]
            return acc + jnp.sum(xb[:, None, :] * wb[None, :, :].astype(f32), axis=2)

        logits = lax.fori_loop(0, d // bd, step, jnp.zeros((bt, ep), f32))
    else:
        logits = tile.load(ins[0].at[rc[:, None], ec1[None, :]], mask=has_e, other=0.0)     # [bt, ep]
    s = 1.0 / (1.0 + jnp.exp(-logits))                                    # jax.nn.sigmoid's expansion
    bias = tile.load(bias_ref.at[ec1], mask=has_e1, other=0.0)
    choice = jnp.where(has_e, s + bias[None, :], -jnp.inf)
    ids, ws = _select(s, choice, cols, k=k, kp=kp, norm=norm, scaling=scaling)
    kk = jnp.arange(kp, dtype=jnp.int32)
    ok = live[:, None] & (kk[None, :] < k)
    at = (rows[:, None], kk[None, :])          # not clamped: a masked-off duplicate index would win in interpret mode
    tile.store(idx_ref.at[at], ids, mask=ok)
    tile.store(wt_ref.at[at], ws, mask=ok)


def _blocks(cfg: RouterConfig, t: int, e: int, d: int) -> tuple[int, int]:
    bt = cfg.block_t or (1 if cfg.gemv == "kernel" else min(16, pl.next_power_of_2(t)))
    bd = cfg.block_d or max(16, 8192 // (bt * pl.next_power_of_2(e)))
    bd = min(bd, d & -d)                                     # a power of two dividing D
    return bt, bd


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "scaling", "config", "interpret"))
def sigmoid_topk(x_TD, w_ED, bias_E, *, k: int, norm_topk_prob: bool = True, scaling: float = 1.0,
                 config: RouterConfig = RouterConfig(), interpret=None):
    """-> (expert ids [T, K] int32, weights [T, K] float32), as `sigmoid_topk_reference` with one group.
    x_TD bf16 or float32; w_ED and bias_E float32. interpret None: everywhere but on a GPU."""
    T, D = x_TD.shape
    E = w_ED.shape[0]
    if w_ED.shape != (E, D) or bias_E.shape != (E,) or not 1 <= k <= E:
        raise ValueError(f"sigmoid_topk: x {x_TD.shape}, W {w_ED.shape}, bias {bias_E.shape}, k={k} "
                         "do not match ([T, D], [E, D], [E], 1 <= k <= E)")
    interpret = tile.resolve_interpret(interpret)
    gemv = config.gemv == "kernel"
    bt, bd = _blocks(config, T, E, D)
    if gemv:
        ins = (x_TD, w_ED.astype(jnp.float32))
    else:
        ins = (jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), w_ED, precision=lax.Precision.HIGHEST),)
    kernel = functools.partial(_kernel, t=T, e=E, d=D, k=k, bt=bt, bd=bd, gemv=gemv, norm=norm_topk_prob,
                               scaling=scaling)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, k), jnp.int32), jax.ShapeDtypeStruct((T, k), jnp.float32)),
        grid=(pl.cdiv(T, bt),),
        interpret=interpret,
        compiler_params=tile.compiler_params(config.num_warps, 2, interpret),
        name="sigmoid_topk_router",
    )(*ins, bias_E.astype(jnp.float32))


def sigmoid_topk_reference(x_TD, w_ED, bias_E, *, k: int, n_group: int = 1, topk_group: int = 1,
                           norm_topk_prob: bool = True, scaling: float = 1.0):
    """The XLA router (noaux_tc), float32: with n_group > 1 only the topk_group groups whose two best
    biased scores sum highest are eligible. -> (ids [T, K] int32, weights [T, K] float32)."""
    E = w_ED.shape[0]
    logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), w_ED, precision=lax.Precision.HIGHEST)
    s_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = s_TE + bias_E
    if n_group > 1:
        T = choice_TE.shape[0]
        grouped_TGe = choice_TE.reshape(T, n_group, E // n_group)
        group_score_TG = lax.top_k(grouped_TGe, 2)[0].sum(-1)
        _, kept_Tk = lax.top_k(group_score_TG, topk_group)
        keep_TG = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], kept_Tk].set(True)
        choice_TE = jnp.where(jnp.repeat(keep_TG, E // n_group, axis=1), choice_TE, -jnp.inf)
    _, idx_TK = lax.top_k(choice_TE, k)
    w_TK = jnp.take_along_axis(s_TE, idx_TK, axis=-1)
    if norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdims=True) + 1e-20)
    return idx_TK.astype(jnp.int32), w_TK * scaling
