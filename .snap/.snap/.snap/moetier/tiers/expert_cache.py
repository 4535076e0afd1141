"""The elastic VRAM expert cache: slots of one expert block each, filled from the host home copy.

Ordering on CUDA (all no-ops on the CPU, where copies are synchronous):
- every write into a slot runs on the cache's own copy stream, waits for the slot's ``released``
  event (the last compute that read the old contents) and records the slot's ``ready`` event;
- every compute that reads a slot first makes its stream wait for ``ready``, so a slot is never
  read before its copy lands; after the reads of one dispatch the dispatcher records ``released``.
The experts a dispatch reads are passed as ``protected``: the policy never offers them as victims,
so an expert in use by the current step is never evicted.

Staging slots (experts computed without being admitted, and cross-layer prefetches) form a FIFO
ring: a slot is taken for a copy only after the compute that last read it was enqueued (and its
``released`` event recorded), so the copy stream runs at most ``n_staging`` experts ahead of the
compute and never overwrites a slot a kernel still reads; no host thread ever waits for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.tiers.experts import ExpertStore, ExpertWeights
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.policies import CachePolicy, Key


@dataclass(eq=False)
class Slot:
    """One expert-sized block on the compute device and the events that order its use."""

    tensor: torch.Tensor
    weights: ExpertWeights
    key: Key | None = None
    filled: bool = False  # False between choosing the slot for a key and enqueueing its copy
    ready: Any = None  # torch.cuda.Event recorded after the last write (CUDA only)
    released: Any = None  # torch.cuda.Event recorded after the last read (CUDA only)


class ExpertCache:
    """Maps ``(layer, expert)`` to device slots; the policy ranks, the cache moves bytes.

    ``n_slots`` may change at run time with :meth:`resize`; ``n_staging`` extra slots hold
    experts that are copied in for one dispatch without being admitted (:meth:`take_staging` /
    :meth:`return_staging`), or prefetched before the dispatch that needs them (:meth:`prefetch` /
    :meth:`claim_prefetched`).
    """

    def __init__(
        self,
        store: ExpertStore,
        device: torch.device | str,
        n_slots: int,
        policy: CachePolicy,
        n_staging: int = 2,
        metrics: TierMetrics | None = None,
    ) -> None:
        if n_slots < 0 or n_staging < 1:
            raise ConfigError(f"expert cache needs n_slots >= 0 and n_staging >= 1, got {n_slots}, {n_staging}")
        self.store, self.policy = store, policy
        self.device = torch.device(device)
        self.metrics = metrics or TierMetrics()
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._slots: list[Slot] = []
        self._free: list[Slot] = []
        self._map: dict[Key, Slot] = {}
        self._staging = [self._new_slot() for _ in range(n_staging)]
        self._staging_free: deque[Slot] = deque(self._staging)  # oldest release first
        self._prefetched: dict[Key, Slot] = {}
        self._lent: list[Slot] = []  # cache slots serving as staging during a streaming prefill
        self._lent_keys: list[Key] = []  # what they held, reloaded when they come back
        # Bumped whenever a key gains or loses its slot: readers that mirror the map (the mapped route's device
        # table) rescan it only after a change.
        self.version = 0
        self.resize(n_slots)

    # --- lookups ------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def n_staging(self) -> int:
        return len(self._staging)

    @property
    def block_bytes(self) -> int:
        return self.store.layout.block_bytes(self.store.dtype)

    def resident(self) -> list[Key]:
        return [key for key, _ in self.items()]

    def get(self, key: Key) -> Slot | None:
        """The slot holding ``key`` (its copy may still be in flight: see :meth:`wait_ready`), or None."""
        slot = self._map.get(key)
        return slot if slot is not None and slot.filled else None

    def __contains__(self, key: Key) -> bool:
        return self.get(key) is not None

    def items(self) -> list[tuple[Key, Slot]]:
        """Every resident key with its slot (copies may still be in flight: see :meth:`landed`)."""
        return [(key, slot) for key, slot in self._map.items() if slot.filled]

    @property
    def free_slots(self) -> int:
        """Cache slots holding no expert (an admission into one evicts nothing)."""
        return len(self._free)

    def all_slots(self) -> list[Slot]:
        """Every slot the cache holds now: its own and the staging ring's (lent slots are the ring's)."""
        return self._slots + self._staging

    @property
    def anchor(self) -> ExpertWeights:
        """A block that lives as long as the cache (the first staging slot is never lent or freed): a fixed
        base address for tables of byte offsets to blocks anywhere (slots, the home copy)."""
        return self._staging[0].weights

    def landed(self, slot: Slot) -> bool:
        """Whether the slot's last copy has finished (asked without waiting; always True off CUDA)."""
        return slot.filled and (slot.ready is None or slot.ready.query())

    # --- ordering (CUDA) -----------------------------------------------------------------------

    def wait_ready(self, slot: Slot, stream: Any) -> None:
        """Make ``stream`` (a compute stream) wait until the slot's last copy has landed."""
        if self.cuda and slot.ready is not None:
            stream.wait_event(slot.ready)

    def mark_released(self, slots: list[Slot], stream: Any) -> None:
        """Record that ``stream`` has enqueued its last read of ``slots``: later writes wait for it."""
        if not self.cuda or not slots:
            return
        event = torch.cuda.Event()
        event.record(stream)
        for slot in slots:
            slot.released = event

    def fill(self, slot: Slot, source: torch.Tensor) -> None:
        """Copy an expert block (host home copy or device tensor) into ``slot``, off the compute stream."""
        self.fill_many([(slot, source)])

    def fill_many(self, work: list[tuple[Slot, torch.Tensor]]) -> None:
        """:meth:`fill` for several slots, in order, under one switch to the copy stream.

        A decode call enqueues its copies while the copy engine idles, so the host time per copy is
        latency on the critical path: each slot keeps one ``ready`` event, recorded again per fill
        (a wait enqueued earlier keeps waiting for the record it saw).
        """
        if not self.cuda:
            for slot, source in work:
                slot.tensor.copy_(source)
                slot.filled = True
            return
        with torch.cuda.stream(self.copy_stream):
            for slot, source in work:
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                slot.tensor.copy_(source, non_blocking=True)
                # The slot may be freed by a shrink while this copy is queued: keep its memory until then.
                slot.tensor.record_stream(self.copy_stream)
                if slot.ready is None:
                    slot.ready = torch.cuda.Event()
                slot.ready.record(self.copy_stream)
                slot.filled = True

    # --- admission and eviction ----------------------------------------------------------------

    def plan_admission(self, key: Key, protected: set[Key]) -> Slot | None:
        """Reserve a slot for the missed ``key`` if the policy admits it (evicting a victim if needed).

        The caller must :meth:`fill` the returned slot in the same dispatch; until then lookups of
        ``key`` miss. Returns None when the policy declines or every resident expert is protected.
        A slot reserved earlier but never filled (the dispatch that reserved it failed) is returned again.
        """
        existing = self._map.get(key)
        if existing is not None:
            return None if existing.filled else existing
        victim = None
        if not self._free:
            victim = self.policy.choose_victim(protected)
            if victim is None:
                return None
        if not self.policy.should_admit(key, victim):
            return None
        if victim is not None:
            self.evict(victim)
        slot = self._free.pop()
        slot.key, slot.filled = key, False
        self._map[key] = slot
        self.version += 1
        self.policy.inserted(key)
        self.metrics.layer(key[0]).admissions += 1  # bytes are counted by whoever enqueues the copy
        return slot

    def evict(self, key: Key) -> None:
        slot = self._map.pop(key)
        slot.key, slot.filled = None, False
        self.version += 1
        self._free.append(slot)
        self.policy.removed(key)
        self.metrics.layer(key[0]).evictions += 1

    def load(self, key: Key) -> bool:
        """Make ``key`` resident now from the home copy if a free slot exists (warm-up); True if loaded."""
        if key in self._map or not self._free:
            return False
        slot = self._free.pop()
        slot.key = key
        self._map[key] = slot
        self.version += 1
        self.fill(slot, self.store.expert(*key).block)
        self.policy.inserted(key)
        self.metrics.layer(key[0]).admit_bytes += self.block_bytes
        return True

    def warm(self) -> int:
        """Fill free slots with the policy's preferred experts (the static set); returns how many were loaded."""
        return sum(self.load(key) for key in self.policy.preferred(self.n_slots))

    # --- staging ring and prefetch --------------------------------------------------------------

    def take_staging(self) -> Slot | None:
        """The free staging slot released longest ago, or None when all are in flight or prefetched."""
        return self._staging_free.popleft() if self._staging_free else None

    def return_staging(self, slot: Slot) -> None:
        """Give a staging slot back once the compute reading it is enqueued (after :meth:`mark_released`)."""
        slot.key, slot.filled = None, False
        self._staging_free.append(slot)

    def staging_slot(self) -> Slot:
        """A staging slot for a use that returns it at once (round robin; calibration and simple callers)."""
        slot = self.take_staging()
        if slot is None:
            raise ConfigError("no free staging slot: return the slots taken before asking for another")
        self._staging_free.append(slot)
        return slot

    @property
    def free_staging(self) -> int:
        return len(self._staging_free)

    def prefetch(self, key: Key) -> bool:
        """Start copying ``key`` into a free staging slot now; False when none is free or it is there already."""
        if key in self._prefetched or self.get(key) is not None:
            return False
        slot = self.take_staging()
        if slot is None:
            return False
        self.fill(slot, self.store.expert(*key).block)
        slot.key = key
        self._prefetched[key] = slot
        return True

    def is_prefetched(self, key: Key) -> bool:
        return key in self._prefetched

    def claim_prefetched(self, key: Key) -> Slot | None:
        """The staging slot a prefetch filled with ``key`` (the caller returns it after use), or None."""
        return self._prefetched.pop(key, None)

    def drop_prefetched(self) -> list[Key]:
        """Give every unclaimed prefetched slot back to the ring; returns the wasted keys."""
        wasted = list(self._prefetched)
        for slot in self._prefetched.values():
            self.return_staging(slot)
        self._prefetched.clear()
        return wasted

    # --- lending cache slots to the ring ----------------------------------------------------------

    @property
    def lent(self) -> int:
        return len(self._lent)

    def lend_to_staging(self, n: int) -> int:
        """Move up to ``n`` cache slots into the staging ring (free slots first, then the policy's victims).

        A long prefill streams whole layers of experts: a deeper ring keeps PCIe busy through the
        attention between two MoE layers, and the decode cache's few hundred MB can be refilled in
        milliseconds afterwards. Call between dispatches. Returns how many slots moved.
        """
        moved = 0
        while moved < n and self._slots:
            if not self._free:
                victim = self.policy.choose_victim(set())
                if victim is None:
                    break
                self._lent_keys.append(victim)
                self.evict(victim)
            slot = self._free.pop()
            self._slots.remove(slot)
            self._lent.append(slot)
            self._staging.append(slot)
            self._staging_free.append(slot)
            moved += 1
        return moved

    def reclaim_lent(self) -> int:
        """Take every lent slot back and reload the experts they held (copy stream); returns how many were reloaded.

        Call between dispatches (no staging slot in use); unclaimed prefetches are dropped first.
        """
        if not self._lent:
            return 0
        self.drop_prefetched()
        for slot in self._lent:
            self._staging_free.remove(slot)
            self._staging.remove(slot)
            slot.key, slot.filled = None, False
            self._slots.append(slot)
            self._free.append(slot)
        self._lent.clear()
        keys, self._lent_keys = self._lent_keys, []
        return sum(self.load(key) for key in keys)

    # --- elasticity ------------------------------------------------------------------------------

    def resize(self, n_slots: int, protected: set[Key] | None = None) -> int:
        """Grow (new empty slots, then warm) or shrink (free slots first, then policy victims) to ``n_slots``.

        Returns the slot count reached: shrinking stops early if only protected experts remain.
        """
        if n_slots < 0:
            raise ConfigError(f"expert cache size must be >= 0 slots, got {n_slots}")
        self.reclaim_lent()  # sizes count the cache's own slots only
        protected = protected or set()
        while len(self._slots) < n_slots:
            slot = self._new_slot()
            self._slots.append(slot)
            self._free.append(slot)
        while len(self._slots) > n_slots:
            if not self._free:
                victim = self.policy.choose_victim(protected)
                if victim is None:
                    break
                self.evict(victim)
            slot = self._free.pop()
            self._slots.remove(slot)
        if self._free:
            self.warm()
        return len(self._slots)

    def _new_slot(self) -> Slot:
        tensor = torch.empty(self.store.layout.block_numel, dtype=self.store.block_dtype, device=self.device)
        return Slot(tensor=tensor, weights=ExpertWeights.from_block(tensor, self.store.layout))
