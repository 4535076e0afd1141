"""Bias-free linears over one input, run as one GEMM (:class:`FusedLinears`): fewer, larger GEMMs per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    """Bias-free linears over one input run as one GEMM: ``groups`` of linears, each group's outputs side by side.

    :meth:`fuse` (after loading) concatenates the weights into one tensor and makes every linear's weight
    a view of it: no extra memory, and checkpoints/state dicts still see the separate parameters. Should
    a weight be replaced later (``model.to``, a reassignment), the fused tensor is stale: calls notice it
    (the weights no longer point into it) and run the linears one by one. A plain object, not a module,
    so the linears stay registered once, under their own names.
    """

    def __init__(self, groups: list[list[nn.Linear]]) -> None:
        self.groups = groups
        self.sizes = [sum(linear.out_features for linear in group) for group in groups]
        self.weight: torch.Tensor | None = None
        self._pointers: list[int] = []

    @property
    def linears(self) -> list[nn.Linear]:
        return [linear for group in self.groups for linear in group]

    def fuse(self) -> None:
        weights = [linear.weight for linear in self.linears]
        if len({(w.dtype, w.device) for w in weights}) != 1 or weights[0].device.type == "meta":
            return
        fused = torch.cat([w.detach() for w in weights])
        offset = 0
        for linear in self.linears:
            linear.weight.data = fused[offset : offset + linear.out_features]
            offset += linear.out_features
        self.weight, self._pointers = fused, [linear.weight.data_ptr() for linear in self.linears]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each group's outputs ``[T, size]`` (views of one GEMM's output when fused)."""
        if self.weight is not None and self._pointers == [linear.weight.data_ptr() for linear in self.linears]:
            return list(F.linear(x, self.weight).split(self.sizes, dim=-1))
        outs = [[linear(x) for linear in group] for group in self.groups]
        return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1) for parts in outs]
