"""The fed CPU tier's sums added into a call's accumulator straight from pinned host memory: one kernel, no copy.

The fed CPU share (:mod:`moetier.tiers.mapped_cpu`) leaves its float32 sums in a pinned buffer; the stream waits for
the worker's done word, then adds them. As a copy to the device and an add, that is a copy-engine node between two
kernels: in the H100 trace of b9694d6 (1 stream) the copy took 2.5 us and the device sat idle ~8 us before it and
~6 us after it, every MoE layer. One kernel that reads the buffer over PCIe (16 KB a token at V4-Flash's width) and
adds it in place takes a few microseconds.

The buffer is rewritten by the CPU for every layer of every step, at the same address, so the loads skip the caches
(``.cv``: fetched again from memory, never served from a line an earlier layer's add brought in). The kernel is
launched after the stream waited for the done word, which the worker stores after its sums.
"""

from __future__ import annotations

import logging
import os

import torch

from moetier.errors import ConfigError
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs add with torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

log = logging.getLogger(__name__)

_BLOCK = 1024
SUMS_MODES = ("kernel", "copy")


def fed_sums_mode() -> str:
    """``MOETIER_FED_SUMS``: how the device adds the CPU's sums, ``kernel`` (:func:`add_host_sums`, the default where
    :func:`host_sums_usable`) or ``copy`` (copied to the device, then added: the way before, kept for A/B runs)."""
    mode = os.environ.get("MOETIER_FED_SUMS", "kernel").strip().lower()
    if mode not in SUMS_MODES:
        raise ConfigError(f"MOETIER_FED_SUMS={mode!r}: use one of {', '.join(SUMS_MODES)}")
    return mode


if triton is not None:

    @triton.jit
    def _add_host_kernel(out_ptr, offset, numel, BLOCK: tl.constexpr):
        # out_ptr is the accumulator (float32, on the device); the sums lie ``offset`` bytes from it, in pinned host
        # memory the device addresses directly.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < numel
        sums = (out_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + offset).to(
            tl.pointer_type(tl.float32), bitcast=True
        )
        add = tl.load(sums + i, mask=ok, other=0.0, cache_modifier=".cv")
        tl.store(out_ptr + i, tl.load(out_ptr + i, mask=ok) + add, mask=ok)


def host_sums_usable(out: torch.Tensor, sums: torch.Tensor) -> bool:
    """Whether :func:`add_host_sums` can add ``sums`` into ``out``: Triton usable for ``out``
    (:func:`~moetier.kernels.rmsnorm.triton_usable`), both float32, contiguous, of one shape, ``sums`` in pinned
    host memory where ``out`` is on CUDA."""
    if not triton_usable(out):  # Triton on CUDA or its interpreter, not switched off (MOETIER_TRITON=0)
        return False
    alike = out.dtype == sums.dtype == torch.float32 and out.shape == sums.shape
    return alike and out.is_contiguous() and sums.is_contiguous() and (not out.is_cuda or sums.is_pinned())


def add_host_sums(out: torch.Tensor, sums: torch.Tensor) -> None:
    """``out += sums`` on ``out``'s current stream, reading ``sums`` where it lies (see :func:`host_sums_usable`)."""
    numel = out.numel()
    if numel == 0:
        return
    offset = sums.data_ptr() - out.data_ptr()
    _add_host_kernel[(triton.cdiv(numel, _BLOCK),)](out, offset, numel, BLOCK=_BLOCK)


def host_sums_ready(device: torch.device) -> bool:
    """Whether the kernel adds pinned sums correctly on ``device`` (CUDA): a first add, which also compiles it (so
    that no CUDA graph capture ever does), checked against torch; False (logged) otherwise."""
    if device.type != "cuda" or triton is None:
        return False
    try:
        sums = torch.arange(6, dtype=torch.float32).reshape(2, 3).pin_memory()
        out = torch.ones(2, 3, device=device)
        if not host_sums_usable(out, sums):
            return False
        add_host_sums(out, sums)
        good = torch.equal(out.cpu(), sums + 1)
    except Exception as error:  # noqa: BLE001 - any failure means the copy and add, never a failed start-up
        log.warning("the CPU tier's sums are copied and added (the host-sums kernel failed: %s)", error)
        return False
    if not good:
        log.warning("the CPU tier's sums are copied and added (the host-sums kernel's probe added wrongly)")
    return good
