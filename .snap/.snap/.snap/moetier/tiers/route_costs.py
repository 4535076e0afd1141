"""Which missed experts run on the CPU tier and which are copied to the device: the cost model.

A missed expert can be computed on host cores straight from its home copy (cost grows with its
token count: the CPU tier is read-bound for a few tokens, compute-bound for many) or copied over
PCIe and computed on the device (cost ~ the copy, nearly flat in tokens). The two routes run
concurrently, so the split is a two-machine scheduling problem over the call's missed groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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

    def scaled(self, cpu: float, copy: float) -> RouteCosts:
        """These costs with the CPU route's times multiplied by ``cpu`` and the copy route's by ``copy``."""
        return RouteCosts(
            self.cpu_fixed * cpu, self.cpu_per_token * cpu, self.copy_fixed * copy, self.copy_per_token * copy
        )

    def cpu(self, tokens: int) -> float:
        return self.cpu_fixed + self.cpu_per_token * tokens

    def copy(self, tokens: int) -> float:
        return self.copy_fixed + self.copy_per_token * tokens


def split_misses(
    tokens: list[int],
    route: MissRoute,
    costs: RouteCosts,
    fat_threshold: int | None = None,
    probe: str | None = None,
) -> tuple[list[int], list[int]]:
    """Indices of missed groups (``tokens[i]`` tokens each) for the CPU tier and for the copy path.

    ``auto`` first sends every group with at least ``fat_threshold`` tokens to the copy path (a fat
    group is a GEMM: the device computes it for the price of its copy, host cores would take many
    times longer), then assigns the others, most tokens first, to the route that would finish its
    queue sooner (longest-processing-time scheduling over two workers running concurrently, the
    copy queue starting with the fat groups' copies); ties go to the CPU. ``cpu`` and ``copy``
    send everything one way (the pure routes the benchmarks compare against). ``probe`` (``auto`` only,
    from :meth:`RouteAdapter.probe`) names a route that must get a group: when the split gave it none,
    the other route's fewest-token thin group moves there, so the route's cost is measured again.
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
    if probe is not None:
        _probe(probe, cpu, copy, thin, tokens)
    return sorted(cpu), sorted(copy)


def _probe(route: str, cpu: list[int], copy: list[int], thin: list[int], tokens: list[int]) -> None:
    """Move the fewest-token thin group to ``route`` if it has none (in place)."""
    target, other = (cpu, copy) if route == "cpu" else (copy, cpu)
    movable = [i for i in other if i in thin]
    if target or not movable:
        return
    smallest = min(movable, key=lambda i: tokens[i])
    other.remove(smallest)
    target.append(smallest)


ROUTES = ("cpu", "copy")


@dataclass
class RouteAdapter:
    """Keeps the split true to what each route costs while serving, not just at start-up.

    The start-up calibration times each route alone; while decoding, the CPU tier and the copy
    engine read host memory at the same time and both slow down, by different amounts (on the H200
    host the CPU kernel read 74 GB/s alone and ~46 GB/s beside the copies). Each decode call reports,
    per route, the seconds its share took and the seconds the start-up costs predicted for it; the
    ratio's exponential average (``weight`` per observation, one observation moving it by at most
    ``max_step``x) rescales that route's costs. Until both routes have been observed the start-up
    costs stand, so a split never compares a measured route with an unmeasured one. A route left
    without work for ``probe_after`` calls is given one group (:meth:`probe`) to be measured again.
    """

    weight: float = 0.25
    max_step: float = 4.0
    probe_after: int = 64  # calls a route may go without work while the other has some, before a probe
    scales: dict[str, float] = field(default_factory=dict)
    idle_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTES, 0))

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0 or self.max_step < 1.0 or self.probe_after < 1:
            raise ValueError(
                f"route adapter needs 0 < weight <= 1, max_step >= 1 and probe_after >= 1: "
                f"{self.weight}, {self.max_step}, {self.probe_after}"
            )

    def note_split(self, cpu_groups: int, copy_groups: int) -> None:
        """Count, per route, the calls in a row it got no work while the other got some."""
        if cpu_groups and copy_groups:
            self.idle_calls = dict.fromkeys(ROUTES, 0)
        elif cpu_groups or copy_groups:
            idle = "copy" if cpu_groups else "cpu"
            self.idle_calls[idle] += 1

    def probe(self) -> str | None:
        """A route starved for ``probe_after`` calls: the next split gives it one group.

        A route the split never uses is never observed, so a cost it was once wrongly given (a slow
        start-up timing, a contended moment) would otherwise stand forever.
        """
        starved = [route for route in ROUTES if self.idle_calls[route] >= self.probe_after]
        if not starved:
            return None
        self.idle_calls[starved[0]] = 0
        return starved[0]

    def observe(self, route: str, predicted: float, seconds: float) -> None:
        """One call's share of ``route`` took ``seconds`` where the start-up costs said ``predicted``."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        if not (predicted > 0 and seconds > 0 and math.isfinite(predicted) and math.isfinite(seconds)):
            return
        ratio, old = seconds / predicted, self.scales.get(route)
        if old is None:
            self.scales[route] = ratio
            return
        ratio = min(max(ratio, old / self.max_step), old * self.max_step)
        self.scales[route] = (1.0 - self.weight) * old + self.weight * ratio

    def costs(self, base: RouteCosts) -> RouteCosts:
        """``base`` rescaled by the observed ratios (``base`` itself until both routes were observed)."""
        if any(route not in self.scales for route in ROUTES):
            return base
        return base.scaled(self.scales["cpu"], self.scales["copy"])
