"""Routing skew for benchmark checkpoints: make a random router prefer some experts, by a chosen amount.

Per layer an expert popularity ``p ~ Dirichlet(alpha * 1)`` is drawn (small ``alpha``: a few hot
experts; large ``alpha``: close to uniform). The router is then shaped so that, over random inputs,
it picks expert ``e`` in a fraction ``k * p_e`` of the tokens (``k`` = top-k, so the pick
frequencies sum to ``k`` and, divided by ``k``, match ``p``):

- DeepSeek-V3/V4 learned routers: the selection-only ``e_score_correction_bias`` (it changes which
  experts are chosen, not their weights), found by fixed-point iteration against the real router.
- Qwen3 (softmax top-k, no bias): a per-expert scale of the gate weight rows; a wider logit
  distribution wins the top-k more often. Over zero-mean inputs an expert can then win at most
  about half the tokens, so its target is capped there (see :data:`ROW_SCALE_MAX_RATE`).
- DeepSeek-V4 hash layers: the ``tid2eid`` table rows are drawn with the same popularity.

"Random inputs" are RMS-normalised Gaussian hidden states, i.e. what a router sees after its
RMSNorm (weight one) when the residual stream has no preferred direction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# An expert whose row scale grows without bound still loses the top-k whenever its logit is
# negative, so it cannot be picked for more than ~half of zero-mean inputs.
ROW_SCALE_MAX_RATE = 0.45
# A selection bias can make an expert win every token.
BIAS_MAX_RATE = 1.0

Selector = Callable[[torch.Tensor], torch.Tensor]


def draw_popularity(alpha: float, experts: int, seed: int) -> np.ndarray:
    """``p ~ Dirichlet(alpha * 1)`` over ``experts`` (float64, sums to 1)."""
    if alpha <= 0:
        raise ValueError(f"routing skew alpha must be > 0, got {alpha}")
    p = np.random.default_rng(seed).dirichlet(np.full(experts, float(alpha)))
    # Tiny alphas can underflow every component of a draw; fall back to the hottest one.
    return p if np.isfinite(p).all() and p.sum() > 0 else np.eye(experts)[0]


def water_fill(rates: np.ndarray, cap: float) -> np.ndarray:
    """Cap per-expert pick rates at ``cap`` and hand the excess to the others, proportionally.

    The sum (``k`` picks per token) is preserved as long as ``cap * len(rates) >= sum``.
    """
    rates = rates.astype(np.float64).copy()
    total = rates.sum()
    for _ in range(len(rates)):
        over = rates > cap
        if not over.any():
            break
        rates[over] = cap
        free = ~over
        room = total - cap * over.sum()
        rates[free] *= room / max(rates[free].sum(), 1e-300)
    return np.minimum(rates, cap)


def pick_rates(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Fraction of tokens that picked each expert (``ids`` is ``[N, k]``)."""
    counts = torch.bincount(ids.reshape(-1), minlength=experts).to(torch.float64)
    return counts / ids.shape[0]


def select_topk(k: int) -> Selector:
    return lambda scores: torch.topk(scores, k, dim=-1, sorted=False).indices


def select_grouped(k: int, groups: int, keep_groups: int) -> Selector:
    """DeepSeek-V3's group-limited choice: groups ranked by their best two scores, top-k inside the best groups."""

    def select(scores: torch.Tensor) -> torch.Tensor:
        tokens, experts = scores.shape
        grouped = scores.view(tokens, groups, experts // groups)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(keep_groups, dim=-1).indices, True)
        masked = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
        return masked.topk(k, dim=-1, sorted=False).indices

    return select


def router_inputs(count: int, hidden: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``count`` random post-RMSNorm hidden states (each row has RMS 1)."""
    x = torch.randn(count, hidden, generator=generator, device=device)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True))


def sample_logits(weight: torch.Tensor, count: int, generator: torch.Generator, rows: int = 1024) -> torch.Tensor:
    """Router logits ``x @ weight.T`` (float32 ``[count, E]``) for random inputs, built ``rows`` at a time."""
    w = weight.float()
    parts = [
        router_inputs(min(rows, count - start), w.shape[1], generator, w.device) @ w.T
        for start in range(0, count, rows)
    ]
    return torch.cat(parts)


def calibrate_bias(
    base: torch.Tensor, select: Selector, target: torch.Tensor, steps: int = 100, init: torch.Tensor | None = None
) -> torch.Tensor:
    """An additive bias ``b`` so that ``select(base + b)`` picks each expert at rate ``target``.

    ``base`` is ``[N, E]`` selection scores for N sample tokens; ``target`` holds picks per token
    (summing to k); ``init`` is a starting bias (default zeros). Fixed-point iteration in log
    space: raise the bias of under-picked experts, lower over-picked ones, with a step that
    shrinks as the rates settle.
    """
    experts = base.shape[1]
    floor = 0.25 / base.shape[0]  # below one pick in the sample: treat as "about zero"
    log_target = torch.log(target.clamp_min(floor))
    scale = float(base.std()) or 1.0
    bias = torch.zeros(experts, dtype=base.dtype, device=base.device) if init is None else init.to(base).clone()
    for step in range(steps):
        rates = pick_rates(select(base + bias), experts).to(base.device)
        error = (log_target - torch.log(rates.clamp_min(floor))).to(base.dtype)
        lr = scale * 0.3 * (1.0 - step / steps) + scale * 0.01
        bias += lr * error.clamp(-2.0, 2.0)
    return bias


def calibrate_row_scale(
    logits: torch.Tensor, k: int, target: torch.Tensor, steps: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert log-scales ``u`` so that top-k of ``logits * exp(u)`` picks each expert at rate ``target``.

    Returns ``(u, rates)``; the scales are kept within ``[e^-6, e^6]`` so weights stay finite.
    """
    experts = logits.shape[1]
    floor = 0.25 / logits.shape[0]
    log_target = torch.log(target.clamp_min(floor))
    log_scale = torch.zeros(experts, dtype=logits.dtype, device=logits.device)
    select = select_topk(k)
    for step in range(steps):
        rates = pick_rates(select(logits * log_scale.exp()), experts).to(logits.device)
        error = (log_target - torch.log(rates.clamp_min(floor))).to(logits.dtype)
        lr = 0.5 * (1.0 - step / steps) + 0.02
        log_scale = (log_scale + lr * error.clamp(-2.0, 2.0)).clamp(-6.0, 6.0)
    return log_scale, pick_rates(select(logits * log_scale.exp()), experts)


def gumbel(shape: tuple[int, int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise: top-k of ``log p + noise`` samples k distinct items with popularity ``p``."""
    u = torch.rand(shape, generator=generator, device=device).clamp_(1e-12, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


@dataclass
class SkewReport:
    """How well one layer's shaped router follows its drawn popularity ``p``."""

    layer: int
    method: str
    popularity: list[float]
    target: list[float]
    observed: list[float]

    @property
    def total_variation(self) -> float:
        """TV distance between the observed pick distribution and the (capped) target."""
        return 0.5 * float(np.abs(np.asarray(self.observed) - np.asarray(self.target)).sum())

    @property
    def total_variation_to_popularity(self) -> float:
        return 0.5 * float(np.abs(np.asarray(self.observed) - np.asarray(self.popularity)).sum())

    @property
    def spearman(self) -> float:
        return spearman(np.asarray(self.observed), np.asarray(self.popularity))

    def as_json(self) -> dict:
        return {
            "method": self.method,
            "popularity": self.popularity,
            "target": self.target,
            "observed": self.observed,
            "total_variation": self.total_variation,
            "total_variation_to_popularity": self.total_variation_to_popularity,
            "spearman": self.spearman,
        }


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for value in np.unique(x):  # ties share their mean rank
            same = x == value
            if same.sum() > 1:
                r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom else 0.0


def as_distribution(rates: torch.Tensor | np.ndarray) -> list[float]:
    rates = np.asarray(rates.cpu() if isinstance(rates, torch.Tensor) else rates, dtype=np.float64)
    return (rates / rates.sum()).tolist()
