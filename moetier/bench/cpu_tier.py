"""``moetier bench cpu-tier``: the CPU expert tier alone, torch against the C kernel, on cold experts.

Random bf16 experts of a real shape (DeepSeek-V4-Flash by default: hidden 4096, intermediate 2048, so
~50 MB each) live in pinned memory when CUDA is present (as the home copy does), else plain memory.
Jobs of ``top_k`` experts x ``tokens`` rows go through :class:`CpuExpertTier` (its worker thread, as in
decode); job i takes the experts after job i-1's, cycling over all of them, so with more expert bytes
than the last-level cache every job reads its weights from DRAM. Reported per (path, threads, tokens):
ms per job and GB/s of expert bytes read (1e9 bytes/s); the receipt also records the host's read
bandwidth and how far the C kernel's output is from torch's on one job.

The "c" path measures the C kernel whenever it is built, whatever its ISA: this bench is what decides
whether a build beats torch (and so belongs in ``cpu_experts.FAST_ISAS``), so it must not apply the
tier's default choice. Its rows are labelled with the ISA (``kernel`` "c-avx2", ...), the receipt says
whether the tier would use that build by default, and a "c" job that did not run the kernel is an error.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.bench.bandwidth import host_read_gbps
from moetier.bench.common import parse_int_list, stats, write_receipt_files
from moetier.bench.environment import environment
from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertWeights

KIND = "cpu-tier"
PATHS = ("torch", "c")


def default_threads() -> list[int]:
    """4, 8 and 14 threads where the host has them, and all cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return sorted({t for t in (4, 8, 14) if t < cores} | {cores})


@dataclass
class CpuTierBenchConfig:
    experts: int = 64
    hidden: int = 4096
    intermediate: int = 2048
    top_k: int = 6
    tokens: list[int] = field(default_factory=lambda: [1, 4])
    threads: list[int] = field(default_factory=default_threads)
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    jobs: int = 20
    warmup: int = 2
    swiglu_limit: float | None = None
    seed: int = 0

    def validate(self) -> None:
        if min(self.experts, self.hidden, self.intermediate, self.top_k, self.jobs) < 1 or self.warmup < 0:
            raise ConfigError("--experts, --hidden, --intermediate, --top-k and --jobs must be >= 1")
        if self.top_k > self.experts:
            raise ConfigError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if unknown := set(self.paths) - set(PATHS):
            raise ConfigError(f"--paths must be a subset of {','.join(PATHS)}, got {sorted(unknown)}")


def make_experts(cfg: CpuTierBenchConfig) -> tuple[ExpertLayout, list[ExpertWeights]]:
    """``cfg.experts`` random bf16 expert blocks (pinned when CUDA is present), values of a real model's scale."""
    layout = ExpertLayout((0,), cfg.experts, cfg.hidden, cfg.intermediate, cfg.top_k, cfg.swiglu_limit)
    gen = torch.Generator().manual_seed(cfg.seed)
    pinned = torch.cuda.is_available()
    experts = []
    for _ in range(cfg.experts):
        block = torch.empty(layout.block_numel, dtype=torch.bfloat16, pin_memory=pinned)
        block.normal_(0.0, cfg.hidden**-0.5, generator=gen)
        experts.append(ExpertWeights.from_block(block, layout))
    return layout, experts


class JobMaker:
    """Jobs of ``top_k`` experts x ``tokens`` rows, each job's experts following the previous job's (cold)."""

    def __init__(self, cfg: CpuTierBenchConfig, experts: list[ExpertWeights]) -> None:
        self.cfg, self.experts, self.next = cfg, experts, 0
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)

    def job(self, tokens: int) -> CpuJob:
        hidden = torch.randn(tokens, self.cfg.hidden, generator=self.gen).to(torch.bfloat16)
        rows = torch.arange(tokens)
        groups = []
        for _ in range(self.cfg.top_k):
            gates = torch.rand(tokens, generator=self.gen)
            groups.append(CpuGroup(self.experts[self.next], rows, gates))
            self.next = (self.next + 1) % len(self.experts)
        return CpuJob(hidden=hidden, groups=groups)


@contextmanager
def any_kernel_build() -> Iterator[None]:
    """``MOETIER_CPU_KERNEL=1`` for the duration (put back after): the tier then runs the C kernel of any
    ISA, not only those of ``FAST_ISAS``. Left alone when it is "0" (the kernel is then not built at all)."""
    before = os.environ.get("MOETIER_CPU_KERNEL")
    if cpu_experts.mode() == "0":
        yield
        return
    os.environ["MOETIER_CPU_KERNEL"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MOETIER_CPU_KERNEL"]
        else:
            os.environ["MOETIER_CPU_KERNEL"] = before


def c_kernel_label() -> str:
    """The ``kernel`` a tier reports for a bf16 job on the C kernel (e.g. "c-avx2")."""
    return f"c-{cpu_experts.kernel_isa()}"


def _check_ran(path: str, kernels: set[str]) -> None:
    """A "c" measurement of anything but the C kernel (a silent torch fallback) must not be reported as one."""
    if path == "c" and kernels != {c_kernel_label()}:
        raise RuntimeError(f"the c path ran {sorted(kernels)}, not the C kernel ({c_kernel_label()})")


def time_path(maker: JobMaker, path: str, threads: int, tokens: int) -> dict[str, Any]:
    """Time ``maker.cfg.jobs`` jobs through a tier of ``threads`` threads on ``path`` (after the warm-up)."""
    cfg = maker.cfg
    with any_kernel_build():
        tier = CpuExpertTier(cfg.swiglu_limit, threads=threads, use_kernel=path == "c")
        try:
            kernels, seconds = set(), []
            for i in range(cfg.warmup + cfg.jobs):
                job = maker.job(tokens)
                start = time.perf_counter()
                result = tier.submit(job).result()
                if i >= cfg.warmup:
                    seconds.append(time.perf_counter() - start)
                    kernels.add(result.kernel)
        finally:
            tier.close()
    _check_ran(path, kernels)
    job_bytes = cfg.top_k * 3 * cfg.hidden * cfg.intermediate * 2
    ms = stats([1e3 * s for s in seconds])
    return {
        "path": path,
        "kernel": sorted(kernels)[0] if len(kernels) == 1 else sorted(kernels),
        "threads": threads,
        "tokens": tokens,
        "ms_per_job": ms,
        "gbps": job_bytes / (ms["median"] / 1e3) / 1e9,
        "gbps_best": job_bytes / (ms["min"] / 1e3) / 1e9,
    }


def kernel_error(maker: JobMaker, tokens: int, threads: int) -> float | None:
    """Relative RMS difference of the C kernel's job output from torch's (None without the kernel)."""
    if cpu_experts.library() is None:
        return None
    job = maker.job(tokens)
    with any_kernel_build():
        c_tier = CpuExpertTier(maker.cfg.swiglu_limit, threads=threads)
        torch_tier = CpuExpertTier(maker.cfg.swiglu_limit, threads=threads, use_kernel=False)
        try:
            ours, ref = c_tier.run(job), torch_tier.run(job)
        finally:
            c_tier.close()
            torch_tier.close()
    _check_ran("c", {ours.kernel})
    return ((ours.out.double() - ref.out.double()).norm() / ref.out.double().norm()).item()


def _host_read(nbytes: int, threads: int) -> float:
    """:func:`host_read_gbps` with ``threads`` torch threads (this thread's count is put back after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return host_read_gbps(nbytes)
    finally:
        torch.set_num_threads(before)


def tier_default() -> bool:
    """Whether the tier uses the built kernel by default (``MOETIER_CPU_KERNEL`` unset): its ISA is a fast one."""
    return cpu_experts.kernel_isa() in cpu_experts.FAST_ISAS


def kernel_notes(paths: list[str]) -> tuple[list[str], list[str]]:
    """The receipt's notes on the C kernel, and the paths to measure (without "c" when it is not built)."""
    if "c" not in paths:
        return [], list(paths)
    if cpu_experts.library() is None:
        note = "C kernel unavailable (no C compiler, a failed build or MOETIER_CPU_KERNEL=0; see the log)"
        return [f"{note}; only torch was measured"], [p for p in paths if p != "c"]
    if not tier_default():
        note = f"the tier does not use the {cpu_experts.kernel_isa()} build by default (not in FAST_ISAS)"
        return [f"{note}; measured as with MOETIER_CPU_KERNEL=1"], list(paths)
    return [], list(paths)


def run_bench(cfg: CpuTierBenchConfig) -> dict[str, Any]:
    cfg.validate()
    layout, experts = make_experts(cfg)
    maker = JobMaker(cfg, experts)
    notes, paths = kernel_notes(cfg.paths)
    results = [
        time_path(maker, path, threads, tokens) for tokens in cfg.tokens for threads in cfg.threads for path in paths
    ]
    total = cfg.experts * layout.block_bytes(torch.bfloat16)
    bound = _host_read(max(64 << 20, min(2 << 30, total)), max(cfg.threads))
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        "kernel_isa": cpu_experts.kernel_isa(),
        "kernel_default": tier_default(),
        "pinned": torch.cuda.is_available(),
        "expert_bytes": layout.block_bytes(torch.bfloat16),
        "job_bytes": cfg.top_k * layout.block_bytes(torch.bfloat16),
        "all_experts_bytes": total,
        "host_read_gbps": bound,
        "max_rel_err_vs_torch": kernel_error(maker, max(cfg.tokens), max(cfg.threads)),
        "results": results,
        "notes": notes,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    err = receipt["max_rel_err_vs_torch"]
    isa = f"{receipt['kernel_isa']}{'' if receipt['kernel_default'] else ' (not the tier default)'}"
    lines = [
        f"CPU tier: {cfg['experts']} experts of {receipt['expert_bytes'] / 1e6:.1f} MB "
        f"(hidden {cfg['hidden']}, intermediate {cfg['intermediate']}), jobs of top-{cfg['top_k']}, "
        f"C kernel {isa}, host read {receipt['host_read_gbps']:.1f} GB/s, "
        f"C vs torch rel. RMS {'-' if err is None else f'{err:.2e}'}, git {receipt['environment']['git_sha']}",
        "",
        "| path | kernel | threads | tokens | ms/job (median [min-max]) | GB/s (median) | GB/s (best) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        ms = r["ms_per_job"]
        lines.append(
            f"| {r['path']} | {r['kernel']} | {r['threads']} | {r['tokens']} "
            f"| {ms['median']:.2f} [{ms['min']:.2f}-{ms['max']:.2f}] | {r['gbps']:.1f} | {r['gbps_best']:.1f} |"
        )
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64, help="experts cycled over (64 x 50 MB: far past L3)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6, help="experts per job")
    parser.add_argument("--tokens", default="1,4", help="comma-separated token rows per job")
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default 4,8,14,all cores)")
    parser.add_argument("--paths", default=",".join(PATHS), help="torch, c or both")
    parser.add_argument("--jobs", type=int, default=20, help="timed jobs per (path, threads, tokens)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--swiglu-limit", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = CpuTierBenchConfig(
        experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        top_k=args.top_k,
        tokens=parse_int_list(args.tokens, "--tokens"),
        threads=parse_int_list(args.threads, "--threads") if args.threads else default_threads(),
        paths=[p.strip() for p in args.paths.split(",") if p.strip()],
        jobs=args.jobs,
        warmup=args.warmup,
        swiglu_limit=args.swiglu_limit,
        seed=args.seed,
    )
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
