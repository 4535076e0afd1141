"""``moetier bench dispatch-host``: the host's own cost of one MoE dispatch call, per dispatcher, on any device.

At a few decode streams the host thread is the critical path of a step (``bench decode``'s phase table), and a
dispatch call is most of a layer's host work. This bench isolates it: DeepSeek-V4-Flash's routing layout (256
experts, top-6, skewed routing so a 5% cache gets hits) over small expert blocks (hidden 256 by default), so the
bytes cost little and what is timed is the dispatcher's Python, its torch calls, its copies and launches, and
the CPU tier's handoffs. Each call is followed by a device sync outside the timer (a decode layer waits for its
routing anyway). Dispatchers: ``resident-host`` (host-built launch tables), ``resident`` (device-built tables,
as served: eagerly here, so its launches count, while decode runs them inside CUDA graphs) and ``tiered``
(pinned home copy, VRAM cache, copy stream and CPU tier on CUDA; the same split on the CPU).

Reported per (dispatcher, tokens): host microseconds per call (the best of ``repeats`` passes), the phases' microseconds
per call (:func:`moetier.profiling.clocking`), and the aten calls the launching thread makes per call (counted
by a dispatch mode in one further pass; on the H200's host each costs ~10-25 us, so the count is the number a
host cut has to lower). The count is exact and the same on any machine for the same device type.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetier.bench.common import fmt, parse_int_list, parse_names, sync_device, write_receipt_files
from moetier.bench.environment import environment
from moetier.errors import ConfigError
from moetier.profiling import clocking
from moetier.tiers.dispatcher import ExpertDispatcher, ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.tiered_dispatcher import TieredDispatcher

KIND = "dispatch-host"
DISPATCHERS = ("resident-host", "resident", "tiered")
Call = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # (layer, hidden, topk_ids, topk_weights)


@dataclass
class DispatchHostBenchConfig:
    layers: int = 3
    experts: int = 256
    hidden: int = 256
    intermediate: int = 128
    top_k: int = 6
    cache_slots: int = 38  # 5% of 3 x 256, as on a 24 GB card
    tokens: list[int] = field(default_factory=lambda: [1, 4])
    dispatchers: list[str] = field(default_factory=lambda: list(DISPATCHERS))
    calls: int = 300
    repeats: int = 2
    skew: float = 0.9  # added to the router's scores along the expert ids: the low ids are popular
    device: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        sizes = (self.layers, self.experts, self.hidden, self.intermediate, self.top_k, self.calls, self.repeats)
        if min(sizes) < 1 or self.cache_slots < 0:
            raise ConfigError(
                "--layers, --experts, --hidden, --intermediate, --top-k, --calls and --repeats must be >= 1, "
                "--cache-slots >= 0"
            )
        if self.top_k > self.experts:
            raise ConfigError(f"--top-k {self.top_k} is more than --experts {self.experts}")
        if not self.tokens or min(self.tokens) < 1:
            raise ConfigError(f"--tokens must list positive integers, got {self.tokens}")
        if not self.dispatchers or (unknown := set(self.dispatchers) - set(DISPATCHERS)):
            raise ConfigError(
                f"--dispatchers must be a non-empty subset of {','.join(DISPATCHERS)}, got {sorted(unknown)}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA device (use --device cpu)")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class _AtenCounter(TorchDispatchMode):
    """Counts the aten calls made in this thread while active (the mode stack is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _stores(cfg: DispatchHostBenchConfig, device: torch.device) -> tuple[ExpertStore, ExpertStore]:
    """The experts' home copy (pinned on CUDA, as served) and a device copy of it (the resident store)."""
    layout = ExpertLayout(
        moe_layers=tuple(range(cfg.layers)), num_experts=cfg.experts, hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate, top_k=cfg.top_k, swiglu_limit=10.0,
    )  # fmt: skip
    cuda = device.type == "cuda"
    home_allocator = HostExpertArena(chunk_bytes=256 << 20, progress=False) if cuda else device_allocator("cpu")
    home = ExpertStore(layout, torch.bfloat16, home_allocator)
    resident = ExpertStore(layout, torch.bfloat16, device_allocator(device))
    generator = torch.Generator().manual_seed(cfg.seed)
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            block = home.block_for_loading(layer, expert).block
            block.copy_(torch.randn(block.shape, generator=generator) * cfg.hidden**-0.5)
            resident.block_for_loading(layer, expert).block.copy_(block)
    return home, resident


def _calls(cfg: DispatchHostBenchConfig, tokens: int, count: int, device: torch.device) -> list[Call]:
    """``count`` calls cycling over the layers, each with fresh rows and skewed top-k routing."""
    generator = torch.Generator().manual_seed(cfg.seed + tokens)
    tilt = cfg.skew * torch.linspace(1.0, 0.0, cfg.experts)
    calls = []
    for i in range(count):
        hidden = torch.randn(tokens, cfg.hidden, generator=generator).bfloat16()
        weights, ids = (torch.rand(tokens, cfg.experts, generator=generator) + tilt).topk(cfg.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        calls.append((i % cfg.layers, hidden.to(device), ids.to(device), weights.to(device)))
    return calls


def _dispatcher(name: str, cfg: DispatchHostBenchConfig, home: ExpertStore, resident: ExpertStore):
    if name == "tiered":
        # The split on every call: the chooser would time the harness's calls as decode steps.
        return TieredDispatcher(home, cache_slots=cfg.cache_slots, miss_route="auto", policy="lfu", choose_split=False)
    return ResidentDispatcher(resident, device_routing=name == "resident")


def _timed_pass(dispatcher: ExpertDispatcher, calls: list[Call], device: torch.device) -> float:
    """Host seconds per call over ``calls``, each followed (outside the timer) by a device sync."""
    total = 0.0
    for layer, hidden, ids, weights in calls:
        start = time.perf_counter()
        dispatcher.dispatch(layer, hidden, ids, weights)
        total += time.perf_counter() - start
        sync_device(device)
    return total / len(calls)


def measure(name: str, cfg: DispatchHostBenchConfig, stores: tuple, tokens: int, device: torch.device) -> dict:
    """One (dispatcher, tokens): a warm-up pass, a clocked pass, ``repeats`` timed passes and a counted pass."""
    dispatcher = _dispatcher(name, cfg, *stores)
    calls = _calls(cfg, tokens, cfg.calls, device)
    try:
        with torch.inference_mode():
            _timed_pass(dispatcher, calls, device)  # compiled kernels, a filled cache, a grown host allocator
            with clocking() as clock:
                _timed_pass(dispatcher, calls, device)
            seconds = [_timed_pass(dispatcher, calls, device) for _ in range(cfg.repeats)]
            counter = _AtenCounter()
            with counter:
                _timed_pass(dispatcher, calls, device)
    finally:
        if isinstance(dispatcher, TieredDispatcher):
            dispatcher.close()
    row: dict[str, Any] = {
        "dispatcher": name,
        "tokens": tokens,
        "us_per_call": {"best": 1e6 * min(seconds), "worst": 1e6 * max(seconds)},
        "phases_us_per_call": {k: 1e6 * v / len(calls) for k, v in sorted(clock.seconds.items())},
        "aten_calls_per_call": sum(counter.calls.values()) / len(calls),
        "aten_calls_by_op": {op: n / len(calls) for op, n in counter.calls.most_common()},
        "graphable": dispatcher.graphable(tokens),
    }
    if isinstance(dispatcher, TieredDispatcher):
        row["hit_rate"] = dispatcher.metrics.snapshot()["hit_rate"]
    return row


def run_bench(cfg: DispatchHostBenchConfig) -> dict[str, Any]:
    cfg.validate()
    device = cfg.resolved_device()
    stores = _stores(cfg, device)
    results = [measure(name, cfg, stores, t, device) for t in cfg.tokens for name in cfg.dispatchers]
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        "device": str(device),
        "results": results,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    lines = [
        f"Dispatch host time on {receipt['device']}: {cfg['layers']} MoE layers x {cfg['experts']} experts (hidden "
        f"{cfg['hidden']}, intermediate {cfg['intermediate']}), top-{cfg['top_k']}, {cfg['cache_slots']} cache slots, "
        f"{cfg['calls']} calls per pass, git {receipt['environment']['git_sha']}",
        "",
        "| dispatcher | tokens | host us/call (best [worst]) | aten calls/call | hit rate | largest phases (us/call) |",
        "|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        us = r["us_per_call"]
        top = sorted(r["phases_us_per_call"].items(), key=lambda kv: -kv[1])[:4]
        phases = ", ".join(f"{name} {value:.0f}" for name, value in top) or "-"
        lines.append(
            f"| {r['dispatcher']} | {r['tokens']} | {us['best']:.1f} [{us['worst']:.1f}] "
            f"| {r['aten_calls_per_call']:.1f} | {fmt(r.get('hit_rate'))} | {phases} |"
        )
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=256, help="experts per MoE layer")
    parser.add_argument("--hidden", type=int, default=256, help="small by default: the host's work is timed")
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--cache-slots", type=int, default=38, help="the tiered dispatcher's VRAM cache slots")
    parser.add_argument("--tokens", default="1,4", help="comma-separated token rows per call")
    parser.add_argument("--dispatchers", default=",".join(DISPATCHERS), help=f"subset of {','.join(DISPATCHERS)}")
    parser.add_argument("--calls", type=int, default=300, help="calls per pass")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes (the best is reported)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = DispatchHostBenchConfig(
        layers=args.layers, experts=args.experts, hidden=args.hidden, intermediate=args.intermediate,
        top_k=args.top_k, cache_slots=args.cache_slots, tokens=parse_int_list(args.tokens, "--tokens"),
        dispatchers=parse_names(args.dispatchers), calls=args.calls, repeats=args.repeats, device=args.device,
    )  # fmt: skip
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
