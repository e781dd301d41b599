"""vLLM's ``vllm.sampling_params`` names, and a checkpoint's generation_config.json defaults."""
from __future__ import annotations

import json
import os
from typing import Optional

from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "generation_defaults"]

GENERATION_CONFIG_FILE = "generation_config.json"
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: Optional[str]) -> dict:
    """SamplingParams keyword arguments from ``model_path/generation_config.json`` ({}: none)."""
    if model_path is None:
        return {}
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable generation config: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: generation config is not a JSON object")
    return {field: cfg[key] for key, field in _FIELDS.items() if cfg.get(key) is not None}
