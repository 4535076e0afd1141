"""Exact prefix caching over contiguous per-sequence caches: the agent turn prefills only what is new.

Token ids are hashed in blocks of ``block_tokens``: the hash of block ``i`` digests the hash of block
``i - 1`` and block ``i``'s tokens, so one hash names a whole prefix. When a sequence's prompt (and,
at its end, prompt + output) reaches a block boundary, the engine stores a *snapshot* of its cache
there, keyed by that boundary's chain hash. A new request walks its own chain and starts from a
copy of the longest stored prefix; at least one prompt token is always left to compute, since the
forward that samples the first token needs it.

What each family can serve (see ``SequenceCache.truncatable``):

- plain KV caches (Qwen3-MoE's ``ContiguousKVCache``, DeepSeek-V3's ``LatentKVCache``) are
  truncatable: a snapshot of ``n`` blocks also serves any shorter prefix of its chain, so a shared
  system prompt hits a snapshot taken further along another conversation;
- DeepSeek-V4's cache (sliding window, compressor rolling state, compressed entries) cannot be
  rewound: a snapshot serves exactly its own length. The scheduler ends a prefill chunk at the
  prompt's last block boundary and the runner marks the cache at every boundary it reaches, so the
  snapshot is taken where the state is.

A snapshot is never written (a hit copies it into a fresh cache), so any entry may be evicted at any
time: least recently used first, to stay under ``capacity_bytes``. A snapshot that borrows its state from a
cache that has moved on since (``SequenceCache.servable`` false: V4's borrowed snapshots,
:mod:`moetier.models.deepseek_v4_snapshot`) serves nothing and is dropped when met. A truncatable snapshot that extends
an older one on the same chain replaces it (the longer one serves every prefix the shorter one did).

Memory, by KV layout:

- contiguous: a snapshot is a copy of its own; its ``nbytes`` is what it costs, counted from insertion;
- paged (``space`` given, :mod:`moetier.models.paged_kv`): a snapshot shares its blocks with the
  sequence it came from, so it costs its state outside the pools (V4's windows and rolling tensors)
  plus the blocks no running sequence holds (the pools' *lent* blocks, counted once however many
  snapshots share them). That cost grows when a sequence sharing a snapshot's blocks is freed, so the
  engine calls :meth:`PrefixCache.trim` then. The cache is the space's reclaim hook: a pool with no
  free block for a running sequence evicts (:meth:`PrefixCache.reclaim`) least recently used
  snapshots that hold lent blocks of it before it grows. Taking a snapshot takes no block; only the
  copy-on-write of a partly filled block its sequence shares with it does, and that may evict the
  snapshot itself (the write then goes in place).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from moetier.errors import ConfigError
from moetier.models.base import SequenceCache
from moetier.models.paged_kv import KVBlockPool, PagedKVSpace, paged_holdings

__all__ = ["PrefixCache", "PrefixHit", "chain_hashes"]

_ROOT = b"moetier-prefix-v1"


def chain_hashes(tokens: Sequence[int], block_tokens: int, previous: Sequence[bytes] = ()) -> list[bytes]:
    """Chain hashes of every full block of ``tokens``; ``previous`` (hashes of the leading blocks, already
    computed) is extended rather than recomputed. A cryptographic digest, so two different prefixes
    never share an entry (which would leak one user's context into another's answer)."""
    hashes = list(previous)
    for start in range(len(hashes) * block_tokens, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(hashes[-1] if hashes else _ROOT, digest_size=16)
        digest.update(array("q", tokens[start : start + block_tokens]).tobytes())
        hashes.append(digest.digest())
    return hashes


@dataclass(eq=False)
class _Entry:
    hashes: tuple[bytes, ...]  # the chain of the stored prefix, one hash per block
    snapshot: SequenceCache
    nbytes: int  # paged KV: the bytes outside the pools (the blocks are counted by the pools)
    holdings: list[tuple[KVBlockPool, list[int], int]] = field(default_factory=list)  # paged KV: marked blocks

    @property
    def key(self) -> bytes:
        return self.hashes[-1]

    def servable(self) -> tuple[bytes, ...]:
        """The prefixes (by chain hash) this entry can start a sequence from."""
        return self.hashes if self.snapshot.truncatable else self.hashes[-1:]

    def can_free(self, pool: KVBlockPool, block: int | None) -> bool:
        """Whether dropping this entry may give ``pool`` a block: it holds one of the pool's lent blocks,
        or ``block`` (a copy-on-write's source, which dropping may leave its writer's alone)."""
        return any(p is pool and (block in blocks or any(map(p.is_lent, blocks))) for p, blocks, _ in self.holdings)


@dataclass
class PrefixHit:
    """A cached prefix of ``length`` tokens; ``snapshot.clone_into(max_tokens, length)`` starts a sequence."""

    length: int
    snapshot: SequenceCache


class PrefixCache:
    """Snapshots keyed by chain hash, LRU-evicted under a byte budget; see the module docstring.

    ``space``: the paged KV space the snapshots' blocks come from (None: contiguous caches); the cache
    registers itself as its reclaim hook. Counters: ``queries``/``query_tokens`` (lookups and the prompt
    tokens they covered), ``hits``/``hit_tokens`` (lookups that matched and the tokens served),
    ``evictions`` (to stay under the budget, and to give a pool's blocks back to running sequences).
    """

    def __init__(self, block_tokens: int, capacity_bytes: int, space: PagedKVSpace | None = None) -> None:
        if block_tokens < 1 or capacity_bytes < 0:
            raise ConfigError(f"prefix cache needs block_tokens >= 1 and capacity_bytes >= 0, got "
                              f"{block_tokens} and {capacity_bytes}")  # fmt: skip
        self.block_tokens = block_tokens
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[bytes, dict[bytes, None]] = {}  # prefix hash -> keys of entries serving it
        self._held = 0  # the entries' nbytes
        self.space = space
        if space is not None:
            space.reclaim_hook = self.reclaim
        self.queries = self.query_tokens = self.hits = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """What the snapshots cost now (see the module docstring: paged KV counts blocks only they hold)."""
        return self._held + (0 if self.space is None else self.space.bytes_lent)

    def lookup(self, hashes: Sequence[bytes], num_tokens: int) -> PrefixHit | None:
        """The longest stored prefix of a ``num_tokens``-token prompt whose chain is ``hashes``, leaving at
        least one token to compute; counts the query (and the hit) and refreshes the entry's recency."""
        self.queries += 1
        self.query_tokens += num_tokens
        best = self._longest(hashes, num_tokens)
        if best is None:
            return None
        blocks, key = best
        self._entries.move_to_end(key)
        self.hits += 1
        self.hit_tokens += blocks * self.block_tokens
        return PrefixHit(blocks * self.block_tokens, self._entries[key].snapshot)

    def peek(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """The tokens :meth:`lookup` would serve now (0: none), without counting a query or touching recency."""
        best = self._longest(hashes, num_tokens)
        return 0 if best is None else best[0] * self.block_tokens

    def _longest(self, hashes: Sequence[bytes], num_tokens: int) -> tuple[int, bytes] | None:
        """(blocks, entry key) of the longest servable prefix leaving at least one token to compute."""
        best: tuple[int, bytes] | None = None
        # Every block is checked: a non-truncatable entry serves only its own length, so a miss at
        # block i says nothing about block i + 1.
        for i in range(min(len(hashes), (num_tokens - 1) // self.block_tokens)):
            key = self._serving(hashes[i])
            if key is not None:
                best = (i + 1, key)
        return best

    def _serving(self, prefix: bytes) -> bytes | None:
        """The newest entry that serves ``prefix`` (dropping those whose snapshot no longer can), or None."""
        keys = self._index.get(prefix)
        while keys:
            key = next(reversed(keys))
            if self._entries[key].snapshot.servable:
                return key
            self._remove(key)
            self.evictions += 1
            keys = self._index.get(prefix)
        return None

    def contains(self, hashes: Sequence[bytes]) -> bool:
        """Whether the prefix ``hashes`` names is already servable (refreshing the serving entry if so)."""
        key = self._serving(hashes[-1]) if hashes else None
        if key is None:
            return False
        self._entries.move_to_end(key)
        return True

    def insert(self, hashes: Sequence[bytes], snapshot: SequenceCache) -> bool:
        """Store ``snapshot`` (a ``len(hashes)``-block prefix) unless already servable or larger than the
        whole budget (its ``nbytes``: all it may cost alone); evicts least recently used entries to make
        room. Returns whether it was stored."""
        if not hashes or snapshot.length != len(hashes) * self.block_tokens:
            raise ValueError(f"a snapshot of {snapshot.length} tokens does not match {len(hashes)} blocks")
        if self.contains(hashes):
            return False
        if snapshot.nbytes > self.capacity_bytes:
            return False
        holdings = [] if self.space is None else paged_holdings(snapshot)
        entry = _Entry(tuple(hashes), snapshot, snapshot.nbytes - sum(n for *_, n in holdings), holdings)
        if snapshot.truncatable:  # shorter truncatable entries on this chain are now redundant
            for key in [h for h in entry.hashes[:-1] if h in self._entries]:
                if self._entries[key].snapshot.truncatable:
                    self._remove(key)
        self._entries[entry.key] = entry
        self._held += entry.nbytes
        for pool, blocks, _ in holdings:
            pool.mark(blocks)
        for h in entry.servable():
            self._index.setdefault(h, {})[entry.key] = None
        self.trim()  # the newest entry goes last, and only if it alone is over the budget
        return entry.key in self._entries

    def trim(self) -> None:
        """Evict least recently used entries until the snapshots cost at most ``capacity_bytes``."""
        while self._entries and self.bytes_used > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1

    def reclaim(self, pool: KVBlockPool, block: int | None) -> bool:
        """The paged KV space's reclaim hook (:class:`moetier.models.paged_kv.PagedKVSpace`): evict the
        least recently used entry whose eviction may give ``pool`` a block; False when none can."""
        key = next((k for k, entry in self._entries.items() if entry.can_free(pool, block)), None)
        if key is None:
            return False
        self._remove(key)  # its blocks go back when the snapshot is dropped, i.e. on return
        self.evictions += 1
        return True

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._held -= entry.nbytes
        for pool, blocks, _ in entry.holdings:  # unmarked before the snapshot releases them
            pool.unmark(blocks)
        for h in entry.servable():
            keys = self._index[h]
            del keys[key]
            if not keys:
                del self._index[h]

    def stats(self) -> dict[str, int]:
        """The cache's counters under their ``EngineStats`` names."""
        return {
            "prefix_cache_queries": self.query_tokens,
            "prefix_cache_hits": self.hit_tokens,
            "prefix_cache_lookups": self.queries,
            "prefix_cache_lookup_hits": self.hits,
            "prefix_cache_bytes": self.bytes_used,
            "prefix_cache_entries": len(self),
        }

    def lengths(self) -> list[int]:
        """Token lengths of the stored snapshots, least recently used first."""
        return [entry.snapshot.length for entry in self._entries.values()]

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)
