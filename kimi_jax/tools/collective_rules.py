"""The collectives of one decode step under a layout: kimi_jax's (compiled on GPU or CPU) and vLLM's
tensor-parallel step, each with why it is there (docs/PLANNER.md "Collectives of one decode
step")."""
from __future__ import annotations

import dataclasses

from kimi_jax.config import ModelConfig
from kimi_jax.parallel.sharding import Layout
from kimi_jax.tools.footprint import _cdiv


@dataclasses.dataclass
class CollectiveSpec:
    kind: str
    count: int               # per decode step
    bytes: float             # buffer of one op (all-gather: the gathered result)
    group: int               # devices per group
    why: str
    artifact: bool = False   # emitted by the current engine beyond the layout's design
    seconds_each: float = 0.0

    @property
    def seconds(self) -> float:
        return self.count * self.seconds_each


PROGRAMS = ("gpu", "cpu")
ENGINES = ("kimi_jax", "vllm")

# GPU_MOE_REDUCE_SPLIT: docs/PLANNER.md "The MoE all-reduce on GPU"
GPU_MOE_REDUCE_SPLIT = False


def collective_plan(cfg: ModelConfig, layout: Layout, batch: int, *, program: str = "gpu",
                    engine_artifacts: bool = True, dtype_bytes: int = 2,
                    engine: str = "kimi_jax") -> list[CollectiveSpec]:
    """The collectives of one decode step of `batch` (padded) rows under `layout`.

    program: which compiled form of kimi_jax's step to model, 'gpu' (XLA:GPU, the target) or 'cpu'
    (XLA:CPU, what the tests compile); they differ in how XLA combines and places collectives, and
    XLA:CPU promotes every bf16 collective to f32 (bytes on the wire).
    engine_artifacts: include collectives the current engine emits beyond the layout's design (each
    flagged); False plans the design.
    engine: 'kimi_jax' (this engine, the default) or 'vllm' (vLLM's tensor-parallel decode step of a
    DeepSeek-V3 / Kimi-K2.5 model, each collective with its source: `vllm_collective_plan`)."""
    if engine == "vllm":
        return vllm_collective_plan(cfg, layout, batch, dtype_bytes=dtype_bytes)
    if engine != "kimi_jax":
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES}")
    if program not in PROGRAMS:
        raise ValueError(f"program={program!r}: expected one of {PROGRAMS}")
    tp, dp, ep = (
        layout.tensor_parallel_size,
        layout.data_parallel_size,
        layout.enable_expert_parallel,
    )
    D, V, E, K = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    L, Ld, Lm = cfg.num_hidden_layers, cfg.num_dense_layers, cfg.num_moe_layers
    Bl = _cdiv(batch, dp)
    gpu = program == "gpu"
    f32 = 4
    w = dtype_bytes if gpu else max(dtype_bytes, f32)   # XLA:CPU sends bf16 collectives as f32
    lat = cfg.latent_dim
    art = engine_artifacts
    out: list[CollectiveSpec] = []

    def add(kind, count, nbytes, group, why, artifact=False):
        if count and group > 1 and (art or not artifact):
            out.append(
                CollectiveSpec(
                    kind,
                    count,
                    nbytes,
                    group,
                    why + (" [engine artifact]" if artifact else ""),
                    artifact,
                )
            )

    if tp > 1:
        add("all-reduce", 1, Bl * D * w, tp, "embedding lookup on the vocab-split table")
        add("all-reduce", L, Bl * D * w, tp, "attention output: o_proj partial sums")
        add("all-reduce", Ld, Bl * D * w, tp, "dense FFN output: down_proj partial sums")
        if cfg.n_shared_experts and gpu and art and GPU_MOE_REDUCE_SPLIT:
            add("all-reduce", Lm, Bl * D * w, tp, "MoE: shared-expert partial sums")
            add(
                "all-reduce",
                Lm,
                Bl * D * w,
                tp,
                "MoE: routed-expert psum, not combined with the shared-expert "
                "all-reduce (H200 compile of the f32-partial-sum engine)",
                artifact=True,
            )
        elif cfg.n_shared_experts:
            add(
                "all-reduce",
                Lm,
                2 * Bl * D * w,
                tp,
                "MoE output: shared-expert partial sums + routed psum, " "one combined op",
            )
        else:
            add("all-reduce", Lm, Bl * D * w, tp, "MoE output: routed psum")
        add(
            "all-gather",
            1,
            Bl * V * f32,
            tp,
            "logits: the vocab-split f32 logits gathered once, sampled "
            "replicated" + ("" if not gpu else " (GPU: inferred from the CPU " "compile)"),
        )
    if dp > 1:
        add(
            "all-gather",
            1,
            batch * V * f32,
            dp,
            "logits: the batch-split rows gathered, sampled replicated"
            + ("" if not gpu else " (GPU: inferred from the CPU compile)"),
        )
        if ep:
            if gpu:
                add(
                    "all-gather",
                    Lm,
                    batch * (D * w + 2 * K * 4),
                    dp,
                    "EP dispatch: tokens, expert ids and " "weights of the dp group, one op",
                )
            else:
                add(
                    "all-gather",
                    3 * Lm,
                    batch * D * w,
                    dp,
                    "EP dispatch: tokens, expert ids, weights "
                    "(3 ops per MoE layer; bytes: the tokens)",
                )
            add(
                "reduce-scatter",
                Lm,
                batch * D * w,
                dp,
                "EP combine: expert outputs back to their rows",
            )
        if not gpu:
            n_ag = 2 if 1 < tp < dp else 1
            add("all-gather", n_ag * L + 2 * n_ag, batch * lat * w, dp,
                "cache write: scatter with an unsharded row index gathers the new latents "
                "(per layer, 2 hoisted)", artifact=True)
            if tp > 1:
                add("collective-permute", L + 2, Bl * lat * w, 2,
                    "cache write: scatter resharding across (dp, tp)", artifact=True)
            add("all-gather", Lm, batch * E * f32, dp,
                "router top-k on batch-split scores gathers them (per MoE layer)", artifact=True)
    return out


# vLLM's decode step of a DeepSeek-V3 / Kimi-K2.5 model under tensor parallelism (V1 engine, CUDA),
# as its source reads (github.com/vllm-project/vllm; Kimi-K2.5 is KimiK25ForConditionalGeneration in
# vllm/model_executor/models/kimi_k25.py: a DeepseekV2Model + ParallelLMHead + LogitsProcessor).
VLLM_TP_SOURCES = {
    "embedding": "vllm/model_executor/layers/vocab_parallel_embedding.py, "
    "VocabParallelEmbedding.forward: masked lookup, then `output = "
    "tensor_model_parallel_all_reduce(output_parallel)` (DeepseekV2Model.embed_tokens)",
    "o_proj": "vllm/model_executor/models/deepseek_v2.py, DeepseekV2MLAAttention: `self.o_proj = "
    "RowParallelLinear(..., reduce_results=reduce_results)` with reduce_results=True outside "
    "sequence-parallel MoE; RowParallelLinear.forward all-reduces when reduce_results and tp > 1 "
    "(vllm/model_executor/layers/linear.py)",
    "dense_mlp": "deepseek_v2.py, DeepseekV2MLP (the first_k_dense_replace layers): `down_proj = "
    "RowParallelLinear(..., reduce_results=True)`",
    "moe": "deepseek_v2.py, DeepseekV2MoE: the shared experts are built with reduce_results=False "
    "and passed into the fused-MoE layer, which all-reduces shared + routed once "
    "(vllm/model_executor/layers/fused_moe/layer.py, must_reduce_shared_expert_outputs: 'When just "
    "tensor-parallel is used ... we reduce at the once at the end of the MoE op'; "
    "maybe_all_reduce_tensor_model_parallel -> tensor_model_parallel_all_reduce)",
    "logits": "vllm/model_executor/layers/logits_processor.py, LogitsProcessor._gather_logits: "
    "`tensor_model_parallel_all_gather(logits)` when current_platform.use_all_gather() "
    "(vllm/platforms/interface.py: True under the V1 engine), else a gather to rank 0",
    "sampler": "no device collective: each TP rank samples from the gathered logits and keeps its "
    "sampled "
    "token ids (vllm PR #20291, 'the scheduler no longer needs to send new token ids unless PP "
    "is being used'); the scheduler reaches the workers through a shared-memory message queue",
    "checks": "third-party models of the same step: ai-dynamo/aiconfigurator PR #1064 (vLLM "
    "backend, DeepSeek / Kimi-K2.5: TP all-reduce scale = 2 x num_layers); vllm issue #55261 "
    "('shared experts are reduced together with the routed output, as in vLLM')",
}


def vllm_collective_plan(cfg: ModelConfig, layout: Layout, batch: int, *,
                         dtype_bytes: int = 2) -> list[CollectiveSpec]:
    """vLLM's collectives per decode step under TP (dp = 1; expert parallelism inside the TP group
    keeps the same reduce), each justified by VLLM_TP_SOURCES: 1 + L + L_dense + L_moe all-reduces
    of the [B, D] bf16 hidden states and one all-gather of the [B, V/tp] logits."""
    tp, dp = layout.tensor_parallel_size, layout.data_parallel_size
    if dp > 1:
        raise ValueError(
            "engine='vllm' models vLLM's tensor-parallel decode only (data_parallel_size=1)"
        )
    D, V = cfg.hidden_size, cfg.vocab_size
    L, Ld, Lm = cfg.num_hidden_layers, cfg.num_dense_layers, cfg.num_moe_layers
    B, db = batch, dtype_bytes
    src = VLLM_TP_SOURCES
    out = []
    if tp > 1:
        for count, why in (
            (1, "embedding: VocabParallelEmbedding all-reduce [vLLM: " + src["embedding"] + "]"),
            (L, "attention: MLA o_proj RowParallelLinear all-reduce [vLLM: " + src["o_proj"] + "]"),
            (
                Ld,
                "dense MLP: down_proj RowParallelLinear all-reduce [vLLM: "
                + src["dense_mlp"]
                + "]",
            ),
            (Lm, "MoE: one all-reduce of routed + shared experts [vLLM: " + src["moe"] + "]"),
        ):
            if count:
                out.append(CollectiveSpec("all-reduce", count, B * D * db, tp, why))
        out.append(
            CollectiveSpec(
                "all-gather",
                1,
                B * V * db,
                tp,
                "logits: LogitsProcessor all-gather [vLLM: "
                + src["logits"]
                + "]; sampler: "
                + src["sampler"],
            )
        )
    return out


def collective_counts(specs: list[CollectiveSpec]) -> dict[str, int]:
    from kimi_jax.tools.hardware import KINDS
    return {k: sum(s.count for s in specs if s.kind == k) for k in KINDS}
