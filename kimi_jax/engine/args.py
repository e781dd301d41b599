"""EngineConfig: everything an engine is built from (vLLM's EngineArgs), checked when it is made;
and the two resolved sub-configs an EngineCore runs under, SchedulerConfig and CacheConfig (vLLM's
names: every default filled in from the model and the machine, `kimi_jax.entrypoints.frontend`)."""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Optional, Union

from kimi_jax import ops
from kimi_jax.config import PRESETS, ModelConfig
from kimi_jax.engine.speculative import SpeculativeConfig

DTYPES = ("bfloat16", "float32")
STEP_LAYOUTS = ("padded", "ragged")
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float": "float32"}
#: dtype="auto" on CPU (BENCHMARKS.md "CPU default dtype")
CPU_AUTO_DTYPE = "float32"


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _batch_invariant_default() -> bool:
    """EngineConfig.batch_invariant's default: the environment's VLLM_BATCH_INVARIANT=1 (vLLM's)."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """model: a checkpoint directory, a preset name, a ModelConfig (random weights) or None (the
    demo model). block_size / num_gpu_blocks_override: tokens per page of the latent cache and its
    pages (vLLM's names; None: from free memory).
    compilation_cache_dir: the persistent JAX cache ('none': off). exec_plan: kimi_jax.ops.ExecPlan
    (None: this machine's). precompile: compile the serving programs before the first request.
    max_logprobs: the most logprobs / prompt_logprobs a request may ask for (-1: no cap).
    step_layout: "padded" (a prefill and a decode pass an iteration, padded [B, T] programs) or
    "ragged" (one step over a flat token axis, vLLM v1's: decode rows and prompt chunks mixed
    within max_num_batched_tokens, a chunk at most long_prefill_token_threshold tokens (0: no cap);
    max_num_batched_tokens None: max(max_prefill_tokens, max_num_seqs)).
    vLLM's trust_remote_code (no checkpoint code runs; warns), enforce_eager (no precompile).
    batch_invariant: a request's greedy tokens and logprobs do not depend on the other requests of
    its steps (`ExecPlan.batch_invariant`; default on where VLLM_BATCH_INVARIANT=1)."""
    model: Union[str, ModelConfig, None] = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    block_size: int = 16
    num_gpu_blocks_override: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    prefill_chunk: Optional[int] = None
    max_prefill_tokens: int = 2048
    speculative_config: Union[SpeculativeConfig, dict, str, None] = None
    overlap_scheduling: bool = True
    enable_prefix_caching: bool = True
    check_finite_weights: bool = True
    compilation_cache_dir: Optional[str] = None
    exec_plan: Optional[ops.ExecPlan] = None
    tokenizer: Optional[str] = None
    seed: int = 0
    precompile: bool = False
    max_logprobs: int = 20
    trust_remote_code: bool = False
    enforce_eager: bool = False
    step_layout: str = "padded"
    max_num_batched_tokens: Optional[int] = None
    long_prefill_token_threshold: int = 0
    batch_invariant: bool = dataclasses.field(default_factory=_batch_invariant_default)

    def __post_init__(self):
        m = self.model
        if not (m is None or isinstance(m, ModelConfig)
                or (isinstance(m, str) and (os.path.isdir(m) or m in PRESETS))):
            raise ValueError(
                f"model={m!r} is neither a checkpoint directory nor a preset {PRESETS}"
            )
        for name, low in (
            ("tensor_parallel_size", 1),
            ("data_parallel_size", 1),
            ("max_num_seqs", 1),
            ("block_size", 1),
            ("max_prefill_tokens", 1),
            ("max_logprobs", -1),
            ("long_prefill_token_threshold", 0),
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        for name, low in (
            ("max_model_len", 1),
            ("num_gpu_blocks_override", 2),
            ("prefill_chunk", 1),
            ("max_num_batched_tokens", 1),
        ):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < low):
                raise ValueError(f"{name} must be an integer >= {low} (or None), got {v!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not (
            isinstance(self.gpu_memory_utilization, (int, float))
            and 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("enable_expert_parallel", "overlap_scheduling", "enable_prefix_caching",
                     "check_finite_weights", "precompile", "trust_remote_code", "enforce_eager",
                     "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.enforce_eager and self.precompile:
            raise ValueError("enforce_eager=True compiles programs on first use; it cannot be "
                             "combined with precompile=True")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is not supported (choose 'auto' or one of {sorted(DTYPES)})"
            )
        if self.exec_plan is not None and not isinstance(self.exec_plan, ops.ExecPlan):
            raise TypeError(
                f"exec_plan must be a kimi_jax.ops.ExecPlan, got {type(self.exec_plan).__name__}"
            )
        spec = self.speculative_config
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if spec is not None and not isinstance(spec, (dict, SpeculativeConfig)):
            raise ValueError(
                f"speculative_config must be a dict or JSON object, got {type(spec).__name__}"
            )
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_any(spec))
        self._check_step_layout()

    def _check_step_layout(self) -> None:
        if self.step_layout not in STEP_LAYOUTS:
            raise ValueError(f"step_layout={self.step_layout!r} is not one of {STEP_LAYOUTS}")
        budget = self.max_num_batched_tokens
        if self.step_layout == "ragged" and budget is not None and budget < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={budget} is below max_num_seqs="
                             f"{self.max_num_seqs}: one step must hold every decode row")

    def batched_tokens(self) -> int:
        """A ragged step's token budget: max_num_batched_tokens, else max(max_prefill_tokens,
        max_num_seqs)."""
        return self.max_num_batched_tokens or max(self.max_prefill_tokens, self.max_num_seqs)

    @property
    def model_path(self) -> Optional[str]:
        """The checkpoint directory, or None for random weights."""
        return self.model if isinstance(self.model, str) and os.path.isdir(self.model) else None

    def resolve_dtype(self, platform: str, config_dict: Optional[dict] = None) -> str:
        """The compute dtype: "auto" is CPU_AUTO_DTYPE on CPU, else the checkpoint's torch_dtype
        (bfloat16 when absent or unsupported, and for random weights). config_dict: config.json as
        read already (else it is read here)."""
        if self.dtype != "auto":
            return self.dtype
        if platform == "cpu":
            return CPU_AUTO_DTYPE
        declared, cfg = None, config_dict
        path = self.model_path
        if cfg is None and path is not None and os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
        if isinstance(cfg, dict):
            text = cfg.get("text_config")
            declared = cfg.get("torch_dtype") or (
                text.get("torch_dtype") if isinstance(text, dict) else None
            )
        return _TORCH_DTYPES.get(str(declared), "bfloat16")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler plans within: at most max_num_seqs running requests of max_model_len
    tokens, prompt chunks of at most prefill_chunk tokens and max_prefill_tokens a pass;
    max_logprobs the cap of a request's logprobs (-1: none); speculation; overlap scheduling.
    step_layout "ragged": one step an iteration within max_num_batched_tokens (0:
    max_prefill_tokens), prompt chunks of at most long_prefill_token_threshold tokens (0: the
    budget), prefill_chunk unread."""
    max_num_seqs: int
    max_model_len: int
    prefill_chunk: int
    max_prefill_tokens: int
    max_logprobs: int = 20
    speculative_config: Optional[SpeculativeConfig] = None
    overlap_scheduling: bool = True
    step_layout: str = "padded"
    max_num_batched_tokens: int = 0
    long_prefill_token_threshold: int = 0


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The latent cache: num_pages pages of page_size tokens in `dtype` (a jnp dtype), with or
    without prefix caching."""
    page_size: int
    num_pages: int
    dtype: object = None
    enable_prefix_caching: bool = True
