"""The mapped route: a decode call's misses read by the device's kernels straight from the pinned home copy.

The copy and CPU routes decide on the host, per MoE layer, where each miss runs: the host first waits for the
router's ids, then launches copies, a CPU job and the compute. At a few streams that host thread is the
critical path. Here the decode call needs no host decision at all. One device table holds, for every (layer,
expert), the byte offset of the block the kernels read, from one fixed base (:attr:`ExpertCache.anchor`):
its cache slot when it is resident, else its home copy in the pinned host arena, which the GPU reads over
PCIe (pinned memory is mapped into the device's address space). A call is the resident dispatcher's
device-built launch (:func:`~moetier.kernels.device_routing.run_routed`) over that table, plus one kernel
counting its uses on the device (:mod:`moetier.kernels.expert_counts`), so the host never waits inside a step
and the arithmetic, and so the bits, are the resident path's (measured on the H200: host-read blocks give the
VRAM blocks' bits; the kernels read bf16 blocks over PCIe at 0.92x the copy engine's rate, fp4 at 0.62x).

Between steps (:meth:`MappedExperts.begin_step`, at a mapped step's first MoE layer) the host catches up
without waiting: the counts copied back after an earlier step (an event it only queries) tell the policy and
the metrics what was used, up to ``admissions`` missed experts a step are admitted (copied into cache slots
on the copy stream), and the table follows the cache. Ordering on CUDA:
- an entry is pointed at a slot only once the slot's copy has landed (its ``ready`` event, queried);
- before a slot's key changes, its entry is pointed home again on the compute stream, and the slot's
  ``released`` event is recorded after that, so the copy into it waits for every kernel that read it
  through the table (:meth:`release`, also called before any other route's step, which may evict);
- the table is changed only by compute-stream copies enqueued between steps, so a step's calls all read
  one table.
Off CUDA the same table is read on the host, block by block, and the call runs the per-expert path: the
CPU tests check the table's bookkeeping against the resident results.

With a :class:`~moetier.tiers.mapped_cpu.FedCpuShare`, a share of each call's uncached experts is the CPU tier's
(:attr:`MappedExperts.pick`, a device tensor the table's writes keep up to date, marks the uncached ones): the
device copies those pairs to the CPU tier's worker and skips them itself, so both links run in the step and it
still never waits on the host (:mod:`moetier.tiers.mapped_cpu`). The device counts the pairs it left to the CPU
beside every expert's uses, so the metrics know each side's share exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from moetier.kernels import grouped_experts
from moetier.kernels.device_routing import (
    LayerBlocks,
    device_routing_fits,
    launch_routed,
    left_to_cpu,
    routed_table,
)
from moetier.kernels.expert_counts import count_uses, count_uses_reference
from moetier.tiers.dispatcher import run_host_sorted
from moetier.tiers.expert_cache import ExpertCache, Slot
from moetier.tiers.experts import ExpertStore, ExpertWeights, swiglu_expert
from moetier.tiers.mapped_ahead import MappedPrefetch
from moetier.tiers.mapped_cpu import FedCpuShare
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.policies import CachePolicy, Key

log = logging.getLogger(__name__)

# Missed experts admitted per mapped step: each copy shares PCIe with the step's own host reads.
DEFAULT_MAPPED_ADMISSIONS = 2
# Steps the host may run ahead of the counts it reads back before it waits for them.
LAG_STEPS = 2
# Most of a call's blocks are read from the pinned home copy: the fp4 kernels' blocks for host reads.
_HOST_READS = grouped_experts.HOST_READ_FP4_BLOCKS


MAPPED_ORDERS = ("kernel", "beside", "torch")
_WARNED_ORDERS: set[str] = set()


def mapped_order() -> str:
    """``MOETIER_MAPPED_ORDER`` (the tiered dispatcher reads it once a step, for A/B runs; the same bits in each):

    - ``kernel`` (default): a mapped call's uses counted by one kernel before its kernels, the work beside it
      (:meth:`ExpertDispatcher.dispatch_beside`, the shared expert) before the call;
    - ``beside``: both after the call's kernels, inside the device's timed share, before it waits for the CPU tier's
      sums (measured on an H100: no gain at 1 stream, ~3% under ``torch`` at 4 streams,
      ``results/h100-20261207-54a6968-mapped-order-ab``);
    - ``torch``: counted by nine torch ops before the call's kernels, the work beside first (the order before)."""
    order = os.environ.get("MOETIER_MAPPED_ORDER", "kernel")
    if order in MAPPED_ORDERS:
        return order
    if order not in _WARNED_ORDERS:  # an A/B with a misspelt side would measure the default twice
        _WARNED_ORDERS.add(order)
        log.warning("MOETIER_MAPPED_ORDER=%r is not one of %s: using kernel", order, ", ".join(MAPPED_ORDERS))
    return "kernel"


class MappedExperts:
    """The device table of every expert's block and the host bookkeeping that keeps it equal to the cache.

    Contract: :meth:`begin_step` once before a mapped decode step's first call (then, for a step whose calls may
    replay CUDA graphs, :meth:`graph_step`, and :meth:`end_step` after it), then :meth:`dispatch` per MoE layer
    (device work only: it may run inside a CUDA graph), and :meth:`release` before anything else may change the
    cache (another route's step, a resize, a prefill lending slots). ``usable`` says whether the
    device kernels take a call; off CUDA dispatch reads the table on the host instead.
    """

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        policy: CachePolicy,
        metrics: TierMetrics,
        admissions: int = DEFAULT_MAPPED_ADMISSIONS,
        cpu: FedCpuShare | None = None,
        ahead_slots: int = 0,
        bookkeeping_every: int = 1,
    ) -> None:
        layout = store.layout
        self.store, self.cache, self.policy, self.metrics = store, cache, policy, metrics
        self.admissions, self.cpu, self.bookkeeping_every = admissions, cpu, bookkeeping_every
        self._since_bookkeeping = bookkeeping_every  # so the first step keeps the books
        self.device, self.cuda = cache.device, cache.device.type == "cuda"
        self.layers = sorted(layout.moe_layers)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self.experts = layout.num_experts
        self.anchor: ExpertWeights = cache.anchor
        self.base = self.anchor.block.data_ptr()
        homes = [store.expert(layer, e).block for layer in self.layers for e in range(self.experts)]
        self._home = [block.data_ptr() - self.base for block in homes]
        self.table = torch.tensor(self._home, dtype=torch.int64, device=self.device)
        # Per entry: the CPU computes it (a fed share's pick, while the entry points home).
        self._picks = list(cpu.picks) if cpu is not None else [False] * len(self._home)
        self.pick = torch.tensor(self._picks, dtype=torch.uint8, device=self.device)
        self._base = self.anchor.block.view(torch.uint8)  # the table kernel's pointer origin for the CPU's inbox
        self._share_version = 0  # the fed share's picks_version the pick tensor follows
        # Per entry: the pairs that used it (row 0), those of them the CPU tier computed (row 1), those that read it
        # from a cache slot (row 2), the calls that used it (row 3) and those of them that read it from a slot (row
        # 4). Counted by the device when used, so a hit is a hit whenever the host looks, and a call's distinct
        # experts are the other routes' per-call hits and misses whatever the window the counts come back over.
        self.counts = torch.zeros((5, len(self._home)), dtype=torch.int64, device=self.device)
        self._in_slot = torch.zeros(len(self._home), dtype=torch.int64, device=self.device)  # 1: points at a slot
        self._layer_counts = {layer: self.counts[:, self._span(layer)] for layer in self.layers}
        self._cpu_count_rows = {layer: self.counts[1, self._span(layer)] for layer in self.layers}
        self._used = {layer: torch.zeros(self.experts, dtype=torch.int64, device=self.device) for layer in self.layers}
        self._in_slot_rows = {layer: self._in_slot[self._span(layer)] for layer in self.layers}
        self._pick_rows = {layer: self.pick[self._span(layer)] for layer in self.layers}
        self._aligned = all(offset % 16 == 0 for offset in self._home) and self.base % 16 == 0
        # The GPU reads pinned memory only (mapped into its address space): a pageable home copy (pinning failed
        # or was turned off) keeps the other routes.
        self._readable = not self.cuda or all(block.is_pinned() for block in homes)
        self._blocks: dict[tuple[int, torch.dtype], LayerBlocks | None] = {}
        self._pointed: dict[Key, Slot] = {}  # entries that point at a cache slot now
        self._version = -1  # the cache version the pointed entries were last compared with
        self._landing: set[Key] = set()  # resident keys whose copy had not landed at the last comparison
        self._seen = torch.zeros((5, len(self._home)), dtype=torch.int64)  # the counts harvested so far (host)
        self._readback: tuple[torch.Tensor, Any, int] | None = None  # (host counts, event, steps covered)
        self._steps = 0  # steps begun since the last readback started
        self._step = 0
        self._by_address: dict[int, ExpertWeights] = {}
        # The next layer's predicted experts read into staging slots by the device during the attention.
        self.ahead = None
        if ahead_slots > 0:
            self.ahead = MappedPrefetch(store, cache, self.table, self.pick, self._home, self.layers, ahead_slots)
        self._ahead_seen = torch.zeros((len(self.layers), 2), dtype=torch.int64)  # [copied, used] harvested

    # --- the call -------------------------------------------------------------------------------

    def usable(self, hidden: torch.Tensor, tokens: int) -> bool:
        """Whether a decode call of ``tokens`` rows takes the device kernels (off CUDA: always, on the host)."""
        if not self.cuda:
            return True
        return (
            self._readable
            and self._aligned
            and device_routing_fits(hidden, tokens, tokens * self.store.layout.top_k)
            and (self._layer_blocks(self.layers[0], hidden.dtype) is not None)
        )

    def dispatch(
        self,
        layer: int,
        out: torch.Tensor,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        stream: Any = None,
        beside: Callable[[], None] | None = None,
        order: str | None = None,
    ) -> None:
        """Add the layer's routed experts into ``out`` (float32 ``[T, H]``), each read where the table says (the
        CPU tier's picks computed by the fed worker, where there is one; ``stream``: the call's, on CUDA), and count
        the call's uses. ``beside`` (the model's work that does not need the routed experts) runs once its kernels
        are enqueued, with the counts (:func:`mapped_order` ``beside``; by default the counts come first and
        ``beside`` is None): on the device before it waits for the CPU tier's sums. Both count as the device's
        share of the call when it is timed: outside it, a CPU done during them looked late to the balance, which
        then gave it less (H100, 4 streams: share 0.54 against 0.64, 0.9x the tok/s). ``order``: the caller's
        :func:`mapped_order` (None: read here)."""
        fed = self.cpu is not None and self.cpu.usable(hidden)
        if self.cpu is not None and not fed:
            self.cpu.abort_step()  # a queued step whose call cannot be fed: no job may wait for a start never stored
        pick = self._pick_rows[layer] if fed else None
        order = order or mapped_order()
        if order != "beside":
            self._count(layer, topk_ids, order)
        after = partial(self._after_kernels, layer, topk_ids, beside, order)
        if self.cuda:
            self._dispatch_on_device(layer, out, hidden, topk_ids, topk_weights, pick, stream, after)
            self._restore_ahead(layer, topk_ids)
            return
        call, skip, rows = None, None, None
        if fed:  # the host plays the device: it fills the inbox, stores the start word, runs the device's share
            # with a split in parts, a cut expert's first rows are the device's
            skip, rows = left_to_cpu(topk_ids, pick, self.cpu.call_split(layer), self._cpu_count_rows[layer])
            inbox = self.cpu.inbox(hidden.shape[0])
            self.cpu.fill(inbox, hidden, topk_ids, topk_weights, skip, rows)
            call = self.cpu.start(layer, inbox, stream)
            skip, rows = (skip, rows) if call is not None else (None, None)
        try:
            if call is not None:
                self.cpu.mark_start(call, stream)
            self._run_on_host(layer, out, hidden, topk_ids, topk_weights, skip, rows)
            after()
            if call is not None:
                self.cpu.mark_end(call, stream)
        except BaseException:
            if call is not None:
                self.cpu.abandon(call)
            raise
        if call is not None:
            self.cpu.collect(call, out, stream)
        self._restore_ahead(layer, topk_ids)

    def _after_kernels(self, layer, topk_ids: torch.Tensor, beside: Callable[[], None] | None, order: str) -> None:
        """Once the call's kernels are enqueued (order ``beside``): its uses counted on the device, then the work
        beside it."""
        if order == "beside":
            self._count(layer, topk_ids, order)
        if beside is not None:
            beside()

    def _count(self, layer: int, topk_ids: torch.Tensor, order: str) -> None:
        """The call's uses into the layer's count rows: one kernel, or the torch ops (order ``torch``)."""
        counts, in_slot, used = self._layer_counts[layer], self._in_slot_rows[layer], self._used[layer]
        if order == "torch":
            count_uses_reference(counts, in_slot, topk_ids.reshape(-1), used)
        else:
            count_uses(counts, in_slot, topk_ids, used)

    def _restore_ahead(self, layer: int, topk_ids: torch.Tensor) -> None:
        """After the call's kernels: the entries its reads ahead pointed at staging slots point home again."""
        if self.ahead is not None:
            self.ahead.restore(layer, topk_ids)

    def ahead_usable(self, hidden: torch.Tensor) -> bool:
        """Whether a decode call like ``hidden`` on this route takes reads ahead (:mod:`moetier.tiers.mapped_ahead`)."""
        return self.ahead is not None and self.ahead.usable(hidden) and self.usable(hidden, hidden.shape[0])

    def _dispatch_on_device(self, layer, out, hidden, topk_ids, topk_weights, pick, stream, after) -> None:
        """The device-built launch over the table; with ``pick``, one kernel writes the table and the CPU tier's
        inbox, the start word follows it, the kernels run the device's pairs, ``after()`` enqueues the counts and
        the work beside, then the stream adds the CPU's sums."""
        blocks, limit = self._layer_blocks(layer, hidden.dtype), self.store.layout.swiglu_limit
        if pick is None:
            launch_routed(out, hidden, topk_weights, blocks, limit, routed_table(blocks, topk_ids), _HOST_READS)
            after()
            return
        inbox = self.cpu.inbox(hidden.shape[0])
        target = self.cpu.target(hidden.shape[0], self._base)
        split, counted = self.cpu.call_split(layer), self._cpu_count_rows[layer]
        routed = routed_table(blocks, topk_ids, pick, target, topk_weights, hidden.contiguous(), split, counted)
        call = self.cpu.start(layer, inbox, stream)
        if call is None:  # the table leaves the CPU's pairs out: build it again with every pair
            launch_routed(out, hidden, topk_weights, blocks, limit, routed_table(blocks, topk_ids), _HOST_READS)
            after()
            return
        try:
            self.cpu.mark_start(call, stream)
            launch_routed(out, hidden, topk_weights, blocks, limit, routed, _HOST_READS)
            after()  # inside the device's timed share: the balance evens the CPU's job against all of it
            self.cpu.mark_end(call, stream)
        except BaseException:
            self.cpu.abandon(call)
            raise
        self.cpu.collect(call, out, stream)

    def _run_on_host(self, layer, out, hidden, topk_ids, topk_weights, skip, rows=None) -> None:
        """Off CUDA: the table read on the host and the per-expert path over the pairs ``skip`` leaves (``rows``:
        each pair's intermediate rows on the device, a cut expert's first ones; see ``routing_table.split_rows``)."""
        layout = self.store.layout
        limit, inter, experts = layout.swiglu_limit, layout.intermediate_size, layout.num_experts
        offsets = self.table[self._span(layer)].tolist()
        if skip is None:
            run_host_sorted(out, hidden, topk_ids, topk_weights, lambda e: self._block_at(offsets[e]), limit, experts)
            return
        if rows is not None:  # the cut expert's pairs: their first rows here, the rest is the CPU tier's
            cut = (rows > 0) & (rows < inter)
            for t, k in cut.nonzero().tolist():
                block, upto = self._block_at(offsets[int(topk_ids[t, k])]), int(rows[t, k])
                part = swiglu_expert(hidden[t : t + 1], block, limit, (0, upto))
                out[t] += part[0].float() * topk_weights[t, k].float()
            skip = skip | cut
        keep = ~skip.reshape(-1)
        if not bool(keep.any()):
            return
        tokens = torch.arange(topk_ids.shape[0]).repeat_interleave(topk_ids.shape[1])[keep]
        part = torch.zeros((tokens.numel(), out.shape[1]), dtype=torch.float32)
        ids, weights = topk_ids.reshape(-1, 1)[keep], topk_weights.reshape(-1, 1)[keep]
        run_host_sorted(part, hidden[tokens], ids, weights, lambda e: self._block_at(offsets[e]), limit, experts)
        out.index_add_(0, tokens, part)

    # --- between steps --------------------------------------------------------------------------

    def begin_step(self, step: int, stream: Any, fresh: bool = False) -> None:
        """Before a mapped step: every ``bookkeeping_every``-th step (and after another route's) a round of
        :meth:`_keep_books`; the steps between only point entries at slots whose copies have landed. The step before
        a round starts copying the counts back, so the round finds them (the host waits only for counts
        ``LAG_STEPS`` steps old). ``fresh``: the step before took another route (the fed share's first calls after
        it are not timed)."""
        self._step = step
        self._since_bookkeeping += 1
        # Why not every step: at 1 stream the round costs the host-bound step a quarter of its time, while admitting
        # a few steps later costs the hit rate next to nothing (a layer's hot experts drift slowly).
        if fresh or self._since_bookkeeping >= self.bookkeeping_every:
            self._since_bookkeeping = 0
            self._keep_books(stream, fresh)
        elif self._landing and all(self._has_landed(key) for key in self._landing):
            self._follow_cache(stream, [])
        self._steps += 1
        if self._since_bookkeeping == self.bookkeeping_every - 1:  # the next step keeps the books
            self._start_readback(stream)

    def _keep_books(self, stream: Any, fresh: bool) -> None:
        """Take in the counts that came back, admit, bring the table up to date."""
        if self.cpu is not None:
            if fresh:
                self.cpu.settle()
            self.cpu.harvest()
            self._follow_share()
        self._record_ahead_times()
        admitted = self._admit(*self._harvest())
        self._follow_cache(stream, [slot for slot, _ in admitted])
        if admitted:
            self.cache.fill_many([(slot, self.store.expert(*key).block) for slot, key in admitted])
            for _, key in admitted:
                self.metrics.layer(key[0]).admit_bytes += self.cache.block_bytes
            self._landing.update(key for _, key in admitted)  # pointed at from the step their copies landed by

    def graph_step(self, hidden: torch.Tensor) -> tuple[str, bool] | None:
        """After :meth:`begin_step`, for a step whose calls the model may run inside CUDA graphs (``hidden``: one
        call's rows, or an empty tensor shaped like them): what those calls do, ``("mapped", fed)``, or None when
        the step must run eagerly (a fed share's timed step). A fed step's jobs are queued here, since replayed
        calls run no host code (:meth:`FedCpuShare.queue_step`), a timed step's too (its eager calls then take them,
        with no submission among their launches); :meth:`end_step` closes the step."""
        fed = self.cpu is not None and self.cpu.usable(hidden)
        if not fed:
            return "mapped", False
        timed = self.cpu.timed_step()
        self.cpu.queue_step(hidden.shape[0])
        return None if timed else ("mapped", True)

    def end_step(self, failed: bool = False) -> None:
        """After a step: a queued step's jobs are the calls' own again, the reads ahead's slots given back;
        ``failed``: the jobs its calls never started are cancelled (:meth:`FedCpuShare.abort_step`) and the
        entries its reads ahead changed restored."""
        if self.ahead is not None:
            self.ahead.finish_step(self._stream_now(), failed)
        if self.cpu is not None:
            if failed:
                self.cpu.abort_step()
            self.cpu.end_step(self._stream_now())

    def _follow_share(self) -> None:
        """After the fed share moved: every entry's pick again (the new picks, where the entry points home)."""
        if self._share_version == self.cpu.picks_version:
            return
        self._share_version = self.cpu.picks_version
        pointed = {self._index(key) for key in self._pointed}
        self._picks = [pick and i not in pointed for i, pick in enumerate(self.cpu.picks)]
        picks = torch.tensor(self._picks, dtype=torch.uint8)
        self.pick.copy_(picks.pin_memory() if self.cuda else picks, non_blocking=self.cuda)

    def release(self, stream: Any, extra: list[Slot] = ()) -> None:
        """Record, on ``stream``, that every kernel reading a slot through the table has been enqueued: a later
        copy into one of those slots (or into ``extra``) waits for them."""
        if self.ahead is not None:  # a step that never ended (end_step) gives its slots back here
            self.ahead.finish_step(stream, failed=True)
        slots = list(self._pointed.values()) + list(extra)
        if slots:
            self.cache.mark_released(slots, stream)

    def flush(self) -> None:
        """Take in every count so far, waiting for the device (a measured window's metrics; tests)."""
        if self.cpu is not None:
            self.cpu.harvest(wait=True)
        for _ in range(2):  # the readback in flight, then one of the counts as they are now (nothing admitted)
            if self._readback is not None and self._readback[1] is not None:
                self._readback[1].synchronize()
            self._harvest()
            self._start_readback(self._stream_now())
        self._record_ahead_times()

    def _harvest(self) -> tuple[dict[Key, int], int]:
        """The experts used since the counts last came back (if they have), told to the policy and metrics, and
        how many steps they cover.

        With nothing in a step waiting for the device, the host may run steps ahead (a benchmark that never reads
        its tokens): once the readback is ``LAG_STEPS`` steps old the host waits for it, which still leaves the
        device that many steps of queued work, so admissions keep up without idling the device."""
        if self._readback is None:
            return {}, 0
        event = self._readback[1]
        if event is not None and not event.query():
            if self._steps < LAG_STEPS:
                return {}, 0
            event.synchronize()
        host, _, steps, ahead = self._readback
        self._readback = None
        self._record_ahead(ahead)
        # Only the entries that moved (a step's pairs), found by torch: a real model has ~11k entries.
        moved = host - self._seen
        changed = torch.nonzero(moved[0]).flatten()
        used: dict[Key, int] = {}
        split: dict[Key, tuple[int, int, int, int]] = {}  # (by the CPU tier, from a slot, calls, calls from a slot)
        for i, (count, *rest) in zip(changed.tolist(), moved[:, changed].t().tolist(), strict=True):
            key = (self.layers[i // self.experts], i % self.experts)
            used[key], split[key] = count, tuple(rest)
        self._seen = host
        self._record(used, steps, split)
        return used, steps

    def _record(self, used: dict[Key, int], steps: int, split: dict[Key, tuple[int, int, int, int]]) -> None:
        """The harvested uses into the policy and the metrics: an expert used from a slot and from home within
        the counts' window (admitted in it) counts as hit and missed both, each use as what it was."""
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for (layer, expert), count in used.items():
            by_layer.setdefault(layer, []).append((expert, count))
        block = self.cache.block_bytes
        for layer in self.layers:
            pairs = by_layer.get(layer, [])
            experts, counts = [e for e, _ in pairs], [c for _, c in pairs]
            counters = self.metrics.layer(layer)
            counters.calls += steps
            if not pairs:
                continue
            self.policy.record(layer, experts, counts, self._step)
            self.metrics.record_routing(layer, experts, counts)
            for expert, count in pairs:
                cpu, hits, calls, hit_calls = split[(layer, expert)]
                counters.experts_hit += hit_calls
                counters.experts_miss += calls - hit_calls
                counters.uses_hit += hits
                counters.uses_miss += count - hits
                counters.cpu_pairs += cpu  # computed by the fed CPU tier from the home copy (whole experts)
                # The others' kernels read their block over PCIe (a cut expert's pairs count here, whole).
                counters.mapped_pairs += count - hits - cpu
                counters.mapped_bytes += (count - hits - cpu) * block

    def _record_ahead(self, stats: torch.Tensor | None) -> None:
        """The reads ahead since the last readback: ``prefetch_used`` / ``prefetch_wasted`` / ``prefetch_bytes``."""
        if stats is None:
            return
        moved, self._ahead_seen = stats - self._ahead_seen, stats
        for layer, (copied, used) in zip(self.layers, moved.tolist(), strict=True):
            counters = self.metrics.layer(layer)
            counters.prefetch_used += used
            counters.prefetch_wasted += copied - used
            counters.prefetch_bytes += copied * self.cache.block_bytes

    def _record_ahead_times(self) -> None:
        """The reads ahead the device has passed: their copy and wait times into each layer's counters."""
        if self.ahead is None:
            return
        for layer, copy_seconds, wait_seconds in self.ahead.harvest_times():
            counters = self.metrics.layer(layer)
            counters.prefetch_timed += 1
            counters.prefetch_copy_seconds += copy_seconds
            counters.prefetch_wait_seconds += wait_seconds

    def _admit(self, used: dict[Key, int], steps: int) -> list[tuple[Slot, Key]]:
        """Reserve slots for the missed experts the policy admits, most used first (never evicting an expert of the
        same layer used in the same window): every one a free slot takes (a cold cache fills as fast as the copy
        path fills it), and up to ``admissions`` per step the counts cover that evict another."""
        admitted: list[tuple[Slot, Key]] = []
        evicting = 0
        missed = sorted((k for k in used if self.cache.get(k) is None), key=lambda k: -used[k])
        for key in missed:
            evicts = self.cache.free_slots == 0
            if evicts and evicting >= self.admissions * steps:
                break
            protected = {k for k in used if k[0] == key[0]}
            slot = self.cache.plan_admission(key, protected)
            if slot is not None:
                admitted.append((slot, key))
                evicting += evicts
        return admitted

    def _follow_cache(self, stream: Any, refilled: list[Slot]) -> None:
        """Point entries home whose slot lost its key, and at slots whose copies landed; then order the copies
        into ``refilled`` after every read of them through the table."""
        changes: dict[int, int] = {}
        if self.cache.version != self._version or self._landing:
            for key, slot in list(self._pointed.items()):
                if self.cache.get(key) is not slot:
                    del self._pointed[key]
                    changes[self._index(key)] = self._home[self._index(key)]
            self._landing = set()
            for key, slot in self.cache.items():
                if key in self._pointed or key[0] not in self._row:
                    continue
                address = slot.tensor.data_ptr()
                if not self.cache.landed(slot) or (self.cuda and address % 16):
                    self._landing.add(key)
                    continue
                self._pointed[key] = slot
                changes[self._index(key)] = address - self.base
            self._version = self.cache.version
        if changes:
            self._write(changes)
        if refilled:
            self.release(stream, refilled)

    def _has_landed(self, key: Key) -> bool:
        """Whether the copy admitting ``key`` has landed (an evicted key's has nothing left to wait for)."""
        slot = self.cache.get(key)
        return slot is None or self.cache.landed(slot)

    def _write(self, changes: dict[int, int]) -> None:
        """Enqueue the table's changed entries, and the CPU picks that follow them (an entry pointed at a slot is
        the device's), on the current stream: after the kernels enqueued before."""
        static = self.cpu.picks if self.cpu is not None else self._picks
        picks = [int(static[i] and offset == self._home[i]) for i, offset in changes.items()]
        for i, pick in zip(changes, picks, strict=True):
            self._picks[i] = bool(pick)
        in_slot = [int(offset != self._home[i]) for i, offset in changes.items()]
        update = torch.tensor([list(changes), list(changes.values()), picks, in_slot], dtype=torch.int64)
        if self.cuda:
            update = update.pin_memory().to(self.device, non_blocking=True)
        self.table.index_copy_(0, update[0], update[1])
        self.pick.index_copy_(0, update[0], update[2].to(torch.uint8))
        self._in_slot.index_copy_(0, update[0], update[3])

    def _start_readback(self, stream: Any) -> None:
        """Copy the counts back to the host (non-blocking; harvested once its event has passed)."""
        if self._readback is not None:
            return
        stats = self.ahead.stats if self.ahead is not None else None  # [copied, used] per layer, on the device
        if not self.cuda:
            self._readback = (self.counts.clone(), None, self._steps, None if stats is None else stats.clone())
        else:
            host = torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=True)
            host.copy_(self.counts, non_blocking=True)
            ahead = None
            if stats is not None:
                ahead = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
                ahead.copy_(stats, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            self._readback = (host, event, self._steps, ahead)
        self._steps = 0

    # --- lookups --------------------------------------------------------------------------------

    def _stream_now(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _span(self, layer: int) -> slice:
        row = self._row[layer]
        return slice(row * self.experts, (row + 1) * self.experts)

    def _index(self, key: Key) -> int:
        return self._row[key[0]] * self.experts + key[1]

    def _layer_blocks(self, layer: int, dtype: torch.dtype) -> LayerBlocks | None:
        """The kernels' view of the layer's table entries (offsets from the anchor), judged once per dtype."""
        key = (layer, dtype)
        if key not in self._blocks:
            probe = torch.empty((1, 1), dtype=dtype, device=self.device)
            placement = grouped_experts._grouped_placement(probe, [(self.anchor, 0, 1)])
            offsets = self.table[self._span(layer)]
            self._blocks[key] = None if placement is None else LayerBlocks(self.anchor, offsets, 16, placement)
        return self._blocks[key]

    def _block_at(self, offset: int) -> ExpertWeights:
        """The block an entry addresses (host reads of the table, off CUDA): a slot's or a home copy's."""
        address = self.base + offset
        if address not in self._by_address:
            homes = [weights for _, weights in self.store.items()]
            self._by_address = {w.block.data_ptr(): w for w in homes + [s.weights for s in self.cache.all_slots()]}
        if address not in self._by_address:
            raise RuntimeError(f"mapped expert table points at an unknown block (offset {offset})")
        return self._by_address[address]
