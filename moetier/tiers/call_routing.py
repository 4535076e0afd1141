"""A tiered dispatch call's routing: its (token, expert) pairs sorted by expert, grouped per expert.

The tiered dispatcher decides every placement on the host from these groups; decode calls are a few
streams x top-k pairs, so their sort runs in plain Python (a handful of list operations cost less than
the half-dozen torch calls of a tensor sort), prefill chunks' tens of thousands of pairs in torch: on the
device when the ids are there (:func:`sort_pairs_for_device`; a host sort of a 8192-token chunk's pairs
took ~17 ms on the H100 machine's host, and its order went back to the device afterwards).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch

from moetier.profiling import phase
from moetier.tiers.decode_inputs import HostInputs
from moetier.tiers.expert_cache import Slot

# Up to this many pairs (decode: a few streams x top-k) are sorted in plain Python.
SMALL_ROUTING_PAIRS = 256
_NO_WAIT = contextlib.nullcontext()


@dataclass
class Group:
    """One expert's pairs in this call: ``pairs`` index the expert-sorted pair arrays."""

    expert: int
    start: int
    count: int
    slot: Slot | None = None  # cache slot when a hit, or the slot an admitted miss is copied into

    @property
    def pairs(self) -> slice:
        return slice(self.start, self.start + self.count)


@dataclass
class Routing:
    """The call's pairs sorted by expert, on the host and (once :meth:`to_device` ran) on the device.

    A decode call also has its :class:`HostInputs`; its device tensors are made after its CPU job is
    submitted, and only when the device has experts of the call to run (only they read them).
    """

    groups: list[Group]
    order_host: torch.Tensor  # int64 [P]: the pair (in [token, k] order) at each sorted position
    tokens_host: torch.Tensor  # int64 [P]: token of each sorted pair
    topk_weights: torch.Tensor  # [T, K] the router's weights, on the device
    host: HostInputs | None = None
    tokens_dev: torch.Tensor | None = None
    gates_dev: torch.Tensor | None = None  # [P] routing weight of each sorted pair

    def to_device(self, device: torch.device) -> None:
        """The sorted pairs' tokens and gates on ``device`` (:func:`sorted_pairs_on_device`)."""
        pairs = sorted_pairs_on_device(self.order_host, self.tokens_host, self.topk_weights, device)
        self.tokens_dev, self.gates_dev = pairs


@dataclass
class Copies:
    """A call's copy-path experts: copied into their cache slot, staged (slot in hand), waiting for a slot."""

    direct: list[Group]
    staged: list[tuple[Group, Slot]] = field(default_factory=list)
    waiting: deque[Group] = field(default_factory=deque)


def sorted_pairs_on_device(
    order_host: torch.Tensor, tokens_host: torch.Tensor, topk_weights: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sorted pair's token and routing weight on ``device``: one host-to-device copy and one gather."""
    order_dev, tokens_dev = torch.stack((order_host, tokens_host)).to(device, non_blocking=True)
    return tokens_dev, topk_weights.reshape(-1)[order_dev]


def sort_pairs_for_device(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs`, and each sorted pair's token and routing weight on the ids' device.

    A large call with ids on an accelerator sorts there (stable, so the order is the host sort's) and reads
    the order and the per-expert counts back in one copy; otherwise the host sorts and the pairs are copied
    over (:func:`sorted_pairs_on_device`). Returns ``(order_host, experts, counts, tokens_dev, gates_dev)``.
    """
    flat, top_k = topk_ids.reshape(-1), topk_ids.shape[1]
    if flat.device.type == "cpu" or flat.numel() <= SMALL_ROUTING_PAIRS:
        order_host, experts, counts = sort_pairs(topk_ids)
        tokens_dev, gates_dev = sorted_pairs_on_device(order_host, order_host // top_k, topk_weights, flat.device)
        return order_host, experts, counts, tokens_dev, gates_dev
    with phase("tiers.wait"):  # the host waits for the router's ids (bincount reads the largest, then the read-back)
        order_dev, by_expert = _sort_on_device(flat, num_experts)
        both = torch.cat((order_dev, by_expert)).cpu()
    order_host, experts, counts = _split_read_back(both, flat.numel())
    return order_host, experts, counts, order_dev // top_k, topk_weights.reshape(-1)[order_dev]


def _sort_on_device(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable expert order of ``flat``'s pairs and each expert's pair count, where ``flat`` lies."""
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _split_read_back(both: torch.Tensor, pairs: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """``[order; counts per expert]`` read back: the order, the experts with pairs and their counts."""
    per_expert = both[pairs:]
    experts = per_expert.nonzero().flatten()
    return both[:pairs], experts.tolist(), per_expert[experts].tolist()


def sort_pairs(topk_ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """Pair order sorted by expert (stable, int64 on the host), the distinct experts and their pair counts.

    Reading ``topk_ids`` on the host waits for the device to have computed them (phase ``tiers.wait``).
    """
    flat = topk_ids if topk_ids.dim() == 1 else topk_ids.reshape(-1)
    small = flat.numel() <= SMALL_ROUTING_PAIRS
    with phase("tiers.wait") if flat.is_cuda else _NO_WAIT:
        ids = flat.tolist() if small else flat.cpu()
    return _sort_small(ids) if small else _sort_large(ids)


def _sort_small(ids: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    order = sorted(range(len(ids)), key=ids.__getitem__)
    experts: list[int] = []
    counts: list[int] = []
    for pair in order:
        if experts and experts[-1] == ids[pair]:
            counts[-1] += 1
        else:
            experts.append(ids[pair])
            counts.append(1)
    return torch.tensor(order, dtype=torch.int64), experts, counts


def _sort_large(ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    order = torch.argsort(ids, stable=True)
    experts, counts = torch.unique_consecutive(ids[order], return_counts=True)
    return order, experts.tolist(), counts.tolist()


def add_rows(out: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    """``out[rows] += values`` (``rows`` None: every row, in order)."""
    if rows is None:
        out.add_(values)
    else:
        out.index_add_(0, rows, values)
