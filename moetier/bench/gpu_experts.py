"""``moetier bench gpu-experts``: the device's routed-expert kernels alone, per expert format, on cold experts.

A decode call's routed experts on the GPU (resident store, cache slots or staging slots alike) run through
:func:`moetier.kernels.grouped_experts.run_experts`. This bench times that call on its own: random
experts of a real shape (DeepSeek-V4-Flash by default, ~50 MB each in bf16, ~13 MB in fp4) in device
memory, calls of ``tokens`` rows x ``top_k`` experts, each call taking the ``tokens * top_k`` experts
after the previous call's, so with more expert bytes than the L2 cache every call reads its weights
from HBM. Paths: ``grouped`` (the Triton kernels, what decode runs) and ``per-expert`` (one
:func:`swiglu_expert` per expert: cuBLAS on dense blocks, dequantise-then-GEMM on quantised ones).

Reported per (format, path, tokens): microseconds per call, GB/s of the expert bytes read (as stored,
1e9 bytes/s) against the HBM copy bandwidth measured in the same process, the relative RMS distance of the
grouped output from the per-expert one, and (one profiled pass) the device time of each kernel.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moetier.bench.common import (
    add_expert_shape_arguments,
    expert_shape_options,
    parse_names,
    stats,
    write_receipt_files,
)
from moetier.bench.cpu_tier import FORMATS, make_experts
from moetier.bench.environment import environment
from moetier.errors import ConfigError
from moetier.kernels import grouped_experts
from moetier.tiers.experts import ExpertWeights

KIND = "gpu-experts"
PATHS = ("grouped", "per-expert")
# The stream's head start per queued call: ~1 ms at ~2 GHz, past the slowest host time seen per call.
_SLEEP_CYCLES_PER_CALL = 2_000_000


@dataclass
class GpuExpertsBenchConfig:
    experts: int = 48
    hidden: int = 4096
    intermediate: int = 2048
    top_k: int = 6
    tokens: list[int] = field(default_factory=lambda: [1, 4])
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    calls: int = 50
    warmup: int = 3
    swiglu_limit: float | None = 10.0
    seed: int = 0

    def validate(self) -> None:
        if min(self.experts, self.hidden, self.intermediate, self.top_k, self.calls) < 1 or self.warmup < 0:
            raise ConfigError("--experts, --hidden, --intermediate, --top-k and --calls must be >= 1")
        if self.top_k * max(self.tokens) > self.experts:
            raise ConfigError(f"--experts {self.experts} is fewer than one call's top_k x tokens experts")
        if unknown := set(self.paths) - set(PATHS):
            raise ConfigError(f"--paths must be a subset of {','.join(PATHS)}, got {sorted(unknown)}")
        if not self.formats or (unknown := set(self.formats) - set(FORMATS)):
            raise ConfigError(f"--formats must be a non-empty subset of {','.join(FORMATS)}, got {self.formats}")


class CallMaker:
    """Decode calls of ``tokens`` rows, each row with ``top_k`` experts of its own, cycling over the experts."""

    def __init__(self, cfg: GpuExpertsBenchConfig, experts: list[ExpertWeights], device: torch.device) -> None:
        self.cfg, self.experts, self.device, self.next = cfg, experts, device, 0
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.expert_bytes = experts[0].block.numel() * experts[0].block.element_size()

    def call(self, tokens: int) -> dict[str, Any]:
        """The arguments of one :func:`run_experts` call: expert-sorted pairs, one group per expert."""
        hidden = torch.randn(tokens, self.cfg.hidden, generator=self.gen).to(torch.bfloat16)
        pair_tokens = torch.arange(tokens).repeat(self.cfg.top_k)  # group g serves token g % tokens
        groups = []
        for start in range(pair_tokens.numel()):
            groups.append((self.experts[self.next], start, 1))
            self.next = (self.next + 1) % len(self.experts)
        gates = torch.rand(pair_tokens.numel(), generator=self.gen).to(torch.bfloat16)
        return {
            "out": torch.zeros(tokens, self.cfg.hidden, device=self.device),
            "hidden": hidden.to(self.device),
            "pair_tokens": pair_tokens.to(self.device),
            "pair_gates": gates.to(self.device),
            "groups": groups,
            "swiglu_limit": self.cfg.swiglu_limit,
            "pair_tokens_host": pair_tokens,
            "per_token": self.cfg.top_k,
        }


def check_grouped(call: dict[str, Any]) -> None:
    """Raise unless the grouped kernels take this call (and have not failed: ``run_experts`` would then have
    run the per-expert path under the grouped label)."""
    if not grouped_experts.grouped_usable(call["hidden"], call["groups"]):
        raise RuntimeError("the grouped kernels are not usable here (no Triton, a block they do not take, or failed)")


def run_path(path: str, call: dict[str, Any]) -> torch.Tensor:
    """Run one call on ``path`` (see :func:`check_grouped`); returns its accumulator."""
    if path == "grouped":
        grouped_experts.run_experts(**call)  # the call decode makes: its checks and host work included
    else:
        args = {k: v for k, v in call.items() if k not in ("pair_tokens_host", "per_token")}
        grouped_experts.run_per_expert(**args)
    return call["out"]


def time_path(maker: CallMaker, path: str, tokens: int) -> dict[str, Any]:
    """Device and host time of ``cfg.calls`` calls each (arguments made beforehand).

    Device: the stream is first held by a sleep kernel long enough for the host to queue every call, so
    each call's pair of device events spans its kernels alone (not the host's launch gaps). Host: what
    queueing one call costs (Python, the launch tables, the launches), which decode pays per MoE layer,
    timed in a second pass that waits for the device every few calls, as decode does (a stream held for
    the whole pass would keep torch's pinned blocks from being reused, and time their allocation).
    """
    cfg = maker.cfg
    calls = [maker.call(tokens) for _ in range(cfg.warmup + 2 * cfg.calls)]
    if path == "grouped":
        check_grouped(calls[0])
    for call in calls[: cfg.warmup]:  # compiled
        run_path(path, call)
    torch.cuda.synchronize()
    timed, hosted = calls[cfg.warmup : cfg.warmup + cfg.calls], calls[cfg.warmup + cfg.calls :]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in timed]
    torch.cuda._sleep(int(_SLEEP_CYCLES_PER_CALL * cfg.calls))
    for call, (begin, end) in zip(timed, events, strict=True):
        begin.record()
        run_path(path, call)
        end.record()
    torch.cuda.synchronize()
    host = []
    for i, call in enumerate(hosted):
        started = time.perf_counter()
        run_path(path, call)
        host.append(1e6 * (time.perf_counter() - started))
        if i % 4 == 3:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    if path == "grouped":
        check_grouped(calls[0])  # no failure fell back to the per-expert path mid-run
    us = stats([1e3 * b.elapsed_time(e) for b, e in events])
    call_bytes = tokens * cfg.top_k * maker.expert_bytes
    return {
        "path": path,
        "tokens": tokens,
        "call_bytes": call_bytes,
        "us_per_call": us,
        "host_us_per_call": stats(host),
        "gbps": call_bytes / (us["median"] / 1e6) / 1e9,
        "gbps_best": call_bytes / (us["min"] / 1e6) / 1e9,
    }


def grouped_error(maker: CallMaker, tokens: int) -> float:
    """Relative RMS distance of the grouped kernels' output from the per-expert path's on one call."""
    call = maker.call(tokens)
    check_grouped(call)
    ref = run_path("per-expert", {**call, "out": call["out"].clone()}).double()
    ours = run_path("grouped", call).double()
    return ((ours - ref).norm() / ref.norm()).item()


def kernel_times(maker: CallMaker, tokens: int, calls: int = 10) -> dict[str, float]:
    """Device microseconds per call of each kernel the grouped path launches (one profiled pass)."""
    from torch.profiler import ProfilerActivity, profile

    work = [maker.call(tokens) for _ in range(calls)]
    check_grouped(work[0])
    run_path("grouped", maker.call(tokens))  # compiled before profiling
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in work:
            run_path("grouped", call)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:  # older torch
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us > 0:
            out[event.key] = device_us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def hbm_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth: bytes read plus bytes written per second by the best of 5 copies of
    ``nbytes`` (1e9 bytes/s), the rate the experts' reads are judged against."""
    src = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return 2 * nbytes / best / 1e9


def bench_format(cfg: GpuExpertsBenchConfig, fmt: str, device: torch.device) -> tuple[dict[str, Any], list[dict]]:
    """Every (path, tokens) of one expert format, its accuracy and its kernels' device times."""
    layout, host_experts = make_experts(cfg, fmt)  # pinned on CUDA hosts: the copies below are DMAs
    experts = [ExpertWeights.from_block(w.block.to(device), layout) for w in host_experts]
    del host_experts
    maker = CallMaker(cfg, experts, device)
    rows = [{"format": fmt, **time_path(maker, path, t)} for t in cfg.tokens for path in cfg.paths]
    info = {
        "expert_bytes": maker.expert_bytes,
        "all_experts_bytes": cfg.experts * maker.expert_bytes,
        "grouped_vs_per_expert_rel": {str(t): grouped_error(maker, t) for t in cfg.tokens},
        "grouped_kernel_us": {str(t): kernel_times(maker, t) for t in cfg.tokens},
    }
    return info, rows


def run_bench(cfg: GpuExpertsBenchConfig) -> dict[str, Any]:
    cfg.validate()
    if not torch.cuda.is_available():
        raise ConfigError("bench gpu-experts measures the CUDA expert kernels; this machine has no CUDA device")
    device = torch.device("cuda")
    formats, results = {}, []
    for fmt in cfg.formats:  # one format's experts in memory at a time
        formats[fmt], rows = bench_format(cfg, fmt, device)
        results += rows
        torch.cuda.empty_cache()
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        "hbm_gbps": hbm_copy_gbps(),
        "formats": formats,
        "results": results,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    lines = [
        f"GPU expert kernels: {cfg['experts']} cold experts (hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}), calls of top-{cfg['top_k']} x tokens, HBM copy {receipt['hbm_gbps']:.0f} GB/s, "
        f"git {receipt['environment']['git_sha']}",
        "",
    ]
    for fmt, info in receipt["formats"].items():
        rel = ", ".join(f"{t} tok {v:.1e}" for t, v in info["grouped_vs_per_expert_rel"].items())
        lines.append(f"- {fmt}: experts of {info['expert_bytes'] / 1e6:.1f} MB as stored; grouped vs per-expert {rel}")
        for t, kernels in info["grouped_kernel_us"].items():
            top = ", ".join(f"{name[:40]} {us:.0f}" for name, us in list(kernels.items())[:4])
            lines.append(f"  - {t} tok, device us per call: {top}")
    lines += [
        "",
        "Device us: the call's kernels alone (queued behind a sleep); host us: queueing the call (a pass that"
        " waits for the device every 4 calls).",
        "",
        "| format | path | tokens | device us/call (median [min-max]) | host us/call | GB/s (median) | x HBM |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        us = r["us_per_call"]
        lines.append(
            f"| {r['format']} | {r['path']} | {r['tokens']} | {us['median']:.0f} [{us['min']:.0f}-{us['max']:.0f}] "
            f"| {r['host_us_per_call']['median']:.0f} | {r['gbps']:.0f} | {r['gbps'] / receipt['hbm_gbps']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=48, help="experts cycled over (more bytes than L2)")
    add_expert_shape_arguments(parser, top_k_help="experts per token")
    parser.add_argument("--tokens", default="1,4", help="comma-separated token rows per call")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated: {', '.join(FORMATS)}")
    parser.add_argument("--paths", default=",".join(PATHS), help="grouped, per-expert or both")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per (format, path, tokens)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--swiglu-limit", type=float, default=10.0, help="DeepSeek-V4's clamp (0: none)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = GpuExpertsBenchConfig(
        **expert_shape_options(args),
        formats=parse_names(args.formats),
        paths=parse_names(args.paths),
        calls=args.calls,
        warmup=args.warmup,
        swiglu_limit=args.swiglu_limit or None,
    )
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
