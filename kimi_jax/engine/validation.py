"""Checks of one request against the model for every entry point: a bad request fails alone
(RequestError)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np

SEED_MIN, SEED_END = -(2 ** 63), 2 ** 64        # seeds are taken modulo 2^64


class RequestError(ValueError):
    """A request that cannot run; it fails alone. field: the parameter at fault, when one is."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


def is_int(v: Any) -> bool:
    """A Python or numpy integer, not a boolean."""
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v: Any) -> bool:
    """A real number (int or float, numpy included), not a boolean."""
    return isinstance(v, (numbers.Real, np.floating, np.integer)) and not isinstance(
        v, (bool, np.bool_)
    )


def check_prompt_ids(prompt_ids: Any, vocab_size: int, max_model_len: Optional[int]) -> list[int]:
    """The prompt as a list of Python ints; RequestError naming the first bad id."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (Sequence, np.ndarray)):
        raise RequestError(
            f"prompt must be text or a list of token ids, got {type(prompt_ids).__name__}"
        )
    if len(prompt_ids) == 0:
        raise RequestError("empty prompt")
    for i, t in enumerate(prompt_ids):
        if not is_int(t):
            raise RequestError(
                f"prompt token {i} is {t!r} ({type(t).__name__}), not an integer token id"
            )
        if not 0 <= t < vocab_size:
            raise RequestError(f"token id {int(t)} is outside the vocabulary [0, {vocab_size})")
    if max_model_len is not None and len(prompt_ids) >= max_model_len:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room under "
                           f"max_model_len={max_model_len}")
    return [int(t) for t in prompt_ids]


def check_seed(seed: Any) -> Optional[int]:
    if seed is None:
        return None
    if not is_int(seed):
        raise RequestError(
            f"seed must be an integer, got {seed!r} ({type(seed).__name__})", field="seed"
        )
    if not SEED_MIN <= seed < SEED_END:
        raise RequestError(
            f"'seed' must be in [{SEED_MIN}, 2^64) (64 bits), got {seed}", field="seed"
        )
    return int(seed)


FLOAT32_MAX = 3.4028234663852886e38


def check_finite(name: str, v: Any) -> None:
    """A number finite in float32, the dtype the device uses (larger ones round to inf there)."""
    if not is_real(v) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v!r}", field=name)
    if abs(v) > FLOAT32_MAX:
        raise RequestError(f"{name} must be within float32's range (|x| <= {FLOAT32_MAX:.8g}), "
                           f"got {v!r}", field=name)


def check_request(prompt_ids: Any, params, *, vocab_size: int, max_model_len: Optional[int],
                  max_logprobs: Optional[int] = None) -> list[int]:
    """Check a request's sampling parameters and prompt ids against the model; the ids as ints."""
    try:
        params.validate(vocab_size=vocab_size, max_logprobs=max_logprobs)
    except RequestError:
        raise
    except (TypeError, ValueError) as e:
        raise RequestError(str(e), getattr(e, "field", None)) from None
    return check_prompt_ids(prompt_ids, vocab_size, max_model_len)
