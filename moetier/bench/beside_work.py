"""Can a layer's backbone run on the device while a mapped call reads missed experts over PCIe?

A decode step today runs each layer's backbone (attention, hyper-connections, shared expert: ~170-225 us a
V4-Flash layer at 1-4 tokens, HBM-bound GEMMs and small kernels) and then its expert phase, which at a 5% cache is
bound by the host's DRAM serving the CPU tier and the mapped kernels' PCIe reads. Nothing overlaps the two, so the
step is about the resident step plus the misses at the DRAM rate (the decode bench's serial bound). Splitting a
batch of streams into two halves whose layers alternate (one half's backbone beside the other half's expert phase)
would hide the backbone, but only if the device can run the backbone's kernels while the mapped kernels wait on
PCIe: they hold SMs for the whole read.

This measures that directly (``bench gpu-experts --where host --beside N``): one host-read call on one stream, and
on a second stream ``N`` passes of a V4-Flash layer's six fp8 backbone linears at the call's tokens (the shapes of
:data:`moetier.bench.v4_kernels.FP8_LINEARS`, weights in HBM, more bytes than L2) replayed from one CUDA graph,
each alone and both at once, every call queued behind a sleep kernel so that the device, not the host's launches,
sets the times. (Launched eagerly, the linears measured the host instead: ~560 us a pass of six on the H100 host,
results/h100-20261207-1c973ca-beside-eager.)
``hidden_share`` is ``(call + beside - together) / min(call, beside)``: 1 when the shorter one hides entirely
under the longer, 0 when they run one after the other. The bench measures the second stream at the default priority
and at the device's highest (:func:`side_stream`): the block scheduler starts a higher-priority stream's programs
before the queued programs of a lower one, so a call's thousands of short programs need not keep the linears out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moetier.bench.common import stats
from moetier.bench.v4_kernels import FP8_LINEARS, random_fp8_weight
from moetier.kernels import fp8_linear

# Device cycles the sleep kernel holds a stream for per queued call: longer than the host takes to queue one.
_SLEEP_CYCLES = 2_000_000


def backbone_linears(tokens: int, passes: int, device: torch.device, seed: int = 0) -> Callable[[], None]:
    """``passes`` passes of the six fp8 linears a V4-Flash decode layer runs, at ``tokens`` rows: one weight of
    each shape in HBM (~136 MB together, more than an H100's or H200's L2), random activations. Eager: each linear
    costs the host more to launch (~90 us on the H100 host) than the device to run; :func:`graphed` makes it one
    launch, as a decode step's segments are."""
    g = torch.Generator().manual_seed(seed)
    linears = []
    for n, k, groups in FP8_LINEARS.values():
        values, scale = random_fp8_weight(n, k, device, g)
        x = torch.randn(tokens, groups * k, generator=g).to(torch.bfloat16).to(device)
        linears.append((x, values, scale, groups))

    def run() -> None:
        for _ in range(passes):
            for x, values, scale, groups in linears:
                fp8_linear.fp8_linear(x, values, scale, (128, 128), groups=groups)

    return run


def side_stream(high: bool = False) -> torch.cuda.Stream:
    """A second stream for the beside work: at the default priority, or (``high``) the device's highest. torch maps
    any priority below the device's range to its highest."""
    return torch.cuda.Stream(priority=-(1 << 10)) if high else torch.cuda.Stream()


def graphed(work: Callable[[], None], stream: torch.cuda.Stream) -> Callable[[], None]:
    """``work`` captured once in a CUDA graph on ``stream`` (after a warm-up run there, which compiles it); the
    returned callable replays it on the current stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        work()
    torch.cuda.synchronize()
    return graph.replay


def time_beside(
    call: Callable[[], None], beside: Callable[[], None], repeats: int, side: torch.cuda.Stream
) -> dict[str, Any]:
    """Device microseconds of ``call`` alone, ``beside`` alone (on ``side``) and both at once, ``repeats`` times
    each (a fresh sleep before every one), and the share of the shorter hidden under the longer."""
    alone_call = [_timed(call, None, side) for _ in range(repeats)]
    alone_beside = [_timed(None, beside, side) for _ in range(repeats)]
    together = [_timed(call, beside, side) for _ in range(repeats)]
    a, b, both = (stats(v)["median"] for v in (alone_call, alone_beside, together))
    return {
        "call_us": stats(alone_call),
        "beside_us": stats(alone_beside),
        "together_us": stats(together),
        "hidden_share": (a + b - both) / min(a, b),
    }


def _timed(call: Callable[[], None] | None, beside: Callable[[], None] | None, side: torch.cuda.Stream) -> float:
    """Microseconds from a common start to the later of the two ends: ``call`` on the current stream, ``beside``
    on ``side``, both queued behind a sleep on the current stream (``side`` waits for its end)."""
    main = torch.cuda.current_stream()
    start, main_end, side_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    start.record(main)
    side.wait_event(start)
    if call is not None:
        call()
    main_end.record(main)
    if beside is not None:
        with torch.cuda.stream(side):
            beside()
    side_end.record(side)
    torch.cuda.synchronize()
    return 1e3 * max(start.elapsed_time(main_end), start.elapsed_time(side_end))
