"""``moetier bench gpu-experts``: the device's routed-expert kernels alone, per expert format, on cold experts.

A decode call's routed experts on the GPU (resident store, cache slots or staging slots alike) run through
:func:`moetier.kernels.grouped_experts.run_experts`. This bench times that call on its own: random
experts of a real shape (DeepSeek-V4-Flash by default, ~50 MB each in bf16, ~13 MB in fp4) in device
memory, calls of ``tokens`` rows x ``top_k`` experts, each call taking the ``tokens * top_k`` experts
after the previous call's, so with more expert bytes than the L2 cache every call reads its weights
from HBM. Paths: ``grouped`` (the Triton kernels, what decode runs) and ``per-expert`` (one
:func:`swiglu_expert` per expert: cuBLAS on dense blocks, dequantise-then-GEMM on quantised ones).

``--where host`` keeps the blocks in pinned host memory instead, read by the same kernels over PCIe as the
mapped route reads a miss's home copy (:mod:`moetier.tiers.mapped`): a table of byte offsets from a device
anchor block, launched by :func:`~moetier.kernels.device_routing.run_routed` (the grouped path only; the
per-expert path would compute on the host). ``--fp4-blocks`` sweeps the fp4 kernels' block sizes
(:class:`~moetier.kernels.grouped_experts.Fp4Blocks`, N x H x K), each against the default's output.

Reported per (format, path, where, fp4 blocks, tokens): microseconds per call, GB/s of the expert bytes read
(as stored, 1e9 bytes/s) against the copy bandwidth measured in the same process (HBM device-to-device copy
for device blocks, a pinned host-to-device copy for host blocks), per grouped row the device time of each
kernel (one profiled pass) and the relative RMS distance of its output from the default blocks' on the first
``--where``, and per format the relative RMS distance of the grouped output from the per-expert one.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moetier.bench import beside_work
from moetier.bench.bandwidth import h2d_gbps
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
from moetier.kernels.device_routing import DEVICE_ROUTING_MAX_PAIRS, LayerBlocks, device_routing_fits, run_routed
from moetier.kernels.grouped_experts import MAX_GROUP_TOKENS, Fp4Blocks
from moetier.tiers.experts import ExpertWeights

KIND = "gpu-experts"
PATHS = ("grouped", "per-expert")
WHERES = ("device", "host")
# The stream's head start per queued call: ~1 ms at ~2 GHz, past the slowest host time seen per call.
_SLEEP_CYCLES_PER_CALL = 2_000_000
# What run_experts / run_per_expert take of a call (the rest serves the host route's run_routed).
_EXPERTS_ARGS = (
    "out",
    "hidden",
    "pair_tokens",
    "pair_gates",
    "groups",
    "swiglu_limit",
    "pair_tokens_host",
    "per_token",
)


def parse_fp4_blocks(text: str) -> list[Fp4Blocks]:
    """``"8x16x1024,8x32x1024"`` -> one :class:`Fp4Blocks` each (N x H x K), in order, repeats dropped; one-line
    ConfigError otherwise."""
    out: list[Fp4Blocks] = []
    for item in str(text).split(","):
        if not item.strip():
            continue
        try:
            blocks = Fp4Blocks.parse(item)
        except ValueError as exc:
            raise ConfigError(f"--fp4-blocks: {exc}") from None
        if blocks not in out:
            out.append(blocks)
    if not out:
        raise ConfigError(f"--fp4-blocks must list N x H x K sizes such as 8x16x1024, got {text!r}")
    return out


@dataclass
class GpuExpertsBenchConfig:
    experts: int = 48
    hidden: int = 4096
    intermediate: int = 2048
    top_k: int = 6
    tokens: list[int] = field(default_factory=lambda: [1, 4])
    formats: list[str] = field(default_factory=lambda: ["bf16", "fp8", "fp4"])  # fp4_e8m0 when asked
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    where: list[str] = field(default_factory=lambda: ["device"])
    fp4_blocks: list[Fp4Blocks] = field(default_factory=lambda: [Fp4Blocks()])
    calls: int = 50
    warmup: int = 3
    swiglu_limit: float | None = 10.0
    seed: int = 0
    beside: int = 0  # passes of a layer's backbone linears on a second stream beside host calls (0: not measured)

    def validate(self) -> None:
        if min(self.experts, self.hidden, self.intermediate, self.top_k, self.calls) < 1 or self.warmup < 0:
            raise ConfigError("--experts, --hidden, --intermediate, --top-k and --calls must be >= 1")
        if self.top_k * max(self.tokens) > self.experts:
            raise ConfigError(f"--experts {self.experts} is fewer than one call's top_k x tokens experts")
        if unknown := set(self.paths) - set(PATHS):
            raise ConfigError(f"--paths must be a subset of {','.join(PATHS)}, got {sorted(unknown)}")
        if not self.formats or (unknown := set(self.formats) - set(FORMATS)):
            raise ConfigError(f"--formats must be a non-empty subset of {','.join(FORMATS)}, got {self.formats}")
        if not self.where or (unknown := set(self.where) - set(WHERES)) or len(set(self.where)) < len(self.where):
            raise ConfigError(f"--where must list some of {','.join(WHERES)} once each, got {self.where}")
        if not self.fp4_blocks or not all(isinstance(b, Fp4Blocks) for b in self.fp4_blocks):
            raise ConfigError(f"--fp4-blocks must list N x H x K sizes such as 8x16x1024, got {self.fp4_blocks}")
        if self.beside < 0 or (self.beside and "host" not in self.where):
            raise ConfigError(f"--beside must be >= 0 and needs --where host, got {self.beside}")
        if "host" in self.where:
            if "grouped" not in self.paths:
                raise ConfigError("--where host runs the grouped path only (the per-expert path would run on the host)")
            worst = max(self.tokens)
            if worst > MAX_GROUP_TOKENS or worst * self.top_k > DEVICE_ROUTING_MAX_PAIRS:
                raise ConfigError(
                    f"--where host runs the mapped route's device table: at most {MAX_GROUP_TOKENS} tokens and "
                    f"{DEVICE_ROUTING_MAX_PAIRS} (token, expert) pairs a call, got {worst} x top-{self.top_k}"
                )


@dataclass
class Placement:
    """Where a format's experts live for the kernels: their blocks in expert order and, for host blocks, the mapped
    route's view of them (byte offsets from a device anchor block; None for device blocks, which ``run_experts``
    takes as they are)."""

    where: str
    experts: list[ExpertWeights]
    routed: LayerBlocks | None = None


def host_placement(host_experts: list[ExpertWeights], anchor: ExpertWeights) -> Placement:
    """Pinned host blocks as the mapped route addresses them (:meth:`MappedExperts._layer_blocks`): each block's
    byte offset from ``anchor``'s device block, which the kernels read through the mapped address."""
    if not all(w.block.is_pinned() for w in host_experts):
        raise ConfigError("--where host needs pinned host blocks (the GPU reads only pinned memory)")
    probe = torch.empty((1, 1), dtype=torch.bfloat16, device=anchor.block.device)
    placement = grouped_experts._grouped_placement(probe, [(anchor, 0, 1)])
    if placement is None:
        raise RuntimeError("the grouped kernels are not usable here (no Triton, a block they do not take, or failed)")
    base = anchor.block.data_ptr()
    deltas = [w.block.data_ptr() - base for w in host_experts]
    align = 16 if base % 16 == 0 and all(d % 16 == 0 for d in deltas) else 1
    offsets = torch.tensor(deltas, dtype=torch.int64, device=anchor.block.device)
    return Placement("host", host_experts, LayerBlocks(anchor, offsets, align, placement))


class CallMaker:
    """Decode calls of ``tokens`` rows, each row with ``top_k`` experts of its own, cycling over the experts."""

    def __init__(self, cfg: GpuExpertsBenchConfig, place: Placement, device: torch.device) -> None:
        self.cfg, self.place, self.device, self.next = cfg, place, device, 0
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        first = place.experts[0].block
        self.expert_bytes = first.numel() * first.element_size()

    def call(self, tokens: int) -> dict[str, Any]:
        """The arguments of one :func:`run_experts` call: expert-sorted pairs, one group per expert; and the same
        pairs as the host route's ``topk_ids`` / ``topk_weights`` ``[tokens, top_k]``."""
        hidden = torch.randn(tokens, self.cfg.hidden, generator=self.gen).to(torch.bfloat16)
        top_k, count = self.cfg.top_k, len(self.place.experts)
        pair_tokens = torch.arange(tokens).repeat(top_k)  # group g serves token g % tokens
        ids = [(self.next + pair) % count for pair in range(pair_tokens.numel())]
        self.next = (self.next + pair_tokens.numel()) % count
        gates = torch.rand(pair_tokens.numel(), generator=self.gen).to(torch.bfloat16)
        by_token = lambda values: values.view(top_k, tokens).t().contiguous().to(self.device)  # noqa: E731
        return {
            "out": torch.zeros(tokens, self.cfg.hidden, device=self.device),
            "hidden": hidden.to(self.device),
            "pair_tokens": pair_tokens.to(self.device),
            "pair_gates": gates.to(self.device),
            "groups": bind(ids, self.place),
            "swiglu_limit": self.cfg.swiglu_limit,
            "pair_tokens_host": pair_tokens,
            "per_token": top_k,
            "expert_ids": ids,
            "topk_ids": by_token(torch.tensor(ids, dtype=torch.int64)),
            "topk_weights": by_token(gates),
        }


def bind(ids: list[int], place: Placement) -> list[tuple[ExpertWeights, int, int]]:
    """The groups of a call's pairs (pair ``p`` is expert ``ids[p]``'s only pair) over ``place``'s blocks."""
    return [(place.experts[e], start, 1) for start, e in enumerate(ids)]


def check_grouped(call: dict[str, Any], place: Placement) -> None:
    """Raise unless the grouped kernels take this call (and have not failed: ``run_experts`` would then have
    run the per-expert path under the grouped label)."""
    if place.routed is not None:
        tokens, top_k = call["topk_ids"].shape
        usable = device_routing_fits(call["hidden"], tokens, tokens * top_k)
    else:
        usable = grouped_experts.grouped_usable(call["hidden"], call["groups"])
    if not usable:
        raise RuntimeError("the grouped kernels are not usable here (no Triton, a block they do not take, or failed)")


def run_path(path: str, call: dict[str, Any], place: Placement) -> torch.Tensor:
    """Run one call on ``path`` over ``place``'s blocks (see :func:`check_grouped`); returns its accumulator."""
    if place.routed is not None:  # host blocks: the mapped route's launch (device table, no host sync)
        args = (call["out"], call["hidden"], call["topk_ids"], call["topk_weights"], place.routed)
        run_routed(*args, call["swiglu_limit"])
    elif path == "grouped":
        grouped_experts.run_experts(**{k: call[k] for k in _EXPERTS_ARGS})  # the call decode makes: checks included
    else:
        grouped_experts.run_per_expert(**{k: call[k] for k in _EXPERTS_ARGS[:-2]})
    return call["out"]


def time_path(maker: CallMaker, path: str, tokens: int) -> dict[str, Any]:
    """Device and host time of ``cfg.calls`` calls each (arguments made beforehand).

    Device: the stream is first held by a sleep kernel long enough for the host to queue every call, so
    each call's pair of device events spans its kernels alone (not the host's launch gaps). Host: what
    queueing one call costs (Python, the launch tables, the launches), which decode pays per MoE layer,
    timed in a second pass that waits for the device every few calls, as decode does (a stream held for
    the whole pass would keep torch's pinned blocks from being reused, and time their allocation).
    """
    cfg, place = maker.cfg, maker.place
    calls = [maker.call(tokens) for _ in range(cfg.warmup + 2 * cfg.calls)]
    if path == "grouped":
        check_grouped(calls[0], place)
    for call in calls[: cfg.warmup]:  # compiled
        run_path(path, call, place)
    torch.cuda.synchronize()
    timed, hosted = calls[cfg.warmup : cfg.warmup + cfg.calls], calls[cfg.warmup + cfg.calls :]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in timed]
    torch.cuda._sleep(int(_SLEEP_CYCLES_PER_CALL * cfg.calls))
    for call, (begin, end) in zip(timed, events, strict=True):
        begin.record()
        run_path(path, call, place)
        end.record()
    torch.cuda.synchronize()
    host = []
    for i, call in enumerate(hosted):
        started = time.perf_counter()
        run_path(path, call, place)
        host.append(1e6 * (time.perf_counter() - started))
        if i % 4 == 3:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    if path == "grouped":
        check_grouped(calls[0], place)  # no failure fell back to the per-expert path mid-run
    us = stats([1e3 * b.elapsed_time(e) for b, e in events])
    call_bytes = tokens * cfg.top_k * maker.expert_bytes
    return {
        "path": path,
        "where": place.where,
        "tokens": tokens,
        "call_bytes": call_bytes,
        "us_per_call": us,
        "host_us_per_call": stats(host),
        "gbps": call_bytes / (us["median"] / 1e6) / 1e9,
        "gbps_best": call_bytes / (us["min"] / 1e6) / 1e9,
    }


def relative_rms(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm() / ref.norm()).item()


def grouped_error(maker: CallMaker, tokens: int) -> float:
    """Relative RMS distance of the grouped kernels' output from the per-expert path's on one call."""
    call = maker.call(tokens)
    check_grouped(call, maker.place)
    ref = run_path("per-expert", {**call, "out": call["out"].clone()}, maker.place)
    return relative_rms(run_path("grouped", call, maker.place), ref)


def grouped_output(call: dict[str, Any], place: Placement) -> torch.Tensor:
    """The grouped path's output of ``call`` (made for any placement) over ``place``'s blocks."""
    call = {**call, "out": torch.zeros_like(call["out"]), "groups": bind(call["expert_ids"], place)}
    check_grouped(call, place)
    return run_path("grouped", call, place)


def kernel_times(maker: CallMaker, tokens: int, calls: int = 10) -> dict[str, float]:
    """Device microseconds per call of each kernel the grouped path launches (one profiled pass)."""
    from torch.profiler import ProfilerActivity, profile

    work = [maker.call(tokens) for _ in range(calls)]
    check_grouped(work[0], maker.place)
    run_path("grouped", maker.call(tokens), maker.place)  # compiled before profiling
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in work:
            run_path("grouped", call, maker.place)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:  # older torch
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us > 0:
            out[event.key] = device_us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def beside_row(maker: CallMaker, tokens: int, passes: int, repeats: int = 9, high: bool = False) -> dict[str, Any]:
    """Host calls of ``tokens`` alone, ``passes`` passes of a layer's backbone linears alone on a second stream, and
    both at once (:mod:`moetier.bench.beside_work`); ``high``: the second stream at the device's highest priority,
    so that the block scheduler starts the linears' programs before the call's queued ones."""
    calls = iter([maker.call(tokens) for _ in range(2 * repeats + 1)])

    def one_call() -> None:
        run_path("grouped", next(calls), maker.place)

    side = beside_work.side_stream(high)
    work = beside_work.graphed(beside_work.backbone_linears(tokens, passes, maker.device, maker.cfg.seed), side)
    one_call()  # compiled
    return {"passes": passes, "high_priority": high, **beside_work.time_beside(one_call, work, repeats, side)}


def _best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, copies: int = 6) -> float:
    best = float("inf")
    for _ in range(copies):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return best


def hbm_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth: bytes read plus bytes written per second by the best of 6 copies of
    ``nbytes`` (1e9 bytes/s), the rate device blocks' reads are judged against."""
    src = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    return 2 * nbytes / _best_copy_seconds(torch.empty_like(src), src) / 1e9


def _kernel(kernels: dict[str, float], part: str) -> float | None:
    """The device us of the grouped kernel whose name holds ``part`` (gate_up, down, sum), if profiled."""
    return next((us for name, us in kernels.items() if name.startswith(f"_{part}_")), None)


def make_places(cfg: GpuExpertsBenchConfig, fmt: str, device: torch.device) -> list[Placement]:
    """``cfg.experts`` random experts of ``fmt`` in each of ``cfg.where``, in that order."""
    layout, host_experts = make_experts(cfg, fmt)  # pinned on CUDA hosts: the copies to the device are DMAs
    places = {}
    if "device" in cfg.where:
        places["device"] = Placement(
            "device", [ExpertWeights.from_block(w.block.to(device), layout) for w in host_experts]
        )
    if "host" in cfg.where:
        # The kernels' base pointer: a device block of the layout (the mapped route's: a cache slot), read by none.
        if "device" in places:
            anchor = places["device"].experts[0]
        else:
            anchor = ExpertWeights.from_block(torch.empty_like(host_experts[0].block, device=device), layout)
        places["host"] = host_placement(host_experts, anchor)
    return [places[where] for where in cfg.where]


def bench_format(cfg: GpuExpertsBenchConfig, fmt: str, device: torch.device) -> tuple[dict[str, Any], list[dict]]:
    """Every (where, tokens, fp4 blocks, path) of one expert format, and its accuracy.

    Grouped rows carry their kernels' device times and ``rel_vs_default``: the distance of their output on one
    fixed call per tokens from the default fp4 blocks' output on the first ``--where`` (host and device blocks,
    and any blocks, compute the same sums: ~0, or the last bits of a float32 sum order). The per-expert path
    runs on device blocks only, once (fp4 blocks do not touch it)."""
    makers = [CallMaker(cfg, place, device) for place in make_places(cfg, fmt, device)]
    default, configs = Fp4Blocks(), cfg.fp4_blocks if fmt.startswith("fp4") else [None]
    checks = {t: makers[0].call(t) for t in cfg.tokens}  # one fixed call per tokens, for every (where, blocks)
    with grouped_experts.fp4_blocks(default):
        refs = {t: grouped_output(call, makers[0].place) for t, call in checks.items()}
    rows = []
    for maker, t in ((m, t) for m in makers for t in cfg.tokens):
        for blocks in configs:
            paths = cfg.paths if maker.place.where == "device" and blocks == configs[0] else ["grouped"]
            with grouped_experts.fp4_blocks(blocks or default):
                for path in (p for p in paths if p in cfg.paths):
                    row = {
                        "format": fmt,
                        "fp4_blocks": None if blocks is None else str(blocks),
                        **time_path(maker, path, t),
                    }
                    if path == "grouped":
                        row["kernel_us"] = kernel_times(maker, t)
                        row["rel_vs_default"] = relative_rms(grouped_output(checks[t], maker.place), refs[t])
                        if cfg.beside and maker.place.where == "host":
                            row["beside"] = beside_row(maker, t, cfg.beside)
                            row["beside_high"] = beside_row(maker, t, cfg.beside, high=True)
                    rows.append(row)
    expert_bytes = makers[0].expert_bytes
    info: dict[str, Any] = {"expert_bytes": expert_bytes, "all_experts_bytes": cfg.experts * expert_bytes}
    if devices := [m for m in makers if m.place.where == "device"]:
        with grouped_experts.fp4_blocks(default):
            info["grouped_vs_per_expert_rel"] = {str(t): grouped_error(devices[0], t) for t in cfg.tokens}
    return info, rows


def run_bench(cfg: GpuExpertsBenchConfig) -> dict[str, Any]:
    cfg.validate()
    if not torch.cuda.is_available():
        raise ConfigError("bench gpu-experts measures the CUDA expert kernels; this machine has no CUDA device")
    device = torch.device("cuda")
    copy = {"hbm_gbps": hbm_copy_gbps()}
    if "host" in cfg.where:
        copy["h2d_gbps"] = h2d_gbps(1 << 29)  # the pinned copy engine's rate: host blocks' reads are judged by it
    torch.cuda.empty_cache()
    formats, results = {}, []
    for fmt in cfg.formats:  # one format's experts in memory at a time
        formats[fmt], rows = bench_format(cfg, fmt, device)
        for row in rows:
            row["x_copy"] = row["gbps"] / copy["h2d_gbps" if row["where"] == "host" else "hbm_gbps"]
        results += rows
        torch.cuda.empty_cache()
    return {
        "kind": KIND,
        "environment": environment(),
        "config": asdict(cfg),
        **copy,
        "formats": formats,
        "results": results,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    cfg = receipt["config"]
    h2d = f", pinned H2D copy {receipt['h2d_gbps']:.1f} GB/s" if "h2d_gbps" in receipt else ""
    lines = [
        f"GPU expert kernels: {cfg['experts']} cold experts (hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}), calls of top-{cfg['top_k']} x tokens, HBM copy {receipt['hbm_gbps']:.0f} GB/s{h2d}, "
        f"git {receipt['environment']['git_sha']}",
        "",
    ]
    for fmt, info in receipt["formats"].items():
        line = f"- {fmt}: experts of {info['expert_bytes'] / 1e6:.1f} MB as stored"
        if "grouped_vs_per_expert_rel" in info:
            rel = ", ".join(f"{t} tok {v:.1e}" for t, v in info["grouped_vs_per_expert_rel"].items())
            line += f"; grouped vs per-expert {rel}"
        lines.append(line)
    lines += [
        "",
        "Device us: the call's kernels alone (queued behind a sleep); host us: queueing the call (a pass that"
        " waits for the device every 4 calls). x copy: of the HBM copy (device blocks) or the pinned H2D copy (host"
        " blocks). Kernel us: one profiled pass. rel: output's relative RMS distance from the default fp4 blocks'"
        f" on {cfg['where'][0]} blocks.",
        "",
        "| format | path | tokens | where | fp4 blocks NxHxK | device us/call (median [min-max]) | host us/call "
        "| GB/s (median) | x copy | gate_up / down / sum us | rel |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        us, kernels = r["us_per_call"], r.get("kernel_us")
        split = "-"
        if kernels is not None:
            split = " / ".join(
                f"{v:.0f}" if (v := _kernel(kernels, part)) is not None else "?" for part in ("gate_up", "down", "sum")
            )
        rel = f"{r['rel_vs_default']:.1e}" if "rel_vs_default" in r else "-"
        lines.append(
            f"| {r['format']} | {r['path']} | {r['tokens']} | {r['where']} | {r['fp4_blocks'] or '-'} "
            f"| {us['median']:.0f} [{us['min']:.0f}-{us['max']:.0f}] | {r['host_us_per_call']['median']:.0f} "
            f"| {r['gbps']:.1f} | {r['x_copy']:.2f} | {split} | {rel} |"
        )
    return "\n".join(lines + _beside_lines(receipt["results"])) + "\n"


def _beside_lines(results: list[dict[str, Any]]) -> list[str]:
    """The host calls measured beside a layer's backbone linears, if any (:mod:`moetier.bench.beside_work`)."""
    rows = [r for r in results if "beside" in r]
    if not rows:
        return []
    lines = [
        "",
        f"Beside: each host call on one stream, {rows[0]['beside']['passes']} pass(es) of a V4-Flash layer's six fp8"
        " backbone linears at its tokens on a second, alone and together (device us, medians). Hidden share: of the"
        " shorter under the longer (1: fully, 0: one after the other). High: the linears' stream at the device's"
        " highest priority.",
        "",
        "| format | tokens | fp4 blocks | call us | linears us | together us | hidden share "
        "| high: together us | high: hidden share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, high = r["beside"], r.get("beside_high")
        tail = "| - | - |" if high is None else f"| {high['together_us']['median']:.0f} | {high['hidden_share']:.2f} |"
        lines.append(
            f"| {r['format']} | {r['tokens']} | {r['fp4_blocks'] or '-'} | {b['call_us']['median']:.0f} "
            f"| {b['beside_us']['median']:.0f} | {b['together_us']['median']:.0f} | {b['hidden_share']:.2f} {tail}"
        )
    return lines


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=48, help="experts cycled over (more bytes than L2)")
    add_expert_shape_arguments(parser, top_k_help="experts per token")
    parser.add_argument("--tokens", default="1,4", help="comma-separated token rows per call")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated: {', '.join(FORMATS)}")
    parser.add_argument("--paths", default=",".join(PATHS), help="grouped, per-expert or both")
    parser.add_argument(
        "--where",
        default="device",
        help="comma-separated: device (blocks in HBM), host (pinned host blocks read over PCIe, as the mapped "
        "route does; grouped path only)",
    )
    parser.add_argument(
        "--fp4-blocks",
        default=str(Fp4Blocks()),
        help="comma-separated fp4 kernel block sizes N x H x K (gate/up rows per program, down channels per "
        f"program, column step; powers of two) to sweep, e.g. 8x16x1024,8x32x1024 (default {Fp4Blocks()})",
    )
    parser.add_argument("--calls", type=int, default=50, help="timed calls per (format, path, where, blocks, tokens)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--swiglu-limit", type=float, default=10.0, help="DeepSeek-V4's clamp (0: none)")
    parser.add_argument(
        "--beside",
        type=int,
        default=0,
        help="with --where host: also time each host call beside N passes of a V4-Flash layer's backbone linears "
        "on a second stream (can the backbone hide under the mapped reads?); 0: not measured",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = GpuExpertsBenchConfig(
        **expert_shape_options(args),
        formats=parse_names(args.formats),
        paths=parse_names(args.paths),
        where=parse_names(args.where),
        fp4_blocks=parse_fp4_blocks(args.fp4_blocks),
        calls=args.calls,
        warmup=args.warmup,
        swiglu_limit=args.swiglu_limit or None,
        beside=args.beside,
    )
    receipt = run_bench(cfg)
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
