"""DeepSeek-V4's FP4 routed-expert format: packed e2m1 values times per-block power-of-two scales.

The release stores routed experts this way (transformers' fine-grained FP8 integration describes
it: ``config.expert_dtype = "fp4"``, ``quantization_config.scale_fmt = "ue8m0"``):

- a weight ``[N, K]`` is stored packed, two e2m1 values per byte, as int8/uint8 ``[N, K/2]``
  (safetensors ``F4``, torch ``float4_e2m1fn_x2``, is the same bytes). Element ``2j`` of a row is
  the LOW nibble of byte ``j``, element ``2j + 1`` the high nibble;
- a nibble is sign (bit 3), exponent (bits 2-1, bias 1) and mantissa (bit 0), so its magnitudes
  are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent 0 is subnormal: mantissa * 0.5);
- a scale grid ``[N / bn, K / bk]`` multiplies each ``bn x bk`` block; the release has one scale
  per 32 inputs of a row (``[N, K/32]``). Scales are ue8m0 (``F8_E8M0``: ``2 ** (e - 127)``),
  raw exponent bytes (``U8``), or float32 (the base-model release keeps its powers of two there);
- the scale is ``<module>.scale`` in the release, ``<module>.weight_scale_inv`` once transformers
  has renamed it, and ``<param>_scale_inv`` beside a fused expert parameter (``experts.gate_up_proj``).

Dequantisation multiplies in float32 and rounds once to the target dtype, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import WeightFormat, register_format

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Packed storage dtypes (safetensors names); "F4" says it outright, I8/U8 only for weight-like names.
_PACKED_DTYPES = ("F4", "I8", "U8")


def _byte_table() -> torch.Tensor:
    """``[256, 2]`` float32: the (low-nibble, high-nibble) values of every byte."""
    nibble = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([nibble[byte & 0xF], nibble[byte >> 4]], dim=-1)


_BYTE_TABLE = _byte_table()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., K/2]`` (int8, uint8 or float4_e2m1fn_x2) -> float32 values ``[..., K]``."""
    codes = packed.contiguous().view(torch.uint8)
    # One lookup per byte yields both nibbles; int32 indices keep the temporary at 4 bytes per byte.
    pairs = F.embedding(codes.to(torch.int32), _BYTE_TABLE.to(packed.device))
    return pairs.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32: ue8m0 and float dtypes by value, raw uint8 as exponent bytes."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.to(torch.int32) - 127)
    if not scale.is_floating_point():
        raise ValueError(f"scale has dtype {scale.dtype}; expected float8_e8m0fnu, uint8 or a float dtype")
    return scale.to(torch.float32)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``unpack_e2m1(packed)`` times its block of ``scale``, rounded once to ``dtype``.

    ``packed`` is ``[..., N, K/2]``, ``scale`` ``[..., N/bn, K/bk]`` with the same leading dims; the
    block sizes ``bn``, ``bk`` follow from the two shapes and must divide ``N`` and ``K`` exactly.
    """
    values = unpack_e2m1(packed)
    *lead, rows, cols = values.shape
    if scale.dim() != values.dim() or list(scale.shape[:-2]) != lead:
        raise ValueError(f"scale shape {list(scale.shape)} does not match packed weight {list(packed.shape)}")
    grid_rows, grid_cols = scale.shape[-2:]
    if grid_rows == 0 or grid_cols == 0 or rows % grid_rows or cols % grid_cols:
        raise ValueError(f"scale grid {[grid_rows, grid_cols]} does not divide the unpacked weight {[rows, cols]}")
    blocks = values.view(*lead, grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
    factors = scale_to_float(scale.to(values.device)).view(*lead, grid_rows, 1, grid_cols, 1)
    return (blocks * factors).to(dtype).view(*lead, rows, cols)


def scale_names(name: str) -> list[str]:
    """Where the scale of weight ``name`` may be stored, the release's naming first."""
    if name.endswith(".weight"):
        base = name.removesuffix(".weight")
        return [f"{base}.scale", f"{base}.weight_scale_inv"]
    return [f"{name}_scale_inv", f"{name}.scale"]


def find_scale(name: str, ckpt: Checkpoint) -> str:
    """The stored scale of ``name``; the release's name when there is none (the loader reports it missing)."""
    candidates = scale_names(name)
    return next((c for c in candidates if ckpt.has(c)), candidates[0])


def _weight_like(name: str) -> bool:
    # int8/uint8 tensors are FP4 only where a weight is expected; this keeps raw exponent-byte
    # scales and integer buffers (hash tables, masks) out of the format.
    return name.endswith((".weight", "_proj"))


def _check_grid(name: str, scale: str, ckpt: Checkpoint) -> None:
    """Compare the two header shapes, so a mismatched pair fails before any tensor is read."""
    info, scale_shape = ckpt.tensors[name], ckpt.tensors[scale].shape
    # The header of an F4 tensor gives the logical shape; int8/uint8 give bytes, two values each.
    *lead, rows, cols = info.shape if info.dtype == "F4" else (*info.shape[:-1], 2 * info.shape[-1])
    ok = len(scale_shape) == len(info.shape) and list(scale_shape[:-2]) == lead
    ok = ok and all(g > 0 and n % g == 0 for g, n in zip(scale_shape[-2:], (rows, cols), strict=True))
    if not ok:
        raise CheckpointError(
            f"{ckpt.path}: {scale} has shape {list(scale_shape)}, which does not tile the FP4 weight {name} "
            f"of {[*lead, rows, cols]} values"
        )


class FP4Format(WeightFormat):
    """Packed e2m1 weights plus one scale companion (see the module docstring).

    ``claims`` takes every ``F4`` tensor and every int8/uint8 weight (at least 2-D) and checks
    its scale's header shape. The registered instance names the release's ``.scale`` companion;
    :meth:`bind` returns one that knows which scale name the checkpoint actually uses.
    """

    name = "fp4"

    def __init__(self, ckpt: Checkpoint | None = None) -> None:
        self.ckpt = ckpt

    def claims(self, name: str, ckpt: Checkpoint) -> bool:
        info = ckpt.tensors.get(name)
        if info is None or info.dtype not in _PACKED_DTYPES or len(info.shape) < 2:
            return False
        if info.dtype != "F4" and not _weight_like(name):
            return False
        scale = find_scale(name, ckpt)
        if ckpt.has(scale):
            _check_grid(name, scale, ckpt)
        return True

    def bind(self, ckpt: Checkpoint) -> FP4Format:
        return FP4Format(ckpt)

    def companions(self, name: str) -> list[str]:
        return [find_scale(name, self.ckpt) if self.ckpt is not None else scale_names(name)[0]]

    def dequantize(self, stored: torch.Tensor, companions: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (scale,) = companions
        return dequantize_fp4(stored, scale, dtype)


register_format(FP4Format())
