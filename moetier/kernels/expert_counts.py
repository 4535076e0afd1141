"""A mapped decode call's use counts in one launch: which experts its pairs used, and which of them from a slot.

The mapped route counts every call on the device (:class:`~moetier.tiers.mapped.MappedExperts`), so the policy
and the metrics learn what a step used without the host waiting. In torch ops that is nine small kernels a MoE
layer (two ``index_add_``, an ``index_select``, a zeroing, an ``index_fill_``, two adds, a product and a fill):
~20 us of a 1-stream V4-Flash step's layer on an H100, in series with the call (the b9694d6 decode trace). Here
one program reads the call's pairs once and adds, per expert of the layer, into the five count rows:

- row 0: the pairs that used it; row 2: those that read it from a cache slot (``in_slot``, 1 or 0);
- row 3: the calls that used it (its first pair in the call counts); row 4: those calls reading it from a slot;
- row 1 (the pairs left to the CPU tier) is the table kernel's (:mod:`moetier.kernels.routing_table`).

Integer atomics make the sums independent of the order the adds land in, so the counts equal the torch ops'.
A call's pairs are at most ``DEVICE_ROUTING_MAX_PAIRS`` (one program holds them all; an expert's first pair is
found by comparing every pair with the ones before it). Off CUDA, or without Triton, the torch ops run.
"""

from __future__ import annotations

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs count with torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_COUNTED_PAIRS = 256  # one program's pairs (a power of two); decode's calls have at most 64
_BROKEN: list[str] = []


def count_uses(counts: torch.Tensor, in_slot: torch.Tensor, topk_ids: torch.Tensor, used: torch.Tensor) -> None:
    """Add one call's uses into ``counts`` (int64 ``[5, E]``: a layer's columns of the mapped route's count rows,
    a view whose rows may be strided), ``in_slot`` (int64 ``[E]``, 1 where the expert reads from a cache slot) and
    ``topk_ids`` (``[T, K]`` expert ids of the call). ``used`` (int64 ``[E]``) is the torch path's scratch."""
    flat = topk_ids.reshape(-1)
    kernel_or_reference(
        _BROKEN,
        "expert count kernel",
        kernel_takes(counts, in_slot, flat),
        lambda: _launch(counts, in_slot, flat),
        lambda: count_uses_reference(counts, in_slot, flat, used),
    )


def kernel_takes(counts: torch.Tensor, in_slot: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether the kernel counts this call (CUDA or Triton's interpreter; int64 rows with unit column strides)."""
    return (
        triton is not None
        and triton_usable(counts)
        and flat.numel() <= MAX_COUNTED_PAIRS
        and counts.dtype == in_slot.dtype == torch.int64
        and counts.stride(1) == 1
        and in_slot.is_contiguous()
    )


def count_uses_reference(counts: torch.Tensor, in_slot: torch.Tensor, flat: torch.Tensor, used: torch.Tensor) -> None:
    """The torch ops the kernel replaces (CPU; a kernel failure)."""
    ones = torch.ones_like(flat)
    counts[0].index_add_(0, flat, ones)
    counts[2].index_add_(0, flat, in_slot.index_select(0, flat))
    used.zero_().index_fill_(0, flat, 1)  # the call's distinct experts
    counts[3].add_(used)
    counts[4].add_(used.mul_(in_slot))


def _launch(counts: torch.Tensor, in_slot: torch.Tensor, flat: torch.Tensor) -> None:
    pairs = flat.numel()
    if pairs == 0:
        return
    block = max(16, triton.next_power_of_2(pairs))
    _count_kernel[(1,)](flat, pairs, in_slot, counts, counts.stride(0), BLOCK=block)


if triton is not None:

    @triton.jit
    def _count_kernel(ids_ptr, pairs, in_slot_ptr, counts_ptr, row_stride, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        valid = i < pairs
        ids = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int64)
        slot = tl.load(in_slot_ptr + ids, mask=valid, other=0)
        # A pair is its expert's first in the call when no earlier pair has the same id.
        earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]
        first = valid & (tl.max(earlier.to(tl.int32), axis=1) == 0)
        one = tl.full((BLOCK,), 1, tl.int64)
        column = counts_ptr + ids
        tl.atomic_add(column, one, mask=valid)
        tl.atomic_add(column + 2 * row_stride, slot, mask=valid)
        tl.atomic_add(column + 3 * row_stride, one, mask=first)
        tl.atomic_add(column + 4 * row_stride, slot, mask=first)
