"""The host home copy of every routed expert: one arena of a few large (pinned) allocations.

Each expert block is carved out of a big chunk at an aligned offset, so one DMA moves a whole
expert and the CPU tier reads it with aligned vector loads. Pinned (page-locked) memory is what
lets the copy engine run at full PCIe speed (55 GB/s against 6.4 GB/s from pageable memory on
the H200 host); pinning is slow (~1.75 GB/s), so reserving the arena up front shows progress.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from moetier.errors import ConfigError
from moetier.tiers.experts import ExpertLayout

log = logging.getLogger(__name__)

GiB = 1 << 30


class HostExpertArena:
    """A :data:`~moetier.tiers.experts.BlockAllocator` that packs expert blocks into big host chunks.

    ``pin=None`` pins when CUDA is available; ``pin=True`` without CUDA, or a failed pinned
    allocation, falls back to pageable memory with a warning. ``pinned`` (and ``pin_note``, the
    reason when not pinned) is what the placement planner reads to pick its PCIe bandwidth.
    Use :meth:`reserve_blocks` (or :meth:`for_layout`) before loading so pinning happens once, with
    progress; blocks requested beyond the reservation grow the arena one chunk at a time.
    """

    def __init__(
        self, chunk_bytes: int = GiB, alignment: int = 4096, pin: bool | None = None, progress: bool = True
    ) -> None:
        if alignment < 64 or alignment & (alignment - 1):
            raise ConfigError(f"arena alignment must be a power of two >= 64, got {alignment}")
        if chunk_bytes < alignment:
            raise ConfigError(f"arena chunk_bytes ({chunk_bytes}) must be at least the alignment ({alignment})")
        self.chunk_bytes = chunk_bytes
        self.alignment = alignment
        self.progress = progress
        self.pin_note: str | None = None
        self.pinned = self._decide_pinning(pin)
        self.chunks: list[torch.Tensor] = []
        self._current = 0  # chunk that blocks are carved from now
        self._offset = 0  # next free byte in that chunk, relative to the chunk tensor's start
        self.used_bytes = 0

    @classmethod
    def for_layout(cls, layout: ExpertLayout, dtype: torch.dtype, **options) -> HostExpertArena:
        """An arena reserved for every routed expert of ``layout`` in ``dtype``."""
        arena = cls(**options)
        arena.reserve_blocks(len(layout.moe_layers) * layout.num_experts, layout.block_bytes(dtype))
        return arena

    @classmethod
    def for_checkpoint(
        cls, path: str | Path, dtype: torch.dtype, expert_format: str = "dense", **options
    ) -> HostExpertArena:
        """An arena sized from a checkpoint folder's ``config.json`` (reads no weights), for its experts
        in ``expert_format`` (``"fp8"``/``"fp4"``: quantised bytes + scales, as ``ModelLoadConfig.expert_format``)."""
        from moetier.weights.checkpoint import Checkpoint
        from moetier.weights.quant_experts import checkpoint_expert_layout

        return cls.for_layout(checkpoint_expert_layout(Checkpoint(path), expert_format), dtype, **options)

    @property
    def allocated_bytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    def reserve_blocks(self, count: int, block_bytes: int) -> None:
        """Allocate (and pin) chunks for ``count`` more blocks of ``block_bytes`` now, with a progress bar."""
        if count <= 0:
            return
        step = self._aligned(block_bytes)
        per_chunk = max(1, self.chunk_bytes // step)
        # Room already reserved: the rest of the current chunk plus any untouched reserved chunks.
        room = self._chunk_room() // step + sum(
            (c.numel() - self._start_of(c)) // step for c in self.chunks[self._current + 1 :]
        )
        sizes, remaining = [], count - room
        while remaining > 0:
            blocks = min(per_chunk, remaining)
            sizes.append(blocks * step)
            remaining -= blocks
        desc = "pinning expert arena" if self.pinned else "allocating expert arena"
        show = self.progress and sum(sizes) >= 256 * (1 << 20)
        with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=desc, disable=not show) as bar:
            for size in sizes:
                self._new_chunk(size)
                bar.update(size)

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        while self._chunk_room() < nbytes:
            if self._current + 1 < len(self.chunks):
                self._current += 1  # move on to the next reserved chunk
                self._offset = self._start_of(self.chunks[self._current])
            else:
                self._new_chunk(max(self.chunk_bytes, self._aligned(nbytes)))
                self._current, self._offset = len(self.chunks) - 1, self._start_of(self.chunks[-1])
        block = self.chunks[self._current][self._offset : self._offset + nbytes].view(dtype)
        self._offset += self._aligned(nbytes)
        self.used_bytes += nbytes
        return block

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    def _start_of(self, chunk: torch.Tensor) -> int:
        return -chunk.data_ptr() % self.alignment

    def _chunk_room(self) -> int:
        return self.chunks[self._current].numel() - self._offset if self.chunks else 0

    def _new_chunk(self, usable_bytes: int) -> None:
        # Extra room so the first block can start on an aligned address whatever the base pointer.
        size = usable_bytes + self.alignment
        chunk = None
        if self.pinned:
            try:
                chunk = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                self._fall_back(f"pinning a {size / GiB:.2f} GiB chunk failed ({str(exc).splitlines()[0]})")
        if chunk is None:
            chunk = torch.empty(size, dtype=torch.uint8)
        self.chunks.append(chunk)
        if len(self.chunks) == 1:
            self._current, self._offset = 0, self._start_of(chunk)

    def _decide_pinning(self, pin: bool | None) -> bool:
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
            if not cuda:
                self._note("no CUDA device: the expert arena is pageable host memory")
                return False
        if pin and not cuda:
            self._note("pinning requested but CUDA is unavailable: the expert arena is pageable host memory")
            return False
        if not pin:
            self._note("pinning disabled: expert copies to the GPU run at pageable speed (~8x slower)")
        return pin

    def _fall_back(self, why: str) -> None:
        self.pinned = False
        self._note(f"{why}; the expert arena continues in pageable memory (copies ~8x slower)")

    def _note(self, why: str) -> None:
        self.pin_note = why
        log.warning(why)
