"""The engine's settings, its per-step outputs, its statistics, and the checkpoint facts it reads first."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moetier.config import ModelLoadConfig, check_backbone_format, check_expert_format, check_seconds, parse_dtype
from moetier.engine.prefill_meter import PrefillMeter
from moetier.engine.sampling import TokenLogprob
from moetier.engine.scheduler import KV_ADMISSION_MODES, Sequence
from moetier.errors import CheckpointError, ConfigError, MoetierError
from moetier.models.cache import KV_DTYPES
from moetier.models.paged_kv import KV_LAYOUTS
from moetier.tiers.workspace import DEFAULT_PREFILL_CHUNK

_CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class EngineBusyError(MoetierError):
    """The waiting queue is full; retry later (the server answers 503)."""


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class EngineConfig:
    """Engine limits, validated on construction.

    - ``max_streams``: sequences running (prefilling or decoding) together.
    - ``max_model_len``: longest sequence, prompt + output; ``None`` = the model's window.
    - ``prefill_chunk_tokens``: prefill tokens per step, so a long prompt never freezes the streams;
      ``None`` (auto) = the placement plan's choice with tiered experts (bigger chunks amortise streaming
      the experts), else :data:`DEFAULT_PREFILL_CHUNK`. See :meth:`with_plan`.
    - ``max_waiting``: bound of the waiting queue; beyond it ``add_request`` raises EngineBusyError.
    - ``kv_token_budget``: KV tokens all running sequences may reserve together; ``None`` =
      ``max_streams * max_model_len``.
    - ``kv_admission``: ``"optimistic"`` (default) reserves a request's prompt plus
      ``kv_headroom_tokens`` at admission and grows the reservation as it generates, preempting the
      newest running request (recomputed later) when the budget is spent; ``"reserve"`` reserves prompt
      + ``max_tokens`` up front and never preempts. See :mod:`moetier.engine.scheduler`.
    - ``kv_headroom_tokens``: optimistic admission's extra reservation, and the least a reservation grows by.
    - ``enable_prefix_caching``: start requests from cached snapshots of earlier requests' prefixes
      (:mod:`moetier.engine.prefix_cache`); ``prefix_cache_bytes`` bounds the snapshots' memory (on
      the model's device; LRU eviction) and ``prefix_block_tokens`` is the hashing granularity. It is a
      bound, not an allocation: contiguous snapshots are allocated as they are taken; paged ones share
      their sequences' blocks and count only what no running sequence holds (see ``kv_layout``).
    - ``prefix_cache_reserve_bytes`` (paged layout; at most ``prefix_cache_bytes``; default 0): bytes of
      blocks the pools hold for snapshots beyond the KV-token budget, from start-up, so that snapshots
      survive while running sequences fill the budget. Ignored by the contiguous layout.
    - ``prefix_share_min_blocks`` / ``prefix_share_max_wait_s`` (prefix caching on): a waiting request
      whose prompt shares at least this many blocks with a running request's not yet computed prefix
      waits (at most this many seconds in total; 0 = never) for that prefix to be cached, instead of
      prefilling it too (:mod:`moetier.engine.prefix_sharing`).
    - ``kv_dtype``: storage of the KV cache (the state that grows with the context): ``auto`` (the
      model dtype), ``bf16``, or ``fp8`` (e4m3 with per-token scales; :mod:`moetier.models.cache`).
    - ``kv_layout``: ``"auto"`` (the default: paged where the model's decode attention reads blocks in
      place, Qwen3 and DeepSeek-V3 on CUDA; contiguous otherwise), ``"contiguous"`` (each sequence's rows
      preallocated for its reservation, copied when it grows) or ``"paged"`` (blocks of ``kv_block_tokens``
      rows from shared pools, taken as tokens arrive and shared, not copied, by growth and prefix
      snapshots; :mod:`moetier.models.paged_kv`). The
      pools are allocated at start-up for the KV-token budget (plus ``prefix_cache_reserve_bytes``);
      snapshots live in the blocks running sequences do not need, and a running sequence that finds no
      free block evicts least recently used snapshots before a pool grows.
    - ``spare_cache_seconds`` (default 30; 0 = off): where decode graphs read the sequences' contiguous caches
      in place (DeepSeek-V4), a finished sequence's cache waits for the next sequence, which takes it (emptied,
      or with its cached prefix copied in) and replays its graphs instead of capturing new ones
      (:mod:`moetier.engine.spare_caches`); where its memory is lent by the expert cache (KV beyond the plan's
      reservation), it waits this long, then the expert cache takes the memory back.
    - ``expert_format``: the routed experts' home copy when the engine loads a checkpoint: ``"dense"``
      (dequantised to the model dtype), ``"fp8"`` (an fp8-block checkpoint's float8 + scales, half the
      bytes) or ``"fp4"`` (DeepSeek-V4's packed FP4 + scales; :class:`moetier.config.ModelLoadConfig`).
    - ``backbone_format``: ``"fp8"`` (backbone linears an fp8-block checkpoint stores so stay float8 + scales in
      VRAM), ``"dense"`` (dequantised at load) or ``"auto"`` (default: fp8 on CUDA, dense elsewhere).
    """

    max_streams: int = 4
    max_model_len: int | None = None
    prefill_chunk_tokens: int | None = None
    max_waiting: int = 256
    kv_token_budget: int | None = None
    kv_admission: str = "optimistic"
    kv_headroom_tokens: int = 256
    enable_prefix_caching: bool = True
    prefix_cache_bytes: int = 1 << 30
    prefix_cache_reserve_bytes: int = 0
    prefix_block_tokens: int = 16
    prefix_share_min_blocks: int = 4
    prefix_share_max_wait_s: float = 60.0
    kv_dtype: str = "auto"
    kv_layout: str = "auto"
    kv_block_tokens: int = 16
    spare_cache_seconds: float = 30.0
    expert_format: str = "dense"
    backbone_format: str = "auto"

    def __post_init__(self) -> None:
        check_expert_format(self.expert_format)
        check_backbone_format(self.backbone_format)
        _positive_int("max_streams", self.max_streams)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("prefill_chunk_tokens", self.prefill_chunk_tokens, allow_none=True)
        _positive_int("max_waiting", self.max_waiting)
        _positive_int("kv_token_budget", self.kv_token_budget, allow_none=True)
        if self.kv_admission not in KV_ADMISSION_MODES:
            raise ConfigError(f"kv_admission must be one of {', '.join(KV_ADMISSION_MODES)}, got {self.kv_admission!r}")
        _positive_int("kv_headroom_tokens", self.kv_headroom_tokens)
        _positive_int("prefix_block_tokens", self.prefix_block_tokens)
        _positive_int("prefix_share_min_blocks", self.prefix_share_min_blocks)
        check_seconds("prefix_share_max_wait_s", self.prefix_share_max_wait_s)
        check_seconds("spare_cache_seconds", self.spare_cache_seconds, "0: off")
        budget = self.prefix_cache_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}")
        reserve = self.prefix_cache_reserve_bytes
        if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve <= budget:
            raise ConfigError(f"prefix_cache_reserve_bytes must be an integer in [0, prefix_cache_bytes = {budget}], "
                              f"got {reserve!r}")  # fmt: skip
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_layout not in ("auto", *KV_LAYOUTS):
            raise ConfigError(f"kv_layout must be one of auto, {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        _positive_int("kv_block_tokens", self.kv_block_tokens)

    def with_plan(self, plan: Any) -> EngineConfig:
        """This config resolved against the placement plan (``plan`` None: every expert resident):
        ``prefill_chunk_tokens`` the given one, else the plan's (``plan.prefill_chunk_tokens``), else the default;
        ``prefix_cache_bytes`` (and the reserve within it) at most the VRAM the plan reserved for the prefix cache
        (``plan.prefix_cache_bytes``: less than the bound where snapshots borrow their caches' entries)."""
        chunk = self.prefill_chunk_tokens
        if chunk is None:
            chunk = DEFAULT_PREFILL_CHUNK if plan is None else plan.prefill_chunk_tokens
        prefix = self.prefix_cache_bytes
        if plan is not None and self.enable_prefix_caching:
            prefix = min(prefix, plan.prefix_cache_bytes)
        reserve = min(self.prefix_cache_reserve_bytes, prefix)
        return replace(self, prefill_chunk_tokens=chunk, prefix_cache_bytes=prefix, prefix_cache_reserve_bytes=reserve)

    def load_config(self, dtype: torch.dtype, device: torch.device, max_model_len: int) -> ModelLoadConfig:
        """How the engine loads its checkpoint: ``dtype`` on ``device``, experts in ``expert_format``."""
        return ModelLoadConfig(
            dtype, device, max_model_len, expert_format=self.expert_format, backbone_format=self.backbone_format
        )

    @property
    def cache_kv_dtype(self) -> str | None:
        """``kv_dtype`` as ``CausalLM.new_cache`` takes it (``None``: the model dtype)."""
        return None if self.kv_dtype == "auto" else self.kv_dtype


@dataclass
class RequestUpdate:
    """What one step produced for one request.

    ``new_text`` is the incremental text (stop strings cut, never half a character, never the start
    of a possible stop string). ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"`` or None.
    ``logprobs``: one per new token when ``params.logprobs`` is set. ``prompt_logprobs``: once, on the
    first update, when ``params.prompt_logprobs`` is set (``None`` for the first prompt token).
    ``error``: why the engine gave up on the request (with ``finish_reason == "abort"``).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # Optimistic KV admission: running requests preempted (KV freed, recomputed when re-admitted).
    preemptions_total: int = 0
    # Prefill (moetier.engine.prefill_meter): wall seconds of steps that computed prompt tokens, the prompt
    # tokens computed (prefix-cache hits excluded), their ratio over the last ~30 s of prefill work, the
    # prompt tokens the running requests have still to prefill, and per running request still prefilling
    # (by engine request id): (prompt tokens in its cache, prompt tokens).
    prefill_seconds_total: float = 0.0
    prefill_computed_tokens_total: int = 0
    prefill_tokens_per_second: float = 0.0
    prefill_remaining_tokens: int = 0
    prefill_progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # prefix_cache_queries/hits count prompt tokens (looked up / served from the cache, as vLLM's metrics
    # do); these count requests, and the memory the snapshots hold.
    prefix_cache_lookups: int = 0
    prefix_cache_lookup_hits: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_entries: int = 0
    # Same-step prefix sharing: requests deferred while a running request prefilled a prefix they share,
    # and the prompt tokens such requests then took from the cache instead of computing them.
    prefix_shared_deferrals_total: int = 0
    prefix_shared_tokens_saved_total: int = 0
    # Paged KV only (None otherwise): bytes of the blocks sequences and snapshots hold, and of the pools;
    # blocks running sequences hold (shared with snapshots or not), blocks only snapshots hold (lent to the
    # prefix cache, which counts them in prefix_cache_bytes; running sequences take them back on demand),
    # and the pools' blocks (sized at start-up: kv_pool_blocks_used / kv_pool_blocks is the KV use).
    kv_pool_bytes_used: int | None = None
    kv_pool_bytes_allocated: int | None = None
    kv_pool_blocks_used: int | None = None
    kv_pool_blocks_lent: int | None = None
    kv_pool_blocks: int | None = None
    # Tiered experts only (None otherwise): the elastic VRAM expert cache now, its bounds, how often it was
    # resized, and the KV bytes the running sequences hold against the plan's reservation.
    expert_cache_slots: int | None = None
    expert_cache_bytes: int | None = None
    expert_cache_max_slots: int | None = None
    expert_cache_min_slots: int | None = None
    expert_cache_resizes: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_reserved_bytes: int | None = None
    # Decode CUDA graphs captured so far (a model with segment graphs; on CUDA only), and, where finished
    # sequences' caches wait for the next ones (moetier.engine.spare_caches), how many wait and were reused.
    decode_graph_captures_total: int | None = None
    spare_caches: int | None = None
    spare_cache_reuses_total: int | None = None


def prefill_stats(meter: PrefillMeter, running: Iterable[Sequence]) -> dict[str, Any]:
    """The prefill fields of :class:`EngineStats`: ``meter``'s counters and the ``running`` sequences' progress."""
    progress = {s.request_id: (s.num_computed, s.num_prompt) for s in running if s.prefilling}
    return {
        "prefill_seconds_total": meter.seconds_total,
        "prefill_computed_tokens_total": meter.computed_tokens_total,
        "prefill_tokens_per_second": meter.tokens_per_second,
        "prefill_remaining_tokens": sum(total - done for done, total in progress.values()),
        "prefill_progress": progress,
    }


# --- loading helpers ----------------------------------------------------------------------------


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of the checkpoint folder ``path`` (:class:`moetier.tokenizer.Tokenizer`)."""
    from moetier.tokenizer import Tokenizer

    return Tokenizer.from_folder(path)


def checkpoint_config(path: Path) -> dict[str, Any]:
    """``config.json`` read before loading, to pick the dtype and window (the loader validates the rest)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model folder (expected config.json and *.safetensors)")
    config_path = path / "config.json"
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: config.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: config.json is not valid JSON ({exc})") from None


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's own float dtype, else bf16 on CUDA and fp32 on CPU."""
    if dtype != "auto":
        return parse_dtype(dtype)
    stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if isinstance(stored, str) and stored in _CHECKPOINT_DTYPES:
        return _CHECKPOINT_DTYPES[stored]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_window(hf_config: dict[str, Any], requested: int | None) -> int:
    """``max_model_len``: the requested one, at most the model's ``max_position_embeddings`` (the default)."""
    limit = hf_config.get("max_position_embeddings")
    if requested is None:
        if limit is None:
            raise ConfigError("config.json has no max_position_embeddings; pass max_model_len")
        return int(limit)
    if limit is not None and requested > limit:
        raise ConfigError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def token_id_set(value: Any) -> set[int]:
    """An ``eos_token_id`` field (int, list of ints or absent) as a set."""
    items = value if isinstance(value, list) else [value]
    return {int(i) for i in items if isinstance(i, int) and not isinstance(i, bool)}
