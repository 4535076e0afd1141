"""DeepSeek's FP8 block format: a float8 ``*.weight`` plus one scale per tile.

The release checkpoints of DeepSeek-V3/R1/V3.1 store every large linear weight ``W`` (``[R, C]``)
as ``Q = fp8_e4m3(W / s)`` with one scale ``s`` per ``128 x 128`` tile, kept in
``weight_scale_inv`` of shape ``[ceil(R/128), ceil(C/128)]`` (the name says "inverse" because
dequantising multiplies by it). Edge tiles are partial: ``kv_a_proj_with_mqa`` has 576 rows,
so its last row of tiles covers 64. The tile size is ``quantization_config.weight_block_size``.
The DeepSeek-V4 release names the scales ``*.scale`` and stores them as ue8m0 (powers of two).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import WeightFormat, register_format
from moetier.weights.fp4 import scale_to_float

DEFAULT_BLOCK = (128, 128)
# Both float8 encodings dequantise the same way; DeepSeek ships e4m3.
_FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


def scale_name(weight_name: str, ckpt: Checkpoint | None = None) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (V3), or ``x.scale`` (V4 release) when only that is stored."""
    stem = weight_name.removesuffix(".weight")
    if ckpt is not None and not ckpt.has(stem + ".weight_scale_inv") and ckpt.has(stem + ".scale"):
        return stem + ".scale"
    return stem + ".weight_scale_inv"


def block_size_of(config: dict[str, Any]) -> tuple[int, int]:
    """The ``(rows, cols)`` tile of ``config.json``'s ``quantization_config``, 128 x 128 when unstated."""
    quant = config.get("quantization_config")
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if block is None:
        return DEFAULT_BLOCK
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` (``[..., R, C]``): ``[..., ceil(R/br), ceil(C/bc)]``."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight.float() * scale_inv`` with each scale covering one ``block`` tile, cast to ``dtype``.

    ``weight`` is ``[..., R, C]`` (leading dims, e.g. experts, allowed); ``scale_inv`` is
    ``[..., ceil(R/br), ceil(C/bc)]``. The product is formed in float32, as DeepSeek's kernel does.
    """
    if weight.dim() < 2 or tuple(scale_inv.shape) != scale_grid(tuple(weight.shape), block):
        raise ValueError(
            f"scales of shape {list(scale_inv.shape)} do not tile a weight of shape {list(weight.shape)} "
            f"in {block[0]}x{block[1]} blocks"
        )
    *lead, rows, cols = weight.shape
    grid_rows, grid_cols = scale_inv.shape[-2:]
    padded = F.pad(weight.float(), (0, grid_cols * block[1] - cols, 0, grid_rows * block[0] - rows))
    tiles = padded.view(*lead, grid_rows, block[0], grid_cols, block[1])
    dense = (tiles * scale_to_float(scale_inv)[..., :, None, :, None]).view(padded.shape)
    return dense[..., :rows, :cols].to(dtype).contiguous()


class Fp8BlockFormat(WeightFormat):
    """Claims a float8 ``*.weight`` stored next to its ``*.weight_scale_inv``.

    ``claims`` also checks the two header shapes against the checkpoint's block size, so a
    mismatched pair fails before any tensor is read. The registered instance uses the default
    tile; :meth:`bind` returns one with the checkpoint's own ``weight_block_size``.
    """

    name = "fp8-block"

    def __init__(self, block: tuple[int, int] = DEFAULT_BLOCK, ckpt: Checkpoint | None = None) -> None:
        self.block = block
        self._ckpt = ckpt  # set by bind(): lets companions() pick the scale name this checkpoint uses

    def claims(self, name: str, ckpt: Checkpoint) -> bool:
        info = ckpt.tensors.get(name)
        scales = scale_name(name, ckpt)
        if info is None or info.dtype not in _FP8_DTYPES or not name.endswith(".weight") or not ckpt.has(scales):
            return False
        if len(info.shape) < 2:
            raise CheckpointError(f"{ckpt.path}: {name} has block scales but shape {list(info.shape)} (not a matrix)")
        block = block_size_of(ckpt.config)
        got, expected = ckpt.tensors[scales].shape, scale_grid(info.shape, block)
        if got != expected:
            raise CheckpointError(
                f"{ckpt.path}: {scales} has shape {list(got)}, but {name} of shape {list(info.shape)} "
                f"in {block[0]}x{block[1]} blocks needs {list(expected)}"
            )
        return True

    def companions(self, name: str) -> list[str]:
        return [scale_name(name, self._ckpt)]

    def bind(self, ckpt: Checkpoint) -> Fp8BlockFormat:
        return Fp8BlockFormat(block_size_of(ckpt.config), ckpt)

    def dequantize(self, stored: torch.Tensor, companions: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(stored, companions[0], self.block, dtype)


register_format(Fp8BlockFormat())
