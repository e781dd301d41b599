"""Requests of the batch engine (kimi_jax.engine.scheduler): the Request record, prompt checks, and
the host side of logprobs and prompt logprobs."""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from kimi_jax.engine import penalties
from kimi_jax.engine.sampling import Logprob, SamplingParams, key_data_for_seed
from kimi_jax.engine.shapes import bucket
from kimi_jax.engine.speculative import SpecState
from kimi_jax.engine.validation import RequestError, check_prompt_ids, check_request


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    key: np.ndarray
    stop_ids: frozenset
    max_new: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0                 # tokens whose latents are in the cache
    # prompt tokens taken from the prefix cache when first admitted
    num_cached_tokens: int = 0
    page_hashes: list = dataclasses.field(default_factory=list)   # chained hashes of its full pages
    num_registered: int = 0               # leading pages registered in the prefix cache
    cache_queried: bool = False           # its prefix was looked up since it was admitted
    pages: list[int] = dataclasses.field(default_factory=list)
    # per output token {id: Logprob}
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: object = None
    text: Optional[str] = None            # set when a stop string truncated it
    num_preemptions: int = 0
    # data-parallel rank whose rows and pages it uses while admitted
    rank: int = 0
    # structured outputs: the grammar state (kimi_jax.engine.structured.RowMatcher), advanced by
    # every appended token; its mask constrains the request's next token
    structured: Optional[object] = None
    spec: SpecState = dataclasses.field(default_factory=SpecState)
    # wall-clock times (time.time()) the host saw: queued (`Scheduler.add`), first output token and
    # last one appended. With overlap scheduling a token is appended one step after it was sampled,
    # which is when a caller could first have it.
    arrival_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # logits adjustments (kimi_jax.engine.penalties; None: none) and the occurrence-pool row held
    # while running (-1: none)
    adjust: Optional[penalties.RowAdjust] = None
    occ_row: int = -1
    # [None, {id: Logprob}, ...] per prompt position, once computed (prompt_logprobs)
    prompt_logprobs: Optional[list] = None
    # n samples sharing one prefill (`EngineCore.add`): a sample's index and its group's id;
    # the group's prefill-only request holds the samples (forks) and the prompt's last token (tail)
    sample_index: int = 0
    group_id: Optional[str] = None
    prefill_only: bool = False
    forks: list = dataclasses.field(default_factory=list)
    tail: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def pending(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


def validate_prompt(prompt_ids, vocab_size: int, max_model_len: int) -> None:
    check_prompt_ids(prompt_ids, vocab_size, max_model_len)


def n_logprobs(reqs) -> Optional[int]:
    """Top logprobs a step must return: the most any of its requests asks for (None: none asks; 0
    when only best_of needs the chosen tokens' logprobs)."""
    return max(
        (
            r.params.logprobs if r.params.logprobs is not None else 0
            for r in reqs
            if r.params.logprobs is not None or r.params.num_samples > r.params.n
        ),
        default=None,
    )


def prompt_entries_left(r: "Request") -> bool:
    """r asks for prompt logprobs and some of its prompt positions are not scored yet."""
    return r.prompt_logprobs is not None and len(r.prompt_logprobs) < len(r.prompt_ids) + len(
        r.tail
    )


def wants_chunk(r: "Request") -> bool:
    """r has prompt work left: more than one token to compute, or its last one while it still
    scores prompt positions (a decode row otherwise)."""
    return r.pending > 1 or (r.pending == 1 and prompt_entries_left(r))


def samples_with_extras(r: "Request") -> bool:
    """r's sampling needs the extras programs: logprobs (best_of's chosen-token ones too), logits
    adjustments or a grammar's mask."""
    return n_logprobs([r]) is not None or r.adjust is not None or r.structured is not None


def prefill_shape(rows, page_size: int) -> tuple[int, int, bool]:
    """(width T, pages of the longest row once it holds its chunk, fresh) of a prefill pass over
    rows [(request, tokens fed)]. T = 1 (a decode-kind step) when each row feeds one token and
    scores no prompt position (decode programs return no prompt logprobs), else bucket(max, 16)."""
    one = all(n == 1 and not prompt_entries_left(r) for r, n in rows)
    pages = max(max(len(r.pages), -(-(r.num_computed + n) // page_size)) for r, n in rows)
    return (
        1 if one else bucket(max(n for _, n in rows), 16),
        pages,
        all(r.num_computed == 0 for r, _ in rows),
    )


def logprob_dict(token: int, logprob, rank, top_ids, top_vals) -> dict:
    """{token: Logprob, then the top ids not yet there: Logprob with rank 1, 2, ...} (vLLM's)."""
    out = {int(token): Logprob(float(logprob), int(rank))}
    for i, (t, v) in enumerate(zip(top_ids, top_vals)):
        out.setdefault(int(t), Logprob(float(v), i + 1))
    return out


def prompt_targets(rows, batch_rows, shape):
    """(top prompt logprobs the step returns or None, each position's next prompt token [B, T]
    (-1: none)) for the rows still scoring prompt positions."""
    want = [(b, r, n) for b, (r, n) in zip(batch_rows, rows) if prompt_entries_left(r)]
    if not want:
        return None, None
    targets = np.full(shape, -1, np.int32)
    for b, r, n in want:
        full = r.prompt_ids + r.tail
        nxt = np.arange(r.num_computed, r.num_computed + n) + 1
        ok = nxt < len(full)
        targets[b, :n][ok] = np.asarray(full)[nxt[ok]]
    return max(r.params.prompt_logprobs for _, r, _ in want), targets

def score_prompt(r: Request, out, b: int, start: int, n: int) -> None:
    """Append the prompt-logprob entries of positions start .. start + n - 1 not yet scored."""
    full, k = r.prompt_ids + r.tail, r.params.prompt_logprobs
    for j in range(n):
        p = start + j
        if p + 1 != len(r.prompt_logprobs) or p + 1 >= len(full):
            continue
        r.prompt_logprobs.append(
            logprob_dict(
                full[p + 1],
                out.prompt_logprob[b, j],
                out.prompt_rank[b, j],
                out.prompt_top_ids[b, j][:k],
                out.prompt_top_vals[b, j][:k],
            )
        )


def append_token(r: Request, t: int, out=None, b: int = 0, tokenizer=None) -> None:
    """Append one output token (out, row b: its logprobs) and set r's finish reason when it ends."""
    r.output_ids.append(t)
    now = time.time()
    if r.first_token_time is None:
        r.first_token_time = now
    if out is not None and out.logprob is not None:
        r.cumulative_logprob += float(out.logprob[b])
        if r.params.logprobs is not None:
            k = r.params.logprobs
            r.logprobs.append(logprob_dict(t, out.logprob[b], out.rank[b], out.top_ids[b][:k],
                                            out.top_vals[b][:k]))
    if r.structured is not None and t not in r.stop_ids:
        r.structured.accept(t)
    if r.structured is not None and r.structured.is_error():
        # broken (its mask then allows stop tokens): not a complete output
        r.finish_reason = "length"
    elif t in r.stop_ids:
        r.finish_reason, r.stop_reason = "stop", t
    elif r.structured is not None and r.structured.is_finished():
        r.finish_reason = "stop"        # the grammar is complete (only a stop token could follow)
    elif r.params.stop_strings and tokenizer is not None and _hit_stop(r, tokenizer):
        r.finish_reason = "stop"
    elif len(r.output_ids) >= r.max_new:
        r.finish_reason = "length"
    if r.finish_reason is not None:
        r.finished_time = now


def _hit_stop(r: Request, tokenizer) -> bool:
    text = tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
    hits = [(text.find(s), s) for s in r.params.stop_strings if s in text]
    if not hits:
        return False
    k, s = min(hits)
    r.text = text[: k + len(s)] if r.params.include_stop_str_in_output else text[:k]
    r.stop_reason = s
    return True


def row_adjust_for(
    params: SamplingParams, stop, vocab: int, tokenizer
) -> Optional[penalties.RowAdjust]:
    """A request's logits adjustments (RequestError names a token id outside the vocabulary)."""
    bad = [t for t in (params.logit_bias or {}) if t >= vocab]
    if bad:
        raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
    words = []
    if params.bad_words:
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise RequestError("bad_words needs a tokenizer; this model has none")
        words = penalties.bad_words_token_ids(params.bad_words, tokenizer)
        if any(t >= vocab for w in words for t in w):
            raise RequestError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab})")
    return penalties.row_adjust(params, stop, words)



def new_request(
    request_id: str,
    prompt_ids,
    params: SamplingParams,
    seed: int,
    prompt: Optional[str],
    *,
    vocab_size: int,
    max_model_len: int,
    page_size: int,
    pages_per_rank: int,
    dp: int,
    eos_ids,
    tokenizer,
    max_logprobs: Optional[int] = None,
) -> Request:
    """A validated Request (its grammar matcher aside); RequestError names what is wrong."""
    prompt_ids = check_request(
        prompt_ids,
        params,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        max_logprobs=max_logprobs,
    )
    if -(-len(prompt_ids) // page_size) + 1 > pages_per_rank:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit in the cache "
                           f"({pages_per_rank} pages of {page_size} tokens"
                           + (" per data-parallel rank)" if dp > 1 else ")"))
    stop = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop |= eos_ids
    max_new = min(params.max_tokens or max_model_len, max_model_len - len(prompt_ids))
    r = Request(request_id, prompt, [int(t) for t in prompt_ids], params, key_data_for_seed(seed),
                frozenset(stop), max_new)
    r.adjust = row_adjust_for(params, stop, vocab_size, tokenizer)
    if params.prompt_logprobs is not None:
        r.prompt_logprobs = [None]
    return r

def prefill_parent(reqs: list[Request]) -> Request:
    """The prefill-only request of a prompt's samples: all but its last token, computed once."""
    first, now = reqs[0], time.time()
    for r in reqs:
        r.arrival_time = r.arrival_time or now
    return Request(
        f"prefill_{first.group_id}",
        first.prompt,
        first.prompt_ids[:-1],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=first.params.prompt_logprobs),
        first.key,
        frozenset(),
        0,
        prefill_only=True,
        forks=list(reqs),
        tail=first.prompt_ids[-1:],
        prompt_logprobs=[None] if first.prompt_logprobs is not None else None,
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One request's part of a step: the tokens it feeds at positions start, start + 1, ... (none in
    a chained decode step: the step in flight's token), its pages and its batch row."""
    req: Request
    batch_row: int                               # batch row (data parallelism: in its rank's block)
    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    step: int                               # tokens the request has sampled before this step
    live: bool = True                       # False: padding (it ends with the step in flight)
    drafts: int = 0                         # its last this many tokens are drafts to verify

    @property
    def n(self) -> int:
        """Tokens whose latents the step computes."""
        return len(self.tokens) or 1


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One pass of the scheduler (kimi_jax.engine.runner runs it): 'prefill' (prompt chunks, T > 1),
    'decode' (one token per row) or 'verify' (the last token plus drafts), padded to [batch, width]
    with a block table of `table` pages; or 'ragged' (any mix of rows on one flat axis of `width`
    tokens, `batch` rows, `table` the width of its pages_X: kimi_jax.engine.shapes.RaggedShapes).
    chained: fed the step in flight's tokens on the device;
    overlap: dispatched without waiting (its outputs come back with a later run); split: a decode
    step run as a forward half and a sampling half, laid out after the step before is booked (rows
    whose sampling needs their last token on the host: grammars, multi-token bad words)."""
    kind: str
    rows: tuple[Row, ...]
    batch: int
    width: int
    table: int
    chained: bool = False
    overlap: bool = False
    split: bool = False

    @property
    def live(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.live)
