"""Per-sequence DeepSeek-V4 attention state: sliding-window keys, compressor rolling state, compressed entries.

Contiguous and per sequence (the paged engine replaces it). Memory per layer is the window
(``sliding_window - 1`` keys plus up to :attr:`SlidingWindowKV.SLACK` rows of room to append in place),
the open window's projections (``rate`` rows, preallocated), one overlap half for CSA, and the
compressed entries, preallocated for ``max_tokens // rate`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import ConfigError
from moetier.models.base import SequenceCache
from moetier.models.cache import kv_rows


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
    """The last ``window - 1`` keys of one layer (V4 uses one tensor as both key and value).

    The keys are rows ``[start, start + length)`` of a buffer with room for ``slack`` more rows, so a decode
    step appends its key in place (one copy) and hands back a view; only when the room runs out (every
    ``slack`` decode steps, or a long chunk) are the kept keys moved back to the front.
    """

    SLACK = 64

    def __init__(self, window: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keep = window - 1
        self.buffer = torch.empty(0, dim, dtype=dtype, device=device)
        self.start = self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        """The kept keys ``[<= window - 1, D]`` (a view)."""
        return self.buffer[self.start : self.start + self.length]

    def extend(self, new: torch.Tensor, writes: RowWrites | None = None) -> torch.Tensor:
        """Append ``new`` (``[T, D]``); return the kept keys followed by ``new``, the keys the new queries see.

        The result may be a view of the buffer: valid until the next :meth:`extend`. With ``writes`` the copy
        of ``new`` into the buffer may be left to it (the view holds ``new`` once it is flushed).
        """
        if not self.keep:
            return new
        end, tokens = self.start + self.length, new.shape[0]
        if end + tokens <= self.buffer.shape[0]:
            if writes is None:
                self.buffer[end : end + tokens] = new
            else:
                writes.add(self.buffer[end : end + tokens], new)
            keys = self.buffer[self.start : end + tokens]
        else:
            keys = torch.cat([self.keys, new]) if self.length else new
            capacity = self.keep + min(self.SLACK, self.keep)
            if self.buffer.shape[0] < capacity:
                self.buffer = new.new_empty(capacity, new.shape[1])
            self.start = 0
            self.buffer[: min(keys.shape[0], self.keep)] = keys[-self.keep :]
            self.length = min(keys.shape[0], self.keep)
            return keys
        self.length = min(self.length + tokens, self.keep)
        self.start = end + tokens - self.length
        return keys

    def copy(self) -> SlidingWindowKV:
        """A compact deep copy (a buffer of exactly the kept keys; it grows on its next extend)."""
        clone = SlidingWindowKV.__new__(SlidingWindowKV)
        clone.keep, clone.buffer = self.keep, self.keys.clone()
        clone.start, clone.length = 0, self.length
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
        self.prev_kv: torch.Tensor | None = None
        self.prev_gate: torch.Tensor | None = None
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

    @property
    def nbytes(self) -> int:
        total = self.window.nbytes
        for state in (self.compressor, self.indexer):
            if state is not None:
                total += state.rolling_nbytes() + state.entries.nbytes
        return total


class DeepseekV4Cache(SequenceCache):
    """All layers' state of one sequence; ``length`` tokens have been consumed."""

    def __init__(self, layers: list[LayerCache], max_tokens: int) -> None:
        self.layers = layers
        self.max_tokens = max_tokens
        self.length = 0
        # (length, per layer: rolling-state copy and emitted-entry counts), set by mark().
        self._mark: tuple[int, list[tuple[LayerCache, tuple[int, int]]]] | None = None

    def check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.max_tokens:
            raise ConfigError(f"sequence of {self.length + num_tokens} tokens exceeds the cache size {self.max_tokens}")

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    # --- prefix caching: the window and compressors roll forward, so no truncation; a mark records
    # the small rolling state at a block boundary (entries are append-only: a count suffices) ---

    def mark(self) -> None:
        # Copies, not references: the rolling tensors are small, and copying keeps the mark valid
        # even if a layer someday updates them in place.
        layers = []
        for layer in self.layers:
            copy = LayerCache(layer.window.copy())
            copy.compressor = None if layer.compressor is None else layer.compressor.copy(0, 0)
            copy.indexer = None if layer.indexer is None else layer.indexer.copy(0, 0)
            counts = tuple(0 if c is None else c.count for c in (layer.compressor, layer.indexer))
            layers.append((copy, counts))
        self._mark = (self.length, layers)

    def snapshot(self, length: int) -> DeepseekV4Cache:
        """The state at ``length``: the current length, or the length of the last :meth:`mark`."""
        if length == self.length:
            return self.clone_into(length)
        marked_length, marked = self._mark or (None, [])
        if length != marked_length:
            raise ValueError(
                f"DeepSeek-V4 state at {length} tokens is gone (cache at {self.length}, mark at "
                f"{marked_length}); its window and compressors cannot be rewound"
            )
        layers = []
        for (rolling, counts), live in zip(marked, self.layers, strict=True):
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

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def row_stores(self) -> list:
        """The compressors' and indexers' entries (the windows are a few fixed rows, never paged)."""
        states = [s for layer in self.layers for s in (layer.compressor, layer.indexer) if s is not None]
        return [state.entries for state in states]
