"""Continuous batching over a paged latent cache.

(One file over 600 lines: admission, the prefill / decode / verification passes, overlap scheduling
and preemption share the running set and the page pool; the records, the pool and the logits
adjustments live in requests.py, page_pool.py and penalties.py.)

Requests wait in a FIFO queue and join the running set as soon as a slot (max_num_seqs) and cache pages
are free; finished requests leave at once and their pages are reused. Every iteration runs
  1. one prefill step: prompt chunks (at most `prefill_chunk` tokens of each prompt, at most
     `max_prefill_tokens` in all), so a long prompt is spread over several iterations, and
  2. one decode step for every running request whose prompt is done (one token each), or, with
     speculation, one verification pass for all of them when that is expected to pay (see
     `_verify_pays`: acceptance statistics against pass costs measured once per shape bucket),
so decoding never waits behind a long prompt. Shapes are bucketed to powers of two (batch, chunk
length, pages per sequence) so the number of compiled programs stays small.

When a sequence needs a page and none is free, the most recently admitted other request is preempted:
its pages are freed and it is recomputed later from its prompt plus the tokens it already produced
(its output is unchanged: greedy tokens and per-request seeded streams do not depend on batching).

Overlap scheduling (`overlap=True`, no speculation): a decode step is dispatched without waiting for
its tokens, and while the device runs step N the host dispatches step N+1 for the same rows, fed
step N's sampled tokens as device arrays (positions, block tables, per-row steps and sampling arrays
do not depend on the token values), then reads step N's tokens and does its bookkeeping (append,
stop conditions, finished requests) one step behind. A request that finished at step N has already
been included in step N+1: that extra token is discarded (a row known on the host to reach max_tokens
at step N is fed as padding instead). Its pages return to the pool at once: every later step that
could write them is ordered after step N+1 on the device (the page pool is threaded through the
steps). The chain stops (the host waits for the step in flight, `drain`, and takes the ordinary
path) whenever the batch would change: a request finished, one can be admitted, a prompt chunk is
pending, or a page for the next step would need a preemption. Tokens are those of the ordinary path.

Logits adjustments (kimi_jax.engine.penalties): a request with penalties holds an occurrence-pool
slot while running (written from its prompt and output when it enters), which the steps update on
the device, so overlap scheduling keeps running; multi-token bad words need the last output tokens
on the host, so a batch with one takes the ordinary path. Rows that adjust logits never verify
drafts. A prompt's n samples (`add_samples`) share one prefill: a prefill-only request computes all
but the prompt's last token, then each sample starts from a copy of its pages (`_fork`).

Structured outputs (kimi_jax.engine.structured): a constrained request holds a grammar matcher, advanced
on the host by every appended token; a step with a constrained row fills each row's packed token mask
from the matchers and passes it to the step (its own compiled program), so such rows take the ordinary
path (no overlap, no drafts). In its last CLOSE_WINDOW tokens a constrained row narrows its mask to a
greedy close once the close needs the tokens left, so its output ends complete within max_tokens.

Data parallelism (engine.dp > 1): the batch's rows are split over the dp ranks in contiguous blocks
(row b on rank b // (B / dp)) and so is the page pool (`Engine.init_pages`: rank k holds the k-th of dp
equal partitions). A request is placed on one rank when admitted (the least loaded one with room:
at most ceil(max_num_seqs / dp) requests and the pages of its first chunk), takes its pages from that
rank's free list and always runs in a row of that rank's block; its block table holds page ids LOCAL
to the partition, [0, num_pages / dp) (with dp = 1 these are the global ids). Preemption frees pages
of the same rank only (victims are requests of that rank); a preempted request may be re-admitted on
any rank. A sequence can then hold at most num_pages / dp pages.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from kimi_jax.engine import penalties
from kimi_jax.engine.page_pool import PagePool, chain_hashes
from kimi_jax.engine.requests import (Request, logprob_dict, n_logprobs, prompt_entries_left,  # noqa: F401
                                      prompt_targets, score_prompt, validate_prompt)
from kimi_jax.engine.shapes import bucket, table_bucket
from kimi_jax.engine.steps import Engine
from kimi_jax.engine.sampling import SamplingArrays, SamplingParams, key_data_for_seed
from kimi_jax.engine.sampling import sample_mode as sample_mode_of
from kimi_jax.engine.speculative import SpeculativeConfig
from kimi_jax.engine.validation import RequestError, check_request  # noqa: F401


# A constrained request with at most this many tokens left checks each step whether closing its output
# (kimi_jax.engine.structured.StructuredBackend.bitmask_closing) must begin, so it ends complete
# within max_tokens.
CLOSE_WINDOW = 96


@dataclasses.dataclass
class _InFlight:
    """A decode step dispatched and not yet read (overlap scheduling): its rows in batch order, its
    device outputs, and what the next step of the same rows reuses."""
    rows: list[Request]
    slots: list[int]                      # each row's batch row (data parallelism: in its rank's block)
    out: tuple
    sp: SamplingArrays
    sample_mode: str
    n_logprobs: Optional[int]


class BatchEngine:
    def __init__(self, engine: Engine, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_model_len: int, cache_dtype, prefill_chunk: int = 256, max_prefill_tokens: int = 2048,
                 tokenizer=None, eos_ids=(), speculative: Optional[SpeculativeConfig] = None,
                 overlap: bool = False, enable_prefix_caching: bool = False, structured=None,
                 max_logprobs: Optional[int] = None):
        """structured: a kimi_jax.engine.structured.StructuredBackend for requests with
        structured_outputs (one is made from the tokenizer when needed and not given)."""
        self.engine, self.tokenizer = engine, tokenizer
        self.structured = structured
        self.page_size, self.max_num_seqs, self.max_model_len = page_size, max_num_seqs, max_model_len
        self.prefill_chunk, self.max_prefill_tokens = prefill_chunk, max_prefill_tokens
        self.max_logprobs = max_logprobs
        self.eos_ids = frozenset(eos_ids)
        # data parallelism: equal page partitions per rank (module docstring); spare pages are dropped
        self.dp = getattr(engine, "dp", 1)
        if num_pages < self.dp:
            raise ValueError(f"num_pages={num_pages} gives no page to some of the {self.dp} data-parallel ranks")
        num_pages -= num_pages % self.dp
        self.slots_per_rank = -(-max_num_seqs // self.dp)
        self.pool = PagePool(num_pages, self.dp, caching=enable_prefix_caching)
        self.pages = engine.init_pages(num_pages, page_size, cache_dtype)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.spec = speculative
        self.drafter = speculative.drafter() if speculative else None
        # overlap scheduling (module docstring); drafts need the tokens on the host, so not with speculation
        self.overlap = bool(overlap) and speculative is None
        self._inflight: Optional[_InFlight] = None
        # the occurrence pool (penalties), made when a request first needs it, and its free slots
        self.occ = None
        self._free_slots: collections.deque = collections.deque()
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "preemptions": 0,
                      "drafted": 0, "accepted": 0, "prefill_passes": 0, "decode_passes": 0, "verify_passes": 0,
                      "cost_calibrations": 0, "overlapped_steps": 0,
                      # prefix caching, in tokens as vLLM counts them: asked for at admission, found cached
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                     prompt: Optional[str] = None) -> Request:
        """Validate and build a request; RequestError names what is wrong."""
        prompt_ids = check_request(prompt_ids, params, vocab_size=self.engine.cfg.vocab_size,
                                   max_model_len=self.max_model_len, max_logprobs=self.max_logprobs)
        if -(-len(prompt_ids) // self.page_size) + 1 > self.pool.per_part:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit in the cache "
                               f"({self.pool.per_part} pages of {self.page_size} tokens"
                               + (f" per data-parallel rank)" if self.dp > 1 else ")"))
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self.eos_ids
        max_new = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids))
        r = Request(request_id, prompt, [int(t) for t in prompt_ids], params, key_data_for_seed(seed),
                    frozenset(stop), max_new)
        r.adjust = self._row_adjust(params, stop)
        if params.prompt_logprobs is not None:
            r.prompt_logprobs = [None]
        if params.structured_outputs is not None:
            r.structured = self._matcher(params, max_new)
        return r

    def _matcher(self, params: SamplingParams, budget: Optional[int] = None):
        """The grammar state of a request with structured_outputs (RequestError when it cannot compile)."""
        from kimi_jax.engine.structured import StructuredBackend, StructuredOutputError
        try:
            if self.structured is None:
                self.structured = StructuredBackend(self.tokenizer, self.engine.cfg.vocab_size)
            return self.structured.matcher(params.structured_outputs, budget)
        except StructuredOutputError as e:
            raise RequestError(str(e)) from None

    def _row_adjust(self, params: SamplingParams, stop) -> Optional[penalties.RowAdjust]:
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        words = []
        if params.bad_words:
            if self.tokenizer is None or not hasattr(self.tokenizer, "encode"):
                raise RequestError("bad_words needs a tokenizer; this model has none")
            words = penalties.bad_words_token_ids(params.bad_words, self.tokenizer)
            if any(t >= vocab for w in words for t in w):
                raise RequestError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab})")
        return penalties.row_adjust(params, stop, words)

    def make_samples(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                     prompt: Optional[str] = None) -> list[Request]:
        """The params.num_samples requests of one prompt (n, or best_of), sample i with its own random
        stream (the seed folded with i: distinct and reproducible) and request id f"{i}_{request_id}"
        (one sample: the request itself, with the seed's own stream). Queue them with `add_samples`."""
        k = params.num_samples
        if k == 1:
            return [self.make_request(request_id, prompt_ids, params, seed, prompt)]
        reqs = [self.make_request(f"{i}_{request_id}", prompt_ids, params, seed, prompt) for i in range(k)]
        for i, r in enumerate(reqs):
            r.key, r.sample_index, r.group_id = key_data_for_seed(seed, i), i, request_id
        return reqs

    def add_samples(self, reqs: list[Request]) -> None:
        """Queue one prompt's samples (`make_samples`): its prompt but the last token is prefilled once
        by a prefill-only request, whose cache pages every sample then starts from (copied); each
        sample feeds the last prompt token itself and samples its first token from its own stream. A
        sample that finds no free slot or pages then prefills alone (same tokens)."""
        if len(reqs) == 1 or len(reqs[0].prompt_ids) < 2:
            for r in reqs:
                self.add(r)
            return
        first = reqs[0]
        parent = Request(f"prefill_{first.group_id}", first.prompt, first.prompt_ids[:-1],
                         SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=first.params.prompt_logprobs),
                         first.key, frozenset(), 0,
                         prefill_only=True, forks=list(reqs), tail=first.prompt_ids[-1:],
                         prompt_logprobs=[None] if first.prompt_logprobs is not None else None)
        now = time.time()
        for r in reqs:
            r.arrival_time = r.arrival_time or now
        self.add(parent)

    def add(self, req: Request) -> None:
        if req.arrival_time is None:
            req.arrival_time = time.time()
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Optional[Request]:
        """Stop a waiting or running request now (finish_reason "abort") and free its pages; returns
        it, or None when no unfinished request has that id. Safe while a decode step that includes it
        is in flight (overlap scheduling): later steps that could reuse its pages are ordered after that
        step on the device, and the step's token for it is discarded when read (its finish_reason is
        set). Call between steps, from the thread that steps."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                break
        else:
            r = next((q for q in self.running if q.request_id == request_id and q.finish_reason is None), None)
            if r is None:
                return None
        r.finish_reason, r.finished_time = "abort", time.time()
        self._release(r)
        return r

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit, run one prefill step and one decode step; return the requests that finished.
        With overlap scheduling a decode step may still be in flight on return (its tokens are read by
        the next call); while the batch stays the same a call dispatches the next decode step and
        reads the previous one."""
        finished: list[Request] = []
        if self._inflight is not None:
            if self._overlap_continues():
                return self._overlap_advance()
            finished += self.drain()
        self._admit()
        budget, rows, filling = self.max_prefill_tokens, [], set()
        for r in [r for r in self.running if r.pending > 1 or (r.pending == 1 and prompt_entries_left(r))]:
            if (self.pool.caching and r.prompt_logprobs is None
                    and r.num_computed == r.num_registered * self.page_size == len(r.pages) * self.page_size):
                # prefix caching: until a request computes anything it takes its cached prefix, when its
                # first chunk is scheduled (pages cached since its admission count); one whose next page
                # another row of this step is computing waits a step and then reads that page instead
                # (not a request scoring its prompt: cached positions have no logits)
                self._take_cached_prefix(r)
                nxt = r.num_computed // self.page_size
                if nxt < len(r.page_hashes) and r.page_hashes[nxt] in filling:
                    continue
                if r.pending <= 1 and not prompt_entries_left(r):
                    continue
            n = min(r.pending, self.prefill_chunk, budget)
            if n <= 0:
                break
            if r in self.running and self._ensure_pages(r, r.num_computed + n, [q for q, _ in rows]):
                rows.append((r, n))
                budget -= n
                if self.pool.caching:
                    chain_hashes(r.tokens, self.page_size, r.page_hashes)
                    filling.update(r.page_hashes[r.num_computed // self.page_size:(r.num_computed + n) // self.page_size])
            elif r in self.running and self._alone(r):
                finished.append(self._stop_at_pool_limit(r))
        if rows:
            finished += self._run(rows)
        ready = []
        for r in [r for r in self.running if r.pending == 1 and r.finish_reason is None]:
            if r in self.running and self._ensure_pages(r, r.num_computed + 1, ready):
                ready.append(r)
            elif r in self.running and self._alone(r):
                finished.append(self._stop_at_pool_limit(r))
        drafts = {id(r): self._drafts(r) for r in ready}
        # any drafts worth it: every ready row goes through ONE verification pass over the weights (rows
        # without drafts verify nothing and just decode), never a decode pass and a verify pass
        speculate = any(drafts.values()) and self._verify_pays(ready, drafts)
        rows, plain = [], []            # plain: decode rows outside verification (rows wanting logprobs)
        for r in ready:
            d = drafts[id(r)]
            if not speculate:
                r.spec.offer_shadow(len(r.output_ids), d)     # scored once its tokens are known
                plain.append((r, 1))
            elif r.params.logprobs is not None or r.adjust is not None or r.structured is not None:
                plain.append((r, 1))
            else:
                if d and not self._ensure_pages(r, r.num_computed + 1 + len(d), ready):
                    d = []
                rows.append((r, d))
        # multi-token bad words are banned by the last output tokens, and a constrained row's mask needs
        # its previous token: the host must have read them
        if plain and self.overlap and not any((r.adjust is not None and r.adjust.bad_words) or r.structured is not None
                                              for r, _ in plain):
            self._dispatch_decode([r for r, _ in plain])
        elif plain:
            finished += self._run(plain)
        if rows:
            finished += self._run_verify(rows)
        for r in finished:
            self._release(r)
        return finished

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            rank = self._rank_for(self.waiting[0])
            if rank is None:
                break
            r = self.waiting.popleft()
            r.rank = rank
            self._enter(r)

    def _enter(self, r: Request) -> None:
        """r joins the running set; with penalties it takes an occurrence slot, written from its prompt
        and output so far."""
        self.running.append(r)
        if r.adjust is None or not r.adjust.has_penalties:
            return
        if self.occ is None:
            self.occ = self.engine.new_occurrences(self.max_num_seqs)
            self._free_slots = collections.deque(range(self.max_num_seqs))
        r.pen_slot = self._free_slots.popleft()
        row = penalties.occurrence_row(self.engine.cfg.vocab_size, r.prompt_ids, r.output_ids)
        self.engine.set_occurrences(self.occ, r.pen_slot, row)

    def _leave(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.pen_slot >= 0:
            self._free_slots.append(r.pen_slot)
            r.pen_slot = -1

    def _cacheable_hashes(self, r: Request) -> list[bytes]:
        """Hashes of the pages of r's tokens that a cache hit may cover: full pages before its last
        token (that token is always computed, for its logits, in a page of its own)."""
        chain_hashes(r.tokens, self.page_size, r.page_hashes)
        return r.page_hashes[:(len(r.tokens) - 1) // self.page_size]

    def _take_cached_prefix(self, r: Request) -> None:
        """Extend r's pages, which hold only cached pages, by the cached pages that follow them."""
        if not r.cache_queried:
            r.cache_queried = True
            self.stats["prefix_cache_queries"] += len(r.tokens)
        more = self.pool.acquire(self._cacheable_hashes(r)[len(r.pages):], r.rank)
        r.pages += more
        r.num_computed = r.num_registered = len(r.pages)
        r.num_computed *= self.page_size
        self.stats["prefix_cache_hits"] += len(more) * self.page_size
        if r.num_preemptions == 0:
            r.num_cached_tokens = r.num_computed

    def _register_pages(self, r: Request) -> None:
        """Cache r's pages that its computed tokens have filled (prefix caching)."""
        full = min(r.num_computed // self.page_size, len(r.pages))
        if not self.pool.caching or full <= r.num_registered:
            return
        hashes = chain_hashes(r.tokens, self.page_size, r.page_hashes)
        self.pool.register(r.pages[r.num_registered:full], hashes[r.num_registered:full], r.rank)
        r.num_registered = full

    def _rank_for(self, r: Request) -> Optional[int]:
        """The data-parallel rank a waiting request would join: among those with a free slot and the
        pages of its first chunk, the one running fewest requests (then: most free pages); None if none."""
        first = -(-min(r.pending, self.prefill_chunk) // self.page_size)
        load = collections.Counter(q.rank for q in self.running)
        fits = [k for k in range(self.dp) if load[k] < self.slots_per_rank and first <= self.pool.free_in(k)]
        if self.pool.caching and self.dp > 1 and r.num_computed == 0 and len(fits) > 1:
            hashes = self._cacheable_hashes(r)
            cached = {k: self.pool.peek(hashes, k) for k in fits}
            return min(fits, key=lambda k: (-cached[k], load[k], -self.pool.free_in(k), k))
        return min(fits, key=lambda k: (load[k], -self.pool.free_in(k), k), default=None)

    def _ensure_pages(self, r: Request, upto: int, protected=()) -> bool:
        """Pages for positions [0, upto); preempt the newest other request (never one already in this
        step's batch) if the pool is dry. Pages and victims come from r's data-parallel rank."""
        need = self._pages_short(r, upto)
        while need > 0:
            got = self.pool.take(need, r.rank)
            if got is not None:
                r.pages += got
                return True
            victims = [v for v in self.running if v is not r and v not in protected and v.rank == r.rank]
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _alone(self, r: Request) -> bool:
        """No other running request holds pages of r's rank: if r cannot get a page now, none will
        ever be freed for it."""
        return not any(v is not r and v.rank == r.rank for v in self.running)

    def _stop_at_pool_limit(self, r: Request) -> Request:
        """Finish r where it is ("length"): it has outgrown the page pool of its rank."""
        r.finish_reason = "length"
        r.finished_time = time.time()
        return r

    def _pages_short(self, r: Request, upto: int) -> int:
        """Pages r lacks to hold positions [0, upto) (<= 0: none)."""
        return -(-upto // self.page_size) - len(r.pages)

    def _preempt(self, r: Request) -> None:
        self._leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_computed, r.num_registered, r.cache_queried = [], 0, 0, False
        r.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(r)

    def _release(self, r: Request) -> None:
        self._leave(r)
        self.pool.give(r.pages, r.rank)
        r.pages, r.num_registered = [], 0

    def _slots(self, reqs: list[Request]) -> tuple[int, list[int]]:
        """(padded batch B, each request's batch row): in order, each in its data-parallel rank's
        block of B / dp rows (with dp = 1: rows 0, 1, ...)."""
        count = collections.Counter(r.rank for r in reqs)
        B = self.engine.batch_size(self.dp * max(count.values()))
        per, seen, slots = B // self.dp, collections.Counter(), []
        for r in reqs:
            slots.append(r.rank * per + seen[r.rank])
            seen[r.rank] += 1
        return B, slots

    def _inputs(self, feeds: list[tuple[Request, list[int]]], T: int):
        """Padded step inputs for rows that feed these tokens at their next positions: (tokens [B, T],
        positions [B, T] (-1: padding), block table [B, P], per-row steps [B], sampling arrays, each
        feed's batch row)."""
        B, slots = self._slots([r for r, _ in feeds])
        P = table_bucket(max(len(r.pages) for r, _ in feeds), self.page_size)
        tokens = np.zeros((B, T), np.int32)
        positions = np.full((B, T), -1, np.int32)
        table = np.zeros((B, P), np.int32)
        steps = np.zeros((B,), np.int32)
        keys = np.zeros((B, 2), np.uint32)
        params = [SamplingParams(temperature=0.0)] * B
        adjust = [None] * B
        for b, (r, feed) in zip(slots, feeds):
            tokens[b, :len(feed)] = feed
            positions[b, :len(feed)] = np.arange(r.num_computed, r.num_computed + len(feed))
            table[b, :len(r.pages)] = r.pages
            steps[b], keys[b], params[b] = len(r.output_ids), r.key, r.params
            if r.adjust is not None:        # (adjustments, bans by the output so far, slot, counts)
                adjust[b] = (r.adjust, penalties.banned_now(r.adjust.bad_words, r.output_ids), r.pen_slot,
                             int(r.num_computed + len(feed) == len(r.tokens)))
        adjust = (penalties.build(adjust, self.occ.pad_slot if self.occ is not None else 0)
                  if any(a is not None for a in adjust) else None)
        return tokens, positions, table, steps, SamplingArrays.build(params, None, keys=keys, adjust=adjust), slots

    def _run(self, rows: list[tuple[Request, int]]) -> list[Request]:
        T = 1 if all(n == 1 for _, n in rows) else bucket(max(n for _, n in rows), 16)
        tokens, positions, table, steps, sp, slots = self._inputs(
            [(r, r.tokens[r.num_computed:r.num_computed + n]) for r, n in rows], T)
        last = np.zeros((tokens.shape[0],), np.int32)
        last[slots] = [n - 1 for _, n in rows]
        n_lp = n_logprobs(r for r, _ in rows)
        n_plp, targets = prompt_targets(rows, slots, tokens.shape)
        self.pages, out = self.engine.paged_step(self.pages, tokens, positions, table, last, sp, steps, n_lp,
                                                 occ=self.occ, n_prompt_logprobs=n_plp, targets_BT=targets,
                                                 mask_Bw=self._mask(rows, slots, tokens.shape[0]))
        self.stats["steps"] += 1
        self.stats["decode_passes" if T == 1 else "prefill_passes"] += 1
        return self._book(rows, out, slots)

    def _mask(self, rows: list[tuple[Request, int]], slots: list[int], B: int) -> Optional[np.ndarray]:
        """The step's packed token bitmask [B, ceil(V / 32)] when some row is constrained (None: none
        is); a row near the end of its budget narrows its mask to a greedy close."""
        if not any(r.structured is not None for r, _ in rows):
            return None
        matchers = [None] * B
        for b, (r, _) in zip(slots, rows):
            matchers[b] = r.structured
        mask = self.structured.fill_bitmask(matchers)
        for b, (r, _) in zip(slots, rows):
            left = r.max_new - len(r.output_ids)
            if r.structured is not None and left <= CLOSE_WINDOW:
                self.structured.bitmask_closing(mask[b], r.structured, left)
        return mask

    def _fork(self, p: Request) -> None:
        """A samples group's prefill is done: each sample starts from copies of its pages (positions
        up to the prompt's last token), or, with no free slot or pages, waits to prefill alone."""
        self._leave(p)
        src, dst, late = [], [], []
        for c in p.forks:
            if p.prompt_logprobs is not None:
                c.prompt_logprobs = list(p.prompt_logprobs)
            load = sum(q.rank == p.rank for q in self.running)
            got = (self.pool.take(len(p.pages), p.rank)
                   if len(self.running) < self.max_num_seqs and load < self.slots_per_rank else None)
            if got is None:
                late.append(c)
                continue
            src += p.pages
            dst += got
            c.pages, c.num_computed, c.rank = got, p.num_computed, p.rank
            self._enter(c)
        if src:
            self.pages = self.engine.copy_pages(self.pages, src, dst, p.rank)
        for c in reversed(late):
            self.waiting.appendleft(c)
        self.pool.give(p.pages, p.rank)
        p.pages = []

    def _book(self, rows: list[tuple[Request, int]], out, slots: list[int]) -> list[Request]:
        """Bookkeeping of a step's host outputs: n tokens of each row are now cached; rows done with
        their prompt get the sampled token. Rows that finished before (overlap: a step ran past their
        end) are skipped, their token discarded. slots: each row's batch row."""
        finished = []
        for b, (r, n) in zip(slots, rows):
            if r.finish_reason is not None:
                continue
            prompt_left = len(r.prompt_ids) - r.num_computed
            self.stats["prompt_tokens"] += max(0, min(n, prompt_left))
            if out.prompt_logprob is not None and prompt_entries_left(r):
                score_prompt(r, out, b, r.num_computed, n)
            r.num_computed += n
            self._register_pages(r)
            if r.pending > 0:      # a chunk in the middle of a prompt (or of a recompute): no token yet
                continue
            if r.prefill_only:
                self._fork(r)
                continue
            self._append(r, int(out.tokens[b]), out, b)
            if r.finish_reason is not None:
                finished.append(r)
        return finished

    # ---- overlap scheduling (module docstring) -------------------------------------------------
    def _dispatch_decode(self, rows: list[Request]) -> None:
        """Start a decode step for rows (pages ensured) without waiting for its tokens."""
        tokens, positions, table, steps, sp, slots = self._inputs([(r, [r.tokens[r.num_computed]]) for r in rows], 1)
        n_lp = n_logprobs(rows)
        mode = sample_mode_of(sp)
        self.pages, out = self.engine.decode_step_async(self.pages, tokens[:, 0], positions[:, 0], table, sp,
                                                        steps, n_lp, mode, occ=self.occ)
        self.stats["steps"] += 1
        self.stats["decode_passes"] += 1
        self._inflight = _InFlight(rows, slots, out, sp, mode, n_lp)

    def _overlap_continues(self) -> bool:
        """Whether the next decode step can run on the same rows before the step in flight is read:
        none of them finished, no other request is running or could be admitted, some row is not
        certain to end with the step in flight, and every page the next step needs is free (no
        preemption)."""
        rows = self._inflight.rows
        if len(rows) != len(self.running) or any(r.finish_reason is not None for r in rows):
            return False
        if {id(r) for r in rows} != {id(r) for r in self.running} or self._admissible():
            return False
        live = [r for r in rows if not self._ends_in_flight(r)]
        need = collections.Counter()
        for r in live:
            need[r.rank] += max(0, self._pages_short(r, r.num_computed + 2))
        return bool(live) and all(n <= self.pool.free_in(k) for k, n in need.items())

    def _ends_in_flight(self, r: Request) -> bool:
        """The step in flight gives r its last token (max_tokens / max_model_len): known on the host."""
        return len(r.output_ids) + 1 >= r.max_new

    def _admissible(self) -> bool:
        """`_admit` would admit a request now."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        return self._rank_for(self.waiting[0]) is not None

    def _overlap_advance(self) -> list[Request]:
        """Dispatch the next decode step of the rows in flight, fed their tokens on the device; then
        read the step in flight and do its bookkeeping. Rows ending with the step in flight are
        padding in the new one."""
        f = self._inflight
        B = f.out["tokens"].shape[0]
        positions = np.full((B,), -1, np.int32)
        steps = np.zeros((B,), np.int32)
        live = []
        for b, r in zip(f.slots, f.rows):
            if self._ends_in_flight(r):
                continue
            need = self._pages_short(r, r.num_computed + 2)
            if need > 0:
                r.pages += self.pool.take(need, r.rank)   # checked free by _overlap_continues
            # the step in flight feeds position num_computed and samples output number len(output_ids)
            positions[b], steps[b] = r.num_computed + 1, len(r.output_ids) + 1
            live.append((b, r))
        table = np.zeros((B, table_bucket(max(len(r.pages) for _, r in live), self.page_size)), np.int32)
        for b, r in live:
            table[b, :len(r.pages)] = r.pages
        self.pages, out = self.engine.decode_step_async(self.pages, f.out["tokens"], positions, table, f.sp, steps,
                                                        f.n_logprobs, f.sample_mode, occ=self.occ)
        self.stats["steps"] += 1
        self.stats["decode_passes"] += 1
        self.stats["overlapped_steps"] += 1
        self._inflight = dataclasses.replace(f, out=out)
        return self._read(f)

    def _read(self, f: _InFlight) -> list[Request]:
        """Wait for a dispatched decode step and do its bookkeeping; release and return the requests
        that finished with it."""
        finished = self._book([(r, 1) for r in f.rows], self.engine.fetch(f.out), f.slots)
        for r in finished:
            self._release(r)
        return finished

    def drain(self) -> list[Request]:
        """Finish the bookkeeping of a decode step still in flight (overlap scheduling); returns the
        requests that finished with it. `step` calls it before the batch changes, `run` before
        returning."""
        f, self._inflight = self._inflight, None
        return [] if f is None else self._read(f)

    def _verify_pays(self, ready: list[Request], drafts: dict) -> bool:
        """Verify when it is expected to yield more tokens per second than a decode pass:
        (n + A) / t_verify > n / t_decode, i.e. A > n (t_verify / t_decode - 1), for n ready rows and A
        the expected accepted drafts (each request's acceptance estimate, real and shadow attempts).
        The pass costs are measured once per engine and batch / page-table bucket (`_pass_costs`), so
        the decision does not depend on per-step timings: on a memory-bound GPU t_verify ~ t_decode
        and little acceptance pays; on a compute-bound CPU t_verify ~ (k + 1) t_decode and few do."""
        if not self.spec.adaptive:
            return True
        t_decode, t_verify = self._pass_costs(ready)
        gain = sum(r.spec.expected_accepted(len(drafts[id(r)])) for r in ready)
        return gain > len(ready) * (t_verify / t_decode - 1.0)

    def _pass_costs(self, ready: list[Request]) -> tuple[float, float]:
        """(decode pass seconds, verification pass seconds) at this step's batch and page-table bucket,
        measured the first time the engine meets the bucket (compiling both programs first) and kept
        on the Engine, so later runs (a benchmark's timed run) take the same decisions and compile
        nothing. Measured on the step's own rows: the decode pass writes the latents the real pass
        then writes again; the verification pass feeds only the last token (drafts are padding), so
        nothing is written beyond the cache the rows already have."""
        key = (self._slots(ready)[0], table_bucket(max(len(r.pages) for r in ready), self.page_size))
        if key not in self.engine.pass_costs:
            self.engine.pass_costs[key] = self._measure_passes(ready)
            self.stats["cost_calibrations"] += 1
        return self.engine.pass_costs[key]

    def _measure_passes(self, ready: list[Request], reps: int = 5) -> tuple[float, float]:
        feeds = [(r, [r.tokens[-1]]) for r in ready]
        dec = self._inputs(feeds, 1)
        ver = self._inputs(feeds, self.spec.num_speculative_tokens + 1)
        last = np.zeros((dec[0].shape[0],), np.int32)
        n_draft = np.zeros((ver[0].shape[0],), np.int32)

        # timing passes: without the rows' logits adjustments (they would count occurrences)
        dec = (*dec[:4], dataclasses.replace(dec[4], adjust=None), dec[5])

        def decode():
            tokens, positions, table, steps, sp, _ = dec
            self.pages, _ = self.engine.paged_step(self.pages, tokens, positions, table, last, sp, steps, None)

        def verify():
            tokens, positions, table, steps, sp, _ = ver
            self.pages, _, _ = self.engine.verify_step(self.pages, tokens, positions, table, n_draft, sp, steps)

        decode(), verify()                    # compile (both return host arrays: each call blocks)
        times = {decode: [], verify: []}
        for _ in range(reps):
            for f in (decode, verify):
                t0 = time.perf_counter()
                f()
                times[f].append(time.perf_counter() - t0)
        costs = np.asarray([np.median(times[decode]), np.median(times[verify])], np.float64)
        import jax
        if jax.process_count() > 1:           # every process must take the same decisions
            from jax.experimental import multihost_utils
            costs = np.asarray(multihost_utils.broadcast_one_to_all(costs))
        return float(costs[0]), float(costs[1])

    def _drafts(self, r: Request) -> list[int]:
        """Draft tokens for a decode-ready request (none without speculation, with logprobs, or near
        the end of its budget). Also scores the request's pending shadow drafts."""
        if (self.drafter is None or r.params.logprobs is not None or r.adjust is not None or r.prefill_only
                or r.structured is not None):
            return []
        st = r.spec
        if st.index is None:
            st.index = self.drafter.index()
        st.index.extend(r.prompt_ids, r.output_ids)
        st.check_shadow(r.output_ids)
        room = min(r.max_new - len(r.output_ids), self.max_model_len - len(r.tokens)) - 1
        k = min(self.spec.num_speculative_tokens, room)
        return st.index.propose(k) if k > 0 else []

    def _run_verify(self, rows: list[tuple[Request, list[int]]]) -> list[Request]:
        tokens, positions, table, steps, sp, slots = self._inputs(
            [(r, [r.tokens[-1], *drafts]) for r, drafts in rows], self.spec.num_speculative_tokens + 1)
        n_draft = np.zeros((tokens.shape[0],), np.int32)
        n_draft[slots] = [len(d) for _, d in rows]
        self.pages, n_acc, nxt = self.engine.verify_step(self.pages, tokens, positions, table, n_draft, sp, steps)
        self.stats["steps"] += 1
        self.stats["verify_passes"] += 1
        finished = []
        for b, (r, drafts) in zip(slots, rows):
            a = int(n_acc[b])
            if drafts:
                r.spec.record(len(drafts), a)
            self.stats["drafted"] += len(drafts)
            self.stats["accepted"] += a
            r.num_computed += a + 1          # the last token and the accepted drafts are now cached
            self._register_pages(r)
            for t in [*drafts[:a], int(nxt[b])]:
                self._append(r, t)
                if r.finish_reason is not None:
                    finished.append(r)
                    break
        return finished

    def _append(self, r: Request, t: int, out=None, b: int = 0) -> None:
        r.output_ids.append(t)
        now = time.time()
        if r.first_token_time is None:
            r.first_token_time = now
        self.stats["generated_tokens"] += 1
        if out is not None and out.logprob is not None:
            r.cumulative_logprob += float(out.logprob[b])
            if r.params.logprobs is not None:
                k = r.params.logprobs
                r.logprobs.append(logprob_dict(t, out.logprob[b], out.rank[b], out.top_ids[b][:k],
                                                out.top_vals[b][:k]))
        if r.structured is not None and t not in r.stop_ids:
            r.structured.accept(t)
        if t in r.stop_ids:
            r.finish_reason, r.stop_reason = "stop", t
        elif r.structured is not None and r.structured.is_finished():
            r.finish_reason = "stop"        # the grammar is complete (only a stop token could follow)
        elif r.structured is not None and r.structured.is_error():
            r.finish_reason = "length"      # broken: the output is not a complete one
        elif r.params.stop_strings and self.tokenizer is not None and self._hit_stop(r):
            r.finish_reason = "stop"
        elif len(r.output_ids) >= r.max_new:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            r.finished_time = now

    def _hit_stop(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        hits = [(text.find(s), s) for s in r.params.stop_strings if s in text]
        if not hits:
            return False
        k, s = min(hits)
        r.text = text[: k + len(s)] if r.params.include_stop_str_in_output else text[:k]
        r.stop_reason = s
        return True

    def _unblock(self) -> Request:
        """Finish the first running (else waiting) request at the pool's limit and free its pages."""
        r = self.running[0] if self.running else self.waiting.popleft()
        self._release(self._stop_at_pool_limit(r))
        return r

    # ---- driving ------------------------------------------------------------------------------
    def run(self, on_finish: Optional[Callable[[Request], None]] = None, progress: bool = False,
            feed: Optional[Callable[[], bool]] = None) -> None:
        """Step until every request is done. `feed()` is called whenever slots are free so a caller
        can add requests lazily (returns False when it has no more)."""
        bar, t0 = None, time.perf_counter()
        if progress:
            from tqdm import tqdm
            bar = tqdm(desc="requests", unit="req", total=None)
        more = feed is not None
        idle = 0                  # consecutive steps that ran no pass and finished nothing
        while True:
            if more and len(self.waiting) < self.max_num_seqs:
                more = feed()
            if not self.has_unfinished():
                if not more:
                    break
                continue
            steps0 = self.stats["steps"]
            done = self.step()
            idle = 0 if done or self.stats["steps"] != steps0 or self._inflight is not None else idle + 1
            if idle >= 3:         # no request can make progress: the first one ends where it is
                done = [self._unblock()]
                idle = 0
            for r in done:
                if on_finish is not None:
                    on_finish(r)
                if bar is not None:
                    bar.update(1)
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(tok_s=f"{self.stats['generated_tokens'] / dt:.1f}",
                                    running=len(self.running))
        for r in self.drain():      # a step past every request's end: nothing left to report
            if on_finish is not None:
                on_finish(r)
        if bar is not None:
            bar.close()
