"""The placement plan: which bytes go to VRAM and which to pinned host RAM, decided from budgets.

:func:`make_plan` reads a checkpoint's ``config.json`` and safetensors headers (never its weights)
and lays the GPU budget out in this order:

1. the backbone (every tensor that is not a routed expert), at the load dtype (fp32 where the
   family keeps it), exactly as the loader materialises it;
2. the KV cache for ``context`` tokens x ``max_streams`` streams (bytes per token from the family's
   attention, see :func:`kv_estimate`), or for only ``kv_reserve_streams`` of them: the other streams'
   KV then borrows from the expert cache at run time (:mod:`moetier.engine.elastic`);
3. an activation workspace (an *estimate*, see :func:`workspace_estimate`; overridable) for the prefill
   chunk, which the plan chooses from the VRAM left unless given (:mod:`moetier.tiers.workspace`);
4. the staging ring the tiered dispatcher streams missed experts through (:func:`default_staging_slots`);
5. the elastic expert cache: every remaining byte, in whole expert blocks.

Every routed expert's home copy lives in pinned host RAM. The predicted decode bound is DESIGN.md's
``tokens/s <= DRAM_bw / ((1 - h) * R)`` with ``R`` the routed-expert bytes a token reads and the hit
rate ``h`` *estimated* as the cache's share of all experts, which is what uniform routing gives
(real routing is skewed, so a frequency-aware policy usually does better).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moetier.config import ModelLoadConfig, check_backbone_format, check_expert_format, resolve_backbone_format
from moetier.errors import ConfigError
from moetier.models.base import ExpertTarget, IgnoreTarget
from moetier.tiers.dispatcher import make_dispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore
from moetier.tiers.kv_estimate import (  # noqa: F401 - KvEstimate re-exported
    KvEstimate,
    kv_estimate,
    kv_shortfall,
    prefix_reservation,
)
from moetier.tiers.tiered_config import MISS_ROUTES
from moetier.tiers.tiered_dispatcher import default_staging_slots
from moetier.tiers.workspace import WORKSPACE_HIDDEN_ROWS as WORKSPACE_HIDDEN_ROWS  # re-export
from moetier.tiers.workspace import (
    ChunkChoice,
    auto_chunk_limit,
    choose_prefill_chunk,
    workspace_allowance,
    workspace_estimate,
)
from moetier.units import gib, parse_size
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import format_for
from moetier.weights.quant_experts import expert_layout_for

log = logging.getLogger(__name__)

# Measured on the H200 test machine (shared/measurements/h200-limits.json): host DRAM read with 16
# cores, and PCIe Gen5 host->device from pinned memory. Override them for other hardware.
DEFAULT_HOST_READ_GBPS = 118.6
DEFAULT_PCIE_GBPS = 55.4
# The same machine's HBM: a device copy's bytes read plus written per second (what the memory serves at once).
DEFAULT_HBM_GBPS = 4205.3
# The smallest useful KV cache: one stream of this many tokens (or the requested context if shorter).
MIN_CONTEXT = 4096


@dataclass(frozen=True)
class CheckpointSizes:
    """Bytes of a checkpoint, read from its headers: as stored, and as the loader materialises them."""

    stored_backbone: int
    stored_experts: int
    stored_ignored: int
    backbone: int  # VRAM bytes of every model parameter and buffer at the load dtype
    layout: ExpertLayout
    family_config: Any
    architecture: str
    fp8_linears: int = 0  # backbone linears kept fp8-block as stored (backbone_format "fp8")
    embedding: int = 0  # VRAM bytes of the embedding tables (of which a decode step reads a row a token)


def checkpoint_sizes(
    path: str | Path, dtype: torch.dtype, expert_format: str = "dense", backbone_format: str = "auto"
) -> CheckpointSizes:
    """Classify every stored tensor (backbone, routed expert, ignored) by the family's name mapping, and
    count the backbone the loader would build (a meta-device model: no memory, no weights read); the
    layout's expert blocks are ``expert_format``'s (``"fp8"``: float8 + scales; ``"fp4"``: packed + scales),
    the backbone's fp8-block linears ``backbone_format``'s (``auto``: as on a CUDA device, fp8)."""
    from moetier.models import model_class_for
    from moetier.models.fp8_linear import keep_fp8_linears, materialized_dtype

    ckpt = Checkpoint(path)
    cls = model_class_for(ckpt.architectures)
    family_config = cls.config_from_hf(ckpt.config)
    layout = expert_layout_for(cls.expert_layout(family_config), ckpt.config, expert_format, str(path))
    store = ExpertStore(layout, dtype, lambda numel, dt: torch.empty(numel, dtype=dt, device="meta"))
    with torch.device("meta"):
        model = cls(family_config, make_dispatcher("resident", store))
    fp8 = resolve_backbone_format(backbone_format, "cuda") == "fp8"  # a plan places a GPU's memory
    fp8_linears = len(keep_fp8_linears(model, ckpt)) if fp8 else 0
    sizes = {"backbone": 0, "experts": 0, "ignored": 0}
    formats = {name: format_for(name, ckpt) for name in ckpt.names()}
    owner = {c: name for name, fmt in formats.items() for c in fmt.companions(name)}
    for name in ckpt.names():
        try:
            target = model.map_checkpoint_name(owner.get(name, name))
        except KeyError:
            target = IgnoreTarget("not part of the model")  # the loader will reject it; the plan only counts
        kind = (
            "experts"
            if isinstance(target, ExpertTarget)
            else "ignored"
            if isinstance(target, IgnoreTarget)
            else "backbone"
        )
        sizes[kind] += ckpt.tensors[name].nbytes
    backbone = embedding = 0
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                full_name = f"{module_name}.{name}" if module_name else name
                target = materialized_dtype(model, module, name, full_name, tensor, dtype)
                backbone += tensor.numel() * _size_of(target)
                if isinstance(module, torch.nn.Embedding):  # a tied LM head is its own parameter here, counted
                    embedding += tensor.numel() * _size_of(target)
    return CheckpointSizes(
        sizes["backbone"], sizes["experts"], sizes["ignored"], backbone, layout, family_config, cls.__name__,
        fp8_linears, embedding,
    )  # fmt: skip


def _size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class PlanBudget:
    """The inputs of a plan; validated on construction. Sizes are bytes or strings (``24GiB``, ``80%``).

    ``device_memory``: the GPU's total bytes, needed only for a percentage ``gpu_memory``.
    ``prefill_chunk_tokens``: prefill tokens per step; ``None`` lets the plan choose it from the VRAM left
    (:func:`moetier.tiers.workspace.choose_prefill_chunk`; within the given ``workspace`` when one is given).
    ``workspace`` / ``kv_bytes_per_token``: override the stated estimates. ``kv_dtype``: the KV cache's
    storage (``auto`` = the load dtype, ``bf16``, ``fp8`` = one byte per element plus per-token scales).
    ``expert_format``: the experts' home copy, ``dense``, ``fp8`` or ``fp4`` (``ModelLoadConfig.expert_format``);
    ``backbone_format``: ``auto`` (fp8 here: a plan places a GPU's memory), ``fp8`` or ``dense``
    (``ModelLoadConfig.backbone_format``).
    ``prefix_cache``: the most VRAM the engine's prefix-cache snapshots may hold. ``prefix_snapshots``: where the
    snapshots borrow their caches' entries (DeepSeek-V4 with spare caches: each holds one stream's rolling state,
    :mod:`moetier.models.deepseek_v4_snapshot`), how many of them the plan reserves for (at most ``prefix_cache``);
    None: snapshots own their state, the whole ``prefix_cache`` is reserved.
    """

    gpu_memory: int | str
    host_memory: int | str | None = None
    context: int = MIN_CONTEXT
    max_streams: int = 1
    prefill_chunk_tokens: int | None = None
    staging_slots: int | None = None
    workspace: int | str | None = None
    kv_bytes_per_token: int | None = None
    host_read_gbps: float = DEFAULT_HOST_READ_GBPS
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    hbm_gbps: float = DEFAULT_HBM_GBPS
    device_memory: int | None = None
    prefix_cache: int | str = 0
    prefix_snapshots: int | None = None
    kv_dtype: str = "auto"
    # Streams whose KV is reserved up front (None = all ``max_streams``); the others borrow expert-cache slots.
    kv_reserve_streams: int | None = None
    expert_format: str = "dense"
    backbone_format: str = "auto"

    def __post_init__(self) -> None:
        check_expert_format(self.expert_format)
        check_backbone_format(self.backbone_format)
        self.gpu_memory = parse_size(self.gpu_memory, "--gpu-memory", self.device_memory)
        self.prefix_cache = parse_size(self.prefix_cache, "prefix cache")
        if self.host_memory is not None:
            self.host_memory = parse_size(self.host_memory, "--host-memory")
        if self.workspace is not None:
            self.workspace = parse_size(self.workspace, "workspace")
        for name in ("context", "max_streams", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if value is None and name == "prefill_chunk_tokens":
                continue  # automatic
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "prefill-chunk" if name == "prefill_chunk_tokens" else name.replace("_", "-")
                raise ConfigError(f"--{flag} must be an integer >= 1, got {value!r}")
        if self.staging_slots is not None and self.staging_slots < 1:
            raise ConfigError(f"staging_slots must be >= 1, got {self.staging_slots}")
        _check_reserve_streams(self.kv_reserve_streams)
        snapshots = self.prefix_snapshots
        if snapshots is not None and (isinstance(snapshots, bool) or not isinstance(snapshots, int) or snapshots < 1):
            raise ConfigError(f"prefix_snapshots must be an integer >= 1, got {snapshots!r}")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 0:
            raise ConfigError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if self.kv_dtype not in ("auto", "bf16", "fp8"):
            raise ConfigError(f"--kv-dtype must be auto, bf16 or fp8, got {self.kv_dtype!r}")
        if self.host_read_gbps <= 0 or self.pcie_gbps <= 0 or self.hbm_gbps <= 0:
            raise ConfigError("bandwidths (host read, PCIe, HBM) must be positive GB/s")

    @property
    def reserved_streams(self) -> int:
        """Streams whose KV the plan reserves: ``kv_reserve_streams`` capped by ``max_streams``."""
        return min(self.kv_reserve_streams or self.max_streams, self.max_streams)


def _check_reserve_streams(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"--kv-reserve-streams must be an integer >= 1, got {value!r}")


@dataclass
class PlacementPlan:
    """Where every byte goes; see the module docstring. All sizes in bytes.

    ``cache_slots`` = ``cache_bytes // expert_block_bytes`` (at most every expert); ``hit_rate`` is the
    uniform-routing estimate ``cache_slots / total_experts``; ``decode_bound_*`` are tokens/s at one
    stream with misses on the CPU tier (host DRAM) or copied over PCIe. ``prefill_chunk_tokens``: the
    chunk the workspace is sized for (the budget's, or the plan's choice; ``chunk_note`` says why).
    """

    model: str
    architecture: str
    dtype: torch.dtype
    budget: PlanBudget
    backbone_bytes: int
    kv_bytes: int
    kv_note: str
    workspace_bytes: int
    staging_slots: int
    expert_block_bytes: int
    total_experts: int
    top_k: int
    moe_layers: int
    cache_slots: int
    stored_backbone_bytes: int
    stored_expert_bytes: int
    warnings: list[str] = field(default_factory=list)
    fp8_linears: int = 0  # of the backbone's linears, those kept fp8-block as stored
    # Of ``kv_bytes``, the state each stream holds whatever its length (V4's window and open windows).
    kv_stream_bytes: int = 0
    prefill_chunk_tokens: int = 512
    chunk_note: str = "given"
    # The VRAM reserved for prefix snapshots: the budget's bound, or what its borrowed snapshots hold.
    prefix_cache_bytes: int = 0
    prefix_note: str = "snapshots of earlier prompts"
    # What a decode step reads of the backbone for a token: all of it but the embedding tables' other rows.
    backbone_read_bytes: int = 0

    def __post_init__(self) -> None:
        if min(self.backbone_bytes, self.kv_bytes, self.workspace_bytes, self.cache_slots) < 0:
            raise ConfigError("a placement plan cannot hold negative sizes")
        if self.cache_slots > self.total_experts:
            raise ConfigError(f"cache_slots {self.cache_slots} exceeds the {self.total_experts} experts")

    @property
    def staging_bytes(self) -> int:
        return self.staging_slots * self.expert_block_bytes

    @property
    def cache_bytes(self) -> int:
        return self.cache_slots * self.expert_block_bytes

    @property
    def host_expert_bytes(self) -> int:
        """The pinned home copy of every routed expert."""
        return self.total_experts * self.expert_block_bytes

    @property
    def vram_used_bytes(self) -> int:
        fixed = self.backbone_bytes + self.kv_bytes + self.workspace_bytes + self.staging_bytes
        return fixed + self.prefix_cache_bytes + self.cache_bytes

    @property
    def cache_share(self) -> float:
        return self.cache_slots / self.total_experts if self.total_experts else 1.0

    @property
    def hit_rate(self) -> float:
        """Estimated VRAM hit rate: the cache's share of experts (uniform routing)."""
        return self.cache_share

    @property
    def routed_bytes_per_token(self) -> int:
        return self.top_k * self.moe_layers * self.expert_block_bytes

    @property
    def missed_bytes_per_token(self) -> float:
        return (1.0 - self.hit_rate) * self.routed_bytes_per_token

    def decode_bound(self, gbps: float) -> float:
        """tokens/s at one stream when every missed byte crosses a link of ``gbps`` (inf: all resident)."""
        missed = self.missed_bytes_per_token
        return math.inf if missed <= 0 else gbps * 1e9 / missed

    @property
    def decode_bound_dram(self) -> float:
        return self.decode_bound(self.budget.host_read_gbps)

    @property
    def decode_bound_serial(self) -> float:
        """tokens/s at one stream when a step reads the backbone and its cached experts at the HBM rate, then its
        misses at the DRAM rate, one after the other (a step whose expert reads never overlap its backbone:
        moetier's decode steps). The kernels' launches and latencies come on top, so a measured step is slower
        still (on the bench model's H100 runs, the resident step took ~2x its bytes at the HBM rate)."""
        hits = self.routed_bytes_per_token - self.missed_bytes_per_token
        seconds = (self.backbone_read_bytes + hits) / (self.budget.hbm_gbps * 1e9)
        seconds += self.missed_bytes_per_token / (self.budget.host_read_gbps * 1e9)
        return math.inf if seconds <= 0 else 1.0 / seconds

    @property
    def decode_bound_pcie(self) -> float:
        return self.decode_bound(self.budget.pcie_gbps)

    def dispatcher_options(self, **extra: Any) -> dict[str, Any]:
        """Options of the tiered dispatcher that realise this plan (plus ``extra``: policy, route, threads)."""
        return {"cache_slots": self.cache_slots, "staging_slots": self.staging_slots, **extra}

    def _kv_streams(self) -> str:
        b = self.budget
        if b.reserved_streams == b.max_streams:
            return f"{b.max_streams} stream(s)"
        return f"{b.reserved_streams} of {b.max_streams} streams reserved (the rest borrow expert-cache slots)"

    def table(self) -> str:
        """A readable table of the placement and the predicted decode bound."""
        b = self.budget
        fp8 = f"; {self.fp8_linears} linears fp8-block as stored" if self.fp8_linears else ""
        rows = [
            (f"backbone (attention, norms, routers, shared experts, embeddings{fp8})", self.backbone_bytes, "VRAM"),
            (f"KV cache: {self._kv_streams()} x {b.context} tokens ({self.kv_note})", self.kv_bytes, "VRAM"),
            ("activation workspace (estimate)", self.workspace_bytes, "VRAM"),
            (f"prefix cache ({self.prefix_note})", self.prefix_cache_bytes, "VRAM"),
            (f"staging slots for prefill / copied misses: {self.staging_slots}", self.staging_bytes, "VRAM"),
            (
                f"expert cache: {self.cache_slots} of {self.total_experts} experts ({100 * self.cache_share:.1f}%)",
                self.cache_bytes,
                "VRAM",
            ),
            (
                f"routed experts, home copy{f' ({b.expert_format} + scales)' if b.expert_format != 'dense' else ''}: "
                f"{self.total_experts} x {self.expert_block_bytes} B",
                self.host_expert_bytes,
                "host (pinned)",
            ),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [
            f"placement plan for {self.model} ({self.architecture}, {str(self.dtype).removeprefix('torch.')})",
            f"{'what':<{width}}  {'GiB':>9}  where",
        ]
        lines += [f"{what:<{width}}  {gib(size):>9}  {where}" for what, size, where in rows]
        host = "unstated" if b.host_memory is None else f"{gib(b.host_memory)} GiB"
        lines += [
            f"{'VRAM used / budget':<{width}}  {gib(self.vram_used_bytes):>9}  of {gib(b.gpu_memory)} GiB",
            f"{'host RAM needed / budget':<{width}}  {gib(self.host_expert_bytes):>9}  of {host}",
            f"prefill chunk: {self.prefill_chunk_tokens} tokens ({self.chunk_note})",
            f"routed expert bytes per token R = {self.routed_bytes_per_token / 1e6:.3g} MB "
            f"({self.top_k} experts x {self.moe_layers} MoE layers)",
            f"estimated hit rate h = {self.hit_rate:.3f} (the cache's share of experts: uniform routing)",
            f"decode bound, 1 stream, misses on the CPU tier: DRAM_bw / ((1-h) R) = {_rate(self.decode_bound_dram)} "
            f"(host read {b.host_read_gbps:g} GB/s)",
            f"decode bound, 1 stream, misses copied in: PCIe_bw / ((1-h) R) = {_rate(self.decode_bound_pcie)} "
            f"(PCIe {b.pcie_gbps:g} GB/s)",
            f"decode bound, 1 stream, backbone then misses: 1 / ((B + h R) / HBM_bw + (1-h) R / DRAM_bw) = "
            f"{_rate(self.decode_bound_serial)} (B = {self.backbone_read_bytes / 1e9:.3g} GB read a token, HBM "
            f"{b.hbm_gbps:g} GB/s)",
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _rate(value: float) -> str:
    return "no bound (every expert resident)" if math.isinf(value) else f"{value:.1f} tok/s"


def make_plan(path: str | Path, budget: PlanBudget, dtype: torch.dtype = torch.bfloat16) -> PlacementPlan:
    """Lay out ``budget`` for the checkpoint at ``path`` (headers only); raises :class:`ConfigError` when
    the backbone and a minimal KV cache do not fit, naming the shortfall and the knob to turn."""
    sizes = checkpoint_sizes(path, dtype, budget.expert_format, budget.backbone_format)
    cfg, layout = sizes.family_config, sizes.layout
    element = _size_of(dtype)
    kv = kv_estimate(cfg)
    token_bytes = kv.token_bytes(element, budget.kv_dtype)
    if budget.kv_dtype != "auto":
        kv = replace(kv, note=f"{kv.note}; {budget.kv_dtype}")
    if budget.kv_bytes_per_token is not None:
        kv = KvEstimate(0, 0, f"{budget.kv_bytes_per_token} B per token, given")
        token_bytes = budget.kv_bytes_per_token

    def kv_bytes(context: int, streams: int) -> int:
        return int(streams * (context * token_bytes + kv.per_stream * element))

    block = layout.block_bytes(dtype)
    staging = budget.staging_slots or default_staging_slots(layout.top_k)
    total_experts = len(layout.moe_layers) * layout.num_experts
    gpu = int(budget.gpu_memory)
    min_context = min(MIN_CONTEXT, budget.context)
    minimum = sizes.backbone + kv_bytes(min_context, 1)
    if minimum > gpu:
        raise ConfigError(
            f"--gpu-memory {gib(gpu)} GiB is {gib(minimum - gpu)} GiB short of the backbone "
            f"({gib(sizes.backbone)} GiB) plus the KV cache of one stream of {min_context} tokens; "
            "raise --gpu-memory (or use a smaller model or dtype)"
        )
    wanted = kv_bytes(budget.context, budget.reserved_streams)
    prefix, prefix_note = prefix_reservation(budget, kv.per_stream * element)
    room = gpu - (sizes.backbone + staging * block + prefix + wanted)
    chunk = _prefill_chunk(cfg, budget, element, room, total_experts * block)
    workspace = chunk.workspace
    fixed = sizes.backbone + workspace + staging * block + prefix
    if fixed + wanted > gpu:
        raise ConfigError(kv_shortfall(gpu, fixed, wanted, budget, kv_bytes, prefix))
    slots = min(total_experts, (gpu - fixed - wanted) // block)
    plan = PlacementPlan(
        model=str(path),
        architecture=sizes.architecture,
        dtype=dtype,
        budget=budget,
        backbone_bytes=sizes.backbone,
        kv_bytes=wanted,
        kv_note=kv.note,
        workspace_bytes=workspace,
        staging_slots=staging,
        expert_block_bytes=block,
        total_experts=total_experts,
        top_k=layout.top_k,
        moe_layers=len(layout.moe_layers),
        cache_slots=slots,
        stored_backbone_bytes=sizes.stored_backbone,
        stored_expert_bytes=sizes.stored_experts,
        fp8_linears=sizes.fp8_linears,
        kv_stream_bytes=kv_bytes(0, 1),
        prefill_chunk_tokens=chunk.tokens,
        chunk_note=chunk.note,
        prefix_cache_bytes=prefix,
        prefix_note=prefix_note,
        backbone_read_bytes=sizes.backbone - sizes.embedding,
    )
    plan.warnings.extend(_host_warnings(plan, budget))
    return plan


def _prefill_chunk(cfg: Any, budget: PlanBudget, element: int, room: int, expert_bytes: int) -> ChunkChoice:
    """The chunk and its workspace: the budget's chunk, or the plan's choice for the ``room`` left for the
    workspace and the cache of ``expert_bytes`` of experts. A given ``workspace`` is kept as the workspace;
    an automatic chunk then grows to fill it."""

    def estimate(tokens: int) -> int:
        return workspace_estimate(cfg, tokens, budget.max_streams, budget.context, element)

    given = None if budget.workspace is None else int(budget.workspace)
    if budget.prefill_chunk_tokens is not None:
        tokens = budget.prefill_chunk_tokens
        return ChunkChoice(tokens, estimate(tokens) if given is None else given, None, "given")
    allowance = workspace_allowance(room, expert_bytes) if given is None else given
    choice = choose_prefill_chunk(estimate, allowance, auto_chunk_limit(budget.context * budget.max_streams))
    return choice if given is None else replace(choice, workspace=given, note=f"{choice.note}; workspace given")


def _host_warnings(plan: PlacementPlan, budget: PlanBudget) -> list[str]:
    need = plan.host_expert_bytes
    if budget.host_memory is not None:
        if need > budget.host_memory:
            return [
                f"the experts' home copy needs {gib(need)} GiB of pinned host RAM but --host-memory is "
                f"{gib(budget.host_memory)} GiB: loading will swap or fail"
            ]
        return []
    physical = _physical_memory()
    if physical is not None and need > physical:
        return [f"the experts' home copy needs {gib(need)} GiB of host RAM; this machine has {gib(physical)} GiB"]
    return []


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# --- loading with a plan ----------------------------------------------------------------------------


@dataclass
class TierOptions:
    """How to serve with tiered experts: the GPU budget plus the dispatcher's choices; validated.

    ``gpu_memory`` (e.g. ``24GiB``, ``80%``) switches tiering on; the plan sizes the expert cache.
    """

    gpu_memory: int | str
    host_memory: int | str | None = None
    policy: str = "lfu"
    cpu_threads: int | None = None
    miss_route: str = "auto"
    workspace: int | str | None = None
    host_read_gbps: float = DEFAULT_HOST_READ_GBPS
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    hbm_gbps: float = DEFAULT_HBM_GBPS
    # Elastic expert cache (moetier.engine.elastic): KV reserved for this many streams (None = all), the
    # others borrow whole expert-cache slots while they run; the cache never shrinks below
    # ``min_cache_slots`` (None = the model's top_k), and admissions wait instead.
    kv_reserve_streams: int | None = None
    min_cache_slots: int | None = None

    def __post_init__(self) -> None:
        _check_reserve_streams(self.kv_reserve_streams)
        floor = self.min_cache_slots
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int) or floor < 0):
            raise ConfigError(f"min_cache_slots must be an integer >= 0, got {floor!r}")
        parse_size(self.gpu_memory, "--gpu-memory", total=100)  # syntax now; percentages resolve on the device
        if self.host_memory is not None:
            parse_size(self.host_memory, "--host-memory")
        if self.miss_route not in MISS_ROUTES:
            raise ConfigError(f"--miss-route must be one of {', '.join(MISS_ROUTES)}, got {self.miss_route!r}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or self.cpu_threads < 1):
            raise ConfigError(f"--cpu-threads must be >= 1, got {self.cpu_threads!r}")
        from moetier.tiers.policies import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"--expert-policy must be one of {sorted(POLICIES)}, got {self.policy!r}")


def device_memory(device: torch.device) -> int | None:
    """Total bytes of a CUDA device (None elsewhere: a percentage budget is then refused)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def plan_for(
    path: str | Path,
    options: TierOptions,
    load_config: ModelLoadConfig,
    context: int,
    max_streams: int,
    prefill_chunk_tokens: int | None = None,
    prefix_cache_bytes: int = 0,
    kv_dtype: str = "auto",
    prefix_snapshots: int | None = None,
) -> PlacementPlan:
    """The plan an engine loads ``load_config`` with (its dtype, device and expert format): ``options``'
    budgets for ``max_streams`` x ``context`` tokens; ``prefill_chunk_tokens`` None lets the plan choose
    the chunk (``plan.prefill_chunk_tokens``); ``prefix_snapshots`` as :class:`PlanBudget`'s."""
    budget = PlanBudget(
        prefix_cache=prefix_cache_bytes,
        prefix_snapshots=prefix_snapshots,
        kv_dtype=kv_dtype,
        gpu_memory=options.gpu_memory,
        host_memory=options.host_memory,
        context=context,
        max_streams=max_streams,
        prefill_chunk_tokens=prefill_chunk_tokens,
        workspace=options.workspace,
        host_read_gbps=options.host_read_gbps,
        pcie_gbps=options.pcie_gbps,
        hbm_gbps=options.hbm_gbps,
        device_memory=device_memory(load_config.device),
        kv_reserve_streams=options.kv_reserve_streams,
        expert_format=load_config.expert_format,
        backbone_format=resolve_backbone_format(load_config.backbone_format, load_config.device),
    )
    return make_plan(path, budget, load_config.dtype)


def load_planned(
    path: str | Path, load_config: ModelLoadConfig, plan: PlacementPlan, options: TierOptions, progress: bool = True
):
    """Load ``path`` as ``plan`` says: experts' home copy in a (pinned) host arena, the tiered dispatcher
    with the plan's cache. Returns the :class:`~moetier.weights.loader.LoadedModel`."""
    from moetier.tiers.host_store import HostExpertArena
    from moetier.weights.loader import load_model

    for warning in plan.warnings:
        log.warning(warning)
    arena = HostExpertArena.for_checkpoint(path, load_config.dtype, load_config.expert_format, progress=progress)
    extra = {"policy": options.policy, "miss_route": options.miss_route, "cpu_threads": options.cpu_threads}
    return load_model(
        path,
        load_config,
        dispatcher="tiered",
        expert_allocator=arena,
        progress=progress,
        dispatcher_options=plan.dispatcher_options(**extra),
    )
