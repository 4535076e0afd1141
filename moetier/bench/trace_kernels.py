"""What a decode step's kernels are, from a decode trace (``bench decode --trace``): per step, how many kernels ran,
their summed time, the span from the step's first kernel to its end, and the kernels grouped by name.

A 1-stream decode step ends with the LM head, a GEMM longer than :data:`STEP_END_US` at the bench shapes (~235 us
for V4's 129k x 4096 head on the H200, ~355 us on the H100; a layer's backbone kernels are a few to ~50 us). A tiered
step's mapped expert kernels can be as long, but not every time (a layer whose experts were cached reads little)
and more often (once per MoE layer), so the steps are cut after each long kernel of :func:`step_end_name`'s name.
``idle_us`` is the step's span that no kernel covered (the device waiting for the host, the CPU tier or a copy).
The first step (warm-up of the profiler) is left out of the averages.
This is how the backbone's kernel count and time were read off the traces of earlier sessions; comparing two trees'
traces (``ALT_TRACE=1`` in ``bench/gpu_suite.sh``) shows what a change did to the step.

``python -m moetier.bench.trace_kernels TRACE.json.gz [--top N] [--gaps N] [--json]`` prints the steps, the heaviest
names and (``--gaps``) where the device idles, by the events either side (:func:`idle_between`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from moetier.bench.trace_phases import device_events, read_trace_argument

STEP_END_US = 200.0


@dataclass
class KernelGroup:
    """Kernels of one (shortened) name within a step: how many ran and their summed microseconds."""

    name: str
    count: int = 0
    us: float = 0.0


@dataclass
class StepKernels:
    """One decode step's kernels: ``count``, their summed time ``busy_us``, ``span_us`` from the first kernel's
    start to the last one's end, and ``groups`` by name, heaviest first."""

    count: int
    busy_us: float
    span_us: float
    groups: list[KernelGroup] = field(default_factory=list)
    idle_us: float = 0.0  # the span no kernel covered (kernels on two streams at once count once)


_OPERATION = re.compile(r"(\w+?(?:_kernel\w*|Functor\w*|Ops|_functor))\b")
# Launchers and wrappers of torch's generic kernels: the operation is the first name inside them that is not one.
_GENERIC = frozenset(
    [
        "gpu_kernel_impl",
        "gpu_kernel_impl_nocast",
        "elementwise_kernel",
        "vectorized_elementwise_kernel",
        "index_elementwise_kernel",
        "unrolled_elementwise_kernel",
        "AUnaryFunctor",
        "BUnaryFunctor",
        "BinaryFunctor",
        "reduce_kernel",
    ]
)


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and namespaces, and for torch's generic kernels the operation
    they run (``elementwise_kernel[masked_fill_kernel]``, ``reduce_kernel[ArgMaxOps]``)."""
    name = re.sub(r"\(anonymous namespace\)::", "", name).replace("at::native::", "")
    head, _, rest = name.partition("<")
    head = head.split("(", 1)[0].replace("void ", "").strip() or name[:60]
    operation = next((m for m in _OPERATION.findall(rest) if m not in _GENERIC and m != head), None)
    return f"{head}[{operation}]" if operation else head


def steps(trace: dict, step_end_us: float = STEP_END_US) -> list[StepKernels]:
    """The trace's kernels cut into steps after each kernel of at least ``step_end_us`` whose name is the step end's
    (:func:`step_end_name`)."""
    kernels = sorted((e for e in device_events(trace) if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    end = step_end_name(kernels, step_end_us)
    found, current = [], []
    for event in kernels:
        current.append(event)
        if _ends_step(event, end, step_end_us):
            found.append(_step(current))
            current = []
    return found


def step_end_name(kernels: list[dict], step_end_us: float = STEP_END_US) -> str | None:
    """The short name of the kernel that ends a step: among names with runs of at least ``step_end_us``, the one whose
    runs are all (or most often) that long, then the one that ran fewest times; ties go to the name seen last. The
    LM head is always long and runs once a step; a mapped expert kernel runs once per MoE layer and is short where
    the layer's experts were cached. None without long kernels."""
    runs: dict[str, list[int]] = {}
    for event in kernels:
        name = short_name(event["name"])
        long = int(float(event.get("dur", 0.0)) >= step_end_us)
        counts = runs.pop(name, [0, 0])  # re-inserted: the last seen comes last
        runs[name] = [counts[0] + long, counts[1] + 1]
    candidates = [(name, long, total) for name, (long, total) in runs.items() if long]
    if not candidates:
        return None
    best = max(reversed(candidates), key=lambda c: (c[1] / c[2], -c[2]))
    return best[0]


def _step(events: list[dict]) -> StepKernels:
    groups: dict[str, KernelGroup] = defaultdict(lambda: KernelGroup(""))
    for event in events:
        group = groups[short_name(event["name"])]
        group.count += 1
        group.us += float(event.get("dur", 0.0))
    for name, group in groups.items():
        group.name = name
    first, last = events[0], events[-1]
    span = float(last["ts"]) + float(last.get("dur", 0.0)) - float(first["ts"])
    busy = sum(float(e.get("dur", 0.0)) for e in events)
    idle = span - _covered_us(events)
    return StepKernels(len(events), busy, span, sorted(groups.values(), key=lambda g: -g.us), idle)


def _covered_us(events: list[dict]) -> float:
    """Microseconds during which at least one of ``events`` (sorted by start) ran."""
    covered, end = 0.0, float("-inf")
    for event in events:
        start, stop = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
        covered += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return covered


def idle_between(trace: dict, step_end_us: float = STEP_END_US, top: int = 12) -> list[dict]:
    """Where the device idles: per step, the microseconds between two device events (kernels, copies, sets) that
    nothing covered, by the short names of the events either side (``before``: the one that ended last, ``after``:
    the next to start), heaviest first. The
    steps measured are those after the first (as in :func:`summary`); empty with fewer than three step ends."""
    events = device_events(trace)
    end = step_end_name([e for e in events if e.get("cat") == "kernel"], step_end_us)
    ends = [float(e["ts"]) for e in events if _ends_step(e, end, step_end_us)]
    if len(ends) < 3:
        return []
    idle: dict[tuple[str, str], float] = defaultdict(float)
    last, reach = None, float("-inf")  # the event that ended last so far, and its end
    for event in events:
        start, stop = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
        if ends[1] < start <= ends[-1] and last is not None and start > reach:
            idle[(short_name(last["name"]), short_name(event["name"]))] += start - reach
        if stop > reach:
            last, reach = event, stop
    measured = len(ends) - 2
    ranked = sorted(idle.items(), key=lambda kv: -kv[1])[:top]
    return [{"before": before, "after": after, "us": us / measured} for (before, after), us in ranked]


def _ends_step(event: dict, end: str | None, step_end_us: float) -> bool:
    long = event.get("cat") == "kernel" and float(event.get("dur", 0.0)) >= step_end_us
    return long and short_name(event["name"]) == end


def heaviest_kernels(trace: dict, top: int = 12) -> list[dict]:
    """The whole trace's kernels grouped by :func:`short_name`, the ``top`` heaviest (name, count, us)."""
    kernels = [e for e in device_events(trace) if e.get("cat") == "kernel"]
    return [asdict(g) for g in _step(kernels).groups[:top]] if kernels else []


def summary(found: list[StepKernels], top: int = 25) -> dict:
    """The steps after the first: the medians of count, busy and span (a step the host delayed stretches its span
    alone), and the last step's ``top`` heaviest names."""
    measured = found[1:] or found
    if not measured:
        return {"steps": 0}
    return {
        "steps": len(measured),
        "kernels": median(s.count for s in measured),
        "busy_us": median(s.busy_us for s in measured),
        "span_us": median(s.span_us for s in measured),
        "idle_us": median(s.idle_us for s in measured),
        "heaviest": [asdict(g) for g in measured[-1].groups[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moetier.bench.trace_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25, help="kernel names listed, heaviest first")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--gaps", type=int, default=0, help="also the N largest idle gaps a step, by neighbours")
    args = parser.parse_args(argv)
    if args.gaps < 0:
        parser.error(f"--gaps must be >= 0, got {args.gaps}")
    trace = read_trace_argument(parser, args.trace)
    found = steps(trace)
    result = summary(found, args.top)
    if args.gaps:
        result["idle_between"] = idle_between(trace, top=args.gaps)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for i, step in enumerate(found):
        print(f"step {i}: {step.count} kernels, {step.busy_us:.1f} us busy, {step.span_us:.1f} us span, "
              f"{step.idle_us:.1f} us idle")  # fmt: skip
    if result["steps"]:
        print(f"median of {result['steps']}: {result['kernels']:.1f} kernels, {result['busy_us']:.1f} us busy, "
              f"{result['span_us']:.1f} us span, {result['idle_us']:.1f} us idle")  # fmt: skip
        for group in result["heaviest"]:
            print(f"{group['us']:9.1f} us {group['count']:4d}x {group['name']}")
    for gap in result.get("idle_between", []):
        print(f"{gap['us']:9.1f} us idle between {gap['before']} and {gap['after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
