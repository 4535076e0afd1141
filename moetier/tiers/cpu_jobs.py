"""A tiered dispatch call's CPU job: the groups' rows and gates as the CPU tier reads them, and the jobs' life.

A decode call's job is built from its host inputs alone (:mod:`moetier.tiers.decode_inputs`): every row of
the call, each group's tokens and gates as Python lists (a few pairs: cheaper than any torch call). A
streaming call's CPU-routed rows and gates are gathered from the device into pinned buffers by
non-blocking copies, with an event the worker waits for before reading them. :class:`CallJobs` starts a call's
job, adds its sums on the device and accounts for it (metrics, the route adapter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from moetier.profiling import phase
from moetier.tiers.call_routing import Group, Routing, add_rows
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.decode_inputs import HostBuffers
from moetier.tiers.experts import ExpertStore
from moetier.tiers.gpu_wait import HostFlag
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.route_costs import RouteAdapter

# What a started job is: (future, rows on the device or None, its fp32 sums on the host, buffers to keep alive).
Started = tuple[Any, torch.Tensor | None, torch.Tensor, tuple]


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


class CallJobs:
    """The CPU tier's jobs for a tiered dispatcher's calls, from start to accounting.

    :meth:`submit` starts a call's job (a decode call's from its host inputs, a streaming call's from rows
    gathered off the device) and returns it started; :meth:`add_sums` adds its fp32 sums into the call's output,
    either with the compute stream waiting for the job's host flag (``release``: the host thread goes on launching,
    the job stays :attr:`pending` until a later host sync proves the GPU past it, :meth:`collect_pending`) or with
    this thread waiting for it. Every job's times go to the layer's metrics, and a job submitted with a prediction
    to the route adapter.
    """

    def __init__(
        self,
        store: ExpertStore,
        tier: CpuExpertTier,
        metrics: TierMetrics,
        adapter: RouteAdapter,
        flag: HostFlag | None,
        buffers: HostBuffers,
        device: torch.device,
    ) -> None:
        self.store, self.tier, self.metrics, self.adapter = store, tier, metrics, adapter
        self.flag, self.buffers, self.device = flag, buffers, device
        self.pending: list[tuple[int, Any, tuple]] = []  # (layer, future, buffers kept until the GPU is past them)

    def submit(
        self,
        layer: int,
        hidden: torch.Tensor,
        routing: Routing,
        groups: list[Group],
        release: int | None,
        stream: Any,
        predicted_seconds: float | None = None,
    ) -> Started:
        """Start the job of ``groups``; with ``release`` its worker sets the host flag to it when done (a GPU stream
        may wait for it). ``predicted_seconds`` (the route costs' price of the job) is compared with its measured
        time when it is collected."""
        with phase("tiers.cpu_submit"):
            if routing.host is not None:
                started = self._start_from_host(layer, routing, groups, release)
            else:
                started = self._start_streaming(layer, hidden, routing, groups, release, stream)
        if predicted_seconds is not None:
            started[0].predicted_seconds = predicted_seconds
        return started

    def add_sums(self, layer: int, out: torch.Tensor, started: Started, release: int | None, stream: Any) -> None:
        """Add the job's fp32 sums into ``out``: ``stream`` waits for the job's flag, or this thread for the job."""
        if release is not None and self.flag.wait_on(stream, release):
            future, rows_dev, host_out, buffers = started
            add_rows(out, rows_dev, host_out.to(out.device, non_blocking=True))
            self.pending.append((layer, future, buffers))
            self.metrics.layer(layer).cpu_jobs_gpu_waited += 1
        else:
            rows_dev, values = self.finish(layer, started)
            add_rows(out, rows_dev, values.to(out.dtype))

    def finish(self, layer: int, started: Started) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Wait for the job; its rows on the device and its sums on their way there."""
        future, rows_dev, _, _ = started
        wait_start = time.perf_counter()
        with phase("tiers.cpu_wait"):
            result = future.result()
        self._account(layer, future, result)
        self.metrics.layer(layer).cpu_wait_seconds += time.perf_counter() - wait_start
        return rows_dev, result.out.to(self.device, non_blocking=True)

    def collect_pending(self, finished_only: bool = False) -> None:
        """After a host sync: the GPU is past every pending job; account for them and raise any failure. With
        ``finished_only`` (the sync proved one stream past its jobs, not another's) the jobs not done yet stay."""
        pending, self.pending = self.pending, []
        for entry in pending:
            layer, future, _ = entry
            if finished_only and not future.done():
                self.pending.append(entry)
                continue
            self._account(layer, future, future.result())  # raises the worker's error: those sums were incomplete

    def _account(self, layer: int, future: Any, result: Any) -> None:
        counters = self.metrics.layer(layer)
        counters.cpu_seconds += result.seconds
        counters.count_cpu_marks(result.marks)
        predicted = getattr(future, "predicted_seconds", None)
        if predicted is not None:  # the job's compute time: its wait for inputs is the same whatever its share
            self.adapter.observe("cpu", predicted, result.seconds - result.wait_seconds)

    def _start_from_host(self, layer: int, routing: Routing, groups: list[Group], release: int | None) -> Started:
        """A decode call's job over its host inputs (:func:`decode_groups`), the fp32 sums into a reused (pinned)
        buffer that is added to every row (rows no group touched are zero)."""
        host = routing.host
        job_groups = decode_groups(self.store, layer, routing, groups)
        cuda = self.device.type == "cuda"
        out = self.buffers.take("cpu_out", tuple(host.hidden.shape), torch.float32, pinned=cuda)
        self.metrics.layer(layer).cpu_pairs += sum(g.count for g in groups)
        job = CpuJob(hidden=host.hidden, groups=job_groups, out=out, on_done=self._on_done(release))
        return self.tier.submit(job), None, out, (job_groups,)

    def _start_streaming(
        self, layer: int, hidden: torch.Tensor, routing: Routing, groups: list[Group], release: int | None, stream: Any
    ) -> Started:
        """Gather a streaming call's CPU-routed rows and gates to the host (:func:`gather_streaming`) and submit the
        job; this thread goes on to launch device work while they land."""
        cuda = hidden.device.type == "cuda"
        gathered = gather_streaming(self.store, layer, hidden, routing, groups, stream)
        out = torch.empty((gathered.hidden.shape[0], hidden.shape[1]), dtype=torch.float32, pin_memory=cuda)
        self.metrics.layer(layer).cpu_pairs += sum(g.count for g in groups)
        job = CpuJob(gathered.hidden, gathered.groups, gathered.ready, out, on_done=self._on_done(release))
        return self.tier.submit(job), gathered.rows_dev, out, (*gathered.keep, out)

    def _on_done(self, release: int | None) -> Any:
        """What a job runs when it ends: with ``release``, set the host flag a GPU stream may wait for (a decode
        job's native worker stores it from C)."""
        return None if release is None else self.flag.releaser(release)
