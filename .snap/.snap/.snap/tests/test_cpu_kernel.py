"""The CPU tier's C kernel (moetier/kernels/cpu_experts.c) against torch's bf16 experts and an fp64 reference.

Every SIMD path this compiler can build on this host is checked (AVX512_BF16, AVX-512F, AVX2, portable:
the narrower ones by building with -mno-... flags; such a build must report its own ISA where the CPU has
it, and is skipped where the CPU has not, as it would be another path's build), on jobs with several
experts of 1, 3, 6 and 8 tokens sharing rows, sizes that are and are not multiples of the vector width,
with and without the clamp, at 1, 2 and 3 threads. Bars: relative RMS error < 0.005 against torch bf16
(issue 4), and against fp64 no worse than torch bf16's own error by more than 25%. Skipped only when
there is no C compiler.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moetier.cli import main
from moetier.kernels import cpu_build, cpu_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights, swiglu_expert
from moetier.weights.fp4 import dequantize_fp4, scale_to_float
from moetier.weights.fp8 import dequantize_blocks

BF16_BAR = 0.005  # kernel vs torch bf16, relative RMS
FP64_FACTOR = 1.25  # kernel's error vs fp64 may exceed torch bf16's by this factor at most
VARIANTS = {
    "default": (),
    # AVX512-BF16 without VBMI: its fp4 tiles in the natural order (with VBMI, as the default build on such
    # a CPU, they are read shuffled: cpu_experts_fp4.c)
    "avx512_bf16": ("-mno-avx512vbmi",),
    "avx512f": ("-mno-avx512bf16",),
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx512f", "-mno-avx2"),
}
# The CPU flags (/proc/cpuinfo) under which a narrowed build must report the ISA it is named after.
VARIANT_NEEDS = {"avx512_bf16": {"avx512_bf16"}, "avx512f": {"avx512f"}, "avx2": {"avx2", "fma"}, "portable": set()}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {f for line in lines if line.startswith("flags") for f in line.partition(":")[2].split()}


@pytest.fixture(autouse=True)
def _kernel_enabled(monkeypatch):
    monkeypatch.delenv("MOETIER_CPU_KERNEL", raising=False)


def _require_compiler() -> None:
    try:
        cpu_build.compiler()
    except RuntimeError as exc:
        pytest.skip(f"no C compiler: {exc}")


def _library(variant: str = "default") -> cpu_experts.CpuExpertsLibrary:
    _require_compiler()
    if variant != "default" and X86 and (missing := VARIANT_NEEDS[variant] - _cpu_flags()):
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}: the {variant} build would be another path's")
    lib = cpu_experts.library(VARIANTS[variant])
    if lib is None and variant != "default" and not X86:
        pytest.skip(f"{VARIANTS[variant]} are x86 flags")
    assert lib is not None, "a C compiler exists, so the kernel must build (see the warning above)"
    if variant != "default":  # else a broken #if would test another path under this one's name
        assert lib.isa == variant, f"{VARIANTS[variant]} built {lib.isa}, not {variant}"
    return lib


def test_default_build_is_the_widest_path_of_this_cpu():
    """-march=native picks the widest SIMD path the CPU has; every x86 SIMD path is one the tier uses."""
    lib = _library()
    if not X86:
        pytest.skip("the SIMD paths are x86 ones")
    flags = _cpu_flags()
    widest = [isa for isa, needs in (("avx512_bf16", {"avx512_bf16"}), ("avx512f", {"avx512f"}),
                                     ("avx2", {"avx2", "fma"})) if needs <= flags]  # fmt: skip
    assert lib.isa == (widest[0] if widest else "portable")
    assert cpu_experts.available() == (lib.isa != "portable")


def _experts(count: int, hidden: int, inter: int, seed: int) -> tuple[ExpertLayout, list[ExpertWeights]]:
    layout = ExpertLayout((0,), num_experts=count, hidden_size=hidden, intermediate_size=inter, top_k=1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        gate_up = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
        down = torch.randn(hidden, inter, generator=gen) / inter**0.5
        block = torch.cat([gate_up.reshape(-1), down.reshape(-1)]).to(torch.bfloat16)
        out.append(ExpertWeights.from_block(block, layout))
    return layout, out


def _job(hidden: int, inter: int, tokens: tuple[int, ...], seed: int = 0):
    """hidden [8, H] bf16 and one group per entry of ``tokens`` (each <= 8), sharing rows (5 is in every group)."""
    layout, experts = _experts(len(tokens), hidden, inter, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(8, hidden, generator=gen).to(torch.bfloat16)
    groups = []
    for weights, n in zip(experts, tokens, strict=True):
        rows = torch.cat([torch.tensor([5]), torch.randperm(8, generator=gen)[: n - 1]])  # may repeat row 5
        gates = torch.rand(n, generator=gen) + 0.1
        groups.append(CpuGroup(weights, rows, gates))
    return layout, x, groups


def _torch_bf16(x: torch.Tensor, groups: list[CpuGroup], limit: float | None) -> torch.Tensor:
    out = torch.zeros(x.shape)
    for g in groups:
        out.index_add_(0, g.rows, swiglu_expert(x[g.rows], g.weights, limit).float() * g.gates[:, None])
    return out


def _fp64(x: torch.Tensor, groups: list[CpuGroup], layout: ExpertLayout, limit: float | None) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for g in groups:
        weights = ExpertWeights.from_block(g.weights.block.double(), layout)
        out.index_add_(0, g.rows, swiglu_expert(x[g.rows].double(), weights, limit) * g.gates.double()[:, None])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(lib: cpu_experts.CpuExpertsLibrary, x, groups, limit, threads, out=None) -> torch.Tensor:
    return lib.run(
        x,
        [g.weights.gate_up for g in groups],
        [g.weights.down for g in groups],
        [g.rows for g in groups],
        [g.gates for g in groups],
        limit,
        threads,
        out,
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("hidden,inter", [(256, 128), (200, 72), (97, 33)])
@pytest.mark.parametrize("limit", [None, 0.4])
def test_kernel_matches_torch_bf16_and_fp64(variant, hidden, inter, limit):
    lib = _library(variant)
    layout, x, groups = _job(hidden, inter, tokens=(1, 3, 8, 6), seed=hidden + inter)
    torch_out, exact = _torch_bf16(x, groups, limit), _fp64(x, groups, layout, limit)
    ours = _run(lib, x, groups, limit, threads=2)
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert _rel(ours, torch_out) < BF16_BAR, lib.isa
    assert _rel(ours, exact) <= FP64_FACTOR * _rel(torch_out, exact), lib.isa
    if limit is not None:  # the clamp is active on these values: a kernel ignoring it would fail above
        assert _rel(_torch_bf16(x, groups, None), torch_out) > 20 * BF16_BAR


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_result_does_not_depend_on_the_thread_count(variant):
    lib = _library(variant)
    _, x, groups = _job(200, 72, tokens=(8, 1, 3), seed=3)
    one = _run(lib, x, groups, None, threads=1)
    assert torch.equal(_run(lib, x, groups, None, threads=2), one)
    assert torch.equal(_run(lib, x, groups, None, threads=3), one)  # uneven shares, more threads than cores


def test_helpers_that_never_come_change_nothing():
    """A job is done when its chunks are, whichever threads took them: built with its odd helpers always absent
    (as if always late), the team gives the same sums; chunks of 16 units and 32 columns split these experts
    (72 units, 200 columns) unevenly."""
    lib = _library()
    absent = cpu_experts.library(("-DMOETIER_TEAM_ODD_HELPERS_ABSENT=1",))
    assert absent is not None
    _, x, groups = _job(200, 72, tokens=(8, 1, 3, 2), seed=9)
    x4, groups4, _ = _fp4_job(224, 96, (1, 32), tokens=(3, 1, 2), seed=29)
    for threads in (2, 3, 4):
        assert torch.equal(_run(absent, x, groups, 0.4, threads), _run(lib, x, groups, 0.4, threads))
        assert torch.equal(_run_fp4(absent, x4, groups4, None, threads), _run_fp4(lib, x4, groups4, None, threads))


def test_many_threads_run_their_own_teams_at_once():
    """Each calling thread owns a team: jobs from several threads at once (and a thread count that grows) give
    the bits of the same jobs run one at a time."""
    lib = _library()
    jobs = [_job(200, 72, tokens=(8, 1, 3), seed=s) for s in range(6)]
    alone = [_run(lib, x, groups, None, threads=1 + s % 3) for s, (_, x, groups) in enumerate(jobs)]
    results: dict[int, torch.Tensor] = {}

    def run(s: int) -> None:
        _, x, groups = jobs[s]
        for _ in range(3):
            results[s] = _run(lib, x, groups, None, threads=1 + s % 3)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[s], alone[s]) for s in range(len(jobs)))


@pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc/self/task").is_dir(), reason="needs fork and /proc")
def test_a_forked_child_runs_jobs_with_a_team_of_its_own():
    """The child of a thread whose team exists has none of its helpers: it starts a team of its own (its thread
    count grows by the helpers) rather than run every job alone on the parent's record, and gets the same sums."""
    lib = _library()
    _, x, groups = _job(200, 72, tokens=(8, 1, 3), seed=3)
    parent = _run(lib, x, groups, None, threads=3)  # this thread's team now exists
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status only
        code = 3
        try:
            before = len(os.listdir("/proc/self/task"))
            same = torch.equal(_run(lib, x, groups, None, threads=3), parent)
            code = 0 if same and len(os.listdir("/proc/self/task")) >= before + 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_out_is_overwritten_and_untouched_rows_are_zero():
    lib = _library()
    _, x, groups = _job(256, 128, tokens=(1, 3), seed=4)
    touched = torch.unique(torch.cat([g.rows for g in groups]))
    assert touched.numel() < 8
    out = torch.full(x.shape, 7.0)
    assert _run(lib, x, groups, None, threads=2, out=out) is out
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[touched] = False
    assert torch.all(out[untouched] == 0) and torch.all(out[touched].abs().sum(-1) > 0)
    assert _rel(out, _torch_bf16(x, groups, None)) < BF16_BAR


def test_bad_inputs_raise_clear_errors():
    lib = _library()
    _, x, groups = _job(256, 128, tokens=(3,), seed=5)
    g = groups[0]
    args = ([g.weights.gate_up], [g.weights.down], [g.rows], [g.gates], None, 1)
    with pytest.raises(ValueError, match="hidden must be a contiguous 2-d torch.bfloat16"):
        lib.run(x.float(), *args)
    with pytest.raises(ValueError, match="gate_up\\[0\\] must be a contiguous"):
        lib.run(x, [g.weights.gate_up.t()], *args[1:])
    with pytest.raises(ValueError, match="expert 0 has gate_up"):
        lib.run(x, [g.weights.gate_up[:10]], *args[1:])
    with pytest.raises(ValueError, match="row index out of range"):
        lib.run(x, args[0], args[1], [torch.tensor([0, 8, 1])], *args[3:])
    with pytest.raises(ValueError, match="one gate per row"):
        lib.run(x, args[0], args[1], args[2], [g.gates[:2]], *args[4:])
    with pytest.raises(ValueError, match="out has shape"):
        lib.run(x, *args, out=torch.empty(3, 256))


def test_disabled_by_the_environment(monkeypatch):
    _require_compiler()
    monkeypatch.setenv("MOETIER_CPU_KERNEL", "0")
    assert not cpu_experts.available() and cpu_experts.library() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_experts.run_experts(torch.empty(1, 32, dtype=torch.bfloat16), [], [], [], [], None, 1)
    _, x, groups = _job(256, 128, tokens=(1, 3), seed=6)
    tier = CpuExpertTier(None, threads=2)
    result = tier.run(CpuJob(hidden=x, groups=groups))
    tier.close()
    assert result.kernel == "torch" and tier.last_kernel == "torch"
    assert torch.equal(result.out, _torch_bf16(x, groups, None))


def test_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    flags = ("-DMOETIER_TEST_BROKEN_COMPILER=1",)
    monkeypatch.delitem(cpu_experts._built, flags, raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_experts.__name__):
        assert cpu_experts.library(flags) is None
        assert cpu_experts.library(flags) is None  # cached: no second build, no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "false failed" in warnings[0].getMessage()
    assert not list(tmp_path.rglob("*.tmp"))  # the failed build left nothing behind
    cpu_experts._built.pop(flags, None)


def test_the_build_key_covers_every_file_the_source_includes():
    """A part #included by the kernel but missing from cpu_build.INCLUDED would leave a stale build cached."""
    sources = [cpu_build.SOURCE, *cpu_build.INCLUDED]
    quoted = {
        line.split('"')[1]
        for path in sources
        for line in path.read_text().splitlines()
        if line.startswith('#include "')
    }
    assert quoted == {path.name for path in cpu_build.INCLUDED}


def test_build_is_cached_and_concurrent_builds_are_safe(monkeypatch, tmp_path):
    _require_compiler()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    paths: list = []
    threads = [threading.Thread(target=lambda: paths.append(cpu_experts.build())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].parent == tmp_path / "moetier" / "kernels"
    stamp = paths[0].stat().st_mtime_ns
    assert cpu_experts.build() == paths[0] and paths[0].stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [paths[0].name]  # no temporary left
    assert cpu_experts.CpuExpertsLibrary(paths[0]).isa in ("avx512_bf16", "avx512f", "avx2", "portable")


def test_tier_uses_the_kernel_for_bf16_and_torch_for_fp32():
    lib = _library()
    if lib.isa not in cpu_experts.FAST_ISAS:
        pytest.skip(f"the tier uses the {lib.isa} build only with MOETIER_CPU_KERNEL=1")
    _, x, groups = _job(256, 128, tokens=(1, 3, 8), seed=7)
    done = []
    tier, torch_tier = CpuExpertTier(0.4, threads=2), CpuExpertTier(0.4, threads=2, use_kernel=False)
    ours = tier.submit(CpuJob(hidden=x, groups=groups, on_done=lambda: done.append(1))).result()
    reference = torch_tier.run(CpuJob(hidden=x, groups=groups))
    assert ours.kernel == f"c-{lib.isa}" and reference.kernel == "torch" and done == [1]
    assert ours.pairs == reference.pairs == 12
    assert _rel(ours.out, reference.out) < BF16_BAR
    # fp32 experts (the test models) stay on torch, exactly.
    layout, experts = _experts(2, 64, 32, seed=8)
    fp32_groups = [
        CpuGroup(ExpertWeights.from_block(w.block.float(), layout), torch.tensor([0, 2]), torch.rand(2))
        for w in experts
    ]
    x32 = torch.randn(3, 64)
    result = tier.run(CpuJob(hidden=x32, groups=fp32_groups))
    tier.close()
    torch_tier.close()
    assert result.kernel == "torch" and torch.equal(result.out, _torch_bf16(x32, fp32_groups, 0.4))


def _bench_receipt(tmp_path, *extra: str) -> dict:
    argv = ["bench", "cpu-tier", "--experts", "4", "--hidden", "256", "--intermediate", "128", "--top-k", "2"]
    argv += ["--tokens", "1,3", "--threads", "1,2", "--jobs", "3", "--out", str(tmp_path), *extra]
    assert main(argv) == 0
    return json.loads(next(tmp_path.glob("cpu-tier-*.json")).read_text())


def test_bench_cpu_tier_quick(tmp_path):
    _require_compiler()
    receipt = _bench_receipt(tmp_path)
    rows = receipt["results"]
    assert {(r["path"], r["threads"], r["tokens"]) for r in rows} == {
        (p, t, n) for p in ("torch", "c") for t in (1, 2) for n in (1, 3)
    }
    assert all(r["ms_per_job"]["median"] > 0 and r["gbps"] > 0 for r in rows)
    # the c rows ran the C kernel, named by its ISA (not a torch fallback under the c label)
    isa = receipt["kernel_isa"]
    assert isa == cpu_experts.kernel_isa() and receipt["kernel_default"] == (isa in cpu_experts.FAST_ISAS)
    assert {r["kernel"] for r in rows if r["path"] == "c"} == {f"c-{isa}"}
    assert {r["kernel"] for r in rows if r["path"] == "torch"} == {"torch"}
    assert list(receipt["formats"]) == ["bf16"] and {r["format"] for r in rows} == {"bf16"}
    assert receipt["formats"]["bf16"]["expert_bytes"] == 3 * 256 * 128 * 2
    assert all(r["job_bytes"] == 2 * 3 * 256 * 128 * 2 for r in rows)
    assert receipt["max_rel_err_vs_torch"] < BF16_BAR
    assert f"| bf16 | c | c-{isa} |" in next(tmp_path.glob("cpu-tier-*.md")).read_text()


def test_bench_cpu_tier_measures_fp8_and_fp4_experts_as_stored(tmp_path):
    _require_compiler()
    receipt = _bench_receipt(tmp_path, "--formats", "fp8,fp4", "--tokens", "1", "--threads", "2")
    isa, rows = receipt["kernel_isa"], receipt["results"]
    assert [(r["format"], r["kernel"]) for r in rows] == [
        ("fp8", "torch"), ("fp8", f"c-{isa}-fp8"), ("fp4", "torch"), ("fp4", f"c-{isa}-fp4"),
    ]  # fmt: skip
    values = 3 * 256 * 128
    # the bytes a job reads are the stored block: values + float32 scales (+ 64-byte alignment of each part)
    fp8, fp4 = receipt["formats"]["fp8"], receipt["formats"]["fp4"]
    assert fp8["expert_bytes"] == values + 3 * 64  # scale grids of 1x2, 1x2 and 2x1, each padded to a line
    assert fp4["expert_bytes"] == values // 2 + values // 32 * 4
    assert all(r["job_bytes"] == 2 * receipt["formats"][r["format"]]["expert_bytes"] for r in rows)
    assert all(f["max_rel_err_vs_torch"] < BF16_BAR for f in (fp8, fp4))
    assert f"| fp4 | c | c-{isa}-fp4 |" in next(tmp_path.glob("cpu-tier-*.md")).read_text()


def test_bench_measures_a_build_the_tier_does_not_use_by_default(tmp_path, monkeypatch):
    """As for a portable build: the bench is what decides whether a build beats torch, so it runs it anyway."""
    _require_compiler()
    monkeypatch.setattr(cpu_experts, "FAST_ISAS", ())
    assert not cpu_experts.available()  # the tier alone would run torch
    receipt = _bench_receipt(tmp_path, "--tokens", "1", "--threads", "1")
    isa = cpu_experts.kernel_isa()
    assert [r["kernel"] for r in receipt["results"]] == ["torch", f"c-{isa}"] and not receipt["kernel_default"]
    assert receipt["max_rel_err_vs_torch"] < BF16_BAR
    assert any(f"does not use the {isa} build by default" in note for note in receipt["notes"])
    assert cpu_experts.mode() == "auto" and not cpu_experts.available()  # MOETIER_CPU_KERNEL was put back


def test_bench_without_the_kernel_measures_torch_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETIER_CPU_KERNEL", "0")
    receipt = _bench_receipt(tmp_path, "--tokens", "1", "--threads", "1")
    assert [r["path"] for r in receipt["results"]] == ["torch"] and receipt["kernel_isa"] is None
    assert receipt["max_rel_err_vs_torch"] is None
    assert any("C kernel unavailable" in note for note in receipt["notes"])


# --- float8 e4m3fn experts ------------------------------------------------------------------------------

E4M3_NAN = (0x7F, 0xFF)


def _fill_fp8(q: torch.Tensor, scale: torch.Tensor, gen: torch.Generator) -> None:
    """Random e4m3fn codes (NaN codes moved to the largest finite ones) and positive scales sized so the
    projections come out near unit scale (random codes have an RMS near 150)."""
    codes = torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=gen)
    if q.dtype == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] -= 1
    else:  # e5m2: the top exponent bit cleared keeps every code finite
        codes &= 0xBF
    q.view(torch.uint8).copy_(codes)
    scale.copy_((torch.rand(scale.shape, generator=gen) + 0.5) / (150 * q.shape[1] ** 0.5))


def _quant_experts(count, hidden, inter, quant, fill, seed):
    """``count`` random experts stored as ``quant`` describes, their values and scales drawn by ``fill``."""
    layout = ExpertLayout((0,), num_experts=count, hidden_size=hidden, intermediate_size=inter, top_k=1, quant=quant)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        w = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
        for name in ("gate", "up", "down"):
            fill(getattr(w, f"{name}_q"), getattr(w, f"{name}_scale"), gen)
        out.append(w)
    return out


def _quant_job(experts, hidden, inter, tokens, seed):
    """As _job, with the quantised ``experts``; also returns the same groups on the experts dequantised to bf16."""
    _, x, dense = _job(hidden, inter, tokens, seed)
    groups = [CpuGroup(w, g.rows, g.gates) for w, g in zip(experts, dense, strict=True)]
    dequantised = [
        CpuGroup(w.dequantized(torch.bfloat16), g.rows, g.gates) for w, g in zip(experts, dense, strict=True)
    ]
    return x, groups, dequantised


def _run_quant(lib, name, x, groups, limit, threads, out=None):
    """``lib.run_fp8`` or ``lib.run_fp4`` (``name``) on ``groups``."""
    run = getattr(lib, f"run_{name}")
    return run(x, [g.weights for g in groups], groups[0].weights.tile, [g.rows for g in groups],
               [g.gates for g in groups], limit, threads, out)  # fmt: skip


def _fp8_experts(count, hidden, inter, tile, seed, fp8=torch.float8_e4m3fn):
    return _quant_experts(count, hidden, inter, ExpertQuant(tile=tile, fp8=fp8), _fill_fp8, seed)


def _fp8_job(hidden, inter, tile, tokens, seed=0):
    return _quant_job(_fp8_experts(len(tokens), hidden, inter, tile, seed), hidden, inter, tokens, seed)


def _run_fp8(lib, x, groups, limit, threads, out=None):
    return _run_quant(lib, "fp8", x, groups, limit, threads, out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_e4m3_decode_is_exact_for_every_code(variant):
    lib = _library(variant)
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()
    ours = lib.decode_e4m3(codes)
    finite = ~expected.isnan()
    assert torch.isnan(ours[~finite]).all() and (~finite).sum() == 2  # 0x7f and 0xff
    # bit equality on the rest: this also checks the sign of zero (0x80 is -0.0)
    assert torch.equal(ours[finite].view(torch.int32), expected[finite].view(torch.int32)), lib.isa
    tail = lib.decode_e4m3(codes[:21])  # the scalar tail after one vector
    assert torch.equal(tail.view(torch.int32), ours[:21].view(torch.int32))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tile", [(128, 128), (32, 32)])
@pytest.mark.parametrize("limit", [None, 0.4])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_path_equals_bf16_path_on_dequantised_weights(variant, tile, limit, threads):
    lib = _library(variant)
    x, groups, dequantised = _fp8_job(200, 72, tile, tokens=(1, 3, 8), seed=tile[0] + threads)
    ours = _run_fp8(lib, x, groups, limit, threads)
    assert torch.equal(ours, _run(lib, x, dequantised, limit, threads)), lib.isa
    assert _rel(ours, _torch_bf16(x, groups, limit)) < BF16_BAR, lib.isa
    if limit is not None:  # the clamp is active on these values
        assert _rel(_torch_bf16(x, groups, None), _torch_bf16(x, groups, limit)) > 20 * BF16_BAR


def test_fp8_bad_inputs_raise_clear_errors():
    lib = _library()
    x, groups, _ = _fp8_job(200, 72, (128, 128), tokens=(3,), seed=9)
    g = groups[0]
    args = ([g.rows], [g.gates], None, 1)
    with pytest.raises(ValueError, match="tile must be two positive integers"):
        lib.run_fp8(x, [g.weights], (0, 128), *args)
    with pytest.raises(ValueError, match="expert 0 has gate_q .* expected"):
        lib.run_fp8(x, [g.weights], (64, 128), *args)  # the scale grids are for 128 x 128 tiles
    e5m2 = _fp8_experts(1, 200, 72, (128, 128), seed=9, fp8=torch.float8_e5m2)
    with pytest.raises(ValueError, match="gate_q must be a contiguous 2-d torch.float8_e4m3fn"):
        lib.run_fp8(x, e5m2, (128, 128), *args)
    dense = _experts(1, 200, 72, seed=9)[1]
    with pytest.raises(ValueError, match="not quantised"):
        lib.run_fp8(x, dense, (128, 128), *args)
    with pytest.raises(ValueError, match="row index out of range"):
        lib.run_fp8(x, [g.weights], (128, 128), [torch.tensor([0, 8, 1])], *args[1:])


def test_tier_uses_the_kernel_for_fp8_e4m3_experts_and_torch_for_e5m2():
    lib = _library()
    if lib.isa not in cpu_experts.FAST_ISAS:
        pytest.skip(f"the tier uses the {lib.isa} build only with MOETIER_CPU_KERNEL=1")
    x, groups, dequantised = _fp8_job(200, 72, (128, 128), tokens=(1, 3, 8), seed=11)
    tier = CpuExpertTier(0.4, threads=2)
    ours = tier.run(CpuJob(hidden=x, groups=groups))
    bf16 = tier.run(CpuJob(hidden=x, groups=dequantised))
    assert ours.kernel == f"c-{lib.isa}-fp8" and bf16.kernel == f"c-{lib.isa}"
    assert torch.equal(ours.out, bf16.out)
    assert _rel(ours.out, _torch_bf16(x, groups, 0.4)) < BF16_BAR
    e5m2 = [
        CpuGroup(w, g.rows, g.gates)
        for w, g in zip(_fp8_experts(3, 200, 72, (128, 128), 12, torch.float8_e5m2), groups, strict=True)
    ]
    result = tier.run(CpuJob(hidden=x, groups=e5m2))
    mixed = tier.run(CpuJob(hidden=x, groups=[groups[0], dequantised[1]]))
    tier.close()
    assert result.kernel == "torch" and torch.equal(result.out, _torch_bf16(x, e5m2, 0.4))
    assert mixed.kernel == "torch"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp8_tiles_outside_the_fast_scale_range_stay_exact(variant):
    """Scales whose products are subnormal (or the scale itself is), or large, take the exact integer path."""
    lib = _library(variant)
    x, groups, _ = _fp8_job(200, 72, (32, 32), tokens=(1, 3), seed=13)
    w = groups[0].weights
    w.gate_scale[0, 0], w.gate_scale[1, 2] = 2.0**-130, 2.0**-120
    w.up_scale[0, -1], w.down_scale[-1, 0] = 300.0, -(2.0**-118)
    w.gate_scale[2, 0] = 300.0  # a whole 32-column tile: 300 * 2^120 overflows, the fast path must not take it
    dequantised = [CpuGroup(g.weights.dequantized(torch.bfloat16), g.rows, g.gates) for g in groups]
    assert (dequantised[0].weights.gate_up[:32, :32].view(torch.int16) & 0x7F80 == 0).any()  # subnormal bf16
    ours = _run_fp8(lib, x, groups, None, threads=2)
    assert torch.equal(ours, _run(lib, x, dequantised, None, threads=2)), lib.isa
    # The dot products flush subnormal bf16 weights, so compare the dequantised rows themselves, bit for bit.
    for name in ("gate", "up", "down"):
        q, scale = getattr(w, f"{name}_q"), getattr(w, f"{name}_scale")
        theirs = dequantize_blocks(q, scale, w.tile, torch.bfloat16)
        assert torch.equal(lib.dequantize_e4m3(q, scale, w.tile).view(torch.int16), theirs.view(torch.int16)), name


# --- packed fp4 (e2m1) experts --------------------------------------------------------------------------

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Scales for the all-codes check: the identity, powers of two (the release's ue8m0), ones that make the
# products round (not powers of two), negative ones, ones whose products are bf16 or fp32 subnormals, ones
# whose products overflow bf16 (inf) or fp32, and non-finite ones (the kernel's scalar path takes those).
SPECIAL_SCALES = (1.0, 2.0**-10, 2.0**7, 0.3, 1 / 3, -1.7, -(2.0**-5), 2.0**-130, 2.0**-140, 2.0**-149, 1e38, 3e38)
NON_FINITE = (float("inf"), -float("inf"), float("nan"))
# (tile, hidden, intermediate): the release's (1, 32); tiles of 8 (scalar tails only) and 48 (32 + 16 values).
FP4_SHAPES = [((1, 32), 224, 96), ((2, 8), 200, 72), ((1, 48), 240, 96)]


def _fill_fp4(q: torch.Tensor, scale: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (all 16 codes in both nibbles) and positive scales, not powers of two, that bring the
    projections near unit scale (random codes have an RMS near 2.9)."""
    q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=gen))
    scale.copy_((torch.rand(scale.shape, generator=gen) + 0.5) / (3 * (2 * q.shape[1]) ** 0.5))


def _fp4_experts(count, hidden, inter, tile, seed):
    return _quant_experts(count, hidden, inter, ExpertQuant(kind="fp4-block", tile=tile), _fill_fp4, seed)


def _fp4_job(hidden, inter, tile, tokens, seed=0):
    return _quant_job(_fp4_experts(len(tokens), hidden, inter, tile, seed), hidden, inter, tokens, seed)


def _run_fp4(lib, x, groups, limit, threads, out=None):
    return _run_quant(lib, "fp4", x, groups, limit, threads, out)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_e2m1_decode_is_exact_for_every_code(variant):
    """Scale 1: the kernel's bf16 of each code in either nibble is the e2m1 value (sign of zero included)."""
    lib = _library(variant)
    codes = torch.arange(256, dtype=torch.uint8).view(1, 256)  # low nibble = value 2j, high = 2j + 1
    ours = lib.dequantize_e2m1(codes, torch.ones(1, 16), (1, 32))
    table, byte = torch.tensor(E2M1_VALUES).to(torch.bfloat16), torch.arange(256)
    expected = torch.stack([table[byte & 0xF], table[byte >> 4]], dim=-1).view(1, 512)
    assert _same_bits(ours, expected), lib.isa
    assert ours[0, 16].item() == 0.0 and str(ours[0, 16].item()) == "-0.0"  # byte 8's low nibble: code 8


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tile", [(1, 32), (2, 24), (1, 48), (3, 6), (4, 16)])
def test_e2m1_dequantize_equals_dequantize_fp4_for_every_code_and_scale(variant, tile):
    """Every byte (so every code in both nibble positions) under every special scale, bit for bit; tile widths
    that take the 32-value tile loop, the 32- and 16-value vector steps and the scalar tail."""
    lib = _library(variant)
    rows, cols = 12, 1536  # each row: all 256 bytes three times
    q = torch.arange(rows * cols // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(rows, cols // 2)
    grid = (rows // tile[0], cols // tile[1])
    scales = SPECIAL_SCALES + NON_FINITE
    scale = torch.tensor(scales)[torch.randint(0, len(scales), grid, generator=torch.Generator().manual_seed(tile[1]))]
    scale[0, 0], scale[-1, -1] = SPECIAL_SCALES[0], SPECIAL_SCALES[-1]
    theirs = dequantize_fp4(q, scale, torch.bfloat16)
    ours = lib.dequantize_e2m1(q, scale, tile)
    exponent = theirs.view(torch.int16) & 0x7F80
    assert (exponent == 0).any() and (exponent == 0x7F80).any()  # the check sees subnormals and infinities
    # NaN products (NaN scales, 0 * inf) stay NaN; their payload is torch's cast's own, so not compared
    nan = theirs.isnan()
    assert nan.any() and torch.equal(ours.isnan(), nan), lib.isa
    assert _same_bits(ours[~nan], theirs[~nan]), lib.isa


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tile,hidden,inter", FP4_SHAPES)
@pytest.mark.parametrize("limit", [None, 0.4])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp4_path_equals_bf16_path_on_dequantised_weights(variant, tile, hidden, inter, limit, threads):
    lib = _library(variant)
    x, groups, dequantised = _fp4_job(hidden, inter, tile, tokens=(1, 3, 8), seed=tile[1] + threads)
    ours = _run_fp4(lib, x, groups, limit, threads)
    assert torch.equal(ours, _run(lib, x, dequantised, limit, threads)), lib.isa
    assert _rel(ours, _torch_bf16(x, groups, limit)) < BF16_BAR, lib.isa
    if limit is not None:  # the clamp is active on these values
        assert _rel(_torch_bf16(x, groups, None), _torch_bf16(x, groups, limit)) > 20 * BF16_BAR


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp4_power_of_two_and_special_scales_stay_exact(variant):
    """The release's ue8m0 scales (powers of two), and tiles whose products are subnormal or huge."""
    lib = _library(variant)
    x, groups, _ = _fp4_job(224, 96, (1, 32), tokens=(1, 3), seed=21)
    gen = torch.Generator().manual_seed(22)
    for g in groups:
        for name in ("gate", "up", "down"):
            scale = getattr(g.weights, f"{name}_scale")
            scale.copy_(2.0 ** torch.randint(-9, -5, scale.shape, generator=gen).float())
    w = groups[0].weights
    w.gate_scale[0, 0], w.up_scale[1, 2], w.down_scale[-1, 0] = 2.0**-130, 0.3e-3, -(2.0**-140)
    w.gate_scale[2, 1] = 2.0**120  # products up to 6 * 2^120, finite in fp32 and bf16
    dequantised = [CpuGroup(g.weights.dequantized(torch.bfloat16), g.rows, g.gates) for g in groups]
    ours = _run_fp4(lib, x, groups, None, threads=2)
    assert torch.equal(ours, _run(lib, x, dequantised, None, threads=2)), lib.isa


# The fused fp4 path (cpu_experts_fp4.c): 32-value tiles whose scale is +-2^k, k in [-125, 125], are decoded in
# registers; every other tile (and a partial last tile) from the first such one on goes through the row buffer.
# The scales below put tiles on both sides of that line, in rows where the two kinds mix. Gate/up columns of
# tiny or huge scales meet hidden columns scaled the other way, so their products count in the sums.
HUGE_EXPONENTS = (118, 122, 124, 125)
OVERFLOW_EXPONENTS = (126, 127)  # some products inf (buffer path)
TINY_EXPONENTS = (-149, -140, -134, -127, -126, -125, -120)  # below -125: subnormal products (buffer path)
ODD_SCALES = (0.0, 0.3 * 2.0**-6, -(2.0**-7), -0.3 * 2.0**-7)  # zero, not powers of two, a negative power of two
FUSED_SHAPES = [((1, 32), 544, 96), ((2, 32), 200, 72), ((3, 32), 98, 34)]  # 200, 72, 98, 34: a partial last tile


def _pow2(shape: tuple[int, ...], exponents, gen: torch.Generator) -> torch.Tensor:
    choice = torch.tensor(exponents)[torch.randint(0, len(exponents), shape, generator=gen)]
    return torch.ldexp(torch.ones(shape), choice)


def _extreme_fp4_job(lib, hidden, inter, tile, tokens, seed):
    """Random fp4 experts (SimpleNamespace QuantExperts: ExpertLayout wants tiles that divide the sizes) with
    power-of-two scales: per gate/up tile column a normal, huge or tiny class (the hidden columns of that tile
    scaled by the inverse), odd scales sprinkled in the normal columns, and in the down rows (whose inputs are
    the activations) a few overflowing tiles, which make only their own output columns inf or NaN. Returns
    hidden, the groups and the same groups on the experts dequantised by the kernel's row dequantisation."""
    _, x, dense = _job(hidden, inter, tokens, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    kinds = torch.arange(-(-hidden // 32)) % 3  # per tile column of gate/up: 0 normal, 1 huge, 2 tiny
    x_scale = torch.tensor((1.0, 2.0**-124, 2.0**118))[kinds].repeat_interleave(32)[:hidden]
    x = (x.float() * x_scale).bfloat16()
    groups, dequantised = [], []
    for g in dense:
        expert = SimpleNamespace(tile=tile)
        for name, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            grid = (-(-rows // tile[0]), -(-cols // tile[1]))
            value = _pow2(grid, range(-9, -4), gen)
            normal = torch.ones(grid, dtype=torch.bool)
            if name != "down":
                for t in kinds.nonzero().flatten().tolist():
                    value[:, t] = _pow2(value[:, t].shape, HUGE_EXPONENTS if kinds[t] == 1 else TINY_EXPONENTS, gen)
                normal = (kinds == 0).expand(grid)
            else:
                overflow = torch.rand(grid, generator=gen) < 0.01
                value[overflow] = _pow2((int(overflow.sum()),), OVERFLOW_EXPONENTS, gen)
            odd = (torch.rand(grid, generator=gen) < 0.1) & normal
            value[odd] = torch.tensor(ODD_SCALES)[torch.randint(0, len(ODD_SCALES), (int(odd.sum()),), generator=gen)]
            setattr(expert, f"{name}_q", torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen))
            setattr(expert, f"{name}_scale", value)
        deq = {n: lib.dequantize_e2m1(getattr(expert, f"{n}_q"), getattr(expert, f"{n}_scale"), tile) for n in
               ("gate", "up", "down")}  # fmt: skip
        bf16 = SimpleNamespace(gate_up=torch.cat([deq["gate"], deq["up"]]), down=deq["down"])
        groups.append(CpuGroup(expert, g.rows, g.gates))
        dequantised.append(CpuGroup(bf16, g.rows, g.gates))
    return x, groups, dequantised


def _same_outputs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN for NaN (a NaN's payload is the FMA's own: both paths take the same ones)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tile,hidden,inter", FUSED_SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fp4_fused_tiles_equal_bf16_path_at_every_scale(variant, tile, hidden, inter, threads):
    """Experts of 1-4 tokens take the fused path, of 8 (two token blocks) the row buffer; both must give the
    bf16 path's result on the dequantised experts, with huge, tiny, zero, negative and odd scales mixed."""
    lib = _library(variant)
    x, groups, dequantised = _extreme_fp4_job(lib, hidden, inter, tile, (1, 3, 4, 8, 2), seed=hidden + threads)
    ours = _run_fp4(lib, x, groups, None, threads)
    theirs = _run(lib, x, dequantised, None, threads)
    assert _same_outputs(ours, theirs), lib.isa
    assert ours.isfinite().float().mean() > 0.5  # the job is not all overflow
    for kind, exponent in (("huge", 125), ("tiny", -125)):  # the extreme fused tiles do move the result
        g = groups[0]
        column = 1 if kind == "huge" else 2
        saved = g.weights.gate_scale.clone()
        g.weights.gate_scale[:, column] = 2.0**exponent
        changed = _run_fp4(lib, x, groups, None, threads)
        g.weights.gate_scale.copy_(saved)
        assert not _same_outputs(changed, ours), kind


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp4_fused_path_stops_where_products_leave_the_normal_range(variant):
    """Every gate/up tile at scale +-2^k, the hidden values scaled by about 2^-k (within bf16's range), so the
    sums are the products'. Only k in [-125, 125] is fused: below, products are subnormal (past about -133 their
    bf16 rounds), above, some overflow; 17 tiles a row also take the 16-wide scale check of the AVX-512 builds."""
    lib = _library(variant)
    gen = torch.Generator().manual_seed(41)
    for k in (-136, -134, -133, -127, -126, -125, -124, 124, 125, 126):
        x, groups, dequantised = _extreme_fp4_job(lib, 544, 64, (1, 32), (1, 3), seed=40)
        magnitude = (torch.rand(x.shape, generator=gen) + 0.5) * 2.0 ** max(-126, min(126, -k - 3))
        x = (magnitude * torch.randn(x.shape, generator=gen).sign()).bfloat16()
        for g, d in zip(groups, dequantised, strict=True):
            w = g.weights
            for name in ("gate", "up"):
                scale = getattr(w, f"{name}_scale")
                scale.copy_(2.0**k * (torch.randint(0, 2, scale.shape, generator=gen) * 2.0 - 1))
            w.down_scale.copy_(_pow2(w.down_scale.shape, range(-9, -4), gen))
            deq = {
                n: lib.dequantize_e2m1(getattr(w, f"{n}_q"), getattr(w, f"{n}_scale"), (1, 32))
                for n in ("gate", "up", "down")
            }
            d.weights.gate_up, d.weights.down = torch.cat([deq["gate"], deq["up"]]), deq["down"]
        ours = _run_fp4(lib, x, groups, None, threads=2)
        assert _same_outputs(ours, _run(lib, x, dequantised, None, threads=2)), (lib.isa, k)
        # The products do count, down to subnormal weights, except on AVX512-BF16: its dot product instruction
        # takes subnormal bf16 inputs as zero (both paths alike, as the comparison above checked; the H200 host).
        lowest = -126 if lib.isa == "avx512_bf16" else -134
        if lowest <= k <= 125:
            touched = ours[torch.unique(torch.cat([g.rows for g in groups]))]
            assert touched.isfinite().all() and (touched != 0).float().mean() > 0.5, k


def test_fp4_fused_path_over_several_token_blocks():
    """Built to fuse experts of up to 16 tokens (two token blocks at 8): the same result again."""
    _library()
    lib = cpu_experts.library(("-DMOETIER_FP4_FUSED_TOKENS=16",))
    assert lib is not None
    x, groups, dequantised = _extreme_fp4_job(lib, 520, 96, (1, 32), (8, 6, 1), seed=31)
    for threads in (1, 2):
        ours = _run_fp4(lib, x, groups, 0.4, threads)
        assert _same_outputs(ours, _run(lib, x, dequantised, 0.4, threads))
        assert _same_outputs(ours, _run_fp4(_library(), x, groups, 0.4, threads))


def test_fp4_bad_inputs_raise_clear_errors():
    lib = _library()
    x, groups, _ = _fp4_job(224, 96, (1, 32), tokens=(3,), seed=23)
    g = groups[0]
    args = ([g.rows], [g.gates], None, 1)
    with pytest.raises(ValueError, match="tile columns must be even"):
        lib.run_fp4(x, [g.weights], (1, 31), *args)
    with pytest.raises(ValueError, match="expert 0 has gate_q .* expected"):
        lib.run_fp4(x, [g.weights], (1, 16), *args)  # the scale grids are for 32-value tiles
    fp8 = _fp8_experts(1, 224, 96, (128, 128), seed=23)
    with pytest.raises(ValueError, match="gate_q must be a contiguous 2-d torch.uint8"):
        lib.run_fp4(x, fp8, (128, 128), *args)
    with pytest.raises(ValueError, match="gate_q must be a contiguous 2-d torch.float8_e4m3fn"):
        lib.run_fp8(x, [g.weights], (1, 32), *args)
    with pytest.raises(ValueError, match="row index out of range"):
        lib.run_fp4(x, [g.weights], (1, 32), [torch.tensor([0, 8, 1])], *args[1:])
    with pytest.raises(ValueError, match="does not tile"):
        lib.dequantize_e2m1(g.weights.gate_q, g.weights.gate_scale, (2, 32))


def test_tier_uses_the_kernel_for_fp4_experts():
    lib = _library()
    if lib.isa not in cpu_experts.FAST_ISAS:
        pytest.skip(f"the tier uses the {lib.isa} build only with MOETIER_CPU_KERNEL=1")
    x, groups, dequantised = _fp4_job(224, 96, (1, 32), tokens=(1, 3, 8), seed=24)
    tier = CpuExpertTier(0.4, threads=2)
    ours = tier.run(CpuJob(hidden=x, groups=groups))
    assert ours.kernel == tier.last_kernel == f"c-{lib.isa}-fp4"
    bf16 = tier.run(CpuJob(hidden=x, groups=dequantised))
    assert bf16.kernel == f"c-{lib.isa}"
    assert torch.equal(ours.out, bf16.out)
    assert _rel(ours.out, _torch_bf16(x, groups, 0.4)) < BF16_BAR
    fp8 = _fp8_experts(1, 224, 96, (128, 128), seed=25)
    mixed = tier.run(CpuJob(hidden=x, groups=[groups[0], CpuGroup(fp8[0], groups[1].rows, groups[1].gates)]))
    tier.close()
    assert mixed.kernel == "torch"  # fp4 and fp8 experts in one job: no single kernel entry


def _fill_fp4_e8m0(q: torch.Tensor, scale: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes and exponent bytes near unit projections (2^-9 .. 2^-3)."""
    q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=gen))
    scale.copy_(torch.randint(118, 125, scale.shape, dtype=torch.uint8, generator=gen))


def _e8m0_and_float_experts(count, hidden, inter, seed):
    """The same fp4 experts twice: with e8m0 scale bytes, and with those scales widened to float32."""
    quant = ExpertQuant(kind="fp4-block", tile=(1, 32), pow2_scales=True, scale_format="e8m0")
    e8m0 = _quant_experts(count, hidden, inter, quant, _fill_fp4_e8m0, seed)
    for e in e8m0:  # the extremes: 2^-127 (subnormal) and 2^-126 in gate's first tiles, 2^127 in down's last row
        e.gate_scale.view(-1)[:2] = torch.tensor([0, 1], dtype=torch.uint8)  # (only that output column overflows)
        e.up_scale.view(-1)[9] = 0  # in a row's second AVX2 vector of bytes (or its first AVX-512 one, or its tail)
        e.down_scale[-1, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    wide = _quant_experts(count, hidden, inter, ExpertQuant(kind="fp4-block", tile=(1, 32), pow2_scales=True),
                          lambda q, s, g: None, seed)  # fmt: skip
    for e, w in zip(e8m0, wide, strict=True):
        for name in ("gate", "up", "down"):
            getattr(w, f"{name}_q").copy_(getattr(e, f"{name}_q"))
            getattr(w, f"{name}_scale").copy_(scale_to_float(getattr(e, f"{name}_scale")))
    return e8m0, wide


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("hidden, inter", [(256, 96), (864, 544)])  # rows of 8 / 3 tiles; 27 / 17: vectors + tails
def test_fp4_with_e8m0_scale_bytes_gives_the_float32_scales_bits(variant, hidden, inter):
    """A block keeping its scales as e8m0 bytes (a quarter of their bytes) computes what the same block with
    float32 scales does, bit for bit, on every path (fused 1-4 tokens, the row buffer past them), its rows' scale
    bytes widened a vector at a time and in the scalar tail."""
    lib = _library(variant)
    e8m0, wide = _e8m0_and_float_experts(3, hidden, inter, seed=41)
    for e, w in zip(e8m0, wide, strict=True):
        assert e.gate_scale.dtype == torch.uint8 and e.block.numel() < w.block.numel()
        assert torch.equal(e.dequantized(torch.bfloat16).block, w.dequantized(torch.bfloat16).block)
    _, x, dense = _job(hidden, inter, (1, 4, 7), seed=41)
    groups = [[CpuGroup(w, g.rows, g.gates) for w, g in zip(ws, dense, strict=True)] for ws in (e8m0, wide)]
    for threads in (1, 3):
        ours, reference = (_run_fp4(lib, x, g, 0.4, threads) for g in groups)
        assert _same_outputs(ours, reference), (lib.isa, threads)
        touched = ours[torch.unique(torch.cat([g.rows for g in groups[0]]))]
        assert touched[:, :-1].isfinite().all() and not touched[:, -1].isfinite().all()  # 2^127: that column


def test_the_tier_runs_e8m0_scale_bytes_on_the_kernel():
    """The CPU tier picks the kernel's e8m0 entry for such blocks (and reports it), with the float32 blocks' sums."""
    _library()
    e8m0, wide = _e8m0_and_float_experts(2, 256, 96, seed=43)
    _, x, dense = _job(256, 96, (2, 3), seed=43)
    tier = CpuExpertTier(0.4, threads=2)
    results = [
        tier.submit(CpuJob(x, [CpuGroup(w, g.rows, g.gates) for w, g in zip(ws, dense, strict=True)])).result()
        for ws in (e8m0, wide)
    ]
    tier.close()
    assert results[0].kernel.endswith("-fp4_e8m0") and results[1].kernel.endswith("-fp4")
    assert _same_outputs(results[0].out, results[1].out)
