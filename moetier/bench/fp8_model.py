"""FP8 routed experts for benchmark checkpoints, stored as DeepSeek's release stores them.

``make-bench-model --fp8-experts`` writes every routed expert matrix as float8 e4m3 with one float32
``weight_scale_inv`` per 128 x 128 tile and declares ``quantization_config`` (``quant_method`` fp8), so
the folder loads like a DeepSeek-V3/R1 release checkpoint: dequantised at load (``--expert-format
dense``) or kept fp8 in the home copy (``--expert-format fp8``). Values are normal draws of the dense
weight's standard deviation; one scale per tensor (``FP8_RANGE_STD`` deviations map to e4m3's largest
value) keeps the draw cheap and every tile's scale equal.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from moetier.bench.shapes import Fill, Normal, TensorSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
FP8_RANGE_STD = 8.0  # draws beyond 8 standard deviations (never, in practice) would clip
TILE = (128, 128)
# Routed experts' matrices in the three families' checkpoint names.
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# The backbone linears DeepSeek's fp8 releases store as float8: attention's projections (V4's compressors and
# indexer too), dense layers' and shared experts' MLPs. Embeddings, the LM head, routers and norms stay dense.
_BACKBONE_LINEAR = re.compile(
    r"\.(self_attn|attn)\.(.+\.)?(w\w*|\w+_proj|\w+_proj_with_mqa)\.weight$"
    r"|\.shared_experts?\.\w+\.weight$|\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight$"
)


@dataclass(frozen=True)
class Fp8Normal:
    """Normal values of ``std`` stored as float8 ``value / scale`` (the companion scale tensor holds ``scale``)."""

    std: float
    scale: float


def quantization_config() -> dict[str, Any]:
    """What a DeepSeek fp8 release declares in ``config.json``."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(TILE)}


def fp8_expert_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` with every routed expert matrix as fp8 (``dtype`` "F8") followed by its tile scales."""
    return _fp8_specs(specs, _EXPERT_WEIGHT)


def fp8_backbone_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` with every backbone linear a DeepSeek fp8 release stores as float8 so, followed by its scales."""
    return _fp8_specs(specs, _BACKBONE_LINEAR)


def _fp8_specs(specs: list[TensorSpec], names: re.Pattern[str]) -> list[TensorSpec]:
    out = []
    for spec in specs:
        if not (names.search(spec.name) and isinstance(spec.init, Normal) and len(spec.shape) == 2):
            out.append(spec)
            continue
        scale = spec.init.std * FP8_RANGE_STD / FP8_MAX
        out.append(replace(spec, init=Fp8Normal(spec.init.std, scale), dtype="F8"))
        grid = tuple(math.ceil(size / tile) for size, tile in zip(spec.shape, TILE, strict=True))
        out.append(TensorSpec(spec.name.removesuffix(".weight") + ".weight_scale_inv", grid, Fill(scale), "F32"))
    return out


def fill_fp8(view: torch.Tensor, generator: torch.Generator, init: Fp8Normal) -> torch.Tensor:
    """Fill the float8 ``view`` with normal draws of ``init.std`` divided by ``init.scale``; returns it."""
    dense = torch.empty(view.shape, dtype=torch.float32, device=view.device)
    dense.normal_(0.0, init.std, generator=generator).div_(init.scale).clamp_(-FP8_MAX, FP8_MAX)
    return view.copy_(dense.to(FP8_DTYPE))
