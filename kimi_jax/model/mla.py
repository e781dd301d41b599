"""Multi-head Latent Attention (DeepSeek-V2/V3), with both the expanded and the absorbed form.

Per token, the keys and values of all N heads are generated from one latent c_t (A = kv_lora_rank
values, RMS-normalized) plus one rope key k^R_t (R values) shared by every head. The cache holds just
those A + R values per token per layer.

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
from kimi_jax.model.layers import Linear, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

_NEG = -1e30  # finite mask value: a fully-masked row can't produce NaN


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, parallel=None):
        self.parallel = parallel  # kimi_jax.parallel.sharding.MoEParallel or None: lets the kernel run per shard
        D, N, H, R, A, U = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim)
        self.cfg = cfg
        self.dims = (N, H, R, A, U)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, N * (H + R), ("q_heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            Q = cfg.q_lora_rank
            self.q_a_proj = Linear(D, Q, ("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(Q, cfg.latent_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(Q, N * (H + R), ("q_heads", "q_lora"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(D, A + R, ("kv_latent", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(A, cfg.latent_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(A, N * (H + U), ("kv_heads", "kv_lora"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(N * U, D, ("embed", "o_heads"), dtype=dtype, rngs=rngs)

    # -- projections ------------------------------------------------------------------------------
    def _queries(self, x_BTD, cos, sin):
        N, H, R, _, _ = self.dims
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BTNW = q.reshape(*x_BTD.shape[:-1], N, H + R)
        q_nope_BTNH, q_pe_BTNR = q_BTNW[..., :H], q_BTNW[..., H:]
        return q_nope_BTNH, apply_rope(q_pe_BTNR, cos[..., None, :], sin[..., None, :])

    def latents(self, x_BTD, positions_BT):
        """What the cache stores for these tokens: [c (A) | rotated k^R (R)] -> [B, T, A + R]."""
        _, _, _, A, _ = self.dims
        cos, sin = rope_cos_sin(positions_BT, rope_inv_freq(self.cfg), self.cfg.rope_scaling.cos_sin_scale)
        kv = self.kv_a_proj_with_mqa(x_BTD)
        c_BTA = self.kv_a_layernorm(kv[..., :A])
        kpe_BTR = apply_rope(kv[..., A:], cos, sin)
        return jnp.concatenate([c_BTA, kpe_BTR], axis=-1)

    def _kv_b(self):
        N, H, _, A, U = self.dims
        w = self.kv_b_proj.weight[...].reshape(N, H + U, A)
        return w[:, :H, :], w[:, H:, :]                     # W_UK [N, H, A], W_UV [N, U, A]

    # -- attention --------------------------------------------------------------------------------
    def __call__(self, x_BTD, positions_BT, kv_BSC=None, *, absorbed: bool = False, block_table_BP=None,
                 fresh: bool = False, layer=None, plan=None):
        """Attend from x's tokens (at absolute positions) to the cached tokens.

        kv_BSC: the layer's latent cache [B, S, A + R] or None. With a cache, the new tokens' latents
        are written at their positions (writes at positions >= S are dropped) and every query attends
        to cache slots s <= its position. Without one, queries attend to the new tokens only (a fresh
        prefill). Returns (output [B, T, D], updated cache, or the new latents [B, T, A + R]).

        Paged: with block_table_BP [B, pages per sequence], kv_BSC is the whole paged pool of the layer
        stack [L, num_pages, page_size, A + R], `layer` this layer's index into it, and block_table_BP
        holds page ids into one layer's pages; position p of sequence b lives in page
        block_table[b, p // page_size] at offset p % page_size. (Or, layer None: a flat pool
        [X pages, page_size, A + R] with ids into it.) Under data parallelism the pool's page axis is
        split over the batch's mesh axes like the rows (`ops.page_split`) and the ids are local to the
        row's shard: every read and write of the pool then runs per shard. Queries attend to the
        cached positions before the row's first new token plus the new tokens themselves (causally),
        and the new latents are returned for one write after all layers (`write_pages`), so the layer
        loop never copies the pool. New tokens of a row must have consecutive positions, padding
        (position < 0) only after them (as the scheduler lays rows out): padding is not written and
        its outputs are garbage to be ignored. The
        absorbed paged form runs as one op (`ops.mla_paged_attention`: a GPU kernel reads the pages
        in place).

        fresh (static, expanded form only): the caller guarantees that no row has tokens before this
        step's: each row's real tokens are at positions 0, 1, ... and its padding (position < 0) comes
        after them. Queries then attend to the new tokens only (the cache is not read; it is still
        written as above) through `ops.mla_prefill_attention` with `causal=True`, which on a GPU runs
        cuDNN flash attention.

        plan: the kimi_jax.ops.ExecPlan the ops run (None: `ExecPlan.for_backend()`).
        """
        N, H, R, A, U = self.dims
        cos, sin = rope_cos_sin(positions_BT, rope_inv_freq(self.cfg), self.cfg.rope_scaling.cos_sin_scale)
        q_nope_BTNH, q_pe_BTNR = self._queries(x_BTD, cos, sin)
        new_BTC = self.latents(x_BTD, positions_BT)
        mask_BTS = chunk_lens = None
        w_uk, w_uv = self._kv_b()
        scale = self.cfg.softmax_scale
        if block_table_BP is not None and absorbed:
            q_lat_BTNA = ops.einsum_f32("btnh,nha->btna", q_nope_BTNH, w_uk).astype(x_BTD.dtype)
            o_lat_BTNA = ops.mla_paged_attention(q_lat_BTNA, q_pe_BTNR, new_BTC, kv_BSC, block_table_BP,
                                                 positions_BT, scale, plan=plan, parallel=self.parallel,
                                                 layer=layer).astype(x_BTD.dtype)
            o_BTNU = ops.einsum_f32("btna,nua->btnu", o_lat_BTNA, w_uv)
            return self.o_proj(o_BTNU.astype(x_BTD.dtype).reshape(*x_BTD.shape[:-1], N * U)), new_BTC
        fresh = fresh and not absorbed
        if block_table_BP is not None:
            out_kv = new_BTC
            if fresh:
                keys_BSC, key_pos_BS = new_BTC, positions_BT
            else:
                keys_BSC, mask_BTS = ops.paged_keys(kv_BSC, block_table_BP, new_BTC, positions_BT, layer=layer,
                                                    parallel=self.parallel)
                # the same layout as lengths: cached tokens before the row's first, then its real new ones
                chunk_lens = (jnp.maximum(positions_BT[:, 0], 0), jnp.sum(positions_BT >= 0, axis=1))
        elif kv_BSC is None:
            keys_BSC, key_pos_BS, out_kv = new_BTC, positions_BT, new_BTC
        else:
            B, S = kv_BSC.shape[:2]
            rows = jnp.arange(B)[:, None]
            kv_BSC = kv_BSC.at[rows, positions_BT].set(new_BTC.astype(kv_BSC.dtype), mode="drop")
            keys_BSC, key_pos_BS, out_kv = kv_BSC, jnp.broadcast_to(jnp.arange(S), (B, S)), kv_BSC
            if fresh:     # the written cache holds nothing a query may see beyond the new tokens
                keys_BSC, key_pos_BS = new_BTC, positions_BT
        if fresh:         # the new tokens, causally, padding keys never seen (as ops.paged_keys' new part)
            mask_BTS = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & (positions_BT[:, None, :] >= 0)
        elif mask_BTS is None:
            mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
        c_BSA, kpe_BSR = keys_BSC[..., :A].astype(x_BTD.dtype), keys_BSC[..., A:].astype(x_BTD.dtype)
        if absorbed:
            rope_BNTS = ops.einsum_f32("btnr,bsr->bnts", q_pe_BTNR, kpe_BSR)
            q_lat_BTNA = ops.einsum_f32("btnh,nha->btna", q_nope_BTNH, w_uk).astype(x_BTD.dtype)
            nope_BNTS = ops.einsum_f32("btna,bsa->bnts", q_lat_BTNA, c_BSA)
            p_BNTS = _softmax((nope_BNTS + rope_BNTS) * scale, mask_BTS).astype(x_BTD.dtype)
            o_lat_BTNA = ops.einsum_f32("bnts,bsa->btna", p_BNTS, c_BSA).astype(x_BTD.dtype)
            o_BTNU = ops.einsum_f32("btna,nua->btnu", o_lat_BTNA, w_uv)
        else:
            k_BSNH = ops.einsum_f32("bsa,nha->bsnh", c_BSA, w_uk).astype(x_BTD.dtype)
            v_BSNU = ops.einsum_f32("bsa,nua->bsnu", c_BSA, w_uv).astype(x_BTD.dtype)
            o_BTNU = ops.mla_prefill_attention(q_nope_BTNH, q_pe_BTNR, k_BSNH, kpe_BSR, v_BSNU, mask_BTS, scale,
                                               causal=fresh, plan=plan, parallel=self.parallel,
                                               chunk_lens=chunk_lens)
        o_BTD = self.o_proj(o_BTNU.astype(x_BTD.dtype).reshape(*x_BTD.shape[:-1], N * U))
        return o_BTD, out_kv


def write_pages(pool_LXpC, block_table_BP, positions_BT, new_LBTC, parallel=None):
    """Write every layer's new latents into their slots (tokens at position < 0 are padding).
    parallel: a page-split pool (`ops.page_split`, ids local to each row's shard) is written per shard:
    each data-parallel rank writes its own rows into its own pages."""

    def write(pool_LXpC, block_table_BP, positions_BT, new_LBTC):
        n_layers, n_pages, page, C = pool_LXpC.shape
        valid = positions_BT >= 0
        pos = jnp.where(valid, positions_BT, 0)
        page_of = jnp.take_along_axis(block_table_BP, pos // page, axis=1)
        slot = jnp.where(valid, page_of * page + pos % page, n_pages * page).reshape(-1)   # padding: dropped
        flat = pool_LXpC.reshape(n_layers, n_pages * page, C).at[:, slot].set(
            new_LBTC.reshape(n_layers, -1, C).astype(pool_LXpC.dtype), mode="drop")
        return flat.reshape(pool_LXpC.shape)

    write = ops.per_page_shard(write, parallel, ((None, "split", None, None), ("split", None), ("split", None),
                                                  (None, "split", None, None)), (None, "split", None, None))
    return write(pool_LXpC, block_table_BP, positions_BT, new_LBTC)


def _softmax(scores_BNTS, mask_BTS):
    s = jnp.where(mask_BTS[:, None], scores_BNTS, _NEG)
    return jax.nn.softmax(s, axis=-1)
