"""Router state of benchmark checkpoints: gate weights, selection biases and hash tables, per layer.

Without a skew the routers are plain random (reference init: normal gate weights, zero bias,
uniformly random distinct ``tid2eid`` rows). With ``--routing-skew ALPHA`` each layer's router is
shaped to follow a drawn expert popularity (see :mod:`moetier.bench.skew`) and a
:class:`~moetier.bench.skew.SkewReport` records how closely it does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moetier.bench import skew
from moetier.bench.shapes import routed_experts

# Calibration runs on this many sample tokens for this many steps; the report uses fresh tokens.
CALIBRATION_TOKENS = 8192
CALIBRATION_STEPS = 100
EVALUATION_TOKENS = 16384
_TABLE_ROWS = 8192  # tid2eid rows drawn at a time


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


class RouterFactory:
    """Builds (and hands out once) each layer's router tensors.

    ``random_tensor(name, shape, std)`` must return a seeded normal tensor on ``device`` in the
    model dtype; ``seed_for(label)`` a deterministic seed for a label.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        device: torch.device,
        random_tensor: Callable[[str, tuple[int, ...], float], torch.Tensor],
        seed_for: Callable[[str], int],
        alpha: float | None,
    ) -> None:
        self.cfg, self.device, self.alpha = cfg, device, alpha
        self._random_tensor, self._seed_for = random_tensor, seed_for
        self.experts, self.top_k = routed_experts(cfg), cfg["num_experts_per_tok"]
        self.reports: list[skew.SkewReport] = []
        self._ready: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, layer: int, part: str, name: str) -> torch.Tensor:
        """The CPU tensor for ``part`` (weight / bias / tid2eid) of ``layer``'s router."""
        if (layer, part) not in self._ready:
            self._build(layer, name)
        return self._ready.pop((layer, part)).cpu()

    # -- per-family construction --------------------------------------------------------------

    def _build(self, layer: int, name: str) -> None:
        prefix = name.rsplit(".", 1)[0]
        weight = self._random_tensor(
            f"{prefix}.weight", (self.experts, self.cfg["hidden_size"]), self.cfg["initializer_range"]
        )
        model_type = self.cfg["model_type"]
        if model_type == "deepseek_v4" and self.cfg["mlp_layer_types"][layer] == "hash_moe":
            self._ready[(layer, "tid2eid")] = self._hash_table(layer)
            self._ready[(layer, "weight")] = weight
        elif model_type == "qwen3_moe":
            self._ready[(layer, "weight")] = self._row_scaled(layer, weight)
        else:
            self._ready[(layer, "weight")] = weight
            self._ready[(layer, "bias")] = self._selection_bias(layer, weight)

    def _target(self, layer: int, cap: float) -> tuple[np.ndarray, torch.Tensor]:
        popularity = skew.draw_popularity(self.alpha, self.experts, self._seed_for(f"routing_skew/{layer}"))
        rates = skew.water_fill(popularity * self.top_k, cap)
        return popularity, torch.tensor(rates, dtype=torch.float32, device=self.device)

    def _generator(self, label: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self._seed_for(label))

    def _report(self, layer: int, method: str, popularity: np.ndarray, target, observed) -> None:
        self.reports.append(
            skew.SkewReport(
                layer, method, popularity.tolist(), skew.as_distribution(target), skew.as_distribution(observed)
            )
        )

    def _selection(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], skew.Selector]:
        """(score function, expert choice) of the family's learned router, bias excluded."""
        if self.cfg["model_type"] == "deepseek_v3":
            select = skew.select_grouped(self.top_k, self.cfg["n_group"], self.cfg["topk_group"])
            return torch.sigmoid, select
        return _sqrtsoftplus, skew.select_topk(self.top_k)

    def _selection_bias(self, layer: int, weight: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3/V4 ``e_score_correction_bias``: zeros, or shaped to the layer's popularity."""
        if self.alpha is None:
            return torch.zeros(self.experts, dtype=torch.float32)
        score, select = self._selection()
        popularity, target = self._target(layer, skew.BIAS_MAX_RATE)
        calib = skew.sample_logits(weight, CALIBRATION_TOKENS, self._generator(f"calibrate/{layer}"))
        bias = skew.calibrate_bias(score(calib), select, target, CALIBRATION_STEPS)
        fresh = skew.sample_logits(weight, EVALUATION_TOKENS, self._generator(f"evaluate/{layer}"))
        observed = skew.pick_rates(select(score(fresh) + bias), self.experts)
        self._report(layer, "e_score_correction_bias", popularity, target, observed)
        return bias.float()

    def _row_scaled(self, layer: int, weight: torch.Tensor) -> torch.Tensor:
        """Qwen3 gate weight: plain, or rows scaled so wider logits win the top-k more often."""
        if self.alpha is None:
            return weight
        popularity, target = self._target(layer, skew.ROW_SCALE_MAX_RATE)
        calib = skew.sample_logits(weight, CALIBRATION_TOKENS, self._generator(f"calibrate/{layer}"))
        log_scale, _ = skew.calibrate_row_scale(calib, self.top_k, target, CALIBRATION_STEPS)
        scaled = (weight.float() * log_scale.exp()[:, None]).to(weight.dtype)
        fresh = skew.sample_logits(scaled, EVALUATION_TOKENS, self._generator(f"evaluate/{layer}"))
        observed = skew.pick_rates(skew.select_topk(self.top_k)(fresh), self.experts)
        self._report(layer, "gate_row_scale", popularity, target, observed)
        return scaled

    def _hash_table(self, layer: int) -> torch.Tensor:
        """DeepSeek-V4 ``tid2eid``: ``top_k`` distinct experts per token id, uniform or by popularity.

        Top-k of Gumbel noise picks k distinct experts uniformly; adding a per-expert bias (fitted so
        that column frequencies follow the popularity) skews the choice.
        """
        vocab, experts = self.cfg["vocab_size"], self.experts
        bias = torch.zeros(experts, device=self.device)
        if self.alpha is not None:
            popularity, target = self._target(layer, skew.BIAS_MAX_RATE)
            shape = (min(vocab, CALIBRATION_TOKENS), experts)
            noise = skew.gumbel(shape, self._generator(f"calibrate/{layer}"), self.device)
            init = torch.log(target.clamp_min(1e-6))
            bias = skew.calibrate_bias(noise, skew.select_topk(self.top_k), target, CALIBRATION_STEPS, init=init)
        generator = self._generator(f"tid2eid/{layer}")
        rows = []
        for start in range(0, vocab, _TABLE_ROWS):
            noise = skew.gumbel((min(_TABLE_ROWS, vocab - start), experts), generator, self.device)
            rows.append(torch.topk(noise + bias, self.top_k, dim=-1).indices.cpu())
        table = torch.cat(rows).to(torch.int64)
        if self.alpha is not None:
            self._report(layer, "tid2eid", popularity, target, skew.pick_rates(table, experts))
        return table

    def skew_summary(self) -> dict[str, Any]:
        """The ``routing_skew.json`` payload: per-layer popularity, target, observed, and fit numbers."""
        layers = {str(r.layer): r.as_json() for r in self.reports}
        return {
            "alpha": self.alpha,
            "experts": self.experts,
            "top_k": self.top_k,
            "inputs": "RMS-normalised Gaussian hidden states (hash layers: uniform token ids)",
            "calibration_tokens": CALIBRATION_TOKENS,
            "evaluation_tokens": EVALUATION_TOKENS,
            "worst_total_variation": max((r.total_variation for r in self.reports), default=0.0),
            "worst_spearman": min((r.spearman for r in self.reports), default=1.0),
            "layers": layers,
        }
