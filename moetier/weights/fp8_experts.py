"""Routed experts kept fp8-block in the home copy (``expert_format="fp8"``).

DeepSeek-V3/R1 release checkpoints store every routed expert matrix as float8 plus one float32 scale
per 128 x 128 tile (:mod:`moetier.weights.fp8`). Dequantising them at load doubles the host RAM of
the home copy and the bytes of every miss; with ``expert_format="fp8"`` the loader copies the stored
bytes and scales into quantised expert blocks (:class:`~moetier.tiers.experts.ExpertQuant`) and every
reader dequantises on use with the same function, so the math is unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from moetier.config import check_expert_format
from moetier.errors import ConfigError
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.fp4 import scale_to_float
from moetier.weights.fp8 import block_size_of

# quantization_config.fmt -> the float8 encoding of the stored weights
FP8_ENCODINGS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FIX = "load it with --expert-format dense (expert_format='dense')"


def expert_quant_of(hf_config: dict[str, Any], where: str) -> ExpertQuant:
    """The fp8-block quantisation a checkpoint's ``quantization_config`` declares; one-line ConfigError if none."""
    quant = hf_config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        found = "it has no quantization_config" if method is None else f"its quant_method is {method!r}"
        raise ConfigError(
            f"{where}: expert_format 'fp8' needs a checkpoint with fp8-block weights "
            f"(quantization_config.quant_method 'fp8', as DeepSeek-V3/R1 ship), but {found}; {_FIX}"
        )
    encoding = quant.get("fmt", "e4m3")
    if encoding not in FP8_ENCODINGS:
        raise ConfigError(f"{where}: quantization_config.fmt {encoding!r} is not one of {', '.join(FP8_ENCODINGS)}")
    return ExpertQuant(tile=block_size_of(hf_config), fp8=FP8_ENCODINGS[encoding])


def expert_layout_for(layout: ExpertLayout, hf_config: dict[str, Any], expert_format: str, where: str) -> ExpertLayout:
    """``layout`` as ``expert_format`` stores it: unchanged for dense, with the checkpoint's quantisation for fp8."""
    if check_expert_format(expert_format) == "dense":
        return layout
    return replace(layout, quant=expert_quant_of(hf_config, where))


def checkpoint_expert_layout(ckpt: Checkpoint, expert_format: str = "dense") -> ExpertLayout:
    """The expert layout of a checkpoint folder in ``expert_format`` (reads ``config.json`` only)."""
    from moetier.models import model_class_for

    family = model_class_for(ckpt.architectures)
    layout = family.expert_layout(family.config_from_hf(ckpt.config))
    return expert_layout_for(layout, ckpt.config, expert_format, str(ckpt.path / "config.json"))


def copy_fp8_expert(weights: ExpertWeights, part: str, stored: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy one stored float8 matrix (``part``: gate, up or down) and its scales into a quantised block.

    Raises ``ValueError`` (the loader adds the tensor's name) for another part, encoding or shape.
    """
    if part not in ("gate", "up", "down"):
        raise ValueError(
            f"is a fused {part} tensor; expert_format 'fp8' reads per-expert gate_proj/up_proj/down_proj only"
        )
    dest, dest_scale = getattr(weights, f"{part}_q"), getattr(weights, f"{part}_scale")
    if stored.dtype != dest.dtype:
        raise ValueError(f"is {stored.dtype}, but the checkpoint's quantization_config says {dest.dtype}")
    if tuple(stored.shape) != tuple(dest.shape) or tuple(scale.shape) != tuple(dest_scale.shape):
        raise ValueError(
            f"has shape {list(stored.shape)} with scales {list(scale.shape)}, "
            f"but the config implies {list(dest.shape)} with scales {list(dest_scale.shape)}"
        )
    # Raw bytes: a float8 -> float8 copy_ would go through float and is not needed.
    dest.view(torch.uint8).copy_(stored.view(torch.uint8))
    dest_scale.copy_(scale_to_float(scale))
