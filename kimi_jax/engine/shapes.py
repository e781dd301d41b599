from __future__ import annotations

MIN_TABLE_TOKENS = 256


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of compiled shapes."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def table_bucket(pages: int, page_size: int) -> int:
    """Block-table width for `pages` pages: a power of two covering >= MIN_TABLE_TOKENS (one width for short rows)."""
    return bucket(pages, max(4, -(-MIN_TABLE_TOKENS // page_size)))
