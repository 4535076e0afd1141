"""Routed-expert weights: their shapes, their storage, and the one kernel every tier must agree with.

Each routed expert lives in ONE contiguous flat block holding ``[gate; up]`` (shape ``[2I, H]``)
followed by ``down`` (shape ``[H, I]``). One block per expert means one DMA moves it between
tiers, and the CPU tier can compute straight from it. Models never touch this store: they call
an :class:`~moetier.tiers.dispatcher.ExpertDispatcher`.

With :class:`ExpertQuant` (``expert_format="fp8"`` or ``"fp4"``) a block keeps the checkpoint's float8
weights (or packed e2m1 nibbles) and their per-tile scales (float32, or fp4's e8m0 bytes) as raw bytes instead
(about half, or 0.27-0.31x, of bf16): every reader dequantises with the loader's own function, so the math is
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.errors import ConfigError
from moetier.kernels.fp4_dequant import dequantize_fp4_expert_into
from moetier.kernels.fp8_dequant import dequantize_fp8_into
from moetier.weights.fp8 import scale_grid

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANT_KINDS = ("fp8-block", "fp4-block")
SCALE_FORMATS = ("float32", "e8m0")
# Every part of a quantised block starts on a cache line: enough for the float32 scales, and what
# vector loads of a future CPU kernel want.
PART_ALIGN = 64


def _align(nbytes: int) -> int:
    return -(-nbytes // PART_ALIGN) * PART_ALIGN


@dataclass(frozen=True)
class ExpertQuant:
    """How a quantised expert block stores its weights.

    ``kind`` ``"fp8-block"``: each matrix as ``fp8`` values plus one float32 scale per ``tile``
    (rows x cols) tile, DeepSeek-V3's release format (:mod:`moetier.weights.fp8`). ``"fp4-block"``:
    each ``[N, K]`` matrix as packed e2m1 bytes ``[N, K/2]`` plus one float32 scale per ``tile``
    (DeepSeek-V4's release: ``(1, 32)``, :mod:`moetier.weights.fp4`); ``fp8`` is unused there.
    ``pow2_scales``: every scale is a power of two (the release's ue8m0 scales; the loader checks each
    one), which lets the GPU's fp4 kernels scale a sum instead of every weight, for the same result.
    ``scale_format``: how the block stores its scales, ``"float32"``, or ``"e8m0"`` (fp4 with power-of-two
    scales only): one exponent byte each, ``2 ** (e - 127)`` as the release's ue8m0 scales, a quarter of the
    bytes (an fp4 V4-Flash expert: 13.4 MB instead of 15.7) for the same values.
    """

    kind: str = "fp8-block"
    tile: tuple[int, int] = (128, 128)
    fp8: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = False
    scale_format: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ConfigError(f"unknown expert quantisation {self.kind!r}; use one of {', '.join(QUANT_KINDS)}")
        tile_ok = len(self.tile) == 2 and all(isinstance(t, int) and t > 0 for t in self.tile)
        if not tile_ok:
            raise ConfigError(f"{self.kind} tile must be two positive integers, got {self.tile!r}")
        if self.kind == "fp8-block" and self.fp8 not in FP8_DTYPES:
            raise ConfigError(f"fp8-block values must be float8_e4m3fn or float8_e5m2, got {self.fp8}")
        if self.packed and self.tile[1] % 2:
            raise ConfigError(f"fp4-block tile columns must be even (two values a byte), got {self.tile!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise ConfigError(f"unknown scale format {self.scale_format!r}; use one of {', '.join(SCALE_FORMATS)}")
        if self.scale_format == "e8m0" and not (self.packed and self.pow2_scales):
            raise ConfigError(
                f"e8m0 scale bytes need fp4-block experts with power-of-two (ue8m0) scales, got {self.kind} with "
                f"pow2_scales={self.pow2_scales}: keep float32 scales (MOETIER_FP4_SCALES=float32)"
            )

    @property
    def packed(self) -> bool:
        """Whether two values share a byte (fp4): stored matrices are ``[N, K/2]``."""
        return self.kind == "fp4-block"

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype of the stored scales: float32, or exponent bytes (uint8) for ``"e8m0"``."""
        return torch.uint8 if self.scale_format == "e8m0" else torch.float32

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype of the stored matrices: the float8 type, or raw bytes for packed fp4."""
        return torch.uint8 if self.packed else self.fp8

    def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The stored shape of a ``[N, K]`` matrix."""
        return (shape[0], shape[1] // 2) if self.packed else shape


@dataclass(frozen=True)
class BlockPart:
    """One matrix of a quantised block: ``shape`` in ``dtype`` starting ``offset`` bytes into the block."""

    name: str
    offset: int
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertLayout:
    """Shape of the routed experts of one model.

    ``moe_layers`` lists the decoder layers that have routed experts; ``swiglu_limit`` (DeepSeek-V4)
    clamps the gate from above and the up projection on both sides before the SwiGLU product.
    """

    moe_layers: tuple[int, ...]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    swiglu_limit: float | None = None
    quant: ExpertQuant | None = None  # None: dense blocks in the store's dtype

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.hidden_size < 1 or self.intermediate_size < 1:
            raise ConfigError(f"expert layout has a non-positive size: {self}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.quant is not None and not isinstance(self.quant, ExpertQuant):
            raise ConfigError(f"expert layout quant must be an ExpertQuant or None, got {self.quant!r}")
        if self.quant is not None and self.quant.packed:
            # dequantize_fp4 needs whole blocks (no edge tiles) and whole bytes.
            sizes = (self.hidden_size, self.intermediate_size)
            if any(size % t for size in sizes for t in self.quant.tile):
                raise ConfigError(
                    f"fp4-block tile {self.quant.tile} does not divide the experts' hidden size {self.hidden_size} "
                    f"and intermediate size {self.intermediate_size}"
                )

    @property
    def gate_up_numel(self) -> int:
        """Elements of ``[gate; up]``: ``2 * I * H`` (the float8 bytes when fp8; fp4 packs them in half)."""
        return 2 * self.intermediate_size * self.hidden_size

    @functools.cached_property  # a frozen dataclass's cache: read on every miss of a decode step
    def block_numel(self) -> int:
        """Elements in one expert's contiguous block: ``3 * I * H`` dense, its byte count (uint8) quantised."""
        if self.quant is None:
            return 3 * self.intermediate_size * self.hidden_size
        last = self.quant_parts()[-1]
        return _align(last.offset + last.nbytes)

    def block_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of a block for a store computing in ``dtype``: raw bytes when quantised."""
        return dtype if self.quant is None else torch.uint8

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block for a store computing in ``dtype`` (the quantised size when quantised)."""
        return self.block_numel * self.block_dtype(dtype).itemsize

    def quant_parts(self) -> list[BlockPart]:
        """Where each matrix of a quantised block lies: gate, up, down (float8 or packed fp4 bytes), then
        their scales (float32, or e8m0 exponent bytes), each part on a 64-byte line.

        Gate and up keep separate scale grids: ``I`` need not be a multiple of the tile.
        """
        if self.quant is None:
            raise ValueError("a dense expert layout has no quantised parts")
        inter, hidden, quant = self.intermediate_size, self.hidden_size, self.quant
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        wanted = [(name, quant.stored_shape(shape), quant.values_dtype) for name, shape in shapes.items()]
        scales = quant.scale_dtype
        wanted += [(f"{name}_scale", scale_grid(shape, quant.tile), scales) for name, shape in shapes.items()]
        parts, offset = [], 0
        for name, shape, dtype in wanted:
            part = BlockPart(name, offset, shape, dtype)
            parts.append(part)
            offset = _align(offset + part.nbytes)
        return parts


@dataclass
class ExpertWeights:
    """Views into one expert's block.

    Dense: ``gate_up`` is ``[2I, H]`` (gate rows first), ``down`` is ``[H, I]``. Quantised
    (``quantized`` True, ``gate_up``/``down`` None): ``gate_q``/``up_q`` ``[I, H]`` and ``down_q`` ``[H, I]``
    in float8 (``quant_kind`` ``"fp8-block"``), or as packed e2m1 bytes ``[I, H/2]``/``[H, I/2]`` (uint8,
    ``"fp4-block"``), with float32 ``*_scale`` grids of one scale per ``tile``.
    """

    block: torch.Tensor
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    gate_q: torch.Tensor | None = None
    up_q: torch.Tensor | None = None
    down_q: torch.Tensor | None = None
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    tile: tuple[int, int] | None = None
    quant_kind: str | None = None  # an ExpertQuant kind when quantised
    pow2_scales: bool = False  # ExpertQuant.pow2_scales: every scale a power of two

    @property
    def quantized(self) -> bool:
        return self.tile is not None

    @classmethod
    def from_block(cls, block: torch.Tensor, layout: ExpertLayout) -> ExpertWeights:
        """Views into ``block`` (``layout.block_numel`` elements of ``layout.block_dtype``), no copy."""
        if layout.quant is not None:
            return cls._quantized_views(block, layout, layout.quant)
        inter, hidden = layout.intermediate_size, layout.hidden_size
        gate_up = block[: layout.gate_up_numel].view(2 * inter, hidden)
        down = block[layout.gate_up_numel :].view(hidden, inter)
        return cls(block=block, gate_up=gate_up, down=down)

    @classmethod
    def _quantized_views(cls, block: torch.Tensor, layout: ExpertLayout, quant: ExpertQuant) -> ExpertWeights:
        if block.dtype != torch.uint8 or block.numel() < layout.block_numel:
            raise ValueError(
                f"a quantised expert block is {layout.block_numel} uint8, got {block.numel()} {block.dtype}"
            )
        views = {}
        for part in layout.quant_parts():
            raw = block[part.offset : part.offset + part.nbytes]
            views[part.name] = raw.view(part.dtype).view(part.shape)
        return cls(
            block=block,
            gate_q=views["gate"],
            up_q=views["up"],
            down_q=views["down"],
            gate_scale=views["gate_scale"],
            up_scale=views["up_scale"],
            down_scale=views["down_scale"],
            tile=quant.tile,
            quant_kind=quant.kind,
            pow2_scales=quant.pow2_scales,
        )

    @property
    def e8m0_scales(self) -> bool:
        """Whether the scale grids are e8m0 exponent bytes (``ExpertQuant.scale_format`` "e8m0"), not float32."""
        return self.gate_scale is not None and self.gate_scale.dtype == torch.uint8

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """Dense weights in ``dtype`` (a new block), dequantised exactly as the loader does at load time: gate, up
        then down written into one block, on a GPU by kernels that give the loader's functions' bits (fp4: the three
        matrices in one launch, :mod:`moetier.kernels.fp4_dequant`; fp8: one a matrix,
        :mod:`moetier.kernels.fp8_dequant`), the loader's functions elsewhere."""
        if self.tile is None:  # dense: nothing to do
            return self
        inter, hidden = self.gate_q.shape[0], self.down_q.shape[0]  # the rows: packed fp4 halves the columns
        block = torch.empty(3 * inter * hidden, dtype=dtype, device=self.gate_q.device)
        gate_up = block[: 2 * inter * hidden].view(2 * inter, hidden)
        down = block[2 * inter * hidden :].view(hidden, inter)
        outs, pairs = (gate_up[:inter], gate_up[inter:], down), self._quantized_pairs()
        if self.quant_kind == "fp4-block":
            dequantize_fp4_expert_into(outs, pairs)  # the three matrices in one launch where it fits
        else:
            for out, (q, s) in zip(outs, pairs, strict=True):
                dequantize_fp8_into(out, q, s, self.tile)
        return ExpertWeights(block=block, gate_up=gate_up, down=down)

    def _quantized_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(stored values, scales) of gate, up and down."""
        return [(self.gate_q, self.gate_scale), (self.up_q, self.up_scale), (self.down_q, self.down_scale)]


def swiglu_expert(
    x: torch.Tensor, weights: ExpertWeights, swiglu_limit: float | None, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """One expert's output ``down(silu(gate(x)) * up(x))`` for ``x`` of shape ``[T, H]``; with ``rows``
    ``(lo, hi)``, the part of it through intermediate rows ``lo .. hi`` only (gate and up rows, down columns: a
    split expert's share, the shares summing to the whole up to rounding).

    This is the reference every tier (resident GPU, CPU tier, staged prefill) is checked against. A
    quantised expert is first dequantised to ``x.dtype`` with the loader's own function, so it computes
    exactly (bit for bit) what the same expert dequantised at load time computes.
    """
    if weights.quantized:
        weights = weights.dequantized(x.dtype)
    down = weights.down
    if rows is None:
        gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
    else:
        (lo, hi), inter = rows, down.shape[1]
        gate, up = F.linear(x, weights.gate_up[lo:hi]), F.linear(x, weights.gate_up[inter + lo : inter + hi])
        down = down[:, lo:hi]
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, down)


BlockAllocator = Callable[[int, torch.dtype], torch.Tensor]


def device_allocator(device: torch.device | str) -> BlockAllocator:
    """Allocate each expert block as its own tensor on ``device`` (the all-resident home)."""
    return lambda numel, dtype: torch.empty(numel, dtype=dtype, device=device)


class ExpertStore:
    """The home copy of every routed expert, one contiguous block per (layer, expert).

    The allocator decides where blocks live (device memory now; a pinned host arena for the
    tiered engine). Blocks are created lazily by :meth:`block_for_loading` so the loader writes
    each checkpoint tensor straight into its final place.
    """

    def __init__(self, layout: ExpertLayout, dtype: torch.dtype, allocator: BlockAllocator) -> None:
        self.layout = layout
        self.dtype = dtype  # the compute dtype; blocks are ``block_dtype`` (raw bytes when quantised)
        self._allocator = allocator
        self._experts: dict[tuple[int, int], ExpertWeights] = {}

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        try:
            return self._experts[(layer, expert)]
        except KeyError:
            raise KeyError(f"expert {expert} of layer {layer} was never loaded") from None

    def block_for_loading(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's block, allocated on first use; raises for an index outside the layout."""
        if layer not in self.layout.moe_layers:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {list(self.layout.moe_layers)})")
        if not 0 <= expert < self.layout.num_experts:
            raise KeyError(f"expert {expert} is outside [0, {self.layout.num_experts})")
        key = (layer, expert)
        if key not in self._experts:
            block = self._allocator(self.layout.block_numel, self.block_dtype)
            self._experts[key] = ExpertWeights.from_block(block, self.layout)
        return self._experts[key]

    @property
    def block_dtype(self) -> torch.dtype:
        """The dtype of every block: the compute dtype, or uint8 for a quantised layout."""
        return self.layout.block_dtype(self.dtype)

    def missing(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs that the checkpoint never filled."""
        return [
            (layer, e)
            for layer in self.layout.moe_layers
            for e in range(self.layout.num_experts)
            if (layer, e) not in self._experts
        ]

    def items(self) -> Iterator[tuple[tuple[int, int], ExpertWeights]]:
        return iter(self._experts.items())

    def total_bytes(self) -> int:
        return len(self._experts) * self.layout.block_bytes(self.dtype)
