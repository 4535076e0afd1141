"""Per-sequence DeepSeek-V4 attention state: sliding-window keys, compressor rolling state, compressed entries.

Contiguous and per sequence (the paged engine replaces it). Memory per layer is the window
(``sliding_window - 1`` keys), at most ``rate - 1`` open-window projections, one overlap half for
CSA, and the compressed entries, preallocated for ``max_tokens // rate`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import ConfigError
from moetier.models.base import SequenceCache


class SlidingWindowKV:
    """The last ``window - 1`` keys of one layer (V4 uses one tensor as both key and value)."""

    def __init__(self, window: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keep = window - 1
        self.keys = torch.empty(0, dim, dtype=dtype, device=device)

    def extend(self, new: torch.Tensor) -> torch.Tensor:
        """Append ``new`` (``[T, D]``); return the kept keys followed by ``new``, the keys the new queries see."""
        keys = torch.cat([self.keys, new])
        self.keys = keys[max(keys.shape[0] - self.keep, 0) :].clone() if self.keep else keys[:0]
        return keys


class CompressorState:
    """Rolling state of one compressor.

    ``open_kv``/``open_gate`` hold the raw projections of the tokens of the still-open window;
    ``prev_kv``/``prev_gate`` (overlapping CSA windows only) the first half of the last closed window,
    gate already biased, which the next entry pools; ``entries[:count]`` the emitted entries.
    """

    def __init__(
        self, rate: int, width: int, dim: int, max_entries: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.rate = rate
        self.open_kv = torch.empty(0, width, dtype=dtype, device=device)
        self.open_gate = torch.empty(0, width, dtype=dtype, device=device)
        self.prev_kv: torch.Tensor | None = None
        self.prev_gate: torch.Tensor | None = None
        self.entries = torch.empty(max_entries, dim, dtype=dtype, device=device)
        self.count = 0

    def close_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add new tokens' projections; return the windows they close (``[n, rate, width]`` each) and the
        index of the first of them. The remainder stays open for the next call."""
        kv, gate = torch.cat([self.open_kv, kv]), torch.cat([self.open_gate, gate])
        closed = kv.shape[0] // self.rate * self.rate
        self.open_kv, self.open_gate = kv[closed:].clone(), gate[closed:].clone()
        shape = (closed // self.rate, self.rate, kv.shape[1])
        return kv[:closed].view(shape), gate[:closed].view(shape), self.count

    def append(self, entries: torch.Tensor) -> None:
        end = self.count + entries.shape[0]
        if end > self.entries.shape[0]:
            raise ConfigError(f"{end} compressed entries exceed the cache's {self.entries.shape[0]}")
        self.entries[self.count : end] = entries
        self.count = end

    @property
    def emitted(self) -> torch.Tensor:
        return self.entries[: self.count]


@dataclass
class LayerCache:
    """One layer's state: the window, plus the compressor (CSA/HCA) and the indexer's compressor (CSA)."""

    window: SlidingWindowKV
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class DeepseekV4Cache(SequenceCache):
    """All layers' state of one sequence; ``length`` tokens have been consumed."""

    def __init__(self, layers: list[LayerCache], max_tokens: int) -> None:
        self.layers = layers
        self.max_tokens = max_tokens
        self.length = 0

    def check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.max_tokens:
            raise ConfigError(f"sequence of {self.length + num_tokens} tokens exceeds the cache size {self.max_tokens}")

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
