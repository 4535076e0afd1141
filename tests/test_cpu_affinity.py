"""The CPU tier's threads are kept off the launching thread's core (moetier.tiers.cpu_affinity)."""

import os

import pytest
import torch

from moetier.tiers import cpu_affinity, cpu_tier
from moetier.tiers.cpu_affinity import core_siblings, parse_cpu_list, tier_cpus
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertWeights, swiglu_expert


def _fake_sysfs(tmp_path, siblings: dict[int, str]):
    for cpu, text in siblings.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0,8") == {0, 8}
    assert parse_cpu_list("0-3,8-9\n") == {0, 1, 2, 3, 8, 9}
    assert parse_cpu_list("5") == {5} and parse_cpu_list("") == set()


def test_the_first_cores_hardware_threads_are_left_out(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {0: "0,8", 2: "2-3"})
    assert core_siblings(0, sysfs) == {0, 8}
    assert core_siblings(7, sysfs) == {7}  # no topology: the CPU alone
    # 16 CPUs with hyper-threads (0 and 8 share a core): the tier gets the other 14.
    assert tier_cpus(set(range(16)), sysfs) == set(range(16)) - {0, 8}
    # The process's first CPU decides, whatever its number.
    assert tier_cpus({2, 3, 4, 5}, sysfs) == {4, 5}
    # Too few left: not pinned.
    assert tier_cpus({0, 1}, sysfs) is None and tier_cpus({2, 3, 4}, sysfs) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_workers_threads_run_on_the_tiers_cpus_and_jobs_still_compute(monkeypatch):
    first = min(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_tier, "tier_cpus", lambda: {first})
    tier = CpuExpertTier(None, threads=1, pin=True)
    try:
        assert tier.cpus == {first}
        assert tier._pool.submit(os.sched_getaffinity, 0).result() == {first}
        assert os.sched_getaffinity(0) != {first} or len(os.sched_getaffinity(0)) == 1  # the caller is not pinned
        generator = torch.Generator().manual_seed(0)
        layout = ExpertLayout(moe_layers=(0,), num_experts=1, hidden_size=8, intermediate_size=4, top_k=1)
        block = torch.randn(layout.block_numel, generator=generator)
        weights = ExpertWeights.from_block(block, layout)
        hidden = torch.randn(2, 8, generator=generator)
        job = CpuJob(hidden=hidden, groups=[CpuGroup(weights, torch.tensor([1]), torch.tensor([0.5]))])
        out = tier.submit(job).result().out
        assert torch.allclose(out[1], 0.5 * swiglu_expert(hidden[1:], weights, None)[0].float())
    finally:
        tier.close()


def test_more_threads_than_the_set_or_the_switch_off_leave_the_tier_unpinned(monkeypatch):
    monkeypatch.setattr(cpu_tier, "tier_cpus", lambda: {0, 1})
    tier = CpuExpertTier(None, threads=3, pin=True)
    assert tier.cpus is None
    tier.close()
    monkeypatch.setenv("MOETIER_CPU_TIER_PIN", "0")
    assert not cpu_affinity.pin_enabled()
    tier = CpuExpertTier(None, threads=1)
    assert tier.cpus is None
    tier.close()
