"""``moetier bench decode``: decode tok/s of one checkpoint under every expert placement, in one run.

The same loaded model (one pinned home copy of the experts) is measured with each dispatcher:

- ``resident``: every expert in VRAM (the upper bound; skipped when they do not fit);
- ``naive``: no cache, every active expert copied over PCIe per step, then computed (the
  baseline of offload systems without a cache or CPU tier);
- ``cpu`` / ``copy``: an expert cache of ``cache_fraction`` of all experts, misses all on the CPU
  tier / all copied in;
- ``tiered``: the same cache, misses split between the CPU tier and the copy path by measured cost;
- ``tiered-host``: ``tiered`` with ``gpu_waits_for_cpu`` off: the host thread, not the compute stream,
  waits for the CPU tier (``tiered`` lets the GPU wait where the driver can, and the receipt says
  when it cannot). Not in the default modes.
- ``tiered-nohint``: ``tiered`` without the next-layer prefetch driven by the model's hints
  (``decode_prefetch=0``, ``mapped_prefetch=0``; ``naive`` never prefetches). Not in the default modes.
- ``mapped``: the same cache, every miss read by the GPU's kernels from the pinned home copy over PCIe
  (``miss_route="mapped"``, ``mapped_cpu_share=0``, :mod:`moetier.tiers.mapped`: no host wait inside a step).
  Not in the default modes (``tiered`` tries it by measured step time where the kernels take the call).
- ``mapped-cpu``: ``mapped`` with the CPU tier beside it, fed by the device: the share of uncached experts that
  balances the two links' measured rates runs on host cores (:mod:`moetier.tiers.mapped_cpu`; still no host
  wait). Not in the default modes (``tiered``'s mapped route is this one where the CPU tier can run).
- ``mapped-cpu-noahead``: ``mapped-cpu`` without the device's reads ahead of the next layer's predicted experts
  during the attention (``mapped_prefetch=0``, :mod:`moetier.tiers.mapped_ahead`): since reads ahead are off by
  default, the same as ``mapped-cpu`` (kept so that earlier A/B commands run; the earlier default, two ahead in
  steps of >= 4 tokens a call, is ``mapped-cpu`` with ``--tiered mapped_prefetch=2``). Not in the default modes.
- ``mapped-cpu-ahead<K>`` (K = 1-4): ``mapped-cpu`` reading K experts ahead at every batch size
  (``mapped_prefetch=K``, ``mapped_prefetch_min_tokens=1``). Not in the default modes.
- ``resident-host``: ``resident`` with launch tables built on the host from the router's ids (one wait
  per MoE layer), where ``resident`` builds them on the device (:mod:`moetier.kernels.device_routing`).
  Not in the default modes.

Each result carries its expert coverage (distinct experts touched per layer), its traffic, and
ratios to the naive baseline, to the resident run and to the bound ``streams * DRAM_bw / missed
bytes per step`` computed from bandwidths measured in the same process (``DRAM_bw``: the larger of the CPU's read
alone and the CPU's and the DMA engine's reads at once, :func:`measure_bounds`); with a resident run, also to the
serial bound (:func:`serial_bound`: the resident step plus the misses at that DRAM rate, one after the other).
With ``hf_baseline``, transformers + accelerate ``device_map="auto"`` under the ``gpu_memory`` budget is measured first
(in a subprocess, see :mod:`moetier.bench.hf_baseline`) and every result gets ``ratio_to_hf``.
With ``routing_trace``, every measured dispatcher routes from that recorded trace instead of the
checkpoint's router (:mod:`moetier.bench.trace_routing`), rewound at the start of each run.
With ``inputs="forced"`` each step is fed tokens drawn from the seed rather than its own greedy output, and the timed
steps run on a fresh run after the split chooser settled: the same inputs after the same context in every mode and
process, for A/B runs whose effect is smaller than the spread that greedy runs' own token streams give.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moetier.bench import hf_baseline, trace_phases, trace_routing
from moetier.bench.bandwidth import measure_bounds
from moetier.bench.common import (
    add_placement_arguments,
    fmt,
    key_json_value,
    load_checkpoint,
    parse_int_list,
    placement_options,
    resident_store,
    stats,
    sync_device,
    write_receipt_files,
)
from moetier.bench.decode_passes import PROFILED_STEPS, clock_steps, profile_steps, python_profile
from moetier.bench.environment import environment
from moetier.engine.sampling import greedy_tokens
from moetier.errors import ConfigError
from moetier.models.base import CausalLM
from moetier.models.paged_kv import KV_LAYOUTS, PagedKVSpace, paged_kv
from moetier.tiers.dispatcher import ExpertDispatcher, ResidentDispatcher
from moetier.tiers.experts import ExpertStore
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.tiered_config import TieredConfig
from moetier.tiers.tiered_dispatcher import TieredDispatcher
from moetier.weights.loader import LoadedModel

MODES = (
    *("resident", "naive", "cpu", "copy", "tiered"),
    *("tiered-host", "tiered-nohint", "resident-host", "mapped", "mapped-cpu", "mapped-cpu-noahead"),
    *("mapped-cpu-ahead1", "mapped-cpu-ahead2", "mapped-cpu-ahead3", "mapped-cpu-ahead4"),
)
DEFAULT_MODES = MODES[:5]
DECODE_INPUTS = ("greedy", "forced")  # what each decode step is fed (DecodeBenchConfig.inputs)
DEFAULT_WARMUP_STEPS = 32


@dataclass
class DecodeBenchConfig:
    """What to measure; validated on construction."""

    model: Path
    streams: list[int] = field(default_factory=lambda: [1, 2, 4])
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    cache_fraction: float = 0.05
    policy: str = "lfu"
    prompt_len: int = 64
    prefill_chunk: int = 2048  # longer prompts are prefilled one stream at a time, this many tokens per call
    # Decode steps before anything is timed, in every mode: the mapped route admits at most two experts a step, so
    # its cache fills over a few dozen steps, which only the split chooser's trial gave the tiered mode (b19f246,
    # 1 stream, 4 warm-up steps: mapped-cpu's hit rate 0.25, tiered's on the same route 0.38).
    warmup: int = DEFAULT_WARMUP_STEPS
    steps: int = 16
    repeats: int = 3
    dtype: str = "bf16"
    device: str | None = None
    cpu_threads: int | None = None
    seed: int = 0
    # "greedy": each step's input is the token the last step produced; "forced": tokens drawn from the seed, the
    # same in every mode and process (the timed steps on a fresh run once the split chooser settled), so that an
    # A/B's runs route alike and its tok/s differ by the change, not by which tokens each run's numerics produced.
    inputs: str = "greedy"
    quick_bounds: bool = False
    profile: bool = False  # add a torch.profiler summary of a few 1-stream decode steps per mode
    host_steps: int = 16  # steps of the clocked pass (host ms per phase) after each timed run, and of the cProfile
    trace: list[str] = field(default_factory=list)  # modes whose profiled 1-stream steps are saved as a Chrome trace
    trace_dir: Path = Path(".")  # where those traces go (the receipt's folder)
    hf_baseline: bool = False  # also measure transformers + accelerate device_map="auto" (a subprocess)
    gpu_memory: str = "24GiB"  # the VRAM budget of that baseline
    host_memory: str | None = None
    hf_args: str = ""  # extra ``moetier bench hf`` flags
    routing_trace: Path | None = None  # replay this recorded routing (see moetier.bench.trace_routing)
    expert_format: str = "dense"  # "fp8" / "fp4": the experts' home copy as the checkpoint stores them
    backbone_format: str = "fp8"  # "dense": backbone linears dequantised at load (moetier.models.fp8_linear)
    kv_layout: str = "contiguous"  # "paged": the streams' caches take blocks from a shared pool (models.paged_kv)
    kv_dtype: str | None = None  # None: the model dtype; "fp8" / "bf16" as the engine's kv_dtype
    # TieredConfig fields every tiered mode but naive runs with (an A/B of one knob in one process).
    tiered_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        self.routing_trace = None if self.routing_trace is None else Path(self.routing_trace)
        unknown = sorted((set(self.modes) | set(self.trace)) - set(MODES))
        if unknown:
            raise ConfigError(f"unknown bench mode(s) {unknown}; choose from {list(MODES)}")
        if not self.streams or min(self.streams) < 1:
            raise ConfigError(f"--streams must be positive integers, got {self.streams}")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ConfigError(f"--cache-fraction must be in [0, 1], got {self.cache_fraction}")
        unknown_options = sorted(set(self.tiered_options) - {f.name for f in fields(TieredConfig)})
        if unknown_options:
            raise ConfigError(f"--tiered: {unknown_options} are not TieredConfig fields")
        TieredConfig(**{"cache_slots": 0, **self.tiered_options})  # the values' checks, before the model loads
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.inputs not in DECODE_INPUTS:
            raise ConfigError(f"--inputs must be one of {', '.join(DECODE_INPUTS)}, got {self.inputs!r}")
        if self.kv_dtype not in (None, "bf16", "fp8"):
            raise ConfigError(f"--kv-dtype must be bf16 or fp8 (default: the model dtype), got {self.kv_dtype!r}")
        if min(self.prompt_len, self.prefill_chunk, self.steps, self.repeats, self.host_steps) < 1 or self.warmup < 0:
            raise ConfigError(
                "--prompt-len, --prefill-chunk, --steps, --repeats and --host-steps must be >= 1 and --warmup >= 0"
            )


class _DecodeRun:
    """Prefill ``streams`` random prompts together, then time greedy decode steps of all streams at once.

    ``prefill()`` and ``step(tokens)`` return the next step's inputs: the greedy tokens they produced (kept as
    ``outputs`` either way) or, with ``cfg.inputs == "forced"``, the next draw of tokens from the seed (every run
    draws the same)."""

    def __init__(self, model: CausalLM, streams: int, cfg: DecodeBenchConfig, vocab: int) -> None:
        self.model, self.streams, self.cfg = model, streams, cfg
        self.prompts = hf_baseline.bench_prompts(cfg.seed, streams, cfg.prompt_len, vocab)
        # Room for the timed steps, or for the clocked / profiled passes' steps (each on a fresh run).
        steps = max(cfg.steps * cfg.repeats, cfg.host_steps, PROFILED_STEPS)
        capacity = cfg.prompt_len + cfg.warmup + _TRIAL_STEPS_CAP + steps + 2  # room for the split trial's warm-up
        space = PagedKVSpace(model.device) if cfg.kv_layout == "paged" else None
        with paged_kv(space):
            self.caches = [model.new_cache(capacity, kv_dtype=cfg.kv_dtype) for _ in range(streams)]
        self.outputs: torch.Tensor | None = None
        # Every step's forced inputs drawn at once and put on the device now (a run takes at most its caches' room
        # in steps): a step then reads its row, with no host-to-device copy (and wait) in the timed steps.
        forced = cfg.inputs == "forced"
        self._forced = _forced_tokens(cfg.seed + 1, capacity - cfg.prompt_len + 1 if forced else 0, streams, vocab)
        self._forced, self._drawn = self._forced.to(model.device), 0

    def _next(self, produced: torch.Tensor) -> torch.Tensor:
        self.outputs = produced
        if self.cfg.inputs == "greedy":
            return produced
        self._drawn += 1
        return self._forced[self._drawn - 1]

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """All prompts in one call, or (longer than ``prefill_chunk``: a long-context decode measurement)
        each stream in chunks, as the engine prefills: the eager attention's scores stay bounded."""
        length, chunk = self.cfg.prompt_len, self.cfg.prefill_chunk
        if length <= chunk:
            ids = torch.cat(self.prompts).to(self.model.device)
            hidden = self.model(ids, self.caches, [length] * self.streams)
            return self._next(greedy_tokens(self.model.compute_logits(hidden.view(self.streams, length, -1)[:, -1])))
        last = []
        for prompt, cache in zip(self.prompts, self.caches, strict=True):
            for start in range(0, length, chunk):
                part = prompt[start : start + chunk].to(self.model.device)
                hidden = self.model(part, [cache], [part.shape[0]])
            last.append(hidden[-1])
        return self._next(greedy_tokens(self.model.compute_logits(torch.stack(last))))

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.model(tokens, self.caches, [1] * self.streams)
        return self._next(greedy_tokens(self.model.compute_logits(hidden)))


def _forced_tokens(seed: int, steps: int, streams: int, vocab: int) -> torch.Tensor:
    """``[steps, streams]`` token ids, uniform over the vocabulary, drawn from ``seed`` on the host (the same ids on
    every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (steps, streams), generator=generator, dtype=torch.long)


# Warm-up steps a decode run may add while the split chooser decides: its trial (3 routes x 2 rounds x 4 steps
# = 24), then a playoff of the pick and every close rival (up to 3 x 24 steps = 72), with room for steps observed
# late (measured: 80-113 on the H200).
_TRIAL_STEPS_CAP = 160


def _time_decode(
    make_run: Callable[[], _DecodeRun], dispatcher: ExpertDispatcher
) -> tuple[list[float], list[int], int]:
    """Seconds per repeat of ``steps`` decode steps (after warm-up), the first stream's tokens from the same
    position in every mode, and the warm-up steps that waited for the dispatcher's split chooser to decide (the
    steady state is measured: the trial's steps, a few dozen of every 256 in serving, are not).

    With forced inputs the timed steps run on a fresh run once the chooser has decided (the same prompts, then the
    warm-up steps): every mode and process then times the same inputs after the same context, and the first
    stream's tokens are its outputs at those steps (a teacher-forced comparison of the modes)."""
    run = make_run()
    cfg, device = run.cfg, run.model.device
    tokens = run.prefill()
    for _ in range(cfg.warmup):
        tokens = run.step(tokens)
    settled, trial_steps, first_stream = getattr(dispatcher, "split_settled", lambda tokens: True), 0, []
    while not settled(run.streams) and trial_steps < _TRIAL_STEPS_CAP:
        tokens = run.step(tokens)
        first_stream.append(run.outputs[0])  # compared at their positions with the modes that warm up less
        trial_steps += 1
    if cfg.inputs == "forced":
        del run, tokens  # its caches go before the fresh run's are made
        run, first_stream = make_run(), []
        tokens = run.prefill()
        for _ in range(cfg.warmup):
            tokens = run.step(tokens)
    metrics = getattr(dispatcher, "metrics", None)
    flush = getattr(dispatcher, "flush_metrics", lambda: None)  # counts the device still holds (mapped route)
    if metrics is not None:
        flush()
        metrics.reset()
    seconds = []
    for _ in range(cfg.repeats):
        sync_device(device)
        start = time.perf_counter()
        for _ in range(cfg.steps):
            tokens = run.step(tokens)
            first_stream.append(run.outputs[0])
        sync_device(device)
        seconds.append(time.perf_counter() - start)
    flush()
    return seconds, [int(t) for t in first_stream[: cfg.steps * cfg.repeats]], trial_steps


def _dispatcher(mode: str, store: ExpertStore, cfg: DecodeBenchConfig, device: torch.device, slots: int):
    if mode in ("resident", "resident-host"):
        resident = resident_store(store, device)
        return None if resident is None else ResidentDispatcher(resident, device_routing=mode == "resident")
    options: dict[str, Any] = {"policy": cfg.policy, "cpu_threads": cfg.cpu_threads}
    if mode == "naive":  # the seed's baseline: every active expert copied when it is needed, nothing ahead
        options |= {"cache_slots": 0, "miss_route": "copy", "calibrate": False, "decode_prefetch": 0}
    else:
        route = "auto" if mode.startswith("tiered") else mode.split("-")[0]
        options |= {"cache_slots": slots, "miss_route": route}
        options["gpu_waits_for_cpu"] = mode != "tiered-host"
        if mode == "mapped":  # the kernels' PCIe reads alone (mapped-cpu: the default share beside them)
            options["mapped_cpu_share"] = 0.0
        if mode == "tiered-nohint":  # tiered without the next-layer prefetch the model's hints drive
            options |= {"decode_prefetch": 0, "mapped_prefetch": 0}
        if mode.endswith("-noahead"):  # the mapped route without its reads ahead during the attention
            options["mapped_prefetch"] = 0
        if "-ahead" in mode:  # a fixed number read ahead at every batch size
            options |= {"mapped_prefetch": int(mode.rsplit("ahead", 1)[1]), "mapped_prefetch_min_tokens": 1}
        options |= cfg.tiered_options
    dispatcher = TieredDispatcher(store, **options)
    dispatcher.prepare(device)
    return dispatcher


def _traffic(dispatcher: ExpertDispatcher, block_bytes: int, steps: int, streams: int) -> dict[str, Any]:
    """Hit rate, misses, bytes moved and expert coverage over the timed window (tiered dispatchers only)."""
    metrics = getattr(dispatcher, "metrics", None)
    if metrics is None:
        return {}
    snap, total, tokens = metrics.snapshot(), metrics.total(), max(1, metrics.tokens)
    return {
        "hit_rate": snap["hit_rate"],
        "expert_hit_rate": snap["expert_hit_rate"],
        "hit_rate_per_layer": {layer: c["hit_rate"] for layer, c in snap["per_layer"].items()},
        "misses_per_token": snap["misses_per_token"],
        # Every missed expert is read from host DRAM once per step, by the CPU tier or by the DMA engine.
        "missed_bytes_per_step": total.experts_miss * block_bytes / steps,
        "copy_bytes_per_token": total.copy_bytes / tokens,
        "mapped_bytes_per_token": total.mapped_bytes / tokens,  # the mapped route's reads over PCIe
        "cpu_pairs_per_token": total.cpu_pairs / tokens,
        "cpu_ms_per_layer_call": 1e3 * total.cpu_seconds / max(1, total.calls),
        # The share of calls made by halves of steps run as two halves alternating layers (decode_halves_min_tokens).
        "half_call_share": total.half_calls / max(1, total.calls),
        # The CPU tier's native jobs: how long their team took to start, how many threads joined (of cpu_threads).
        "cpu_team_start_ms_per_job": 1e3 * total.cpu_team_start_seconds / max(1, total.cpu_jobs_marked),
        "cpu_threads_joined_per_job": total.cpu_threads_joined / max(1, total.cpu_jobs_marked),
        # Next-layer prefetch from the model's hints: experts copied ahead that were used / never needed,
        # and how well the hints predicted (distinct experts per hinted call).
        "prefetch_used_per_step": total.prefetch_used / steps,
        "prefetch_wasted_per_step": total.prefetch_wasted / steps,
        # The mapped route's reads ahead, timed on the device: copy from launch to end, and the call's wait for it.
        "prefetch_copy_ms": 1e3 * total.prefetch_copy_seconds / max(1, total.prefetch_timed),
        "prefetch_wait_ms": 1e3 * total.prefetch_wait_seconds / max(1, total.prefetch_timed),
        "hint_precision": snap["totals"]["hint_precision"],
        "hint_recall": snap["totals"]["hint_recall"],
        "hint_rank_precision": list(getattr(dispatcher, "hint_rank_precision", [])),
        "distinct_experts_per_layer": {str(k): len(v) for k, v in sorted(metrics.routing_counts().items())},
        # Measured / start-up cost of each miss route while decoding (tiers.route_costs.RouteAdapter).
        "route_cost_scales": dict(getattr(getattr(dispatcher, "adapter", None), "scales", {})),
        # The decode split chosen per batch size by measured step time (tiers.split_choice.SplitChooser).
        "split_choices": {str(k): v for k, v in getattr(metrics, "split_choices", dict)().items()},
        # The share of uncached experts the mapped route's fed CPU tier takes (tiers.mapped_cpu; after rebalancing).
        "mapped_cpu_share": _fed_share(dispatcher),
        "mapped_cpu_share_history": list(getattr(_fed(dispatcher), "history", [])),  # (mapped steps, share)
        # Its timed calls: the device's share, and the device's wait after it until the CPU's sums were added.
        "fed_device_ms_per_call": 1e3 * total.fed_device_seconds / max(1, total.fed_timed),
        "fed_late_ms_per_call": 1e3 * total.fed_late_seconds / max(1, total.fed_timed),
        # How those calls were timed (graphed ones by device-clock stamps, or eager timed steps), and the CPU's
        # hand-off per call the stamps measured (tiers.fed_clock.Handoff).
        "fed_timing": getattr(_fed(dispatcher), "timing", None),
        "fed_sums": getattr(_fed(dispatcher), "sums", None),
        "fed_handoff_ms": _fed_handoff_ms(dispatcher),
        "timed_steps": steps,
    }


def _fed(dispatcher: ExpertDispatcher) -> Any:
    return getattr(getattr(dispatcher, "mapped", None), "cpu", None)


def _fed_handoff_ms(dispatcher: ExpertDispatcher) -> float | None:
    handoff = getattr(_fed(dispatcher), "handoff", None)
    return None if handoff is None else 1e3 * handoff.seconds


def _fed_share(dispatcher: ExpertDispatcher) -> float | None:
    fed = _fed(dispatcher)
    return None if fed is None or fed.broken else fed.share


def _result(mode, streams, seconds, traffic, cfg, bounds) -> dict[str, Any]:
    tok_s = [streams * cfg.steps / s for s in seconds]
    result = {"mode": mode, "streams": streams, "tok_s": stats(tok_s), "seconds": seconds, **traffic}
    missed = traffic.get("missed_bytes_per_step")
    if missed:
        result["bound_dram_tok_s"] = streams * bounds["host_read_gbps"] * 1e9 / missed
        result["ratio_to_dram_bound"] = result["tok_s"]["median"] / result["bound_dram_tok_s"]
        if bounds.get("h2d_pinned_gbps"):
            result["bound_pcie_tok_s"] = streams * bounds["h2d_pinned_gbps"] * 1e9 / missed
    return result


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each result's ratios to naive and resident at its stream count, its serial bound and x naive's ceilings
    (:func:`_add_naive_ceilings`), from the medians of the same receipt (older receipts' results too)."""
    by_key = {(r["mode"], r["streams"]): r["tok_s"]["median"] for r in results}
    for r in results:
        for base in ("naive", "resident"):
            if (base, r["streams"]) in by_key:
                r[f"ratio_to_{base}"] = r["tok_s"]["median"] / by_key[(base, r["streams"])]
        resident = by_key.get(("resident", r["streams"]))
        if resident and r.get("bound_dram_tok_s") and r["mode"] != "resident":
            r["bound_serial_tok_s"] = serial_bound(resident, r["bound_dram_tok_s"])
            r["ratio_to_serial_bound"] = r["tok_s"]["median"] / r["bound_serial_tok_s"]
        _add_naive_ceilings(r, by_key.get(("naive", r["streams"])))
        if ("tiered", 1) in by_key and r["mode"] == "tiered":
            r["ratio_to_tiered_1_stream"] = r["tok_s"]["median"] / by_key[("tiered", 1)]


def _add_naive_ceilings(result: dict[str, Any], naive_tok_s: float | None) -> None:
    """The x naive a run would reach at its DRAM bound and at its serial bound: the ceilings that the host's DRAM and
    this run's hit rate put on x naive. A target above the DRAM one needs fewer misses or a faster host, not a
    better split. The bound takes the host-read figure measured at start (:func:`measure_bounds`: the larger of
    the CPU's read alone and beside the DMA engine's copies), so the ceiling is as good as that figure. Receipts
    from before the pair priced misses at the CPU's read alone, which the two links together went past."""
    if not naive_tok_s or result["mode"] == "naive":
        return
    for bound in ("dram", "serial"):
        if result.get(f"bound_{bound}_tok_s"):
            result[f"naive_ratio_at_{bound}_bound"] = result[f"bound_{bound}_tok_s"] / naive_tok_s


def serial_bound(resident_tok_s: float, dram_bound_tok_s: float) -> float:
    """tok/s of a step that is the resident step (backbone, LM head, experts in VRAM) followed by the misses read once
    at the host's DRAM rate: the bound for a tiered step whose expert reads never overlap the backbone (they would
    with reads ahead of the routing, i.e. hints, or with other streams' backbone beside them). The DRAM bound leaves
    the backbone out."""
    return 1.0 / (1.0 / resident_tok_s + 1.0 / dram_bound_tok_s)


def load_for_bench(cfg: DecodeBenchConfig) -> tuple[LoadedModel, torch.device, HostExpertArena]:
    # The backbone loads onto the compute device; the experts' home copy into the (pinned) host arena.
    return load_checkpoint(cfg.model, cfg.dtype, cfg.device, cfg.expert_format, cfg.backbone_format)


def run_decode_bench(cfg: DecodeBenchConfig) -> dict[str, Any]:
    """Measure every mode at every stream count; return the receipt (not yet written)."""
    started = time.time()
    # A bad trace fails here, before the baseline and the weights take their minutes.
    trace, trace_info = trace_routing.load_for_bench(cfg.routing_trace, cfg.model)
    # Before our own load: the baseline's host copy of the weights must be gone when ours is made.
    hf = hf_baseline.run_subprocess(cfg) if cfg.hf_baseline else None
    bounds = measure_bounds(quick=cfg.quick_bounds)
    load_start = time.perf_counter()
    loaded, device, arena = load_for_bench(cfg)
    load_seconds = time.perf_counter() - load_start
    model, store = loaded.model, loaded.store
    layout = store.layout
    total_experts = len(layout.moe_layers) * layout.num_experts
    slots = int(round(cfg.cache_fraction * total_experts))
    block_bytes = layout.block_bytes(store.dtype)
    vocab = model.config.vocab_size
    results, tokens_by_mode, notes, profiles = [], {}, [], {}
    if trace_info is not None:
        notes.append(trace_routing.summary_note(trace_info))
    for mode in cfg.modes:
        dispatcher = _dispatcher(mode, store, cfg, device, slots)
        if dispatcher is None:
            notes.append(f"{mode}: skipped, {store.total_bytes() / 1e9:.1f} GB of experts do not fit in free VRAM")
            continue
        if mode in ("cpu", "tiered") and not dispatcher.gpu_waits_for_cpu:
            notes.append(f"{mode}: the host thread waited for the CPU tier (no CUDA stream memory operations here)")
        replay = None if trace is None else trace_routing.TraceRoutingDispatcher(dispatcher, trace)
        model.use_dispatcher(replay or dispatcher)
        for streams in cfg.streams:
            if replay is not None:
                replay.rewind()  # every mode and stream count replays the trace from its first row
            seconds, tokens, trial_steps = _time_decode(partial(_DecodeRun, model, streams, cfg, vocab), dispatcher)
            traffic = _traffic(dispatcher, block_bytes, cfg.steps * cfg.repeats, streams)
            traffic["split_trial_warmup_steps"] = trial_steps
            if replay is not None:
                traffic["routing_trace_wraps"] = max(replay.wraps.values())
            results.append(_result(mode, streams, seconds, traffic, cfg, bounds))
            results[-1]["host_ms_per_step"] = clock_steps(_DecodeRun(model, streams, cfg, vocab), cfg.host_steps)
            tokens_by_mode.setdefault(streams, {})[mode] = tokens
        if cfg.profile or mode in cfg.trace:
            trace_path = Path(cfg.trace_dir) / f"decode-trace-{mode}.json.gz" if mode in cfg.trace else None
            profiles[mode] = profile_steps(_DecodeRun(model, 1, cfg, vocab), trace_path=trace_path)
            profiles[mode] += "\n" + python_profile(_DecodeRun(model, 1, cfg, vocab), cfg.host_steps)
            if trace_path is not None and (note := trace_phases.trace_note(mode, trace_path)):
                notes.append(note)
        if choices := getattr(getattr(dispatcher, "metrics", None), "split_choices", dict)():
            notes.append(f"{mode}: decode split chosen by measured step time, per tokens per call: {choices}")
        if note := _cpu_team_note(mode, [r for r in results if r["mode"] == mode]):
            notes.append(note)
        if hasattr(dispatcher, "close"):
            dispatcher.close()
        del dispatcher
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf_baseline.merge_into_decode(results, notes, hf)
    add_ratios(results)
    hf_baseline.add_hf_ratios(results)
    return {
        "kind": "decode",
        "environment": environment(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
        | ({"routing_trace": trace_info} if trace_info is not None else {}),
        "bounds": bounds,
        "plan": {
            "moe_layers": len(layout.moe_layers),
            "experts_per_layer": layout.num_experts,
            "top_k": layout.top_k,
            "expert_block_bytes": block_bytes,
            "routed_expert_bytes_total": store.total_bytes(),
            "routed_expert_bytes_per_token": layout.top_k * len(layout.moe_layers) * block_bytes,
            "cache_slots": slots,
            "cache_share_of_experts": slots / total_experts,
            # VRAM of the backbone as loaded (fp8-block linears kept so with backbone_format "fp8")
            "backbone_bytes": sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]),
            "host_copy_pinned": arena.pinned,
            "host_copy_note": arena.pin_note,
            "load_seconds": load_seconds,
        },
        "results": results,
        "greedy_tokens_agree": _agreement(tokens_by_mode),
        "notes": notes,
        "profiles": profiles,
        "hf_baseline": hf,
        "wall_seconds": time.time() - started,
    }


def _agreement(tokens_by_mode: dict[int, dict[str, list[int]]]) -> dict[str, float]:
    """Share of the first stream's greedy tokens each mode shares with the first mode measured."""
    out = {}
    for streams, per_mode in tokens_by_mode.items():
        reference = next(iter(per_mode.values()))
        for mode, tokens in per_mode.items():
            same = sum(a == b for a, b in zip(tokens, reference, strict=False))
            out[f"{mode}@{streams}"] = same / max(1, len(reference))
    return out


def _pair(result: dict[str, Any], first: str, second: str, digits: int) -> str:
    """``first / second`` (``-`` for either one the result lacks: a run without a resident one has no serial bound),
    or ``-`` alone without ``first``."""
    if first not in result:
        return "-"
    return f"{fmt(result[first], digits)} / {fmt(result.get(second), digits)}"


def _cpu_team_note(mode: str, results: list[dict[str, Any]]) -> str | None:
    """The CPU tier's native jobs per stream count: their team's start and the threads that joined (None without)."""
    marked = [r for r in results if r.get("cpu_threads_joined_per_job", 0) > 0]
    if not marked:
        return None
    parts = [
        f"{r['streams']}: {r['cpu_team_start_ms_per_job']:.3f} ms, {r['cpu_threads_joined_per_job']:.1f} threads"
        for r in marked
    ]
    return f"{mode}: CPU-tier jobs' team start and threads joined, by streams: {'; '.join(parts)}"


def _host_read(bounds: dict[str, Any]) -> str:
    """The DRAM rate the bounds use, and what it was measured as (receipts before the DMA pair carry neither)."""
    text = f"{bounds['host_read_gbps']:.1f} GB/s"
    if "host_read_cpu_gbps" not in bounds:
        return text
    beside = bounds["host_read_beside_dma"]
    if not beside:
        return text + " (the CPU's read alone: no DMA engine to read beside it)"
    return text + (
        f" (the larger of: CPU alone {bounds['host_read_cpu_gbps']:.1f}; CPU {beside['cpu']:.1f} + DMA "
        f"{beside['dma']:.1f} at once = {beside['total']:.1f})"
    )


def markdown_table(receipt: dict[str, Any]) -> str:
    """A Markdown summary of a decode receipt."""
    plan, bounds = receipt["plan"], receipt["bounds"]
    lines = [
        f"Decode, {plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts "
        f"({plan['routed_expert_bytes_total'] / 1e9:.1f} GB routed), cache {plan['cache_slots']} slots "
        f"({100 * plan['cache_share_of_experts']:.1f}% of experts), host read {_host_read(bounds)}, "
        f"H2D {bounds['h2d_pinned_gbps'] or 0:.1f} GB/s, backbone {plan.get('backbone_bytes', 0) / 1e9:.2f} GB "
        f"({receipt['config'].get('backbone_format', 'dense')}), git {receipt['environment']['git_sha']}",
        "",
        "| mode | streams | tok/s (median [min-max]) | x naive | x resident | x hf | hit rate | DRAM bound tok/s "
        "| x bound | x serial bound | x naive at DRAM / serial bound | prefetched used / wasted per step "
        "| hint precision / recall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        t = r["tok_s"]
        lines.append(
            f"| {r['mode']} | {r['streams']} | {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] "
            f"| {fmt(r.get('ratio_to_naive'))} | {fmt(r.get('ratio_to_resident'))} | {fmt(r.get('ratio_to_hf'))} "
            f"| {fmt(r.get('hit_rate'))} "
            f"| {fmt(r.get('bound_dram_tok_s'), 1)} | {fmt(r.get('ratio_to_dram_bound'))} "
            f"| {fmt(r.get('ratio_to_serial_bound'))} "
            f"| {_pair(r, 'naive_ratio_at_dram_bound', 'naive_ratio_at_serial_bound', 2)} "
            f"| {_pair(r, 'prefetch_used_per_step', 'prefetch_wasted_per_step', 1)} "
            f"| {_pair(r, 'hint_precision', 'hint_recall', 2)} |"
        )
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines + _host_phase_table(receipt["results"])) + "\n"


# The phases worth a column, in the order a layer runs them; others a receipt holds stay in its JSON.
_PHASE_COLUMNS = (
    "segments", "tiers.step_start", "v4.attend", "v4.dispatch", "tiers.wait", "tiers.route", "tiers.split",
    "tiers.policy", "tiers.copy_submit", "tiers.cpu_submit", "tiers.to_device", "tiers.device", "tiers.after",
    "tiers.cpu_sums", "tiers.cpu_wait", "tiers.cpu_job", "tiers.mapped",
)  # fmt: skip


def _host_phase_table(results: list[dict[str, Any]]) -> list[str]:
    """Host ms per step in each phase (``host_ms_per_step``), one row per result that has them."""
    rows = [r for r in results if r.get("host_ms_per_step")]
    if not rows:
        return []
    columns = [c for c in _PHASE_COLUMNS if any(c in r["host_ms_per_step"] for r in rows)]
    lines = [
        "",
        "Host wall ms per step by phase (a parent's time includes its children's; tiers.wait is the host waiting "
        "for the device, tiers.cpu_job the CPU tier's worker):",
        "",
        "| mode | streams | step | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for r in rows:
        phases = r["host_ms_per_step"]
        cells = [fmt(phases.get(c), 2) for c in columns]
        lines.append(f"| {r['mode']} | {r['streams']} | {fmt(phases['step'], 2)} | " + " | ".join(cells) + " |")
    return lines


def write_receipt(receipt: dict[str, Any], out_dir: Path) -> Path:
    path = write_receipt_files(receipt, out_dir, markdown_table, omit=("profiles",))
    if profiles := receipt.get("profiles"):
        text = "".join(f"=== {mode} (1 stream) ===\n{table}\n" for mode, table in profiles.items())
        path.with_name(path.stem + "-profile.txt").write_text(text)
    return path


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_placement_arguments(parser, MODES, "expert cache policy (lru, lfu, static)", DEFAULT_MODES)
    parser.add_argument("--streams", default="1,2,4", help="comma-separated stream counts")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--prefill-chunk", type=int, default=2048, help="longer prompts: prefilled per stream in chunks this long"
    )
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP_STEPS, help="decode steps before timing (every mode)"
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also write a torch.profiler summary per mode")
    parser.add_argument(
        "--host-steps", type=int, default=16, help="steps of the clocked pass (host ms per phase) and of the cProfile"
    )
    parser.add_argument(
        "--trace", default="", help="comma-separated modes whose profiled 1-stream steps are saved as a Chrome trace"
    )
    parser.add_argument(
        "--inputs",
        default="greedy",
        choices=DECODE_INPUTS,
        help="each step's input: the token the step before produced, or tokens drawn from the seed (forced: the "
        "same in every mode and process, for A/B runs)",
    )
    parser.add_argument("--kv-layout", default="contiguous", choices=KV_LAYOUTS, help="the streams' KV caches")
    parser.add_argument("--kv-dtype", default=None, choices=["bf16", "fp8"], help="KV storage (default: model dtype)")
    parser.add_argument(
        "--tiered",
        type=key_json_value,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a TieredConfig field for every tiered mode but naive, e.g. --tiered mapped_bookkeeping_every=1",
    )
    hf_baseline.add_decode_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = DecodeBenchConfig(
        **placement_options(args),
        streams=parse_int_list(args.streams, "--streams"),
        prompt_len=args.prompt_len,
        prefill_chunk=args.prefill_chunk,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        profile=args.profile,
        host_steps=args.host_steps,
        trace=[m for m in args.trace.split(",") if m],
        trace_dir=args.out,
        kv_layout=args.kv_layout,
        kv_dtype=args.kv_dtype,
        inputs=args.inputs,
        tiered_options=dict(args.tiered),
        **hf_baseline.decode_options(args),
    )
    receipt = run_decode_bench(cfg)
    path = write_receipt(receipt, args.out)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
