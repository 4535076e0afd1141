"""Where a fed mapped layer's time goes, from a decode trace (``bench decode --trace``): per MoE call, the device's
share of the experts and how long the device then waited for the CPU tier's sums.

A mapped call with the fed CPU tier is, on the compute stream: the table kernel, the device's grouped kernels
(``_gate_up*`` then ``_down_kernel``), a wait for the CPU's done word, and the copy of the CPU's sums
(``Memcpy HtoD``). So from the table kernel's start, ``device`` is the grouped kernels' time, ``phase`` the time
until the sums' copy starts, and ``late`` how long the device sat idle between its last kernel and that copy: the
CPU tier's job outlasting the device's share (plus the hand-off). ``balanced`` is what the phase would take if
both sides' work were moved until they ended together at the rates they ran at (the harmonic mean of the two).

``python -m moetier.bench.trace_phases TRACE.json.gz [--from US --to US]`` prints a row per call and the means.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_DEVICE_SHARE = ("_gate_up", "_down_kernel")


@dataclass(frozen=True)
class CallPhase:
    """One fed mapped call: ``start`` (us from the trace's first device event), ``device`` (us of grouped kernels),
    ``phase`` (us from the table kernel to the CPU's sums) and ``late`` (us the device waited after its share)."""

    start: float
    device: float
    phase: float
    late: float

    @property
    def balanced(self) -> float:
        """The phase with both sides' work moved until they end together (each at the rate it ran at)."""
        cpu = self.phase
        return min(self.phase, 2 * self.device * cpu / (self.device + cpu)) if self.device > 0 else self.phase


def device_events(trace: dict) -> list[dict]:
    """The trace's device events (kernels, copies, sets) by start time."""
    return sorted((e for e in trace.get("traceEvents", []) if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])


def call_phases(events: Iterable[dict], origin: float | None = None) -> list[CallPhase]:
    """The fed mapped calls among ``events`` (device events by start time): each from a table kernel through its
    grouped kernels to the next host-to-device copy (a call without one, or without kernels, is left out)."""
    calls, current, origin_ts = [], None, origin
    for event in events:
        name, ts, dur = event["name"], float(event["ts"]), float(event.get("dur", 0.0))
        origin_ts = ts if origin_ts is None else origin_ts
        if name.startswith("_table_kernel"):
            current = {"start": ts, "device": 0.0, "end": None}
        elif current is not None and name.startswith(_DEVICE_SHARE):
            current["device"] += dur
            current["end"] = ts + dur
        elif current is not None and "Memcpy HtoD" in name and current["end"] is not None:
            start = current["start"]
            calls.append(CallPhase(start - origin_ts, current["device"], ts - start, max(0.0, ts - current["end"])))
            current = None
    return calls


def summary(calls: list[CallPhase]) -> dict[str, float]:
    """Means over the calls, us: device share, phase, wait for the CPU, balanced phase."""
    n = max(len(calls), 1)
    return {
        "calls": len(calls),
        "device_us": sum(c.device for c in calls) / n,
        "phase_us": sum(c.phase for c in calls) / n,
        "late_us": sum(c.late for c in calls) / n,
        "balanced_us": sum(c.balanced for c in calls) / n,
    }


def read_trace(path: Path) -> dict:
    """A gzipped Chrome trace (``bench decode --trace``)."""
    with gzip.open(path, "rt") as src:
        return json.load(src)


def read_trace_argument(parser: argparse.ArgumentParser, path: Path) -> dict:
    """The trace a command line names, or the parser's one-line error (exit 2) naming the fix."""
    if not path.is_file():
        parser.error(f"{path} is not a file: pass a decode-trace-*.json.gz from bench decode --trace")
    try:
        return read_trace(path)
    except (OSError, ValueError, EOFError) as exc:  # not gzip, not JSON, cut short
        parser.error(f"{path} is not a gzipped JSON trace ({exc}): pass one from bench decode --trace")


def trace_note(mode: str, path: Path) -> str | None:
    """A receipt's note on the fed mapped calls of ``mode``'s trace at ``path`` (None: it has none)."""
    calls = call_phases(device_events(read_trace(path)))
    if not calls:
        return None
    means = summary(calls)
    return (
        f"{mode}: traced fed calls (1 stream, {len(calls)}): device share {means['device_us']:.0f} us, table kernel to "
        f"the CPU's sums {means['phase_us']:.0f} us, the device's wait for them {means['late_us']:.0f} us (both sides "
        f"ending together: {means['balanced_us']:.0f} us)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moetier.bench.trace_phases", description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path, help="a gzipped Chrome trace from bench decode --trace")
    parser.add_argument("--from", dest="lo", type=float, default=0.0, help="first call start, us (default 0)")
    parser.add_argument("--to", dest="hi", type=float, default=float("inf"), help="last call start, us")
    args = parser.parse_args(argv)
    trace = read_trace_argument(parser, args.trace)
    calls = [c for c in call_phases(device_events(trace)) if args.lo <= c.start <= args.hi]
    for c in calls:
        row = f"device {c.device:5.0f} phase {c.phase:5.0f} late {c.late:4.0f} balanced {c.balanced:5.0f}"
        print(f"{c.start:9.0f} {row}")
    print(json.dumps({k: round(v, 1) for k, v in summary(calls).items()}))
    return 0


if __name__ == "__main__":  # pragma: no cover - the command line
    raise SystemExit(main())
