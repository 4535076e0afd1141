"""Warm the decode path before the first request: compile kernels, capture decode graphs.

On CUDA the first decode step at each batch size is slow: Triton compiles its kernels (RMSNorm,
Sinkhorn, the grouped experts: a second or more each), and DeepSeek-V4's decode segments run once
eagerly, then are captured as CUDA graphs (:mod:`moetier.models.graph_segments`). Users would see
that as a stall in their first streams. The server therefore runs, while ``/health`` still says
503, a short prefill and a few decode steps at every batch size up to ``max_streams``, on throwaway
caches (the engine's own scheduler, KV accounting and prefix cache never see them). Only the
dispatcher's counters are reset afterwards; a tiered expert cache keeps what the warm-up admitted
(its policy counts a few random tokens' routing, as it would a first request's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moetier.errors import ConfigError
from moetier.models.base import CausalLM

log = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    """What :func:`warm_up` ran: batch sizes, decode steps per size, wall seconds, graphs captured."""

    batch_sizes: list[int]
    decode_steps: int
    seconds: float
    graphs_captured: int | None  # None when the model has no decode graphs

    def describe(self) -> str:
        graphs = "" if self.graphs_captured is None else f", {self.graphs_captured} decode graphs captured"
        sizes = ",".join(str(b) for b in self.batch_sizes)
        return f"warm-up: batch sizes {sizes}, {self.decode_steps} decode steps each, {self.seconds:.1f} s{graphs}"


def warm_up(
    model: CausalLM,
    batch_sizes: Iterable[int],
    vocab_size: int,
    prompt_tokens: int = 8,
    decode_steps: int = 3,
    seed: int = 0,
) -> WarmupReport:
    """Prefill ``prompt_tokens`` random tokens per sequence, then greedy-decode ``decode_steps`` steps,
    for each batch size, on fresh caches that are dropped afterwards. Three steps cover a segment's
    eager warm-up call, its capture and one replay."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1 or prompt_tokens < 1 or decode_steps < 1 or vocab_size < 1:
        raise ConfigError(
            f"warm-up needs batch sizes >= 1, prompt_tokens, decode_steps and vocab_size >= 1, got "
            f"{sizes}, {prompt_tokens}, {decode_steps}, {vocab_size}"
        )
    graphs = getattr(model, "graphs", None)
    captured_before = getattr(graphs, "captures", None)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for size in sizes:
        _run_batch(model, size, vocab_size, prompt_tokens, decode_steps, generator)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    metrics = getattr(model.dispatcher, "metrics", None)
    if metrics is not None:
        metrics.reset()  # /metrics starts from the first real request
    captured = None if captured_before is None else graphs.captures - captured_before
    report = WarmupReport(sizes, decode_steps, time.perf_counter() - start, captured)
    log.info(report.describe())
    return report


@torch.inference_mode()
def _run_batch(
    model: CausalLM, size: int, vocab: int, prompt_tokens: int, steps: int, generator: torch.Generator
) -> None:
    caches = [model.new_cache(prompt_tokens + steps + 1) for _ in range(size)]
    ids = torch.randint(0, vocab, (size * prompt_tokens,), generator=generator).to(model.device)
    hidden = model(ids, caches, [prompt_tokens] * size)
    tokens = model.compute_logits(hidden.view(size, prompt_tokens, -1)[:, -1]).argmax(-1)
    for _ in range(steps):
        tokens = model.compute_logits(model(tokens, caches, [1] * size)).argmax(-1)
