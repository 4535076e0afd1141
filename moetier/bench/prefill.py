"""``moetier bench prefill``: time to first token and prefill tok/s of long prompts under each expert placement.

One loaded model (one pinned home copy of the experts) is measured with each dispatcher, one random
prompt (seeded token ids) per length, fed through the model in chunks of ``chunk_tokens``:

- ``resident``: every expert in VRAM (skipped when they do not fit);
- ``sync``: per MoE layer call, every used expert is copied to the device first, the copy is waited
  for, and only then do the experts compute: no overlap (how KTransformers and llama.cpp prefill);
- ``tiered``: the :class:`TieredDispatcher` with a ``cache_fraction`` VRAM cache and its miss routing
  (streaming prefill: fat experts stream through the staging ring with cross-layer prefetch, thin
  ones run on the CPU tier);
- ``copy`` / ``cpu``: the same with every miss copied / on the CPU tier (the pure paths that
  CPU-assisted short turns must beat; not in the default set).

Each result carries the distinct experts touched per layer per chunk, the bytes copied, and its ratio
to ``sync``, to ``resident`` and to the streaming bound ``sum over chunks of bytes_touched(chunk) /
PCIe_bw`` (host DRAM bandwidth stands in off CUDA), all from the same run; where ``resident`` ran at
that length, also to the overlap bound ``min(PCIe bound, resident)`` (streaming cannot beat the
compute either). ``--profile`` adds, per profiled mode, a torch-profiler summary of two chunks: how
long the copy engine and the kernels were busy and how much of the copy time the kernels hid
(:mod:`moetier.bench.overlap`). A prompt length whose
attention workspace would not fit the free memory (an estimate, see :func:`attention_bytes`) is
skipped with a note rather than crashing the run. With ``routing_trace``, every measured dispatcher
routes from that recorded trace (:mod:`moetier.bench.trace_routing`), rewound before each repeat.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.bench import trace_routing
from moetier.bench.bandwidth import measure_bounds
from moetier.bench.common import (
    add_placement_arguments,
    fmt,
    load_checkpoint,
    parse_int_list,
    placement_options,
    resident_store,
    stats,
    sync_device,
    write_receipt_files,
)
from moetier.bench.environment import environment
from moetier.bench.host_profile import host_profile_lines, profile_host
from moetier.errors import ConfigError
from moetier.kernels.grouped_experts import run_experts
from moetier.models.base import CausalLM
from moetier.models.deepseek_v4_attention import workspace_bytes as v4_workspace_bytes
from moetier.tiers.call_routing import sort_pairs_for_device
from moetier.tiers.dispatcher import ExpertDispatcher, ResidentDispatcher
from moetier.tiers.experts import ExpertStore, ExpertWeights
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.tiered_dispatcher import TieredDispatcher

MODES = ("resident", "sync", "tiered", "copy", "cpu")
DEFAULT_MODES = ("resident", "sync", "tiered")
PROFILED_MODES = ("sync", "copy", "tiered")


@dataclass
class PrefillBenchConfig:
    """What to measure; validated on construction."""

    model: Path
    prompt_lens: list[int] = field(default_factory=lambda: [8192, 32768])
    chunk_tokens: int = 512
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    cache_fraction: float = 0.05
    policy: str = "lfu"
    repeats: int = 1
    dtype: str = "bf16"
    device: str | None = None
    cpu_threads: int | None = None
    seed: int = 0
    quick_bounds: bool = False
    memory_budget_bytes: int | None = None  # replaces the measured free memory in the skip check (tests)
    staging_slots: int | None = None  # tiered modes' staging ring (default: the dispatcher's)
    profile: bool = False
    host_profile: bool = False  # cProfile of two chunks, per mode (moetier.bench.host_profile)
    routing_trace: Path | None = None  # replay this recorded routing (see moetier.bench.trace_routing)
    expert_format: str = "dense"  # "fp8": the experts' home copy as an fp8 checkpoint stores them
    backbone_format: str = "fp8"  # "dense": backbone linears dequantised at load (moetier.models.fp8_linear)

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        self.routing_trace = None if self.routing_trace is None else Path(self.routing_trace)
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown:
            raise ConfigError(f"unknown prefill bench mode(s) {unknown}; choose from {list(MODES)}")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ConfigError(f"--prompt-lens must be positive integers, got {self.prompt_lens}")
        if self.chunk_tokens < 1 or self.repeats < 1:
            raise ConfigError("--chunk-tokens and --repeats must be >= 1")
        if self.staging_slots is not None and self.staging_slots < 1:
            raise ConfigError(f"--staging-slots must be >= 1, got {self.staging_slots}")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ConfigError(f"--cache-fraction must be in [0, 1], got {self.cache_fraction}")


# --- the synchronous baseline -------------------------------------------------------------------


class SyncCopyDispatcher(ExpertDispatcher):
    """Copy-then-compute: every expert a call uses is copied to the device, waited for, then computed.

    No cache and no overlap: the copies of a call (at most ``staging_experts`` at a time, default a
    whole layer) all land before the first expert computes, as in KTransformers' layer-wise prefill
    and llama.cpp's per-micro-batch expert copies. ``metrics`` counts like the tiered dispatcher's
    (every used expert is a miss); ``copy_seconds`` is the time spent waiting for the copies.
    ``trace``, when a list, receives ``("copy" | "compute", layer, expert)`` in the order issued.
    """

    def __init__(self, store: ExpertStore, staging_experts: int | None = None, trace: list | None = None) -> None:
        super().__init__(store)
        self.staging_experts = staging_experts or store.layout.num_experts
        self.metrics = TierMetrics()
        self.copy_seconds = 0.0
        self.trace = trace
        self._staging: torch.Tensor | None = None
        self._first_layer = min(store.layout.moe_layers)

    def _buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < rows or self._staging.device != device:
            self._staging = torch.empty(
                (rows, self.store.layout.block_numel), dtype=self.store.block_dtype, device=device
            )
        return self._staging

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        if hidden.shape[0] == 0:
            return out.to(hidden.dtype)
        if layer == self._first_layer:
            self.metrics.tokens += hidden.shape[0]
        # The pair sort every placement uses (on the device for a chunk), so only the copies' timing differs.
        sorted_pairs = sort_pairs_for_device(topk_ids, topk_weights, self.store.layout.num_experts)
        order_host, experts_l, counts_l, tokens_of_pair, gates_of_pair = sorted_pairs
        self._count(layer, experts_l, counts_l)
        top_k = topk_ids.shape[1]
        tokens_host = order_host // top_k
        starts = [0, *torch.tensor(counts_l).cumsum(0).tolist()]
        for first in range(0, len(experts_l), self.staging_experts):
            batch = range(first, min(first + self.staging_experts, len(experts_l)))
            staged = self._copy_all(layer, [experts_l[i] for i in batch], hidden.device)
            if self.trace is not None:
                self.trace += [("compute", layer, experts_l[i]) for i in batch]
            # The experts compute as every placement computes them (run_experts: the same kernels), so the
            # baseline differs from the tiered path only in when its copies run.
            groups = [
                (ExpertWeights.from_block(staged[row], self.store.layout), starts[i], counts_l[i])
                for row, i in enumerate(batch)
            ]
            limit = self.store.layout.swiglu_limit
            run_experts(out, hidden, tokens_of_pair, gates_of_pair, groups, limit, tokens_host, top_k)
        return out.to(hidden.dtype)

    def _copy_all(self, layer: int, experts: list[int], device: torch.device) -> torch.Tensor:
        """Copy the experts' blocks into the staging buffer and wait until all have landed."""
        staged = self._buffer(len(experts), device)
        sync_device(device)  # the copies start once earlier compute is done: nothing overlaps
        start = time.perf_counter()
        for row, expert in enumerate(experts):
            if self.trace is not None:
                self.trace.append(("copy", layer, expert))
            staged[row].copy_(self.store.expert(layer, expert).block, non_blocking=True)
        sync_device(device)
        self.copy_seconds += time.perf_counter() - start
        return staged

    def _count(self, layer: int, experts: list[int], counts: list[int]) -> None:
        self.metrics.record_routing(layer, experts, counts)
        counters = self.metrics.layer(layer)
        counters.calls += 1
        counters.experts_miss += len(experts)
        counters.uses_miss += sum(counts)
        counters.copy_pairs += sum(counts)
        counters.copy_bytes += len(experts) * self.store.layout.block_bytes(self.store.dtype)


# --- memory estimate ----------------------------------------------------------------------------


def attention_bytes(config: Any, prompt_len: int, chunk: int, elem: int) -> int:
    """Estimated peak bytes of the attention path for the last chunk of a ``prompt_len`` prompt.

    DeepSeek-V4 (per sequence): queries run in blocks of bounded workspace, so the transients are the
    largest layer's :func:`~moetier.models.deepseek_v4_attention.workspace_bytes` (one attention or
    indexer block, about ``QUERY_BLOCK_BYTES``, plus tensors linear in the chunk), and what grows with
    the prompt is the cache: every layer's window, compressed entries and (CSA) indexer entries.
    Other families (eager attention): fp32 logits ``[C, heads, L]`` counted three times over (scores,
    masked copy, softmax) plus the KV cache. An estimate for the skip decision, not an accounting.
    """
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = getattr(config, "num_hidden_layers", 1)
    if hasattr(config, "compress_rates") and hasattr(config, "layer_types"):
        peak, cache = 0, 0
        for layer, kind in enumerate(config.layer_types):
            peak = max(peak, v4_workspace_bytes(config, layer, chunk, prompt_len, elem))
            rate = config.compress_rate(layer)
            entries = prompt_len // rate if rate else 0
            index_dim = config.index_head_dim if kind == "compressed_sparse_attention" else 0
            cache += ((config.sliding_window - 1) * head_dim + entries * (head_dim + index_dim)) * elem
        return peak + cache
    kv_heads = getattr(config, "num_key_value_heads", heads)
    return 3 * chunk * heads * prompt_len * 4 + 2 * layers * kv_heads * head_dim * prompt_len * elem


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA; the host's MemAvailable otherwise."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not skip


# --- one measured prefill -----------------------------------------------------------------------


@dataclass
class _Prefill:
    """Timings and per-chunk coverage of one chunked prefill."""

    seconds: float
    first_token: int
    distinct_per_chunk: list[dict[int, int]]  # per chunk: {layer: distinct experts touched}


@torch.inference_mode()
def _prefill_once(model: CausalLM, ids: torch.Tensor, chunk: int, metrics: TierMetrics | None) -> _Prefill:
    """Feed ``ids`` through a fresh cache ``chunk`` tokens at a time; time until the first token is known."""
    cache = model.new_cache(ids.shape[0] + 1)
    device = model.device
    coverage: list[dict[int, int]] = []
    before = metrics.routing_counts() if metrics is not None else {}
    sync_device(device)
    start = time.perf_counter()
    for first in range(0, ids.shape[0], chunk):
        hidden = model(ids[first : first + chunk], cache)
        if metrics is not None:  # routing counts grow where a chunk touched an expert
            after = metrics.routing_counts()
            coverage.append({layer: _grown(before.get(layer, {}), table) for layer, table in after.items()})
            before = after
    token = int(model.compute_logits(hidden[-1:]).argmax(-1))  # .item() waits for the device
    return _Prefill(time.perf_counter() - start, token, coverage)


def _profile_chunks(model: CausalLM, ids: torch.Tensor, chunk: int) -> dict[str, Any]:
    """Profile a prefill of ``ids`` (two chunks): copy-engine and kernel busy time and their overlap."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from moetier.bench.overlap import overlap_summary
    from moetier.bench.trace_kernels import heaviest_kernels

    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _prefill_once(model, ids, chunk, None)
        sync_device(model.device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())
    summary: dict[str, Any] = overlap_summary(events)
    # Where the time went: the device's heaviest kernels, and the host's heaviest ops (a host-bound prefill
    # shows its launches' and waits' time here, not in the kernels').
    summary["heaviest_kernels"] = heaviest_kernels(events)
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    summary["heaviest_host_ops"] = [
        {"name": e.key, "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in host
    ]
    summary["tokens"] = int(ids.shape[0])
    summary["chunk_tokens"] = chunk
    return summary


def _grown(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(1 for expert, count in after.items() if count > before.get(expert, 0))


def _dispatcher(mode: str, store: ExpertStore, cfg: PrefillBenchConfig, device: torch.device, slots: int):
    if mode == "resident":
        resident = resident_store(store, device)
        return None if resident is None else ResidentDispatcher(resident)
    if mode == "sync":
        return SyncCopyDispatcher(store)
    dispatcher = TieredDispatcher(
        store,
        cache_slots=slots,
        policy=cfg.policy,
        cpu_threads=cfg.cpu_threads,
        staging_slots=cfg.staging_slots,
        miss_route="auto" if mode == "tiered" else mode,
    )
    dispatcher.prepare(device)
    return dispatcher


def _measure(
    model: CausalLM,
    dispatcher,
    prompt: torch.Tensor,
    cfg: PrefillBenchConfig,
    replay: trace_routing.TraceRoutingDispatcher | None = None,
) -> dict[str, Any]:
    metrics: TierMetrics | None = getattr(dispatcher, "metrics", None)
    seconds, runs = [], []
    for _ in range(cfg.repeats):
        if replay is not None:
            replay.rewind()  # every repeat (and mode) prefills under the same rows of the trace
        if metrics is not None:
            metrics.reset()
        if isinstance(dispatcher, SyncCopyDispatcher):
            dispatcher.copy_seconds = 0.0
        run = _prefill_once(model, prompt, cfg.chunk_tokens, metrics)
        seconds.append(run.seconds)
        runs.append(run)
    last = runs[-1]
    result: dict[str, Any] = {
        "seconds": seconds,
        "ttft_s": stats(seconds),
        "tok_s": stats([prompt.shape[0] / s for s in seconds]),
        "first_token": last.first_token,
        "first_tokens_agree_across_repeats": len({r.first_token for r in runs}) == 1,
    }
    if metrics is not None:  # traffic of the last repeat
        snap = metrics.snapshot()
        result |= {
            "hit_rate": snap["hit_rate"],
            "copy_bytes": snap["copy_bytes"],
            "admit_bytes": snap["admit_bytes"],
            "cpu_seconds": snap["cpu_seconds"],
            "cpu_pairs": snap["totals"]["cpu_pairs"],
            "copy_pairs": snap["totals"]["copy_pairs"],
            "prefetch_used": snap["totals"]["prefetch_used"],
            "prefetch_wasted": snap["totals"]["prefetch_wasted"],
            "admissions": snap["totals"]["admissions"],
            "distinct_experts_per_chunk": [{str(k): v for k, v in c.items()} for c in last.distinct_per_chunk],
        }
    if isinstance(dispatcher, SyncCopyDispatcher):
        result["copy_wait_seconds"] = dispatcher.copy_seconds
    if replay is not None:
        result["routing_trace_wraps"] = max(replay.wraps.values())
    return result


def _coverage_summary(result: dict[str, Any], block_bytes: int, bandwidth_gbps: float) -> None:
    """Per-layer min/median/max distinct experts per chunk, bytes touched per chunk, the streaming bound."""
    chunks = result["distinct_experts_per_chunk"]
    layers = sorted({layer for c in chunks for layer in c}, key=int)
    result["distinct_experts_per_layer_per_chunk"] = {
        layer: stats([c.get(layer, 0) for c in chunks]) for layer in layers
    }
    touched = [block_bytes * sum(c.values()) for c in chunks]
    result["bytes_touched_per_chunk"] = stats(touched)
    bound_seconds = sum(touched) / (bandwidth_gbps * 1e9)
    result["bound_seconds"] = bound_seconds
    result["bound_tok_s"] = result["prompt_len"] / bound_seconds if bound_seconds else None


def _add_ratios(results: list[dict[str, Any]], block_bytes: int, bandwidth_gbps: float) -> None:
    """Coverage and bound per result (resident borrows the coverage of a mode measured at its length)."""
    by_key = {(r["mode"], r["prompt_len"]): r for r in results}
    for r in results:
        if "distinct_experts_per_chunk" not in r:
            donor = next(
                (by_key.get((m, r["prompt_len"])) for m in ("sync", "tiered") if (m, r["prompt_len"]) in by_key), None
            )
            if donor is None:
                continue
            r["distinct_experts_per_chunk"] = donor["distinct_experts_per_chunk"]
            r["coverage_from"] = donor["mode"]
        _coverage_summary(r, block_bytes, bandwidth_gbps)
    for r in results:
        median = r["tok_s"]["median"]
        if r.get("bound_tok_s"):
            r["ratio_to_bound"] = median / r["bound_tok_s"]
            resident = by_key.get(("resident", r["prompt_len"]))
            if resident is not None:
                r["overlap_bound_tok_s"] = min(r["bound_tok_s"], resident["tok_s"]["median"])
                r["ratio_to_overlap_bound"] = median / r["overlap_bound_tok_s"]
        for base in ("sync", "resident"):
            if (base, r["prompt_len"]) in by_key:
                r[f"ratio_to_{base}"] = median / by_key[(base, r["prompt_len"])]["tok_s"]["median"]


def run_prefill_bench(cfg: PrefillBenchConfig) -> dict[str, Any]:
    """Measure every mode at every prompt length; return the receipt (not yet written)."""
    started = time.time()
    trace, trace_info = trace_routing.load_for_bench(cfg.routing_trace, cfg.model)  # fails before the weights load
    bounds = measure_bounds(quick=cfg.quick_bounds)
    load_start = time.perf_counter()
    loaded, device, arena = load_checkpoint(cfg.model, cfg.dtype, cfg.device, cfg.expert_format, cfg.backbone_format)
    load_seconds = time.perf_counter() - load_start
    model, store = loaded.model, loaded.store
    layout = store.layout
    total_experts = len(layout.moe_layers) * layout.num_experts
    slots = int(round(cfg.cache_fraction * total_experts))
    block_bytes = layout.block_bytes(store.dtype)
    bandwidth_name = "h2d_pinned_gbps" if bounds.get("h2d_pinned_gbps") else "host_read_gbps"
    generator = torch.Generator().manual_seed(cfg.seed)
    prompts = {n: torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in cfg.prompt_lens}
    elem = torch.empty((), dtype=store.dtype).element_size()
    results, skipped, notes = [], [], []
    if trace_info is not None:
        notes.append(trace_routing.summary_note(trace_info))
    profiles: dict[str, dict[str, Any]] = {}
    host_profiles: dict[str, dict[str, Any]] = {}
    for mode in cfg.modes:
        dispatcher = _dispatcher(mode, store, cfg, device, slots)
        if dispatcher is None:
            notes.append(f"{mode}: skipped, {store.total_bytes() / 1e9:.1f} GB of experts do not fit in free VRAM")
            continue
        replay = None if trace is None else trace_routing.TraceRoutingDispatcher(dispatcher, trace)
        model.use_dispatcher(replay or dispatcher)
        warmed = False
        for length in cfg.prompt_lens:
            chunk = min(cfg.chunk_tokens, length)
            need = attention_bytes(model.config, length, chunk, elem)
            free = cfg.memory_budget_bytes if cfg.memory_budget_bytes is not None else free_memory_bytes(device)
            if need > 0.8 * free:
                skipped.append(
                    {"mode": mode, "prompt_len": length, "attention_bytes_estimate": need, "free_bytes": free}
                )
                notes.append(
                    f"{mode} @ {length} tokens: skipped, the attention path needs ~{need / 1e9:.2f} GB "
                    f"(estimate) of {free / 1e9:.2f} GB free"
                )
                continue
            if not warmed:  # first-call costs (kernels, allocator, worker threads) stay out of the timings
                _prefill_once(model, prompts[length][:chunk].to(device), chunk, None)
                warmed = True
            result = {"mode": mode, "prompt_len": length, "chunk_tokens": chunk, "chunks": -(-length // chunk)}
            results.append(result | _measure(model, dispatcher, prompts[length].to(device), cfg, replay))
            # Profiled once, at the first length with two full chunks (a steady-state picture).
            if cfg.profile and mode in PROFILED_MODES and mode not in profiles and length >= 2 * chunk:
                profiles[mode] = _profile_chunks(model, prompts[length][: 2 * chunk].to(device), chunk)
            if cfg.host_profile and mode not in host_profiles and length >= 2 * chunk:
                ids = prompts[length][: 2 * chunk].to(device)
                host_profiles[mode] = profile_host(functools.partial(_prefill_once, model, ids, chunk, None))
                host_profiles[mode]["tokens"] = int(ids.shape[0])
        if hasattr(dispatcher, "close"):
            dispatcher.close()
        del dispatcher
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _add_ratios(results, block_bytes, bounds[bandwidth_name])
    return {
        "kind": "prefill",
        "environment": environment(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
        | ({"routing_trace": trace_info} if trace_info is not None else {}),
        "bounds": bounds | {"streaming_bound_uses": bandwidth_name},
        "plan": {
            "moe_layers": len(layout.moe_layers),
            "experts_per_layer": layout.num_experts,
            "top_k": layout.top_k,
            "expert_block_bytes": block_bytes,
            "routed_expert_bytes_total": store.total_bytes(),
            "cache_slots": slots,
            "cache_share_of_experts": slots / total_experts,
            "host_copy_pinned": arena.pinned,
            "host_copy_note": arena.pin_note,
            "load_seconds": load_seconds,
        },
        "results": results,
        "skipped": skipped,
        "profile": profiles,
        "host_profile": host_profiles,
        "notes": notes,
        "wall_seconds": time.time() - started,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    """A Markdown summary of a prefill receipt."""
    plan, bounds = receipt["plan"], receipt["bounds"]
    bandwidth = bounds[bounds["streaming_bound_uses"]]
    lines = [
        f"Prefill, {plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts "
        f"({plan['routed_expert_bytes_total'] / 1e9:.1f} GB routed), cache {plan['cache_slots']} slots "
        f"({100 * plan['cache_share_of_experts']:.1f}% of experts), chunk {receipt['config']['chunk_tokens']} tokens, "
        f"bound from {bounds['streaming_bound_uses']} = {bandwidth:.1f} GB/s, git {receipt['environment']['git_sha']}",
        "",
        "| mode | prompt | TTFT s (median) | tok/s (median [min-max]) | distinct experts/layer/chunk | GB copied "
        "| bound tok/s | x bound | x overlap bound | x sync | x resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        t = r["tok_s"]
        per_layer = r.get("distinct_experts_per_layer_per_chunk") or {}
        coverage = (
            f"{min(s['min'] for s in per_layer.values()):.0f}-{max(s['max'] for s in per_layer.values()):.0f}"
            if per_layer
            else "-"
        )
        copied = r.get("copy_bytes")
        lines.append(
            f"| {r['mode']} | {r['prompt_len']} | {r['ttft_s']['median']:.3f} "
            f"| {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | {coverage} "
            f"| {fmt(None if copied is None else copied / 1e9, 3)} | {fmt(r.get('bound_tok_s'), 1)} "
            f"| {fmt(r.get('ratio_to_bound'))} | {fmt(r.get('ratio_to_overlap_bound'))} "
            f"| {fmt(r.get('ratio_to_sync'))} | {fmt(r.get('ratio_to_resident'))} |"
        )
    for mode, prof in (receipt.get("profile") or {}).items():
        lines.append(
            f"- profile {mode} ({prof['tokens']} tokens): copies busy {prof['copy_busy_s']:.3f} s, kernels busy "
            f"{prof['kernel_busy_s']:.3f} s, overlapped {prof['overlap_s']:.3f} s "
            f"({100 * prof.get('hidden_share_of_shorter', 0.0):.0f}% of the shorter side hidden) "
            f"in a {prof['window_s']:.3f} s window"
        )
        for key, unit in (("heaviest_kernels", "us"), ("heaviest_host_ops", "self_ms")):
            top = ", ".join(f"{g['name'][:48]} x{g['count']} {g[unit]:.1f}" for g in prof.get(key, [])[:6])
            if top:
                lines.append(f"  - {key.replace('_', ' ')} ({unit}): {top}")
    for mode, summary in (receipt.get("host_profile") or {}).items():
        lines += host_profile_lines(f"{mode} ({summary['tokens']} tokens)", summary)
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines) + "\n"


def write_receipt(receipt: dict[str, Any], out_dir: Path) -> Path:
    return write_receipt_files(receipt, out_dir, markdown_table)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_placement_arguments(parser, MODES, "expert cache policy of the tiered mode (lru, lfu, static)")
    parser.set_defaults(modes=",".join(DEFAULT_MODES))
    parser.add_argument("--prompt-lens", default="8k,32k", help="comma-separated prompt lengths (8k = 8192)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill tokens per forward")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick-bounds", action="store_true", help="measure bandwidths on small buffers (smoke runs)")
    parser.add_argument("--staging-slots", type=int, default=None, help="staging ring of the tiered modes")
    parser.add_argument("--profile", action="store_true", help="profile two chunks of sync and tiered: copy overlap")
    parser.add_argument(
        "--host-profile", action="store_true", help="cProfile two chunks of every mode: the host's heaviest functions"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = PrefillBenchConfig(
        **placement_options(args),
        prompt_lens=parse_int_list(args.prompt_lens, "--prompt-lens"),
        chunk_tokens=args.chunk_tokens,
        repeats=args.repeats,
        quick_bounds=args.quick_bounds,
        staging_slots=args.staging_slots,
        profile=args.profile,
        host_profile=args.host_profile,
    )
    receipt = run_prefill_bench(cfg)
    path = write_receipt(receipt, args.out)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
