"""Which missed experts run on the CPU tier and which are copied to the device: the cost model.

A missed expert can be computed on host cores straight from its home copy (cost grows with its
token count: the CPU tier is read-bound for a few tokens, compute-bound for many) or copied over
PCIe and computed on the device (cost ~ the copy, nearly flat in tokens). The two routes run
concurrently, so the split is a two-machine scheduling problem over the call's missed groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MissRoute = Literal["auto", "cpu", "copy"]


@dataclass
class RouteCosts:
    """Seconds to run one missed expert over ``n`` tokens on each route: ``fixed + per_token * n``."""

    cpu_fixed: float = 1.0
    cpu_per_token: float = 0.0
    copy_fixed: float = 1.0
    copy_per_token: float = 0.0

    @classmethod
    def from_share(cls, cpu_share: float) -> RouteCosts:
        """Costs under which the CPU tier takes ``cpu_share`` of the miss work (per-token cost ignored)."""
        cpu = 1.0 / cpu_share if cpu_share > 0 else math.inf
        copy = 1.0 / (1.0 - cpu_share) if cpu_share < 1 else math.inf
        return cls(cpu_fixed=cpu, copy_fixed=copy)

    def cpu(self, tokens: int) -> float:
        return self.cpu_fixed + self.cpu_per_token * tokens

    def copy(self, tokens: int) -> float:
        return self.copy_fixed + self.copy_per_token * tokens


def split_misses(
    tokens: list[int], route: MissRoute, costs: RouteCosts, fat_threshold: int | None = None
) -> tuple[list[int], list[int]]:
    """Indices of missed groups (``tokens[i]`` tokens each) for the CPU tier and for the copy path.

    ``auto`` first sends every group with at least ``fat_threshold`` tokens to the copy path (a fat
    group is a GEMM: the device computes it for the price of its copy, host cores would take many
    times longer), then assigns the others, most tokens first, to the route that would finish its
    queue sooner (longest-processing-time scheduling over two workers running concurrently, the
    copy queue starting with the fat groups' copies); ties go to the CPU. ``cpu`` and ``copy``
    send everything one way (the pure routes the benchmarks compare against).
    """
    everyone = list(range(len(tokens)))
    if route == "cpu":
        return everyone, []
    if route == "copy":
        return [], everyone
    fat = [i for i in everyone if fat_threshold is not None and tokens[i] >= fat_threshold]
    cpu, copy = [], list(fat)
    cpu_load, copy_load = 0.0, sum(costs.copy(tokens[i]) for i in fat)
    thin = [i for i in everyone if not (fat_threshold is not None and tokens[i] >= fat_threshold)]
    for i in sorted(thin, key=lambda i: -tokens[i]):
        cpu_finish, copy_finish = cpu_load + costs.cpu(tokens[i]), copy_load + costs.copy(tokens[i])
        if cpu_finish <= copy_finish:
            cpu.append(i)
            cpu_load = cpu_finish
        else:
            copy.append(i)
            copy_load = copy_finish
    return sorted(cpu), sorted(copy)
