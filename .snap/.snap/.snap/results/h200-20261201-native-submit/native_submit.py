"""Where a decode CPU job's submit time goes on this host, and what a running job costs the launching thread.

Real-width fp4 experts (hidden 4096, intermediate 2048, V4-Flash's), 64 of them (~0.85 GB, more than the
L3), each 1-token job reading 3 experts that were not read for the last 20 jobs, so the weights stream from
DRAM as in decode. Prints microseconds per call of each piece of the native submit, the whole submit on
both workers, the submit-to-result latency, and a fixed pure-Python workload's time with the machine idle,
while native jobs run back to back, and while Python-worker jobs do.
Run: PYTHONPATH=. python3 results/h200-20261201-native-submit/native_submit.py
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from moetier.kernels import cpu_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights

HIDDEN, INTER, N_EXPERTS, PER_JOB = 4096, 2048, 64, 3
FP4 = ExpertQuant(kind="fp4-block", tile=(1, 32))


def experts() -> list[ExpertWeights]:
    layout = ExpertLayout((0,), num_experts=N_EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, top_k=6, quant=FP4)
    gen, out = torch.Generator().manual_seed(0), []
    for _ in range(N_EXPERTS):
        block = torch.randint(0, 256, (layout.block_numel,), dtype=torch.uint8, generator=gen)
        w = ExpertWeights.from_block(block, layout)
        for scale in (w.gate_scale, w.up_scale, w.down_scale):
            scale.copy_(2.0 ** torch.randint(-9, -5, scale.shape, generator=gen).float())
        out.append(w)
    return out


def jobs(weights: list[ExpertWeights], count: int) -> list[CpuJob]:
    hidden, out, made = torch.randn(1, HIDDEN).bfloat16(), torch.empty(1, HIDDEN), []
    for j in range(count):
        first = (j * 7 * PER_JOB) % N_EXPERTS  # 21 experts on per job: none of the last ~3 jobs' experts again
        groups = [CpuGroup(weights[(first + e) % N_EXPERTS], [0], [0.25]) for e in range(PER_JOB)]
        made.append(CpuJob(hidden=hidden, groups=groups, out=out))
    return made


def busy(seconds: float) -> None:
    """The launching thread's work between two layers' submits: busy, not asleep (a sleeping thread wakes slowly)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def us(samples: list[float]) -> str:
    return f"median {1e6 * statistics.median(samples):7.1f} us, min {1e6 * min(samples):7.1f}"


def python_work() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i % 7
    return time.perf_counter() - start


def main() -> None:
    print(f"cores {os.cpu_count()}, kernel isa {cpu_experts.kernel_isa()}")
    weights = experts()
    native, python = CpuExpertTier(None), CpuExpertTier(None, native=False)
    for tier in (native, python):
        for job in jobs(weights, 24):
            tier.submit(job).result()  # experts checked, threads started
    pieces = {"plan": [], "checked_job": [], "ctypes submit": [], "native submit": [], "python submit": []}
    latency = {"native": [], "python": []}
    for job in jobs(weights, 60):
        out = job.out
        t0 = time.perf_counter()
        plan = native._kernel_for(job, out)
        checked = native._checked(job, plan)
        t1 = time.perf_counter()
        packed = cpu_experts.checked_job(checked, job.hidden, [g.rows for g in job.groups],
                                         [g.gates for g in job.groups], None, native.threads, out)
        t2 = time.perf_counter()
        pieces["plan"].append(t1 - t0)
        pieces["checked_job"].append(t2 - t1)
        del packed
        busy(0.0015)  # the worker idle again, as between two decode layers
        t3 = time.perf_counter()
        future = native.submit(job)
        t4 = time.perf_counter()
        future.result()
        t5 = time.perf_counter()
        pieces["native submit"].append(t4 - t3)
        latency["native"].append(t5 - t3)
        busy(0.0015)
        t6 = time.perf_counter()
        future = python.submit(job)
        t7 = time.perf_counter()
        future.result()
        t8 = time.perf_counter()
        pieces["python submit"].append(t7 - t6)
        latency["python"].append(t8 - t6)
    worker = native._native[0]
    job = jobs(weights, 1)[0]
    plan = native._kernel_for(job, job.out)
    checked = native._checked(job, plan)
    for _ in range(60):
        busy(0.0015)
        t0 = time.perf_counter()
        queued = worker.submit(checked, job.hidden, [g.rows for g in job.groups], [g.gates for g in job.groups],
                               None, native.threads, job.out)
        pieces["ctypes submit"].append(time.perf_counter() - t0)
        queued.wait()
    for name, samples in pieces.items():
        print(f"{name:>15}: {us(samples)}")
    for name, samples in latency.items():
        print(f"{name:>15} submit -> result: {us(samples)}")
    for label, tier in (("idle", None), ("native jobs", native), ("python jobs", python), ("idle again", None)):
        stop = threading.Event()
        runner = None
        if tier is not None:
            def load(tier=tier, stop=stop) -> None:
                for job in iter(lambda: jobs(weights, 1)[0], None):
                    if stop.is_set():
                        return
                    tier.submit(job).result()
            runner = threading.Thread(target=load)
            runner.start()
            time.sleep(0.2)
        times = [python_work() for _ in range(15)]
        stop.set()
        if runner is not None:
            runner.join()
        print(f"{label:>15}: python workload {us(times)}")
    native.close()
    python.close()


if __name__ == "__main__":
    main()
