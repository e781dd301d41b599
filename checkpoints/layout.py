"""The canonical tensor list of a DeepSeek-V3 / Kimi-K2.x checkpoint, and K2.5 name mapping.

Canonical names are the DeepseekV3ForCausalLM / Kimi-K2 names without any prefix
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_a_proj.weight`, ..., `lm_head.weight`).
Kimi-K2.5 stores the text model under `language_model.` (`language_model.model.X`,
`language_model.lm_head.weight`) next to a vision tower and projector that kimi_jax does not use.

Shapes use HF Linear layout [out, in]. Symbols (the shape letters of docs/ARCHITECTURE.md): V vocab,
D hidden, N heads, H qk_nope_head_dim, R qk_rope_head_dim, U v_head_dim, Q q_lora_rank, A kv_lora_rank,
F FFN width (intermediate_size dense, moe_intermediate_size per expert), E routed experts, g INT4 group size.
"""
from __future__ import annotations

import itertools
import re
from typing import Any, Iterator, Optional, Protocol

TensorSpec = tuple[tuple[int, ...], str]      # (shape, dtype name: 'bfloat16' | 'float32' | 'int32')

LAYOUTS = ("k2", "k25")
K25_PREFIX = "language_model."
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
# weight_shape: compressed-tensors writes torch.tensor(shape) (int64); the K2.5 dump shows int32.
_ALT_DTYPES = {"weight_shape": ("int32", "int64")}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SKIP_PREFIXES = (("vision_tower.", "vision tower"), ("mm_projector.", "multimodal projector"),
                  ("multi_modal_projector.", "multimodal projector"))

__all__ = ["expected_tensors", "canonical_name", "skip_reason", "layout_name", "accepted_dtypes",
           "layer_of", "stack_depth", "hf_name", "hf_names_for", "ModelShape", "LAYOUTS", "TensorSpec",
           "STACKS"]


class ModelShape(Protocol):
    """What the file formats read of a model config (kimi_jax.config.ModelConfig has all of it)."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    tie_word_embeddings: bool
    quantization: Any            # None, or an object with `group_size` (INT4 routed experts)

    @property
    def num_dense_layers(self) -> int: ...

    def to_hf_dict(self) -> dict: ...


# ---- engine parameter paths <-> canonical names ------------------------------------------------------
# The engine's parameter paths mirror the canonical names, with the layers of one kind stacked:
#   model.layers.{i}.REST              -> dense_layers.REST[j]  (i < num_dense_layers, j = i)
#                                         moe_layers.REST[j]    (j = i - num_dense_layers)
#   ...mlp.experts.{e}.P.weight        -> moe_layers.mlp.experts.P[j, e]
#   ...mlp.experts.{e}.P.weight_packed -> moe_layers.mlp.experts.P_packed[j, e]   (int32, as stored)
#   ...mlp.experts.{e}.P.weight_scale  -> moe_layers.mlp.experts.P_scale[j, e]
#   model.embed_tokens / model.norm    -> embed_tokens / norm;  lm_head -> lm_head
STACKS = {"dense_layers": 0, "moe_layers": 1}


def stack_depth(path: tuple[str, ...]) -> int:
    """Leading stacked dims of a parameter: 0 (embeddings, norm, head), 1 (layers), 2 (layers, experts)."""
    if path[0] not in STACKS:
        return 0
    return 2 if path[1:3] == ("mlp", "experts") else 1


def hf_name(path: tuple[str, ...], num_dense_layers: int, idx: tuple[int, ...] = ()) -> str:
    """Canonical tensor name of element `idx` (layer, or (layer, expert)) of a parameter's stack."""
    head = path[0]
    if head not in STACKS:
        return ".".join(("model",) + path if head in ("embed_tokens", "norm") else path)
    first = 0 if head == "dense_layers" else num_dense_layers
    rest = path[1:]
    if rest[:2] == ("mlp", "experts"):
        proj, suffix = rest[2], "weight"
        for s in ("_packed", "_scale"):
            if proj.endswith(s):
                proj, suffix = proj[: -len(s)], "weight" + s
        j, e = idx
        return f"model.layers.{first + j}.mlp.experts.{e}.{proj}.{suffix}"
    (j,) = idx
    return f"model.layers.{first + j}." + ".".join(rest)


def hf_names_for(path: tuple[str, ...], num_dense_layers: int,
                 shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
    """(index into the parameter, canonical tensor name) for every element of one parameter's stack."""
    depth = stack_depth(path)
    for idx in itertools.product(*(range(n) for n in shape[:depth])):
        yield idx, hf_name(path, num_dense_layers, idx)


def _proj(d: dict, prefix: str, out: int, inp: int) -> None:
    d[f"{prefix}.weight"] = ((out, inp), "bfloat16")


def _quant_proj(d: dict, prefix: str, out: int, inp: int, group_size: int) -> None:
    if inp % 8 or inp % group_size:
        raise ValueError(f"{prefix}: input dim {inp} is not a multiple of 8 and of the INT4 "
                         f"group_size {group_size}")
    d[f"{prefix}.weight_packed"] = ((out, inp // 8), "int32")
    d[f"{prefix}.weight_scale"] = ((out, inp // group_size), "bfloat16")
    d[f"{prefix}.weight_shape"] = ((2,), "int32")


def _attention(d: dict, p: str, cfg: ModelShape) -> None:
    D, N = cfg.hidden_size, cfg.num_attention_heads
    H, R, U, A = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        _proj(d, f"{p}.q_proj", N * (H + R), D)
    else:
        Q = cfg.q_lora_rank
        _proj(d, f"{p}.q_a_proj", Q, D)
        d[f"{p}.q_a_layernorm.weight"] = ((Q,), "bfloat16")
        _proj(d, f"{p}.q_b_proj", N * (H + R), Q)
    _proj(d, f"{p}.kv_a_proj_with_mqa", A + R, D)
    d[f"{p}.kv_a_layernorm.weight"] = ((A,), "bfloat16")
    _proj(d, f"{p}.kv_b_proj", N * (H + U), A)
    _proj(d, f"{p}.o_proj", D, N * U)


def _mlp(d: dict, p: str, D: int, width: int) -> None:
    _proj(d, f"{p}.gate_proj", width, D)
    _proj(d, f"{p}.up_proj", width, D)
    _proj(d, f"{p}.down_proj", D, width)


def _moe(d: dict, p: str, cfg: ModelShape) -> None:
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    d[f"{p}.gate.weight"] = ((E, D), "bfloat16")
    d[f"{p}.gate.e_score_correction_bias"] = ((E,), "float32")
    if cfg.n_shared_experts:
        _mlp(d, f"{p}.shared_experts", D, F * cfg.n_shared_experts)
    q = cfg.quantization
    for e in range(E):
        for name, out, inp in (("gate_proj", F, D), ("up_proj", F, D), ("down_proj", D, F)):
            if q is None:
                _proj(d, f"{p}.experts.{e}.{name}", out, inp)
            else:
                _quant_proj(d, f"{p}.experts.{e}.{name}", out, inp, q.group_size)


def expected_tensors(cfg: ModelShape) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for `cfg` must hold: canonical name -> (shape, dtype name).

    Ordered: embeddings, layers 0..L-1 (norms, attention, MLP), final norm, lm_head. Routed
    experts are bf16 `.weight` [out, in], or with cfg.quantization INT4 `.weight_packed` int32
    [out, in/8], `.weight_scale` bf16 [out, in/g], `.weight_shape` int32 [2].
    """
    D, V = cfg.hidden_size, cfg.vocab_size
    d: dict[str, TensorSpec] = {"model.embed_tokens.weight": ((V, D), "bfloat16")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        d[f"{p}.input_layernorm.weight"] = ((D,), "bfloat16")
        _attention(d, f"{p}.self_attn", cfg)
        d[f"{p}.post_attention_layernorm.weight"] = ((D,), "bfloat16")
        if i < cfg.first_k_dense_replace:
            _mlp(d, f"{p}.mlp", D, cfg.intermediate_size)
        else:
            _moe(d, f"{p}.mlp", cfg)
    d["model.norm.weight"] = ((D,), "bfloat16")
    if not cfg.tie_word_embeddings:
        d["lm_head.weight"] = ((V, D), "bfloat16")
    return d


def layer_of(name: str) -> Optional[int]:
    """Decoder layer index of a canonical name (`model.layers.{i}.`), else None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _strip_prefix(name: str) -> str:
    if name.startswith(K25_PREFIX):
        return name[len(K25_PREFIX):]
    return name


def skip_reason(name: str, num_hidden_layers: Optional[int] = None) -> Optional[str]:
    """Why a stored tensor is not used by design ('vision tower', 'MTP layer', ...), or None.

    num_hidden_layers: layers at or beyond it (`model.layers.{L+k}.`) are MTP layers; pass None
    to not classify them.
    """
    for prefix, why in _SKIP_PREFIXES:
        if name.startswith(prefix):
            return why
    base = _strip_prefix(name)
    if base.endswith("rotary_emb.inv_freq"):
        return "rotary_emb.inv_freq"
    if num_hidden_layers is not None:
        layer = layer_of(base)
        if layer is not None and layer >= num_hidden_layers:
            return "MTP layer"
    return None


def canonical_name(name: str, num_hidden_layers: Optional[int] = None) -> Optional[str]:
    """Stored name (K2 or K2.5 layout) -> canonical name, or None if skipped by design.

    `language_model.model.X` -> `model.X`, `language_model.lm_head.weight` -> `lm_head.weight`;
    K2 names map to themselves. Skipped: `vision_tower.*`, `mm_projector.*`,
    `multi_modal_projector.*`, `*rotary_emb.inv_freq` and, when num_hidden_layers is given, MTP
    layers `model.layers.{num_hidden_layers + k}.*`.
    """
    if skip_reason(name, num_hidden_layers) is not None:
        return None
    return _strip_prefix(name)


def layout_name(name: str, layout: str) -> str:
    """Canonical name -> the name stored in a `layout` ('k2' or 'k25') checkpoint."""
    if layout == "k2":
        return name
    if layout == "k25":
        return K25_PREFIX + name
    raise ValueError(f"unknown checkpoint layout {layout!r} (known: {LAYOUTS})")


def accepted_dtypes(name: str, dtype: str) -> tuple[str, ...]:
    """The stored dtypes accepted for a tensor whose expected dtype is `dtype`."""
    return _ALT_DTYPES.get(name.rpartition(".")[2], (dtype,)) if dtype == "int32" else (dtype,)
