"""Routed-expert weights: their shapes, their storage, and the one kernel every tier must agree with.

Each routed expert lives in ONE contiguous flat block holding ``[gate; up]`` (shape ``[2I, H]``)
followed by ``down`` (shape ``[H, I]``). One block per expert means one DMA moves it between
tiers, and the CPU tier can compute straight from it. Models never touch this store: they call
an :class:`~moetier.tiers.dispatcher.ExpertDispatcher`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.errors import ConfigError


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

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.hidden_size < 1 or self.intermediate_size < 1:
            raise ConfigError(f"expert layout has a non-positive size: {self}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    @property
    def gate_up_numel(self) -> int:
        return 2 * self.intermediate_size * self.hidden_size

    @property
    def block_numel(self) -> int:
        """Elements in one expert's contiguous block (gate, up and down)."""
        return 3 * self.intermediate_size * self.hidden_size

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.block_numel * torch.empty((), dtype=dtype).element_size()


@dataclass
class ExpertWeights:
    """Views into one expert's block: ``gate_up`` is ``[2I, H]`` (gate rows first), ``down`` is ``[H, I]``."""

    block: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def from_block(cls, block: torch.Tensor, layout: ExpertLayout) -> ExpertWeights:
        inter, hidden = layout.intermediate_size, layout.hidden_size
        gate_up = block[: layout.gate_up_numel].view(2 * inter, hidden)
        down = block[layout.gate_up_numel :].view(hidden, inter)
        return cls(block=block, gate_up=gate_up, down=down)


def swiglu_expert(x: torch.Tensor, weights: ExpertWeights, swiglu_limit: float | None) -> torch.Tensor:
    """One expert's output ``down(silu(gate(x)) * up(x))`` for ``x`` of shape ``[T, H]``.

    This is the reference every tier (resident GPU, CPU tier, staged prefill) is checked against.
    """
    gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, weights.down)


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
        self.dtype = dtype
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
            block = self._allocator(self.layout.block_numel, self.dtype)
            self._experts[key] = ExpertWeights.from_block(block, self.layout)
        return self._experts[key]

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
