"""A decode call's routing and token rows on the host, read with one wait for the device.

Decode of a few streams is bound by latency: the time from the router's ids reaching the host to both
miss routes running is on every MoE layer's critical path. So a decode call copies the ids, their
routing weights and the token rows the CPU tier reads into pinned buffers back to back on the compute
stream, and waits once. The CPU job is then built from host tensors alone (no gather on the device, no
second copy, no event for the worker to wait on), and submitted microseconds after the wait returns.

The buffers are reused by every layer and step, which is safe because of the stream order: a layer's
copies into them are enqueued after the compute stream's wait for the previous layer's CPU job (or after
the host waited for it), and a job writes its output buffer only after the host's wait for its own
routing, when the device has already copied the previous job's output back. Buffers are only replaced
(never written) when a call needs more rows; a pinned block torch frees is not reused before the copies
recorded on it have completed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetier.profiling import phase


@dataclass
class HostInputs:
    """What a decode call's placement and CPU job read on the host (flat in ``[token, k]`` pair order)."""

    ids: torch.Tensor  # [P] expert ids
    weights: torch.Tensor  # [P] routing weights
    hidden: torch.Tensor | None  # [T, H] the call's rows (None: no CPU tier for this call)


class HostBuffers:
    """Pinned (CUDA) buffers for :class:`HostInputs` and the CPU job's fp32 output, grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Views handed out, kept: every decode call asks for the same few shapes, and a view costs two torch
        # calls (a slice and a view, ~10 us each on the H200's host).
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A ``shape`` view of the buffer ``name`` (replaced by a larger one when it is too small)."""
        view = self._views.get((name, shape))
        if view is not None and view.dtype == dtype:
            return view
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, pin_memory=pinned)
            self._views = {key: v for key, v in self._views.items() if key[0] != name}  # views of the old one
        view = self._views[(name, shape)] = buffer[:numel].view(shape)
        return view


def read_host_inputs(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, buffers: HostBuffers, rows: bool
) -> HostInputs:
    """The call's ids and weights (and with ``rows`` its hidden rows) on the host: on CUDA three
    non-blocking copies into pinned buffers and one stream synchronisation; on the CPU the tensors."""
    if hidden.device.type != "cuda":
        return HostInputs(topk_ids.reshape(-1), topk_weights.reshape(-1), hidden if rows else None)
    # Copied in the router's [T, K] shape and read flat: two views of one buffer, no reshape on the device.
    shape, flat = tuple(topk_ids.shape), (topk_ids.numel(),)
    buffers.take("ids", shape, topk_ids.dtype, pinned=True).copy_(topk_ids, non_blocking=True)
    buffers.take("weights", shape, topk_weights.dtype, pinned=True).copy_(topk_weights, non_blocking=True)
    host_ids = buffers.take("ids", flat, topk_ids.dtype, pinned=True)
    host_weights = buffers.take("weights", flat, topk_weights.dtype, pinned=True)
    host_hidden = None
    if rows:
        host_hidden = buffers.take("hidden", tuple(hidden.shape), hidden.dtype, pinned=True)
        host_hidden.copy_(hidden, non_blocking=True)
    with phase("tiers.wait"):
        torch.cuda.current_stream(hidden.device).synchronize()
    return HostInputs(host_ids, host_weights, host_hidden)
