"""kimi_jax: a JAX/XLA inference engine for Kimi-K2.5-class (DeepSeek-V3 architecture) MoE models"""

from kimi_jax.entrypoints.llm import LLM, CompletionOutput, RequestOutput
from kimi_jax.config import ModelConfig, preset
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_params import StructuredOutputsParams
from kimi_jax.ops.plan import ExecPlan

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ModelConfig",
    "preset",
    "ExecPlan",
]
__version__ = "0.1.0"
