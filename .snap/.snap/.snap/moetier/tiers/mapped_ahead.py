"""The mapped route's reads ahead: the next MoE layer's predicted experts copied into VRAM during the attention.

In a mapped decode step the device reads each missed expert over PCIe inside the layer's call, while between two
calls (the next layer's attention: mostly host launches, the device idle) PCIe and the CPU tier have nothing to
do. Here the model's next-layer prediction (:meth:`ExpertDispatcher.hint`, a device tensor) drives copies in
that gap, with no host wait: :func:`~moetier.kernels.ahead_copy.launch_ahead` on a side stream copies up to
``slots`` predicted, uncached experts into staging slots of the cache and points the device table at them; the
layer's call then reads them from VRAM and computes them on the device (not the CPU tier), and its last kernel
(:func:`~moetier.kernels.ahead_copy.launch_restore`, captured with the call) points the entries home again.

Ordering on CUDA, per layer ``L'`` predicted at ``L``:
- the side stream starts after everything enqueued on the compute stream up to ``L``'s call (an event), so
  ``L``'s reads of the slots (the previous prediction's) are done before they are written again;
- the compute stream waits for the side stream's event before the segment holding ``L'``'s call
  (:meth:`join`, which the model calls through ``await_hint``), so the call reads the finished copies and the
  table entries they point at; the host never waits;
- the staging slots are taken from the cache's ring for one step (the side stream first waits for their last
  copy and read) and given back at its end, released on the compute stream after every join.

Off CUDA the same bookkeeping runs synchronously in torch ops (:mod:`moetier.kernels.ahead_copy`'s references),
so the CPU tests check the choice, the table and the restore against the resident results.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any

import torch

from moetier.kernels.ahead_copy import (
    ahead_kernels_usable,
    ahead_reference,
    launch_ahead,
    launch_restore,
    restore_reference,
)
from moetier.tiers.expert_cache import ExpertCache, Slot
from moetier.tiers.experts import ExpertStore

_MAX_SLOT_SETS = 64  # the ring hands out len(ring) / slots sets in turn; more means the ring changed
_MAX_TIMED = 256  # joined reads ahead kept for timing until the device passes them


class MappedPrefetch:
    """Per MoE layer, the device's record of what it read ahead, and the side stream that does it.

    Contract: :meth:`note` a layer's prediction when the model hands it over, :meth:`launch` it once the call
    before it is enqueued, :meth:`join` before the
    work holding that layer's call, :meth:`restore` inside the call after its kernels, :meth:`finish_step` at the
    end of the step (``failed``: entries a call never restored are restored there). ``table``/``pick`` are the
    mapped route's device table and CPU picks (rows of ``experts`` per layer, in ``layers`` order).
    """

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        table: torch.Tensor,
        pick: torch.Tensor,
        home: list[int],
        layers: list[int],
        slots: int,
    ) -> None:
        self.store, self.cache, self.table, self.pick = store, cache, table, pick
        self.layers, self.experts, self.slots = layers, store.layout.num_experts, slots
        self.device, self.cuda = cache.device, cache.device.type == "cuda"
        self.block_bytes = cache.block_bytes
        self.home = torch.tensor(home, dtype=torch.int64, device=self.device)
        rows = len(layers)
        self.chosen = torch.full((rows, slots), -1, dtype=torch.int64, device=self.device)
        self.saved = torch.zeros((rows, slots), dtype=torch.uint8, device=self.device)
        self.stats = torch.zeros((rows, 2), dtype=torch.int64, device=self.device)  # [copied, used] per layer
        self._row = {layer: i for i, layer in enumerate(layers)}
        self._base = cache.anchor.block.view(torch.uint8)
        self._anchor = cache.anchor.block.data_ptr()
        self._held: list[Slot] = []
        # Per set of held slots: their offsets on the device (and the pinned copy they came from).
        self._offsets: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._ids: dict[tuple, torch.Tensor] = {}  # per (layer, shape): the copy of a prediction the kernel reads
        self._noted: dict[int, torch.Tensor] = {}  # per layer: this step's prediction, not launched yet
        # Per layer launched this step and not joined: its (start on the compute stream, end on the side stream)
        # events (None off CUDA, where it ran at once); per joined layer not harvested: (layer, start, end, compute
        # stream before its wait, after it). Fresh events each step: the host may run steps ahead of the device, so
        # one step's cannot be recorded over.
        self._launches: dict[int, tuple[Any, Any] | None] = {}
        self._timed: deque[tuple[int, Any, Any, Any, Any]] = deque()
        self._launched = False  # this step launched something (its end restores on failure, gives slots back)

    def usable(self, hidden: torch.Tensor) -> bool:
        """Whether reads ahead run for calls like ``hidden`` (on CUDA: the copy kernel, 16-byte blocks)."""
        return not self.cuda or (ahead_kernels_usable(hidden) and self.block_bytes % 16 == 0)

    # --- the step -------------------------------------------------------------------------------

    def note(self, layer: int, ids: torch.Tensor) -> None:
        """Keep ``layer``'s predicted experts ``ids`` (int64 ``[B, K]``, device): copied on the current stream,
        since they may be a graph's output the next replay overwrites."""
        if layer not in self._row:
            return
        kept = self._ids.get((layer, ids.shape))
        if kept is None:
            with torch.inference_mode(False):  # a buffer every later step writes, inference mode or not
                kept = torch.empty(ids.shape, dtype=torch.int64, device=self.device)
            self._ids[(layer, ids.shape)] = kept
        kept.copy_(ids)
        self._noted[layer] = kept

    def launch(self, layer: int) -> None:
        """Read ahead ``layer``'s noted prediction after the work on the current stream so far (the one the note's
        copy went to); a step without free staging slots reads nothing ahead."""
        ids = self._noted.pop(layer, None)
        if ids is None or layer in self._launches or not self._hold():
            return
        row, span = self._row[layer], self._span(layer)
        table, home, pick = self.table[span], self.home[span], self.pick[span]
        held = len(self._held)
        chosen, saved = self.chosen[row, :held], self.saved[row, :held]
        slots = self._slot_offsets()
        self._launched = True
        if not self.cuda:
            blocks = [slot.tensor for slot in self._held]
            ahead_reference(ids, table, home, pick, slots, chosen, saved, blocks, partial(self._home_block, layer))
            self._launches[layer] = None
            return
        start, finished = _timing_event(), _timing_event()
        start.record(torch.cuda.current_stream(self.device))
        self._side.wait_event(start)
        with torch.cuda.stream(self._side):
            launch_ahead(ids, table, home, pick, slots, chosen, saved, self._base, self.block_bytes)
        finished.record(self._side)
        self._launches[layer] = (start, finished)

    def join(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s reads ahead (before the work holding its call); on CUDA
        the wait is timed (:meth:`harvest_times`)."""
        events = self._launches.pop(layer, None)
        if events is None:
            return
        start, finished = events
        stream = torch.cuda.current_stream(self.device)
        before, after = _timing_event(), _timing_event()
        before.record(stream)
        stream.wait_event(finished)
        after.record(stream)
        if len(self._timed) < _MAX_TIMED:  # a host far ahead of the device leaves later joins untimed
            self._timed.append((layer, start, finished, before, after))

    def harvest_times(self) -> list[tuple[int, float, float]]:
        """Per joined read ahead the device has passed since the last harvest (never waits): ``(layer, copy
        seconds, wait seconds)``, the copy's from its launch point on the compute stream to its end on the side
        stream, the wait's the compute stream's stall before the call (0 where the copy was done by then)."""
        out = []
        while self._timed and self._timed[0][4].query():
            layer, start, finished, before, after = self._timed.popleft()
            out.append((layer, start.elapsed_time(finished) / 1e3, before.elapsed_time(after) / 1e3))
        return out

    def restore(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Inside ``layer``'s call, after its kernels: its entries home again, ``[copied, used]`` counted (device
        work only: it may be captured)."""
        if not self._launched and not (self.cuda and torch.cuda.is_current_stream_capturing()):
            return  # nothing read ahead this step (a capture records the kernel for the steps that will)
        ids = topk_ids.reshape(-1).contiguous() if self.cuda else topk_ids
        self._restore_layer(layer, ids)

    def finish_step(self, stream: Any, failed: bool = False) -> None:
        """After a step: with ``failed``, every layer's entries restored (a call may have raised before its
        restore); the staging slots given back, released on ``stream`` after every read of them."""
        self._noted.clear()
        if not self._launched:
            return
        for layer in list(self._launches):
            self.join(layer)
        if failed:
            for layer in self.layers:
                self._restore_layer(layer, None)
        self.cache.mark_released(self._held, stream)
        for slot in self._held:
            self.cache.return_staging(slot)
        self._held, self._launched = [], False

    # --- helpers --------------------------------------------------------------------------------

    def _restore_layer(self, layer: int, ids: torch.Tensor | None) -> None:
        """One layer's entries and picks back as they were; with the call's ``ids``, its reads ahead counted."""
        row, span = self._row[layer], self._span(layer)
        args = (self.chosen[row], self.saved[row], self.table[span], self.home[span], self.pick[span])
        (launch_restore if self.cuda else restore_reference)(*args, ids, self.stats[row])

    def _hold(self) -> bool:
        """Staging slots for this step's reads ahead (taken at its first launch); False when none is free."""
        if self._held:
            return True
        while len(self._held) < self.slots:
            slot = self.cache.take_staging()
            if slot is None:
                break
            self._held.append(slot)
        if self.cuda:  # the side stream writes them only after their last copy and read
            for slot in self._held:
                for event in (slot.ready, slot.released):
                    if event is not None:
                        self._side.wait_event(event)
        return bool(self._held)

    def _slot_offsets(self) -> torch.Tensor:
        """The held slots' byte offsets from the anchor, on the device (one tensor per set of slots: the ring
        hands the same few sets out in turn)."""
        offsets = tuple(slot.tensor.data_ptr() - self._anchor for slot in self._held)
        kept = self._offsets.get(offsets)
        if kept is None:
            if len(self._offsets) >= _MAX_SLOT_SETS:  # lent slots joined the ring and left: start over
                self._offsets.clear()
            with torch.inference_mode(False):
                host = torch.tensor(offsets, dtype=torch.int64)
                host = host.pin_memory() if self.cuda else host
                # Copied without a host wait; the pinned source lives as long as its entry.
                device = host.to(self.device, non_blocking=True)
                if self.cuda:  # read on the side stream: a dropped entry's memory waits for those reads
                    device.record_stream(self._side)
                kept = self._offsets[offsets] = (device, host)
        return kept[0]

    def _home_block(self, layer: int, expert: int) -> torch.Tensor:
        return self.store.expert(layer, expert).block

    def _span(self, layer: int) -> slice:
        row = self._row[layer]
        return slice(row * self.experts, (row + 1) * self.experts)


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)
