"""A decode call's routed experts with their launch table built on the device: no host sync.

:func:`~moetier.kernels.grouped_experts.run_grouped` builds its launch table on the host from the
expert-sorted pairs, so the host first waits for the router's ids, once per MoE layer. Where every expert
of a layer is in device memory (the resident store), the table can be made on the device instead, from
the ids themselves: every (token, k) pair is its own group of one, each group's block offset is
gathered from the layer's table of offsets, and each token's pairs are summed in increasing expert order
(a per-token sort), the order the host table gives. Each pair's arithmetic is the host path's (a group's
tokens are computed row by row), so the results are the same bits; an expert two tokens share is read
twice, which only decode's few tokens make cheap (``DEVICE_ROUTING_MAX_PAIRS``). Every shape depends only
on the number of tokens and top-k, so the call can run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.kernels import grouped_experts
from moetier.kernels.grouped_experts import MAX_GROUP_TOKENS, Fp4Blocks, LaunchLayout, launch_grouped
from moetier.kernels.rmsnorm import triton_usable
from moetier.kernels.routing_table import (
    CallSplit,
    FeedTarget,
    build_table,
    row_width,
    split_rows,
    split_skip,
    table_kernel_usable,
)
from moetier.tiers.experts import ExpertWeights

# Calls of at most this many (token, expert) pairs take the device table: a few streams of decode.
DEVICE_ROUTING_MAX_PAIRS = 64
# A device-built call: its launch table, layout, each pair's token, and each pair's intermediate rows on the device
# (None: every row; a split expert's first rows, see routing_table.CallSplit).
Routed = tuple[torch.Tensor, LaunchLayout, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class LayerBlocks:
    """One MoE layer's expert blocks as the grouped kernels address them.

    ``first`` is expert 0 (the kernels' base pointer and the layout every expert shares), ``offsets`` each
    expert's byte offset from its block (int64, on the blocks' device), ``align`` 16 when every block is
    16-byte aligned, ``placement`` the kernels' constants for the layout.
    """

    first: ExpertWeights
    offsets: torch.Tensor
    align: int
    placement: tuple

    @classmethod
    def of(cls, experts: list[ExpertWeights], dtype: torch.dtype) -> LayerBlocks | None:
        """The layer's blocks, or None when the grouped kernels do not take them all as one layout in
        ``dtype`` activations (then the host-table path decides per call)."""
        if not experts:
            return None
        probe = torch.empty((1, 1), dtype=dtype, device=experts[0].block.device)
        placement = grouped_experts._grouped_placement(probe, [(w, 0, 1) for w in experts])
        if placement is None:
            return None
        base = experts[0].block.data_ptr()
        deltas = [w.block.data_ptr() - base for w in experts]
        align = 16 if base % 16 == 0 and all(d % 16 == 0 for d in deltas) else 1
        offsets = torch.tensor(deltas, dtype=torch.int64, device=experts[0].block.device)
        return cls(experts[0], offsets, align, placement)


def device_tables(
    offsets: torch.Tensor, topk_ids: torch.Tensor, align: int = 16, skip: torch.Tensor | None = None
) -> tuple[torch.Tensor, LaunchLayout, torch.Tensor]:
    """The launch table for ``topk_ids`` ``[T, K]`` on their device, its layout (``align``: the blocks'), and
    each pair's token.

    Pairs are in ``[token, k]`` order, one group each: groups ``(offset, pair, 1)``, pairs ``(pair, offset)``,
    tokens ``(token, its K pairs by increasing expert id, -1 padding to a power of two)``. A pair ``skip``
    (bool ``[T, K]``) marks is left to another tier: its group has no tokens, its pair row is ``-1`` and its
    token leaves it out, so the kernels read none of its expert (shapes unchanged: still graph-safe).
    """
    tokens, top_k = topk_ids.shape
    pairs, device = tokens * top_k, topk_ids.device
    flat = topk_ids.reshape(-1)
    block = offsets[flat]
    pair = torch.arange(pairs, dtype=torch.int64, device=device)
    one = torch.ones_like(pair)
    width = row_width(top_k)
    order = torch.argsort(topk_ids, dim=1, stable=True)
    by_expert = order + pair.view(tokens, top_k)[:, :1]
    down_pair = pair
    if skip is not None:
        none = torch.full_like(pair, -1)
        one, down_pair = (~skip).reshape(-1).to(torch.int64), torch.where(skip.reshape(-1), none, pair)
        by_expert = torch.where(skip.gather(1, order), none.view(tokens, top_k), by_expert)
    token = torch.arange(tokens, dtype=torch.int64, device=device)[:, None]
    padding = torch.full((tokens, width - top_k), -1, dtype=torch.int64, device=device)
    table = torch.cat(
        (
            torch.stack((block, pair, one), dim=1).reshape(-1),
            torch.stack((down_pair, block), dim=1).reshape(-1),
            torch.cat((token, by_expert, padding), dim=1).reshape(-1),
        )
    )
    layout = routed_layout(tokens, top_k, align)
    return table, layout, pair // top_k


def device_routing_fits(hidden: torch.Tensor, tokens: int, pairs: int) -> bool:
    """Whether a call of ``tokens`` tokens and ``pairs`` (token, expert) pairs over ``hidden``'s device takes
    the device table: a decode-sized call the kernels can run.

    At most ``MAX_GROUP_TOKENS`` tokens: then no expert's run of tokens outgrows the grouped kernels' token
    tile, so the host path would run these kernels too and the two give the same bits. A longer call's host
    path sends its larger groups to per-expert GEMMs, whose float32 sums differ in the last bits (measured on
    the H200: a 23-token prefill of the tiny V4, 3e-7 relative), so it keeps the host path.
    """
    small = 0 < tokens <= MAX_GROUP_TOKENS and 0 < pairs <= DEVICE_ROUTING_MAX_PAIRS
    return small and not grouped_experts._BROKEN and triton_usable(hidden)


def routed_table(
    blocks: LayerBlocks,
    topk_ids: torch.Tensor,
    pick: torch.Tensor | None = None,
    feed: FeedTarget | None = None,
    gates: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    split: CallSplit | None = None,
    cpu_counts: torch.Tensor | None = None,
) -> Routed:
    """The call's launch table, its layout, each pair's token and (a ``split`` with ``unit_rows``) each pair's rows
    on the device: one kernel where it runs (:func:`~moetier.kernels.routing_table.build_table`, also writing the
    CPU tier's inbox for ``feed``), else :func:`device_tables`' torch ops. ``pick`` (uint8 ``[E]``) marks the
    experts whose pairs are left out (with ``split``: those the CPU may take, split per call), each left-out pair
    counted into ``cpu_counts``; ``feed`` needs the kernel
    (:func:`~moetier.kernels.routing_table.table_kernel_usable`)."""
    tokens, top_k = topk_ids.shape
    if not table_kernel_usable(topk_ids):
        if feed is not None:
            raise ValueError("device_routing: feeding the CPU tier's inbox needs the table kernel")
        if split is not None and split.unit_rows:
            raise ValueError("device_routing: splitting an expert's rows needs the table kernel")
        skip = None if pick is None else left_to_cpu(topk_ids, pick, split, cpu_counts)[0]
        return (*device_tables(blocks.offsets, topk_ids, blocks.align, skip), None)
    table, pair_tokens, rows = build_table(blocks.offsets, topk_ids, pick, feed, gates, hidden, split, cpu_counts)
    return table, routed_layout(tokens, top_k, blocks.align), pair_tokens, rows


def left_to_cpu(
    topk_ids: torch.Tensor, pick: torch.Tensor, split: CallSplit | None, cpu_counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pairs (bool ``[T, K]``) the table kernel would leave out for ``pick`` and ``split``, counted into
    ``cpu_counts`` as it counts them, and (a split in parts of an expert's rows) each pair's rows on the device
    (:func:`~moetier.kernels.routing_table.split_rows`; else None). Torch ops: where the kernel does not run."""
    rows = None
    if split is None:
        skip = pick[topk_ids].bool()
    elif split.unit_rows:
        skip, rows = split_rows(topk_ids, pick, split)
    else:
        skip = split_skip(topk_ids, pick, split)
    if cpu_counts is not None:
        taken = topk_ids.reshape(-1)[skip.reshape(-1)]
        cpu_counts.index_add_(0, taken, torch.ones_like(taken, dtype=cpu_counts.dtype))
    return skip, rows


def routed_layout(tokens: int, top_k: int, align: int) -> LaunchLayout:
    """Where a device-built table's parts start: ``T*K`` groups of 3, ``T*K`` pairs of 2, ``T`` token rows."""
    pairs = tokens * top_k
    return LaunchLayout(pairs, 3 * pairs, 5 * pairs, pairs, row_width(top_k), tokens, align)


def launch_routed(
    out: torch.Tensor,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: LayerBlocks,
    swiglu_limit: float | None,
    routed: Routed,
    fp4: Fp4Blocks | None = None,
) -> None:
    """The grouped kernels over a table from :func:`routed_table`, adding into ``out`` (float32 ``[T, H]``);
    ``fp4``: the fp4 kernels' block sizes (default: the module's current ones)."""
    table, layout, pair_tokens, rows = routed
    gates = topk_weights.reshape(-1)
    first, placement = blocks.first, blocks.placement
    launch_grouped(out, hidden, pair_tokens, gates, first, placement, swiglu_limit, table, layout, fp4, rows)


def run_routed(
    out: torch.Tensor,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: LayerBlocks,
    swiglu_limit: float | None,
    pick: torch.Tensor | None = None,
) -> None:
    """Add every pair's ``weight * expert(hidden[token])`` into ``out`` (float32 ``[T, H]``), but those of the
    experts ``pick`` marks, the table built on the device (:func:`routed_table`); the caller checked
    :func:`device_routing_fits`."""
    launch_routed(out, hidden, topk_weights, blocks, swiglu_limit, routed_table(blocks, topk_ids, pick))
