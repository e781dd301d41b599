"""Shape buckets: the padded sizes a step is compiled for."""
from __future__ import annotations

# The narrowest block table covers this many tokens: short sequences (a chat turn, a benchmark's
# prompts, kimi-generate's 64 tokens) share one compiled program instead of compiling again each time
# they cross 4 and 8 pages. Padding pages cost a gather on the XLA path; the GPU kernels read only
# each row's own tokens.
MIN_TABLE_TOKENS = 256


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of compiled shapes."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def table_bucket(pages: int, page_size: int) -> int:
    """Block-table width for rows holding at most `pages` pages of `page_size` tokens: a power of two
    covering at least MIN_TABLE_TOKENS tokens."""
    return bucket(pages, max(4, -(-MIN_TABLE_TOKENS // page_size)))
