"""Sinkhorn projection of many tiny ``[n, n]`` matrices (DeepSeek-V4's mHC residual mixing) in one kernel.

Decode runs a handful of tokens per step, so its time is set by kernel launches: the eager
projection below is ~120 tiny ops per call (20 iterations of row and column normalising), and
V4 calls it twice per layer. The Triton kernel keeps each token's ``n x n`` matrix in registers
for all iterations: one launch. It is used on CUDA when Triton is importable and ``n`` is a power
of two (``MOETIER_TRITON=0`` turns it off); everywhere else the eager reference runs.
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


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then ``iters`` alternating column/row normalisations (column first), in float32."""
    m = torch.softmax(logits.float(), dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


if triton is not None:

    @triton.jit
    def _sinkhorn_kernel(x_ptr, out_ptr, eps, ITERS: tl.constexpr, N: tl.constexpr):
        rows = tl.arange(0, N)[:, None]
        cols = tl.arange(0, N)[None, :]
        offsets = tl.program_id(0) * N * N + rows * N + cols
        x = tl.load(x_ptr + offsets).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        m = e / tl.sum(e, axis=1)[:, None] + eps
        m = m / (tl.sum(m, axis=0)[None, :] + eps)
        for _ in range(ITERS - 1):
            m = m / (tl.sum(m, axis=1)[:, None] + eps)
            m = m / (tl.sum(m, axis=0)[None, :] + eps)
        tl.store(out_ptr + offsets, m)


def triton_usable(logits: torch.Tensor) -> bool:
    n = logits.shape[-1]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (
        triton is not None
        and os.environ.get("MOETIER_TRITON", "1") != "0"
        and (logits.is_cuda or interpreted)
        and logits.shape[-2] == n
        and n & (n - 1) == 0
    )


def sinkhorn_triton(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Triton kernel over ``logits`` ``[..., n, n]`` (any leading shape), float32 out."""
    n = logits.shape[-1]
    flat = logits.reshape(-1, n, n).float().contiguous()
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _sinkhorn_kernel[(flat.shape[0],)](flat, out, eps, ITERS=iters, N=n)
    return out.view(logits.shape)


_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on eagerly


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``[..., n, n]`` logits towards a doubly-stochastic matrix (float32)."""
    return kernel_or_reference(
        _BROKEN, "Sinkhorn kernel", triton_usable(logits),
        lambda: sinkhorn_triton(logits, iters, eps), lambda: sinkhorn_reference(logits, iters, eps),
    )  # fmt: skip
