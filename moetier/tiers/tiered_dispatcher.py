"""The tiered dispatcher: VRAM-cache hits on the device, misses on the CPU tier and/or copied in.

Per call:
1. read the routing on the host (one wait for the device; a decode call also reads its ids' weights
   and its rows there, :mod:`moetier.tiers.decode_inputs`), group the (token, expert) pairs by
   expert; a group is a hit when its expert is resident;
2. split the misses between the CPU tier and the copy path by a cost model (measured at start-up on
   CUDA and kept true while serving, or a fixed ``cpu_share``): groups of at least ``fat_threshold``
   tokens always go to the device, the rest by longest-processing-time; a decode step whose batch size
   measured faster with copies only (:class:`SplitChooser`, chosen at the step's first MoE layer) sends
   every miss to the copy path (and reads no rows for the CPU tier), and one that measured faster mapped
   skips all of this: its calls read misses from the pinned home copy on the device
   (:mod:`moetier.tiers.mapped`, no host wait);
3. tell the policy what the layer used and reserve cache slots for the misses it admits (never
   evicting an expert this call reads);
4. enqueue the copy-path copies (into their cache slot when admitted, into the staging ring
   otherwise, prefetched ones first) on the copy stream, start the CPU worker (a decode call's job
   reads only host tensors), run hits then copied experts;
5. copy the CPU-routed admitted experts into their slots off the critical path, add the CPU tier's
   fp32 partial sums on the device.

A *streaming* call (at least ``stream_min_tokens`` tokens: a prefill chunk) leaves the decode cache
alone: the policy does not see its routing and nothing is admitted, so decode after a long prompt
finds the cache it had before. Its fat misses stream through the staging ring, and before it
returns it prefetches the next MoE layer's likely experts (the ones that layer used last chunk,
fat ones first; for a first chunk that covers most experts, all of them in id order) into the free
staging slots, so the copy engine keeps moving while attention runs between the two MoE layers.
The math is :func:`swiglu_expert` everywhere (decode calls run it as grouped kernels on CUDA), as in
:class:`ResidentDispatcher`; only the order of the final sums differs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.profiling import phase
from moetier.tiers.calibration import calibrate_routes
from moetier.tiers.call_routing import Group, Routing, sort_pairs, sort_pairs_for_device
from moetier.tiers.copy_path import CopyPath
from moetier.tiers.copy_timings import CopyTimings
from moetier.tiers.cpu_jobs import CallJobs
from moetier.tiers.cpu_tier import CpuExpertTier
from moetier.tiers.decode_inputs import HostBuffers, read_host_inputs
from moetier.tiers.dispatcher import Beside, ExpertDispatcher, T, expert_accumulator
from moetier.tiers.expert_cache import ExpertCache
from moetier.tiers.experts import ExpertStore
from moetier.tiers.gpu_wait import HostFlag
from moetier.tiers.hints import HintBuffer
from moetier.tiers.mapped import MappedExperts, mapped_order
from moetier.tiers.mapped_cpu import FedCpuShare, fed_share
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.next_layer import NextLayerPrefetch
from moetier.tiers.policies import make_policy
from moetier.tiers.route_costs import RouteAdapter, RouteCosts, split_misses
from moetier.tiers.split_choice import SplitChooser, StepTimer
from moetier.tiers.tiered_config import TieredConfig, default_staging_slots

log = logging.getLogger(__name__)
# A longer gap between two decode steps is idle time (no requests), not a step: it is not timed.
_STEP_GAP_S = 1.0
# How long the CPU tier's native worker spins for its next job on CUDA: longer than a decode layer (~1-2 ms).
DECODE_SPIN_S = 0.002


class TieredDispatcher(ExpertDispatcher):
    """Routed experts behind a VRAM cache, a CPU tier and a copy path; see the module docstring.

    Built by ``load_model`` over an empty store; :meth:`prepare` (called after loading, or lazily by
    the first dispatch) allocates the cache on the compute device, warms it, and measures route
    costs. ``metrics`` counts hits, misses, CPU time and bytes copied.
    """

    def __init__(self, store: ExpertStore, config: TieredConfig | None = None, **options: Any) -> None:
        super().__init__(store)
        if config is not None and options:
            raise ConfigError("pass either a TieredConfig or keyword options to TieredDispatcher, not both")
        self.config = config or TieredConfig(**options)
        self.metrics = TierMetrics()
        self.policy = make_policy(self.config.policy, **self.config.policy_options)
        self.cache: ExpertCache | None = None
        self.copies: CopyPath | None = None  # the copy path over the cache (made by prepare)
        self.mapped: MappedExperts | None = None  # the mapped route's device table (made by prepare)
        self.cpu_tier: CpuExpertTier | None = None
        self.costs = RouteCosts.from_share(self.config.cpu_share) if self.config.cpu_share is not None else RouteCosts()
        self.device: torch.device | None = None
        self.step = 0
        self._first_layer = min(store.layout.moe_layers)
        self._last_layer = max(store.layout.moe_layers)
        self._flag: HostFlag | None = None
        self.jobs: CallJobs | None = None  # the CPU tier's jobs for the calls (made by prepare)
        self.adapter = RouteAdapter()
        self.metrics.route_cost_scales = self.adapter.scales  # the same dict: /metrics reads it live
        self._copy_timings = CopyTimings(self.adapter, None)  # on the cache's copy stream once prepared
        self.chooser = SplitChooser()
        self.metrics.split_choices = self.chooser.report
        self._step_route = self.config.miss_route  # the miss route of the step in progress
        self._timer = StepTimer(_STEP_GAP_S)  # decode steps' durations, for the chooser
        self._mapped_failed = False  # a mapped call raised: that route is off from then on
        self._hints = HintBuffer(min_precision=self.config.hint_min_precision)
        # A streaming call copies its experts of at least this many tokens (auto: the fat ones; cpu: none).
        floor = {"cpu": 0, "auto": self.config.fat_threshold}.get(self.config.miss_route, 1)
        self._ahead = NextLayerPrefetch(store.layout.moe_layers, store.layout.num_experts, floor, self._hints)
        self._host_buffers = HostBuffers()  # a decode call's routing, rows and CPU sums on the host
        self._lane_buffers: dict[int, HostBuffers] = {}  # the same per half of a decode_halves step
        self._lane: int | None = None  # the half whose call is in progress (decode_lane)
        self._stream: Any = None  # the compute stream of the call in progress (None off CUDA)
        self._step_open = False  # inside decode_step: the step has started, its first call must not start another
        self._probes: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # This step reads the next layer's predicted experts ahead (mapped route), and how: launched when hinted
        # (its calls run in graphs, the hint comes after the call before it) or after the call before it.
        self._ahead_step, self._graphed_step = False, False
        self._pending_hint: int | None = None
        self._beside: Beside | None = None  # the work beside the call in progress (dispatch_beside)
        self._order = mapped_order()  # a mapped call's order, read once a step (for A/B runs)

    # --- set-up --------------------------------------------------------------------------------

    def prepare(self, device: torch.device | str) -> None:
        """Allocate the cache on ``device``, start the CPU worker, warm the cache, calibrate routes (once)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None:
            if device != self.device:
                raise ConfigError(f"tiered dispatcher was prepared for {self.device}, not {device}")
            return
        self._check_home(device)
        cfg, layout = self.config, self.store.layout
        n_slots = cfg.cache_slots if cfg.cache_slots is not None else cfg.cache_bytes // self.block_bytes
        staging = cfg.staging_slots or default_staging_slots(layout.top_k)
        self.cache = ExpertCache(self.store, device, n_slots, self.policy, staging, self.metrics)
        self.copies = CopyPath(self.store, self.cache, self.metrics)
        # On CUDA the native worker spins between a step's jobs (one per MoE layer): host cores only launch there.
        spin = DECODE_SPIN_S if device.type == "cuda" else 0.0
        self.cpu_tier = CpuExpertTier(layout.swiglu_limit, cfg.cpu_threads, spin_seconds=spin)
        self._copy_timings = CopyTimings(self.adapter, self.cache.copy_stream)
        self.device = device
        if cfg.gpu_waits_for_cpu and device.type == "cuda":
            self._flag = HostFlag.create(device)
        buffers = self._host_buffers
        self.jobs = CallJobs(self.store, self.cpu_tier, self.metrics, self.adapter, self._flag, buffers, device)
        split_priced = cfg.miss_route == "auto" and cfg.cpu_share is None
        fed_priced = cfg.miss_route == "mapped" and cfg.mapped_cpu_share is None  # the fed share from measured rates
        if device.type == "cuda" and (split_priced or fed_priced) and cfg.calibrate:
            self.costs = calibrate_routes(self.store, self.cache, self.cpu_tier, device, self._first_layer)
        fed = self._fed_cpu_share(device)
        self.mapped = MappedExperts(
            self.store, self.cache, self.policy, self.metrics, cfg.mapped_admissions, fed, cfg.mapped_prefetch,
            cfg.mapped_bookkeeping_every,
        )  # fmt: skip
        log.info(
            "tiered experts: %d cache slots, %d staging slots, policy %s, route costs %s",
            n_slots,
            staging,
            cfg.policy,
            self.costs,
        )

    def _fed_cpu_share(self, device: torch.device) -> FedCpuShare | None:
        """The CPU tier beside the mapped route (``TieredConfig.mapped_cpu_share``), where a step may be mapped."""
        cfg = self.config
        if cfg.miss_route != "mapped" and not (self._choosing() and self._mapped_wanted()):
            return None  # no step will be mapped
        return fed_share(self.store, self.cpu_tier, self.metrics, self.costs, device, cfg.mapped_cpu_share)

    @property
    def hint_rank_precision(self) -> list[float]:
        """The hints' measured precision per rank (what decides which predicted experts are prefetched)."""
        return self._hints.rank_precision()

    @property
    def wants_hints(self) -> bool:
        """Per step: a mapped step reads ahead on the device (``mapped_prefetch``), others copy ahead
        (``decode_prefetch``)."""
        if self._step_route == "mapped":
            return self._ahead_step
        return self.config.decode_prefetch > 0 and self.config.miss_route != "cpu"

    @property
    def wants_graph_hints(self) -> bool:
        return self._ahead_step and self._graphed_step

    def hint(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Keep a decode call's prediction for ``layer``: a mapped step reads those experts ahead on the device
        (:mod:`moetier.tiers.mapped_ahead`), another copies them to the host without a sync (see :mod:`hints`)."""
        if self._step_route == "mapped":
            if not self._ahead_step:
                return
            self.mapped.ahead.note(layer, topk_ids)
            if self._graphed_step:  # the call before it ran inside the segment that computed the prediction
                # On the stream the model runs on now (the last call's may have been a capture's or a warm-up's).
                self.mapped.ahead.launch(layer)
            else:  # launched once the call before it is enqueued (its reads of the slots come first)
                self._pending_hint = layer
            return
        if self.wants_hints and 0 < topk_ids.shape[0] < self.config.stream_min_tokens:
            self._hints.record(layer, topk_ids)

    def await_hint(self, layer: int) -> None:
        if self._ahead_step:
            self.mapped.ahead.join(layer)

    def decode_halves(self, tokens: int) -> bool:
        """``TieredConfig.decode_halves_min_tokens``: a decode step of that many sequences or more whose route the
        host decides per call (not the mapped route: its kernels wait on PCIe themselves, no device time is idle)."""
        least = self.config.decode_halves_min_tokens
        return self._step_open and 0 < least <= tokens and self._step_route != "mapped"

    @contextlib.contextmanager
    def decode_lane(self, lane: int) -> Iterator[None]:
        """Half ``lane``'s pinned buffers (the routing, rows and CPU sums a call reads and writes after it returns)
        for the calls inside: the other half's calls come before the device and the CPU tier are past these."""
        buffers = self._lane_buffers.get(lane)
        if buffers is None:
            buffers = self._lane_buffers[lane] = HostBuffers()
        before, self._lane = self._host_buffers, lane
        self._host_buffers = self.jobs.buffers = buffers
        try:
            yield
        finally:
            self._host_buffers = self.jobs.buffers = before
            self._lane = None

    @property
    def gpu_waits_for_cpu(self) -> bool:
        """Whether the compute stream (not the host thread) waits for decode CPU jobs (prepared, driver allows)."""
        return self._flag is not None

    @property
    def block_bytes(self) -> int:
        return self.store.layout.block_bytes(self.store.dtype)

    def resize_cache(self, n_slots: int) -> int:
        """Elastic cache: grow or shrink to ``n_slots`` between steps; returns the size reached."""
        if self.cache is None:
            raise ConfigError("prepare() the tiered dispatcher before resizing its cache")
        self.mapped.release(self._current_stream())  # a shrink may evict what the table reads
        return self.cache.resize(n_slots)

    def flush_metrics(self) -> None:
        """Bring the metrics up to date with counts the device still holds (the mapped route's; waits for it)."""
        if self.mapped is not None:
            self.mapped.flush()

    def close(self) -> None:
        if self.mapped is not None and self.mapped.cpu is not None and self.device.type == "cuda":
            # Steps still queued store start words into, and read sums from, the fed CPU tier's pinned buffers.
            torch.cuda.synchronize(self.device)
        if self.cpu_tier is not None:
            self.cpu_tier.close()

    def _check_home(self, device: torch.device) -> None:
        homes = {weights.block.device.type for _, weights in self.store.items()}
        if device.type == "cuda" and homes != {"cpu"}:
            raise ConfigError(
                "the tiered dispatcher needs the expert home copy in host memory: "
                "load with expert_allocator=HostExpertArena.for_checkpoint(path, dtype)"
            )
        pinned = all(weights.block.is_pinned() for _, weights in self.store.items()) if device.type == "cuda" else True
        if not pinned:
            log.warning("expert home copy is not pinned: copies to the GPU will run at pageable speed")

    # --- the call ------------------------------------------------------------------------------

    def dispatch_beside(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        beside: Callable[[], T],
    ) -> tuple[torch.Tensor, T]:
        """``beside`` runs where the call would wait for the CPU tier: a mapped call's once its kernels are enqueued
        (before the device waits for the CPU's sums), a copy-path call's before the CPU's sums are added; else
        after the call; with :func:`~moetier.tiers.mapped.mapped_order` other than ``beside`` (the default): first."""
        if self._order != "beside":
            return super().dispatch_beside(layer, hidden, topk_ids, topk_weights, beside)
        self._beside = Beside(beside)
        try:
            routed = self.dispatch(layer, hidden, topk_ids, topk_weights)
        finally:
            pending, self._beside = self._beside, None
        return routed, pending.result()

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        self.prepare(hidden.device)
        self._stream = self._current_stream()  # looked up once per call (torch's lookup is Python-heavy)
        out = expert_accumulator(hidden)
        if hidden.shape[0] == 0:
            return out.to(hidden.dtype)
        streaming = hidden.shape[0] >= self.config.stream_min_tokens
        if layer == self._first_layer and not self._step_open:
            self._begin_forward(hidden, streaming)
        if self._step_route == "mapped" and not streaming:
            if self._dispatch_mapped(layer, out, hidden, topk_ids, topk_weights):
                return out.to(hidden.dtype)
            out.zero_()  # the failed call's partial sums; the rest of the step copies its misses
        with phase("tiers.route"):  # the host waits here for the router's ids
            routing = self._route(layer, hidden, topk_ids, topk_weights, streaming)
        # A copies-only step (SplitChooser) tells the adapter nothing of the split: its copies run without the
        # CPU tier beside them, so their times would price the split's copies too low.
        adapt = self._adapting(streaming) and self._step_route == "auto"
        with phase("tiers.split"):
            hits, cpu_groups, copy_groups = self._split(layer, routing, adapt)
        # The GPU (not this thread) waits for a decode call's CPU sums, except at the last MoE layer,
        # so this thread goes on launching the next layer; the job's outcome is checked at the next call.
        release = None
        if cpu_groups and self._flag is not None and not streaming and layer != self._last_layer:
            release = self._flag.next_value()
        started = None
        try:
            with phase("tiers.policy"):  # what the layer used, and the slots its admitted misses take
                self._record(layer, routing, streaming)
                if not streaming:  # a prefill chunk never reshapes the decode cache
                    self._plan_admissions(layer, routing)
            # The copies go first: PCIe starts moving as soon as the slots are known. A decode call's CPU job
            # follows at once: it is built from host tensors (measured on the H200: as fast as starting the
            # predicted longer route first, and simpler).
            timer = self._copy_timings.start() if adapt and copy_groups else None
            with phase("tiers.copy_submit"):
                copies = self.copies.start(layer, copy_groups)
            if cpu_groups:
                # The start-up costs' price of the job, compared with its measured seconds when it is collected.
                predicted = sum(self.costs.cpu(g.count) for g in cpu_groups) if adapt else None
                started = self.jobs.submit(layer, hidden, routing, cpu_groups, release, self._stream, predicted)
            with phase("tiers.device"):
                read = self.copies.compute(layer, out, hidden, routing, hits, copies, streaming, self._stream)
            if timer is not None:
                self._copy_timings.stop(timer, sum(self.costs.copy(g.count) for g in copy_groups))
            with phase("tiers.after"):  # prefetches and the CPU-routed admissions' copies
                if streaming and self.config.prefetch:
                    self._ahead.prefetch_streamed(layer, int(routing.tokens_host.numel()), self.cache, self.metrics)
                elif not streaming and self.wants_hints:
                    self._ahead.prefetch_hinted(layer, self.config.decode_prefetch, self.cache, self.metrics)
                self._admit_cpu_routed(layer, cpu_groups)
        except BaseException:
            if started is not None:
                with contextlib.suppress(Exception):  # never leave a worker reading buffers this call drops
                    started[0].result()
            raise
        if started is not None:
            if self._beside is not None:  # the device's work beside the call, before it waits for the CPU's sums
                self._beside.run()
            with phase("tiers.cpu_sums"):
                self.jobs.add_sums(layer, out, started, release, self._stream)
        self.cache.mark_released(read, self._compute_stream())
        return out.to(hidden.dtype)

    @contextlib.contextmanager
    def decode_step(self, tokens: int, dtype: torch.dtype) -> Iterator[Hashable | None]:
        """A model's segmented decode step: the step's start (its route chosen, a mapped step's table brought up
        to date) happens here, before its calls; a mapped step's calls may then run inside the model's CUDA graphs
        (``TieredConfig.mapped_graphs``): it yields ``("mapped", fed)`` (:meth:`MappedExperts.graph_step`), any
        other step None."""
        if self.device is None or not 0 < tokens < self.config.stream_min_tokens:
            yield None  # not prepared yet (the first call prepares and starts its step) or not a decode step
            return
        probe = self._probes.get((tokens, dtype))
        if probe is None:  # what the route checks read of a call's rows: their count, dtype and device
            shape = (tokens, self.store.layout.hidden_size)
            probe = self._probes[(tokens, dtype)] = torch.empty(shape, dtype=dtype, device=self.device)
        self._stream = self._current_stream()
        failed = False
        try:
            with phase("tiers.step_start"):  # the host's work between two steps (the chooser, the table, the jobs)
                self._begin_forward(probe, streaming=False)
                mapped = self._step_route == "mapped" and self.config.mapped_graphs
                variant = self.mapped.graph_step(probe) if mapped else None
            wide = tokens >= self.config.mapped_prefetch_min_tokens
            self._ahead_step = self._step_route == "mapped" and wide and self.mapped.ahead_usable(probe)
            self._graphed_step = variant is not None
            if self._ahead_step and variant is not None:
                variant = (*variant, "ahead")
            self._step_open = True
            yield variant
        except BaseException:
            failed = True
            raise
        finally:
            self._step_open = False
            self._ahead_step, self._graphed_step, self._pending_hint = False, False, None
            self.mapped.end_step(failed)

    def _begin_forward(self, hidden: torch.Tensor, streaming: bool) -> None:
        """Before a forward's first MoE call: count it, take lent slots back (or lend them), start its step."""
        self.step += 1
        self.metrics.tokens += hidden.shape[0]
        if self._step_route == "mapped":  # before anything below may evict a slot the table read
            self.mapped.release(self._stream)
        self._lend_or_reclaim(streaming)
        self._start_step(hidden, streaming)

    def _dispatch_mapped(self, layer, out, hidden, topk_ids, topk_weights) -> bool:
        """The call on the mapped route; False after a failure (logged once; the copy route from then on)."""
        try:
            with phase("tiers.mapped"):
                if self._ahead_step and not self._graphed_step:  # the model's await_hint did it already
                    self.mapped.ahead.join(layer)
                beside = None if self._beside is None else self._beside.run
                self.mapped.dispatch(layer, out, hidden, topk_ids, topk_weights, self._stream, beside, self._order)
                if self._pending_hint is not None and self._pending_hint != layer:
                    self.mapped.ahead.launch(self._pending_hint)
                self._pending_hint = None
            return True
        except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
            log.warning("mapped expert route failed (%s); copying misses from now on", exc)
            self._mapped_failed, self._step_route = True, "copy"
            self._ahead_step, self._pending_hint = False, None
            self.mapped.end_step(failed=True)  # jobs queued for the step's other calls: cancelled
            return False

    def _split(self, layer: int, routing: Routing, adapt: bool) -> tuple[list, list, list]:
        """The call's hits, CPU-routed misses and copy-path misses (prefetched misses are the copy path's)."""
        hits = [g for g in routing.groups if g.slot is not None]
        misses = [g for g in routing.groups if g.slot is None]
        self._count(layer, hits, misses)
        # A prefetched miss is already on its way to the device: it is not the CPU's any more.
        prefetched = [g for g in misses if self.cache.is_prefetched((layer, g.expert))]
        others = [g for g in misses if not self.cache.is_prefetched((layer, g.expert))]
        route = self._step_route
        probe = self.adapter.probe() if adapt else None  # a starved route gets one group, to be measured again
        costs, fat = self._costs(adapt), self.config.fat_threshold
        cpu_idx, copy_idx = split_misses([g.count for g in others], route, costs, fat, probe)
        if adapt:
            self.adapter.note_split(len(cpu_idx), len(copy_idx))
        return hits, [others[i] for i in cpu_idx], prefetched + [others[i] for i in copy_idx]

    def _start_step(self, hidden: torch.Tensor, streaming: bool) -> None:
        """First MoE layer of a forward: time the previous decode step for the chooser, pick this step's route
        (a mapped one then brings the device table up to date)."""
        now, tokens, before = time.perf_counter(), hidden.shape[0], self._step_route
        self._order = mapped_order()
        mapped = not streaming and not self._mapped_failed and self.mapped.usable(hidden, tokens)
        route = self.config.miss_route
        self._step_route = route if route != "mapped" or mapped else "copy"
        if streaming or not self._choosing():
            self._timer.stop()
        else:
            self._timer.start(tokens, now, self._stream)
            for measured in self._timer.finished():
                self.chooser.observe(*measured)
            routes = ("auto", "copy", "mapped") if mapped and self._mapped_wanted() else ("auto", "copy")
            self._step_route = self.chooser.route(tokens, routes)
            self._timer.label(self._step_route)
        if self._step_route == "mapped":
            if self.jobs.pending:  # the last split step's CPU jobs: done (the host has read the step's tokens since)
                self.jobs.collect_pending()
            self.mapped.begin_step(self.step, self._stream, fresh=before != "mapped")

    def split_settled(self, tokens: int) -> bool:
        """Whether decode steps of ``tokens`` tokens per call run a chosen route (no trial under way or ahead)."""
        if self.device is None or not self._choosing():
            return True
        return self.chooser.settled(tokens)

    def _mapped_wanted(self) -> bool:
        """Whether the chooser may try the mapped route (``TieredConfig.mapped``; ``None``: on CUDA)."""
        wanted = self.config.mapped
        return self.device.type == "cuda" if wanted is None else wanted

    def _choosing(self) -> bool:
        """Whether decode steps choose between the split and copies only (``TieredConfig.choose_split``)."""
        cfg = self.config
        wanted = cfg.choose_split if cfg.choose_split is not None else self._adapting(False)
        return wanted and cfg.miss_route == "auto" and cfg.cpu_share is None

    def _costs(self, adapt: bool) -> RouteCosts:
        return self.adapter.costs(self.costs) if adapt else self.costs

    def _plan_admissions(self, layer: int, routing: Routing) -> None:
        """Reserve cache slots for the misses the policy admits, most tokens first (never evicting an
        expert this call reads)."""
        protected = {(layer, g.expert) for g in routing.groups}
        for group in sorted((g for g in routing.groups if g.slot is None), key=lambda g: -g.count):
            group.slot = self.cache.plan_admission((layer, group.expert), protected)

    def _record(self, layer: int, routing: Routing, streaming: bool) -> None:
        """Tell the policy (decode) or the streaming history what the layer used; count it; score the hint."""
        experts = [g.expert for g in routing.groups]
        counts = [g.count for g in routing.groups]
        if streaming:
            self._ahead.remember_streamed(layer, experts, counts)
        else:
            self.policy.record(layer, experts, counts, self.step)
            self._ahead.score_hint(layer, experts, self.metrics)
        self.metrics.record_routing(layer, experts, counts)

    def _admit_cpu_routed(self, layer: int, cpu_groups: list[Group]) -> None:
        """Admitted CPU-routed misses: copied into their slots behind the critical path (read next call)."""
        for group in cpu_groups:
            if group.slot is not None:
                self.cache.fill(group.slot, self.store.expert(layer, group.expert).block)
                self.metrics.layer(layer).admit_bytes += self.block_bytes

    def _lend_or_reclaim(self, streaming: bool) -> None:
        """First MoE layer of a forward: a streaming one borrows cache slots for the ring, a decode returns them."""
        if streaming and self.config.miss_route != "cpu" and not self.cache.lent and self.config.lend_slots:
            lent = self.cache.lend_to_staging(self.config.lend_slots)
            log.debug("streaming prefill: %d cache slots lent to the staging ring", lent)
        elif not streaming and self.cache.lent:
            reloaded = self.cache.reclaim_lent()
            log.debug("prefill done: cache slots back, %d experts reloaded", reloaded)

    def _route(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights, streaming: bool
    ) -> Routing:
        """Sort pairs by expert on the host (one wait for the device) and look each expert up.

        A decode call reads its ids, weights and (when the CPU tier may take misses) rows to the host in
        that wait (:mod:`moetier.tiers.decode_inputs`); a streaming call reads its ids and puts the sorted
        pairs on the device at once (its CPU groups gather their rows there).
        """
        host, on_device = None, (None, None)
        if streaming:
            num_experts = self.store.layout.num_experts
            order_host, experts_l, counts_l, *on_device = sort_pairs_for_device(topk_ids, topk_weights, num_experts)
        else:
            rows = self._step_route != "copy"  # a copies-only step (or dispatcher) never runs the CPU tier
            host = read_host_inputs(hidden, topk_ids, topk_weights, self._host_buffers, rows)
            order_host, experts_l, counts_l = sort_pairs(host.ids)
        if self.jobs.pending:  # the wait above waited for the GPU, which waited for the pending CPU jobs
            # (in a half's call only for this half's stream: the other half's jobs are taken once they are done)
            self.jobs.collect_pending(finished_only=self._lane is not None)
        self._copy_timings.poll()
        groups, start = [], 0
        for expert, count in zip(experts_l, counts_l, strict=True):
            groups.append(Group(expert, start, count, self.cache.get((layer, expert))))
            start += count
        return Routing(groups, order_host, order_host // topk_ids.shape[1], topk_weights, host, *on_device)

    # --- keeping the split's costs true (RouteAdapter) ------------------------------------------

    def _adapting(self, streaming: bool) -> bool:
        cfg = self.config
        wanted = cfg.adapt_costs if cfg.adapt_costs is not None else self.device.type == "cuda"
        return wanted and cfg.miss_route == "auto" and cfg.cpu_share is None and not streaming

    def _count(self, layer: int, hits: list[Group], misses: list[Group]) -> None:
        counters = self.metrics.layer(layer)
        counters.calls += 1
        counters.half_calls += self._lane is not None
        counters.experts_hit += len(hits)
        counters.experts_miss += len(misses)
        counters.uses_hit += sum(g.count for g in hits)
        counters.uses_miss += sum(g.count for g in misses)

    def _compute_stream(self) -> Any:
        """The stream this call's device work is enqueued on (None off CUDA)."""
        return self._stream

    def _current_stream(self) -> Any:
        cuda = self.device is not None and self.device.type == "cuda"
        return torch.cuda.current_stream(self.device) if cuda else None
