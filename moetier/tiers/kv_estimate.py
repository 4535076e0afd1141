"""How much attention state a family keeps per token of context and per stream (the plan's KV rule)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetier.errors import ConfigError
from moetier.units import gib


@dataclass(frozen=True)
class KvEstimate:
    """KV-cache elements (at the load dtype) per token of context and per stream, over all layers."""

    per_token: float
    per_stream: int
    note: str
    # fp8 KV (``kv_dtype="fp8"``): float32 scales per token that come with the per-token elements
    # (one per token per row group: a KV head's keys or values, MLA's latent or rope key, a V4 entry).
    scales_per_token: float = 0.0

    def token_bytes(self, element: int, kv_dtype: str = "auto") -> float:
        """Bytes per token of context: the per-token elements at ``element`` bytes (``auto``), 2 (``bf16``)
        or 1 plus their float32 scales (``fp8``). The per-stream state stays at the load dtype."""
        if kv_dtype == "fp8":
            return self.per_token + 4 * self.scales_per_token
        return self.per_token * (2 if kv_dtype == "bf16" else element)


def kv_estimate(config: Any) -> KvEstimate:
    """The family's attention state per token, from its config dataclass (one rule per attention kind).

    - DeepSeek-V4 (``layer_types``): compressed entries, ``head_dim / rate`` per token per CSA/HCA
      layer plus ``index_head_dim / rate`` for the CSA indexer; per stream the sliding window ring
      (``sliding_window`` keys per layer), the open compressor windows and CSA's predecessor halves.
    - MLA (``kv_lora_rank``, DeepSeek-V3): ``kv_lora_rank + qk_rope_head_dim`` per token per layer.
    - GQA (``num_key_value_heads``, ``head_dim``): keys and values, ``2 * kv_heads * head_dim``.
    """
    layers = config.num_hidden_layers
    if hasattr(config, "layer_types") and hasattr(config, "compress_rates"):
        return _v4_kv(config)
    if hasattr(config, "kv_lora_rank"):
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return KvEstimate(layers * width, 0, f"MLA latent, {width} values per token per layer", 2 * layers)
    if hasattr(config, "num_key_value_heads") and hasattr(config, "head_dim"):
        width = 2 * config.num_key_value_heads * config.head_dim
        note = f"GQA keys + values, {width} values per token per layer"
        return KvEstimate(layers * width, 0, note, 2 * config.num_key_value_heads * layers)
    raise ConfigError(f"cannot estimate the KV cache of {type(config).__name__}; pass kv_bytes_per_token")


def kv_budget_line(config: Any, tokens: int, origin: str, streams: int, element: int, kv_dtype: str = "auto") -> str:
    """``"<tokens> tokens (<origin>), about <GiB> GiB"``: the estimated bytes of ``streams`` contiguous caches
    holding ``tokens`` tokens together (:func:`kv_estimate`'s rule, ``element`` bytes per value at the load
    dtype); without the bytes when the family has no estimate."""
    line = f"{tokens} tokens ({origin})"
    try:
        kv = kv_estimate(config)
    except ConfigError:
        return line
    return f"{line}, about {gib(tokens * kv.token_bytes(element, kv_dtype) + streams * kv.per_stream * element)} GiB"


def _v4_kv(config: Any) -> KvEstimate:
    per_token, per_stream, scales = 0.0, 0, 0.0
    # Per stream, what DeepseekV4Cache allocates up front: the window ring, each compressor's open window
    # (projections and gates) and, overlapping (CSA, its indexer), the predecessor half's kv and gate (the
    # gate is float32: counted as one value, exact in fp32, half its bytes in 16-bit).
    for layer in range(config.num_hidden_layers):
        per_stream += config.sliding_window * config.head_dim
        rate = config.compress_rate(layer)
        if rate == 0:
            continue
        csa = config.layer_types[layer] == "compressed_sparse_attention"
        width = config.head_dim * (2 if csa else 1)
        per_token += config.head_dim / rate
        scales += 1 / rate
        per_stream += 2 * rate * width + (2 * rate * config.head_dim if csa else 0)
        if csa:
            per_token += config.index_head_dim / rate
            scales += 1 / rate
            per_stream += 2 * rate * 2 * config.index_head_dim + 2 * rate * config.index_head_dim
    note = "V4 compressed entries per token; window + open windows per stream"
    return KvEstimate(per_token, per_stream, note, scales)


def prefix_reservation(budget: Any, stream_bytes: int) -> tuple[int, str]:
    """The prefix cache's VRAM and its note: the budget's bound, or, where snapshots borrow their caches' entries
    and hold one stream's rolling state (``stream_bytes``) each, that many snapshots' worth (within the bound)."""
    bound, snapshots = int(budget.prefix_cache), budget.prefix_snapshots
    if snapshots is None or stream_bytes <= 0 or snapshots * stream_bytes >= bound:
        return bound, "snapshots of earlier prompts"
    # An owned V4 snapshot of a 100k-token V4-Flash context is 0.64 GiB (bf16); a borrowed one is its rolling
    # state alone (~11 MiB), so the rest of the bound goes to the expert cache.
    return snapshots * stream_bytes, (
        f"{snapshots} snapshots borrowing their caches' entries, {stream_bytes / (1 << 20):.1f} MiB each"
    )


def kv_shortfall(
    gpu: int, fixed: int, wanted: int, budget: Any, kv_bytes: Callable[[int, int], int], prefix: int = 0
) -> str:
    """The one-line refusal of a plan whose KV cache does not fit what ``fixed`` (``prefix`` of it the prefix
    cache's) leaves of ``gpu``, naming the knobs that would make it fit (``kv_bytes(context, streams)``: the KV
    rule)."""
    room = gpu - fixed
    streams, context = budget.reserved_streams, budget.context
    fit_context = _largest(context, lambda c: kv_bytes(c, streams) <= room)
    fit_streams = _largest(streams, lambda s: kv_bytes(context, s) <= room)
    hints = [f"raise --gpu-memory by {gib(fixed + wanted - gpu)} GiB"]
    if fit_context:
        hints.append(f"lower --context to {fit_context}")
    if fit_streams:
        hints.append(f"lower --max-streams to {fit_streams}")
    if prefix:
        hints.append(f"lower --prefix-cache (it reserves {gib(prefix)} GiB)")
    return (
        f"the KV cache of {streams} stream(s) x {context} tokens needs {gib(wanted)} GiB but only "
        f"{gib(max(room, 0))} GiB of --gpu-memory {gib(gpu)} GiB is left after the backbone, workspace, "
        f"staging slots and prefix cache; " + ", or ".join(hints)
    )


def _largest(limit: int, fits) -> int:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)`` (``fits`` monotone), or 0."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
