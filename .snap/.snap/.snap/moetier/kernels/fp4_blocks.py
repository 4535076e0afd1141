"""The fp4 grouped kernels' block sizes (:mod:`moetier.kernels.grouped_experts`): one validated value per launch, or
the module's current one, which a bench may sweep (:func:`fp4_blocks`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

FP4_BLOCK_N, FP4_BLOCK_H, FP4_BLOCK_K = 8, 16, 1024  # tuned for blocks in VRAM


@dataclass(frozen=True)
class Fp4Blocks:
    """The fp4 kernels' block sizes: ``n`` intermediate rows per gate/up program, ``h`` output channels per down
    program, ``k`` the column step of both (a multiple of every scale unit, which is at most 32 columns).

    Powers of two (``tl.arange``), each program's tile (rows x step) at most ``MAX_TILE`` values, so a tile
    stays in registers. The defaults are the module constants; ``"8x16x1024"`` is ``parse``'s form (N x H x K).
    """

    n: int = FP4_BLOCK_N
    h: int = FP4_BLOCK_H
    k: int = FP4_BLOCK_K

    MAX_TILE: ClassVar[int] = 1 << 16
    RANGES: ClassVar[dict[str, tuple[int, int]]] = {"n": (2, 256), "h": (2, 256), "k": (32, 8192)}

    def __post_init__(self) -> None:
        for name, (low, high) in self.RANGES.items():
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high or value & (value - 1):
                raise ValueError(f"fp4 block {name} must be a power of two in [{low}, {high}], got {value!r}")
        if max(self.n, self.h) * self.k > self.MAX_TILE:
            raise ValueError(f"fp4 blocks {self}: a program's tile (rows x k) must be at most {self.MAX_TILE} values")

    def __str__(self) -> str:
        return f"{self.n}x{self.h}x{self.k}"

    @classmethod
    def parse(cls, text: str) -> Fp4Blocks:
        """``"8x16x1024"`` (N x H x K) -> ``Fp4Blocks(8, 16, 1024)``; ValueError otherwise."""
        parts = str(text).strip().lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"fp4 blocks must be N x H x K integers such as 8x16x1024, got {text!r}")
        return cls(*(int(p) for p in parts))


_FP4_BLOCKS = Fp4Blocks()  # what launch_grouped uses now (set_fp4_blocks / fp4_blocks: benches' sweeps)
# For calls whose blocks are mostly in pinned host memory (the mapped route): narrower down programs, more of them
# in flight over PCIe. Measured on the H200 (bench gpu-experts --where host, results/h200-20261202-7a92376-fp4-blocks):
# down 622 vs 899 us for 6 V4-Flash experts at 1 token (~50 vs ~35 GB/s), the call 1937 vs 2154 us; 4 tokens
# 7715 vs 8631 us. From VRAM it costs 96 vs 92 us, 342 vs 320 us.
HOST_READ_FP4_BLOCKS = Fp4Blocks(n=8, h=4, k=1024)


def current_fp4_blocks() -> Fp4Blocks:
    """The fp4 block sizes the next launches use."""
    return _FP4_BLOCKS


def set_fp4_blocks(blocks: Fp4Blocks) -> Fp4Blocks:
    """Launch fp4 experts with ``blocks`` from now on (each new value compiles the kernels once); returns the
    previous value."""
    global _FP4_BLOCKS
    if not isinstance(blocks, Fp4Blocks):
        raise TypeError(f"set_fp4_blocks takes Fp4Blocks, got {type(blocks).__name__}")
    previous, _FP4_BLOCKS = _FP4_BLOCKS, blocks
    return previous


@contextmanager
def fp4_blocks(blocks: Fp4Blocks) -> Iterator[Fp4Blocks]:
    """``with fp4_blocks(Fp4Blocks(h=32)):`` launches inside use ``blocks``; the previous value after."""
    previous = set_fp4_blocks(blocks)
    try:
        yield blocks
    finally:
        set_fp4_blocks(previous)
