"""Step shapes, one rule for the scheduler's plans and the runner's `Runner.programs`: `Shapes`
(padded [B, T] passes) and `RaggedShapes` (one step over a flat token axis)."""

from __future__ import annotations

import dataclasses
from typing import Optional

MIN_TABLE_TOKENS = 256
# Decode and verification on the Pallas MLA kernel, which reads each row's length, take one
# block-table width for rows up to this many pages: ~free (BENCHMARKS.md 'Program set').
DECODE_TABLE_PAGES = 1024
# A ragged step's token ladder starts here: steps of up to this many tokens share one program
# (a decode step of a few rows runs a few tokens, not 16, through every layer).
RAGGED_MIN_TOKENS = 4
# Ragged steps of fewer tokens than this still take this many rows (as many as the ladder's step
# of this width): the sampling halves keep one program per row count of a 16-token step up.
RAGGED_MIN_ROWS = 16
# A ragged step that scores a prompt (prompt_logprobs) is at least this wide (or the ladder's
# widest): the forward's prompt-logprobs variant exists from this width up, not at every width.
RAGGED_MIN_PROMPT_TOKENS = 64


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of compiled shapes."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def table_bucket(pages: int, page_size: int) -> int:
    """Block-table width for `pages` pages: a power of two covering >= MIN_TABLE_TOKENS (one width
    for short rows)."""
    return bucket(pages, max(4, -(-MIN_TABLE_TOKENS // page_size)))


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an engine admits: bounds of its padded shapes and program set (`Runner.programs`)."""

    max_num_seqs: int
    max_model_len: int
    page_size: int
    prefill_chunk: int
    max_prefill_tokens: int
    max_logprobs: int = 20
    speculative_tokens: int = 0           # drafts per verification pass (0: no speculation)
    pages_per_rank: Optional[int] = None  # a row can hold at most this many pages
    split_decode: bool = False            # overlap scheduling: decode steps may run in two halves
    step_layout: str = "padded"           # "ragged": one step over a flat token axis
    max_num_batched_tokens: int = 0       # a ragged step's token budget (0: max_prefill_tokens)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The padded shapes of an engine's steps: block-table widths and the prefill pass's bounds."""
    page_size: int
    max_pages: int                        # the most pages a row holds
    prefill_tokens: int                   # a prefill pass's cap on B * T
    rank_pages: Optional[int] = None      # pages of one data-parallel rank (None: no cap)
    dp: int = 1
    lengths_read: bool = False            # decode attention reads each row's length (Pallas)
    absorbed_chunk: int = 0               # chunk prefills up to this width run as decode does

    @classmethod
    def of(
        cls,
        max_model_len: int,
        page_size: int,
        max_prefill_tokens: int,
        rank_pages: Optional[int] = None,
        dp: int = 1,
        pallas: bool = False,
        absorbed_chunk: int = 0,
    ) -> "Shapes":
        # a prompt is shorter than max_model_len and the last sampled token is never fed
        pages = max(1, -(-(max_model_len - 1) // page_size))
        pages = pages if rank_pages is None else min(pages, rank_pages)
        return cls(
            page_size,
            pages,
            bucket(max_prefill_tokens, 16),
            rank_pages,
            dp,
            pallas,
            absorbed_chunk if pallas else 0,
        )

    @classmethod
    def for_limits(cls, limits: Limits, dp: int, exec_plan) -> "Shapes":
        """The shapes of an engine within `limits` whose steps run `exec_plan` over dp ranks."""
        return cls.of(limits.max_model_len, limits.page_size, limits.max_prefill_tokens,
                      limits.pages_per_rank, dp, exec_plan.pallas, exec_plan.absorbed_chunk_tokens)

    def table(self, kind: str, pages: int, width: int = 1, fresh: bool = False) -> int:
        """Block-table width of a step whose longest row holds `pages` pages: fresh prefill never
        reads the cache; the XLA path and chunk prefill gather the whole table."""
        if kind == "prefill" and fresh and not self._reads_lengths(kind, width):
            return table_bucket(-(-width // self.page_size), self.page_size)
        if self._reads_lengths(kind, width) and pages <= DECODE_TABLE_PAGES:
            top = min(DECODE_TABLE_PAGES, table_bucket(self.max_pages, self.page_size))
            return max(top, table_bucket(pages, self.page_size))
        return table_bucket(pages, self.page_size)

    def _reads_lengths(self, kind: str, width: int) -> bool:
        return self.lengths_read and (kind != "prefill" or width <= self.absorbed_chunk)

    def tables(self, kind: str, width: int = 1, fresh: bool = False) -> list[int]:
        return sorted({self.table(kind, p, width, fresh) for p in range(1, self.max_pages + 1)})

    def prefill_fits(self, batch: int, width: int, pages: int, fresh: bool) -> bool:
        """Whether a prefill pass [batch, width] (longest row: `pages` pages) may take another row:
        B * T within the cap and, chunk prefill, each rank's gathered tables within its pages (T =
        1: decode)."""
        if width == 1:
            return True
        table = self.table("prefill", pages, width, fresh)
        return batch * width <= self.prefill_tokens and (
            fresh
            or self._reads_lengths("prefill", width)
            or self.rank_pages is None
            or batch * table <= self.dp * self.rank_pages
        )


@dataclasses.dataclass(frozen=True)
class RaggedShapes:
    """The shapes of a ragged step (kimi_jax.engine.steps.RaggedBatch): T tokens from a power-of-two
    ladder (RAGGED_MIN_TOKENS up to the budget, multiples of dp), B(T) = min(max(T, RAGGED_MIN_ROWS
    rounded up to dp), max_rows) rows (the forward program is keyed by T alone) and X(T) pages
    (each rank's block: min(its pages, B / dp rows x the pages a row holds)). Each rank's rows
    take at most `rank_tokens` of its block of T / dp tokens."""
    dp: int
    rank_tokens: int                      # a rank's token budget a step
    max_rows: int                         # rows of the widest step: the padded max_num_seqs
    max_pages: int                        # the most pages a row holds
    rank_pages: Optional[int] = None      # pages of one data-parallel rank (None: no cap)

    @classmethod
    def for_limits(cls, limits: Limits, dp: int) -> "RaggedShapes":
        budget = limits.max_num_batched_tokens or limits.max_prefill_tokens
        per_rank = -(-limits.max_num_seqs // dp)
        rows = -(-bucket(dp * per_rank, 1) // dp) * dp
        pages = max(1, -(-(limits.max_model_len - 1) // limits.page_size))
        if limits.pages_per_rank is not None:
            pages = min(pages, limits.pages_per_rank)
        rank_tokens = max(1, min(budget // dp, per_rank * max(1, limits.max_model_len - 1)))
        return cls(dp, rank_tokens, rows, pages, limits.pages_per_rank)

    def tokens(self, n: int, scores_prompt: bool = False) -> int:
        """T of a step whose busiest rank feeds n tokens (scores_prompt: a row of it scores its
        prompt, so it takes a width with the prompt-logprobs variant)."""
        T = -(-bucket(self.dp * n, RAGGED_MIN_TOKENS) // self.dp) * self.dp
        return max(T, self.prompt_tokens()) if scores_prompt else T

    def prompt_tokens(self) -> int:
        """The narrowest width whose forward has a prompt-logprobs variant."""
        return min(self.tokens(-(-RAGGED_MIN_PROMPT_TOKENS // self.dp)), self.ladder()[-1])

    def rows(self, T: int) -> int:
        return min(max(T, -(-RAGGED_MIN_ROWS // self.dp) * self.dp), self.max_rows)

    def pages(self, T: int) -> int:
        block = self.rows(T) // self.dp * self.max_pages
        return self.dp * (block if self.rank_pages is None else min(self.rank_pages, block))

    def ladder(self) -> list[int]:
        top, T, out = self.tokens(self.rank_tokens), RAGGED_MIN_TOKENS, []
        while True:
            out.append(-(-T // self.dp) * self.dp)
            if out[-1] >= top:
                return sorted(set(out))
            T *= 2
