"""The CPU tier beside the mapped route, fed by the device: both links at once with no host wait in the step.

The mapped route (:mod:`moetier.tiers.mapped`) has the device's kernels read every miss over PCIe, and a step
never waits for the host. The split route adds the CPU tier, whose cores read the home copy at DRAM speed,
but there the host decides per layer, so it first waits for the router's ids. Here the device decides: every
uncached expert may be the CPU's (:attr:`MappedExperts.pick`, a device tensor kept with the table, says so per
(layer, expert)), and the table kernel gives the CPU ``share`` of each call's uncached experts, the cheapest for
it first, met to a part of an expert (:class:`~moetier.kernels.routing_table.CallSplit`, ``SPLIT_UNIT_ROWS``;
the device computes the cut expert's first rows; ``MOETIER_FED_SPLIT=whole``: whole experts). ``static`` keeps the
split this replaced: a fixed ``share`` of each layer's expert ids (:func:`cpu_picks`) is the CPU's whenever not
cached, which gives both sides their share only on average over calls. Per MoE layer, on the compute stream:

1. the kernel that builds the call's launch table (:mod:`moetier.kernels.routing_table`) also writes the pairs'
   ids (-1 where the device keeps the pair), their gates and the hidden rows into a pinned inbox (the GPU
   addresses pinned memory directly), then stream writes clear the layer's pinned done word and store 1 into
   its start word (``cuStreamWriteValue32``: the kernel's writes are visible first);
2. the kernels run the device's pairs (:func:`~moetier.kernels.device_routing.run_routed` with ``skip``), while
   the CPU tier's native worker, spinning on the start word, stores 0 back into it, groups the CPU's pairs by
   expert and computes them from the home copy (a job queued by the host before its inputs exist:
   ``cpu_worker.c``'s fed jobs), then stores 1 into the done word;
3. the stream waits for the done word (``cuStreamWaitValue32``) and adds the CPU's sums.

Every value is a constant, so a CUDA graph can replay the call: a *queued step* (:meth:`FedCpuShare.queue_step`,
before a mapped step whose calls run inside the model's decode graphs) queues every layer's job up front, and the
calls (captured once, replayed after) only do device work. A step that fails midway cancels what it queued
(:meth:`FedCpuShare.abort_step`: the device drained first, so no stream waits for a cancelled job). An adaptive
share times graphed calls by the device's clock: each call stamps it after its start word, after the device's
share and once the CPU's sums are in (:mod:`moetier.kernels.device_clock`), and every ``STAMP_EVERY``-th queued
step copies the stamps back (:mod:`moetier.tiers.fed_clock` makes them samples, the CPU's hand-off included).
Without stamps (no Triton, or ``MOETIER_FED_STAMPS=0``) it runs every ``TIMED_STEP_EVERY``-th mapped step eagerly
instead, every call timed by events (its jobs queued at the step's start too, so its CPU side starts as a graphed
step's does).

One inbox per batch size is enough: the stream orders each layer's copies into it after the previous layer's
wait for the worker, so nothing overwrites an inbox the worker still reads. Off CUDA the host plays the device
(it copies into the inbox with torch and stores the start word itself), so the CPU tests run the same worker code;
the table kernel's inbox writes are tested under Triton's interpreter.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.kernels.cpu_experts import CheckedExperts
from moetier.kernels.cpu_worker import ABANDONED, FedInbox, NativeJob, NativeWorker, fed_ids
from moetier.kernels.device_clock import launch_stamp, stamps_usable
from moetier.kernels.host_sums import add_host_sums, fed_sums_mode, host_sums_ready, host_sums_usable
from moetier.kernels.routing_table import CallSplit, FeedTarget, split_priorities
from moetier.tiers.cpu_tier import CpuExpertTier
from moetier.tiers.experts import ExpertStore
from moetier.tiers.fed_clock import STAMPS, Handoff, stamped_call
from moetier.tiers.gpu_wait import HostFlag
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.route_costs import RouteCosts

log = logging.getLogger(__name__)

# The mapped route's PCIe rate against the copy engine's (H200 probe, results/h200-20261201-zero-copy): the
# kernels read bf16 blocks at 0.92x, fp4 blocks at 0.75x (41 of 55 GB/s) with their current read shape.
MAPPED_READ_FACTOR = {False: 0.92, True: 0.75}
# An adaptive share times the device's share of every SAMPLE_EVERY-th call (two events) against its CPU job and
# rebalances from BALANCE_SAMPLES of them (the CPU tier's fp4 kernel is compute-bound at ~22-26 GB/s as stored on
# the H200 host, the kernels' PCIe reads ~41: a share from the start-up costs was off by a fifth).
SAMPLE_EVERY = 4
BALANCE_SAMPLES = 12
# With graphed steps: every TIMED_STEP_EVERY-th mapped step is eager and timed, every FAST_TIMED_STEP_EVERY-th
# while the share still moves (no rebalance yet, or the last one moved it by SETTLED_MOVE or more: smaller moves
# are the samples' noise, ~1-2 experts a layer on the H200, and an eager step costs the host ~2 ms more).
TIMED_STEP_EVERY = 16
FAST_TIMED_STEP_EVERY = 3
# With device-clock stamps, every STAMP_EVERY-th queued step's stamps are copied back and sampled (each sampled step
# costs the host a copy and an event; three MoE layers' calls a step are 12 samples in 4 sampled steps).
STAMP_EVERY = 2
SETTLED_MOVE = 0.02
BALANCE_LIMITS = (0.05, 0.95)
# A rebalance moves the share by at most this much, and the first SETTLE_STEPS steps after another route's are
# not timed: that route's copies still land and its cache contents are not the mapped route's (on the H200 a
# share rebalanced inside the split chooser's trial fell to 0.29 while the mapped route alone settled at 0.62).
MAX_MOVE = 0.1
SETTLE_STEPS = 4
SHARE_HISTORY = 64
# The fixed part of a CPU job's time is fitted over the last FIT_JOBS jobs (FIT_MIN_JOBS of them with work at least).
FIT_JOBS = 96
FIT_MIN_JOBS = 8


def default_share(costs: RouteCosts, quantised: bool) -> float:
    """The share of missed experts that balances the CPU tier against the kernels' PCIe reads, from the measured
    one-token costs of the CPU and copy routes."""
    cpu_rate = 1.0 / max(costs.cpu(1), 1e-12)
    mapped_rate = MAPPED_READ_FACTOR[quantised] / max(costs.copy(1), 1e-12)
    return cpu_rate / (cpu_rate + mapped_rate)


def fed_share(
    store: ExpertStore,
    tier: CpuExpertTier,
    metrics: TierMetrics,
    costs: RouteCosts,
    device: torch.device,
    share: float | None,
) -> FedCpuShare | None:
    """The fed CPU tier of ``share`` (None: from ``costs``, then rebalanced as it runs), or None where it has no
    share or cannot run (no C kernel or native worker for these experts, no stream writes)."""
    quantised = store.expert(store.layout.moe_layers[0], 0).quant_kind is not None
    start = default_share(costs, quantised) if share is None else share
    fed = FedCpuShare(store, sorted(store.layout.moe_layers), tier, metrics, start, device, adaptive=share is None)
    if fed.broken:
        return None
    log.info("mapped route: the CPU tier computes %.0f%% of each layer's uncached experts", 100 * start)
    return fed


def balanced_share(share: float, cpu_seconds: float, device_seconds: float, cpu_fixed: float = 0.0) -> float:
    """The next share from one measured at ``share``: the CPU's jobs took ``cpu_seconds``, of which ``cpu_fixed``
    does not depend on how many experts they computed (the job's start-up: :func:`cpu_fixed_seconds`), the device's
    share of the same calls ``device_seconds``. The rest of each side's time is taken as its share over its rate;
    the share that gives both sides the same time is the target, and the step goes half way there, by at most
    ``MAX_MOVE`` (the measurements are noisy; the share stays in [0.05, 0.95], so either side keeps being measured).

    Without ``cpu_fixed``, a CPU slowed by its jobs' fixed cost looks slower the fewer experts it gets, so the share
    would shrink step after step (on the H200 one run went 0.54 -> 0.27 at one stream, its CPU jobs taking ~1 ms an
    expert against ~0.3 in a run that kept 0.53)."""
    fixed = min(max(cpu_fixed, 0.0), 0.9 * cpu_seconds)
    cpu_per_share = max(cpu_seconds - fixed, 1e-9) / max(share, 1e-9)
    device_per_share = max(device_seconds, 1e-9) / max(1.0 - share, 1e-9)
    # fixed + s * cpu_per_share == (1 - s) * device_per_share
    target = (device_per_share - fixed) / (cpu_per_share + device_per_share)
    step = min(max(0.5 * (target - share), -MAX_MOVE), MAX_MOVE)
    return min(max(share + step, BALANCE_LIMITS[0]), BALANCE_LIMITS[1])


def cpu_fixed_seconds(jobs: Sequence[tuple[int, float]]) -> float:
    """A CPU job's time that does not grow with its experts, fitted over ``(experts, seconds)`` of recent jobs that
    computed at least one (least squares, ``seconds = fixed + experts * per_expert``): 0 with fewer than
    ``FIT_MIN_JOBS`` such jobs or one expert count only; at most 0.9 of their mean time (where the fit's slope
    is not positive, the jobs' time did not follow their experts: that much is taken as fixed)."""
    worked = [(n, t) for n, t in jobs if n > 0]
    if len(worked) < FIT_MIN_JOBS:
        return 0.0
    mean_n = sum(n for n, _ in worked) / len(worked)
    mean_t = sum(t for _, t in worked) / len(worked)
    spread = sum((n - mean_n) ** 2 for n, _ in worked)
    if spread == 0.0:
        return 0.0
    slope = sum((n - mean_n) * (t - mean_t) for n, t in worked) / spread
    ceiling = 0.9 * mean_t
    return ceiling if slope <= 0.0 else min(max(mean_t - slope * mean_n, 0.0), ceiling)


FED_SPLITS = ("balanced", "whole", "static")
# A call's share is met to a part of this many intermediate rows of an expert (where the experts' rows cut in a
# power of two of such parts): at one stream a layer misses ~4 experts, and whole experts leave one side waiting
# for up to one expert's time (H200 traces, results/h200-20261204-e3ff99d-row-cuts: a call's experts 666-691 us,
# ~577-587 had both sides ended together). 128 rows of V4-Flash's 2048 are 1/16 of an expert (~0.8 MB in fp4).
SPLIT_UNIT_ROWS = 128


def fed_stamps_enabled() -> bool:
    """``MOETIER_FED_STAMPS``: unset or ``1`` times graphed fed calls by the device's clock where it can (CUDA with
    Triton); ``0`` times eager steps instead (the way before stamps, kept for A/B runs)."""
    value = os.environ.get("MOETIER_FED_STAMPS", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"MOETIER_FED_STAMPS={value!r}: use 1 (stamps, the default) or 0 (eager timed steps)")
    return value == "1"


def fed_split_mode() -> str:
    """``MOETIER_FED_SPLIT``: how the fed CPU tier's experts are chosen: ``balanced`` (the default: ``share`` of each
    call's uncached experts, to a part of an expert's rows), ``whole`` (the same in whole experts) or ``static``
    (a fixed ``share`` of each layer's expert ids, :func:`cpu_picks`)."""
    value = os.environ.get("MOETIER_FED_SPLIT", "balanced").strip().lower()
    if value not in FED_SPLITS:
        raise ConfigError(f"MOETIER_FED_SPLIT must be one of {', '.join(FED_SPLITS)}, got {value!r}: unset it")
    return value


def split_unit_rows(inter: int, tile_cols: int = 0, unit: int = SPLIT_UNIT_ROWS) -> int:
    """The rows of a part of an expert of ``inter`` intermediate rows a call's split cuts to: ``unit``, or a smaller
    power of two down to 32 and ``tile_cols`` (the CPU kernel reads rows from a tile's start: fp8's scale tiles are
    128 wide), that cuts the rows in a power of two of at least 2 parts; 0 where none does (whole experts only)."""
    while unit >= max(32, tile_cols):
        parts = inter // unit
        if parts >= 2 and parts * unit == inter and parts & (parts - 1) == 0:
            return unit
        unit //= 2
    return 0


def cpu_picks(layers: int, experts: int, share: float) -> list[bool]:
    """Per (layer, expert), row by row, whether the CPU computes it when it is not cached: ``share`` of each
    layer's experts, spread by a fixed hash (not the low ids: routers favour no id range, but skewed test routing
    may)."""
    taken = round(share * experts)  # the first of each layer's fixed order, the balanced split's priorities
    return [rank < taken for layer in range(layers) for rank in split_priorities(experts, layer)]


@dataclass
class FedCall:
    """One layer's fed job: its worker job and the inbox it reads and writes."""

    layer: int
    job: NativeJob
    inbox: FedInbox
    timing: list[Any] | None = None  # a sampled call's device-share marks: CUDA events, or host clock readings
    stamps: tuple[torch.Tensor, int, Any] | None = None  # a stamped call's: the step's stamps (pinned), row, event


class FedCpuShare:
    """The fed CPU tier of the mapped route (see the module docstring).

    Contract: :meth:`usable` for a call; its :meth:`inbox` written (by the table kernel at :meth:`target`, or by
    :meth:`fill`), then :meth:`start` (before the device's kernels) and :meth:`collect` (after them), all on one
    stream; :meth:`harvest` between steps takes the finished jobs' times into the metrics (and, ``adaptive``,
    rebalances the share: :func:`balanced_share`; ``picks_version`` counts the changes of ``picks``; :meth:`settle`
    after a change of route). ``share`` is the fraction of each call's uncached experts the CPU takes
    (:meth:`call_split`; ``picks``, every expert, says which it may take), or with ``balanced`` False the fraction
    of each layer's experts it takes whenever they are not cached (``picks``; :meth:`call_split` is None).
    A queued step: :meth:`queue_step` before it (every layer's job), :meth:`end_step` after it, or
    :meth:`abort_step` if it failed; :meth:`timed_step` says whether a mapped step must stay eager to be timed.
    """

    def __init__(
        self,
        store: ExpertStore,
        layers: list[int],
        tier: CpuExpertTier,
        metrics: TierMetrics,
        share: float,
        device: torch.device,
        adaptive: bool = False,
    ) -> None:
        layout = store.layout
        self.adaptive, self.picks_version = adaptive, 0
        self.store, self.tier, self.metrics, self.share = store, tier, metrics, share
        self.layers, self.top_k, self.hidden_size = layers, layout.top_k, layout.hidden_size
        mode, stamps = fed_split_mode(), fed_stamps_enabled()  # all three read (and validated) on every machine
        self._sums_kernel = fed_sums_mode() == "kernel"
        self.balanced = mode != "static"
        experts = layout.num_experts
        self.picks = [True] * (len(layers) * experts) if self.balanced else cpu_picks(len(layers), experts, share)
        self.cuda = device.type == "cuda"
        self._row = {layer: i for i, layer in enumerate(layers)}
        # The balanced split's device inputs: the share (moved between steps) and each layer's priorities.
        self._share = torch.tensor([share], dtype=torch.float32, device=device)
        ranks = [split_priorities(experts, row) for row in range(len(layers))]
        priorities = torch.tensor(ranks, dtype=torch.int32, device=device)
        tile_cols, inter = (layout.quant.tile[1] if layout.quant is not None else 0), layout.intermediate_size
        unit = split_unit_rows(inter, tile_cols) if mode == "balanced" else 0
        self._splits = {layer: CallSplit(priorities[row], self._share, unit, inter) for layer, row in self._row.items()}
        self.worker: NativeWorker | None = None
        self._checked: dict[int, CheckedExperts] = {}
        self.kernel: str | None = None
        self._start: HostFlag | None = None
        self._done: HostFlag | None = None
        # Per MoE layer: the start and done words (pinned and device-written on CUDA; host-written off it).
        self._words = (torch.zeros(len(layers), dtype=torch.int32), torch.zeros(len(layers), dtype=torch.int32))
        self._queued: dict[int, FedCall] | None = None  # a queued step's jobs, by layer
        self._mapped_steps = 0
        self._moving = True  # no rebalance yet, or the last one moved the share by SETTLED_MOVE or more
        # (mapped steps so far, share, fitted fixed ms of a CPU job) at the start and after each rebalance, the last
        # SHARE_HISTORY of them.
        self.history: deque[tuple[int, float, float]] = deque([(0, share, 0.0)], maxlen=SHARE_HISTORY)
        self._timed = False  # the step in progress times every call
        # The device-clock stamps of queued calls (CUDA; a row of STAMPS per layer), and whether the queued step in
        # progress is sampled (its stamps copied back at end_step).
        self._stamps: torch.Tensor | None = None
        self._stamped_step = False
        self._queued_steps = 0
        self.handoff = Handoff()
        self._inboxes: dict[int, FedInbox] = {}
        self._targets: dict[int, FeedTarget] = {}
        self._jobs: deque[FedCall] = deque()
        # (CPU seconds, device share seconds, experts the CPU computed, the CPU's hand-off in them) of sampled calls
        self._samples: list[tuple[float, float, int, float]] = []
        self._jobs_done: deque[tuple[int, float]] = deque(maxlen=FIT_JOBS)  # (experts, seconds) of finished jobs
        self.cpu_fixed = 0.0  # the last rebalance's fitted fixed seconds of a CPU job (cpu_fixed_seconds)
        self._calls = 0
        self._untimed = 0  # calls left untimed after a change of route (settle)
        self.broken = share <= 0.0 or not self._set_up(device, stamps)

    def _set_up(self, device: torch.device, stamps: bool) -> bool:
        """Check every layer's home copy with the C kernel, start the worker, make the flags (and, ``stamps``, the
        device-clock stamps of an adaptive share); False where any of it cannot be had (then the mapped route runs
        alone)."""
        experts = self.store.layout.num_experts
        for layer in self.layers:
            plan = self.tier.fed_plan([self.store.expert(layer, e) for e in range(experts)], self.hidden_size)
            if plan is None:
                return False
            self.worker, self._checked[layer], self.kernel = plan
        if self.cuda:
            self._start, self._done = (HostFlag.create(device, len(self.layers)) for _ in range(2))
            if self._start is None or self._done is None or not self._start.writable:
                return False
            self._words = (self._start.tensor, self._done.tensor)
            if self.adaptive and stamps and stamps_usable(device):
                self._stamps = torch.zeros((len(self.layers), len(STAMPS)), dtype=torch.int64, device=device)
            self._sums_kernel = self._sums_kernel and host_sums_ready(device)
        return True

    @property
    def sums(self) -> str:
        """How the device adds the CPU's sums: ``kernel`` (:func:`~moetier.kernels.host_sums.add_host_sums`, on CUDA
        where its probe passed) or ``copy`` (copied to the device, then added; off CUDA the host adds them)."""
        return "kernel" if self._sums_kernel and self.cuda else "copy"

    @property
    def timing(self) -> str:
        """How the share's samples are timed: ``stamps`` (graphed calls, by the device's clock), ``timed steps``
        (eager steps, by events or the host's clock) or ``fixed`` (not adaptive)."""
        if not self.adaptive:
            return "fixed"
        return "stamps" if self._stamps is not None else "timed steps"

    def call_split(self, layer: int) -> CallSplit | None:
        """How the layer's calls split their uncached experts (None: by ``picks`` alone, the static split)."""
        return self._splits[layer] if self.balanced else None

    def usable(self, hidden: torch.Tensor) -> bool:
        """Whether a call over ``hidden`` can have the CPU's share (bf16 activations, the C kernel's)."""
        return not self.broken and hidden.dtype == torch.bfloat16

    def inbox(self, tokens: int) -> FedInbox:
        """The pinned buffers of calls of ``tokens`` tokens (one per batch size: see the module docstring)."""
        inbox = self._inboxes.get(tokens)
        if inbox is None:
            with torch.inference_mode(False):  # written in place by every later call, in inference mode or not
                inbox = FedInbox.allocate(tokens, self.top_k, self.hidden_size, pin=self.cuda)
            inbox.check(self._checked[self.layers[0]])
            self._inboxes[tokens] = inbox
        return inbox

    def target(self, tokens: int, base: torch.Tensor) -> FeedTarget:
        """The inbox of ``tokens``-token calls as the table kernel addresses it: byte offsets from ``base`` (uint8,
        on the device; one per route, so the target is made once per batch size)."""
        target = self._targets.get(tokens)
        if target is None or target.base is not base:
            inbox, origin = self.inbox(tokens), base.data_ptr()
            parts = (inbox.ids, inbox.weights, inbox.hidden)
            target = self._targets[tokens] = FeedTarget(base, *(t.data_ptr() - origin for t in parts))
        return target

    def fill(self, inbox: FedInbox, hidden, topk_ids, topk_weights, skip: torch.Tensor, rows=None) -> None:
        """Copy the CPU's pairs (``skip`` marks them; the others' ids become -1, but a cut expert's, whose ``rows``
        on the device are fewer than all: theirs carry those rows, :func:`~moetier.kernels.cpu_worker.fed_ids`),
        their gates and the hidden rows into the inbox with torch copies (where the table kernel does not write it)."""
        cpu_ids = torch.where(skip, topk_ids.to(torch.int64), -1)
        if rows is not None:
            cut = (rows > 0) & (rows < self.store.layout.intermediate_size)
            cpu_ids = torch.where(cut, fed_ids(topk_ids, rows), cpu_ids)
        for dst, src in ((inbox.ids, cpu_ids), (inbox.weights, topk_weights.float()), (inbox.hidden, hidden)):
            dst.copy_(src, non_blocking=src.is_cuda)

    def start(self, layer: int, inbox: FedInbox, stream: Any) -> FedCall | None:
        """Once the inbox is written (on ``stream``): clear the layer's done word and store its start word after it,
        and queue the worker's job (a queued step's is there already); None (nothing queued: the device must run
        every pair) if the device cannot store the words."""
        row = self._row[layer]
        on_device = self._start is not None  # else the host plays the device (off CUDA)
        if on_device and not (self._done.write_on(stream, 0, row) and self._start.write_on(stream, 1, row)):
            log.warning("the device cannot store the CPU tier's start word: mapped steps run without it")
            self.broken = True
            self.abort_step()
            return None
        # A queued step's job serves every call of its layer in the step: a capture that fails (recorded, never run)
        # is followed by the same call run eagerly, and only one of them stores the start word on the device.
        call = self._queued.get(layer) if self._queued is not None else None
        if call is None:
            call = self._submit(layer, inbox)
        if not on_device:  # its inputs are in place: the host stores the words itself
            self._words[1].numpy()[row] = 0
            self._words[0].numpy()[row] = 1
        return call

    def _submit(self, layer: int, inbox: FedInbox) -> FedCall:
        """Queue the layer's job on its words (it runs once the start word is stored), tracked for :meth:`harvest`."""
        row = self._row[layer]
        start_word, done_word = (w[row].data_ptr() for w in self._words)
        job = self.worker.submit_fed(
            self._checked[layer], (start_word, 1), inbox, self.store.layout.swiglu_limit, self.tier.threads,
            (done_word, 1),
        )  # fmt: skip
        call = FedCall(layer, job, inbox)
        self._jobs.append(call)
        return call

    def queue_step(self, tokens: int) -> None:
        """Before a mapped step of ``tokens`` tokens per call whose calls may replay a CUDA graph (no host code
        runs then): queue every layer's job now, in layer order (the order the step starts them in)."""
        self._queued = {layer: self._submit(layer, self.inbox(tokens)) for layer in self.layers}
        # No call of a graphed step is timed by events: the settling after a change of route counts its calls too.
        self._calls += len(self.layers)
        self._untimed = max(0, self._untimed - len(self.layers))
        if self._stamps is not None:
            self._stamped_step = self._untimed == 0 and self._queued_steps % STAMP_EVERY == 0
            self._queued_steps += 1
            if self._stamped_step:  # a call that does not run this step leaves zeros: not sampled
                self._stamps.zero_()

    def _stamp(self, call: FedCall, slot: int, stream: Any) -> None:
        """A queued call's stamp ``slot`` (:data:`STAMPS`): always in a capture (the graph's replays stamp), in an
        eager call only where the step is sampled."""
        if self._stamped_step or torch.cuda.is_current_stream_capturing():
            launch_stamp(self._stamps[self._row[call.layer]], slot, stream)

    def end_step(self, stream: Any = None) -> None:
        """After a step (its calls enqueued on ``stream``): a sampled queued step's stamps are copied back; calls
        started from here on queue their own jobs again."""
        if self._stamped_step and self._queued is not None and stream is not None:
            with torch.cuda.stream(stream):
                host = torch.empty(self._stamps.shape, dtype=torch.int64, pin_memory=True)
                host.copy_(self._stamps, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            for call in self._queued.values():
                call.stamps = (host, self._row[call.layer], event)
        self._queued = None
        self._timed = False
        self._stamped_step = False

    def abort_step(self) -> None:
        """A queued step failed before all of its calls reached the device: the device drained (where it is not
        being captured), the jobs it never started cancelled, every word cleared."""
        if self._queued is None:
            return
        if self.cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # the started calls' jobs run (they are ahead of the others in the queue)
        if self.worker is not None:
            self.worker.cancel_fed()
        for call in self._queued.values():
            call.job.wait()
        self._queued = None
        self._stamped_step = False
        for words in self._words:
            words.zero_()

    def timed_step(self) -> bool:
        """Before a mapped step: whether it runs eagerly with every call timed (an adaptive share's every
        ``TIMED_STEP_EVERY``-th, more often while the share moves); otherwise it may run in graphs."""
        self._mapped_steps += 1
        every = FAST_TIMED_STEP_EVERY if self._moving else TIMED_STEP_EVERY
        stamped = self._stamps is not None  # graphed calls time themselves
        self._timed = self.adaptive and not self.broken and not stamped and self._mapped_steps % every == 0
        return self._timed

    def settle(self) -> None:
        """The route changed to this one: the next ``SETTLE_STEPS`` steps' calls are not timed."""
        self._untimed = SETTLE_STEPS * len(self.layers)

    def mark_start(self, call: FedCall, stream: Any) -> None:
        """Before the device's share of a call: on every ``SAMPLE_EVERY``-th call of an adaptive share (every call of
        a timed step), the first of the marks :meth:`harvest` times (:meth:`mark_end` the second, :meth:`collect`
        the third: the CPU's sums added)."""
        if self._queued is not None:  # a queued step's calls run inside graphs (stamped), but a timed step's eagerly
            if self._stamps is not None:
                self._stamp(call, 0, stream)
            elif self._timed and self.adaptive and self._untimed == 0:  # queue_step counted its calls
                call.timing = [self._mark(stream)]
            return
        self._calls += 1
        if self._untimed > 0:
            self._untimed -= 1
        elif self.adaptive and (self._timed or self._calls % SAMPLE_EVERY == 0):
            call.timing = [self._mark(stream)]

    def mark_end(self, call: FedCall, stream: Any) -> None:
        """After the device's share of a call (its kernels enqueued, off CUDA run)."""
        if self._queued is not None and self._stamps is not None:
            self._stamp(call, 1, stream)
        if call.timing is not None:
            call.timing.append(self._mark(stream))

    def _mark(self, stream: Any) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def collect(self, call: FedCall, out: torch.Tensor, stream: Any) -> None:
        """Add the CPU's sums into ``out``: the stream waits for them (the host only where it cannot)."""
        if self._done is not None and self._done.wait_on(stream, 1, self._row[call.layer]):
            if self._queued is not None and self._stamps is not None:
                self._stamp(call, 2, stream)
            if self._sums_kernel and host_sums_usable(out, call.inbox.out):
                add_host_sums(out, call.inbox.out)  # read over PCIe in place: no copy node between two kernels
            else:
                out.add_(call.inbox.out.to(out.device, non_blocking=True))
        else:
            call.job.wait()
            out.add_(call.inbox.out.to(out.device))
        if call.timing is not None and len(call.timing) == 2:
            call.timing.append(self._mark(stream))  # the device's share ended at the second: the rest waited

    def abandon(self, call: FedCall) -> None:
        """A call that failed after :meth:`start`: wait until the worker is done with the inbox."""
        call.job.wait()

    def harvest(self, wait: bool = False) -> None:
        """The finished jobs' wall times into each layer's ``cpu_seconds`` (``wait``: every job's), their sampled
        device times into the next rebalance."""
        while self._jobs and (wait or self._done_with(self._jobs[0])):
            call = self._jobs.popleft()
            status, seconds = call.job.wait()
            counters = self.metrics.layer(call.layer)
            counters.cpu_seconds += seconds
            counters.count_cpu_marks(call.job.marks)
            if status not in (0, ABANDONED) and not self.broken:
                log.error("a fed CPU-tier job failed (status %d): mapped steps run without the CPU tier", status)
                self.broken = True
            if status == 0:
                self._jobs_done.append((call.job.experts, seconds))
            if call.timing is not None and len(call.timing) >= 2 and status == 0:
                self._sample(seconds, call.timing, call.job.experts, counters)
            if call.stamps is not None and status == 0:
                self._sample_stamps(seconds, call, counters)
        if len(self._samples) >= BALANCE_SAMPLES:
            self._rebalance()

    def _done_with(self, call: FedCall) -> bool:
        """Whether the call's job ran and its marks (if any) have passed on the device (never waits)."""
        marks_passed = not self.cuda or call.timing is None or all(e.query() for e in call.timing)
        stamps_back = call.stamps is None or call.stamps[2].query()
        return call.job.done() and marks_passed and stamps_back

    def _sample(self, cpu_seconds: float, marks: list[Any], experts: int, counters: Any) -> None:
        """A timed call into the next rebalance, and into the layer's counters: the device's share and, with the
        third mark, how long the device then went on before the CPU's sums were in (``fed_late_seconds``: the CPU's
        job outlasting the device's share, its start and the hand-off of its sums; ~the add alone when the CPU
        ended first)."""
        if self.cuda:
            marks[-1].synchronize()  # passed already (see _done_with); a flush waits here
            spans = [marks[0].elapsed_time(m) / 1e3 for m in marks[1:]]
        else:
            spans = [m - marks[0] for m in marks[1:]]
        device_seconds = spans[0]
        self._samples.append((cpu_seconds, device_seconds, experts, 0.0))
        if len(spans) == 2:
            counters.fed_timed += 1
            counters.fed_device_seconds += device_seconds
            counters.fed_late_seconds += max(0.0, spans[1] - device_seconds)

    def _sample_stamps(self, job_seconds: float, call: FedCall, counters: Any) -> None:
        """A stamped call into the next rebalance (the CPU's time as the device saw it, its hand-off counted as fixed
        time) and into the layer's counters."""
        host, row, event = call.stamps
        event.synchronize()  # passed already (see _done_with); a flush waits here
        timing = stamped_call(host[row].tolist())
        if timing is None:
            return
        self.handoff.observe(timing, job_seconds)
        cpu_seconds = self.handoff.cpu_seconds(timing, job_seconds)
        self._samples.append((cpu_seconds, timing.device, call.job.experts, max(0.0, cpu_seconds - job_seconds)))
        counters.fed_timed += 1
        counters.fed_device_seconds += timing.device
        counters.fed_late_seconds += timing.late

    def _rebalance(self) -> None:
        """A new share from the samples' totals (the fixed part of the CPU's jobs fitted over the recent ones): the
        device's share value (balanced split), or new picks where it moved by a step of the picks (1/E, static)."""
        cpu_total = sum(sample[0] for sample in self._samples)
        device_total = sum(sample[1] for sample in self._samples)
        worked = sum(1 for sample in self._samples if sample[2] > 0)
        handoff = sum(sample[3] for sample in self._samples)
        self._samples, self.cpu_fixed = [], cpu_fixed_seconds(self._jobs_done)
        share = balanced_share(self.share, cpu_total, device_total, cpu_fixed=self.cpu_fixed * worked + handoff)
        before = self.share
        self.share, experts = share, self.store.layout.num_experts
        self._moving = abs(share - before) >= SETTLED_MOVE
        self.history.append((self._mapped_steps, round(share, 4), round(1e3 * self.cpu_fixed, 3)))
        if self.balanced:  # the calls read it on the device: enqueued here, between steps, after the last one's calls
            self._share.fill_(share)
            return
        if round(share * experts) == round(before * experts):
            return  # less than one expert a layer: kept (the share itself moves on)
        log.info("mapped route: the CPU tier's share %.2f -> %.2f (CPU %.2f ms, device %.2f ms over the samples)",
                 before, share, 1e3 * cpu_total, 1e3 * device_total)  # fmt: skip
        self.picks = cpu_picks(len(self.layers), experts, share)
        self.picks_version += 1
