"""Paged KV storage: token rows in fixed-size blocks of a shared pool, one block table per row store.

Every cache state that grows with the context (attention keys and values, MLA latents, V4's
compressed entries) is a row store with :class:`~moetier.models.cache.KVRows`' contract: ``write``
rows at a position, ``read`` the first ``end`` rows, ``copy`` the first ``length`` rows into a new
store. :class:`PagedKVRows` keeps that contract over blocks of ``block_tokens`` rows taken from a
:class:`KVBlockPool` on first write, so:

- a sequence holds memory for the tokens it has, not for its whole reservation;
- ``copy`` (growing a reservation, a prefix-cache snapshot, a request starting from a cached prefix)
  shares the blocks instead of copying them: a block's reference count says how many tables hold it,
  and a store about to write into a shared block copies that block first (copy-on-write; only a
  partly filled last block is ever written again);
- a block returns to the pool when the last table holding it is dropped.

The engine sizes the pools once, at start-up (:meth:`PagedKVSpace.size_for`), for its KV-token budget
(plus an optional reserve for prefix-cache snapshots), so KV memory is fixed and known before the first
request. Prefix-cache snapshots live in the blocks running sequences do not need: the prefix cache marks
the blocks its snapshots hold (:meth:`KVBlockPool.mark`), a block only snapshots hold is *lent*, and a
pool with no free block asks its reclaim hook to drop snapshots before it grows. A pool that still runs
out grows (into a new tensor, the old blocks copied over) with one warning.

Reads gather the table's rows into one tensor (a copy), then dequantise fp8 storage as :class:`KVRows`
does; decode attention (Qwen3, DeepSeek-V3) skips that copy on CUDA and reads the blocks in place
(:mod:`moetier.kernels.paged_attention`, through :meth:`PagedKVRows.pool_rows` and ``token_rows``). Caches built inside
``with paged_kv(space):`` get paged stores (:func:`moetier.models.cache.kv_rows`); elsewhere they stay
contiguous.
``nbytes`` keeps :class:`KVRows`' meaning (the store's capacity in bytes, what the engine reserves);
:meth:`PagedKVSpace.stats` tells what the pools really hold.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.kernels.kv_read import try_read_rows
from moetier.models.cache import FP8_DTYPE, KVRows, kv_storage_dtype, quantize_fp8
from moetier.units import gib

KV_LAYOUTS = ("contiguous", "paged")
_ACTIVE: ContextVar[PagedKVSpace | None] = ContextVar("moetier_paged_kv", default=None)
INITIAL_BLOCKS = 16  # a pool no one sized starts this small; a growth adds half the pool, at least this

log = logging.getLogger(__name__)


class KVBlockPool:
    """Blocks ``[block_tokens, *lead, width]`` of one storage dtype (and fp8 scales), reference counted.

    Block-major, token-next layout: the pool viewed as ``[blocks * block_tokens, *lead, width]`` is
    indexed by ``block * block_tokens + offset``, so a store's whole table reads or writes in one op.
    ``blocks`` are allocated up front. When every one is held, :meth:`allocate` first calls
    ``reclaim(pool, block)`` (``block``: the shared block a copy-on-write copies, else None) while it
    returns True: it drops a prefix-cache snapshot, which may free blocks. Only then does it grow the
    pool (into a new tensor, the old blocks copied over) and call ``on_grow(pool, old_blocks)``.

    ``marks[b]`` counts the references to block ``b`` that prefix-cache snapshots hold (a part of
    ``refs[b]``); ``lent`` counts the blocks snapshots alone hold (spare blocks the pool lends them).
    """

    def __init__(
        self,
        lead: tuple[int, ...],
        width: int,
        storage: torch.dtype,
        groups: int,
        device,
        block_tokens: int,
        blocks: int = INITIAL_BLOCKS,
        on_grow: Callable[[KVBlockPool, int], None] | None = None,
        reclaim: Callable[[KVBlockPool, int | None], bool] | None = None,
    ) -> None:
        self.lead, self.width, self.block_tokens = lead, width, block_tokens
        self.data = torch.empty(blocks, block_tokens, *lead, width, dtype=storage, device=device)
        self.scales = None
        if storage == FP8_DTYPE:
            self.scales = torch.empty(blocks, block_tokens, *lead, groups, dtype=torch.float32, device=device)
        self.refs = [0] * blocks
        self.marks = [0] * blocks
        self.lent = 0
        self.free: list[int] = []  # released blocks, handed out again first
        self.fresh = 0  # blocks [fresh, blocks) were never handed out
        self.on_grow, self.reclaim = on_grow, reclaim
        # A store's blocks go back when its last holder is dropped, in whichever thread that happens
        # (a garbage-collection pass may run anywhere): reference counts change under this lock.
        self._lock = threading.Lock()

    @property
    def blocks(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.fresh - len(self.free)

    @property
    def shared(self) -> int:
        """Blocks held by more than one table."""
        return sum(1 for r in self.refs[: self.fresh] if r > 1)

    @property
    def block_bytes(self) -> int:
        tensors = [self.data] if self.scales is None else [self.data, self.scales]
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row (values and fp8 scales)."""
        return self.block_bytes // self.block_tokens

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``data`` or ``scales`` as ``[blocks * block_tokens, *lead, last]``."""
        return tensor.view(-1, *tensor.shape[2:])

    def allocate(self) -> int:
        """A block of one reference: a free one, else one reclaimed from snapshots, else a grown pool's."""
        return self._obtain(None)

    def copy_block(self, source: int) -> int:
        """A block holding ``source``'s rows, private to the caller, who then drops its reference to
        ``source`` (copy-on-write): a copy, or ``source`` itself with one more reference when reclaiming
        snapshots left the caller its only holder (no block taken, no row copied)."""
        block = self._obtain(source)
        if block != source:
            self.data[block].copy_(self.data[source])
            if self.scales is not None:
                self.scales[block].copy_(self.scales[source])
        return block

    def _obtain(self, source: int | None) -> int:
        while True:
            with self._lock:
                block = self._take(source)
                if block is not None:
                    return block
                if self.reclaim is None:
                    return self._take_grown()
            # Outside the lock: dropping a snapshot releases its blocks, which takes the lock again.
            if not self.reclaim(self, source):
                break
        with self._lock:
            block = self._take(source)  # another thread may have freed one meanwhile
            return self._take_grown() if block is None else block

    def _take(self, source: int | None) -> int | None:
        """(Lock held.) ``source`` again if its caller now holds it alone, else a free block, else None."""
        if source is not None and self.refs[source] == 1:
            self._count(source, 1, 0)
            return source
        if self.free:
            block = self.free.pop()
        elif self.fresh < self.blocks:
            block, self.fresh = self.fresh, self.fresh + 1
        else:
            return None
        self.refs[block] = 1  # a free block has no marks
        return block

    def _take_grown(self) -> int:
        """(Lock held, no block left.) A block of the grown pool."""
        self._grow()
        block, self.fresh = self.fresh, self.fresh + 1
        self.refs[block] = 1
        return block

    def retain(self, blocks: Sequence[int]) -> None:
        with self._lock:
            for block in blocks:
                self._count(block, 1, 0)

    def release(self, blocks: Sequence[int]) -> None:
        with self._lock:
            for block in blocks:
                self._count(block, -1, 0)
                if self.refs[block] == 0:
                    self.free.append(block)

    def mark(self, blocks: Sequence[int]) -> None:
        """Count one reference to each of ``blocks`` (held already) as a prefix-cache snapshot's."""
        with self._lock:
            for block in blocks:
                self._count(block, 0, 1)

    def unmark(self, blocks: Sequence[int]) -> None:
        """Undo :meth:`mark`, before the snapshot releases its blocks (so marks never exceed refs)."""
        with self._lock:
            for block in blocks:
                self._count(block, 0, -1)

    def is_lent(self, block: int) -> bool:
        """Whether only snapshots hold ``block`` (dropping them all frees it)."""
        return 0 < self.marks[block] == self.refs[block]

    def _count(self, block: int, refs: int, marks: int) -> None:
        """(Lock held.) Change ``block``'s references and marks, keeping ``lent`` up to date."""
        was = self.is_lent(block)
        self.refs[block] += refs
        self.marks[block] += marks
        self.lent += self.is_lent(block) - was

    def reserve(self, blocks: int) -> None:
        """Hold at least ``blocks`` blocks (no growth callback: this is sizing, not running out)."""
        with self._lock:
            if blocks > self.blocks:
                self._resize(blocks)

    def _grow(self) -> None:
        # Geometric, so the copies stay few; stores index the pool afresh on every read and write.
        old = self.blocks
        self._resize(old + max(INITIAL_BLOCKS, old // 2))
        if self.on_grow is not None:
            self.on_grow(self, old)

    def _resize(self, blocks: int) -> None:
        """Move the blocks into tensors of ``blocks``: the old and the new pool exist at once, nothing more
        (``torch.cat`` would also build a temporary of the added blocks)."""
        old = self.blocks
        data = self.data.new_empty(blocks, *self.data.shape[1:])
        data[:old].view(torch.uint8).copy_(self.data.view(torch.uint8))  # fp8 bytes move as uint8 (same bits)
        self.data = data
        if self.scales is not None:
            scales = self.scales.new_empty(blocks, *self.scales.shape[1:])
            scales[:old].copy_(self.scales)
            self.scales = scales
        self.refs += [0] * (blocks - old)
        self.marks += [0] * (blocks - old)


@dataclass
class KVSpaceStats:
    """What the pools of a :class:`PagedKVSpace` hold: blocks in use (``blocks_shared`` of them by more
    than one table: what sharing saved; ``blocks_lent`` of them by prefix-cache snapshots alone),
    blocks allocated, and their bytes."""

    blocks_used: int
    blocks_shared: int
    blocks_allocated: int
    bytes_used: int
    bytes_allocated: int
    blocks_lent: int = 0
    bytes_lent: int = 0


@dataclass(frozen=True)
class KVSizing:
    """What :meth:`PagedKVSpace.size_for` allocated: ``blocks`` of ``block_tokens`` rows over ``pools``
    pools (``nbytes`` in all), for ``tokens`` tokens of ``sequences`` running sequences plus
    ``snapshot_tokens`` tokens reserved for rows that outlive them (prefix-cache snapshots; 0 by default:
    snapshots borrow the blocks running sequences do not need)."""

    pools: int
    blocks: int
    block_tokens: int
    nbytes: int
    tokens: int
    sequences: int
    snapshot_tokens: int

    def describe(self, origin: str) -> str:
        """One line for the start-up log; ``origin`` says where ``tokens`` comes from."""
        pools = f"{self.pools} pool{'s' * (self.pools != 1)}"
        line = f"{pools}, {self.blocks} blocks of {self.block_tokens} rows, {gib(self.nbytes)} GiB, for {self.tokens} "
        line += f"tokens ({origin})"
        if self.snapshot_tokens:
            line += f" + {self.snapshot_tokens} tokens reserved for prefix-cache snapshots"
        return line


class PagedKVSpace:
    """The pools of one engine's paged caches, one per row shape (lead dims, width, storage dtype).

    :meth:`size_for` allocates the pools once, before the first cache, for a KV-token budget; a pool
    that runs out later still grows (a fallback: one warning, naming ``grow_hint``). A space nobody
    sized starts each pool at :data:`INITIAL_BLOCKS` and grows quietly (benchmarks, tests).

    ``reclaim_hook(pool, block)`` (the prefix cache sets it): called by a pool with no free block before
    it grows, in the allocating thread and outside the pool's lock; it drops one snapshot whose
    eviction can give ``pool`` a block (or make ``block``, being copied on write, its writer's alone)
    and returns True, or returns False when no snapshot can.
    """

    def __init__(self, device: torch.device | str, block_tokens: int = 64) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"KV block size must be an integer >= 1 token, got {block_tokens!r}")
        self.device, self.block_tokens = torch.device(device), block_tokens
        self._pools: dict[tuple, KVBlockPool] = {}
        self.sizing: KVSizing | None = None  # set by size_for
        self.grow_hint = "kv_token_budget"  # the knob the growth warning names (size_for sets it)
        self._census: list[tuple[KVBlockPool, int]] | None = None  # (pool, rows) of stores built while sizing
        self._warned = False
        self.reclaim_hook: Callable[[KVBlockPool, int | None], bool] | None = None

    @property
    def pools(self) -> list[KVBlockPool]:
        return list(self._pools.values())

    def pool(self, lead: tuple[int, ...], width: int, storage: torch.dtype, groups: int, rows: int = 0) -> KVBlockPool:
        """The pool of this row shape, for a store of at most ``rows`` rows (what :meth:`size_for` counts)."""
        key = (lead, width, storage, groups)
        if key not in self._pools:
            blocks = INITIAL_BLOCKS if self._census is None and self.sizing is None else 0
            pool = KVBlockPool(
                lead, width, storage, groups, self.device, self.block_tokens, blocks, self._grew, self._reclaim
            )
            self._pools[key] = pool
        pool = self._pools[key]
        if self._census is not None:
            self._census.append((pool, rows))
        return pool

    def size_for(
        self,
        new_cache: Callable[[int], Any],
        tokens: int,
        sequences: int,
        snapshot_bytes: int = 0,
        grow_hint: str = "kv_token_budget",
    ) -> KVSizing:
        """Allocate the pools for at most ``sequences`` caches of ``new_cache`` (a ``max_tokens -> cache``
        factory) that hold ``tokens`` tokens together, plus ``snapshot_bytes`` reserved for rows that
        outlive them, counted as :attr:`PagedKVRows.nbytes` counts (prefix-cache snapshots).

        Rows per token come from the caches themselves: one probe cache of ``tokens`` tokens is built and
        each of its stores reports its capacity (K/V and latents: one row per token, V4's compressed
        entries ``tokens // rate``). Split over sequences, a store's rows fill at most one partial block
        per sequence, so a store of ``r`` rows needs ``ceil(r / block_tokens) + min(sequences, r) - 1``
        blocks (a capacity never grows faster than the tokens: ``sum(r_i // rate) <= sum(r_i) // rate``).
        Snapshots add their share of ``snapshot_bytes`` to each store's rows, in proportion to its bytes.
        ``grow_hint`` names the knob that sizes the pools, for the warning of a pool that still runs out.

        Why snapshots need no blocks of their own (``snapshot_bytes`` is 0 unless a reserve is asked
        for): a snapshot shares its blocks with the sequence it was taken from, and what it alone holds
        (a finished or preempted request's blocks, the partly filled block its sequence copied on write)
        is lent: a pool with no free block drops least recently used snapshots through
        ``reclaim_hook`` before it grows. Running sequences never hold more than the budget's blocks, so
        with every lent block reclaimable a pool sized here does not grow for snapshots.
        """
        census = self._count_rows(new_cache, tokens)
        probe_bytes = sum(rows * pool.row_bytes for pool, rows in census)
        needed: dict[int, int] = {}
        for pool, rows in census:
            extra = snapshot_bytes * rows // probe_bytes if probe_bytes else 0
            blocks = math.ceil((rows + extra) / self.block_tokens) + max(0, min(sequences, rows) - 1)
            needed[id(pool)] = needed.get(id(pool), 0) + blocks
        for pool in self._pools.values():
            pool.reserve(needed.get(id(pool), 0))
        self.grow_hint = grow_hint
        stats = self.stats()
        snapshot_tokens = snapshot_bytes * tokens // probe_bytes if probe_bytes else 0
        self.sizing = KVSizing(
            len(self._pools), stats.blocks_allocated, self.block_tokens, stats.bytes_allocated, tokens, sequences,
            snapshot_tokens,
        )  # fmt: skip
        return self.sizing

    def _count_rows(self, new_cache: Callable[[int], Any], tokens: int) -> list[tuple[KVBlockPool, int]]:
        """(pool, capacity) of every paged store of a probe cache of ``tokens`` tokens (it holds no block)."""
        self._census = []
        try:
            with paged_kv(self):
                new_cache(tokens)
            return self._census
        finally:
            self._census = None

    def _grew(self, pool: KVBlockPool, old: int) -> None:
        """A pool ran out: in a sized space warn once (later growths log at debug); else grow quietly."""
        sizing = self.sizing
        if sizing is None:
            return
        report = log.debug if self._warned else log.warning
        self._warned = True
        report(
            "paged KV pool %s grew from %d to %d blocks: the pools were sized at start-up for %d tokens "
            "(+ %d reserved for prefix-cache snapshots); raise %s so that they hold it from the start",
            (*pool.lead, pool.width), old, pool.blocks, sizing.tokens, sizing.snapshot_tokens, self.grow_hint,
        )  # fmt: skip

    @property
    def bytes_lent(self) -> int:
        """Bytes of the blocks only prefix-cache snapshots hold (cheap: no walk over the blocks)."""
        return sum(p.lent * p.block_bytes for p in self._pools.values())

    def _reclaim(self, pool: KVBlockPool, block: int | None) -> bool:
        hook = self.reclaim_hook
        return hook is not None and hook(pool, block)

    def engine_stats(self) -> dict[str, int]:
        """The :class:`moetier.engine.types.EngineStats` fields of paged KV. Bytes used: every held block;
        blocks used: those running sequences hold, not the ones lent to snapshots (a running sequence
        takes those back), so that blocks used / blocks is the KV use."""
        stats = self.stats()
        return {
            "kv_pool_bytes_used": stats.bytes_used,
            "kv_pool_bytes_allocated": stats.bytes_allocated,
            "kv_pool_blocks_used": stats.blocks_used - stats.blocks_lent,
            "kv_pool_blocks_lent": stats.blocks_lent,
            "kv_pool_blocks": stats.blocks_allocated,
        }

    def stats(self) -> KVSpaceStats:
        pools = self.pools
        return KVSpaceStats(
            blocks_used=sum(p.used for p in pools),
            blocks_shared=sum(p.shared for p in pools),
            blocks_allocated=sum(p.blocks for p in pools),
            bytes_used=sum(p.used * p.block_bytes for p in pools),
            bytes_allocated=sum(p.blocks * p.block_bytes for p in pools),
            blocks_lent=sum(p.lent for p in pools),
            bytes_lent=self.bytes_lent,
        )


@contextmanager
def paged_kv(space: PagedKVSpace | None) -> Iterator[None]:
    """Caches built inside get their row stores from ``space`` (None: contiguous, as outside)."""
    token = _ACTIVE.set(space)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_space() -> PagedKVSpace | None:
    """The space of the innermost :func:`paged_kv` block (None outside: caches are contiguous)."""
    return _ACTIVE.get()


def paged_holdings(cache: Any) -> list[tuple[KVBlockPool, list[int], int]]:
    """(pool, block table, ``nbytes``) of each paged row store of ``cache`` (its ``row_stores()``): the blocks
    a prefix-cache snapshot holds."""
    return [(s._pool, s.blocks, s.nbytes) for s in cache.row_stores() if isinstance(s, PagedKVRows)]


class PagedKVRows(KVRows):
    """:class:`KVRows` over pool blocks: ``capacity`` is the most rows it may hold, none allocated up front."""

    def __init__(
        self,
        space: PagedKVSpace,
        lead: Sequence[int],
        capacity: int,
        width: int,
        dtype: torch.dtype,
        kv_dtype: str | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:  # KVRows.__init__ would allocate the rows: this store shares its parent's fields instead
        self.dtype = dtype
        self.groups = tuple(groups or (width,))
        if sum(self.groups) != width or min(self.groups) < 1:
            raise ValueError(f"row groups {self.groups} must be positive and sum to the width {width}")
        storage = kv_storage_dtype(kv_dtype, dtype)
        self._pool = space.pool(tuple(lead), width, storage, len(self.groups), capacity)
        self._capacity = capacity
        self._table: list[int] = []  # mutated in place only: the finalizer holds this very list
        self._index = torch.empty(0, dtype=torch.long, device=space.device)  # pool row of each held token slot
        self._release = weakref.finalize(self, self._pool.release, self._table)

    # --- KVRows' contract --------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def kv_dtype(self) -> str | None:
        if self._pool.scales is not None:
            return "fp8"
        return None if self._pool.data.dtype == self.dtype else "bf16"

    @property
    def data(self) -> torch.Tensor:  # the pool's rows (shared): KVRows' helpers read the storage dtype here
        return self._pool.data

    @property
    def scales(self) -> torch.Tensor | None:
        return self._pool.scales

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[-2]
        if end > self._capacity:
            raise ConfigError(f"writing rows up to {end} past the store's capacity of {self._capacity}")
        self._own_blocks(start, end)
        index = self._index[start:end]
        tokens_first = rows.movedim(-2, 0)  # [T, *lead, width]: the pool's row order
        if self._pool.scales is None:
            self._pool.flat(self._pool.data).index_copy_(0, index, tokens_first.to(self._pool.data.dtype))
            return
        # Index kernels lack float8 on some devices: fp8 bytes move as uint8 (same bits).
        raw = self._pool.flat(self._pool.data).view(torch.uint8)
        for g, (offset, part) in enumerate(self._split(tokens_first)):
            values, scale = quantize_fp8(part)
            raw[..., offset : offset + part.shape[-1]].index_copy_(0, index, values.view(torch.uint8))
            self._pool.flat(self._pool.scales)[..., g : g + 1].index_copy_(0, index, scale)

    def read(self, end: int) -> torch.Tensor:
        return self._gather(self._index[:end])

    def read_at(self, index: torch.Tensor) -> torch.Tensor:
        return self._gather(self._index[index])

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Pool ``rows`` (int64 ``[n]``) as ``[*lead, n, width]`` in the compute dtype."""
        pool = self._pool
        if pool.scales is None:
            data = pool.flat(pool.data).index_select(0, rows).movedim(0, -2)
            return data if data.dtype == self.dtype else data.to(self.dtype)
        n = rows.shape[0]
        fused = try_read_rows(pool.flat(pool.data), pool.flat(pool.scales), self.groups, n, self.dtype, 0, rows)
        if fused is not None:  # gather and dequantisation in one kernel on CUDA
            return fused
        raw = pool.flat(pool.data).view(torch.uint8).index_select(0, rows)
        scales = pool.flat(pool.scales).index_select(0, rows).movedim(0, -2)
        return self._dequantize(raw.view(pool.data.dtype).movedim(0, -2), scales)

    def copy(self, capacity: int, length: int) -> PagedKVRows:
        """A store of ``capacity`` rows sharing this one's blocks for its first ``length`` rows (no data copied)."""
        clone = PagedKVRows.__new__(PagedKVRows)
        clone.dtype, clone.groups, clone._pool, clone._capacity = self.dtype, self.groups, self._pool, capacity
        held = math.ceil(length / self._pool.block_tokens)
        clone._table = list(self._table[:held])
        self._pool.retain(clone._table)
        clone._index = self._index[: held * self._pool.block_tokens].clone()
        clone._release = weakref.finalize(clone, self._pool.release, clone._table)
        return clone

    @property
    def nbytes(self) -> int:
        """Bytes of ``capacity`` rows, as a contiguous store would reserve (the engine's accounting)."""
        return self._capacity * self._pool.block_bytes // self._pool.block_tokens

    # --- blocks ------------------------------------------------------------------------------------

    @property
    def blocks(self) -> list[int]:
        """The block table (read-only use)."""
        return list(self._table)

    def _own_blocks(self, start: int, end: int) -> None:
        """Make every block rows ``[start, end)`` fall in present and private to this store."""
        size = self._pool.block_tokens
        first, last = start // size, math.ceil(end / size)
        for b in range(first, min(last, len(self._table))):
            if self._pool.refs[self._table[b]] > 1:  # shared with a snapshot or another sequence
                block = self._pool.copy_block(self._table[b])
                self._pool.release([self._table[b]])
                self._table[b] = block
                self._place(b)
        while len(self._table) < last:
            self._table.append(self._pool.allocate())
            self._place(len(self._table) - 1)

    def _place(self, b: int) -> None:
        """Point token slots ``[b * size, (b + 1) * size)`` at the pool rows of table entry ``b``."""
        size = self._pool.block_tokens
        if self._index.shape[0] < (b + 1) * size:
            length = max(2 * self._index.shape[0], (b + 1) * size)
            grown = torch.empty(length, dtype=torch.long, device=self._index.device)
            grown[: self._index.shape[0]] = self._index
            self._index = grown
        first = self._table[b] * size
        torch.arange(first, first + size, out=self._index[b * size : (b + 1) * size])

    # --- in-place reads (attention kernels; read-only) ---------------------------------------------

    def pool_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool's values and fp8 scales (None unless fp8) as ``[pool rows, *lead, width | groups]`` views,
        indexed by :meth:`token_rows`. Take them after the step's writes: a write may grow the pool into new
        tensors."""
        pool = self._pool
        return pool.flat(pool.data), None if pool.scales is None else pool.flat(pool.scales)

    def token_rows(self, end: int) -> torch.Tensor:
        """The pool row of each token slot ``[0, end)`` (int64 ``[end]``; a view, valid until the next write)."""
        return self._index[:end]
