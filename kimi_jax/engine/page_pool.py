"""The paged latent cache's page pool, with automatic prefix caching.

Pages are handed out per data-parallel partition (`parts` equal partitions of num_pages; page ids
are local to their partition, [0, num_pages / parts)). Every page a request holds is
reference-counted.

Prefix caching (`caching=True`): a FULL page of a sequence is identified by a chained hash of its
tokens, h_i = H(h_{i-1}, tokens[i * page : (i + 1) * page]) (SHA-256: a page's content is a function
of every token before it and their positions, which the chain fixes; a cryptographic hash so that no
request can be made to collide with another's pages). Once a request has computed a page's tokens
the page is registered under its hash; when the request ends (or is preempted) the page is not freed
but kept, evictable, until the pool needs room, and then evicted least recently used. A request that
starts with the same tokens takes the cached pages (reference count + 1) and computes only the rest.
A page is written only while it is being filled, by the request that fills it; a registered page is
full and never written again, so sharing it is safe. Pages with no hash go straight back to the free
list. Without caching the pool is a plain free list per partition.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Callable, Optional, Sequence

import numpy as np


def chain_hashes(tokens: Sequence[int], page_size: int, known: list[bytes]) -> list[bytes]:
    """Hashes of every full page of `tokens`, extending `known` (the hashes of the first len(known)
    pages, computed earlier for the same tokens) in place; returns it."""
    full = len(tokens) // page_size
    for i in range(len(known), full):
        h = hashlib.sha256(known[i - 1] if i else b"kimi_jax/page")
        h.update(np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes())
        known.append(h.digest())
    return known


class PagePool:
    """Free lists of cache pages, one per data-parallel partition, with reference counts and (with
    `caching`) a table of cached full pages per partition (module docstring).

    on_reclaim(part, pages): called with pages whose content is given up (freed without a hash, or
    evicted) before anyone can take them again (tests poison them)."""

    def __init__(self, num_pages: int, parts: int = 1, *, caching: bool = False,
                 on_reclaim: Optional[Callable[[int, list[int]], None]] = None):
        if num_pages % parts:
            raise ValueError(f"num_pages={num_pages} is not a multiple of {parts} partitions")
        self.num_pages, self.parts, self.per_part = num_pages, parts, num_pages // parts
        self.caching = caching
        self.on_reclaim = on_reclaim
        self._free = [collections.deque(range(self.per_part)) for _ in range(parts)]
        self._refs = [collections.Counter() for _ in range(parts)]
        # caching: hash -> page, page -> hash, the evictable pages (reference count 0) in LRU order
        self._table: list[dict[bytes, int]] = [{} for _ in range(parts)]
        self._hash_of: list[dict[int, bytes]] = [{} for _ in range(parts)]
        self._lru: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(parts)
        ]
        self.evictions = 0

    @property
    def free(self) -> list[int]:
        """Every page no request holds, of all partitions (local ids; cached evictable ones too)."""
        return [p for k in range(self.parts) for p in (*self._free[k], *self._lru[k])]

    @property
    def num_free(self) -> int:
        """Pages no request holds (free and evictable), over all partitions."""
        return sum(self.free_in(k) for k in range(self.parts))

    def free_in(self, part: int) -> int:
        """Pages a `take` on this partition can hand out (free and evictable)."""
        return len(self._free[part]) + len(self._lru[part])

    def cached_in(self, part: int) -> int:
        """Evictable cached pages of a partition."""
        return len(self._lru[part])

    def take(self, n: int, part: int = 0) -> Optional[list[int]]:
        """n pages for a request (reference count 1): free ones first, then the least recently used
        evictable ones; None (and nothing taken) if there are not n."""
        if n > self.free_in(part):
            return None
        free, lru, got, evicted = self._free[part], self._lru[part], [], []
        for _ in range(n):
            if free:
                p = free.popleft()
            else:
                p, _ = lru.popitem(last=False)
                del self._table[part][self._hash_of[part].pop(p)]
                evicted.append(p)
            self._refs[part][p] = 1
            got.append(p)
        if evicted:
            self.evictions += len(evicted)
            if self.on_reclaim is not None:
                self.on_reclaim(part, evicted)
        return got

    def give(self, pages: list[int], part: int = 0) -> None:
        """A request lets go of its pages: each one no request holds any more goes back to the free
        list or, if it is cached, to the evictable end of the LRU order (most recent last)."""
        refs, freed = self._refs[part], []
        for p in pages:
            refs[p] -= 1
            if refs[p] > 0:
                continue
            del refs[p]
            if p in self._hash_of[part]:
                self._lru[part][p] = None
            else:
                freed.append(p)
        if freed and self.on_reclaim is not None:
            self.on_reclaim(part, freed)
        self._free[part].extend(freed)

    # ---- prefix caching -----------------------------------------------------------------------
    def peek(self, hashes: Sequence[bytes], part: int) -> int:
        """How many leading pages of these hashes are cached in a partition."""
        table, n = self._table[part], 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[bytes], part: int) -> list[int]:
        """Take the cached pages of the leading cached hashes (reference count + 1), in order."""
        if not self.caching:
            return []
        n = self.peek(hashes, part)
        table, lru, refs = self._table[part], self._lru[part], self._refs[part]
        pages = [table[h] for h in hashes[:n]]
        for p in pages:
            lru.pop(p, None)
            refs[p] += 1
        return pages

    def register(self, pages: Sequence[int], hashes: Sequence[bytes], part: int) -> None:
        """Cache a request's full pages under their hashes (pages[i] holds the tokens of hashes[i]);
        a hash already cached under another page keeps that one (this page stays private)."""
        if not self.caching:
            return
        table, hash_of = self._table[part], self._hash_of[part]
        for p, h in zip(pages, hashes):
            if p in hash_of or h in table:
                continue
            table[h] = p
            hash_of[p] = h

    def take_cached_prefix(self, r, page_size: int) -> int:
        """Extend request r's pages, which hold only cached pages, by the cached pages that follow
        them; returns the tokens found cached."""
        more = self.acquire(cacheable_hashes(r, page_size)[len(r.pages):], r.rank)
        r.pages += more
        r.num_computed = r.num_registered = len(r.pages)
        r.num_computed *= page_size
        if r.num_preemptions == 0:
            r.num_cached_tokens = r.num_computed
        return len(more) * page_size

    def register_filled(self, r, page_size: int) -> None:
        """Cache request r's pages that its computed tokens have filled (with caching)."""
        full = min(r.num_computed // page_size, len(r.pages))
        if not self.caching or full <= r.num_registered:
            return
        hashes = chain_hashes(r.tokens, page_size, r.page_hashes)
        self.register(r.pages[r.num_registered:full], hashes[r.num_registered:full], r.rank)
        r.num_registered = full


def cacheable_hashes(r, page_size: int) -> list[bytes]:
    """Hashes of the pages of request r's tokens that a cache hit may cover: full pages before its
    last token (that token is always computed, for its logits, in a page of its own)."""
    chain_hashes(r.tokens, page_size, r.page_hashes)
    return r.page_hashes[:(len(r.tokens) - 1) // page_size]
