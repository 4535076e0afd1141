"""Per-sequence DeepSeek-V4 attention state: sliding-window keys, compressor rolling state, compressed entries.

Per sequence. Memory per layer is the window (a ring of ``sliding_window`` keys), the open window's
projections (``rate`` rows), one overlap half for CSA, all allocated once, and the compressed entries
(``max_tokens // rate`` rows, contiguous or paged). The rolling tensors never move, so a decode step's
CUDA graph may write them in place (:mod:`deepseek_v4_static_decode`).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from moetier.errors import ConfigError
from moetier.models.base import SequenceCache
from moetier.models.cache import KVRows, kv_rows


class RowWrites:
    """The row copies of one decode layer (each sequence's new window key and compressor rows), made together:
    one ``torch._foreach_copy_`` is one dispatch, and on CUDA one launch, instead of one per sequence and
    store. Stores hand their destination rows here and the rows land at :meth:`flush`: whoever reads a
    store's rows (a closing window's pooling, the attention) flushes first."""

    def __init__(self) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst.append(dst)
        self.src.append(src)

    def flush(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
            self.dst, self.src = [], []


class SlidingWindowKV:
    """The last ``window`` keys of one layer (V4 uses one tensor as both key and value), in a ring.

    The key of position ``p`` lives in row ``p % window`` of a buffer allocated once, so its address never
    changes and a decode step writes its key at a row the device computes from the position (a CUDA graph
    can replay it: :mod:`deepseek_v4_static_decode`). ``seen`` counts the keys written so far. A query at
    position ``p`` sees the keys of positions ``p - window + 1 .. p``: after its own key is written, every
    row of the ring (rows past ``p`` are unwritten while ``p < window - 1``).
    """

    def __init__(self, window: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keep = window - 1
        self.buffer = torch.zeros(window, dim, dtype=dtype, device=device)
        self.seen = 0

    @property
    def size(self) -> int:
        return self.buffer.shape[0]

    @property
    def keys(self) -> torch.Tensor:
        """The last ``<= window - 1`` keys in position order ``[n, D]`` (a view unless they wrap the ring)."""
        count = min(self.seen, self.keep)
        first = (self.seen - count) % self.size
        if first + count <= self.size:
            return self.buffer[first : first + count]
        return torch.cat([self.buffer[first:], self.buffer[: first + count - self.size]])

    def extend(self, new: torch.Tensor, writes: RowWrites | None = None) -> torch.Tensor:
        """Append ``new`` (``[T, D]``); return the kept keys followed by ``new``, the keys the new queries see.

        With ``writes`` (one row) the copy of ``new`` into the ring may be left to it."""
        keys = torch.cat([self.keys, new]) if self.seen and self.keep else new
        tokens = new.shape[0]
        if tokens == 1:
            row = self.seen % self.size
            if writes is None:
                self.buffer[row : row + 1] = new
            else:
                writes.add(self.buffer[row : row + 1], new)
        else:
            tail = new[-self.size :]
            first = self.seen + tokens - tail.shape[0]
            rows = torch.arange(first, first + tail.shape[0], device=new.device) % self.size
            self.buffer.index_copy_(0, rows, tail)
        self.seen += tokens
        return keys

    def advance(self) -> None:
        """Count one key written by the device (a static decode step wrote its row)."""
        self.seen += 1

    def reset(self) -> None:
        """Empty, as a new ring (its buffer kept)."""
        self.buffer.zero_()
        self.seen = 0

    def copy_into(self, target: SlidingWindowKV) -> None:
        """This ring's keys into ``target``'s buffer (in place)."""
        target.buffer.copy_(self.buffer)
        target.seen = self.seen

    def copy(self) -> SlidingWindowKV:
        """A deep copy (its own ring)."""
        clone = SlidingWindowKV.__new__(SlidingWindowKV)
        clone.keep, clone.buffer, clone.seen = self.keep, self.buffer.clone(), self.seen
        return clone

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class CompressorState:
    """Rolling state of one compressor.

    ``open`` rows ``[:n_open]`` hold the raw projections (kv then gate channels, ``[rate, 2 * width]``) of
    the tokens of the still-open window; ``prev_kv``/``prev_gate`` (overlapping CSA windows only, ``[1, rate,
    width / 2]``) the first half of the last closed window, gate already biased, which the next entry
    pools; ``entries`` rows ``[:count]`` the emitted entries. ``kv_dtype`` applies to the entries only, the
    part that grows with the context (fp8: one scale per entry); the rolling tensors are a few rows and stay
    in the model dtype.
    """

    def __init__(
        self,
        rate: int,
        width: int,
        dim: int,
        max_entries: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str | None = None,
    ) -> None:
        self.rate, self.width = rate, width
        self.open = torch.empty(rate, 2 * width, dtype=dtype, device=device)
        self.n_open = 0
        # Overlapping windows (CSA, ``width`` = 2 x ``dim``): the first half of the last closed window; before
        # any closed, zeros with a -inf gate (weight 0). Allocated once and updated in place (fixed addresses).
        self.prev_kv: torch.Tensor | None = None
        self.prev_gate: torch.Tensor | None = None
        if width == 2 * dim:
            self.prev_kv = torch.zeros(1, rate, dim, dtype=dtype, device=device)
            self.prev_gate = torch.full((1, rate, dim), float("-inf"), dtype=torch.float32, device=device)
        self.entries = kv_rows((), max_entries, dim, dtype, device, kv_dtype)
        self.count = 0

    def close_windows(self, kv_gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Add new tokens' projections (``[T, 2 * width]``: kv then gate); return the windows they close
        (``[n, rate, width]`` kv and gate) and the index of the first of them, or None when none closes.
        The remainder stays open for the next call. The windows may be views of the open buffer: use them
        before the next call."""
        tokens, width = kv_gate.shape[0], self.width
        if self.n_open + tokens <= self.rate:  # decode: one in-place copy, a window closes every rate steps
            self.open[self.n_open : self.n_open + tokens] = kv_gate
            self.n_open += tokens
            if self.n_open < self.rate:
                return None
            self.n_open, windows = 0, self.open[None]
        else:
            joined = torch.cat([self.open[: self.n_open], kv_gate]) if self.n_open else kv_gate
            closed = joined.shape[0] // self.rate * self.rate
            self.n_open = joined.shape[0] - closed
            self.open[: self.n_open] = joined[closed:]
            windows = joined[:closed].view(closed // self.rate, self.rate, 2 * width)
        return windows[..., :width], windows[..., width:], self.count

    def push(self, row: torch.Tensor, writes: RowWrites | None = None) -> bool:
        """Decode: store one token's projections (``[1, 2 * width]``; the copy left to ``writes`` when given);
        True when they close the open window, whose rows are then all of :attr:`open` (until the next
        push, which starts the next window)."""
        if writes is None:
            self.open[self.n_open : self.n_open + 1] = row
        else:
            writes.add(self.open[self.n_open : self.n_open + 1], row)
        self.n_open += 1
        if self.n_open < self.rate:
            return False
        self.n_open = 0
        return True

    def advance(self) -> None:
        """Count one row stored by the device (a static decode step wrote it, and the entry when it closed)."""
        self.n_open += 1
        if self.n_open == self.rate:
            self.n_open = 0
            self.count += 1

    @property
    def open_kv(self) -> torch.Tensor:
        return self.open[: self.n_open, : self.width]

    @property
    def open_gate(self) -> torch.Tensor:
        return self.open[: self.n_open, self.width :]

    def append(self, entries: torch.Tensor) -> None:
        end = self.count + entries.shape[0]
        if end > self.entries.capacity:
            raise ConfigError(f"{end} compressed entries exceed the cache's {self.entries.capacity}")
        self.entries.write(self.count, entries)
        self.count = end

    @property
    def emitted(self) -> torch.Tensor:
        return self.entries.read(self.count)

    def emitted_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The emitted entries at ``ids`` (int64, each below ``count``): only they are read back."""
        return self.entries.read_at(ids)

    def copy(self, max_entries: int | None = None, count: int | None = None) -> CompressorState:
        """A deep copy with room for ``max_entries`` entries (default: exactly the emitted ones), keeping
        the first ``count`` entries (default all). Only the rolling tensors' current values are copied."""
        count = self.count if count is None else count
        max_entries = count if max_entries is None else max_entries
        if not count <= min(self.count, max_entries):
            raise ValueError(f"cannot copy {count} of {self.count} compressed entries into {max_entries}")
        clone = CompressorState.__new__(CompressorState)
        clone.rate, clone.width, clone.count, clone.n_open = self.rate, self.width, count, self.n_open
        clone.open = self.open.clone()
        clone.prev_kv = None if self.prev_kv is None else self.prev_kv.clone()
        clone.prev_gate = None if self.prev_gate is None else self.prev_gate.clone()
        clone.entries = self.entries.copy(max_entries, count)  # fp8 scales included
        return clone

    def reset(self) -> None:
        """No window open and no entry, as a new state (its tensors kept; entries past ``count`` are never read)."""
        self.n_open = self.count = 0
        if self.prev_kv is not None:
            self.prev_kv.zero_()
            self.prev_gate.fill_(float("-inf"))

    def copy_into(self, target: CompressorState, count: int) -> None:
        """This state with its first ``count`` entries into ``target`` (in place: its tensors kept)."""
        if (target.rate, target.width) != (self.rate, self.width) or not count <= self.count:
            raise ValueError(f"cannot copy {count} of {self.count} entries into a compressor of another shape")
        target.open.copy_(self.open)
        target.n_open, target.count = self.n_open, count
        if self.prev_kv is not None:
            target.prev_kv.copy_(self.prev_kv)
            target.prev_gate.copy_(self.prev_gate)
        self.entries.copy_rows_into(target.entries, count)

    def rolling_nbytes(self) -> int:
        tensors = [self.open, self.prev_kv, self.prev_gate]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class LayerCache:
    """One layer's state: the window, plus the compressor (CSA/HCA) and the indexer's compressor (CSA)."""

    window: SlidingWindowKV
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def copy(self, max_tokens: int | None = None, counts: tuple[int, int] | None = None) -> LayerCache:
        """Deep copy; ``max_tokens`` sizes the entry tensors (default: exactly the emitted entries),
        ``counts`` (compressor, indexer) keeps only that many entries (a :meth:`DeepseekV4Cache.mark`)."""

        def compressor(state: CompressorState | None, count: int | None) -> CompressorState | None:
            if state is None:
                return None
            return state.copy(None if max_tokens is None else max_tokens // state.rate, count)

        compressor_count, indexer_count = counts or (None, None)
        return LayerCache(
            self.window.copy(), compressor(self.compressor, compressor_count), compressor(self.indexer, indexer_count)
        )

    def states(self) -> list[CompressorState]:
        return [s for s in (self.compressor, self.indexer) if s is not None]

    @property
    def nbytes(self) -> int:
        total = self.window.nbytes
        for state in (self.compressor, self.indexer):
            if state is not None:
                total += state.rolling_nbytes() + state.entries.nbytes
        return total


_SERIALS = itertools.count()


class DeepseekV4Cache(SequenceCache):
    """All layers' state of one sequence; ``length`` tokens have been consumed."""

    def __init__(self, layers: list[LayerCache], max_tokens: int) -> None:
        self.serial = next(_SERIALS)  # never reused: a decode graph keyed by it reads this cache's tensors only
        self.layers = layers
        self.max_tokens = max_tokens
        self.length = 0
        # (length, per layer: rolling-state copy and emitted-entry counts), set by mark().
        self._mark: tuple[int, list[tuple[LayerCache, tuple[int, int]]]] | None = None
        # One entry per restart (a new sequence's state written in place): the tokens whose entries it kept (0 when
        # emptied or overwritten as a copy's target; a sequence restarted at a borrowed snapshot's length keeps the
        # entries before it). A snapshot borrowing these entries (deepseek_v4_snapshot, listed in ``borrowers``) at
        # L tokens stays servable while every restart after it kept at least L.
        self.restarts: list[int] = []
        self.borrowers: weakref.WeakSet = weakref.WeakSet()

    def check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.max_tokens:
            raise ConfigError(f"sequence of {self.length + num_tokens} tokens exceeds the cache size {self.max_tokens}")

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    # --- prefix caching: the window and compressors roll forward, so no truncation; a mark records
    # the small rolling state at a block boundary (entries are append-only: a count suffices) ---

    def mark(self) -> None:
        self._mark = (self.length, self._rolling_now())

    def _rolling_now(self) -> list[tuple[LayerCache, tuple[int, int]]]:
        """Per layer, a copy of the rolling state (no entries) and the compressor's and indexer's entry counts.
        Copies, not references: the rolling tensors are small, and copying keeps a mark valid even if a layer
        someday updates them in place."""
        layers = []
        for layer in self.layers:
            copy = LayerCache(layer.window.copy())
            copy.compressor = None if layer.compressor is None else layer.compressor.copy(0, 0)
            copy.indexer = None if layer.indexer is None else layer.indexer.copy(0, 0)
            counts = tuple(0 if c is None else c.count for c in (layer.compressor, layer.indexer))
            layers.append((copy, counts))
        return layers

    def _rolling_at(self, length: int) -> list[tuple[LayerCache, tuple[int, int]]]:
        """The rolling state at ``length``: the current length, or the last :meth:`mark`'s."""
        if length == self.length:
            return self._rolling_now()
        marked_length, marked = self._mark or (None, [])
        if length != marked_length:
            raise ValueError(
                f"DeepSeek-V4 state at {length} tokens is gone (cache at {self.length}, mark at "
                f"{marked_length}); its window and compressors cannot be rewound"
            )
        return marked

    def snapshot(self, length: int) -> DeepseekV4Cache:
        """The state at ``length``: the current length, or the length of the last :meth:`mark`."""
        if length == self.length:
            return self.clone_into(length)
        layers = []
        for (rolling, counts), live in zip(self._rolling_at(length), self.layers, strict=True):
            layer = rolling.copy()
            for name, count in zip(("compressor", "indexer"), counts, strict=True):
                state, source = getattr(layer, name), getattr(live, name)
                if state is not None:  # emitted entries are append-only: the live ones up to the mark's count
                    state.entries = source.entries.copy(count, count)
                    state.count = count
            layers.append(layer)
        snap = DeepseekV4Cache(layers, length)
        snap.length = length
        return snap

    def clone_into(self, max_tokens: int, length: int | None = None) -> DeepseekV4Cache:
        if length not in (None, self.length) or max_tokens < self.length:
            raise ValueError(f"cannot clone a {self.length}-token DeepSeek-V4 cache as {length} tokens in {max_tokens}")
        clone = DeepseekV4Cache([layer.copy(max_tokens) for layer in self.layers], max_tokens)
        clone.length = self.length
        return clone

    def reset(self) -> bool:
        """Empty, as a new cache of the same size, in place: the same tensors (and serial), so decode graphs captured
        over them replay for the next sequence (:mod:`moetier.engine.spare_caches`). False for paged stores."""
        if not self.contiguous:
            return False
        for layer in self.layers:
            layer.window.reset()
            for state in layer.states():
                state.reset()
        self.restart(0)
        return True

    def restart(self, length: int, keeps_entries: bool = False) -> None:
        """Now a new sequence's state of ``length`` tokens (written in place): no mark, and the snapshots borrowing
        the old entries are stale; with ``keeps_entries`` (the entries of the first ``length`` tokens are this
        cache's own already) only those borrowing past ``length``."""
        self.length, self._mark = length, None
        self.restarts.append(length if keeps_entries else 0)

    def borrowed_snapshot(self, length: int) -> SequenceCache | None:
        """The state at ``length`` (as :meth:`snapshot`) borrowing this cache's entries
        (:class:`~moetier.models.deepseek_v4_snapshot.BorrowedSnapshot`); None for paged stores."""
        from moetier.models.deepseek_v4_snapshot import BorrowedSnapshot  # it builds on this module

        return BorrowedSnapshot(self, length, self._rolling_at(length)) if self.contiguous else None

    def copy_into(self, target: SequenceCache, length: int | None = None) -> bool:
        """This state (at its length: it cannot be rewound) into ``target``, another V4 cache of this model with
        room for it, in place: as :meth:`clone_into` into ``target``'s own tensors. False for paged stores."""
        if not isinstance(target, DeepseekV4Cache) or not (self.contiguous and target.contiguous):
            return False
        if length not in (None, self.length) or target.max_tokens < self.length:
            raise ValueError(f"cannot copy a {self.length}-token DeepSeek-V4 cache into one of {target.max_tokens}")
        for source, layer in zip(self.layers, target.layers, strict=True):
            source.window.copy_into(layer.window)
            for state, into in zip(source.states(), layer.states(), strict=True):
                state.copy_into(into, state.count)
        target.restart(self.length)
        return True

    @property
    def contiguous(self) -> bool:
        """Whether every entry store is preallocated rows (not paged blocks)."""
        return all(type(state.entries) is KVRows for layer in self.layers for state in layer.states())

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def row_stores(self) -> list:
        """The compressors' and indexers' entries (the windows are a few fixed rows, never paged)."""
        states = [s for layer in self.layers for s in (layer.compressor, layer.indexer) if s is not None]
        return [state.entries for state in states]
