"""``moetier bench cpu-tier``: the CPU expert tier alone, torch against the C kernel, on cold experts.

Random experts of a real shape (DeepSeek-V4-Flash by default: hidden 4096, intermediate 2048, so ~50 MB
each in bf16) live in pinned memory when CUDA is present (as the home copy does), else plain memory.
``--formats`` picks how they are stored, as ``--expert-format`` keeps them in the home copy: ``bf16``
(dense), ``fp8`` (e4m3fn + float32 scales per 128 x 128 tile, DeepSeek-V3's release) and ``fp4`` (packed
e2m1 + a float32 power-of-two scale per 32 inputs, DeepSeek-V4's). Jobs of ``top_k`` experts x
``tokens`` rows go through :class:`CpuExpertTier` (its worker thread, as in decode); job i takes the
experts after job i-1's, cycling over all of them, so with more expert bytes than the last-level cache
every job reads its weights from DRAM. Reported per (format, path, threads, tokens): ms per job and GB/s
of the expert bytes actually read (1e9 bytes/s: the stored block, so 0.31x bf16's for fp4); the receipt
also records the host's read bandwidth and how far the C kernel's output is from torch's on one job.

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
from typing import Any

import torch

from moetier.bench.bandwidth import host_read_gbps
from moetier.bench.common import (
    add_expert_shape_arguments,
    expert_shape_options,
    parse_int_list,
    parse_names,
    stats,
    write_receipt_files,
)
from moetier.bench.environment import environment
from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights
from moetier.weights.quant_experts import e8m0_bytes

KIND = "cpu-tier"
PATHS = ("torch", "c")
# How the experts are stored (as --expert-format keeps them), and the suffix of the tier's C kernel label.
# fp4's scales are the release's powers of two (_fill_quantised), as a ue8m0 checkpoint declares.
FORMATS = {
    "bf16": None,
    "fp8": ExpertQuant("fp8-block", (128, 128)),
    "fp4": ExpertQuant("fp4-block", (1, 32), pow2_scales=True),
    # the same, its scales kept as e8m0 exponent bytes (MOETIER_FP4_SCALES=e8m0)
    "fp4_e8m0": ExpertQuant("fp4-block", (1, 32), pow2_scales=True, scale_format="e8m0"),
}
KERNEL_SUFFIX = {"bf16": "", "fp8": "-fp8", "fp4": "-fp4", "fp4_e8m0": "-fp4_e8m0"}


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
    formats: list[str] = field(default_factory=lambda: ["bf16"])
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
        if not self.formats or (unknown := set(self.formats) - set(FORMATS)):
            raise ConfigError(f"--formats must be a non-empty subset of {','.join(FORMATS)}, got {self.formats}")


def make_experts(cfg: CpuTierBenchConfig, fmt: str = "bf16") -> tuple[ExpertLayout, list[ExpertWeights]]:
    """``cfg.experts`` random expert blocks stored as ``fmt`` (pinned when CUDA is present), of a real model's scale."""
    layout = ExpertLayout(
        (0,), cfg.experts, cfg.hidden, cfg.intermediate, cfg.top_k, cfg.swiglu_limit, quant=FORMATS[fmt]
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    pinned = torch.cuda.is_available()
    experts = []
    for _ in range(cfg.experts):
        block = torch.empty(layout.block_numel, dtype=layout.block_dtype(torch.bfloat16), pin_memory=pinned)
        if layout.quant is None:
            block.normal_(0.0, cfg.hidden**-0.5, generator=gen)
            experts.append(ExpertWeights.from_block(block, layout))
        else:
            block.zero_()  # the alignment padding between parts
            experts.append(_fill_quantised(ExpertWeights.from_block(block, layout), cfg.hidden, gen))
    return layout, experts


def _fill_quantised(weights: ExpertWeights, hidden: int, gen: torch.Generator) -> ExpertWeights:
    """Random codes and scales giving weights of RMS near ``hidden ** -0.5``, like the dense experts: fp8
    finite e4m3fn codes (RMS ~150) with float32 scales, fp4 any bytes (RMS ~2.9) with the release's
    power-of-two scales."""
    fp4 = weights.quant_kind == "fp4-block"
    for name in ("gate", "up", "down"):
        q, scale = getattr(weights, f"{name}_q"), getattr(weights, f"{name}_scale")
        codes = torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=gen)
        if fp4:
            q.copy_(codes)
            exponent = round(-0.5 * torch.log2(torch.tensor(float(hidden))).item() - 1.5)  # 2.9 ~ 2^1.5
            powers = 2.0 ** torch.randint(exponent - 1, exponent + 2, scale.shape, generator=gen).float()
            scale.copy_(e8m0_bytes(powers) if scale.dtype == torch.uint8 else powers)
        else:
            codes[(codes & 0x7F) == 0x7F] -= 1  # the two NaN codes
            q.view(torch.uint8).copy_(codes)
            scale.copy_((torch.rand(scale.shape, generator=gen) + 0.5) / (150 * hidden**0.5))
    return weights


class JobMaker:
    """Jobs of ``top_k`` experts x ``tokens`` rows, each job's experts following the previous job's (cold)."""

    def __init__(self, cfg: CpuTierBenchConfig, experts: list[ExpertWeights], fmt: str = "bf16") -> None:
        self.cfg, self.experts, self.next, self.format = cfg, experts, 0, fmt
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.job_bytes = cfg.top_k * experts[0].block.numel() * experts[0].block.element_size()

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


def c_kernel_label(fmt: str = "bf16") -> str:
    """The ``kernel`` a tier reports for a job of ``fmt`` experts on the C kernel (e.g. "c-avx2", "c-avx2-fp4")."""
    return f"c-{cpu_experts.kernel_isa()}{KERNEL_SUFFIX[fmt]}"


def _check_ran(path: str, kernels: set[str], fmt: str = "bf16") -> None:
    """A "c" measurement of anything but the C kernel (a silent torch fallback) must not be reported as one."""
    if path == "c" and kernels != {c_kernel_label(fmt)}:
        raise RuntimeError(f"the c path ran {sorted(kernels)}, not the C kernel ({c_kernel_label(fmt)})")


def time_path(maker: JobMaker, path: str, threads: int, tokens: int) -> dict[str, Any]:
    """Time ``maker.cfg.jobs`` jobs through a tier of ``threads`` threads on ``path`` (after the warm-up, at least
    one job per expert: the C kernel checks each expert once, fp4 scales and all, and that is not a job's cost)."""
    cfg = maker.cfg
    warmup = max(cfg.warmup, -(-len(maker.experts) // cfg.top_k))
    with any_kernel_build():
        tier = CpuExpertTier(cfg.swiglu_limit, threads=threads, use_kernel=path == "c")
        try:
            kernels, seconds = set(), []
            for i in range(warmup + cfg.jobs):
                job = maker.job(tokens)
                start = time.perf_counter()
                result = tier.submit(job).result()
                if i >= warmup:
                    seconds.append(time.perf_counter() - start)
                    kernels.add(result.kernel)
        finally:
            tier.close()
    _check_ran(path, kernels, maker.format)
    job_bytes = maker.job_bytes  # as stored: what the job reads
    ms = stats([1e3 * s for s in seconds])
    return {
        "format": maker.format,
        "path": path,
        "kernel": sorted(kernels)[0] if len(kernels) == 1 else sorted(kernels),
        "threads": threads,
        "tokens": tokens,
        "job_bytes": job_bytes,
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
    _check_ran("c", {ours.kernel}, maker.format)
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
    notes, paths = kernel_notes(cfg.paths)
    results, formats = [], {}
    for fmt in cfg.formats:  # one format's experts in memory at a time
        layout, experts = make_experts(cfg, fmt)
        maker = JobMaker(cfg, experts, fmt)
        results += [
            time_path(maker, path, threads, tokens)
            for tokens in cfg.tokens
            for threads in cfg.threads
            for path in paths
        ]
        expert_bytes = layout.block_bytes(torch.bfloat16)
        formats[fmt] = {
            "expert_bytes": expert_bytes,
            "job_bytes": maker.job_bytes,
            "all_experts_bytes": cfg.experts * expert_bytes,
            "max_rel_err_vs_torch": kernel_error(maker, max(cfg.tokens), max(cfg.threads)),
        }
        del experts, maker
    total = max(f["all_experts_bytes"] for f in formats.values())
    bound = _host_read(max(64 << 20, min(2 << 30, total)), max(cfg.threads))
    errors = [f["max_rel_err_vs_torch"] for f in formats.values() if f["max_rel_err_vs_torch"] is not None]
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        "kernel_isa": cpu_experts.kernel_isa(),
        "kernel_default": tier_default(),
        "pinned": torch.cuda.is_available(),
        "formats": formats,
        "host_read_gbps": bound,
        "max_rel_err_vs_torch": max(errors) if errors else None,
        "results": results,
        "notes": notes,
    }


def _format_line(fmt: str, info: dict[str, Any]) -> str:
    err = info["max_rel_err_vs_torch"]
    return (
        f"- {fmt}: experts of {info['expert_bytes'] / 1e6:.1f} MB as stored, jobs of {info['job_bytes'] / 1e6:.1f} MB, "
        f"C vs torch rel. RMS {'-' if err is None else f'{err:.2e}'}"
    )


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    isa = f"{receipt['kernel_isa']}{'' if receipt['kernel_default'] else ' (not the tier default)'}"
    lines = [
        f"CPU tier: {cfg['experts']} experts (hidden {cfg['hidden']}, intermediate {cfg['intermediate']}), "
        f"jobs of top-{cfg['top_k']}, C kernel {isa}, host read {receipt['host_read_gbps']:.1f} GB/s, "
        f"git {receipt['environment']['git_sha']}",
        "",
        *[_format_line(fmt, info) for fmt, info in receipt["formats"].items()],
        "",
        "GB/s: expert bytes as stored (what a job reads) per second.",
        "",
        "| format | path | kernel | threads | tokens | ms/job (median [min-max]) | GB/s (median) | GB/s (best) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        ms = r["ms_per_job"]
        lines.append(
            f"| {r['format']} | {r['path']} | {r['kernel']} | {r['threads']} | {r['tokens']} "
            f"| {ms['median']:.2f} [{ms['min']:.2f}-{ms['max']:.2f}] | {r['gbps']:.1f} | {r['gbps_best']:.1f} |"
        )
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64, help="experts cycled over (64 x 50 MB: far past L3)")
    add_expert_shape_arguments(parser, top_k_help="experts per job")
    parser.add_argument("--tokens", default="1,4", help="comma-separated token rows per job")
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default 4,8,14,all cores)")
    parser.add_argument("--paths", default=",".join(PATHS), help="torch, c or both")
    parser.add_argument(
        "--formats", "--expert-format", default="bf16", help=f"comma-separated expert storage: {', '.join(FORMATS)}"
    )
    parser.add_argument("--jobs", type=int, default=20, help="timed jobs per (path, threads, tokens)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed jobs first (at least one per expert)")
    parser.add_argument("--swiglu-limit", type=float, default=None)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = CpuTierBenchConfig(
        **expert_shape_options(args),
        threads=parse_int_list(args.threads, "--threads") if args.threads else default_threads(),
        paths=parse_names(args.paths),
        formats=parse_names(args.formats),
        jobs=args.jobs,
        warmup=args.warmup,
        swiglu_limit=args.swiglu_limit,
    )
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
