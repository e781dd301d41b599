"""Shape buckets: the padded sizes a step is compiled for."""
from __future__ import annotations


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of compiled shapes."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())
