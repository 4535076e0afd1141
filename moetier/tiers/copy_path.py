"""The copy path of a tiered call: missed experts copied into VRAM slots (cache or staging ring), computed there.

:class:`CopyPath` is the part of :class:`~moetier.tiers.tiered_dispatcher.TieredDispatcher`'s call that moves
experts over PCIe with the copy engine and runs them on the device: :meth:`CopyPath.start` enqueues a call's
copies before any of its compute, :meth:`CopyPath.compute` runs the hits and the copied experts as their copies
land, refilling the staging ring behind the compute.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from moetier.kernels.grouped_experts import MAX_GROUP_TOKENS, expert_batches_enabled, run_experts
from moetier.profiling import phase
from moetier.tiers.call_routing import Copies, Group, Routing
from moetier.tiers.expert_cache import ExpertCache, Slot
from moetier.tiers.experts import ExpertStore
from moetier.tiers.metrics import TierMetrics

# Fat staged experts a streaming call computes at most: one call of several spends the per-call host work once
# and the per-expert path's batched ops over all of them (the fp4 prefill is host-bound: ~0.4 ms of host an
# expert-call in the H100's profile against ~0.24 ms to copy one V4-Flash fp4 expert).
STREAM_FAT_PER_CALL = 4


def stream_fat_per_call(ring: int) -> int:
    """Fat experts a streaming call takes from a staging ring of ``ring`` slots: a quarter of it, 1 to
    :data:`STREAM_FAT_PER_CALL`, so the rest of the ring keeps copying while a call's experts wait to be read
    (1 with ``MOETIER_EXPERT_BATCHES=0``)."""
    if not expert_batches_enabled():
        return 1
    return max(1, min(STREAM_FAT_PER_CALL, ring // 4))


def _streamed_batch_end(staged: list[tuple[Group, Slot]], first: int, fat_per_call: int = 1) -> int:
    """End of a streaming call's next compute batch from ``first``: the thin experts staged from there, and up
    to ``fat_per_call`` fat ones with the thin ones between them. The copies land in staging order, so the batch
    waits for nothing its last expert does not wait for."""
    end, fat = first, 0
    while end < len(staged) and fat < fat_per_call:  # a thin one after the last fat one waits for the next call
        fat += staged[end][0].count > MAX_GROUP_TOKENS
        end += 1
    return end


class CopyPath:
    """A tiered call's copies and device compute over ``cache`` (see the module docstring).

    Contract: :meth:`start` once per call with its copy-path groups (each an admitted group with its cache slot,
    or one that goes through the staging ring), then :meth:`compute` with the call's hits and those copies, on
    the call's compute ``stream``; it returns the cache slots the call read (to be marked released).
    """

    def __init__(self, store: ExpertStore, cache: ExpertCache, metrics: TierMetrics) -> None:
        self.store, self.cache, self.metrics = store, cache, metrics

    def start(self, layer: int, copy_groups: list[Group]) -> Copies:
        """Enqueue the copy path's copies on the copy stream, before any compute of this call.

        Admitted misses are copied straight into their cache slot; the others go through the staging
        ring, prefetched ones first (their copies were issued earliest), as many as the ring has free
        slots; the rest wait for :meth:`compute` to free a slot.
        """
        copies = Copies(direct=[g for g in copy_groups if g.slot is not None])
        counters = self.metrics.layer(layer)
        from_host, moved = [], []
        for group in copy_groups:
            slot = self.cache.claim_prefetched((layer, group.expert))
            if slot is not None:
                counters.copy_pairs += group.count
                counters.prefetch_used += 1
            if group.slot is not None:  # admitted: into its cache slot, from the prefetched copy if there is one
                (from_host if slot is None else moved).append((group, slot))
            elif slot is None:
                copies.waiting.append(group)
            else:
                copies.staged.append((group, slot))
        counters.prefetch_wasted += len(self.cache.drop_prefetched())
        self._move_prefetched(moved)
        self._refill(layer, copies.waiting, copies.staged, [(g, g.slot) for g, _ in from_host])
        return copies

    def _move_prefetched(self, moved: list[tuple[Group, Slot]]) -> None:
        """Admitted experts already prefetched into staging slots: copied device to device into their cache
        slots (on the copy stream, after the prefetch), the staging slots freed at once (nothing reads them)."""
        if not moved:
            return
        self.cache.fill_many([(group.slot, staged.tensor) for group, staged in moved])
        for _, staged in moved:
            self.cache.return_staging(staged)

    def compute(
        self, layer: int, out: torch.Tensor, hidden: torch.Tensor, routing: Routing, hits, copies, streaming, stream
    ) -> list[Slot]:
        """Run the hits and the copied experts.

        A decode call whose copies all have a slot runs everything in one grouped launch
        (:mod:`moetier.kernels.grouped_experts`) once the copies have landed: the hits take microseconds,
        so launching them apart would only cost host time. Otherwise the hits go first, then each ring's
        worth of staged experts; a ring slot is refilled only after the compute that read it has been
        enqueued (on CUDA the refill also waits for its event), so at most ``n_staging`` copies run ahead
        of the compute. A streaming call computes each staged expert as soon as its copy lands, so its
        GEMM overlaps the next copies (thin experts staged before a fat one go in its call: their kernels take
        microseconds, and a call apiece cost the host a launch table each; a deep ring gives a call up to
        :data:`STREAM_FAT_PER_CALL` fat ones, :func:`stream_fat_per_call`).
        """
        staged, waiting = copies.staged, copies.waiting
        read = [group.slot for group in hits + copies.direct]
        first = [(group, group.slot) for group in hits + copies.direct]
        together = not streaming and not waiting
        self._compute(out, hidden, routing, first + staged if together else first, stream)
        done = len(staged) if together else 0
        fat_per_call = stream_fat_per_call(self.cache.n_staging)
        while done < len(staged):
            batch = staged[done : _streamed_batch_end(staged, done, fat_per_call)] if streaming else staged[done:]
            self._compute(out, hidden, routing, batch, stream)
            done += len(batch)
            self._release_staged(batch, stream)
            self._refill(layer, waiting, staged)
        if together:
            self._release_staged(staged, stream)
        return read

    def _release_staged(self, batch: list[tuple[Group, Slot]], stream: Any) -> None:
        self.cache.mark_released([slot for _, slot in batch], stream)
        for _, slot in batch:
            self.cache.return_staging(slot)

    def _compute(self, out, hidden, routing: Routing, work: list[tuple[Group, Slot]], stream: Any) -> None:
        """Run these groups from their slots (each waits for its copy): one grouped launch where it applies."""
        if not work:  # every miss went to the CPU tier and nothing hit: no device tensors to make
            return
        for _, slot in work:
            self.cache.wait_ready(slot, stream)
        groups = [(slot.weights, group.start, group.count) for group, slot in work]
        limit, top_k = self.store.layout.swiglu_limit, self.store.layout.top_k
        if routing.tokens_dev is None:  # made once per call, and only for a call with device work
            with phase("tiers.to_device"):
                routing.to_device(hidden.device)
        run_experts(out, hidden, routing.tokens_dev, routing.gates_dev, groups, limit, routing.tokens_host, top_k)

    def _refill(
        self,
        layer: int,
        waiting: deque[Group],
        staged: list[tuple[Group, Slot]],
        direct: list[tuple[Group, Slot]] = (),
    ) -> None:
        """Copy ``direct`` groups into their slots, then waiting groups into free staging slots (oldest
        release first) until either runs out: one batch of copies."""
        work = list(direct)
        while waiting:
            slot = self.cache.take_staging()
            if slot is None:
                break
            group = waiting.popleft()
            staged.append((group, slot))
            work.append((group, slot))
        self._copy_in(layer, work)

    def _copy_in(self, layer: int, work: list[tuple[Group, Slot]]) -> None:
        if not work:
            return
        self.cache.fill_many([(slot, self.store.expert(layer, group.expert).block) for group, slot in work])
        counters = self.metrics.layer(layer)
        counters.copy_bytes += self.cache.block_bytes * len(work)
        counters.copy_pairs += sum(group.count for group, _ in work)
