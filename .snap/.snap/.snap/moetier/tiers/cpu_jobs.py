"""A tiered dispatch call's CPU job: the groups' rows and gates as the CPU tier reads them.

A decode call's job is built from its host inputs alone (:mod:`moetier.tiers.decode_inputs`): every row of
the call, each group's tokens and gates as Python lists (a few pairs: cheaper than any torch call). A
streaming call's CPU-routed rows and gates are gathered from the device into pinned buffers by
non-blocking copies, with an event the worker waits for before reading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetier.tiers.call_routing import Group, Routing
from moetier.tiers.cpu_tier import CpuGroup
from moetier.tiers.experts import ExpertStore


def decode_groups(store: ExpertStore, layer: int, routing: Routing, groups: list[Group]) -> list[CpuGroup]:
    """Each group's rows (the call's own row indices) and gates, from a decode call's host inputs."""
    assert routing.host is not None
    top_k = store.layout.top_k
    order, weights = routing.order_host.tolist(), routing.host.weights.view(-1).tolist()
    out = []
    for group in groups:
        pairs = order[group.start : group.start + group.count]
        rows, gates = [pair // top_k for pair in pairs], [weights[pair] for pair in pairs]
        out.append(CpuGroup(store.expert(layer, group.expert), rows, gates))
    return out


@dataclass
class GatheredRows:
    """A streaming call's CPU-routed rows on the host (``hidden``, ``[U, H]``) and the job's groups over them.

    ``rows_dev`` (None when every row of the call is one) says where the job's sums go back; ``ready`` (CUDA)
    is the event after the copies; ``keep`` are the buffers that must live until the job ran."""

    hidden: torch.Tensor
    groups: list[CpuGroup]
    rows_dev: torch.Tensor | None
    ready: Any
    keep: tuple[Any, ...]


def gather_streaming(
    store: ExpertStore, layer: int, hidden: torch.Tensor, routing: Routing, groups: list[Group], stream: Any
) -> GatheredRows:
    """Copy the rows the groups touch and the sorted pairs' gates to pinned host buffers (non-blocking on
    CUDA, an event recorded on ``stream`` after them), and the groups' rows renumbered to those rows."""
    owners = [routing.tokens_host[g.pairs].tolist() for g in groups]  # each group's tokens
    rows = sorted({token for tokens in owners for token in tokens})
    local = {token: i for i, token in enumerate(rows)}
    cuda = hidden.device.type == "cuda"
    # Decode of a few streams usually touches every token: then the rows need no gather and no scatter.
    every_row = len(rows) == hidden.shape[0]
    rows_dev = None if every_row else torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    host_hidden = torch.empty((len(rows), hidden.shape[1]), dtype=hidden.dtype, pin_memory=cuda)
    host_gates = torch.empty(routing.gates_dev.shape, dtype=routing.gates_dev.dtype, pin_memory=cuda)
    host_hidden.copy_(hidden if every_row else hidden.index_select(0, rows_dev), non_blocking=cuda)
    host_gates.copy_(routing.gates_dev, non_blocking=cuda)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record(stream)
    # Slices are views: nothing is read from the pinned buffers before the worker waits on ``ready``.
    job_groups = [
        CpuGroup(
            store.expert(layer, g.expert),
            torch.tensor([local[token] for token in tokens], dtype=torch.int64),
            host_gates[g.pairs],
        )
        for g, tokens in zip(groups, owners, strict=True)
    ]
    return GatheredRows(host_hidden, job_groups, rows_dev, ready, (host_hidden, host_gates, rows_dev, job_groups))
