"""DeepSeek-V3 mixture of experts: sigmoid router with group-limited top-k, routed experts, shared
experts.

Router (noaux_tc), in float32:
  s = sigmoid(x W_g^T);  choose with s + b (b = e_score_correction_bias, used ONLY for choosing):
  keep the topk_group groups whose two best biased scores sum highest, then the top-K experts in
  them; weights = s at the chosen experts, normalized to sum 1 (norm_topk_prob), times
  routed_scaling_factor.
Output = sum_k weight_k * expert_k(x) + shared_experts(x).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax import ops
from kimi_jax.config import ModelConfig
from kimi_jax.model.layers import MLP, param


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, parallel=None):
        self.cfg = cfg
        self.parallel = parallel
        # kept in float32: the scores that pick experts are computed in float32 (as the reference)
        self.weight = param(
            rngs, (cfg.n_routed_experts, cfg.hidden_size), jnp.float32, ("router_experts", "embed")
        )
        self.e_score_correction_bias = param(
            None, (cfg.n_routed_experts,), jnp.float32, ("router_experts",), init="zeros"
        )

    def __call__(self, x_TD, *, plan=None):
        """-> (expert ids [T, K] int32, weights [T, K] float32)."""
        cfg = self.cfg
        return ops.route(
            x_TD,
            self.weight[...],
            self.e_score_correction_bias[...],
            k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor,
            plan=plan,
            parallel=self.parallel,
        )


def pin_routing(state, k: int) -> int:
    """A diagnostic control (fixed routing, to compare runs whose router inputs differ slightly):
    set every router's choice bias in `state` (an nnx.State) to 2 for experts 0..k-1 and 0 for the
    rest. Sigmoid scores (0..1) cannot outweigh it, so every token picks experts 0..k-1 while the
    routing weights still follow the scores. Returns the number of biases set (0: no router)."""
    n = 0
    for path, var in nnx.to_flat_state(state):
        if str(path[-1]) == "e_score_correction_bias":
            old = var.get_value()
            first = jnp.where(jnp.arange(old.shape[-1]) < k, 2.0, 0.0).astype(old.dtype)
            var.set_value(jax.device_put(jnp.broadcast_to(first, old.shape), old.sharding))
            n += 1
    return n


class RoutedExperts(nnx.Module):
    """E expert FFNs stacked: gate/up [E, F, D], down [E, D, F]; bf16, or INT4 + group scales."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, parallel=None):
        # kimi_jax.parallel.sharding.MoEParallel or None (opaque to the model)
        self.parallel = parallel
        E, F, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        q = cfg.quantization
        self.int4 = q is not None
        shapes = {"gate_proj": (E, F, D), "up_proj": (E, F, D), "down_proj": (E, D, F)}
        axes = {
            "gate_proj": ("experts", "expert_mlp", "embed"),
            "up_proj": ("experts", "expert_mlp", "embed"),
            "down_proj": ("experts", "embed", "expert_mlp"),
        }
        for name, (n_exp, out, inp) in shapes.items():
            if self.int4:
                # random INT4 codes (uniform in [-8, 7]) with scale std/4: roughly std-sized weights
                packed = jax.random.randint(
                    rngs.params(),
                    (n_exp, out, inp // 8),
                    jnp.iinfo(jnp.int32).min,
                    jnp.iinfo(jnp.int32).max,
                    dtype=jnp.int32,
                )
                setattr(self, name + "_packed", nnx.Param(packed, axes=axes[name]))
                scale = jnp.full((n_exp, out, inp // q.group_size), 0.005, dtype)
                setattr(self, name + "_scale", nnx.Param(scale, axes=axes[name]))
            else:
                setattr(self, name, param(rngs, (n_exp, out, inp), dtype, axes[name]))

    def weights(self) -> ops.ExpertWeights:
        def w(name):
            if self.int4:
                return ops.Int4Weight(
                    getattr(self, name + "_packed")[...], getattr(self, name + "_scale")[...]
                )
            return getattr(self, name)[...]
        return ops.ExpertWeights(gate=w("gate_proj"), up=w("up_proj"), down=w("down_proj"))

    def __call__(self, x_TD, idx_TK, w_TK, layer=None, *, plan=None):
        """layer: with weights stacked over layers [L, E, ...] (scan_layers), which layer to run.
        plan: the kimi_jax.ops.ExecPlan (None: `ExecPlan.for_backend()`)."""
        return ops.routed_experts(
            x_TD, idx_TK, w_TK, self.weights(), plan=plan, parallel=self.parallel, layer=layer
        )


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, parallel=None):
        self.gate = Router(cfg, rngs=rngs, parallel=parallel)
        self.experts = RoutedExperts(cfg, dtype=dtype, rngs=rngs, parallel=parallel)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.shared_expert_width,
                                   dtype=dtype, rngs=rngs, ffn_axis="shared_mlp")
                               if cfg.n_shared_experts else None)

    def __call__(self, x_BTD, layer=None, *, plan=None, valid_BT=None):
        """valid_BT (a ragged step's positions >= 0): tokens where False select no expert (the
        out-of-range id E, weight 0), so padding costs the routed experts nothing."""
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        idx_TK, w_TK = self.gate(x_TD, plan=plan)
        if valid_BT is not None:
            valid_T1 = valid_BT.reshape(-1, 1)
            idx_TK = jnp.where(valid_T1, idx_TK, self.gate.cfg.n_routed_experts)
            w_TK = jnp.where(valid_T1, w_TK, 0.0)
        y_TD = self.experts(x_TD, idx_TK, w_TK, layer, plan=plan)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD, plan=plan)
        return y_TD.reshape(x_BTD.shape)
