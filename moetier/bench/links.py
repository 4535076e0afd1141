"""``moetier bench links``: the home copy's two links at once, on cold experts.

A miss at decode is read from the pinned home copy in host DRAM by one of two links: the CPU tier's kernel
(host cores) or the device over PCIe (the mapped route's kernels reading pinned memory, or DMA copies into
VRAM slots). The split decode runs both at once, and the decode bench's DRAM bound prices every miss at the
host's DRAM read rate, as if the two links together could reach it. This bench measures what they reach,
each alone and together, on this host:

- ``cpu``: jobs of ``cpu_experts`` experts x ``tokens`` rows through :class:`CpuExpertTier` (the C kernel on
  its native worker, as in decode: the same threads and spin);
- ``mapped``: calls of ``gpu_experts`` experts x ``tokens`` rows through the mapped route's launch
  (:func:`run_routed` over pinned blocks, the host-read fp4 blocks), kept queued ahead on the device;
- ``dma``: pinned -> device copies of ``gpu_experts`` blocks a call into staging slots, kept queued ahead;
- ``read``: :func:`host_read_gbps`'s sum over a buffer far past the caches (the CPU-alone half of the DRAM bound's
  rate: :func:`measure_bounds` takes the larger of it and the sum beside DMA copies).

Each runner reads experts of its own (as the links read different misses), cycling so that every call reads
DRAM. A combination (``cpu+mapped``) runs its runners in threads released together for ``seconds``; each
reports bytes as stored per second over its own busy span. Reported per combination: every runner's GB/s, the
sum, and the sum against ``read`` alone: the ceiling the split decode can reach on this host. The decode bench's
DRAM bound prices misses at the larger of ``read`` and ``read+dma``'s sum (measured again in its own process).
Off CUDA only ``cpu`` and ``read`` run.
"""

from __future__ import annotations

import argparse
import statistics
from abc import abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moetier.bench.bandwidth import HostSumRunner, Runner, run_window
from moetier.bench.common import add_expert_shape_arguments, expert_shape_options, parse_names, write_receipt_files
from moetier.bench.cpu_tier import FORMATS, CpuTierBenchConfig, JobMaker, any_kernel_build, make_experts
from moetier.bench.environment import environment
from moetier.bench.gpu_experts import CallMaker, GpuExpertsBenchConfig, host_placement, run_path
from moetier.errors import ConfigError
from moetier.kernels import cpu_experts, grouped_experts
from moetier.kernels.fp4_blocks import HOST_READ_FP4_BLOCKS
from moetier.tiers.cpu_tier import CpuExpertTier, default_cpu_threads
from moetier.tiers.experts import ExpertWeights
from moetier.tiers.tiered_dispatcher import DECODE_SPIN_S

KIND = "links"
RUNNERS = ("cpu", "mapped", "dma", "read")
CUDA_RUNNERS = ("mapped", "dma")
DEFAULT_COMBOS = ("cpu", "mapped", "dma", "read", "cpu+mapped", "cpu+dma", "read+dma", "read+mapped")
_QUEUED_AHEAD = 2  # device runners keep this many batches queued, so the device never waits for the host


@dataclass
class LinksBenchConfig:
    """What ``moetier bench links`` measures; ``validate`` raises a one-line ConfigError."""

    experts: int = 64  # per runner: 64 fp4 V4-Flash experts are ~1 GB, far past the last-level cache
    hidden: int = 4096
    intermediate: int = 2048
    top_k: int = 6  # unused by the runners (their own counts below); kept for the shared shape flags
    tokens: list[int] = field(default_factory=lambda: [1])
    expert_format: str = "fp4"
    cpu_experts: int = 2  # a 1-stream decode layer's CPU share of ~4 misses
    gpu_experts: int = 2
    cpu_threads: int = field(default_factory=default_cpu_threads)
    combos: list[str] = field(default_factory=lambda: list(DEFAULT_COMBOS))
    seconds: float = 2.0
    read_bytes: int = 1 << 30  # the read runner's buffer
    seed: int = 0

    def validate(self) -> None:
        if min(self.experts, self.hidden, self.intermediate, self.cpu_experts, self.gpu_experts) < 1:
            raise ConfigError("--experts, --hidden, --intermediate, --cpu-experts and --gpu-experts must be >= 1")
        if len(self.tokens) != 1 or self.tokens[0] < 1:
            raise ConfigError(f"--tokens takes one row count >= 1, got {self.tokens}")
        if max(self.cpu_experts, self.gpu_experts) * self.tokens[0] > self.experts:
            raise ConfigError(f"--experts {self.experts} is fewer than one call's experts x tokens")
        if self.expert_format not in FORMATS:
            raise ConfigError(f"--expert-format must be one of {', '.join(FORMATS)}, got {self.expert_format!r}")
        if self.cpu_threads < 1:
            raise ConfigError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if not 0.05 <= self.seconds <= 60:
            raise ConfigError(f"--seconds must be in [0.05, 60], got {self.seconds}")
        if self.read_bytes < 1 << 20:
            raise ConfigError(f"--read-mib must be >= 1, got {self.read_bytes / (1 << 20):g}")
        if not self.combos:
            raise ConfigError("--combos must list at least one combination such as cpu+mapped")
        for combo in self.combos:
            names = combo.split("+")
            if any(name not in RUNNERS for name in names) or len(set(names)) < len(names):
                raise ConfigError(f"--combos: {combo!r} must join distinct runners of {', '.join(RUNNERS)} with +")


class CpuRunner(Runner):
    """The CPU tier's jobs, one at a time, as a decode layer submits them (its native worker, spinning)."""

    name = "cpu"

    def __init__(self, cfg: LinksBenchConfig) -> None:
        tier_cfg = CpuTierBenchConfig(
            experts=cfg.experts, hidden=cfg.hidden, intermediate=cfg.intermediate, top_k=cfg.cpu_experts,
            formats=[cfg.expert_format], seed=cfg.seed,
        )  # fmt: skip
        _, experts = make_experts(tier_cfg, cfg.expert_format)
        maker = JobMaker(tier_cfg, experts, cfg.expert_format)
        self.jobs = [maker.job(cfg.tokens[0]) for _ in range(max(1, cfg.experts // cfg.cpu_experts))]
        self.job_bytes, self.next = maker.job_bytes, 0
        self.experts = experts  # alive while the jobs point at them
        self.tier = CpuExpertTier(None, threads=cfg.cpu_threads, spin_seconds=DECODE_SPIN_S)
        self.kernels: set[str] = set()
        self.marks: list[dict[str, float]] = []  # each job's marks and seconds since the last take_marks

    def step(self) -> int:
        job, self.next = self.jobs[self.next], (self.next + 1) % len(self.jobs)
        result = self.tier.submit(job).result()
        self.kernels.add(result.kernel)
        if result.marks:
            self.marks.append({**result.marks, "seconds": result.seconds})
        return self.job_bytes

    def take_marks(self) -> list[dict[str, float]]:
        marks, self.marks = self.marks, []
        return marks

    def close(self) -> None:
        self.tier.close()


class _DeviceRunner(Runner):
    """A device link: batches queued on a stream of its own, ``_QUEUED_AHEAD`` ahead of the one waited for."""

    def __init__(self, calls_per_batch: int = 4) -> None:
        self.stream = torch.cuda.Stream()
        self.calls_per_batch = calls_per_batch
        self.pending: list[tuple[torch.cuda.Event, int]] = []

    @abstractmethod
    def call(self) -> int:
        """Queue one call on the current stream; its bytes."""

    def _queue_batch(self) -> None:
        with torch.cuda.stream(self.stream):
            nbytes = sum(self.call() for _ in range(self.calls_per_batch))
            done = torch.cuda.Event()
            done.record()
        self.pending.append((done, nbytes))

    def start(self) -> None:
        for _ in range(_QUEUED_AHEAD):
            self._queue_batch()

    def step(self) -> int:
        self._queue_batch()
        done, nbytes = self.pending.pop(0)
        done.synchronize()
        return nbytes

    def finish(self) -> int:
        total = 0
        while self.pending:
            done, nbytes = self.pending.pop(0)
            done.synchronize()
            total += nbytes
        return total


class MappedRunner(_DeviceRunner):
    """The mapped route's kernels reading pinned blocks over PCIe (the host-read fp4 blocks, as decode runs them)."""

    name = "mapped"

    def __init__(self, cfg: LinksBenchConfig) -> None:
        super().__init__()
        device = torch.device("cuda")
        gpu_cfg = GpuExpertsBenchConfig(
            experts=cfg.experts, hidden=cfg.hidden, intermediate=cfg.intermediate, top_k=cfg.gpu_experts,
            tokens=list(cfg.tokens), formats=[cfg.expert_format], where=["host"], seed=cfg.seed + 7,
        )  # fmt: skip
        layout, host = make_experts(gpu_cfg, cfg.expert_format)
        anchor = ExpertWeights.from_block(torch.empty_like(host[0].block, device=device), layout)
        self.place = host_placement(host, anchor)
        maker = CallMaker(gpu_cfg, self.place, device)
        self.calls = [maker.call(cfg.tokens[0]) for _ in range(max(1, cfg.experts // cfg.gpu_experts))]
        self.call_bytes, self.next = cfg.tokens[0] * cfg.gpu_experts * maker.expert_bytes, 0
        with grouped_experts.fp4_blocks(HOST_READ_FP4_BLOCKS):
            run_path("grouped", self.calls[0], self.place)  # compiled before the window
        torch.cuda.synchronize()

    def call(self) -> int:
        call, self.next = self.calls[self.next], (self.next + 1) % len(self.calls)
        with grouped_experts.fp4_blocks(HOST_READ_FP4_BLOCKS):
            run_path("grouped", call, self.place)
        return self.call_bytes


class DmaRunner(_DeviceRunner):
    """DMA copies of whole expert blocks from the pinned home copy into VRAM staging slots (the copy route)."""

    name = "dma"

    def __init__(self, cfg: LinksBenchConfig) -> None:
        super().__init__()
        gpu_cfg = GpuExpertsBenchConfig(
            experts=cfg.experts, hidden=cfg.hidden, intermediate=cfg.intermediate, top_k=cfg.gpu_experts,
            formats=[cfg.expert_format], seed=cfg.seed + 11,
        )  # fmt: skip
        _, host = make_experts(gpu_cfg, cfg.expert_format)
        self.blocks = [w.block for w in host]
        self.slots = [torch.empty_like(self.blocks[0], device="cuda") for _ in range(cfg.gpu_experts)]
        self.next = 0

    def call(self) -> int:
        nbytes = 0
        for slot in self.slots:
            block, self.next = self.blocks[self.next], (self.next + 1) % len(self.blocks)
            slot.copy_(block, non_blocking=True)
            nbytes += block.numel() * block.element_size()
        return nbytes


class ReadRunner(HostSumRunner):
    """The CPU-alone half of the DRAM bound's own measurement (:class:`HostSumRunner`) over ``cfg.read_bytes``."""

    def __init__(self, cfg: LinksBenchConfig) -> None:
        super().__init__(cfg.read_bytes)


RUNNER_TYPES: dict[str, type[Runner]] = {"cpu": CpuRunner, "mapped": MappedRunner, "dma": DmaRunner, "read": ReadRunner}


def measure_combo(combo: str, runners: dict[str, Runner], seconds: float) -> dict[str, Any]:
    """One row: every runner's GB/s over its own span while the combination ran together, and their sum."""
    names = combo.split("+")
    windows = run_window([runners[n] for n in names], seconds)
    gbps = {n: w.bytes / w.seconds / 1e9 for n, w in zip(names, windows, strict=True)}
    steps = {n: w.steps for n, w in zip(names, windows, strict=True)}
    row = {"combo": combo, "gbps": gbps, "total_gbps": sum(gbps.values()), "steps": steps}
    if isinstance(cpu := runners.get("cpu"), CpuRunner):
        marks = cpu.take_marks()  # the warm-up's too, when this combination has no cpu: dropped
        row["cpu_job_ms"] = job_phases_ms(marks) if "cpu" in names else None
        row["cpu_joined"] = statistics.median(m["joined"] for m in marks) if "cpu" in names and marks else None
    return row


# A CPU job's time in parts (cpu_worker.MARK_NAMES): the team's start (the last thread that joined it), each phase
# from its first thread's start to its last thread's end, how far apart the phase's threads ended (what the phase's
# end waits out), the rest.
_PHASES = {
    "job": lambda m: m["seconds"],
    "team_start": lambda m: m["entered_last"] - m["allocated"],
    "gate_up": lambda m: m["gate_up_last"] - m["entered_first"],
    "gate_up_spread": lambda m: m["gate_up_last"] - m["gate_up_first"],
    "down": lambda m: m["down_last"] - m["gate_up_last"],
    "down_spread": lambda m: m["down_last"] - m["down_first"],
    "rest": lambda m: m["seconds"] - (m["down_last"] - m["entered_first"]),
}


def job_phases_ms(marks: list[dict[str, float]]) -> dict[str, float] | None:
    """Median ms of each part of a CPU job (``_PHASES``) over ``marks``; None without marks (the Python worker)."""
    if not marks:
        return None
    return {name: 1e3 * statistics.median(part(m) for m in marks) for name, part in _PHASES.items()}


def _runners_needed(cfg: LinksBenchConfig) -> list[str]:
    wanted = {name for combo in cfg.combos for name in combo.split("+")}
    return [name for name in RUNNERS if name in wanted]


def run_bench(cfg: LinksBenchConfig) -> dict[str, Any]:
    cfg.validate()
    needed = _runners_needed(cfg)
    if not torch.cuda.is_available() and (missing := sorted(set(needed) & set(CUDA_RUNNERS))):
        raise ConfigError(
            f"bench links: {', '.join(missing)} need a CUDA device; without one pass --combos cpu,read,cpu+read"
        )
    runners: dict[str, Runner] = {}
    with any_kernel_build():  # the C kernel of any ISA, as bench cpu-tier measures it
        try:
            for name in needed:
                runners[name] = RUNNER_TYPES[name](cfg)
            for runner in runners.values():  # warm: first calls, the tier's worker, compiled kernels
                run_window([runner], min(0.2, cfg.seconds))
            results = [measure_combo(combo, runners, cfg.seconds) for combo in cfg.combos]
        finally:
            for runner in runners.values():
                if isinstance(runner, CpuRunner):
                    runner.close()
    read = next((r["total_gbps"] for r in results if r["combo"] == "read"), None)
    for row in results:
        row["x_read"] = None if read is None else row["total_gbps"] / read
    cpu = runners.get("cpu")
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        "cpu_kernel": sorted(cpu.kernels) if isinstance(cpu, CpuRunner) else None,
        "cpu_kernel_isa": cpu_experts.kernel_isa() if "cpu" in runners else None,
        "read_gbps": read,
        "results": results,
        "best_split": _best_split(results),
    }


def _best_split(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The CPU + device combination that read the most: the ceiling of the split decode on this host."""
    splits = [r for r in results if "cpu" in r["gbps"] and set(r["gbps"]) & set(CUDA_RUNNERS)]
    return max(splits, key=lambda r: r["total_gbps"], default=None)


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    read = receipt["read_gbps"]
    lines = [
        f"Links to the home copy: {cfg['expert_format']} experts (hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}), {cfg['tokens'][0]} token(s), CPU jobs of {cfg['cpu_experts']} experts on "
        f"{cfg['cpu_threads']} threads ({', '.join(receipt['cpu_kernel'] or ['-'])}), "
        f"device calls of {cfg['gpu_experts']}, "
        f"{cfg['seconds']} s a combination, git {receipt['environment']['git_sha']}",
        "",
        "GB/s: expert bytes as stored per second, each runner over its own span while the combination ran; x read:"
        " the sum against the host read alone (the decode bench's DRAM bound takes the larger of it and read+dma).",
        "",
        "| combination | " + " | ".join(RUNNERS) + " | sum GB/s | x read |",
        "|---|" + "---|" * (len(RUNNERS) + 2),
    ]
    for r in receipt["results"]:
        cells = [f"{r['gbps'][n]:.1f}" if n in r["gbps"] else "-" for n in RUNNERS]
        ratio = "-" if r["x_read"] is None else f"{r['x_read']:.2f}"
        lines.append(f"| {r['combo']} | " + " | ".join(cells) + f" | {r['total_gbps']:.1f} | {ratio} |")
    phased = [r for r in receipt["results"] if r.get("cpu_job_ms")]
    if phased:
        names = list(_PHASES)
        lines += ["", "CPU jobs, median ms: the job; its team's start; each phase from its first thread's start to its"
                  " last thread's end, and how far apart its threads ended; the rest (allocation, wrap-up); the"
                  f" threads that took part (of {cfg['cpu_threads']}).", "",
                  f"| combination | {' | '.join(names)} | joined |", "|---|" + "---|" * (len(names) + 1)]  # fmt: skip
        for r in phased:
            cells = [f"{r['cpu_job_ms'][n]:.3f}" for n in names] + [f"{r['cpu_joined']:g}"]
            lines.append(f"| {r['combo']} | " + " | ".join(cells) + " |")
    if (best := receipt["best_split"]) is not None:
        of_read = "" if read is None else f" ({best['total_gbps'] / read:.2f}x the host read, {read:.1f} GB/s)"
        lines += ["", f"Best split: {best['combo']} at {best['total_gbps']:.1f} GB/s{of_read}."]
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64, help="experts per runner, cycled over (past the caches)")
    add_expert_shape_arguments(parser, top_k_help="unused (see --cpu-experts, --gpu-experts)")
    parser.add_argument("--tokens", default="1", help="token rows per CPU job and device call")
    parser.add_argument("--expert-format", default="fp4", help=f"expert storage: {', '.join(FORMATS)}")
    parser.add_argument("--cpu-experts", type=int, default=2, help="experts per CPU job")
    parser.add_argument("--gpu-experts", type=int, default=2, help="experts per device call (mapped, dma)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="CPU tier threads (default: all cores but 2)")
    parser.add_argument("--combos", default=",".join(DEFAULT_COMBOS), help="comma-separated runners joined by +")
    parser.add_argument("--seconds", type=float, default=2.0, help="window per combination")
    parser.add_argument("--read-mib", type=int, default=1024, help="the read runner's buffer (MiB)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = LinksBenchConfig(
        **expert_shape_options(args),
        expert_format=args.expert_format,
        cpu_experts=args.cpu_experts,
        gpu_experts=args.gpu_experts,
        cpu_threads=args.cpu_threads if args.cpu_threads is not None else default_cpu_threads(),
        combos=parse_names(args.combos),
        seconds=args.seconds,
        read_bytes=args.read_mib << 20,
    )
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
