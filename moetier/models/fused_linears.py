"""Bias-free linears over one input, run as one GEMM (:class:`FusedLinears`): fewer, larger GEMMs per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.kernels.fp8_linear import fp8_linear


class FusedLinears:
    """Bias-free linears over one input run as one GEMM: ``groups`` of linears, each group's outputs side by side.

    :meth:`fuse` (after loading) concatenates the weights into one tensor and makes every linear's weight
    a view of it: no extra memory, and checkpoints/state dicts still see the separate parameters. Should
    a weight be replaced later (``model.to``, a reassignment), the fused tensor is stale: calls notice it
    (the weights no longer point into it) and run the linears one by one. A plain object, not a module,
    so the linears stay registered once, under their own names.

    fp8-block linears (:class:`moetier.models.fp8_linear.Fp8BlockLinear`) fuse the same way, values and scales
    both, when all of a call's linears are fp8 with one tile and encoding and every one but the last fills whole
    tile rows (so each row keeps its own tile's scale); a mix of fp8 and dense linears runs one by one.
    """

    def __init__(self, groups: list[list[nn.Linear]]) -> None:
        self.groups = groups
        self.sizes = [sum(linear.out_features for linear in group) for group in groups]
        self.weight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None  # the fused scales of fp8-block linears
        self.tile: tuple[int, int] | None = None
        self._pointers: list[int] = []

    @property
    def linears(self) -> list[nn.Linear]:
        return [linear for group in self.groups for linear in group]

    def replace(self, swapped: dict[int, nn.Module]) -> None:
        """Point at the new modules of linears swapped after construction (``swapped``: old module id -> new)."""
        self.groups = [[swapped.get(id(linear), linear) for linear in group] for group in self.groups]

    def fuse(self) -> None:
        linears = self.linears
        weights = [linear.weight for linear in linears]
        if len({(w.dtype, w.device) for w in weights}) != 1 or weights[0].device.type == "meta":
            return
        tiles = {getattr(linear, "tile", None) for linear in linears}
        if len(tiles) != 1:
            return
        (tile,) = tiles
        if tile is not None and any(linear.out_features % tile[0] for linear in linears[:-1]):
            return  # a partial tile row inside the fused weight would give its rows the next linear's scales
        self.weight = self._joined(linears, "weight")
        if tile is not None:
            self.scale, self.tile = self._joined(linears, "scale"), tile
        self._pointers = [linear.weight.data_ptr() for linear in linears]

    @staticmethod
    def _joined(linears: list[nn.Module], name: str) -> torch.Tensor:
        """One tensor of every linear's ``name`` stacked by rows, each linear's now a view of its rows."""
        fused = torch.cat([getattr(linear, name).detach() for linear in linears])
        offset = 0
        for linear in linears:
            tensor = getattr(linear, name)
            tensor.data = fused[offset : offset + tensor.shape[0]]
            offset += tensor.shape[0]
        return fused

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each group's outputs ``[T, size]`` (views of one GEMM's output when fused)."""
        if self.weight is not None and self._pointers == [linear.weight.data_ptr() for linear in self.linears]:
            if self.tile is not None:
                return list(fp8_linear(x, self.weight, self.scale, self.tile).split(self.sizes, dim=-1))
            return list(F.linear(x, self.weight).split(self.sizes, dim=-1))
        outs = [[linear(x) for linear in group] for group in self.groups]
        return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1) for parts in outs]
