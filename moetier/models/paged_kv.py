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

Reads gather the table's rows into one tensor (a copy; an attention kernel reading blocks in place is
the next step), then dequantise fp8 storage as :class:`KVRows` does. Caches built inside
``with paged_kv(space):`` get paged stores (:func:`moetier.models.cache.kv_rows`); elsewhere they stay
contiguous.
``nbytes`` keeps :class:`KVRows`' meaning (the store's capacity in bytes, what the engine reserves);
:meth:`PagedKVSpace.stats` tells what the pools really hold.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from moetier.errors import ConfigError
from moetier.kernels.kv_read import try_read_rows
from moetier.models.cache import FP8_DTYPE, KVRows, kv_storage_dtype, quantize_fp8

KV_LAYOUTS = ("contiguous", "paged")
_ACTIVE: ContextVar[PagedKVSpace | None] = ContextVar("moetier_paged_kv", default=None)
INITIAL_BLOCKS = 16  # a pool starts this small and doubles: memory follows use


class KVBlockPool:
    """Blocks ``[block_tokens, *lead, width]`` of one storage dtype (and fp8 scales), reference counted.

    Block-major, token-next layout: the pool viewed as ``[blocks * block_tokens, *lead, width]`` is
    indexed by ``block * block_tokens + offset``, so a store's whole table reads or writes in one op.
    """

    def __init__(
        self, lead: tuple[int, ...], width: int, storage: torch.dtype, groups: int, device, block_tokens: int
    ) -> None:
        self.lead, self.width, self.block_tokens = lead, width, block_tokens
        self.data = torch.empty(INITIAL_BLOCKS, block_tokens, *lead, width, dtype=storage, device=device)
        self.scales = None
        if storage == FP8_DTYPE:
            self.scales = torch.empty(INITIAL_BLOCKS, block_tokens, *lead, groups, dtype=torch.float32, device=device)
        self.refs = [0] * INITIAL_BLOCKS
        self.free = list(range(INITIAL_BLOCKS - 1, -1, -1))
        # A store's blocks go back when its last holder is dropped, in whichever thread that happens
        # (a garbage-collection pass may run anywhere): reference counts change under this lock.
        self._lock = threading.Lock()

    @property
    def blocks(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    @property
    def block_bytes(self) -> int:
        tensors = [self.data] if self.scales is None else [self.data, self.scales]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``data`` or ``scales`` as ``[blocks * block_tokens, *lead, last]``."""
        return tensor.view(-1, *tensor.shape[2:])

    def allocate(self) -> int:
        with self._lock:
            if not self.free:
                self._grow()
            block = self.free.pop()
            self.refs[block] = 1
            return block

    def retain(self, blocks: Sequence[int]) -> None:
        with self._lock:
            for block in blocks:
                self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        with self._lock:
            for block in blocks:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    self.free.append(block)

    def copy_block(self, source: int) -> int:
        """A private copy of ``source`` (copy-on-write); the caller drops its reference to ``source``."""
        block = self.allocate()
        self.data[block].copy_(self.data[source])
        if self.scales is not None:
            self.scales[block].copy_(self.scales[source])
        return block

    def _grow(self) -> None:
        # Doubling keeps the copies of the pool few; stores index the pool afresh on every read and write.
        old = self.blocks
        self.data = torch.cat([self.data, torch.empty_like(self.data)])
        if self.scales is not None:
            self.scales = torch.cat([self.scales, torch.empty_like(self.scales)])
        self.refs += [0] * old
        self.free = list(range(2 * old - 1, old - 1, -1))


@dataclass
class KVSpaceStats:
    """What the pools of a :class:`PagedKVSpace` hold: blocks in use (``blocks_shared`` of them by more
    than one table: what sharing saved), blocks allocated, and their bytes."""

    blocks_used: int
    blocks_shared: int
    blocks_allocated: int
    bytes_used: int
    bytes_allocated: int


class PagedKVSpace:
    """The pools of one engine's paged caches, one per row shape (lead dims, width, storage dtype)."""

    def __init__(self, device: torch.device | str, block_tokens: int = 64) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"KV block size must be an integer >= 1 token, got {block_tokens!r}")
        self.device, self.block_tokens = torch.device(device), block_tokens
        self._pools: dict[tuple, KVBlockPool] = {}

    def pool(self, lead: tuple[int, ...], width: int, storage: torch.dtype, groups: int) -> KVBlockPool:
        key = (lead, width, storage, groups)
        if key not in self._pools:
            self._pools[key] = KVBlockPool(lead, width, storage, groups, self.device, self.block_tokens)
        return self._pools[key]

    def engine_stats(self) -> dict[str, int]:
        """The :class:`moetier.engine.types.EngineStats` fields of paged KV."""
        stats = self.stats()
        return {"kv_pool_bytes_used": stats.bytes_used, "kv_pool_bytes_allocated": stats.bytes_allocated}

    def stats(self) -> KVSpaceStats:
        pools = list(self._pools.values())
        return KVSpaceStats(
            blocks_used=sum(p.used for p in pools),
            blocks_shared=sum(sum(1 for r in p.refs if r > 1) for p in pools),
            blocks_allocated=sum(p.blocks for p in pools),
            bytes_used=sum(p.used * p.block_bytes for p in pools),
            bytes_allocated=sum(p.blocks * p.block_bytes for p in pools),
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
        self._pool = space.pool(tuple(lead), width, storage, len(self.groups))
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
