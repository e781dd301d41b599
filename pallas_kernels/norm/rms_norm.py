"""Residual add + RMSNorm in one Pallas (Triton backend) launch.

  h = x + r (in x's dtype, as the model adds its residual);  y = w * (h32 / sqrt(mean(h32^2) + eps))
  with h32 = h as float32 and the normalized value rounded to x's dtype before the weight multiply
  (kimi_jax.model.layers.RMSNorm's semantics). Without r: y = norm(x) alone.

XLA runs this as three kernels (the add, the mean of squares, the scale; ~1.3 us each plus ~2 us of
host enqueue each at batch 1 on an H200), twice per decoder layer. Here one program per row loads the
whole row once (D padded to a power of two in-register, masked: Kimi's D = 7168 is a [8192] tile, 32
values per thread at 8 warps), writes h, reduces, and writes y. `add_rms_norm_reference` is the
same math in jnp.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4 import tile


def _kernel(*refs, d: int, eps: float, residual: bool):
    # x_ref [N, D], (r_ref [N, D]), w_ref [D]; outputs (h_ref [N, D]), y_ref [N, D]
    if residual:
        x_ref, r_ref, w_ref, h_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    row = pl.program_id(0)
    cols = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32)
    ok = cols < d
    c = jnp.minimum(cols, d - 1)
    h = tile.load(x_ref.at[row, c], mask=ok, other=0.0)
    if residual:
        h = h + tile.load(r_ref.at[row, c], mask=ok, other=0.0)
        tile.store(h_ref.at[row, cols], h, mask=ok)
    h32 = h.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(h32 * h32) / d + eps)
    w = tile.load(w_ref.at[c], mask=ok, other=0.0)
    tile.store(y_ref.at[row, cols], (w * (h32 * inv).astype(h.dtype)).astype(y_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_rms_norm(x, r, w_D, eps: float, *, num_warps: int = 0, interpret=None):
    """(h = x + r, y = norm(h)) for r given, else y = norm(x); x, r [..., D] of one dtype, w_D [D].
    num_warps 0: 8 from D >= 4096, else 4. interpret None: everywhere but on a GPU."""
    D = x.shape[-1]
    if w_D.shape != (D,) or (r is not None and (r.shape != x.shape or r.dtype != x.dtype)):
        raise ValueError(f"add_rms_norm: x {x.shape} {x.dtype}, residual "
                         f"{None if r is None else (r.shape, r.dtype)}, weight {w_D.shape} do not match")
    interpret = tile.resolve_interpret(interpret)
    n = math.prod(x.shape[:-1])
    rows = (x.reshape(-1, D),) + (() if r is None else (r.reshape(-1, D),))
    y_dtype = jnp.result_type(w_D.dtype, x.dtype)
    shapes = (() if r is None else (jax.ShapeDtypeStruct((n, D), x.dtype),)) + (jax.ShapeDtypeStruct((n, D), y_dtype),)
    outs = pl.pallas_call(
        functools.partial(_kernel, d=D, eps=eps, residual=r is not None),
        out_shape=shapes,
        grid=(n,),
        interpret=interpret,
        compiler_params=tile.compiler_params(num_warps or (8 if D >= 4096 else 4), 1, interpret),
        name="add_rms_norm" if r is not None else "rms_norm",
    )(*rows, w_D)
    outs = tuple(o.reshape(x.shape) for o in outs)
    return outs if r is not None else outs[0]


def add_rms_norm_reference(x, r, w_D, eps: float):
    """jnp: (x + r, norm(x + r)), or norm(x) without r; the model's RMSNorm."""
    h = x if r is None else x + r
    h32 = h.astype(jnp.float32)
    y = w_D * (h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)).astype(h.dtype)
    return y if r is None else (h, y)
