"""Contiguous per-sequence KV caches for the simple generation loop (the paged engine replaces them)."""

from __future__ import annotations

import torch

from moetier.errors import ConfigError
from moetier.models.base import SequenceCache


class ContiguousKVCache(SequenceCache):
    """Preallocated ``[heads, max_tokens, dim]`` key and value tensors for every layer.

    Layers write at ``self.length`` during a forward; the model advances ``length`` once per
    forward via :meth:`advance`, after all layers have written.
    """

    truncatable = True  # a token's entries never depend on later tokens

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        max_tokens: int,
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.length = 0
        self.max_tokens = max_tokens
        self.keys = [torch.empty(kv_heads, max_tokens, key_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [
            torch.empty(kv_heads, max_tokens, value_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` (``[heads, T, dim]``) after the cached tokens; return all keys/values so far."""
        end = self.length + key.shape[1]
        if end > self.max_tokens:
            raise ConfigError(f"sequence of {end} tokens exceeds the cache size {self.max_tokens}")
        self.keys[layer][:, self.length : end] = key
        self.values[layer][:, self.length : end] = value
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def snapshot(self, length: int) -> ContiguousKVCache:
        return self.clone_into(length, length)

    def clone_into(self, max_tokens: int, length: int | None = None) -> ContiguousKVCache:
        length = self.length if length is None else length
        if not 0 <= length <= min(self.length, max_tokens):
            raise ValueError(f"cannot copy {length} tokens of a {self.length}-token cache into {max_tokens}")
        keys, values = self.keys[0], self.values[0]
        heads, key_dim, value_dim = keys.shape[0], keys.shape[2], values.shape[2]
        clone = ContiguousKVCache(len(self.keys), heads, max_tokens, key_dim, value_dim, keys.dtype, keys.device)
        for src, dst in zip(self.keys + self.values, clone.keys + clone.values, strict=True):
            dst[:, :length] = src[:, :length]
        clone.length = length
        return clone

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
