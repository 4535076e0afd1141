"""DeepSeek-V4's rotation of interleaved channel pairs in one kernel (:func:`moetier.models.deepseek_v4_rope.rotate_`),
and a step's rotation angles in another (:func:`angles`).

In torch the rotation is four kernels (the pair swap, ``x * cos``, ``addcmul`` and the copy back into ``x``), and a
decode step rotates ~6 times a layer: on the H200 those were ~24 of a layer's ~110 kernels, 5-13 us a rotation
of a 1-token step (results/h200-20261204-e3ff99d-row-cuts/2d299e4-steady-traces). Here one program rotates a few
rows in place with the same arithmetic: ``fl32(x * cos)`` then one fused multiply-add of the swapped pair by
``sin`` (as torch's CUDA ``addcmul`` computes ``a + b * c``), rounded once into ``x``'s dtype; on CUDA the bits
are torch's (tested). Off CUDA :func:`rotate_reference` (the torch ops) runs; Triton's interpreter runs the kernel
in the CPU tests, with its own bf16 truncation and unfused multiply-add.

A decode step's angles (``cos(p * f) * factor`` and ``sin``, rounded to the model's dtype, laid out for the
rotation) were ~14 kernels a rope kind at the step's start (~30 us of the H200's 1-token step); :func:`angles` is
one, with CUDA's own ``cosf``/``sinf`` (libdevice), so the bits are torch's there too (tested).
"""

from __future__ import annotations

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# Rows (token x head) per program: a decode step's query has 64 heads of one token, a prefill chunk thousands.
ROWS_PER_PROGRAM = 16

# Set once when a kernel fails, so serving carries on with the torch ops: the rotation's, the angles'.
_BROKEN: list[str] = []
_ANGLES_BROKEN: list[str] = []


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``cos.shape[-1]`` channels of ``x`` (``[N, D]`` or ``[N, heads, D]``) in place by
    ``cos``/``sin`` (``[N, R]``, float32): ``x * cos + pair_swap(x) * sin`` in float32, rounded into ``x``."""
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rope = x[..., -cos.shape[-1] :]
    swapped = rope.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    rope.copy_(torch.addcmul(rope * cos, swapped, sin))
    return x


if triton is not None:

    @triton.jit
    def _rotate_kernel(
        x, cos, sin, rows, heads, stride_xn, stride_xh, offset, stride_cn, stride_sn,
        R: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # token * heads + head
        j = tl.arange(0, R)[None, :]
        keep = row < rows
        n, h = row // heads, row % heads
        at = x + n * stride_xn + h * stride_xh + offset
        value = tl.load(at + j, mask=keep).to(tl.float32)
        pair = tl.load(at + (j ^ 1), mask=keep).to(tl.float32)  # the other channel of the pair
        c = tl.load(cos + n * stride_cn + j, mask=keep)
        s = tl.load(sin + n * stride_sn + j, mask=keep)
        tl.store(at + j, tl.fma(pair, s, value * c).to(x.dtype.element_ty), mask=keep)

    @triton.jit
    def _angles_kernel(
        positions, inv_freq, factor, cos, sin, sin_inverse, n,
        R: tl.constexpr, ROUND: tl.constexpr, ROWS: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        j = tl.arange(0, R)[None, :]
        keep = row < n
        at = row * R + j
        freq = tl.load(positions + row, mask=keep).to(tl.float32) * tl.load(inv_freq + j // 2)
        if LIBDEVICE:  # CUDA's cosf/sinf, as torch's; Triton's interpreter has no libdevice (numpy's instead)
            c, s = libdevice.cos(freq) * factor, libdevice.sin(freq) * factor
        else:
            c, s = tl.cos(freq) * factor, tl.sin(freq) * factor
        if ROUND == 1:  # to the model's dtype and back, as the reference's .to(dtype).float()
            c, s = c.to(tl.bfloat16).to(tl.float32), s.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            c, s = c.to(tl.float16).to(tl.float32), s.to(tl.float16).to(tl.float32)
        signed = tl.where(j % 2 == 1, s, -s)
        tl.store(cos + at, c, mask=keep)
        tl.store(sin + at, signed, mask=keep)
        tl.store(sin_inverse + at, -signed, mask=keep)


_ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def angles_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE's ``cos``, ``sin`` and ``sin_inverse`` (``[N, 2 * len(inv_freq)]``, float32) at ``positions``, laid out
    for :func:`rotate_reference`: ``cos`` ``[c0, c0, c1, c1, ...]``, ``sin`` ``[-s0, s0, -s1, s1, ...]``, each
    ``cos(p * f) * factor`` rounded to ``dtype`` (the model's) as the reference does, ``sin_inverse = -sin``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos = (freqs.cos() * factor).to(dtype).float()
    sin = (freqs.sin() * factor).to(dtype).float()
    signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos.repeat_interleave(2, dim=-1), signed, -signed


def angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`angles_reference`, in one kernel where Triton runs on ``positions``' device (~14 torch kernels)."""
    width = 2 * inv_freq.shape[0]
    fits = (
        inv_freq.dtype == torch.float32 and inv_freq.device == positions.device and inv_freq.is_contiguous()
        and positions.dim() == 1 and positions.is_contiguous() and width & (width - 1) == 0 and dtype in _ROUNDINGS
    )  # fmt: skip
    return kernel_or_reference(
        _ANGLES_BROKEN, "RoPE angles kernel", fits and triton_usable(positions),
        lambda: angles_triton(positions, inv_freq, factor, dtype),
        lambda: angles_reference(positions, inv_freq, factor, dtype),
    )  # fmt: skip


def angles_triton(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The angles kernel (the caller checked its inputs fit, see :func:`angles`)."""
    width, n = 2 * inv_freq.shape[0], positions.shape[0]
    out = torch.empty((3, n, width), dtype=torch.float32, device=positions.device)
    if n:
        # Masked rows still compute their cos and sin: a decode step of one position per program, not sixteen.
        rows = min(ROWS_PER_PROGRAM, triton.next_power_of_2(n))
        _angles_kernel[(triton.cdiv(n, rows),)](
            positions, inv_freq, factor, out[0], out[1], out[2], n,
            R=width, ROUND=_ROUNDINGS[dtype], ROWS=rows, LIBDEVICE=positions.is_cuda, num_warps=1,
        )  # fmt: skip
    return out[0], out[1], out[2]


def _kernel_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    width = cos.shape[-1]
    return (
        x.dim() in (2, 3)
        and x.stride(-1) == 1
        and width >= 2
        and width & (width - 1) == 0  # a power of two: one block of channels
        and width <= x.shape[-1]
        and cos.dtype == sin.dtype == torch.float32
        and cos.stride(-1) == sin.stride(-1) == 1
        and cos.shape[0] == sin.shape[0] == x.shape[0]
        and cos.device == x.device == sin.device
    )


def rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel over ``x`` (see :func:`rotate_reference`; the caller checked :func:`_kernel_fits`)."""
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows == 0:
        return x
    stride_h = x.stride(1) if x.dim() == 3 else 0
    width = cos.shape[-1]
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    _rotate_kernel[grid](
        x, cos, sin, rows, heads, x.stride(0), stride_h, x.shape[-1] - width, cos.stride(0), sin.stride(0),
        R=width, ROWS=ROWS_PER_PROGRAM, num_warps=1,
    )  # fmt: skip
    return x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_reference`, in one kernel where Triton runs on ``x``'s device."""
    return kernel_or_reference(
        _BROKEN,
        "rotation kernel",
        triton_usable(x) and _kernel_fits(x, cos, sin),
        lambda: rotate_triton(x, cos, sin),
        lambda: rotate_reference(x, cos, sin),
    )
