"""The DeepSeek-V3 / Kimi-K2 decoder: embeddings, dense layers, MoE layers, final norm, LM head.

Layers of one kind (dense FFN, MoE) are stacked along a leading axis and run with `lax.scan` (one
compiled layer body per kind instead of 61) or unrolled (one call per layer of one jitted body per
kind), as the ExecPlan's `layer_loop` says. The latent cache is stacked the same way: one array
[L, B, S, A + R] per kind. Every call takes `plan` (a kimi_jax.ops.ExecPlan; None:
`ExecPlan.for_backend()`) and hands it to the ops.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.model import layer_weights
from kimi_jax.model.layers import MLP, RMSNorm, param
from kimi_jax.model.mla import MLA, write_pages, write_slots
from kimi_jax.model.moe import MoE


class DecoderLayer(nnx.Module):
    """h = x + MLA(norm(x));  out = h + FFN(norm(h)), FFN dense or MoE."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, dtype, rngs: nnx.Rngs, parallel=None):
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, parallel=parallel
        )
        self.self_attn = MLA(cfg, dtype=dtype, rngs=rngs, parallel=parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                                                parallel=parallel)
        self.mlp = (MoE(cfg, dtype=dtype, rngs=rngs, parallel=parallel) if moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))

    def __call__(
        self,
        x_BTD,
        positions_BT,
        cache=None,
        *,
        absorbed=False,
        block_table_BP=None,
        layer=None,
        fresh=False,
        plan=None,
        rows=None,
        max_pages=None,
    ):
        """layer: this layer's index in its stack when the routed experts' weights are the whole
        stack [L, E, ...] (scan_layers); None when they are this layer's own [E, ...]. fresh: see
        MLA. cache: as MLA's. plan: the ExecPlan the ops run. rows (an ops.RaggedRows): a ragged
        step over the paged pool `cache` (`MLA.ragged`, max_pages static)."""
        normed_BTD = self.input_layernorm(x_BTD, plan=plan)
        if rows is not None:
            a_BTD, kv = self.self_attn.ragged(normed_BTD, positions_BT, cache, rows, layer,
                                              max_pages=max_pages, plan=plan)
            return self._ffn(x_BTD, a_BTD, layer, plan, valid_BT=positions_BT >= 0), kv
        a_BTD, kv = self.self_attn(
            normed_BTD,
            positions_BT,
            cache,
            absorbed=absorbed,
            block_table_BP=block_table_BP,
            fresh=fresh,
            layer=layer if block_table_BP is not None else None,
            plan=plan,
        )
        return self._ffn(x_BTD, a_BTD, layer, plan), kv

    def _ffn(self, x_BTD, a_BTD, layer, plan, valid_BT=None):
        """The layer's output: the residual after attention plus the FFN of its norm (valid_BT: a
        ragged step's real tokens, the only ones routed to experts)."""
        h_BTD, ffn_in = self.post_attention_layernorm(x_BTD, a_BTD, plan=plan)
        ffn = (
            self.mlp(ffn_in, layer=layer, plan=plan, valid_BT=valid_BT)
            if isinstance(self.mlp, MoE)
            else self.mlp(ffn_in, plan=plan)
        )
        return h_BTD + ffn


def stack_modules(make: Callable[[], nnx.Module], n: int) -> Optional[nnx.Module]:
    """n modules built by `make`, merged into one whose parameters have a leading [n] axis."""
    if n == 0:
        return None
    mods = [make() for _ in range(n)]
    graphdef, _ = nnx.split(mods[0])
    states = [nnx.split(m)[1] for m in mods]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _layer_body(
    graphdef,
    experts,
    layer_state,
    x_BTD,
    positions_BT,
    kv,
    block_table_BP,
    layer,
    *,
    absorbed,
    fresh,
    plan,
    **ragged,
):
    module = nnx.merge(graphdef, experts, layer_weights.unpacked(layer_state))
    return module(
        x_BTD,
        positions_BT,
        kv,
        absorbed=absorbed,
        block_table_BP=block_table_BP,
        layer=layer,
        fresh=fresh,
        plan=plan,
        **ragged,
    )


_layer_call = jax.jit(_layer_body, static_argnums=0,
                      static_argnames=("absorbed", "fresh", "plan", "max_pages"))


def scan_layers(
    stack: nnx.Module,
    x_BTD,
    positions_BT,
    cache_L,
    *,
    absorbed: bool,
    block_table_BP=None,
    fresh: bool = False,
    plan: Optional[ops.ExecPlan] = None,
    rows: Optional[ops.RaggedRows] = None,
    slots_BT=None,
    max_pages: Optional[int] = None,
):
    """Run a stacked layer module over its leading axis; returns (x, per-layer cache or latents).
    cache_L: the stack's contiguous cache [L, B, S, C], its paged pool [L, X, p, C] (block_table_BP
    given, or a ragged step's rows: `MLA.ragged`, the new latents written at slots_BT by
    `write_slots`, max_pages static) or None.

    The routed experts' weights (9.5 GB per Kimi layer) and a paged pool enter the loop whole, never
    as per-layer slices, and each layer indexes them with its layer number (the MoE kernels take
    expert ids offset by layer * E; the paged attention flattens the pool [L, num_pages, ...] and
    offsets page ids by layer * num_pages, per shard with the shard's num_pages when the pool's
    pages are split over data parallelism, see ops.page_split). A paged pool (block_table_BP given)
    is only read inside the loop; the new latents of every layer come out of it and are written into
    the pool once afterwards (no copy of the pool per step).
    The other per-layer weights are sliced per layer: by lax.scan, or, unrolled (layer_loop
    'unroll'), statically outside `_layer_call`, which takes each layer's own arrays (read in place
    on a GPU: BENCHMARKS.md "ModelSteps decode step") and its index as a traced int32, so one body
    per kind is traced and lowered and every layer calls it (XLA inlines the calls).
    fresh (static): no row has tokens before this step's (see MLA): prefill attends to the new
    tokens only, on a GPU through cuDNN flash attention (ops.mla_prefill_attention).
    plan: the kimi_jax.ops.ExecPlan (None: `ExecPlan.for_backend()`): the layer loop and every op's
    path."""
    plan = ops.default_plan(plan)
    graphdef, experts, rest = nnx.split(stack, nnx.PathContains("experts"), ...)
    n_layers = layer_weights.num_layers(rest)
    paged = block_table_BP is not None or rows is not None
    ragged = {} if rows is None else dict(rows=rows, max_pages=max_pages)

    def layer_fn(call, x, layer, layer_state, kv):
        # a paged step passes the whole stacked pool; attention reads its layer's (ops._layer_pages)
        return call(
            graphdef,
            experts,
            layer_state,
            x,
            positions_BT,
            cache_L if paged else kv,
            block_table_BP,
            layer,
            absorbed=absorbed,
            fresh=fresh,
            plan=plan,
            **ragged,
        )

    if plan.layer_loop == "unroll":
        outs = []
        for i in range(n_layers):
            kv = None if paged or cache_L is None else cache_L[i]
            x_BTD, out = layer_fn(_layer_call, x_BTD, np.int32(i), layer_weights.layer(rest, i), kv)
            outs.append(out)
        out_L = jnp.stack(outs)
    else:
        layers = jnp.arange(n_layers, dtype=jnp.int32)
        per_layer_kv = None if paged else cache_L
        x_BTD, out_L = jax.lax.scan(lambda x, xs: layer_fn(_layer_body, x, *xs), x_BTD,
                                    (layers, layer_weights.stacked(rest), per_layer_kv))
    if rows is not None:
        return x_BTD, write_slots(cache_L, slots_BT, out_L, parallel=stack.self_attn.parallel)
    if paged:
        return x_BTD, write_pages(
            cache_L, block_table_BP, positions_BT, out_L, parallel=stack.self_attn.parallel
        )
    return x_BTD, out_L


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, parallel=None):
        """parallel: a kimi_jax.parallel.sharding.MoEParallel for sharded experts (else None)."""
        self.cfg = cfg
        self.dtype = dtype
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nnx.Module()
        self.embed_tokens.weight = param(rngs, (V, D), dtype, ("vocab", "embed"))
        self.dense_layers = stack_modules(
            lambda: DecoderLayer(cfg, moe=False, dtype=dtype, rngs=rngs, parallel=parallel),
            cfg.num_dense_layers,
        )
        self.moe_layers = stack_modules(lambda: DecoderLayer(cfg, moe=True, dtype=dtype, rngs=rngs,
                                                             parallel=parallel),
                                        cfg.num_moe_layers)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, parallel=parallel)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Module()
            self.lm_head.weight = param(rngs, (V, D), dtype, ("vocab", "embed"))

    @property
    def layer_stacks(self) -> tuple[tuple[str, Optional[nnx.Module]], ...]:
        return (("dense", self.dense_layers), ("moe", self.moe_layers))

    def hidden_states(
        self,
        tokens_BT,
        positions_BT,
        cache=None,
        *,
        absorbed=False,
        block_table_BP=None,
        fresh=False,
        plan: Optional[ops.ExecPlan] = None,
    ):
        """Final-norm hidden states [B, T, D] and the cache dict {kind: [L, B, S, A+R]} (updated),
        or, without a cache, the new latents {kind: [L, B, T, A+R]}. With block_table_BP the cache
        is paged: {kind: [L, num_pages, page_size, A+R]} (see MLA). fresh (static): every row's
        tokens start at position 0, padding after them (see MLA). plan: the ExecPlan (None:
        `ExecPlan.for_backend()`)."""
        plan = ops.default_plan(plan)
        x = jnp.take(self.embed_tokens.weight[...], tokens_BT, axis=0)
        new = {}
        for kind, stack in self.layer_stacks:
            if stack is None:
                continue
            kv = None if cache is None else cache[kind]
            x, new[kind] = scan_layers(stack, x, positions_BT, kv, absorbed=absorbed,
                                       block_table_BP=block_table_BP, fresh=fresh, plan=plan)
        return self.norm(x, plan=plan), new

    def ragged_hidden_states(self, tokens_BT, positions_BT, pages, rows: ops.RaggedRows, slots_BT,
                             *, max_pages: int, plan: Optional[ops.ExecPlan] = None):
        """A ragged step: final-norm hidden states [B, T, D] and the paged pool {kind: [L, X, p, C]}
        with every layer's new latents written at slots_BT. B: one batch row per data-parallel rank,
        its T tokens any mix of rows (`rows`, ops.RaggedRows, indices local to the rank's block);
        positions_BT < 0: padding. Every layer runs absorbed MLA (`MLA.ragged`); max_pages (static):
        the most pages a row holds."""
        plan = ops.default_plan(plan)
        x = jnp.take(self.embed_tokens.weight[...], tokens_BT, axis=0)
        out = {}
        for kind, stack in self.layer_stacks:
            if stack is None:
                continue
            x, out[kind] = scan_layers(stack, x, positions_BT, pages[kind], absorbed=True,
                                       plan=plan, rows=rows, slots_BT=slots_BT,
                                       max_pages=max_pages)
        return self.norm(x, plan=plan), out

    def logits(self, h_BTD, plan: Optional[ops.ExecPlan] = None):
        w = (self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head).weight[...]
        if ops.default_plan(plan).batch_invariant:   # its rows a few at a time (ops.row_tiles)
            logits_RV = ops.row_tiles(lambda h: self._logits(h, w), h_BTD.reshape(-1, w.shape[1]),
                                      ops.default_plan(plan).row_tile)
            return logits_RV.reshape(*h_BTD.shape[:-1], -1)
        return self._logits(h_BTD, w)

    @staticmethod
    def _logits(h_D, w_VD):
        return jnp.einsum("...d,vd->...v", h_D, w_VD, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, positions_BT, cache=None, *, absorbed=False, fresh=False,
                 plan: Optional[ops.ExecPlan] = None):
        h, new = self.hidden_states(
            tokens_BT, positions_BT, cache, absorbed=absorbed, fresh=fresh, plan=plan
        )
        return self.logits(h, plan), new


def abstract_model(
    cfg: ModelConfig, dtype=jnp.bfloat16, parallel=None, seed: int = 0
) -> Transformer:
    """The Transformer with every parameter a ShapeDtypeStruct (shapes only, nothing allocated)."""
    return nnx.eval_shape(
        lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), parallel=parallel)
    )


def param_arrays(model_or_state) -> dict[tuple[str, ...], jax.Array]:
    """{parameter path: value} of a Transformer (or its nnx.State); paths: checkpoints.layout's."""
    state = (
        nnx.split(model_or_state)[1] if isinstance(model_or_state, nnx.Module) else model_or_state
    )
    return {tuple(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(state)}


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> dict:
    """Zeroed paged latent cache {kind: [L, num_pages, page_size, A + R]}."""
    return {kind: jnp.zeros((n, num_pages, page_size, cfg.latent_dim), dtype)
            for kind, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)) if n}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """Zeroed latent cache {kind: [L, B, S, A + R]} for the stacks the model has."""
    out = {}
    for kind, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
        if n:
            out[kind] = jnp.zeros((n, batch, max_len, cfg.latent_dim), dtype)
    return out
