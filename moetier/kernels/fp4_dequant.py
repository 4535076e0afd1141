"""An FP4 expert matrix dequantised on the device in one kernel: packed e2m1 bytes and their block scales to dense
weights, the bits of :func:`moetier.weights.fp4.dequantize_fp4`.

A prefill chunk's fat experts run as dense GEMMs, so each FP4 expert is first dequantised to the model's dtype.
The torch ops do that in ~10 kernels (int32 codes, a byte-table lookup, the scales' ``ldexp``, the float32
product, the cast, the three matrices' concatenation), each a pass over float32 temporaries: on an H100, a
16384-token prefill of the 3-layer fp4 bench model spent ~400 of its 643 ms of kernel time there (~0.3 ms an
expert, against ~50 ms of GEMMs; results/h100-20261206-dad1319-fp4-prefill-profile). Here one pass reads the
packed bytes and the scales and writes the dense matrix into the caller's buffer (a view of one block holding
gate, up and down: no concatenation): ~60 MB of traffic an expert, ~25 us at HBM speed.

The bits are the torch ops': a nibble's value and an e8m0 scale (``2 ** (e - 127)``) are built exactly from their
bit fields, their float32 product is IEEE's, and one round to nearest even makes the target dtype. Off CUDA (the
CPU tier, the tests' reference) and for shapes the kernel does not take, the torch ops run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable
from moetier.weights.fp4 import dequantize_fp4, scale_to_float

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_ROWS, BLOCK_BYTES = 16, 128  # a program: 16 rows x 128 packed bytes (256 values)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with the torch ops


if triton is not None:
    from moetier.kernels.expert_tiles import e2m1  # the grouped kernels' decoder: one set of bits

    @triton.jit
    def _dequant_tile(
        packed, scales, out, rows, row_bytes, scale_cols, tile_r, tile_c,
        ROWS_PER_SCALE: tl.constexpr, BYTES_PER_SCALE: tl.constexpr, EXPONENT_BYTES: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        """One ``BR`` rows x ``BC`` packed bytes tile of a matrix: its ``2 * BC`` values a row into ``out``."""
        r = tile_r * BR + tl.arange(0, BR)
        c = tile_c * BC + tl.arange(0, BC)
        keep = (r < rows)[:, None] & (c < row_bytes)[None, :]
        codes = tl.load(packed + r[:, None] * row_bytes + c[None, :], mask=keep, other=0).to(tl.int32) & 0xFF
        at = (r // ROWS_PER_SCALE)[:, None] * scale_cols + (c // BYTES_PER_SCALE)[None, :]
        if EXPONENT_BYTES:  # e8m0 bytes: 2 ** (e - 127); e = 0 is the subnormal 2 ** -127 (bits 0x00400000)
            e = tl.load(scales + at, mask=keep, other=127).to(tl.int32) & 0xFF
            factor = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        else:
            factor = tl.load(scales + at, mask=keep, other=1.0)
        low, high = e2m1(codes & 15) * factor, e2m1(codes >> 4) * factor  # element 2j is byte j's low nibble
        values = tl.reshape(tl.join(low, high), (BR, 2 * BC))
        oc = tile_c * (2 * BC) + tl.arange(0, 2 * BC)
        put = (r < rows)[:, None] & (oc < 2 * row_bytes)[None, :]
        tl.store(out + r[:, None] * (2 * row_bytes) + oc[None, :], values.to(out.dtype.element_ty), mask=put)

    @triton.jit
    def _dequant_kernel(
        packed, scales, out, rows, row_bytes, scale_cols,
        ROWS_PER_SCALE: tl.constexpr, BYTES_PER_SCALE: tl.constexpr, EXPONENT_BYTES: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        _dequant_tile(
            packed, scales, out, rows, row_bytes, scale_cols, tl.program_id(0), tl.program_id(1),
            ROWS_PER_SCALE, BYTES_PER_SCALE, EXPONENT_BYTES, BR, BC,
        )  # fmt: skip

    @triton.jit
    def _dequant_expert_kernel(
        gate, up, down, gate_scale, up_scale, down_scale, gate_out, up_out, down_out,
        inter, hidden, inter_scale_cols, hidden_scale_cols,
        ROWS_PER_SCALE: tl.constexpr, BYTES_PER_SCALE: tl.constexpr, EXPONENT_BYTES: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        """An expert's three matrices in one launch: gate's tiles, then up's, then down's, by program id. Gate and
        up are ``[inter, hidden / 2]`` bytes, down ``[hidden, inter / 2]``; one tile (the same constexprs) for all."""
        pid = tl.program_id(0)
        gate_cols = tl.cdiv(hidden // 2, BC)
        gate_tiles = tl.cdiv(inter, BR) * gate_cols
        if pid < 2 * gate_tiles:
            local = pid % gate_tiles
            if pid < gate_tiles:
                _dequant_tile(
                    gate, gate_scale, gate_out, inter, hidden // 2, inter_scale_cols, local // gate_cols,
                    local % gate_cols, ROWS_PER_SCALE, BYTES_PER_SCALE, EXPONENT_BYTES, BR, BC,
                )  # fmt: skip
            else:
                _dequant_tile(
                    up, up_scale, up_out, inter, hidden // 2, inter_scale_cols, local // gate_cols,
                    local % gate_cols, ROWS_PER_SCALE, BYTES_PER_SCALE, EXPONENT_BYTES, BR, BC,
                )  # fmt: skip
        else:
            local, down_cols = pid - 2 * gate_tiles, tl.cdiv(inter // 2, BC)
            _dequant_tile(
                down, down_scale, down_out, hidden, inter // 2, hidden_scale_cols, local // down_cols,
                local % down_cols, ROWS_PER_SCALE, BYTES_PER_SCALE, EXPONENT_BYTES, BR, BC,
            )  # fmt: skip


def _fits(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernel takes these: 2-D, contiguous, on one device, a scale grid whose blocks hold whole bytes."""
    if packed.dim() != 2 or scale.dim() != 2 or out.dtype not in _DTYPES or packed.element_size() != 1:
        return False
    if scale.dtype != torch.uint8 and not scale.is_floating_point():
        return False  # the torch ops raise on it: a bad input must not mark the kernel broken for every later call
    rows, row_bytes = packed.shape
    grid_rows, grid_cols = scale.shape
    if list(out.shape) != [rows, 2 * row_bytes] or not (grid_rows and grid_cols):
        return False
    if rows % grid_rows or (2 * row_bytes) % grid_cols or ((2 * row_bytes) // grid_cols) % 2:
        return False  # a block that splits a byte's two values: the torch ops
    same_device = out.device == packed.device == scale.device
    return same_device and out.is_contiguous() and packed.is_contiguous() and scale.is_contiguous()


def _kernel_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as the kernel reads them: e8m0 bytes or float32 as stored, other float scales (e8m0fnu, bf16) by
    value in float32, as the torch ops read them."""
    if scale.dtype in (torch.uint8, torch.float32):
        return scale
    return scale_to_float(scale).contiguous()


def _dequantize_triton(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, row_bytes = packed.shape
    grid_rows, grid_cols = scale.shape
    exponent_bytes = scale.dtype == torch.uint8
    scale = _kernel_scale(scale)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(row_bytes, BLOCK_BYTES))
    _dequant_kernel[grid](
        packed.view(torch.uint8), scale, out, rows, row_bytes, grid_cols,
        ROWS_PER_SCALE=rows // grid_rows, BYTES_PER_SCALE=row_bytes // grid_cols, EXPONENT_BYTES=exponent_bytes,
        BR=BLOCK_ROWS, BC=BLOCK_BYTES, num_warps=4,
    )  # fmt: skip
    return out


def dequantize_fp4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out`` (``[N, K]``, its dtype the target's) := ``dequantize_fp4(packed, scale, out.dtype)`` for ``packed``
    ``[N, K/2]`` bytes and ``scale`` ``[N/bn, K/bk]``; in one kernel where Triton runs on their device and the
    shapes fit, else the torch ops (which also raise the shape errors). Returns ``out``."""
    return kernel_or_reference(
        _BROKEN, "FP4 dequantisation kernel", triton_usable(packed) and _fits(out, packed, scale),
        lambda: _dequantize_triton(out, packed, scale), lambda: out.copy_(dequantize_fp4(packed, scale, out.dtype)),
    )  # fmt: skip


def _expert_fits(outs: Sequence[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether one launch takes the expert: each matrix fits the kernel, gate and up alike, down their transpose's
    shape, one scale block (rows and bytes a scale) and one scale dtype for all three."""
    if not all(_fits(out, q, s) for out, (q, s) in zip(outs, pairs, strict=True)):
        return False
    (gate, gate_s), (up, up_s), (down, down_s) = pairs
    inter, hidden = gate.shape[0], 2 * gate.shape[1]
    if up.shape != gate.shape or up_s.shape != gate_s.shape or list(down.shape) != [hidden, inter // 2]:
        return False
    blocks = {(q.shape[0] // s.shape[0], q.shape[1] // s.shape[1]) for q, s in pairs}
    return len(blocks) == 1 and gate_s.dtype == up_s.dtype == down_s.dtype


def _dequantize_expert_triton(
    outs: Sequence[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Sequence[torch.Tensor]:
    (gate, gate_s), (up, up_s), (down, down_s) = pairs
    inter, hidden = gate.shape[0], 2 * gate.shape[1]
    exponent_bytes = gate_s.dtype == torch.uint8
    gate_s, up_s, down_s = (_kernel_scale(s) for s in (gate_s, up_s, down_s))
    gate_tiles = triton.cdiv(inter, BLOCK_ROWS) * triton.cdiv(hidden // 2, BLOCK_BYTES)
    down_tiles = triton.cdiv(hidden, BLOCK_ROWS) * triton.cdiv(inter // 2, BLOCK_BYTES)
    _dequant_expert_kernel[(2 * gate_tiles + down_tiles,)](
        gate.view(torch.uint8), up.view(torch.uint8), down.view(torch.uint8), gate_s, up_s, down_s, *outs,
        inter, hidden, gate_s.shape[1], down_s.shape[1],
        ROWS_PER_SCALE=inter // gate_s.shape[0], BYTES_PER_SCALE=(hidden // 2) // gate_s.shape[1],
        EXPONENT_BYTES=exponent_bytes, BR=BLOCK_ROWS, BC=BLOCK_BYTES, num_warps=4,
    )  # fmt: skip
    return outs


def dequantize_fp4_expert_into(
    outs: Sequence[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Sequence[torch.Tensor]:
    """:func:`dequantize_fp4_into` of an expert's gate, up and down (``outs`` and ``(packed, scale)`` ``pairs`` in
    that order) in one launch where the kernel takes all three (:func:`_expert_fits`), else a call a matrix.

    The same tiles and arithmetic as the one-matrix kernel, so the same bits; one launch instead of three saves
    the host two kernel launches an expert (a prefill's host-bound per-expert path runs one per fat expert).
    """
    usable = triton_usable(pairs[0][0]) and _expert_fits(outs, pairs)
    return kernel_or_reference(
        _BROKEN, "FP4 dequantisation kernel", usable, lambda: _dequantize_expert_triton(outs, pairs),
        lambda: [dequantize_fp4_into(out, q, s) for out, (q, s) in zip(outs, pairs, strict=True)],
    )  # fmt: skip
