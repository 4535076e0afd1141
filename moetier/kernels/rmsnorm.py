"""RMS normalisation of the last dim in one kernel (DeepSeek-V4's norms, weighted or not).

Eager, a norm is 5-8 tiny ops (cast, square, mean, add, rsqrt, multiply, casts); decode of a few tokens
is bound by their launches, and V4 runs ~7 norms per layer. The Triton kernel normalises one row per
program in float32, rounding where the eager reference rounds, so both paths give the same values up
to the order of the sum of squares. It is used on CUDA when Triton is importable (``MOETIER_TRITON=0``
turns it off); everywhere else, or after the kernel once failed, the eager reference runs.
"""

from __future__ import annotations

import os

import torch

from moetier.kernels.guard import kernel_or_reference

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Normalise ``x`` over its last dim with float32 statistics; the result is in ``out_dtype`` (default ``x``'s).

    Weighted: ``weight * round(x * rsqrt(mean(x^2) + eps))``, rounded to ``x``'s dtype before the weight.
    Unweighted: ``x * round(rsqrt(mean(x^2) + eps))``, the product taken in the output dtype. (The roundings
    are those of the reference implementations, so an fp32 weight over bf16 activations matches them.)
    """
    if weight is None:
        x = x if out_dtype is None else x.to(out_dtype)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out.to(out_dtype or x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        inner,
        stride_outer,
        stride_inner,
        dim,
        eps,
        HAS_WEIGHT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < dim
        base = (row // inner) * stride_outer + (row % inner) * stride_inner
        x_in = tl.load(x_ptr + base + cols, mask=keep, other=0.0)
        x = x_in.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
        if HAS_WEIGHT:
            normed = (x * scale).to(x_in.dtype).to(tl.float32)
            out = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32) * normed
        else:
            # The product in the output dtype, as the reference computes it.
            out = x * scale.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * dim + cols, out, mask=keep)


def triton_usable(x: torch.Tensor) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and os.environ.get("MOETIER_TRITON", "1") != "0" and (x.is_cuda or interpreted)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The Triton kernel: ``x`` ``[..., D]`` with a unit stride on ``D`` (other dims may be strided: views of
    a fused GEMM's output are read in place); returns a fresh contiguous tensor."""
    dim = x.shape[-1]
    if x.dim() == 1:
        x = x[None]
    if x.dim() > 3 or x.stride(-1) != 1:
        x = x.reshape(-1, dim) if x.stride(-1) == 1 else x.contiguous().view(-1, dim)
    outer, inner = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    stride_outer, stride_inner = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if out.numel():
        _rms_norm_kernel[(outer * inner,)](
            x,
            x if weight is None else weight,
            out,
            inner,
            stride_outer,
            stride_inner,
            dim,
            eps,
            HAS_WEIGHT=weight is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out


_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on eagerly


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` (see :func:`rms_norm_reference`), in one kernel where possible."""
    return kernel_or_reference(
        _BROKEN, "RMSNorm kernel", triton_usable(x),
        lambda: rms_norm_triton(x, weight, eps, out_dtype).view(x.shape),
        lambda: rms_norm_reference(x, weight, eps, out_dtype),
    )  # fmt: skip
