"""FP4 routed experts for benchmark checkpoints, stored as DeepSeek-V4's release stores them.

``make-bench-model --fp4-experts`` (DeepSeek-V4 shapes only) writes every routed expert matrix
``[N, K]`` as packed e2m1 codes, int8 ``[N, K/2]`` (value ``2j`` in the low nibble of byte ``j``),
plus ``<module>.scale``: one ue8m0 scale (``float8_e8m0fnu``, a power of two) per 32 inputs of a
row, ``[N, K/32]``. ``config.json`` says ``expert_dtype: "fp4"`` and
``quantization_config.scale_fmt: "ue8m0"``, so the folder loads like the release: dequantised at
load (``--expert-format dense``) or kept packed in the home copy (``--expert-format fp4``); see
:mod:`moetier.weights.fp4` for the layout.

Values: every byte is uniform, so each nibble is one of the 16 codes with equal odds (mean square
``CODE_MEAN_SQUARE``). Each tile's scale is ``2**e`` or ``2**(e+1)``, drawn so that the dequantised
weights have the dense init's variance (``std**2``) exactly in expectation: the model's activations
keep the scale of a ``--dtype`` bench model's. Real powers of two exercise the CPU kernel's fast path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from moetier.bench.fp8_model import quantization_config as fp8_quantization_config
from moetier.bench.shapes import Normal, TensorSpec
from moetier.errors import ConfigError
from moetier.weights.fp4 import E2M1_MAGNITUDES
from moetier.weights.quant_experts import FP4_TILE

# int8, as the release stores it (transformers reads int8 expert weights as packed FP4, uint8 it would not).
PACKED_DTYPE = torch.int8
SCALE_DTYPE = torch.float8_e8m0fnu
BLOCK = FP4_TILE[1]  # inputs per scale
E8M0_BIAS = 127
# The 16 codes (8 magnitudes, both signs) with equal odds.
CODE_MEAN_SQUARE = sum(m * m for m in E2M1_MAGNITUDES) / len(E2M1_MAGNITUDES)
FP4_MODEL_TYPES = ("deepseek_v4",)  # the families whose release ships FP4 routed experts
# DeepSeek-V4's routed expert matrices (shared experts stay in the model dtype, as in the release).
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class Fp4Codes:
    """Packed e2m1 bytes, every byte uniform (both nibbles independent, each of the 16 codes equally likely)."""


@dataclass(frozen=True)
class Ue8m0Scales:
    """Power-of-two scales: ``2**exponent``, or ``2**(exponent + 1)`` with probability ``p_up`` (validated)."""

    exponent: int
    p_up: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_up <= 1.0:
            raise ValueError(f"p_up must be in [0, 1], got {self.p_up}")
        if not -E8M0_BIAS <= self.exponent < E8M0_BIAS:  # e + 1 must stay below e8m0's NaN byte (255)
            raise ValueError(f"exponent {self.exponent} is outside ue8m0's range")

    @property
    def mean_square(self) -> float:
        return 4.0**self.exponent * (1.0 + 3.0 * self.p_up)


def scales_for_std(std: float) -> Ue8m0Scales:
    """Scales whose dequantised weights (uniform codes times scale) have variance ``std**2`` in expectation.

    With ``t = std / sqrt(CODE_MEAN_SQUARE)`` and ``e = floor(log2 t)``, a scale of ``2**e`` (odds
    ``1 - p``) or ``2**(e+1)`` (odds ``p``) has mean square ``4**e * (1 + 3p)``; ``p`` makes it ``t**2``.
    """
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    target = std / math.sqrt(CODE_MEAN_SQUARE)
    exponent = math.floor(math.log2(target))
    p_up = (target * target / 4.0**exponent - 1.0) / 3.0
    return Ue8m0Scales(exponent, min(max(p_up, 0.0), 1.0))  # the clamp only absorbs rounding


def check_fp4_shape(cfg: dict[str, Any]) -> None:
    """One-line ConfigError unless ``cfg`` is a family whose release stores FP4 routed experts."""
    model_type = cfg.get("model_type")
    if model_type not in FP4_MODEL_TYPES:
        raise ConfigError(
            f"--fp4-experts writes DeepSeek-V4's FP4 expert format, which {model_type!r} checkpoints never ship; "
            "use a deepseek-v4 shape (or --fp8-experts for DeepSeek-V3's fp8 format)"
        )


def fp4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` declaring FP4 experts as the release does (``expert_dtype``, ``quantization_config.scale_fmt``)."""
    return {**cfg, "expert_dtype": "fp4", "quantization_config": {**fp8_quantization_config(), "scale_fmt": "ue8m0"}}


def fp4_expert_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` with every routed expert matrix as packed FP4 bytes followed by its ``.scale`` grid.

    Raises ConfigError when a matrix's inputs are not a multiple of ``BLOCK`` (no whole scale tiles).
    """
    out = []
    for spec in specs:
        if not (_EXPERT_WEIGHT.search(spec.name) and isinstance(spec.init, Normal) and len(spec.shape) == 2):
            out.append(spec)
            continue
        rows, cols = spec.shape
        if cols % BLOCK:
            raise ConfigError(
                f"--fp4-experts needs expert widths that are multiples of {BLOCK} (one scale per {BLOCK} inputs); "
                f"{spec.name} has {cols} inputs"
            )
        out.append(replace(spec, shape=(rows, cols // 2), init=Fp4Codes(), dtype="I8"))
        scales = scales_for_std(spec.init.std)
        out.append(TensorSpec(spec.name.removesuffix(".weight") + ".scale", (rows, cols // BLOCK), scales, "F8_E8M0"))
    return out


def fill_fp4_codes(view: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill the one-byte ``view`` with uniform random bytes; returns it."""
    view.view(torch.uint8).random_(0, 256, generator=generator)
    return view


def fill_ue8m0(view: torch.Tensor, generator: torch.Generator, init: Ue8m0Scales) -> torch.Tensor:
    """Fill the float8_e8m0fnu ``view`` with ``init``'s powers of two (written as exponent bytes); returns it."""
    draws = torch.empty(view.shape, dtype=torch.float32, device=view.device).uniform_(generator=generator)
    view.view(torch.uint8).copy_(draws.lt_(init.p_up).to(torch.uint8)).add_(E8M0_BIAS + init.exponent)
    return view
