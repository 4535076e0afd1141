"""The CPU expert tier: cold (token, expert) pairs computed on host cores straight from the home copy.

A missed expert costs its bytes at DRAM bandwidth here instead of PCIe bandwidth, and nothing waits
for a copy. A worker thread runs the jobs with its own thread count (torch's thread count is
per calling thread; the C kernel takes it per job), so the dispatching thread keeps its cores for
launching device work. Each job returns an fp32 partial sum over the rows it touched.

bf16 jobs run the C kernel of :mod:`moetier.kernels.cpu_experts` when it is available (one team of
threads for the whole job, every weight row read once for all of its expert's tokens), and so do
float8 e4m3fn experts (``expert_format="fp8"``) and packed fp4 e2m1 experts (``expert_format="fp4"``,
DeepSeek-V4's release), dequantised row by row inside the kernel exactly as :func:`swiglu_expert`
dequantises them; other dtypes (e5m2 included), and hosts where it cannot be built, run torch.

A job's host work is small (it sits on the decode critical path and holds the GIL): the kernel checks an
expert's tensors once (:func:`cpu_experts.check_experts`) and the tier remembers which passed, so later jobs
compare their ids and data pointers only; ``MOETIER_CPU_KERNEL`` is read once per job.

A job the C kernel runs that needs no wait for inputs (a decode job, built from host tensors) and whose
``on_done`` is a :class:`~moetier.tiers.gpu_wait.FlagRelease` (or None) goes to the kernel's native worker
(:mod:`moetier.kernels.cpu_worker`): it is packed on the calling thread and run on a C thread, which also
stores the flag, so no Python thread takes the GIL from the dispatcher while it launches the device's work.
Other jobs run on the Python worker. Jobs finish in submission order across both: a native job is only
queued while no Python job is outstanding, and a Python job first waits for the queued native ones.
"""

from __future__ import annotations

import logging
import operator
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.errors import ConfigError
from moetier.kernels import cpu_experts, cpu_worker
from moetier.profiling import phase, record_phase
from moetier.tiers.experts import ExpertWeights, swiglu_expert
from moetier.tiers.gpu_wait import FlagRelease

TORCH_KERNEL = "torch"
log = logging.getLogger(__name__)


def pinned_cores(threads: int) -> list[int] | None:
    """``MOETIER_CPU_PIN``: unset or ``0``, the CPU tier's threads run where the OS puts them; ``1``, they are pinned
    to the last ``threads`` cores this process may use (the first ones left to the thread that drives the device,
    which is not pinned); anything else is refused."""
    value = os.environ.get("MOETIER_CPU_PIN", "0").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"MOETIER_CPU_PIN must be 0 or 1, got {value!r}: unset it")
    if value == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-threads:]  # all of them when threads >= their count


def default_cpu_threads() -> int:
    """All usable cores but two (left to the dispatching thread and the rest of the process)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 2)


@dataclass
class CpuGroup:
    """One expert's share of a job: ``rows`` index ``CpuJob.hidden``; ``gates`` are the routing weights.

    Either may be a Python list (a decode job's few pairs: no tensor to make); a list of gates must hold
    values fp32 represents exactly (read from an fp32, bf16 or fp16 tensor)."""

    weights: ExpertWeights
    rows: torch.Tensor | list[int]  # int64 [n]
    gates: torch.Tensor | list[float]  # [n], any float dtype


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
    # a native job's marks: where its wall time went (cpu_worker.MARK_NAMES, seconds); empty for the Python worker
    marks: dict[str, float] = field(default_factory=dict)


class CpuExpertTier:
    """Runs :class:`CpuJob` s with ``threads`` threads (torch's, or the C kernel's), on the C kernel's native
    worker where a job fits it (``native``; see the module docstring), else on a Python worker thread.

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

    def __init__(
        self,
        swiglu_limit: float | None,
        threads: int | None = None,
        use_kernel: bool = True,
        native: bool | None = None,
        spin_seconds: float = 0.0,
    ) -> None:
        self.threads = default_cpu_threads() if threads is None else threads
        if self.threads < 1:
            raise ConfigError(f"cpu tier threads must be >= 1, got {self.threads}")
        self.pinned = pinned_cores(self.threads)  # the cores its native threads are pinned to, or None
        # Whether jobs may go to the native worker (None: unless MOETIER_CPU_WORKER=python, the A/B switch).
        self.native = native if native is not None else _native_wanted()
        self.spin_seconds = spin_seconds  # the native worker's spin for its next job (cpu_worker.NativeWorker)
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
        self._native: list[cpu_worker.NativeWorker] = []  # the native worker, once a job needed it
        self._last_pool: Future[CpuResult] | None = None
        self._finalizer = weakref.finalize(self, _shut_down, self._pool, self._native)

    def submit(self, job: CpuJob) -> Future[CpuResult] | NativeFuture:
        """Start ``job`` now (on the native worker where it can run there, see the module docstring); the caller
        overlaps its device work and takes ``.result()`` later."""
        native = self._submit_native(job)
        if native is not None:
            return native
        if self._native:  # after every queued native job, so the flags' values are stored in order
            future = self._pool.submit(self._run_after_native, self._native[0], job)
        else:
            future = self._pool.submit(self.run, job)
        self._last_pool = future
        return future

    def _run_after_native(self, worker: cpu_worker.NativeWorker, job: CpuJob) -> CpuResult:
        worker.drain()
        return self.run(job)

    def _submit_native(self, job: CpuJob) -> NativeFuture | None:
        """Queue ``job`` on the native worker, or None where it runs on the Python worker (see the module docstring).

        An error checking or packing the job is the future's (its ``on_done`` has run), as on the Python worker.
        """
        done = job.on_done
        if not self.native or job.ready is not None or not (done is None or isinstance(done, FlagRelease)):
            return None
        if self._last_pool is not None and not self._last_pool.done():
            return None
        out = job.out if job.out is not None else torch.empty(job.hidden.shape, dtype=torch.float32)
        plan = self._kernel_for(job, out)
        worker = None if plan is None else self._native_worker(plan.lib)
        if worker is None:
            return None
        try:
            hidden, checked = job.hidden.contiguous(), self._checked(job, plan)
            rows, gates = [g.rows for g in job.groups], [g.gates for g in job.groups]
            flag = None if done is None else (done.address, done.value)
            native = worker.submit(checked, hidden, rows, gates, self.swiglu_limit, self.threads, out, flag)
        except Exception as exc:  # noqa: BLE001 - the future carries it, as the Python worker's would
            if done is not None:
                done()
            failed: Future[CpuResult] = Future()
            failed.set_exception(exc)
            return failed  # type: ignore[return-value]
        self.last_kernel = plan.kernel_name
        return NativeFuture(native, plan.kernel_name, _pairs(job))

    def _native_worker(self, lib: cpu_experts.CpuExpertsLibrary) -> cpu_worker.NativeWorker | None:
        """The native worker, started on first use; None (and the Python worker from then on) for a build
        without one, or when its thread cannot start (one warning)."""
        if not self._native and self.native:
            try:
                if cpu_worker.supported(lib):
                    lib.pin_threads(self.pinned or [])  # before the worker (and its team) exists
                    self._native.append(cpu_worker.NativeWorker(lib, self.spin_seconds))
            except RuntimeError as exc:
                log.warning("the CPU tier's native worker is unavailable, jobs run on a Python thread: %s", exc)
            self.native = bool(self._native)
        return self._native[0] if self._native else None

    def fed_plan(
        self, experts: list[ExpertWeights], hidden_size: int
    ) -> tuple[cpu_worker.NativeWorker, cpu_experts.CheckedExperts, str] | None:
        """For jobs the device feeds (:meth:`cpu_worker.NativeWorker.submit_fed`): the native worker, the C kernel's
        check of ``experts`` (one layer's, in id order) and the kernel's name; None where either cannot run them."""
        probe = torch.zeros((1, hidden_size), dtype=torch.bfloat16)
        job = CpuJob(probe, [CpuGroup(w, [0], [1.0]) for w in experts])
        plan = self._kernel_for(job, torch.empty((1, hidden_size), dtype=torch.float32))
        worker = None if plan is None or not self.native else self._native_worker(plan.lib)
        if plan is None or worker is None:
            return None
        try:
            return worker, self._checked(job, plan), plan.kernel_name
        except ValueError:
            return None

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
        with phase("tiers.cpu_job"):
            plan = self._kernel_for(job, out)
            if plan is not None:  # raw pointers: no torch op updates a tensor in place, so no inference_mode
                kernel = self._compute_c(job, out, plan)
            else:
                # inference_mode is per thread: the caller's tensors may be inference tensors, which only an
                # inference-mode block may update in place.
                with torch.inference_mode():
                    kernel = self._compute_torch(job, out)
        self.last_kernel = kernel
        pairs = _pairs(job)
        seconds = time.perf_counter() - start
        return CpuResult(out=out, seconds=seconds, wait_seconds=waited, pairs=pairs, kernel=kernel)

    def _kernel_fits(self, job: CpuJob, out: torch.Tensor) -> bool:
        """Whether the C kernel runs ``job`` into ``out`` (see :meth:`_kernel_for`)."""
        return self._kernel_for(job, out) is not None

    def _kernel_for(self, job: CpuJob, out: torch.Tensor) -> _Plan | None:
        """How the kernel runs a job of bf16 hidden into an fp32 contiguous out whose experts are all bf16, or
        all of one quantised kind the kernel runs (e4m3fn fp8-block, fp4-block) on one tile (contiguous); None
        for torch. Experts that passed the kernel's checks before (:func:`_passed_before`) are not checked again."""
        hidden = job.hidden
        if not self.use_kernel or hidden.dtype != torch.bfloat16 or not hidden.is_cpu:
            return None
        if out.dtype != torch.float32 or not out.is_contiguous():
            return None
        groups, quant, tile = job.groups, None, None
        if _quantised_job(job):
            kind, tile = _kind_and_tile(groups[0].weights)
            quant = _KERNEL_QUANT.get(kind or "")
            if quant is None or tile is None or (quant.even_tile_cols and tile[1] % 2):
                return None
            want = (kind, tile)
            if not all([_kind_and_tile(g.weights) == want for g in groups]):
                return None
            tensors = [cpu_experts.quant_tensors(g.weights) for g in groups]
        else:
            tensors = [_dense_tensors(g.weights) for g in groups]
        name = None if quant is None else quant.name
        checked = _passed_before(name, hidden, tile, tensors)
        if checked is None and not all(_tensors_fit(t, _BF16 if quant is None else quant.parts) for t in tensors):
            return None
        lib = cpu_experts.usable_library()  # re-read: MOETIER_CPU_KERNEL=0 turns it off at run time
        if lib is None or (quant is not None and not quant.supported(lib)):
            return None
        return _Plan(lib, name, tile, tensors, checked)

    def _compute_c(self, job: CpuJob, out: torch.Tensor, plan: _Plan) -> str:
        hidden, checked = job.hidden.contiguous(), self._checked(job, plan)
        rows, gates = [g.rows for g in job.groups], [g.gates for g in job.groups]
        plan.lib.run_checked(checked, hidden, rows, gates, self.swiglu_limit, self.threads, out)
        return plan.kernel_name

    @staticmethod
    def _checked(job: CpuJob, plan: _Plan) -> cpu_experts.CheckedExperts:
        """The plan's experts as checked before, or checked now (ValueError as the kernel's run would raise)."""
        if plan.checked is not None:
            return plan.checked
        checked = cpu_experts.check_experts(plan.name, job.hidden, plan.tile, plan.tensors)
        _remember(plan.tensors, checked)
        return checked

    def _compute_torch(self, job: CpuJob, out: torch.Tensor) -> str:
        out.zero_()
        for group in job.groups:
            rows, gates = torch.as_tensor(group.rows, dtype=torch.int64), torch.as_tensor(group.gates)
            y = swiglu_expert(job.hidden[rows], group.weights, self.swiglu_limit)
            out.index_add_(0, rows, y.float() * gates.float()[:, None])
        return TORCH_KERNEL

    def close(self) -> None:
        self._finalizer()


class NativeFuture:
    """A job on the native worker, shaped like the Python worker's ``Future``: :meth:`result` waits for it (the
    wait releases the GIL) and returns its :class:`CpuResult` or raises its error; :meth:`done` never waits.
    Its wall time is added to the ``tiers.cpu_job`` phase when collected (no Python ran while it did)."""

    def __init__(self, job: cpu_worker.NativeJob, kernel: str, pairs: int) -> None:
        self._job, self._kernel, self._pairs = job, kernel, pairs
        self._result: CpuResult | None = None
        self.predicted_seconds: float | None = None  # set by a caller comparing it with the measured seconds

    def done(self) -> bool:
        return self._job.done()

    def result(self) -> CpuResult:
        if self._result is None:
            status, seconds = self._job.wait()
            cpu_experts.raise_for(status)
            record_phase("tiers.cpu_job", seconds)
            self._result = CpuResult(
                out=self._job.out, seconds=seconds, pairs=self._pairs, kernel=self._kernel, marks=self._job.marks
            )
        return self._result


def _shut_down(pool: ThreadPoolExecutor, native: list[cpu_worker.NativeWorker]) -> None:
    pool.shutdown(wait=False)
    for worker in native:
        worker.close()


def _native_wanted() -> bool:
    """``MOETIER_CPU_WORKER``: ``native`` (the default) or ``python``; anything else is refused."""
    value = os.environ.get("MOETIER_CPU_WORKER", "native").strip().lower()
    if value not in ("native", "python"):
        raise ConfigError(f"MOETIER_CPU_WORKER must be 'native' or 'python', got {value!r}: unset it for the default")
    return value == "native"


def _pairs(job: CpuJob) -> int:
    return sum([len(group.rows) for group in job.groups])


def _quantised_job(job: CpuJob) -> bool:
    """Whether the job's experts are quantised (judged by the first: a job mixing formats fits nowhere)."""
    return bool(job.groups) and job.groups[0].weights.quantized


def _cpu_contiguous(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.dtype == dtype and t.is_cpu and t.is_contiguous()


# Experts whose tensors passed the kernel's checks: the ids of an expert's tensors -> (what they were checked for
# (cpu_experts.job_key), I, their data pointers, weakrefs whose callback forgets the entry when one of those
# tensors dies, so an id never names another tensor, and (fp4) whether its scales were exact, else None). A tensor's
# dtype and device never change; a set_ or a reallocation moves its data, which _passed_before compares. Single dict
# operations: threads may share it.
_passed: dict[tuple[int, ...], tuple[tuple[Any, ...], int, tuple[int, ...], list[weakref.ref], bool | None]] = {}
_PASSED_LIMIT = 1 << 16
_data_ptr = torch.Tensor.data_ptr


def _passed_before(
    name: str | None, hidden: torch.Tensor, tile: tuple[int, int] | None, tensors: list[tuple[Any, ...]]
) -> cpu_experts.CheckedExperts | None:
    """The job's experts as :func:`cpu_experts.check_experts` would pass them, when every one passed for this H
    and tile before and still sits where it did (all of one I); else None."""
    if not tensors or hidden.dim() != 2:
        return None
    key, inter, pointers, exact = cpu_experts.job_key(name, hidden.shape[1], tile), 0, [], []
    for parts in tensors:
        entry = _passed.get(tuple(map(id, parts)))
        if entry is None or entry[0] != key or (pointers and entry[1] != inter):
            return None
        here = tuple(map(_data_ptr, parts))
        if here != entry[2]:
            return None
        inter = entry[1]
        pointers.append(here)
        exact.append(entry[4])
    return cpu_experts.CheckedExperts(key, inter, pointers, exact if all(e is not None for e in exact) else [])


def _remember(tensors: list[tuple[Any, ...]], checked: cpu_experts.CheckedExperts) -> None:
    """Note that each expert's tensors passed as ``checked`` says (forgotten when one of them dies)."""
    if len(_passed) + len(tensors) > _PASSED_LIMIT:
        _passed.clear()
    exact = checked.exact if len(checked.exact) == len(checked.pointers) else [None] * len(checked.pointers)
    for parts, here, fine in zip(tensors, checked.pointers, exact, strict=True):
        ids = tuple(map(id, parts))

        def forget(dead: weakref.ref, ids: tuple[int, ...] = ids) -> None:
            entry = _passed.get(ids)
            if entry is not None and any(ref is dead for ref in entry[3]):
                _passed.pop(ids, None)

        _passed[ids] = (checked.key, checked.inter, here, [weakref.ref(t, forget) for t in parts], fine)


_dense_tensors = operator.attrgetter("gate_up", "down")


# The quantised kind the kernel must run (e4m3fn fp8-block, packed fp4-block; e5m2 runs torch, as _tensors_fit
# finds) and the tile, which every expert of a job shares (packed fp4: of even width, whole bytes per tile).
def _kind_and_tile(weights: ExpertWeights) -> tuple[str | None, tuple[int, int] | None]:
    """The expert's quantised kind as the kernel knows it (fp4 with e8m0 scale bytes is its own) and its tile."""
    kind = weights.quant_kind
    return (f"{kind}-e8m0" if weights.e8m0_scales else kind), weights.tile


_BF16 = (torch.bfloat16, torch.bfloat16)


def _tensors_fit(tensors: tuple[Any, ...], dtypes: tuple[torch.dtype, ...]) -> bool:
    """Every tensor of its dtype in ``dtypes``, contiguous on the CPU."""
    return all(_cpu_contiguous(t, dtype) for t, dtype in zip(tensors, dtypes, strict=True))


def _bf16_fits(weights: ExpertWeights) -> bool:
    """Dense bf16 weights, contiguous on the CPU (as every dense ExpertWeights is)."""
    return _tensors_fit(_dense_tensors(weights), _BF16)


@dataclass(frozen=True)
class _KernelQuant:
    """One quantised expert kind the C kernel runs: its stored values' dtype and its name ("fp8", "fp4",
    :data:`cpu_experts.QUANT_NAMES`), which labels the result and picks the kernel's entry."""

    values: torch.dtype
    name: str
    even_tile_cols: bool = False  # packed: two values a byte, so every tile must start on a whole byte
    scales: torch.dtype = torch.float32  # of the scale grids (uint8: e8m0 exponent bytes)

    @property
    def parts(self) -> tuple[torch.dtype, ...]:
        """The dtypes of :data:`cpu_experts.QUANT_PARTS`: three of values, three scale grids."""
        return (self.values,) * 3 + (self.scales,) * 3

    def supported(self, lib: cpu_experts.CpuExpertsLibrary) -> bool:
        return bool(getattr(lib, f"supports_{self.name}"))


_KERNEL_QUANT = {
    "fp8-block": _KernelQuant(torch.float8_e4m3fn, "fp8"),
    "fp4-block": _KernelQuant(torch.uint8, "fp4", even_tile_cols=True),
    "fp4-block-e8m0": _KernelQuant(torch.uint8, "fp4_e8m0", even_tile_cols=True, scales=torch.uint8),
}


@dataclass(slots=True)
class _Plan:
    """How the kernel runs a job: the build, the quantised format (None: bf16) and tile, each expert's tensors
    (:data:`cpu_experts.QUANT_PARTS`, or gate_up and down), and those checked before (None: check them now)."""

    lib: cpu_experts.CpuExpertsLibrary
    name: str | None
    tile: tuple[int, int] | None
    tensors: list[tuple[Any, ...]]
    checked: cpu_experts.CheckedExperts | None

    @property
    def kernel_name(self) -> str:
        """What :attr:`CpuResult.kernel` says of this path: "c-" + the ISA, then "-fp8" or "-fp4" if quantised."""
        return f"c-{self.lib.isa}" if self.name is None else f"c-{self.lib.isa}-{self.name}"
