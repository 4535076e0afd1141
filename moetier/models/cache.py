"""Contiguous per-sequence KV caches for the simple generation loop (the paged engine replaces them),
and :class:`KVRows`, the token-row storage they share: model dtype, bf16, or fp8 with scales.

fp8 storage (``kv_dtype="fp8"``) keeps float8 e4m3 values and one float32 scale per token per row
group (a KV head's keys, a head's values, MLA's latent and its rope key). Per-token scales rather
than a 16-token block: a decode step writes one token, and a block scale would either re-quantise the
block's earlier tokens (their stored values would depend on later tokens, breaking prefix snapshots
at any length) or keep an open block in the model dtype. The cost is 4 bytes per row group per token
(3% of a 128-wide bf16 head's 256 bytes; fp8 rows take 128 + 4). Values are quantised on write and
dequantised to the compute dtype on read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moetier.errors import ConfigError
from moetier.kernels.kv_read import try_read_rows
from moetier.models.base import SequenceCache

KV_DTYPES = ("auto", "bf16", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: a group's absolute maximum maps here


def kv_storage_dtype(kv_dtype: str | None, compute_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``kv_dtype``: ``None``/``"auto"`` the compute dtype, ``"bf16"``, ``"fp8"`` (e4m3fn)."""
    if kv_dtype is None or kv_dtype == "auto":
        return compute_dtype
    if kv_dtype == "bf16":
        return torch.bfloat16
    if kv_dtype == "fp8":
        return FP8_DTYPE
    raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None), got {kv_dtype!r}")


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> (e4m3fn values ``[..., D]``, float32 scales ``[..., 1]``) with ``x ~ values * scale``."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # An all-zero group gets scale 1 (its values are exact zeros); tiny scales would overflow on divide.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class KVRows:
    """Preallocated rows ``[*lead, capacity, width]`` (token axis -2) in ``storage`` dtype, read back in ``dtype``.

    With fp8 storage the width splits into ``groups`` (sizes summing to ``width``; default one group)
    and ``scales[..., t, g]`` holds token ``t``'s scale for group ``g``.
    """

    def __init__(
        self,
        lead: Sequence[int],
        capacity: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:
        self.dtype = dtype
        self.groups = tuple(groups or (width,))
        if sum(self.groups) != width or min(self.groups) < 1:
            raise ValueError(f"row groups {self.groups} must be positive and sum to the width {width}")
        storage = kv_storage_dtype(kv_dtype, dtype)
        self.data = torch.empty(*lead, capacity, width, dtype=storage, device=device)
        self.scales: torch.Tensor | None = None
        if storage == FP8_DTYPE:
            self.scales = torch.empty(*lead, capacity, len(self.groups), dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[-2]

    @property
    def kv_dtype(self) -> str | None:
        if self.scales is not None:
            return "fp8"
        return None if self.data.dtype == self.dtype else "bf16"

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[*lead, T, width]``) at token ``start``."""
        end = start + rows.shape[-2]
        if self.scales is None:
            self.data[..., start:end, :] = rows
            return
        for g, (offset, part) in enumerate(self._split(rows)):
            values, scale = quantize_fp8(part)
            self.data[..., start:end, offset : offset + part.shape[-1]] = values
            self.scales[..., start:end, g : g + 1] = scale

    def write_where(self, index: torch.Tensor, rows: torch.Tensor, when: torch.Tensor) -> None:
        """Store ``rows`` (``[n, width]``, no lead dims) at token rows ``index`` (int64 ``[n]``, on the device) where
        ``when`` (bool ``[n]``) holds; elsewhere the stored bytes are written back unchanged. No host value
        decides anything: a CUDA graph can replay it (a static decode step's entry, written when it closes)."""
        keep = when[:, None]
        if self.scales is None:
            current = self.data.index_select(0, index)
            self.data.index_copy_(0, index, torch.where(keep, rows.to(self.data.dtype), current))
            return
        raw = self.data.view(torch.uint8)  # index kernels lack float8 on some devices: the same bits as uint8
        for g, (offset, part) in enumerate(self._split(rows)):
            values, scale = quantize_fp8(part)
            columns = raw[:, offset : offset + part.shape[-1]]
            columns.index_copy_(0, index, torch.where(keep, values.view(torch.uint8), columns.index_select(0, index)))
            group = self.scales[:, g : g + 1]
            group.index_copy_(0, index, torch.where(keep, scale, group.index_select(0, index)))

    def read(self, end: int) -> torch.Tensor:
        """Rows ``[0, end)`` in the compute dtype (``[*lead, end, width]``); a view when stored in it."""
        data = self.data[..., :end, :]
        if self.scales is None:
            return data if data.dtype == self.dtype else data.to(self.dtype)
        fused = try_read_rows(self.data, self.scales, self.groups, end, self.dtype, token_axis=-2)
        if fused is not None:  # one kernel on CUDA instead of ~5 ops
            return fused
        return self._dequantize(data, self.scales[..., :end, :])

    def read_at(self, index: torch.Tensor) -> torch.Tensor:
        """The rows at ``index`` (int64 ``[n]``, each below the rows written) in the compute dtype,
        ``[*lead, n, width]``: a reader that needs a few rows (V4's top-k entries) converts only those."""
        if self.scales is None:
            rows = self.data.index_select(-2, index)
            return rows if rows.dtype == self.dtype else rows.to(self.dtype)
        n = index.shape[0]
        fused = try_read_rows(self.data, self.scales, self.groups, n, self.dtype, token_axis=-2, index=index)
        if fused is not None:
            return fused
        # Index kernels lack float8 on some devices: fp8 bytes move as uint8 (same bits).
        data = self.data.view(torch.uint8).index_select(-2, index).view(self.data.dtype)
        return self._dequantize(data, self.scales.index_select(-2, index))

    def _dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp8 rows and their per-group scales (token axis -2) -> the compute dtype."""
        parts = [part.float() * scales[..., g : g + 1] for g, (_, part) in enumerate(self._split(data))]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(self.dtype)

    def _split(self, rows: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        offsets = [sum(self.groups[:g]) for g in range(len(self.groups))]
        return list(zip(offsets, rows.split(self.groups, dim=-1), strict=True))

    def copy(self, capacity: int, length: int) -> KVRows:
        """A new store of ``capacity`` tokens holding this one's first ``length`` rows (values and scales)."""
        clone = KVRows.__new__(KVRows)
        clone.dtype, clone.groups = self.dtype, self.groups
        clone.data = self.data.new_empty(*self.data.shape[:-2], capacity, self.data.shape[-1])
        clone.data[..., :length, :] = self.data[..., :length, :]
        clone.scales = None
        if self.scales is not None:
            clone.scales = self.scales.new_empty(*self.scales.shape[:-2], capacity, self.scales.shape[-1])
            clone.scales[..., :length, :] = self.scales[..., :length, :]
        return clone

    def copy_rows_into(self, target: KVRows, length: int) -> None:
        """This store's first ``length`` rows (values and scales) into ``target``, a store of the same rows in place
        (its tensors kept)."""
        same = type(target) is KVRows and target.data.dtype == self.data.dtype and target.groups == self.groups
        if not same or target.data.shape[:-2] != self.data.shape[:-2] or target.data.shape[-1] != self.data.shape[-1]:
            raise ValueError("rows copy between stores of different layouts")
        if length > target.capacity:
            raise ValueError(f"cannot copy {length} rows into a store of {target.capacity}")
        target.data[..., :length, :] = self.data[..., :length, :]
        if self.scales is not None:
            target.scales[..., :length, :] = self.scales[..., :length, :]

    @property
    def nbytes(self) -> int:
        tensors = [self.data] if self.scales is None else [self.data, self.scales]
        return sum(t.numel() * t.element_size() for t in tensors)


def kv_rows(
    lead: Sequence[int],
    capacity: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_dtype: str | None = None,
    groups: Sequence[int] | None = None,
) -> KVRows:
    """A row store (arguments as :class:`KVRows`): paged blocks inside ``moetier.models.paged_kv.paged_kv``,
    else preallocated rows. Every cache builds the state that grows with the context through this."""
    from moetier.models.paged_kv import PagedKVRows, active_space  # paged_kv builds on this module

    space = active_space()
    if space is None:
        return KVRows(lead, capacity, width, dtype, device, kv_dtype, groups)
    return PagedKVRows(space, lead, capacity, width, dtype, kv_dtype, groups)


class ContiguousKVCache(SequenceCache):
    """Preallocated ``[heads, max_tokens, dim]`` key and value rows for every layer.

    Layers write at ``self.length`` during a forward; the model advances ``length`` once per
    forward via :meth:`advance`, after all layers have written. ``kv_dtype`` picks the storage
    (see the module docstring; fp8 scales are per token per KV head, keys and values apart).
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
        kv_dtype: str | None = None,
    ) -> None:
        self.length = 0
        self.max_tokens = max_tokens
        self.keys = [kv_rows((kv_heads,), max_tokens, key_dim, dtype, device, kv_dtype) for _ in range(num_layers)]
        self.values = [kv_rows((kv_heads,), max_tokens, value_dim, dtype, device, kv_dtype) for _ in range(num_layers)]

    @property
    def kv_dtype(self) -> str | None:
        return self.keys[0].kv_dtype if self.keys else None

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` (``[heads, T, dim]``) after the cached tokens; return all keys/values so far."""
        end = self.length + key.shape[1]
        if end > self.max_tokens:
            raise ConfigError(f"sequence of {end} tokens exceeds the cache size {self.max_tokens}")
        self.keys[layer].write(self.length, key)
        self.values[layer].write(self.length, value)
        return self.keys[layer].read(end), self.values[layer].read(end)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def snapshot(self, length: int) -> ContiguousKVCache:
        return self.clone_into(length, length)

    def clone_into(self, max_tokens: int, length: int | None = None) -> ContiguousKVCache:
        length = self.length if length is None else length
        if not 0 <= length <= min(self.length, max_tokens):
            raise ValueError(f"cannot copy {length} tokens of a {self.length}-token cache into {max_tokens}")
        clone = ContiguousKVCache.__new__(ContiguousKVCache)
        clone.max_tokens, clone.length = max_tokens, length
        clone.keys = [rows.copy(max_tokens, length) for rows in self.keys]
        clone.values = [rows.copy(max_tokens, length) for rows in self.values]
        return clone

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.keys + self.values)

    def row_stores(self) -> list[KVRows]:
        return [*self.keys, *self.values]
