"""The CPU expert tier: cold (token, expert) pairs computed on host cores straight from the home copy.

A missed expert costs its bytes at DRAM bandwidth here instead of PCIe bandwidth, and nothing waits
for a copy. One worker thread runs the jobs with its own torch intra-op thread count (torch's
OpenMP thread count is per calling thread), so the dispatching thread keeps its cores for
launching device work. Each job returns an fp32 partial sum over the rows it touched.

bf16 jobs run the C kernel of :mod:`moetier.kernels.cpu_experts` when it is available (one OpenMP
region for the whole job, every weight row read once for all of its expert's tokens), and so do
float8 e4m3fn experts (``expert_format="fp8"``) and packed fp4 e2m1 experts (``expert_format="fp4"``,
DeepSeek-V4's release), dequantised row by row inside the kernel exactly as :func:`swiglu_expert`
dequantises them; other dtypes (e5m2 included), and hosts where it cannot be built, run torch.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.profiling import phase
from moetier.tiers.experts import ExpertWeights, swiglu_expert

TORCH_KERNEL = "torch"


def default_cpu_threads() -> int:
    """All usable cores but two (left to the dispatching thread and the rest of the process)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 2)


@dataclass
class CpuGroup:
    """One expert's share of a job: ``rows`` index ``CpuJob.hidden``; ``gates`` are the routing weights."""

    weights: ExpertWeights
    rows: torch.Tensor  # int64 [n]
    gates: torch.Tensor  # [n], any float dtype


@dataclass
class CpuJob:
    """Work for the CPU tier over ``hidden`` (``[U, H]`` host rows, the tokens the groups touch).

    ``ready`` (a CUDA event) is waited on before reading ``hidden``/gates, which may still be landing
    from the device. ``out`` is the fp32 ``[U, H]`` result buffer (pinned on CUDA so it can go back
    with a non-blocking copy); it is allocated when not given. ``on_done`` runs after the job,
    whether it succeeded or failed (it releases a GPU stream waiting for ``out``).
    """

    hidden: torch.Tensor
    groups: list[CpuGroup]
    ready: Any = None
    out: torch.Tensor | None = None
    on_done: Callable[[], None] | None = None


@dataclass
class CpuResult:
    out: torch.Tensor  # fp32 [U, H]: sum over groups of gate * expert(hidden[rows]) placed at rows
    seconds: float  # wall time the worker spent on the job
    # of which it waited for its inputs to land from the device (a latency of the call, not of its experts)
    wait_seconds: float = 0.0
    pairs: int = field(default=0)
    # which path ran: "torch", or "c-" + the C kernel's ISA (e.g. "c-avx512_bf16"), then "-fp8" or "-fp4"
    # for quantised experts
    kernel: str = TORCH_KERNEL


class CpuExpertTier:
    """Runs :class:`CpuJob` s on a worker thread with ``threads`` threads (torch's, or the C kernel's).

    Math contract: each group is :func:`swiglu_expert` on the home copy, scaled by its gates and
    accumulated in fp32. The torch path runs it in the weights' dtype (the same kernel the device runs).
    The C kernel (bf16 weights and hidden, ``use_kernel`` and the kernel available) accumulates every
    dot product in fp32 and rounds where a bf16 GEMM does: gate and up to bf16, the activation
    ``silu(gate) * up`` (after the optional clamp, by the limit rounded to bf16 as torch's clamp of bf16
    values gives) computed in fp32 and rounded once to bf16 (torch rounds ``silu(gate)`` and the
    product separately), the expert's output to bf16 before the gate. float8 e4m3fn and packed fp4
    (e2m1) experts compute exactly that on their weights dequantised to bf16 (as :func:`swiglu_expert`
    dequantises them): bit for bit the C kernel's result on the dequantised experts. Its results do not
    depend on ``threads``.
    ``last_kernel`` names the path of the latest job (also :attr:`CpuResult.kernel`).
    """

    def __init__(self, swiglu_limit: float | None, threads: int | None = None, use_kernel: bool = True) -> None:
        self.threads = default_cpu_threads() if threads is None else threads
        if self.threads < 1:
            raise ConfigError(f"cpu tier threads must be >= 1, got {self.threads}")
        self.swiglu_limit = swiglu_limit
        # Build (or load) the kernel now rather than inside the first decode step.
        self.use_kernel = use_kernel and cpu_experts.available()
        self.last_kernel: str | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="moetier-cpu-tier",
            initializer=torch.set_num_threads,
            initargs=(self.threads,),
        )
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)

    def submit(self, job: CpuJob) -> Future[CpuResult]:
        """Start ``job`` on the worker now; the caller overlaps its device work and takes ``.result()`` later."""
        return self._pool.submit(self.run, job)

    def run(self, job: CpuJob) -> CpuResult:
        """Compute ``job`` in the calling thread (then call its ``on_done``, even on failure)."""
        try:
            return self._compute(job)
        finally:
            if job.on_done is not None:
                job.on_done()

    def _compute(self, job: CpuJob) -> CpuResult:
        start = time.perf_counter()
        if job.ready is not None:
            with phase("tiers.cpu_wait_inputs"):
                job.ready.synchronize()
        waited = time.perf_counter() - start
        out = job.out
        if out is None:
            out = torch.empty(job.hidden.shape, dtype=torch.float32)
        # inference_mode is per thread: the caller's tensors may be inference tensors, which only an
        # inference-mode block may update in place.
        with torch.inference_mode(), phase("tiers.cpu_job"):
            compute = self._compute_c if self._kernel_fits(job, out) else self._compute_torch
            kernel = compute(job, out)
        self.last_kernel = kernel
        pairs = sum(int(group.rows.numel()) for group in job.groups)
        seconds = time.perf_counter() - start
        return CpuResult(out=out, seconds=seconds, wait_seconds=waited, pairs=pairs, kernel=kernel)

    def _kernel_fits(self, job: CpuJob, out: torch.Tensor) -> bool:
        """bf16 hidden, an fp32 contiguous out, and experts all bf16, or all of one quantised kind the kernel
        runs (e4m3fn fp8-block, fp4-block) on one tile (contiguous)."""
        if not self.use_kernel or job.hidden.dtype != torch.bfloat16 or job.hidden.device.type != "cpu":
            return False
        if out.dtype != torch.float32 or not out.is_contiguous():
            return False
        if _quantised_job(job):
            first = job.groups[0].weights
            if not all(_quant_fits(g.weights, first.quant_kind, first.tile) for g in job.groups):
                return False
            if not _KERNEL_QUANT[first.quant_kind].supported():
                return False
        elif not all(_bf16_fits(g.weights) for g in job.groups):
            return False
        return cpu_experts.available()  # re-read: MOETIER_CPU_KERNEL=0 turns it off at run time

    def _compute_c(self, job: CpuJob, out: torch.Tensor) -> str:
        groups = job.groups
        if _quantised_job(job):
            first = groups[0].weights
            assert first.tile is not None and first.quant_kind is not None  # _kernel_fits checked every group
            quant = _KERNEL_QUANT[first.quant_kind]
            quant.run(
                job.hidden.contiguous(),
                [g.weights for g in groups],
                first.tile,
                [g.rows for g in groups],
                [g.gates for g in groups],
                self.swiglu_limit,
                self.threads,
                out=out,
            )
            return f"c-{cpu_experts.kernel_isa()}-{quant.name}"
        cpu_experts.run_experts(
            job.hidden.contiguous(),
            [g.weights.gate_up for g in groups],
            [g.weights.down for g in groups],
            [g.rows for g in groups],
            [g.gates for g in groups],
            self.swiglu_limit,
            self.threads,
            out=out,
        )
        return f"c-{cpu_experts.kernel_isa()}"

    def _compute_torch(self, job: CpuJob, out: torch.Tensor) -> str:
        out.zero_()
        for group in job.groups:
            y = swiglu_expert(job.hidden[group.rows], group.weights, self.swiglu_limit)
            out.index_add_(0, group.rows, y.float() * group.gates.float()[:, None])
        return TORCH_KERNEL

    def close(self) -> None:
        self._finalizer()


def _quantised_job(job: CpuJob) -> bool:
    """Whether the job's experts are quantised (judged by the first: a job mixing formats fits nowhere)."""
    return bool(job.groups) and job.groups[0].weights.quantized


def _cpu_contiguous(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def _bf16_fits(weights: ExpertWeights) -> bool:
    """Dense bf16 weights, contiguous on the CPU (as every dense ExpertWeights is)."""
    return all(_cpu_contiguous(w, torch.bfloat16) for w in (weights.gate_up, weights.down))


@dataclass(frozen=True)
class _KernelQuant:
    """One quantised expert kind the C kernel runs: its stored values' dtype and its name ("fp8", "fp4",
    :data:`cpu_experts.QUANT_NAMES`), which labels the result and picks the kernel's entry."""

    values: torch.dtype
    name: str
    even_tile_cols: bool = False  # packed: two values a byte, so every tile must start on a whole byte

    def supported(self) -> bool:
        return cpu_experts.supports_quantised(self.name)

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return cpu_experts.run_quantised_experts(self.name, *args, **kwargs)


_KERNEL_QUANT = {
    "fp8-block": _KernelQuant(torch.float8_e4m3fn, "fp8"),
    "fp4-block": _KernelQuant(torch.uint8, "fp4", even_tile_cols=True),
}


def _quant_fits(weights: ExpertWeights, kind: str | None, tile: tuple[int, int] | None) -> bool:
    """Weights of ``kind`` on ``tile`` (the job's first expert's) that the kernel decodes: e4m3fn fp8-block
    (e5m2 runs torch) or packed fp4-block (DeepSeek-V4's (1, 32) tile, or any of even width), the values and
    float32 scales contiguous on the CPU."""
    quant = _KERNEL_QUANT.get(kind or "")
    if quant is None or weights.quant_kind != kind or weights.tile != tile or tile is None:
        return False
    if quant.even_tile_cols and tile[1] % 2:
        return False
    values = (weights.gate_q, weights.up_q, weights.down_q)
    scales = (weights.gate_scale, weights.up_scale, weights.down_scale)
    return all(_cpu_contiguous(q, quant.values) for q in values) and all(
        _cpu_contiguous(s, torch.float32) for s in scales
    )
