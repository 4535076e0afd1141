"""The CPU tier's native worker: C-thread jobs give the synchronous kernel's bits, store their flag value in
order (also when they fail), run while the calling thread holds the GIL, and keep order with Python-worker
jobs. Tiny experts: each test takes well under a second."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from test_cpu_tier_overhead import HIDDEN, _checked_run, _experts, _job

from moetier.bench.cpu_tier import CpuTierBenchConfig, JobMaker, make_experts
from moetier.errors import ConfigError
from moetier.kernels import cpu_experts, cpu_worker
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob, NativeFuture, pinned_cores
from moetier.tiers.gpu_wait import FlagRelease


@pytest.fixture(autouse=True)
def _kernel(monkeypatch):
    monkeypatch.delenv("MOETIER_CPU_KERNEL", raising=False)
    lib = cpu_experts.library()
    if not cpu_experts.available() or lib is None or not cpu_worker.supported(lib):
        pytest.skip("the tier does not use the C kernel here (no compiler, or a build it does not use)")


class _Word:
    """A 32-bit word a job stores into, read without releasing the GIL (numpy indexing)."""

    def __init__(self) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32)
        self.cell = self.tensor.numpy()

    def release(self, value: int) -> None:  # the HostFlag interface FlagRelease calls
        self.cell[0] = value


def _releaser(word: _Word, value: int) -> FlagRelease:
    return FlagRelease(word, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_native_jobs_give_the_synchronous_bits_and_store_their_flags_in_order(fmt):
    experts, word = _experts(3, fmt), _Word()
    tier = CpuExpertTier(0.4, threads=2)
    jobs = [_job(experts[::-1] if s % 2 else experts, seed=s) for s in range(6)]
    for value, job in enumerate(jobs, start=1):
        job.on_done = _releaser(word, value)
    futures = [tier.submit(job) for job in jobs]
    assert all(isinstance(f, NativeFuture) for f in futures)
    results = [f.result() for f in futures]
    tier.close()
    assert word.cell[0] == len(jobs)
    for s, result in enumerate(results):
        assert torch.equal(result.out, _checked_run(_job(experts[::-1] if s % 2 else experts, seed=s), fmt))
        assert result.seconds > 0 and result.pairs == 6 and result.kernel.startswith("c-")


def test_a_native_job_runs_while_the_caller_holds_the_gil():
    """The flag is stored with no Python thread running: a Python worker could not take the GIL here."""
    experts, word = _experts(2, "bf16"), _Word()
    tier = CpuExpertTier(0.4, threads=1)
    tier.submit(_job(experts)).result()  # the worker thread exists and the experts are checked
    job = _job(experts, seed=5)
    job.on_done = _releaser(word, 7)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # this thread gives the GIL away only where it blocks
    try:
        future = tier.submit(job)
        deadline, stored = time.perf_counter() + 5.0, False
        while time.perf_counter() < deadline:  # pure Python: never releases the GIL
            if word.cell[0] == 7:
                stored = True
                break
    finally:
        sys.setswitchinterval(interval)
    assert stored
    assert torch.equal(future.result().out, _checked_run(_job(experts, seed=5), "bf16"))
    tier.close()


def test_a_failed_native_job_raises_at_result_and_still_stores_its_flag():
    experts, word = _experts(2, "bf16"), _Word()
    tier = CpuExpertTier(0.4, threads=1)
    job = _job(experts)
    job.groups[1] = CpuGroup(job.groups[1].weights, torch.tensor([0, 9]), job.groups[1].gates)  # row 9 of 4
    job.on_done = _releaser(word, 3)
    future = tier.submit(job)
    assert isinstance(future, NativeFuture)
    with pytest.raises(ValueError, match="out of range"):
        future.result()
    assert word.cell[0] == 3
    bad_hidden = _job(experts)
    bad_hidden.hidden = torch.zeros(4, HIDDEN + 2, dtype=torch.bfloat16)  # fails the check at submit
    bad_hidden.on_done = _releaser(word, 4)
    failed = tier.submit(bad_hidden)
    with pytest.raises(ValueError, match="expected"):
        failed.result()
    assert word.cell[0] == 4
    tier.close()


def test_jobs_keep_their_order_across_the_native_and_the_python_worker():
    experts = _experts(2, "bf16")
    tier = CpuExpertTier(0.4, threads=1)
    native = [tier.submit(_job(experts, seed=s)) for s in range(3)]
    seen: list[bool] = []
    python_job = _job(experts, seed=9)
    python_job.on_done = lambda: seen.append(all(f.done() for f in native))  # a plain callable: the Python worker
    after = tier.submit(python_job)
    assert isinstance(after, Future) and all(isinstance(f, NativeFuture) for f in native)
    after.result()
    assert seen == [True]
    # While a Python job is outstanding, the next job queues behind it on the Python worker.
    gate = threading.Event()
    slow = _job(experts, seed=10)
    slow.ready = type("Ready", (), {"synchronize": staticmethod(gate.wait)})()
    blocked = tier.submit(slow)
    behind = tier.submit(_job(experts, seed=11))
    assert isinstance(behind, Future) and not behind.done()
    gate.set()
    assert torch.equal(behind.result().out, _checked_run(_job(experts, seed=11), "bf16"))
    assert blocked.result().wait_seconds >= 0.0
    tier.close()


def _bf16_job():
    """The library, a bf16 job of two experts, its checked experts, rows and gates: what NativeWorker.submit takes."""
    experts = _experts(2, "bf16")
    job = _job(experts)
    checked = cpu_experts.check_experts(None, job.hidden, None, [(w.gate_up, w.down) for w in experts])
    return cpu_experts.library(), job, checked, [g.rows for g in job.groups], [g.gates for g in job.groups]


def test_the_worker_refuses_jobs_once_closed_and_its_jobs_stay_waitable():
    lib, job, checked, rows, gates = _bf16_job()
    worker = cpu_worker.NativeWorker(lib)
    queued = [worker.submit(checked, job.hidden, rows, gates, 0.4, 1) for _ in range(4)]
    worker.close()  # runs what is queued first
    assert all(q.done() for q in queued) and [q.wait()[0] for q in queued] == [0] * 4
    assert torch.equal(queued[-1].out, _checked_run(job, "bf16"))
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(checked, job.hidden, rows, gates, 0.4, 1)


def test_cpu_job_rows_are_gathered_per_group():
    """A job whose groups share rows sums them in fp32, as the synchronous path does."""
    experts = _experts(3, "fp4")
    job = _job(experts)
    job.groups = [CpuGroup(g.weights, torch.tensor([1, 1]), g.gates) for g in job.groups]
    tier = CpuExpertTier(0.4, threads=2)
    ours = tier.submit(job).result()
    tier.close()
    reference = CpuExpertTier(0.4, threads=1)
    expected = reference.run(CpuJob(hidden=job.hidden, groups=job.groups))
    reference.close()
    assert torch.equal(ours.out, expected.out)


def test_a_worker_that_cannot_start_leaves_the_jobs_to_the_python_worker(monkeypatch, caplog):
    def refuse(lib, spin_seconds=0.0):
        raise RuntimeError("cpu_experts: could not start the native worker thread")

    monkeypatch.setattr(cpu_worker, "NativeWorker", refuse)
    experts = _experts(2, "bf16")
    tier = CpuExpertTier(0.4, threads=1)
    with caplog.at_level("WARNING"):
        first, second = tier.submit(_job(experts)), tier.submit(_job(experts, seed=2))
    assert isinstance(first, Future) and isinstance(second, Future) and not tier.native
    assert torch.equal(second.result().out, _checked_run(_job(experts, seed=2), "bf16"))
    assert first.result().kernel.startswith("c-")
    assert sum("native worker is unavailable" in r.message for r in caplog.records) == 1
    tier.close()


def test_a_spinning_worker_takes_jobs_while_spinning_and_after_it_slept():
    lib, job, checked, rows, gates = _bf16_job()
    with pytest.raises(ValueError, match="spin_seconds"):
        cpu_worker.NativeWorker(lib, spin_seconds=2.0)
    worker = cpu_worker.NativeWorker(lib, spin_seconds=0.002)
    expected = _checked_run(job, "bf16")
    for gap in (0.0, 0.0005, 0.01, 0.0, 0.02):  # within the spin, and after the worker went to sleep
        time.sleep(gap)
        queued = worker.submit(checked, job.hidden, rows, gates, 0.4, 1)
        assert queued.wait()[0] == 0 and torch.equal(queued.out, expected)
    worker.close()


def test_an_unknown_worker_switch_is_refused(monkeypatch):
    from moetier.errors import ConfigError

    monkeypatch.setenv("MOETIER_CPU_WORKER", "pyhton")
    with pytest.raises(ConfigError, match="MOETIER_CPU_WORKER must be 'native' or 'python'"):
        CpuExpertTier(0.4, threads=1)
    monkeypatch.setenv("MOETIER_CPU_WORKER", "python")
    assert not CpuExpertTier(0.4, threads=1).native


@pytest.mark.parametrize("threads", [1, 3])
def test_a_native_job_reports_where_its_time_went(threads):
    """The marks are seconds after the kernel's entry, ordered as the job passes them (a late thread may enter
    after another finished phase 1, but phase 2 starts after the barrier), within its wall time."""
    experts = _experts(3, "fp4")
    tier = CpuExpertTier(0.4, threads=threads)
    result = tier.submit(_job(experts, seed=2)).result()
    tier.close()
    marks = result.marks
    assert list(marks) == ["before", *cpu_worker.MARK_NAMES]
    for phase in ("entered", "gate_up", "down"):
        assert marks[f"{phase}_first"] <= marks[f"{phase}_last"]
    passed = ("allocated", "entered_first", "gate_up_first", "gate_up_last", "down_last", "end")
    order = [marks[name] for name in passed]
    assert order == sorted(order) and order[0] >= 0.0 and order[-1] <= result.seconds
    assert marks["entered_last"] <= marks["down_first"]  # every thread is in before the barrier lets any through
    assert 0.0 <= marks["before"] <= result.seconds - order[-1] + 1e-6
    if threads == 1:  # a team of one: the first thread is the last
        assert marks["gate_up_first"] == marks["gate_up_last"] and marks["down_first"] == marks["down_last"]


def test_a_job_counts_the_threads_that_joined_it():
    """A job's marks count the threads that took part: never the odd helpers of a build that keeps them away (the
    caller alone may do a job before any helper wakes), the helpers of the default build do come (jobs of ~1 ms: 4
    bf16 experts of 1024 x 512), and a build whose team cannot start runs every job on its caller: the same sums."""
    cfg = CpuTierBenchConfig(experts=4, hidden=1024, intermediate=512, top_k=4, formats=["bf16"], seed=0)
    _, experts = make_experts(cfg, "bf16")
    job = JobMaker(cfg, experts).job(2)
    checked = cpu_experts.check_experts(
        None, job.hidden, None, [(g.weights.gate_up, g.weights.down) for g in job.groups]
    )
    rows, gates = [g.rows for g in job.groups], [g.gates for g in job.groups]
    absent = cpu_experts.library(("-DMOETIER_TEAM_ODD_HELPERS_ABSENT=1",))
    assert absent is not None
    alone = cpu_experts.library(("-DMOETIER_TEAM_CANNOT_START=1",))
    assert alone is not None
    outs = []
    for lib, most in ((absent, 2), (cpu_experts.library(), 4), (alone, 1)):
        worker = cpu_worker.NativeWorker(lib, spin_seconds=0.002)
        queued = [worker.submit(checked, job.hidden, rows, gates, 0.4, 4) for _ in range(20)]
        assert [q.wait()[0] for q in queued] == [0] * 20
        worker.close()
        joined = [q.marks["joined"] for q in queued]
        assert min(joined) >= 1 and max(joined) <= most and (max(joined) > 1 or most == 1), joined
        assert all(torch.equal(q.out, queued[0].out) for q in queued)
        outs.append(queued[0].out)
    assert all(torch.equal(out, outs[0]) for out in outs)


def _threads_on(cores: set[int]) -> int:
    """How many of this process's threads may run on ``cores`` only."""
    return sum(os.sched_getaffinity(int(tid)) == cores for tid in os.listdir("/proc/self/task"))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux's")
def test_pinned_tier_threads_run_on_the_cores_given(monkeypatch):
    """MOETIER_CPU_PIN=1 pins the native worker and its team's helpers to the process's last cores; the sums do not
    change; a tier without it pins nothing new."""
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    experts = _experts(2, "fp4")
    monkeypatch.setenv("MOETIER_CPU_PIN", "1")
    assert pinned_cores(1) == [last] and pinned_cores(len(allowed) + 1) == allowed
    before = {core: _threads_on({core}) for core in (first, last)}
    tier = CpuExpertTier(0.4, threads=1)
    assert tier.pinned == [last]
    one = tier.submit(_job(experts)).result()
    assert _threads_on({last}) == before[last] + 1  # the worker
    tier.close()
    # The worker on the first core, its helper on the last: a helper inherits its creator's cores, so only its own
    # pinning moves it (on a machine of one core both are that core).
    wide = CpuExpertTier(0.4, threads=2)
    wide.pinned = [first, last]
    two = wide.submit(_job(experts)).result()
    after = {core: _threads_on({core}) for core in (first, last)}
    if first != last:
        assert after == {first: before[first] + 1, last: before[last] + 1}
    else:
        assert after[last] == before[last] + 2
    wide.close()
    for result in (one, two):
        assert isinstance(result.out, torch.Tensor) and torch.equal(result.out, _checked_run(_job(experts), "fp4"))
    monkeypatch.setenv("MOETIER_CPU_PIN", "0")
    unpinned = CpuExpertTier(0.4, threads=1)
    assert unpinned.pinned is None
    unpinned.submit(_job(experts)).result()
    assert _threads_on({last}) == before[last]
    unpinned.close()


def test_pin_settings_that_cannot_work_are_refused(monkeypatch):
    monkeypatch.setenv("MOETIER_CPU_PIN", "yes")
    with pytest.raises(ConfigError, match="MOETIER_CPU_PIN must be 0 or 1"):
        CpuExpertTier(0.4, threads=1)
    lib = cpu_experts.library()
    with pytest.raises(ValueError, match="cannot pin threads to cores"):
        lib.pin_threads([-1])
