"""How much the CPU tier's threads slow the thread that launches the GPU's work (decode's critical path at 1 stream).

    python bench/host_contention.py --threads 2,4,8,12,14 --out $OUT/host-contention.json

On the H200 host a tiered 1-stream decode step's host calls (graph replays, the attention's torch ops) took 2-3x
what the same calls take in the resident run, where no CPU tier runs, and the step is bound by that host thread.
This measures the launching thread alone while a background thread runs the CPU tier's fp4 decode jobs (2 experts,
1 token) on ``T`` threads, back to back (``compute``) or with a 0.5 ms pause between jobs, in which the team's
helpers spin as they do between decode's layers (``duty``); then with the launching thread pinned to core 0 and one
job thread pinned to each other core in turn (``sibling``: a core sharing core 0's physical core, which a guest
cannot see, slows it most). The probes: ``launch_us`` (a tiny CUDA kernel launched 400 times, the host's time per
launch; absent off CUDA) and ``python_us`` (20k iterations of a small pure-Python loop, per 1k iterations).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.bench.cpu_tier import CpuTierBenchConfig, JobMaker, make_experts  # noqa: E402
from moetier.bench.environment import environment  # noqa: E402
from moetier.kernels import cpu_experts  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


class Load:
    """A separate process (so the launching thread's GIL plays no part, as with the native worker) running fp4
    CPU-tier decode jobs on ``threads`` threads until stopped, ``pause`` seconds between jobs, pinned to ``core``."""

    def __init__(self, experts: int, threads: int, pause: float = 0.0, core: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.jobs, self._stop, self._ready = context.Value("q", 0), context.Event(), context.Event()
        args = (experts, threads, pause, core, self.jobs, self._stop, self._ready)
        self._process = context.Process(target=_load_loop, args=args, daemon=True)

    def __enter__(self) -> Load:
        self._process.start()
        if not self._ready.wait(120):
            raise RuntimeError("host_contention: the load process did not start")
        time.sleep(0.05)  # its team started and warm
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(30)


def _load_loop(experts: int, threads: int, pause: float, core: int | None, count, stop, ready) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    cfg = CpuTierBenchConfig(experts=experts, top_k=2, formats=["fp4"])
    maker = JobMaker(cfg, make_experts(cfg, "fp4")[1], "fp4")
    lib = cpu_experts.usable_library()
    jobs = [maker.job(1) for _ in range(8)]
    calls = [
        ([g.weights for g in job.groups], [g.rows for g in job.groups], [g.gates for g in job.groups]) for job in jobs
    ]
    ready.set()
    done = 0
    while not stop.is_set():
        experts_of, rows, gates = calls[done % len(calls)]
        lib.run_fp4(jobs[done % len(jobs)].hidden, experts_of, experts_of[0].tile, rows, gates, None, threads)
        done += 1
        count.value = done
        if pause:
            time.sleep(pause)


def probe(rounds: int) -> dict[str, float]:
    """The launching thread's costs now: medians over ``rounds`` (each ~2-4 ms: well inside a load's run)."""
    launch, python = [], []
    tiny = torch.zeros(1, device="cuda") if torch.cuda.is_available() else None
    for _ in range(rounds):
        if tiny is not None:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(400):
                tiny.add_(1.0)
            launch.append((time.perf_counter() - start) / 400 * 1e6)
            torch.cuda.synchronize()
        start = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(20000):
            table[i & 255] = table.get(i & 255, 0) + i
        python.append((time.perf_counter() - start) / 20 * 1e6)
    out = {"python_us": statistics.median(python)}
    if launch:
        out["launch_us"] = statistics.median(launch)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=_ints, default=[2, 4, 8, 12, 14])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-siblings", action="store_true", help="skip the per-core pinned runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not cpu_experts.available():
        print("host_contention: no C kernel on this machine (a C compiler is needed)", file=sys.stderr)
        return 2
    rows: list[dict] = []

    def record(kind: str, threads: int, load: Load | None, **extra: object) -> None:
        started, jobs_before = time.perf_counter(), load.jobs.value if load is not None else 0
        result = probe(args.rounds)
        jobs_per_s = (load.jobs.value - jobs_before) / (time.perf_counter() - started) if load is not None else 0.0
        rows.append({"load": kind, "threads": threads, **extra, **result, "jobs_per_s": round(jobs_per_s, 1)})
        print(json.dumps(rows[-1]), flush=True)

    record("idle", 0, None)
    for threads in args.threads:
        with Load(args.experts, threads) as load:
            record("compute", threads, load)
        with Load(args.experts, threads, pause=0.0005) as load:
            record("duty", threads, load)
    record("idle", 0, None)
    cores = sorted(os.sched_getaffinity(0))
    if not args.no_siblings and len(cores) > 1:
        main_core, allowed = cores[0], set(cores)
        os.sched_setaffinity(0, {main_core})
        record("idle-pinned", 0, None, main_core=main_core)
        for core in cores[1:]:
            with Load(args.experts, 1, core=core) as load:
                record("sibling", 1, load, main_core=main_core, load_core=core)
        os.sched_setaffinity(0, allowed)
    receipt = {"environment": environment(), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(receipt, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
