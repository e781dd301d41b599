"""Model configuration: one frozen dataclass; `ModelConfig.from_hf_dict` is the only reader of a
Hugging Face config.json (DeepSeek-V3 / Kimi-K2 at the top level, Kimi-K2.5 under text_config, rope
under rope_scaling or rope_parameters)."""
# Over 600 lines: the model configuration, its config.json reader and writer, the presets.
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


class ConfigError(ValueError):
    """A config.json that kimi_jax cannot run faithfully."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (rope_type 'yarn'); factor 1 with type 'default' means plain RoPE."""
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None: absent from the config (changes attention_factor)
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None  # explicit cos/sin scale; None: derived as HF does
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's scale on cos/sin: 1.0 for Kimi (mscale == mscale_all_dim); HF's rule otherwise."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 W4A16 for the routed experts (None: bf16 experts)."""
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 architecture hyperparameters (names as in the HF config)."""
    vocab_size: int
    hidden_size: int                 # D
    intermediate_size: int           # dense-layer FFN width
    moe_intermediate_size: int       # F, per routed/shared expert
    num_hidden_layers: int
    num_attention_heads: int         # N
    n_routed_experts: int            # E
    num_experts_per_tok: int         # K
    n_shared_experts: int
    first_k_dense_replace: int
    kv_lora_rank: int                # A
    q_lora_rank: Optional[int]       # Q (None: q_proj directly from x)
    qk_nope_head_dim: int            # H
    qk_rope_head_dim: int            # R
    v_head_dim: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    # HF and DeepSeek's own code build q_a_layernorm / kv_a_layernorm with the default eps 1e-6, not
    # rms_norm_eps (vLLM/SGLang pass rms_norm_eps). We follow the reference implementation.
    latent_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None
    quantization: Optional[QuantConfig] = None
    model_type: str = "deepseek_v3"
    # preset-only; None: F * n_shared_experts
    shared_expert_intermediate_size: Optional[int] = None

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def shared_expert_width(self) -> int:
        return (
            self.shared_expert_intermediate_size
            or self.moe_intermediate_size * self.n_shared_experts
        )

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer by absorbed MLA: A + R."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF/vLLM/SGLang's)"""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs.rope_type == "yarn" and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def __post_init__(self):
        _check_ranges(self)
        if self.scoring_func != "sigmoid":
            raise ConfigError(
                f"config field scoring_func={self.scoring_func!r}: only 'sigmoid' is supported"
            )
        if self.topk_method not in ("noaux_tc",):
            raise ConfigError(
                f"config field topk_method={self.topk_method!r}: only 'noaux_tc' is supported"
            )
        if self.hidden_act != "silu":
            raise ConfigError(
                f"config field hidden_act={self.hidden_act!r}: only 'silu' is supported"
            )
        if self.attention_bias:
            raise ConfigError(
                "config field attention_bias=true is not supported (DeepSeek-V3 has none)"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"config field n_group={self.n_group} does not divide n_routed_experts"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError("config field qk_rope_head_dim must be even")

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """config.json of checkpoint directory `path`, only parsed (read_checkpoint checks it)."""
        return cls.parse_pretrained(path)[0]

    @classmethod
    def parse_pretrained(cls, path: str) -> tuple["ModelConfig", dict]:
        """from_pretrained's ModelConfig and the config.json dict it was parsed from (one read)."""
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"{cfg_file}: no config.json in the checkpoint directory")
        try:
            with open(cfg_file, "rb") as f:
                raw = json.loads(f.read())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{cfg_file}: JSON nested too deeply to be a config") from None
        try:
            return cls.from_hf_dict(raw), raw
        except ConfigError as e:
            raise ConfigError(f"{cfg_file}: {e}") from None

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
        top = dict(raw)
        if top.get("text_config") is not None and not isinstance(top["text_config"], Mapping):
            raise ConfigError(
                "config field 'text_config' must be an object, got "
                f"{json.dumps(top['text_config'])[:60]}"
            )
        model_type = top.get("model_type")
        text = dict(top["text_config"]) if isinstance(top.get("text_config"), Mapping) else top
        if model_type == "kimi_k25" or "text_config" in top:
            model_type = "kimi_k25"
            if text.get("model_type") not in (None, "kimi_k2", "deepseek_v3"):
                raise ConfigError(
                    f"text_config.model_type={text.get('model_type')!r} is not a DeepSeek-V3 model"
                )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported (expected one of "
                f"{SUPPORTED_MODEL_TYPES})"
            )

        def need(name, kind=None):
            if name not in text:
                raise ConfigError(f"missing config field {name!r}, which changes the model's math")
            return _typed(name, text[name], kind) if kind else text[name]

        def opt(name, default, kind=None):
            v = text.get(name, default)
            v = default if v is None and default is not None else v
            return _typed(name, v, kind) if kind and v is not None else v

        rope_theta, rope = _parse_rope(text)
        quant = _parse_quant(text.get("quantization_config") or top.get("quantization_config"))
        eos = opt("eos_token_id", None)
        if eos is None:
            eos = top.get("eos_token_id")
        eos_t = tuple(
            _typed("eos_token_id", e, int)
            for e in (eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,))
        )
        q_lora = text.get("q_lora_rank", "__missing__")
        if q_lora == "__missing__":
            raise ConfigError(
                "missing config field 'q_lora_rank' (use null for no query compression)"
            )
        tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        return cls(
            vocab_size=need("vocab_size", int),
            hidden_size=need("hidden_size", int),
            intermediate_size=need("intermediate_size", int),
            moe_intermediate_size=need("moe_intermediate_size", int),
            num_hidden_layers=need("num_hidden_layers", int),
            num_attention_heads=need("num_attention_heads", int),
            n_routed_experts=need("n_routed_experts", int),
            num_experts_per_tok=need("num_experts_per_tok", int),
            n_shared_experts=opt("n_shared_experts", 0, int),
            first_k_dense_replace=opt("first_k_dense_replace", 0, int),
            kv_lora_rank=need("kv_lora_rank", int),
            q_lora_rank=None if q_lora is None else _typed("q_lora_rank", q_lora, int),
            qk_nope_head_dim=need("qk_nope_head_dim", int),
            qk_rope_head_dim=need("qk_rope_head_dim", int),
            v_head_dim=need("v_head_dim", int),
            n_group=opt("n_group", 1, int),
            topk_group=opt("topk_group", 1, int),
            norm_topk_prob=need("norm_topk_prob", bool),
            routed_scaling_factor=need("routed_scaling_factor", float),
            scoring_func=opt("scoring_func", "sigmoid"),
            topk_method=opt("topk_method", "noaux_tc"),
            rms_norm_eps=need("rms_norm_eps", float),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=opt("max_position_embeddings", 4096, int),
            tie_word_embeddings=_typed("tie_word_embeddings", tie, bool),
            hidden_act=opt("hidden_act", "silu"),
            attention_bias=opt("attention_bias", False, bool),
            bos_token_id=opt("bos_token_id", top.get("bos_token_id"), int),
            eos_token_id=eos_t,
            pad_token_id=opt("pad_token_id", top.get("pad_token_id"), int),
            quantization=quant,
            model_type=model_type,
        )

    def to_hf_dict(self) -> dict:
        """The DeepSeek-V3 config.json fields (published layout: rope_scaling + rope_theta)."""
        if self.shared_expert_intermediate_size is not None:
            raise ConfigError(
                "config field shared_expert_intermediate_size has no DeepSeek-V3 config.json field"
            )
        rs = self.rope_scaling
        d = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": self.scoring_func,
            "topk_method": self.topk_method,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None
            if rs.rope_type == "default"
            else {
                "type": rs.rope_type,
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
                "mscale": rs.mscale,
                "mscale_all_dim": rs.mscale_all_dim,
                **(
                    {} if rs.attention_factor is None else {"attention_factor": rs.attention_factor}
                ),
                **({} if rs.truncate else {"truncate": False}),
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "num_nextn_predict_layers": 0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                self.eos_token_id[0]
                if len(self.eos_token_id) == 1
                else list(self.eos_token_id) or None
            ),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.quantization is not None:
            d["quantization_config"] = quantization_config_dict(self.quantization)
        return d


def quantization_config_dict(q: QuantConfig) -> dict:
    """compressed-tensors quantization_config as Kimi-K2-Thinking / K2.5 publish it."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "format": "pack-quantized",
            "weights": {"num_bits": q.num_bits, "type": "int", "symmetric": q.symmetric,
                        "strategy": "group", "group_size": q.group_size, "dynamic": False,
                        "actorder": None, "observer": "minmax", "block_structure": None}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    }


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _typed(name: str, v: Any, kind: type) -> Any:
    """A config.json value of the kind a field needs: an integer (not a boolean, not 4.5), a finite
    real number, or a boolean; ConfigError naming the field otherwise."""
    if kind is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"config field {name!r} must be true or false, got {json.dumps(v)}")
        return v
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (kind is int and not isinstance(v, int))
    ):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"config field {name!r} must be {what}, got {json.dumps(v)}")
    if kind is float:
        if not math.isfinite(v):
            raise ConfigError(f"config field {name!r} must be a finite number, got {v}")
        return float(v)
    return v


def _check_ranges(c: "ModelConfig") -> None:
    """Every field in its range and consistent with the others; ConfigError names the field."""
    def at_least(name, lo):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"config field {name!r} must be an integer >= {lo}, got {v!r}")

    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "max_position_embeddings",
    ):
        at_least(name, 1)
    at_least("n_shared_experts", 0)
    at_least("first_k_dense_replace", 0)
    if c.q_lora_rank is not None:
        at_least("q_lora_rank", 1)
    if c.shared_expert_intermediate_size is not None:
        at_least("shared_expert_intermediate_size", 1)
        at_least("n_shared_experts", 1)
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"config field 'num_experts_per_tok'={c.num_experts_per_tok} is more than "
            f"n_routed_experts={c.n_routed_experts}"
        )
    if c.topk_group > c.n_group:
        raise ConfigError(
            f"config field 'topk_group'={c.topk_group} is more than n_group={c.n_group}"
        )
    for name in ("rms_norm_eps", "latent_norm_eps", "rope_theta", "routed_scaling_factor"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"config field {name!r} must be a finite number > 0, got {v!r}")
    # >= 0; past vocab_size only for a synthetic cut-down vocabulary (checkpoints.preflight)
    for name, ids in (("bos_token_id", [c.bos_token_id]), ("pad_token_id", [c.pad_token_id]),
                      ("eos_token_id", list(c.eos_token_id))):
        for v in ids:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"config field {name!r} must hold token ids >= 0, got {v!r}")
    rs = c.rope_scaling
    if rs.rope_type == "yarn":
        if not rs.factor > 0 or rs.original_max_position_embeddings < 1:
            raise ConfigError("config field 'rope_scaling': factor must be > 0 and "
                              "original_max_position_embeddings >= 1")


def _parse_rope(text: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    params = text.get("rope_parameters")
    scaling = text.get("rope_scaling")
    for name, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, Mapping):
            raise ConfigError(
                f"config field {name!r} must be an object or null, got {json.dumps(v)[:60]}"
            )
    theta = text.get("rope_theta")
    src = None
    if isinstance(params, Mapping):
        src = params
        theta = params.get("rope_theta", theta)
    elif isinstance(scaling, Mapping):
        src = scaling
    if theta is None:
        raise ConfigError("missing config field 'rope_theta', which changes the model's math")
    theta = _typed("rope_theta", theta, float)
    if src is None:
        return float(theta), RopeScaling()
    rtype = src.get("rope_type", src.get("type", "default"))
    if rtype in (None, "default"):
        return float(theta), RopeScaling()
    if rtype != "yarn":
        raise ConfigError(
            f"config field rope_scaling.type={rtype!r}: only 'yarn' (or none) is supported"
        )
    orig = src.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError("missing config field 'rope_scaling.original_max_position_embeddings', "
                          "which changes the model's math")
    factor = src.get("factor")
    if factor is None:  # as transformers: the ratio of the context lengths
        factor = float(text.get("max_position_embeddings", orig)) / float(orig)

    def f_or_none(key):
        v = src.get(key)
        return None if v is None else _typed(f"rope_scaling.{key}", v, float)

    factor = _typed("rope_scaling.factor", factor, float)
    orig = _typed("rope_scaling.original_max_position_embeddings", orig, int)

    return float(theta), RopeScaling(
        rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=f_or_none("beta_fast") or 32.0, beta_slow=f_or_none("beta_slow") or 1.0,
        mscale=f_or_none("mscale"), mscale_all_dim=f_or_none("mscale_all_dim"),
        attention_factor=f_or_none("attention_factor"), truncate=bool(src.get("truncate", True)))


def _parse_quant(q: Optional[Mapping[str, Any]]) -> Optional[QuantConfig]:
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(
            f"config field 'quantization_config' must be an object, got {json.dumps(q)[:60]}"
        )
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported "
                          "(only compressed-tensors pack-quantized INT4)")
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not all(isinstance(g, Mapping) for g in groups.values()):
        raise ConfigError(
            "config field 'quantization_config.config_groups' must be an object of objects"
        )
    if len(groups) != 1:
        raise ConfigError(
            f"quantization_config has {len(groups)} config_groups; exactly one is supported"
        )
    (gname, g), = groups.items()
    fmt = g.get("format", fmt)
    if fmt != "pack-quantized":
        raise ConfigError(
            f"quantization_config format={fmt!r} is not supported (only 'pack-quantized')"
        )
    w = g.get("weights") or {}
    if not isinstance(w, Mapping):
        raise ConfigError(
            f"config field 'quantization_config.config_groups.{gname}.weights' must be an object"
        )
    checks = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for k, v in checks.items():
        if w.get(k) != v:
            raise ConfigError(f"quantization_config.config_groups.{gname}.weights.{k}={w.get(k)!r} "
                              f"is not supported (need {v!r})")
    if w.get("actorder") not in (None, False):
        raise ConfigError(
            f"quantization_config.config_groups.{gname}.weights.actorder is not supported"
        )
    if g.get("input_activations") is not None:
        raise ConfigError(
            f"quantization_config.config_groups.{gname}.input_activations: only weight-only "
            "(W4A16) quantization is supported"
        )
    gs = w.get("group_size")
    if not isinstance(gs, int) or gs <= 0 or gs % 8:
        raise ConfigError(f"quantization_config group_size={gs!r} is not supported (multiple of 8)")
    return QuantConfig(num_bits=4, group_size=gs, symmetric=True)


# ---- presets ----------------------------------------------------------------------------
_KIMI_COMMON = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, n_routed_experts=384, num_experts_per_tok=8,
    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.827, rope_theta=50000.0,
    bos_token_id=163584, pad_token_id=163839, quantization=QuantConfig(),
)


def preset(name: str) -> ModelConfig:
    """Named configurations: kimi-k2.5, kimi-k2-thinking, deepseek-v3, tiny; kimi-k2.5-61x16:
    Kimi-K2.5 with 16 routed experts per layer (top-8, INT4: a batch-1 token reads a real layer's
    bytes, on one device); kimi-k2.5-tp8-shard: one GPU's share of Kimi-K2.5 under TP8 (`shard_of`,
    tensor_parallel_size 8); kimi-k2.5-tp8-ep8-shard: one GPU's share under TP8 attention + EP8
    experts (`shard_of`, expert_parallel)."""
    if name == "kimi-k2.5-tp8-shard":
        return shard_of(preset("kimi-k2.5"), 8)
    if name == "kimi-k2.5-tp8-ep8-shard":
        return shard_of(preset("kimi-k2.5"), 8, expert_parallel=True)
    if name == "kimi-k2.5-61x16":
        return preset("kimi-k2.5").replace(n_routed_experts=16)
    if name == "kimi-k2.5":
        return ModelConfig(**_KIMI_COMMON, rms_norm_eps=1e-5, max_position_embeddings=262144,
                           rope_scaling=RopeScaling("yarn", 64.0, 4096, 32.0, 1.0, 1.0, 1.0),
                           eos_token_id=(163585,), model_type="kimi_k25")
    if name == "kimi-k2-thinking":
        return ModelConfig(**_KIMI_COMMON, rms_norm_eps=1e-5, max_position_embeddings=262144,
                           rope_scaling=RopeScaling("yarn", 64.0, 4096, 1.0, 1.0, 1.0, 1.0),
                           eos_token_id=(163586,), model_type="kimi_k2")
    if name == "deepseek-v3":
        return ModelConfig(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            first_k_dense_replace=3,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=RopeScaling("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
            max_position_embeddings=163840,
            bos_token_id=0,
            eos_token_id=(1,),
        )
    if name == "tiny":
        return ModelConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling=RopeScaling("yarn", 4.0, 64, 32.0, 1.0, 1.0, 1.0),
            max_position_embeddings=256, bos_token_id=0, eos_token_id=(1,))
    raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")


PRESETS = (
    "kimi-k2.5",
    "kimi-k2-thinking",
    "deepseek-v3",
    "tiny",
    "kimi-k2.5-61x16",
    "kimi-k2.5-tp8-shard",
    "kimi-k2.5-tp8-ep8-shard",
)


def shard_of(
    cfg: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False
) -> ModelConfig:
    """One device's share of `cfg` on tp devices (layouts TP, TP+EP): heads, dense and shared FFN
    widths and vocab / tp; q_a, kv_a, router and latent cache whole; routed experts F / tp each, or
    under expert_parallel E / tp whole experts with top-(K / tp), the same expected experts per
    token and batch."""
    tp, E, K = tensor_parallel_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    split = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "shared_expert_width": cfg.shared_expert_width,
    }
    split.update({"n_routed_experts": E, "num_experts_per_tok": K} if expert_parallel
                 else {"moe_intermediate_size": cfg.moe_intermediate_size})
    for name, n in split.items():
        if n % tp:
            raise ConfigError(
                f"shard_of: {name} = {n} is not divisible by tensor_parallel_size {tp}"
            )
    if expert_parallel and cfg.n_group != 1:
        raise ConfigError(
            f"shard_of: n_group = {cfg.n_group}: group-limited routing has no per-shard form"
        )
    out = cfg.replace(**{k: v // tp for k, v in split.items() if k != "shared_expert_width"})
    if out.shared_expert_width != cfg.shared_expert_width // tp:
        out = out.replace(shared_expert_intermediate_size=cfg.shared_expert_width // tp)
    q = out.quantization
    if q is not None and out.moe_intermediate_size % q.group_size:
        raise ConfigError(
            f"shard_of: moe_intermediate_size = {out.moe_intermediate_size} is not a multiple of "
            f"the INT4 group size {q.group_size}"
        )
    return out
