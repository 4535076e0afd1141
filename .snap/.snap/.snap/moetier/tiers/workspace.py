"""The activation workspace of a prefill chunk, and the chunk a placement plan picks for the VRAM left.

With tiered experts a prefill chunk streams nearly every expert of each MoE layer over PCIe, whatever
its length, so prefill is bounded by ``chunk_tokens x PCIe_bw / bytes_of_experts_touched``: tokens/s
grows with the chunk until compute dominates. The chunk is also the per-step token budget the scheduler
shares with running decodes, so a huge chunk stalls the other streams for the chunk's duration.
:func:`choose_prefill_chunk` weighs the two: the largest power of two in
``[MIN_AUTO_CHUNK, MAX_AUTO_CHUNK]`` whose workspace fits what :func:`workspace_allowance` grants of
the VRAM left for the workspace and the expert cache (the workspace is taken from the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetier.errors import ConfigError
from moetier.units import gib

# Activation workspace estimate: fp32 hidden-width rows alive at once per prefill token (residual,
# norms, attention projections, gathered expert rows, partial sums), plus fp32 logits per stream.
# Counted at ``hidden_size``, not DeepSeek-V4's ``hc_mult`` times wider residual (which overstated V4 ~7x):
# a bf16 prefill of a 3-layer checkpoint with V4-Flash's widths (8 experts per layer, resident, on the CPU)
# grew its peak RSS by ~270 KiB per chunk token (1024 -> 2048 tokens), attention included, against 512 KiB
# here plus the attention's own estimate: about 2x headroom for the GPU path's extra rows and fragmentation.
WORKSPACE_HIDDEN_ROWS = 32
# The chunk without a plan (every expert resident: nothing to amortise), and the least the plan picks.
DEFAULT_PREFILL_CHUNK = 512
MIN_AUTO_CHUNK = 512
# The most the plan picks on its own. A tiered V4-Flash prefilled ~5.4k tok/s with 4096-token chunks and
# ~12-15k with 16384 (H200), so an 8192-token chunk takes around a second, and every running decode waits
# that long for its next token (the chunk is the step's token budget); beyond it the streaming bound still
# improves but decode latency suffers. ``--prefill-chunk`` goes higher explicitly (batch jobs).
MAX_AUTO_CHUNK = 8192
# What the workspace may take of the VRAM left after backbone, KV, staging and prefix cache: every
# byte it takes comes out of the expert cache, so it is priced in decode speed. The plan's decode bound
# is DRAM_bw / ((1 - h) R) with h = cache bytes / all expert bytes E (uniform routing), so a workspace W
# taken from a cache C leaves (E - C) / (E - C + W) of the bound; the allowance keeps that >= 1 - 1/8,
# i.e. W <= (E - C) / 7, plus any room beyond E (the cache could not use it). Why 1/8: prefill gains up
# to 16x (512 -> 8192 tokens per chunk) for at most 12.5% off the decode bound, and the cost is
# overstated (a frequency-aware policy drops the coldest experts, worth less than the average).
# In practice: a GPU that caches a small share of a big model (the full V4-Flash on 80 GiB: ~10%) gives
# the chunk all it wants, one that nearly holds every expert keeps it small, room to spare is free.
DECODE_COST_SHARE = 8


def workspace_estimate(
    config: Any, chunk_tokens: int, max_streams: int, context: int | None = None, element: int = 4
) -> int:
    """A stated estimate of activation memory: ``WORKSPACE_HIDDEN_ROWS`` fp32 hidden-width rows per prefill
    token of a chunk, plus fp32 logits for every stream, plus (DeepSeek-V4) the largest layer's prefill
    attention workspace for ``chunk_tokens`` queries ending at ``context`` tokens (default: the chunk) with
    ``element``-byte activations (:func:`moetier.models.deepseek_v4_attention.workspace_bytes`, bounded by
    its query blocks). Not measured: override with ``workspace``."""
    rows = chunk_tokens * config.hidden_size * WORKSPACE_HIDDEN_ROWS * 4 + max_streams * config.vocab_size * 4
    return rows + _v4_attention_workspace(config, chunk_tokens, max(context or 0, chunk_tokens), element)


def _v4_attention_workspace(config: Any, queries: int, context: int, element: int) -> int:
    from moetier.models.deepseek_v4_config import DeepseekV4Config

    if not isinstance(config, DeepseekV4Config):
        return 0  # other families: eager attention over a chunk is within the hidden-row estimate
    from moetier.models.deepseek_v4_attention import workspace_bytes

    return max(workspace_bytes(config, layer, queries, context, element) for layer in range(config.num_hidden_layers))


def workspace_allowance(room: int, expert_bytes: int) -> int:
    """Bytes the workspace of an automatic chunk may take of ``room`` (the VRAM left for the workspace and
    the expert cache) when all routed experts hold ``expert_bytes``: the room the cache cannot use, plus
    what lowers the uniform-routing decode bound by at most ``1 / DECODE_COST_SHARE`` (see above)."""
    if room <= 0:
        return 0
    cache = min(room, expert_bytes)  # the cache without a workspace
    return min(room, room - cache + (expert_bytes - cache) // (DECODE_COST_SHARE - 1))


def auto_chunk_limit(tokens: int) -> int:
    """The largest chunk worth choosing for ``tokens`` prompt tokens in flight at most (context x streams):
    the smallest power of two covering them, within ``[MIN_AUTO_CHUNK, MAX_AUTO_CHUNK]``. A larger chunk
    could never be filled and its workspace would only be taken from the expert cache."""
    limit = MIN_AUTO_CHUNK
    while limit < min(tokens, MAX_AUTO_CHUNK):
        limit *= 2
    return limit


@dataclass(frozen=True)
class ChunkChoice:
    """The prefill chunk of a plan: ``tokens``, its ``workspace`` bytes, and why (``note`` for the table).

    ``allowance``: the bytes an automatic choice had (None when the chunk was given)."""

    tokens: int
    workspace: int
    allowance: int | None
    note: str


def choose_prefill_chunk(estimate: Callable[[int], int], allowance: int, limit: int = MAX_AUTO_CHUNK) -> ChunkChoice:
    """The largest power of two in ``[MIN_AUTO_CHUNK, limit]`` whose ``estimate(tokens)`` workspace fits
    ``allowance`` bytes; ``MIN_AUTO_CHUNK`` when none does (the plan's shortfall errors then speak)."""
    if limit < MIN_AUTO_CHUNK:
        raise ConfigError(f"the automatic prefill chunk limit must be >= {MIN_AUTO_CHUNK}, got {limit}")
    tokens = MIN_AUTO_CHUNK
    while tokens * 2 <= limit and estimate(tokens * 2) <= allowance:
        tokens *= 2
    workspace = estimate(tokens)
    why = f"auto: workspace {gib(workspace)} GiB of {gib(allowance)} GiB allowed"
    if workspace > allowance:
        why = f"auto: even this chunk's workspace {gib(workspace)} GiB exceeds the {gib(allowance)} GiB allowed"
    elif tokens == MAX_AUTO_CHUNK:
        why += f"; capped at {MAX_AUTO_CHUNK} to interleave with decodes, --prefill-chunk goes higher"
    elif tokens == limit:
        why += "; no more prompt tokens fit context x streams"
    return ChunkChoice(tokens, workspace, allowance, why)
