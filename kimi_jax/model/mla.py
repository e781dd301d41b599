"""Multi-head Latent Attention (DeepSeek-V2/V3), with both the expanded and the absorbed form.

Per token, the keys and values of all N heads are generated from one latent c_t (A = kv_lora_rank
values, RMS-normalized) plus one rope key k^R_t (R values) shared by every head. The cache holds
just those A + R values per token per layer.

Expanded (prefill):   k^C_{t,n} = W^UK_n c_t,  v_{t,n} = W^UV_n c_t,
                      score = (q^C_n . k^C_{s,n} + q^R_n . k^R_s) * scale
Absorbed (decode):    q~_n = (W^UK_n)^T q^C_n  (a query in latent space),
                      score = (q~_n . c_s + q^R_n . k^R_s) * scale,
                      o_n = W^UV_n sum_s p_s c_s
The two are the same function; tests check they agree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.model.layer_weights import AbsorbedKvB, JointQKvA
from kimi_jax.model.layers import Linear, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

_NEG = -1e30  # finite mask value: a fully-masked row can't produce NaN


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, parallel=None):
        # kimi_jax.parallel.sharding.MoEParallel or None: lets the kernel run per shard
        self.parallel = parallel
        D, N, H, R, A, U = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim)
        self.cfg = cfg
        self.dims = (N, H, R, A, U)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, N * (H + R), ("q_heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            Q = cfg.q_lora_rank
            self.q_a_proj = Linear(D, Q, ("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(Q, cfg.latent_norm_eps, dtype=dtype, parallel=parallel)
            self.q_b_proj = Linear(Q, N * (H + R), ("q_heads", "q_lora"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(D, A + R, ("kv_latent", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(A, cfg.latent_norm_eps, dtype=dtype, parallel=parallel)
        self.kv_b_proj = Linear(A, N * (H + U), ("kv_heads", "kv_lora"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(N * U, D, ("embed", "o_heads"), dtype=dtype, rngs=rngs)

    # -- projections ------------------------------------------------------------------------------
    def _down_projections(self, x_BTD, plan=None):
        """(q_a(x) [B, T, Q] or None without a q LoRA, kv_a(x) [B, T, A + R]): one product under a
        JointQKvA."""
        if self.cfg.q_lora_rank is None:
            return None, self.kv_a_proj_with_mqa(x_BTD, plan)
        w = self.q_a_proj.weight.get_value()
        if isinstance(w, JointQKvA):
            y = ops.linear(x_BTD, w.w_XD, plan=plan)
            return y[..., :w.q_rows], y[..., w.q_rows:]
        return self.q_a_proj(x_BTD, plan), self.kv_a_proj_with_mqa(x_BTD, plan)

    def _queries(self, x_BTD, q_a_BTQ, cos, sin, plan=None):
        N, H, R, _, _ = self.dims
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x_BTD, plan)
        else:
            q = self.q_b_proj(self.q_a_layernorm(q_a_BTQ, plan=plan), plan)
        q_BTNW = q.reshape(*x_BTD.shape[:-1], N, H + R)
        q_nope_BTNH, q_pe_BTNR = q_BTNW[..., :H], q_BTNW[..., H:]
        return q_nope_BTNH, apply_rope(q_pe_BTNR, cos[..., None, :], sin[..., None, :])

    def latents(self, kv_BTC, cos, sin, plan=None):
        """The cache's entries [c (A) | rotated k^R (R)] -> [B, T, A + R] of tokens whose kv_a(x) is
        kv_BTC."""
        _, _, _, A, _ = self.dims
        c_BTA = self.kv_a_layernorm(kv_BTC[..., :A], plan=plan)
        kpe_BTR = apply_rope(kv_BTC[..., A:], cos, sin)
        return jnp.concatenate([c_BTA, kpe_BTR], axis=-1)

    def _kv_b(self):
        """(W_UK^T [N, A, H], W_UV [N, U, A]): the layer's AbsorbedKvB, or kv_b_proj slices."""
        N, H, _, A, U = self.dims
        w = self.kv_b_proj.weight.get_value()
        if isinstance(w, AbsorbedKvB):
            return w.uk_NAH, w.uv_NUA
        w = w.reshape(N, H + U, A)
        return w[:, :H, :].swapaxes(1, 2), w[:, H:, :]

    # -- attention --------------------------------------------------------------------------------
    def __call__(
        self,
        x_BTD,
        positions_BT,
        cache=None,
        *,
        absorbed: bool = False,
        block_table_BP=None,
        fresh: bool = False,
        layer=None,
        plan=None,
    ):
        """Dispatch to the entry point the arguments name. cache: with block_table_BP the paged pool
        (the stack's [L, X, p, C] with `layer`, or one layer's [X, p, C]); else a contiguous cache
        [B, S, C] or None."""
        if block_table_BP is None:
            return self.contiguous(
                x_BTD, positions_BT, cache, absorbed=absorbed, fresh=fresh, plan=plan
            )
        pool_LXpC, layer = (cache[None], 0) if layer is None else (cache, layer)
        if absorbed or not fresh and ops.default_plan(plan).absorbs_chunk(x_BTD.shape[1]):
            return self.paged_decode(
                x_BTD, positions_BT, pool_LXpC, block_table_BP, layer, plan=plan
            )
        if fresh:
            return self.fresh_prefill(x_BTD, positions_BT, plan=plan)
        return self.chunk_prefill(x_BTD, positions_BT, pool_LXpC, block_table_BP, layer, plan=plan)

    def paged_decode(self, x_BTD, positions_BT, pool_LXpC, block_table_BP, layer, *, plan=None):
        """Absorbed attention over each row's cached pages plus its new tokens (decode,
        verification): one op (`ops.mla_paged_attention`; a GPU kernel reads the pages in place).
        pool_LXpC: the stack's paged pool, `layer` this layer's index into it; block_table_BP: page
        ids into one layer's pages (under data parallelism local to the row's shard,
        `ops.page_split`). Returns (output [B, T, D], the new latents [B, T, C], written after all
        layers by `write_pages`)."""
        N, H, R, A, U = self.dims
        q_nope_BTNH, q_pe_BTNR, new_BTC = self._project(x_BTD, positions_BT, plan)
        w_uk, w_uv = self._kv_b()
        q_lat_BTNA = ops.einsum_f32("btnh,nah->btna", q_nope_BTNH, w_uk,
                                    invariant=_invariant(plan), weight=True).astype(x_BTD.dtype)
        o_lat_BTNA = ops.mla_paged_attention(
            q_lat_BTNA,
            q_pe_BTNR,
            new_BTC,
            pool_LXpC,
            block_table_BP,
            positions_BT,
            self.cfg.softmax_scale,
            plan=plan,
            parallel=self.parallel,
            layer=layer,
        ).astype(x_BTD.dtype)
        o_BTNU = ops.einsum_f32("btna,nua->btnu", o_lat_BTNA, w_uv, invariant=_invariant(plan),
                                weight=True)
        return self._out(o_BTNU, x_BTD, plan), new_BTC

    def ragged(self, x_BTD, positions_BT, pool_LXpC, rows, layer, *, max_pages, plan=None):
        """Absorbed attention of a ragged step (`ops.mla_ragged_attention`): x_BTD holds one batch
        row per data-parallel rank, its T tokens any mix of rows (`ops.RaggedRows`, indices local
        to the rank's block); pool_LXpC and layer as `paged_decode`. Returns (output [B, T, D], the
        new latents [B, T, C], written after all layers by `write_slots`)."""
        q_nope_BTNH, q_pe_BTNR, new_BTC = self._project(x_BTD, positions_BT, plan)
        w_uk, w_uv = self._kv_b()
        q_lat_BTNA = ops.einsum_f32("btnh,nah->btna", q_nope_BTNH, w_uk,
                                    invariant=_invariant(plan), weight=True).astype(x_BTD.dtype)
        o_lat_BTNA = ops.mla_ragged_attention(
            q_lat_BTNA, q_pe_BTNR, new_BTC, pool_LXpC, rows, positions_BT, self.cfg.softmax_scale,
            max_pages=max_pages, plan=plan, parallel=self.parallel, layer=layer,
        ).astype(x_BTD.dtype)
        o_BTNU = ops.einsum_f32("btna,nua->btnu", o_lat_BTNA, w_uv, invariant=_invariant(plan),
                                weight=True)
        return self._out(o_BTNU, x_BTD, plan), new_BTC

    def fresh_prefill(self, x_BTD, positions_BT, *, plan=None):
        """Expanded attention over this step's tokens only: no row has cached tokens (its real
        tokens sit at positions 0, 1, ... from its first column, padding (< 0) after them), so the
        cache is not read; causal through `ops.mla_prefill_attention` (cuDNN flash attention on a
        GPU). Returns (output [B, T, D], the new latents [B, T, C])."""
        q_nope_BTNH, q_pe_BTNR, new_BTC = self._project(x_BTD, positions_BT, plan)
        return self._expanded(
            x_BTD, q_nope_BTNH, q_pe_BTNR, new_BTC, _causal(positions_BT), True, plan
        ), new_BTC

    def chunk_prefill(self, x_BTD, positions_BT, pool_LXpC, block_table_BP, layer, *, plan=None):
        """Expanded attention for a prompt chunk after cached tokens: each row's cached pages
        (positions before its first new token) plus its new tokens, causally (`ops.paged_keys`). New
        tokens of a row have consecutive positions, padding only after them. Returns (output [B, T,
        D], the new latents [B, T, C])."""
        q_nope_BTNH, q_pe_BTNR, new_BTC = self._project(x_BTD, positions_BT, plan)
        keys_BSC, mask_BTS = ops.paged_keys(
            pool_LXpC, block_table_BP, new_BTC, positions_BT, layer=layer, parallel=self.parallel
        )
        # the same layout as lengths: cached tokens before the row's first, then its real new ones
        chunk_lens = (jnp.maximum(positions_BT[:, 0], 0), jnp.sum(positions_BT >= 0, axis=1))
        o_BTD = self._expanded(
            x_BTD, q_nope_BTNH, q_pe_BTNR, keys_BSC, mask_BTS, False, plan, chunk_lens
        )
        return o_BTD, new_BTC

    def contiguous(
        self,
        x_BTD,
        positions_BT,
        cache_BSC=None,
        *,
        absorbed: bool = False,
        fresh: bool = False,
        plan=None,
    ):
        """Attention over a contiguous cache [B, S, C] (the profiler's reference step): the new
        latents are written at their positions (writes at S or beyond dropped) and each query sees
        slots up to its position. cache_BSC None: the new tokens only. fresh (expanded only): as
        `fresh_prefill`. Returns (output [B, T, D], the updated cache, or new latents [B, T, C])."""
        q_nope_BTNH, q_pe_BTNR, new_BTC = self._project(x_BTD, positions_BT, plan)
        fresh = fresh and not absorbed
        if cache_BSC is None:
            keys_BSC, key_pos_BS, out = new_BTC, positions_BT, new_BTC
        else:
            B, S = cache_BSC.shape[:2]
            cache_BSC = cache_BSC.at[jnp.arange(B)[:, None], positions_BT].set(
                new_BTC.astype(cache_BSC.dtype), mode="drop"
            )
            keys_BSC, key_pos_BS, out = (
                cache_BSC,
                jnp.broadcast_to(jnp.arange(S), (B, S)),
                cache_BSC,
            )
            if fresh:     # the written cache holds nothing a query may see beyond the new tokens
                keys_BSC, key_pos_BS = new_BTC, positions_BT
        mask_BTS = (
            _causal(positions_BT) if fresh else key_pos_BS[:, None, :] <= positions_BT[:, :, None]
        )
        if not absorbed:
            return self._expanded(
                x_BTD, q_nope_BTNH, q_pe_BTNR, keys_BSC, mask_BTS, fresh, plan
            ), out
        _, _, _, A, _ = self.dims
        w_uk, w_uv = self._kv_b()
        c_BSA, kpe_BSR = (
            keys_BSC[..., :A].astype(x_BTD.dtype),
            keys_BSC[..., A:].astype(x_BTD.dtype),
        )
        rope_BNTS = ops.einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR,
                                   invariant=_invariant(plan))
        q_lat_BTNA = ops.einsum_f32("btnh,nah->btna", q_nope_BTNH, w_uk,
                                    invariant=_invariant(plan), weight=True).astype(x_BTD.dtype)
        nope_BNTS = ops.einsum_f32("btna,bsa->bnts", q_lat_BTNA, c_BSA, invariant=_invariant(plan))
        p_BNTS = _softmax((nope_BNTS + rope_BNTS) * self.cfg.softmax_scale, mask_BTS, plan).astype(
            x_BTD.dtype
        )
        o_lat_BTNA = ops.einsum_f32("bnts,bsa->btna", p_BNTS, c_BSA,
                                    invariant=_invariant(plan)).astype(x_BTD.dtype)
        return self._out(ops.einsum_f32("btna,nua->btnu", o_lat_BTNA, w_uv,
                                        invariant=_invariant(plan), weight=True), x_BTD, plan), out

    def _project(self, x_BTD, positions_BT, plan=None):
        """(q_nope [B, T, N, H], rotated q_pe [B, T, N, R], the new latents [B, T, C])."""
        cos, sin = rope_cos_sin(
            positions_BT, rope_inv_freq(self.cfg), self.cfg.rope_scaling.cos_sin_scale
        )
        q_a_BTQ, kv_BTC = self._down_projections(x_BTD, plan)
        return (*self._queries(x_BTD, q_a_BTQ, cos, sin, plan),
                self.latents(kv_BTC, cos, sin, plan))

    def _expanded(
        self, x_BTD, q_nope_BTNH, q_pe_BTNR, keys_BSC, mask_BTS, causal, plan, chunk_lens=None
    ):
        """Expanded attention: keys and values from the latents keys_BSC through W_UK, W_UV."""
        _, _, _, A, _ = self.dims
        w_uk, w_uv = self._kv_b()
        c_BSA, kpe_BSR = (
            keys_BSC[..., :A].astype(x_BTD.dtype),
            keys_BSC[..., A:].astype(x_BTD.dtype),
        )
        k_BSNH = ops.einsum_f32("bsa,nah->bsnh", c_BSA, w_uk,
                                invariant=_invariant(plan)).astype(x_BTD.dtype)
        v_BSNU = ops.einsum_f32("bsa,nua->bsnu", c_BSA, w_uv,
                                invariant=_invariant(plan)).astype(x_BTD.dtype)
        o_BTNU = ops.mla_prefill_attention(
            q_nope_BTNH,
            q_pe_BTNR,
            k_BSNH,
            kpe_BSR,
            v_BSNU,
            mask_BTS,
            self.cfg.softmax_scale,
            causal=causal,
            plan=plan,
            parallel=self.parallel,
            chunk_lens=chunk_lens,
        )
        return self._out(o_BTNU, x_BTD, plan)

    def _out(self, o_BTNU, x_BTD, plan=None):
        N, _, _, _, U = self.dims
        return self.o_proj(o_BTNU.astype(x_BTD.dtype).reshape(*x_BTD.shape[:-1], N * U), plan)


def _invariant(plan) -> int:
    """einsum_f32's invariant: the plan's row tile (0: off)."""
    return ops.default_plan(plan).row_tile


def _causal(positions_BT):
    """The new tokens, causally, padding keys never seen (as ops.paged_keys' new part)."""
    return (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (positions_BT[:, None, :] >= 0)


def write_pages(pool_LXpC, block_table_BP, positions_BT, new_LBTC, parallel=None):
    """Write every layer's new latents into their slots (tokens at position < 0 are padding).
    parallel: a page-split pool (`ops.page_split`, ids local to each row's shard) is written per
    shard: each data-parallel rank writes its own rows into its own pages."""

    def write(pool_LXpC, block_table_BP, positions_BT, new_LBTC):
        n_pages, page = pool_LXpC.shape[1:3]
        valid = positions_BT >= 0
        pos = jnp.where(valid, positions_BT, 0)
        page_of = jnp.take_along_axis(block_table_BP, pos // page, axis=1)
        # padding: dropped
        slot = jnp.where(valid, page_of * page + pos % page, n_pages * page).reshape(-1)
        return _scatter_slots(pool_LXpC, slot, new_LBTC)

    write = ops.per_page_shard(
        write,
        parallel,
        (
            (None, "split", None, None),
            ("split", None),
            ("split", None),
            (None, "split", None, None),
        ),
        (None, "split", None, None),
    )
    return write(pool_LXpC, block_table_BP, positions_BT, new_LBTC)


def write_slots(pool_LXpC, slots_BT, new_LBTC, parallel=None):
    """Write every layer's new latents at their pool slots (page * p + offset; a slot < 0 or past
    the pool is padding, dropped). parallel: a page-split pool (`ops.page_split`) is written per
    shard, each data-parallel rank its batch rows' tokens into its own pages (slots local to it)."""

    def write(pool_LXpC, slots_BT, new_LBTC):
        n_pages, page = pool_LXpC.shape[1:3]
        slot = jnp.where(slots_BT >= 0, slots_BT, n_pages * page).reshape(-1)
        return _scatter_slots(pool_LXpC, slot, new_LBTC)

    write = ops.per_page_shard(
        write,
        parallel,
        ((None, "split", None, None), ("split", None), (None, "split", None, None)),
        (None, "split", None, None),
    )
    return write(pool_LXpC, slots_BT, new_LBTC)


def _scatter_slots(pool_LXpC, slot, new_LBTC):
    """The pool with every layer's new latents at their flat slots (page * p + offset; slots past
    the pool dropped): the one write of `write_pages` and `write_slots`."""
    n_layers, n_pages, page, C = pool_LXpC.shape
    flat = pool_LXpC.reshape(n_layers, n_pages * page, C).at[:, slot].set(
        new_LBTC.reshape(n_layers, -1, C).astype(pool_LXpC.dtype), mode="drop")
    return flat.reshape(pool_LXpC.shape)


def _softmax(scores_BNTS, mask_BTS, plan=None):
    s = jnp.where(mask_BTS[:, None], scores_BNTS, _NEG)
    return ops.softmax(s, invariant=_invariant(plan))
