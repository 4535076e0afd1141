"""Routed experts kept quantised in the home copy (``expert_format="fp8"`` or ``"fp4"``).

DeepSeek-V3/R1 release checkpoints store every routed expert matrix as float8 plus one float32 scale
per 128 x 128 tile (:mod:`moetier.weights.fp8`). Dequantising them at load doubles the host RAM of
the home copy and the bytes of every miss; with ``expert_format="fp8"`` the loader copies the stored
bytes and scales into quantised expert blocks (:class:`~moetier.tiers.experts.ExpertQuant`) and every
reader dequantises on use with the same function, so the math is unchanged.

``expert_format="fp4"`` does the same for DeepSeek-V4's FP4 routed experts (``expert_dtype "fp4"``:
packed e2m1 bytes plus one power-of-two scale per 32 inputs, :mod:`moetier.weights.fp4`): about 0.27x
of bf16 for ue8m0 checkpoints (half a byte a value plus an e8m0 scale byte per 32 values), 0.31x with float32
scales (``MOETIER_FP4_SCALES=float32``, or a checkpoint without ue8m0 scales); scales are converted once at load.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from moetier.config import check_expert_format
from moetier.errors import ConfigError
from moetier.tiers.experts import SCALE_FORMATS, ExpertLayout, ExpertQuant, ExpertWeights
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.fp4 import scale_to_float
from moetier.weights.fp8 import block_size_of

# quantization_config.fmt -> the float8 encoding of the stored weights
FP8_ENCODINGS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FIX = "load it with --expert-format dense (expert_format='dense')"
# DeepSeek-V4's release: one scale per 32 inputs of a row (the checkpoint's scale shapes are checked at load)
FP4_TILE = (1, 32)


def expert_quant_of(hf_config: dict[str, Any], where: str) -> ExpertQuant:
    """The fp8-block quantisation a checkpoint's ``quantization_config`` declares; one-line ConfigError if none."""
    quant = hf_config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if hf_config.get("expert_dtype") == "fp4":
        raise ConfigError(
            f"{where}: expert_format 'fp8' needs fp8-block routed experts, but this checkpoint's are FP4 "
            "(expert_dtype 'fp4', as DeepSeek-V4 ships); load it with --expert-format fp4 or dense"
        )
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


def fp4_expert_quant_of(hf_config: dict[str, Any], where: str) -> ExpertQuant:
    """The fp4-block quantisation of a checkpoint whose config says ``expert_dtype: "fp4"``; else a one-line error."""
    found = hf_config.get("expert_dtype")
    if found != "fp4":
        said = "it has no expert_dtype" if found is None else f"its expert_dtype is {found!r}"
        raise ConfigError(
            f"{where}: expert_format 'fp4' needs a checkpoint with FP4 routed experts "
            f"(expert_dtype 'fp4', as DeepSeek-V4 ships), but {said}; {_FIX}"
        )
    quant = hf_config.get("quantization_config")
    ue8m0 = isinstance(quant, dict) and quant.get("scale_fmt") == "ue8m0"  # powers of two, checked at load
    scales = fp4_scale_format()
    if scales == "auto":  # the exponent bytes where the checkpoint promises powers of two
        scales = "e8m0" if ue8m0 else "float32"
    elif scales == "e8m0" and not ue8m0:
        raise ConfigError(
            f"{where}: MOETIER_FP4_SCALES=e8m0 keeps scales as exponent bytes, which needs ue8m0 scales "
            "(quantization_config.scale_fmt 'ue8m0'), and this checkpoint does not say so; unset MOETIER_FP4_SCALES"
        )
    return ExpertQuant(kind="fp4-block", tile=FP4_TILE, pow2_scales=ue8m0, scale_format=scales)


def fp4_scale_format() -> str:
    """``MOETIER_FP4_SCALES``: how fp4 expert blocks keep their scales: ``auto`` (the default: ``e8m0`` where the
    checkpoint declares ue8m0 scales, else ``float32``), ``float32`` or ``e8m0`` (one exponent byte each: 15% fewer
    bytes a block to read on a miss); anything else is refused."""
    value = os.environ.get("MOETIER_FP4_SCALES", "auto").strip().lower()
    if value not in ("auto", *SCALE_FORMATS):
        raise ConfigError(
            f"MOETIER_FP4_SCALES must be one of auto, {', '.join(SCALE_FORMATS)}, got {value!r}: unset it"
        )
    return value


def expert_layout_for(layout: ExpertLayout, hf_config: dict[str, Any], expert_format: str, where: str) -> ExpertLayout:
    """``layout`` as ``expert_format`` stores it: unchanged for dense, with the checkpoint's quantisation otherwise."""
    expert_format = check_expert_format(expert_format)
    if expert_format == "dense":
        return layout
    quant_of = fp4_expert_quant_of if expert_format == "fp4" else expert_quant_of
    quant = quant_of(hf_config, where)
    try:
        return replace(layout, quant=quant)
    except ConfigError as exc:  # e.g. an fp4 tile that does not divide the expert sizes
        raise ConfigError(f"{where}: {exc}") from None


def checkpoint_expert_layout(ckpt: Checkpoint, expert_format: str = "dense") -> ExpertLayout:
    """The expert layout of a checkpoint folder in ``expert_format`` (reads ``config.json`` only)."""
    from moetier.models import model_class_for

    family = model_class_for(ckpt.architectures)
    layout = family.expert_layout(family.config_from_hf(ckpt.config))
    return expert_layout_for(layout, ckpt.config, expert_format, str(ckpt.path / "config.json"))


def copy_quant_expert(weights: ExpertWeights, part: str, stored: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy one stored quantised matrix (``part``: gate, up or down) and its scales into a quantised block.

    fp8: float8 values of the checkpoint's encoding. fp4: packed bytes of any one-byte dtype (int8, uint8,
    float4_e2m1fn_x2). Scales become float32 (:func:`scale_to_float`), or exponent bytes where the block keeps
    e8m0 scales. Raises ``ValueError`` (the loader adds the tensor's name) for another part, encoding or shape,
    or a scale e8m0 cannot hold.
    """
    if part not in ("gate", "up", "down"):
        raise ValueError(
            f"is a fused {part} tensor; expert_format 'fp8'/'fp4' reads per-expert gate_proj/up_proj/down_proj only"
        )
    dest, dest_scale = getattr(weights, f"{part}_q"), getattr(weights, f"{part}_scale")
    if weights.quant_kind == "fp4-block":
        if stored.element_size() != 1:
            raise ValueError(f"is {stored.dtype}, not packed FP4 bytes (int8, uint8 or float4_e2m1fn_x2)")
        stored = stored.view(torch.uint8)
    elif stored.dtype != dest.dtype:
        raise ValueError(f"is {stored.dtype}, but the checkpoint's quantization_config says {dest.dtype}")
    if tuple(stored.shape) != tuple(dest.shape) or tuple(scale.shape) != tuple(dest_scale.shape):
        raise ValueError(
            f"has shape {list(stored.shape)} with scales {list(scale.shape)}, "
            f"but the config implies {list(dest.shape)} with scales {list(dest_scale.shape)}"
        )
    scale = scale_to_float(scale)
    if weights.pow2_scales and not all_powers_of_two(scale):
        raise ValueError(
            "has scales that are not powers of two, but the checkpoint's quantization_config.scale_fmt says "
            "ue8m0; fix its config (drop scale_fmt) or its scales"
        )
    # Raw bytes: a float8 -> float8 copy_ would go through float and is not needed.
    dest.view(torch.uint8).copy_(stored.view(torch.uint8))
    dest_scale.copy_(e8m0_bytes(scale) if dest_scale.dtype == torch.uint8 else scale)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal powers of two (float32) as their e8m0 exponent bytes: ``2 ** (e - 127)`` -> ``e``, exactly;
    ValueError for any other value (zero, negative, subnormal), which only float32 scales can hold."""
    bits = scale.contiguous().view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if not bool(((bits >= 0) & (mantissa == 0) & (exponent >= 1) & (exponent <= 254)).all()):
        raise ValueError(
            "has scales that are zero, negative or not normal powers of two, which e8m0 scale bytes cannot hold; "
            "set MOETIER_FP4_SCALES=float32"
        )
    return exponent.to(torch.uint8)


def all_powers_of_two(scale: torch.Tensor) -> bool:
    """Whether every value is zero or a normal power of two (what ``ExpertQuant.pow2_scales`` promises)."""
    mantissa, _ = torch.frexp(scale)
    return bool(((scale == 0) | ((mantissa.abs() == 0.5) & (scale.abs() >= 2.0**-126))).all())
