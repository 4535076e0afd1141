"""The device's own clock, stamped from inside a stream (and so from inside a replayed CUDA graph).

CUDA events cannot time a call inside a graph the host replays ahead of the device: an event recorded in a graph
is recorded again by every replay, and the host cannot tell which replay a reading belongs to. A stamp is a
one-program kernel that stores the GPU's ``%globaltimer`` (nanoseconds, one clock for every SM) into a slot of a
device tensor when the stream reaches it; the host copies the slots back after the step (in stream order, so a
later replay cannot overwrite them first) and reads them once that copy's event has passed. A stamp costs the
stream one tiny kernel (~2-3 us in a graph). CUDA only: Triton's interpreter cannot run the timer's inline PTX.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs have no device clock.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


if triton is not None:

    @triton.jit
    def _stamp_kernel(stamps, slot):
        tl.store(stamps + slot, globaltimer())


def launch_stamp(stamps: torch.Tensor, slot: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue on ``stream`` (default: the current one) the store of the device clock (ns) into ``stamps[slot]``
    (a contiguous int64 CUDA tensor)."""
    if stream is None:
        _stamp_kernel[(1,)](stamps, slot, num_warps=1)
        return
    with torch.cuda.stream(stream):
        _stamp_kernel[(1,)](stamps, slot, num_warps=1)


def stamps_usable(device: torch.device) -> bool:
    """Whether stamps work on ``device``: a CUDA device with Triton, where a first stamp (which compiles the kernel,
    so that no capture ever compiles it) stored a clock reading; False (logged) otherwise."""
    if device.type != "cuda" or triton is None:
        return False
    try:
        probe = torch.zeros(2, dtype=torch.int64, device=device)
        launch_stamp(probe, 0)
        launch_stamp(probe, 1)
        first, second = probe.tolist()
    except Exception as error:  # noqa: BLE001 - any failure means no device clock, never a failed start-up
        log.warning("no device clock stamps (%s): the fed CPU tier times eager steps instead", error)
        return False
    return 0 < first <= second
