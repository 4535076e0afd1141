"""Prefix snapshots of a DeepSeek-V4 cache that borrow its compressed entries instead of copying them.

A V4 cache cannot be rewound, so a prefix snapshot holds the rolling state at its length (the window ring, the open
compressor windows, CSA's predecessor halves: a few MB a stream) and the entries emitted so far (``~6.9 KB`` a token
of V4-Flash in bf16: 0.64 GiB at 100k tokens). Entries are append-only, so while the cache the snapshot was taken of
(its *lender*) is not emptied or overwritten, its first ``count`` entries are the snapshot's: a
:class:`BorrowedSnapshot` keeps the rolling state and the counts and reads the entries from the lender. It costs the
prefix cache a few MB whatever the context (an owned copy of a long agent session's context would not fit its
budget, and the next turn would prefill everything again), and where the next turn starts in the lender itself (a
finished sequence's spare cache, :mod:`moetier.engine.spare_caches`) nothing is copied but the rolling state.

The lender is held weakly, with the number of its :attr:`~DeepseekV4Cache.restarts` at the snapshot: once the lender
is dropped, emptied (``reset``) or written as a copy's target, the snapshot is no longer :attr:`servable` (the prefix
cache then forgets it). A sequence restarted in the lender at some snapshot's length keeps the entries before it:
snapshots up to that length stay servable (a shared system prompt's, for the requests after it), longer ones do
not.
"""

from __future__ import annotations

import weakref

from moetier.models.base import SequenceCache
from moetier.models.deepseek_v4_cache import DeepseekV4Cache, LayerCache

Rolling = list[tuple[LayerCache, tuple[int, int]]]  # per layer: the rolling state (no entries), entry counts
_STATES = ("compressor", "indexer")


class BorrowedSnapshot(SequenceCache):
    """The state of ``lender`` at ``length`` tokens: ``rolling`` (per layer, the rolling state and the compressor's
    and indexer's entry counts), the entries read from the lender while it is :attr:`servable`."""

    truncatable = False

    def __init__(self, lender: DeepseekV4Cache, length: int, rolling: Rolling) -> None:
        self.length = self.max_tokens = length
        self._lender = weakref.ref(lender)
        self._since = len(lender.restarts)  # the lender's restarts before this snapshot
        self._rolling = rolling
        lender.borrowers.add(self)

    @property
    def lender(self) -> DeepseekV4Cache | None:
        """The cache whose entries this snapshot reads, while they are still the snapshot's (else None)."""
        lender = self._lender()
        if lender is None or min(lender.restarts[self._since :], default=self.length) < self.length:
            return None
        return lender

    @property
    def servable(self) -> bool:
        return self.lender is not None

    @property
    def nbytes(self) -> int:
        """The rolling state only: the entries are the lender's memory."""
        return sum(layer.nbytes for layer, _ in self._rolling)

    def clone_into(self, max_tokens: int, length: int | None = None) -> DeepseekV4Cache:
        """A new cache of ``max_tokens`` holding this state (its entries copied from the lender)."""
        lender = self._checked(max_tokens, length)
        layers = []
        for (rolling, counts), live in zip(self._rolling, lender.layers, strict=True):
            layer = rolling.copy(max_tokens)
            for name, count in zip(_STATES, counts, strict=True):
                state = getattr(layer, name)
                if state is not None:
                    getattr(live, name).entries.copy_rows_into(state.entries, count)
                    state.count = count
            layers.append(layer)
        clone = DeepseekV4Cache(layers, max_tokens)
        clone.length = self.length
        return clone

    def copy_into(self, target: SequenceCache, length: int | None = None) -> bool:
        """This state into ``target`` in place; into the lender itself only the rolling state and the counts are
        written (its first entries are this state's already). False for a target that is not a contiguous V4 cache."""
        if not isinstance(target, DeepseekV4Cache) or not target.contiguous:
            return False
        lender = self._checked(target.max_tokens, length)
        for (rolling, counts), live, into in zip(self._rolling, lender.layers, target.layers, strict=True):
            rolling.window.copy_into(into.window)
            for name, count in zip(_STATES, counts, strict=True):
                state, source, dest = getattr(rolling, name), getattr(live, name), getattr(into, name)
                if state is None:
                    continue
                state.copy_into(dest, 0)  # the open window and predecessors
                if target is not lender:
                    source.entries.copy_rows_into(dest.entries, count)
                dest.count = count
        target.restart(self.length, keeps_entries=target is lender)
        return True

    def _checked(self, max_tokens: int, length: int | None) -> DeepseekV4Cache:
        lender = self.lender
        if lender is None:
            raise ValueError("the cache this DeepSeek-V4 snapshot borrows its entries from was reused or dropped")
        if length not in (None, self.length) or max_tokens < self.length:
            raise ValueError(f"cannot start {length} tokens in {max_tokens} from a {self.length}-token V4 snapshot")
        return lender
