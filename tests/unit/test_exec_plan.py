"""kimi_jax.ops.ExecPlan: a frozen, hashable, validated value built from the backend; its kernel-side
thresholds default to the kernel wrappers' own defaults; and no module of kimi_jax or pallas_kernels
keeps an execution switch in module state (no `global` statement, none of the removed switch names)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import warnings

import pytest

from kimi_jax import ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
REMOVED = {"_FORCED_IMPL", "use_impl", "resolve_impl", "forced", "_PREFILL_ATTENTION", "_CHUNK_ATTENTION",
           "use_prefill_attention", "use_chunk_attention", "_warned_fallback", "_MLA_DECODE_KERNEL", "_MLA_SCHEDULE",
           "use_mla_decode_kernel", "use_mla_schedule", "LAYER_LOOP", "XLA_MAX_MACS", "ONE_NEW_TOKEN_ELEMENTWISE",
           "_is_hopper"}


def test_plan_is_frozen_hashable_and_validated():
    plan = ops.ExecPlan()
    assert plan == ops.ExecPlan() and hash(plan) == hash(ops.ExecPlan())
    other = dataclasses.replace(plan, layer_loop="unroll")
    assert other != plan and len({plan, other}) == 2              # distinct jit cache keys
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.impl = "pallas"
    for field, bad in (("impl", "cuda"), ("mla_decode_kernel", "cutlass"), ("mla_schedule", "fair"),
                       ("prefill_attention", "flash"), ("chunk_attention", "flash"), ("layer_loop", "auto"),
                       ("combine_xla_max_macs", -1), ("one_new_token_elementwise", 1), ("hopper", "yes"), ("mla_fuse_new", 1),
                       ("router_kernel", "triton"), ("norm_kernel", "fused")):
        with pytest.raises(ValueError, match=field):
            ops.ExecPlan(**{field: bad})


def test_for_backend_resolves_from_the_hardware_and_takes_options():
    assert ops.ExecPlan.for_backend() == ops.ExecPlan()          # the tests run on CPU: the portable plan
    gpu = ops.ExecPlan.for_backend("gpu", hopper=True)
    assert (gpu.impl, gpu.layer_loop, gpu.hopper) == ("pallas", "unroll", True)
    assert ops.ExecPlan.for_backend("gpu", hopper=False).hopper is False
    forced = ops.ExecPlan.for_backend("gpu", hopper=True, impl="xla", layer_loop="scan", mla_decode_kernel="triton",
                                      chunk_attention="cudnn")
    assert (forced.impl, forced.layer_loop, forced.mla_decode_kernel, forced.chunk_attention) == (
        "xla", "scan", "triton", "cudnn")
    assert ops.ExecPlan.for_backend("cpu", impl="auto", layer_loop="auto") == ops.ExecPlan()
    assert (gpu.router_kernel, gpu.norm_kernel) == ("auto", "xla")         # the norm kernel: asked for
    # 'auto': the Pallas router for small steps under impl 'pallas' only (ROUTER_AUTO_MAX_TOKEN_EXPERTS)
    assert [gpu.router_kernel_for(t, 384) for t in (1, 2, 8)] == ["pallas", "xla", "xla"]
    assert [gpu.router_kernel_for(t, 16) for t in (1, 32, 33)] == ["pallas", "pallas", "xla"]
    assert ops.ExecPlan().router_kernel_for(1, 16) == "xla"
    assert ops.ExecPlan(impl="pallas", router_kernel="pallas_gemv").router_kernel_for(64, 384) == "pallas_gemv"
    assert ops.ExecPlan.for_backend("gpu", router_kernel="pallas", norm_kernel="pallas").norm_kernel == "pallas"
    with pytest.raises(TypeError, match="layer_loops"):
        ops.ExecPlan.for_backend(layer_loops="scan")


def test_threshold_defaults_equal_the_kernel_wrappers():
    """The plan's two kernel-side thresholds are the wrappers' keyword defaults: a default plan runs
    the kernels exactly as a direct call does."""
    from pallas_kernels.mla import combine as mc
    from pallas_kernels.mla import decode as md
    from pallas_kernels.mla import decode_mgpu as mg
    plan = ops.ExecPlan()

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    assert default(mc.combine, "xla_max_macs") == plan.combine_xla_max_macs
    for fn in (md.mla_paged_attention, mg.mla_paged_attention_mgpu, md.finish_items):
        assert default(fn, "combine_xla_max_macs") == plan.combine_xla_max_macs
    for fn in (md.mla_paged_attention, mg.mla_paged_attention_mgpu, md.finish_items, md.finish, md.finish_xla,
               md._new_token_part):
        assert default(fn, "one_new_token_elementwise") is plan.one_new_token_elementwise is True


def _sources():
    for pkg in ("kimi_jax", "pallas_kernels"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_no_module_keeps_execution_switches():
    """Static check of every module's source: no `global` statement (a function rebinding module
    state), no module-level binding of a removed switch name, and kimi_jax.ops exports none of them."""
    found = []
    for path in _sources():
        with warnings.catch_warnings():           # a docstring's escapes are not this test's concern
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree)
                  if isinstance(n, ast.Global)]
        for node in tree.body:
            targets = []
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    targets += [e.id for e in ast.walk(t) if isinstance(e, ast.Name)]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                targets.append(node.name)
            found += [f"{rel}:{node.lineno}: {name}" for name in targets if name in REMOVED]
    assert found == []
    assert not [name for name in REMOVED if hasattr(ops, name)]
    assert len(list(_sources())) > 40                             # the walk saw the packages


@pytest.mark.parametrize("layout", [(1, 1), (1, 2), (2, 1)], ids=["single", "dp2", "tp2"])
def test_fused_router_and_norm_plans_give_the_xla_plans_logits(layout):
    """A 2-layer float32 model (one dense, one MoE layer; no group limit) under router_kernel 'pallas' /
    'pallas_gemv' and norm_kernel 'pallas' (interpreted on CPU), on one device and per batch shard
    (dp2) or replicated (tp2) in shard_map, against the XLA plan: the same routing and logits within
    1e-5 of the largest (the norms' other summation order, ~2e-7 observed, through two layers)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from kimi_jax.config import preset
    from kimi_jax.model.transformer import Transformer
    from kimi_jax.parallel.sharding import Layout

    cfg = preset("tiny").replace(num_hidden_layers=2, n_group=1, topk_group=1)
    model = Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3), parallel=Layout(*layout).moe_parallel())
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    run = lambda plan: np.asarray(jax.jit(lambda m, t, p: m(t, p, plan=plan)[0])(model, tokens, pos))  # noqa: E731
    ref = run(ops.ExecPlan())
    for router in ("pallas", "pallas_gemv"):
        out = run(ops.ExecPlan(router_kernel=router, norm_kernel="pallas"))
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), router
