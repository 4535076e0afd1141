"""The clamped SwiGLU of a dense MLP or shared expert in one kernel: ``silu(min(gate, L)) * clamp(up, -L, L)``.

In torch that is four kernels (two clamps, the SiLU, the product), each a pass over the activations; a V4 decode
layer's shared expert spent ~4.5 us of launches on them for a 2048-wide row (H200 trace,
results/h200-20261204-eb488f1-stamps-rope-exact/ad9776c-angles), and a prefill chunk reads and writes the
activations four times. Here one pass with torch's roundings: the clamps are exact, the SiLU is computed in float32
(``x / (1 + exp(-x))``, CUDA's ``expf``) and rounded to the activations' dtype, and the product of the rounded SiLU
and ``up`` is rounded once, so on CUDA the bits are torch's (tested). Off CUDA the torch ops run
(:func:`swiglu_reference`); Triton's interpreter runs the kernel in the CPU tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK = 1024  # columns a program

_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with the torch ops


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up`` with V4's clamps (``gate <= limit``, ``|up| <= limit``) when ``limit`` is set."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _swiglu_kernel(
        gate, up, out, cols, stride_gate, stride_up, limit,
        CLAMP: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = j < cols
        g = tl.load(gate + row * stride_gate + j, mask=keep, other=0.0)
        u = tl.load(up + row * stride_up + j, mask=keep, other=0.0)
        if CLAMP:  # compared in float32 and rounded back, as torch's clamp by a Python number
            g = tl.minimum(g.to(tl.float32), limit).to(g.dtype)
            u = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit).to(u.dtype)
        x = g.to(tl.float32)
        e = libdevice.exp(-x) if LIBDEVICE else tl.exp(-x)
        silu = tl.div_rn(x, 1.0 + e).to(g.dtype)  # rounded as torch's SiLU output
        product = (silu.to(tl.float32) * u.to(tl.float32)).to(out.dtype.element_ty)
        tl.store(out + row * cols + j, product, mask=keep)


def _fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (
        gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
        and gate.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and gate.stride(-1) == 1 and up.stride(-1) == 1 and gate.device == up.device
    )  # fmt: skip


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The kernel (the caller checked :func:`_fits`): a fresh contiguous ``[T, I]``."""
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if rows and cols:
        _swiglu_kernel[(rows, triton.cdiv(cols, BLOCK))](
            gate, up, out, cols, gate.stride(0), up.stride(0), 0.0 if limit is None else float(limit),
            CLAMP=limit is not None, BLOCK=BLOCK, LIBDEVICE=gate.is_cuda, num_warps=4,
        )  # fmt: skip
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """:func:`swiglu_reference` of ``gate`` and ``up`` (``[T, I]``, unit stride on ``I``: e.g. the two halves of a
    fused projection's output), in one kernel where Triton runs on their device."""
    return kernel_or_reference(
        _BROKEN, "SwiGLU kernel", triton_usable(gate) and _fits(gate, up),
        lambda: swiglu_triton(gate, up, limit), lambda: swiglu_reference(gate, up, limit),
    )  # fmt: skip
