"""Which miss route a decode step takes, chosen by measured step time: the cost model's split, copies only, or
(where the device kernels take the call) the mapped route, which reads misses from the pinned home copy.

The split's cost model (:mod:`moetier.tiers.route_costs`) prices each route's own work. It cannot price
what the CPU tier's load costs the thread that launches the device's work: on the H200 host the same
attention launches took 1.5-1.9x longer while the CPU tier ran (``results/README.md``, seventh session),
and at one stream, where that thread is the bottleneck, the split then loses to copying every miss. So
the split is chosen the way a user would judge it, by the wall time of whole decode steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.errors import ConfigError

# The cost model's split, every miss through the copy path, every miss read by the kernels over PCIe (mapped).
SPLIT_ROUTES = ("auto", "copy", "mapped")


@dataclass
class _BatchTrial:
    """One batch size's state: its routes, the visit (``index``; in the trial visit i runs route i mod routes, in
    the playoff route ``playoff[i]``), its samples, the winner."""

    routes: tuple[str, ...]
    index: int = 0
    seen: int = 0  # steps of the current visit, counted or not
    samples: dict[str, list[float]] = field(default_factory=dict)
    playoff: tuple[str, ...] = ()  # the trial's pick and its close rivals while their playoff runs
    pending: dict[str, float] = field(default_factory=dict)  # the trial's medians while its playoff runs
    winner: str | None = None
    since_trial: int = 0  # steps run with the winner since the trial ended
    # The last finished trial's, seconds per step: per route, and its playoff's as "playoff_<route>".
    medians: dict[str, float] = field(default_factory=dict)

    def visiting(self) -> str:
        """The route of the trial's or playoff's current visit."""
        return self.playoff[self.index] if self.playoff else self.routes[self.index % len(self.routes)]


@dataclass
class SplitChooser:
    """Per decode batch size (tokens per call), the route of :data:`SPLIT_ROUTES` with the shortest steps.

    A batch size starts with a trial that visits the routes in turn, ``rounds`` times (so neither is only
    measured first, right after a prefill or a change of streams): each visit runs ``settle_steps`` steps
    that are not counted (the cache and the route costs settle after a switch), then ``block_steps`` timed
    ones. The first route (the cost model's split) wins unless another's median step time is lower by more
    than ``margin``. Where other routes' medians are within ``playoff_margin`` of the trial's pick, a playoff
    decides: the pick, then those rivals (closest first), each runs ``playoff_steps`` steps in a row, the first
    ``playoff_settle`` not counted, and the lower median wins (the first route, if it plays, again unless
    beaten by more than ``margin``). Short visits are biased: the routes change the expert cache differently
    (copies admit every miss, a mapped step at most two), so a visit inherits the previous route's cache. On
    the H200 the trial measured mapped at 5.70 ms per step and copies only at 6.00; mapped then ran 6.0 ms in
    the steady state, copies only alone 5.43; and at 4 streams a 16.84 ms trial median left out the mapped route
    that alone ran 12.4 ms a step (so every close rival plays, not only the closest). The winner runs for
    ``revisit_steps`` steps, then the trial (and any playoff) runs again (routing, load and the cache's contents
    change over a session). A route of ``playoff_always`` plays off whenever the trial did not pick it, close or not:
    the mapped route's short visits measure its worst steps (its share's timed eager steps, a cache the copies
    left), 25-60% above its steady state in every H200 receipt of the twelfth session (trial 7.63 ms a 1-stream step
    against copies' 5.80, so copies won, while mapped alone ran 4.17 ms).
    :meth:`route` names the route of the step about to run (a batch size's routes are ``routes``, or those
    its first :meth:`route` call passes: the mapped route takes decode-sized calls only), :meth:`observe`
    takes the seconds of a step that ran with the route it was given.
    """

    block_steps: int = 3
    rounds: int = 2
    settle_steps: int = 1
    revisit_steps: int = 256
    margin: float = 0.03
    playoff_margin: float = 0.15
    playoff_steps: int = 24
    playoff_settle: int = 8
    routes: tuple[str, ...] = ("auto", "copy")
    playoff_always: tuple[str, ...] = ("mapped",)
    _trials: dict[int, _BatchTrial] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.block_steps, self.rounds, self.revisit_steps) < 1 or self.settle_steps < 0:
            raise ConfigError(
                "split chooser needs block_steps, rounds, revisit_steps >= 1 and settle_steps >= 0: "
                f"{self.block_steps}, {self.rounds}, {self.revisit_steps}, {self.settle_steps}"
            )
        if not 0 <= self.playoff_settle < self.playoff_steps:
            raise ConfigError(
                f"split chooser needs 0 <= playoff_settle < playoff_steps: {self.playoff_settle}, {self.playoff_steps}"
            )
        for name in ("margin", "playoff_margin"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"split chooser {name} must be in [0, 1), got {getattr(self, name)}")
        _check_routes(self.routes)
        if any(route not in SPLIT_ROUTES for route in self.playoff_always):
            raise ConfigError(f"split chooser playoff_always must name routes of {SPLIT_ROUTES}: {self.playoff_always}")

    def route(self, tokens: int, routes: tuple[str, ...] | None = None) -> str:
        """The route for a step of ``tokens`` tokens per call (``routes``: that batch size's, if it is new)."""
        trial = self._trial(tokens, routes)
        if trial.winner is not None and trial.since_trial < self.revisit_steps:
            return trial.winner
        return trial.visiting()

    def observe(self, tokens: int, route: str, seconds: float) -> None:
        """A step of ``tokens`` tokens per call ran with ``route`` (from :meth:`route`) in ``seconds``."""
        trial = self._trial(tokens, None)
        if trial.winner is not None and trial.since_trial < self.revisit_steps:
            trial.since_trial += 1
            return
        if route != trial.visiting():
            return  # a step routed before the trial moved on
        trial.seen += 1
        if trial.playoff:
            settle, steps = self.playoff_settle, self.playoff_steps
        else:
            settle, steps = self.settle_steps, self.settle_steps + self.block_steps
        if trial.seen <= settle:
            return
        trial.samples.setdefault(route, []).append(seconds)
        if trial.seen < steps:
            return
        trial.index, trial.seen = trial.index + 1, 0
        if trial.index == (len(trial.playoff) if trial.playoff else len(trial.routes) * self.rounds):
            self._decide(trial)

    def settled(self, tokens: int) -> bool:
        """Whether a batch size of ``tokens`` tokens per call runs its winner (its trial done, the revisit ahead)."""
        trial = self._trials.get(tokens)
        return trial is not None and trial.winner is not None and trial.since_trial < self.revisit_steps

    def _trial(self, tokens: int, routes: tuple[str, ...] | None) -> _BatchTrial:
        trial = self._trials.get(tokens)
        if trial is None:
            trial = self._trials[tokens] = _BatchTrial(_check_routes(routes) if routes else self.routes)
        return trial

    def _decide(self, trial: _BatchTrial) -> None:
        """The trial's or the playoff's end: the winner, or (rivals close to the trial's pick) the playoff."""
        medians = {r: statistics.median(s) for r, s in trial.samples.items()}
        trial.index, trial.samples = 0, {}
        if trial.playoff:
            winner = self._pick(trial.routes[0], trial.playoff, medians)
            trial.medians = {**trial.pending, **{f"playoff_{r}": m for r, m in medians.items()}}
        else:
            winner = self._pick(trial.routes[0], trial.routes, medians)
            close = self.playoff_margin * medians[winner]
            rivals = sorted((r for r in trial.routes if r != winner and (abs(medians[r] - medians[winner]) <= close
                                                                       or r in self.playoff_always)),
                            key=medians.__getitem__)  # fmt: skip
            if rivals:
                trial.playoff, trial.pending = (winner, *rivals), medians
                return
            trial.medians = medians
        trial.winner, trial.playoff, trial.pending, trial.since_trial = winner, (), {}, 0

    def _pick(self, default: str, routes: tuple[str, ...], medians: dict[str, float]) -> str:
        """The one of ``routes`` of the lowest median, but ``default`` (if one of them) unless beaten by ``margin``."""
        best = min(routes, key=medians.__getitem__)
        beats = default not in routes or medians[best] < (1.0 - self.margin) * medians[default]
        return best if beats else default

    def report(self) -> dict[int, dict[str, float | str]]:
        """Per batch size that finished a trial: the winning route and each route's median ms per step (the
        trial's as ``<route>_ms``, a playoff's as ``playoff_<route>_ms``)."""
        return {
            tokens: {"route": t.winner, **{f"{r}_ms": round(1e3 * s, 3) for r, s in t.medians.items()}}
            for tokens, t in sorted(self._trials.items())
            if t.winner is not None
        }


def _check_routes(routes: tuple[str, ...]) -> tuple[str, ...]:
    if not routes or any(route not in SPLIT_ROUTES for route in routes) or len(set(routes)) != len(routes):
        raise ConfigError(f"split chooser routes must be distinct ones of {SPLIT_ROUTES}, got {routes}")
    return tuple(routes)


@dataclass
class _Mark:
    tokens: int
    host: float
    event: Any  # torch.cuda.Event recorded at the step's start (None off CUDA)
    route: str | None = None


class StepTimer:
    """Decode steps timed from one step's start to the next's, for the :class:`SplitChooser`.

    Off CUDA by the host clock. On CUDA by events on the compute stream: a step whose calls never wait for the
    device (the mapped route) lets the host run steps ahead, so only the device's timeline says how long a step
    took; where the host is the slower side, the device waits for its launches and the events measure that
    too. A pair of marks counts only for the same batch size and under ``gap_s`` of host time apart (a longer
    gap is idle time, not a step); :meth:`stop` (a prefill call, a step nothing is chosen for) ends the pair.
    """

    def __init__(self, gap_s: float = 1.0) -> None:
        self.gap_s = gap_s
        self._marks: deque[_Mark | None] = deque()

    @property
    def timing(self) -> bool:
        """Whether a step is being timed (its start marked, its end not yet)."""
        return bool(self._marks) and self._marks[-1] is not None

    def start(self, tokens: int, now: float, stream: Any) -> None:
        """Mark a step's start: ``now`` on the host clock, an event on ``stream`` (None off CUDA)."""
        event = None
        if stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        self._marks.append(_Mark(tokens, now, event))

    def label(self, route: str) -> None:
        """The route of the step whose start was marked last."""
        self._marks[-1].route = route

    def stop(self) -> None:
        if self.timing:
            self._marks.append(None)

    def finished(self) -> list[tuple[int, str, float]]:
        """``(tokens, route, seconds)`` of the timed steps whose end the device has passed (asked, not waited for)."""
        done = []
        while len(self._marks) >= 2:
            first, second = self._marks[0], self._marks[1]
            if first is None or second is None:
                self._marks.popleft()
                continue
            if second.event is not None and not second.event.query():
                break
            self._marks.popleft()
            if first.tokens == second.tokens and second.host - first.host < self.gap_s and first.route:
                host = second.host - first.host
                seconds = host if first.event is None else first.event.elapsed_time(second.event) / 1e3
                done.append((first.tokens, first.route, seconds))
        return done
