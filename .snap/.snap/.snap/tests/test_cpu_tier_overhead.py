"""The CPU tier's cheap per-job path: experts the kernel checked once run unchecked while their tensors live
where they were, with the results of a fully checked call; anything swapped, moved or freed is checked again,
and ``MOETIER_CPU_KERNEL`` is still read on every job. Tiny experts, so each test takes well under a second.
"""

from __future__ import annotations

import gc

import pytest
import torch

from moetier.kernels import cpu_experts
from moetier.tiers import cpu_tier
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights

HIDDEN, INTER = 64, 32
FP4 = ExpertQuant(kind="fp4-block", tile=(1, 32))


@pytest.fixture(autouse=True)
def _kernel(monkeypatch):
    monkeypatch.delenv("MOETIER_CPU_KERNEL", raising=False)
    if not cpu_experts.available():
        pytest.skip("the tier does not use the C kernel here (no compiler, or a build it does not use)")


def _experts(count: int, fmt: str, seed: int = 0) -> list[ExpertWeights]:
    quant = FP4 if fmt == "fp4" else None
    layout = ExpertLayout((0,), num_experts=count, hidden_size=HIDDEN, intermediate_size=INTER, top_k=2, quant=quant)
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(count):
        if quant is None:
            block = (torch.randn(layout.block_numel, generator=gen) / HIDDEN**0.5).bfloat16()
        else:
            block = torch.randint(0, 256, (layout.block_numel,), dtype=torch.uint8, generator=gen)
        weights = ExpertWeights.from_block(block, layout)
        for scale in (weights.gate_scale, weights.up_scale, weights.down_scale) if quant else ():
            scale.copy_(2.0 ** torch.randint(-9, -5, scale.shape, generator=gen).float())
        out.append(weights)
    return out


def _job(experts: list[ExpertWeights], seed: int = 1) -> CpuJob:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, HIDDEN, generator=gen).bfloat16()
    groups = [CpuGroup(w, torch.tensor([i % 4, 3]), torch.rand(2, generator=gen) + 0.1) for i, w in enumerate(experts)]
    return CpuJob(hidden=hidden, groups=groups)


def _checked_run(job: CpuJob, fmt: str) -> torch.Tensor:
    """The library's own run (every expert checked), for comparison."""
    lib, groups = cpu_experts.library(), job.groups
    assert lib is not None
    rows, gates = [g.rows for g in groups], [g.gates for g in groups]
    if fmt == "fp4":
        return lib.run_fp4(job.hidden, [g.weights for g in groups], FP4.tile, rows, gates, 0.4, 1)
    return lib.run(
        job.hidden, [g.weights.gate_up for g in groups], [g.weights.down for g in groups], rows, gates, 0.4, 1
    )


def _count_checks(monkeypatch) -> list[int]:
    calls = [0]
    for name in ("_check_experts", "_check_quant_experts"):
        check = getattr(cpu_experts, name)

        def counted(*args, _check=check):
            calls[0] += 1
            return _check(*args)

        monkeypatch.setattr(cpu_experts, name, counted)
    return calls


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_experts_are_checked_once_and_give_the_checked_result(monkeypatch, fmt):
    calls = _count_checks(monkeypatch)
    experts = _experts(3, fmt)
    tier = CpuExpertTier(0.4, threads=1)
    first = tier.run(_job(experts))
    again = [tier.run(_job(experts[::-1], seed=s)) for s in (2, 3)]  # the same experts, other jobs and orders
    tier.close()
    assert calls[0] == 1  # the first job checked them; the next ones found them
    suffix = "-fp4" if fmt == "fp4" else ""
    assert {r.kernel for r in (first, *again)} == {f"c-{cpu_experts.kernel_isa()}{suffix}"}
    assert torch.equal(first.out, _checked_run(_job(experts), fmt))
    assert torch.equal(again[1].out, _checked_run(_job(experts[::-1], seed=3), fmt))


def test_a_swapped_or_moved_tensor_is_checked_again():
    experts = _experts(2, "bf16")
    tier = CpuExpertTier(0.4, threads=1)
    tier.run(_job(experts))
    w = experts[1]
    w.down = torch.zeros(HIDDEN, INTER // 2, dtype=torch.bfloat16)  # swapped for one of another shape
    with pytest.raises(ValueError, match="expert 1 has gate_up"):
        tier.run(_job(experts))
    w.down = torch.randn(HIDDEN, INTER)  # another dtype: the job is torch's, as before any check was remembered
    job = _job(experts)
    assert not tier._kernel_fits(job, torch.empty(job.hidden.shape))
    w.down = w.down.bfloat16()
    tier.run(_job(experts))
    w.down.set_(torch.zeros(HIDDEN, INTER - 2, dtype=torch.bfloat16))  # the same tensor, moved and reshaped
    with pytest.raises(ValueError, match="expert 1 has gate_up"):
        tier.run(_job(experts))
    w.down.set_(torch.randn(HIDDEN, INTER).bfloat16())  # moved, of the right shape: read where it is now
    ours = tier.run(_job(experts))
    tier.close()
    assert torch.equal(ours.out, _checked_run(_job(experts), "bf16"))


def test_experts_are_forgotten_when_their_tensors_die():
    gc.collect()
    before = len(cpu_tier._passed)
    experts = _experts(3, "fp4", seed=5)
    tier = CpuExpertTier(0.4, threads=1)
    tier.run(_job(experts))
    assert len(cpu_tier._passed) == before + 3
    experts[0].gate_scale = experts[0].gate_scale.clone()  # one tensor of an expert dies: its entry goes
    gc.collect()
    assert len(cpu_tier._passed) == before + 2
    del experts
    gc.collect()
    tier.close()
    assert len(cpu_tier._passed) == before


def test_the_environment_switch_is_read_on_every_job(monkeypatch):
    experts = _experts(2, "fp4", seed=7)
    tier = CpuExpertTier(0.4, threads=1)
    kernel = tier.run(_job(experts)).kernel
    monkeypatch.setenv("MOETIER_CPU_KERNEL", "0")
    off = tier.run(_job(experts))
    torch_tier = CpuExpertTier(0.4, threads=1, use_kernel=False)
    assert off.kernel == "torch" and torch.equal(off.out, torch_tier.run(_job(experts)).out)
    monkeypatch.delenv("MOETIER_CPU_KERNEL")
    assert tier.run(_job(experts)).kernel == kernel != "torch"
    tier.close()
    torch_tier.close()


@pytest.mark.parametrize("pairs", [2, 300])  # the list path of decode's few pairs, and torch's past 256
def test_rows_and_gates_of_other_dtypes_and_shapes_pack_alike(pairs):
    lib = cpu_experts.library()
    assert lib is not None
    experts = _experts(2, "bf16", seed=9)
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(8, HIDDEN, generator=gen).bfloat16()
    rows = [torch.randint(0, 8, (pairs,), generator=gen) for _ in experts]
    gates = [torch.rand(pairs, generator=gen, dtype=torch.float64) for _ in experts]
    weights = ([w.gate_up for w in experts], [w.down for w in experts])

    def run(rows, gates):
        return lib.run(hidden, *weights, rows, gates, None, 1)

    reference = run(rows, [g.float() for g in gates])
    assert torch.equal(run([r.int() for r in rows], gates), reference)  # int32 rows, float64 gates rounded once
    assert torch.equal(run([r[:, None] for r in rows], [g.float()[None] for g in gates]), reference)  # 2-d
    bf16 = [g.bfloat16() for g in gates]
    assert torch.equal(run(rows, bf16), run(rows, [g.float() for g in bf16]))
    with pytest.raises(ValueError, match="one gate per row"):
        run(rows, [gates[0], gates[1][1:]])
