"""Options of the tiered dispatcher (:class:`TieredConfig`) and the defaults they start from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError

# The seed's measured crossover: from 32 tokens an expert is a GEMM the device runs for the price
# of its copy, while host cores would spend many times the copy time on it.
DEFAULT_FAT_THRESHOLD = 32
# Enough ring to keep PCIe busy through the attention between two MoE layers of a prefill chunk
# (at ~55 GB/s a 50 MB expert lands every ~0.9 ms); the plan charges it against the expert cache.
MIN_STAGING_SLOTS = 16


# A V4-Flash layer's attention over a 16k-token chunk at long context takes ~100+ ms on an H200,
# during which PCIe could land ~110 experts: lend up to that many cache slots to the ring.
DEFAULT_LEND_SLOTS = 128
# Experts a mapped decode step reads ahead per MoE layer: none. Two fp4 V4-Flash experts (~26 MB) cross PCIe in
# about the time one layer's attention takes at a few streams, but with the bench model's ~58% precise predictions
# two ahead lost at 4 streams on an H100 in 4 runs of 4, even with the copies beside the attention: 464 / 469 / 454 /
# 499 tok/s against 505 / 523 / 470 / 539 without (results/h100-20261207-463e837-reads-ahead-ab); one ahead at 1 stream
# gained nothing on an H200 (315.3 against 314.5, results/h200-20261207-10ea80a-priority-sums-longctx). A model whose
# predictions are better may pass mapped_prefetch=2.
DEFAULT_MAPPED_PREFETCH = 0
# Mapped decode steps per round of the host's bookkeeping (counts taken in, admissions, the table brought up to date):
# at 1 stream on the H200 that round took ~0.8 ms of a ~3.2 ms host-bound step (results/h200-20261203-9014c9a-host);
# every 4th step it took 0.44-0.46 ms a step against 0.77-1.08, while tok/s moved no more than the lent host's spread
# (results/h200-20261203-e8f8b43-bookkeeping): host time handed back to the server, admissions at most 3 steps later.
DEFAULT_MAPPED_BOOKKEEPING_EVERY = 4
# Reads ahead (mapped_prefetch > 0) only in steps of at least this many tokens a call. Measured on the H200 (fp4
# V4-Flash widths, two experts ahead against none, tok/s at 1 / 2 / 4 streams): 196 / 273 / 331 vs 233 / 290 / 289
# (results/h200-20261202-1ebb01d-reads-ahead),
# 183 / 264 / 330 vs 234 / 324 / 340 (results/h200-20261202-289e636). Timed on the device, the call never waits for
# the copies (0.002 ms for 0.62 ms of copies): what they cost at 1-2 streams is elsewhere (those steps' hit rate was
# lower, 0.36 vs 0.42, and one or three experts ahead ran between: 195 / 168 tok/s at 1 stream). The H200 traces
# showed the copy kernel holding the attention's GEMMs off the SMs; with that fixed the join waits 0.26-0.30 ms a
# layer for two experts (~0.25 ms of attention to hide them in), and they still lost: 196 / 281 / 352 vs 230 / 317 /
# 386 (results/h200-20261202-9841684).
DEFAULT_MAPPED_PREFETCH_MIN_TOKENS = 4


# Where a decode call's misses run: split by cost, all on the CPU tier, all copied in, or all read over PCIe by
# the device's kernels from the pinned home copy (moetier.tiers.mapped; calls those kernels do not take copy).
MISS_ROUTES = ("auto", "cpu", "copy", "mapped")


def default_staging_slots(top_k: int) -> int:
    """Staging ring size when not configured: a decode step's misses, and at least ``MIN_STAGING_SLOTS``."""
    return max(top_k, MIN_STAGING_SLOTS)


@dataclass
class TieredConfig:
    """Options of the tiered dispatcher (``load_model(..., dispatcher="tiered", dispatcher_options={...})``).

    Exactly one of ``cache_slots`` / ``cache_bytes`` sizes the VRAM cache. ``miss_route`` sends
    every miss to the CPU tier, every miss through the copy path, or (``auto``) splits them by
    the routes' costs: measured at start-up on CUDA unless ``cpu_share`` (the fraction of miss
    throughput the CPU tier provides, 0..1) fixes the ratio; ``auto`` never sends a group of
    ``fat_threshold`` or more tokens to the CPU. ``staging_slots`` sizes the staging ring
    (default :func:`default_staging_slots`). Calls of ``stream_min_tokens`` or more tokens are
    streaming calls (module docstring); ``prefetch`` turns their cross-layer prefetch on, and up to
    ``lend_slots`` cache slots join the staging ring while they last (the experts those slots held
    are reloaded when the next non-streaming call starts; 0 disables). With ``gpu_waits_for_cpu``
    (the default; CUDA with stream memory operations), a decode call's CPU-tier result is awaited by
    the compute stream instead of the host thread, except at the last MoE layer
    (:mod:`moetier.tiers.gpu_wait`). With ``adapt_costs`` (``None``: on CUDA, where the costs are
    measured; ``True``: anywhere; ``auto`` route without ``cpu_share`` only), decode calls rescale each
    route's costs by what its share of each call took (:class:`RouteAdapter`); the split then follows
    wall-clock timings, so it is not reproducible run to run (the math is the same either way).
    With ``choose_split`` (``None``: whenever costs adapt), each decode batch size runs the cost model's split,
    copies-only and (with ``mapped``, ``None``: on CUDA where the device kernels take the call) the mapped route
    in turn and keeps the one of shorter measured steps, the two best run again in long visits when close
    (:class:`SplitChooser`'s playoff). The mapped route admits up to ``mapped_admissions`` of the experts it missed
    a step (:mod:`moetier.tiers.mapped`; the host takes the counts in, admits and brings the table up to date once
    every ``mapped_bookkeeping_every`` mapped steps), and ``mapped_cpu_share`` of each layer's experts, while not
    cached, are computed by the CPU tier fed by the device (:mod:`moetier.tiers.mapped_cpu`;
    ``None``: the share that balances the measured CPU and PCIe rates; 0: the kernels read every miss). With
    ``mapped_graphs``, a model's segmented decode runs a mapped step's calls inside its CUDA graphs (no host code
    per call; :meth:`TieredDispatcher.decode_step`), and in steps of at least ``mapped_prefetch_min_tokens`` tokens
    per call the device reads up to ``mapped_prefetch`` of the experts the model predicts for the next MoE layer
    into staging slots while that layer's attention runs (:mod:`moetier.tiers.mapped_ahead`; 0: it reads every
    miss inside the call).
    A decode call copies up to ``decode_prefetch`` of the experts the model hinted for the next MoE
    layer (:meth:`ExpertDispatcher.hint`) into free staging slots once its own copies are enqueued
    (0: hints are not asked for), and only the ranks of the prediction whose measured precision reaches
    ``hint_min_precision`` (:mod:`moetier.tiers.hints`; 0: every predicted expert).
    A decode step of at least ``decode_halves_min_tokens`` sequences (0: never; else >= 2) whose route is not the
    mapped one runs as two halves of its batch alternating layers (:meth:`TieredDispatcher.decode_halves`): one
    half's backbone runs on the device while the other's experts wait for the CPU tier and the copies.
    """

    cache_slots: int | None = None
    cache_bytes: int | None = None
    policy: str = "lru"
    policy_options: dict[str, Any] = field(default_factory=dict)
    cpu_threads: int | None = None
    miss_route: str = "auto"
    cpu_share: float | None = None
    staging_slots: int | None = None
    calibrate: bool = True
    fat_threshold: int = DEFAULT_FAT_THRESHOLD
    stream_min_tokens: int = 64
    prefetch: bool = True
    lend_slots: int = DEFAULT_LEND_SLOTS
    gpu_waits_for_cpu: bool = True  # where the driver allows it (moetier.tiers.gpu_wait); else the host waits
    adapt_costs: bool | None = None
    choose_split: bool | None = None
    mapped: bool | None = None
    mapped_admissions: int = 2
    mapped_bookkeeping_every: int = DEFAULT_MAPPED_BOOKKEEPING_EVERY
    mapped_cpu_share: float | None = None
    mapped_graphs: bool = True
    mapped_prefetch: int = DEFAULT_MAPPED_PREFETCH
    mapped_prefetch_min_tokens: int = DEFAULT_MAPPED_PREFETCH_MIN_TOKENS
    decode_prefetch: int = 4
    hint_min_precision: float = 0.8
    decode_halves_min_tokens: int = 0

    def __post_init__(self) -> None:
        if (self.cache_slots is None) == (self.cache_bytes is None):
            raise ConfigError("tiered dispatcher needs exactly one of cache_slots= or cache_bytes=")
        if (self.cache_slots or 0) < 0 or (self.cache_bytes or 0) < 0:
            raise ConfigError("tiered dispatcher cache size must be >= 0")
        if self.miss_route not in MISS_ROUTES:
            raise ConfigError(f"miss_route must be one of {', '.join(MISS_ROUTES)}, got {self.miss_route!r}")
        admissions = self.mapped_admissions
        if isinstance(admissions, bool) or not isinstance(admissions, int) or admissions < 0:
            raise ConfigError(f"mapped_admissions must be an integer >= 0, got {self.mapped_admissions!r}")
        every = self.mapped_bookkeeping_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"mapped_bookkeeping_every must be an integer >= 1, got {every!r}")
        for name in ("cpu_share", "mapped_cpu_share"):
            share = getattr(self, name)
            if share is not None and not 0.0 <= share <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {share}")
        if self.staging_slots is not None and self.staging_slots < 1:
            raise ConfigError(f"staging_slots must be >= 1, got {self.staging_slots}")
        if self.lend_slots < 0:
            raise ConfigError(f"lend_slots must be >= 0, got {self.lend_slots}")
        prefetch = self.mapped_prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"mapped_prefetch must be an integer >= 0, got {self.mapped_prefetch!r}")
        if self.mapped_prefetch_min_tokens < 1:
            raise ConfigError(f"mapped_prefetch_min_tokens must be >= 1, got {self.mapped_prefetch_min_tokens}")
        if self.decode_prefetch < 0:
            raise ConfigError(f"decode_prefetch must be >= 0, got {self.decode_prefetch}")
        if not 0.0 <= self.hint_min_precision <= 1.0:
            raise ConfigError(f"hint_min_precision must be in [0, 1], got {self.hint_min_precision}")
        halves = self.decode_halves_min_tokens
        if isinstance(halves, bool) or not isinstance(halves, int) or halves < 0 or halves == 1:
            raise ConfigError(f"decode_halves_min_tokens must be 0 (off) or an integer >= 2, got {halves!r}")
        if self.fat_threshold < 1 or self.stream_min_tokens < 1:
            raise ConfigError(
                f"fat_threshold and stream_min_tokens must be >= 1, got {self.fat_threshold}, {self.stream_min_tokens}"
            )
