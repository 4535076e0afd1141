"""An fp8-block expert matrix dequantised on the device in one kernel: float8 values times their tile's float32
scale, rounded once to the target dtype, the bits of :func:`moetier.weights.fp8.dequantize_blocks`.

The fp8 counterpart of :mod:`moetier.kernels.fp4_dequant` (DeepSeek-V3/R1's release: e4m3 values, one scale per
128 x 128 tile): a prefill chunk's fat experts run as dense GEMMs, and the torch ops' dequantisation (the float32
widening, the padding to whole tiles, the product, the slice, the cast, the three matrices' concatenation) is
several passes over float32 temporaries an expert. Here one pass writes each matrix into its part of one dense
block. A float8 value is widened from its bit fields (exact: every e4m3/e5m2 value is a float32), the product is
IEEE float32, the cast rounds to nearest even. Off CUDA and for shapes it does not take, the torch ops run.
"""

from __future__ import annotations

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable
from moetier.weights.fp4 import scale_to_float
from moetier.weights.fp8 import dequantize_blocks, scale_grid

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_ROWS, BLOCK_COLS = 16, 256  # a program's tile of the matrix
_VALUES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with the torch ops


if triton is not None:

    @triton.jit
    def widened_fp8(codes, E5M2: tl.constexpr):
        """int32 float8 bytes -> their float32 values, exactly (e4m3fn: bias 7, no infinities, S.1111.111 NaN;
        e5m2: bias 15, IEEE's infinities and NaNs); subnormals are the mantissa times the smallest step."""
        if E5M2:
            exponent, mantissa = (codes >> 2) & 31, codes & 3
            normal = ((exponent + 112) << 23) | (mantissa << 21)
            small = (mantissa.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # 2 ** -16
            special = tl.where(mantissa == 0, 0x7F800000, 0x7FC00000)
            bits = tl.where(exponent == 31, special, tl.where(exponent == 0, small, normal))
        else:
            exponent, mantissa = (codes >> 3) & 15, codes & 7
            normal = ((exponent + 120) << 23) | (mantissa << 20)
            small = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # 2 ** -9
            bits = tl.where(exponent == 0, small, normal)
            bits = tl.where((exponent == 15) & (mantissa == 7), 0x7FC00000, bits)
        return (bits | ((codes >> 7) << 31)).to(tl.float32, bitcast=True)  # the sign as a bit: -0.0 stays

    @triton.jit
    def _dequant_kernel(
        values, scales, out, rows, cols, scale_cols,
        TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr, E5M2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        keep = (r < rows)[:, None] & (c < cols)[None, :]
        codes = tl.load(values + r[:, None] * cols + c[None, :], mask=keep, other=0).to(tl.int32) & 0xFF
        at = (r // TILE_ROWS)[:, None] * scale_cols + (c // TILE_COLS)[None, :]
        factor = tl.load(scales + at, mask=keep, other=1.0)
        dense = widened_fp8(codes, E5M2) * factor
        tl.store(out + r[:, None] * cols + c[None, :], dense.to(out.dtype.element_ty), mask=keep)


def _fits(out: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> bool:
    """Whether the kernel takes these: 2-D e4m3/e5m2 values, contiguous, on one device, the tile's scale grid."""
    if values.dim() != 2 or values.dtype not in _VALUES or out.dtype not in _DTYPES or out.shape != values.shape:
        return False
    if tuple(scale.shape) != scale_grid(tuple(values.shape), tile) or not scale.is_floating_point():
        return False  # the torch ops raise the error: a bad input must not mark the kernel broken for later calls
    same_device = out.device == values.device == scale.device
    return same_device and out.is_contiguous() and values.is_contiguous() and scale.is_contiguous()


def _dequantize_triton(out: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]):
    rows, cols = values.shape
    if scale.dtype != torch.float32:
        scale = scale_to_float(scale).contiguous()
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _dequant_kernel[grid](
        values.view(torch.uint8), scale, out, rows, cols, scale.shape[1], TILE_ROWS=tile[0], TILE_COLS=tile[1],
        E5M2=values.dtype == torch.float8_e5m2, BR=BLOCK_ROWS, BC=BLOCK_COLS, num_warps=4,
    )  # fmt: skip
    return out


def dequantize_fp8_into(
    out: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """``out`` := ``dequantize_blocks(values, scale, tile, out.dtype)``: in one kernel where Triton runs on their
    device and the shapes fit, else the torch ops (which also raise the shape errors). Returns ``out``."""
    return kernel_or_reference(
        _BROKEN, "fp8 dequantisation kernel", triton_usable(values) and _fits(out, values, scale, tile),
        lambda: _dequantize_triton(out, values, scale, tile),
        lambda: out.copy_(dequantize_blocks(values, scale, tile, out.dtype)),
    )  # fmt: skip
