"""The CPU tier's native worker (``cpu_worker.c``): checked jobs run on a C thread, with no Python on it.

A Python worker thread holds the GIL for each job's prelude and wrap-up, and a decode job starts just
as the dispatching thread launches the device's work: that thread then waits for the GIL, job after
job. :class:`NativeWorker` packs a job on the calling thread (the arrays are copied into C), queues it,
and returns a :class:`NativeJob` at once; the C thread runs the same entry point a synchronous call
would (:meth:`CpuExpertsLibrary.run_checked`), then stores an optional value into a 32-bit word of
pinned memory (:class:`moetier.tiers.gpu_wait.HostFlag`), which releases a CUDA stream waiting for it.
Jobs run in submission order. Waiting on a job is a ctypes call, so it releases the GIL.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.kernels.cpu_experts import CheckedExperts, CpuExpertsLibrary, checked_job, raise_for

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
ABANDONED = -3  # a fed job's status when its start never came (MOETIER_ABANDONED)
# A job's marks (cpu_experts.c's MARK_* order): seconds after the kernel's entry (but "joined"), ``before`` the
# seconds the worker spent ahead of it (a fed job grouping its pairs). ``*_first`` / ``*_last``: the first and the
# last thread that joined the job.
MARK_NAMES = (
    "allocated", "entered_first", "entered_last", "gate_up_first", "gate_up_last", "down_first", "down_last", "end",
    "joined",  # not a time: how many of the job's threads took part (a helper that came late did not)
)  # fmt: skip


class _Entry:
    """The worker's C functions in one loaded build."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.start = lib.moetier_worker_start
        self.start.argtypes, self.start.restype = [ctypes.c_double], _PTR
        self.stop = lib.moetier_worker_stop
        self.stop.argtypes, self.stop.restype = [_PTR], None
        self.submit = lib.moetier_worker_submit
        # worker, quant, n_experts, table, tile rows, cols; offsets, rows, gates, hidden, U, H, I, has_limit,
        # limit, out, threads (moetier_cpu_experts' tail); flag, its value, status (the order in the C source).
        self.submit.argtypes = [_PTR, _INT, _I64, _PTR, _I64, _I64, *[_PTR] * 4, _I64, _I64, _I64, _INT]
        self.submit.argtypes += [ctypes.c_float, _PTR, _INT, _PTR, ctypes.c_int32, ctypes.POINTER(_INT)]
        self.submit.restype = _PTR
        self.submit_fed = lib.moetier_worker_submit_fed
        # worker, quant, n_layer, table, tile rows, cols; start word, its value; ids, weights, tokens, top_k, hidden,
        # H, I, has_limit, limit, out, threads; flag, its value, status.
        self.submit_fed.argtypes = [_PTR, _INT, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int32, _PTR, _PTR, _I64, _I64]
        self.submit_fed.argtypes += [_PTR, _I64, _I64, _INT, ctypes.c_float, _PTR, _INT, _PTR, ctypes.c_int32]
        self.submit_fed.argtypes += [ctypes.POINTER(_INT)]
        self.submit_fed.restype = _PTR
        self.cancel_fed = lib.moetier_worker_cancel_fed
        self.cancel_fed.argtypes, self.cancel_fed.restype = [_PTR], None
        self.done = lib.moetier_worker_done
        self.done.argtypes, self.done.restype = [_PTR], _INT
        self.wait = lib.moetier_worker_wait
        self.wait.argtypes, self.wait.restype = [_PTR, _PTR, ctypes.POINTER(ctypes.c_double)], _INT
        self.free = lib.moetier_worker_free
        self.free.argtypes, self.free.restype = [_PTR], None
        self.experts = lib.moetier_worker_experts
        self.experts.argtypes, self.experts.restype = [_PTR], _I64
        self.marks = lib.moetier_worker_marks
        self.marks.argtypes = [_PTR, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
        self.marks.restype = _INT


_entries: dict[str, _Entry | None] = {}
_entries_lock = threading.Lock()


def _entry(lib: CpuExpertsLibrary) -> _Entry | None:
    """The build's worker functions (None for a build without them), bound once per build."""
    key = str(lib.path)
    with _entries_lock:
        if key not in _entries:
            _entries[key] = _Entry(lib.cdll) if hasattr(lib.cdll, "moetier_worker_experts") else None
        return _entries[key]


def supported(lib: CpuExpertsLibrary) -> bool:
    """Whether this build has the native worker."""
    return _entry(lib) is not None


class NativeJob:
    """One queued job: :meth:`wait` blocks (without the GIL) until it ran and returns ``(status, seconds)``;
    ``experts`` is then the number of distinct experts it computed (a fed job's: those the device left it).

    Any thread may wait, any number of times; the C side's record is freed once, by the first wait.
    """

    def __init__(self, entry: _Entry, worker: int, handle: int, out: torch.Tensor, keep: Any) -> None:
        self._entry, self._worker, self._handle = entry, worker, handle
        self.out = out
        self._keep = keep  # the caller's tensors the C thread reads (hidden, out): alive until the job ran
        self._outcome: tuple[int, float] | None = None
        self.experts = 0
        self.marks: dict[str, float] = {}  # once waited for: where its wall time went (MARK_NAMES, and "before")
        self._lock = threading.Lock()

    def done(self) -> bool:
        if self._outcome is not None:
            return True
        return bool(self._entry.done(self._handle))

    def wait(self) -> tuple[int, float]:
        with self._lock:
            if self._outcome is None:
                seconds = ctypes.c_double(0.0)
                status = self._entry.wait(self._worker, self._handle, ctypes.byref(seconds))
                self.experts = int(self._entry.experts(self._handle))
                self.marks = self._read_marks()
                self._entry.free(self._handle)
                self._outcome, self._keep = (int(status), seconds.value), None
            return self._outcome

    def _read_marks(self) -> dict[str, float]:
        values, before = (ctypes.c_double * len(MARK_NAMES))(), ctypes.c_double(0.0)
        count = self._entry.marks(self._handle, values, ctypes.byref(before))
        if count != len(MARK_NAMES):  # a build whose enum this module does not know: no marks, not wrong ones
            return {}
        return {"before": before.value, **dict(zip(MARK_NAMES, values, strict=True))}

    def __del__(self) -> None:  # a job nobody waited for: it still runs; its record is freed once it has
        if getattr(self, "_outcome", True) is None:
            self.wait()


# A fed pair's id carries, above this bit, the first intermediate row the CPU computes of its expert (0: all of it;
# else the device computes the rows below: a split expert). cpu_worker.c's fed_expert / fed_from read it.
FED_FROM_SHIFT = 32


def fed_ids(ids: torch.Tensor, from_rows: torch.Tensor | int = 0) -> torch.Tensor:
    """Inbox ids (int64) for expert ``ids`` (-1: the device's pair) whose CPU part starts at intermediate row
    ``from_rows`` (a multiple of 32 and of the scales' tile width; the same for every pair of one expert)."""
    ids = ids.to(torch.int64)
    return torch.where(ids < 0, -1, ids | (torch.as_tensor(from_rows, dtype=torch.int64) << FED_FROM_SHIFT))


@dataclass
class FedInbox:
    """A fed job's pinned buffers: ``ids`` int64 and ``weights`` float32 ``[T, K]`` (an id of -1: not the CPU's
    pair; above ``FED_FROM_SHIFT``, the first intermediate row it computes: :func:`fed_ids`), ``hidden`` bf16
    ``[T, H]`` (the device writes these three), ``out`` float32 ``[T, H]`` (the worker's)."""

    ids: torch.Tensor
    weights: torch.Tensor
    hidden: torch.Tensor
    out: torch.Tensor
    _fits: tuple | None = field(default=None, repr=False)  # the experts' key the buffers were checked for

    @classmethod
    def allocate(cls, tokens: int, top_k: int, hidden_size: int, pin: bool) -> FedInbox:
        def empty(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        return cls(
            empty((tokens, top_k), torch.int64),
            empty((tokens, top_k), torch.float32),
            empty((tokens, hidden_size), torch.bfloat16),
            empty((tokens, hidden_size), torch.float32),
        )

    def check(self, experts: CheckedExperts) -> None:
        """ValueError unless the buffers fit each other and ``experts`` (dtypes, shapes, contiguity); checked once
        per experts' kind (a decode step submits a fed job every MoE layer)."""
        if self._fits == experts.key:
            return
        tokens, top_k = self.ids.shape
        want = {
            "ids": (self.ids, torch.int64, (tokens, top_k)),
            "weights": (self.weights, torch.float32, (tokens, top_k)),
            "hidden": (self.hidden, torch.bfloat16, (tokens, experts.key[1])),
            "out": (self.out, torch.float32, (tokens, experts.key[1])),
        }
        for name, (tensor, dtype, shape) in want.items():
            if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous() or tensor.is_cuda:
                raise ValueError(f"cpu_experts: fed job's {name} must be contiguous host {dtype} {shape}")
        self._fits = experts.key


class NativeWorker:
    """One C thread running jobs of experts :func:`~moetier.kernels.cpu_experts.check_experts` passed.

    :meth:`submit` checks and packs a job as :meth:`CpuExpertsLibrary.run_checked` does (ValueError for
    what it refuses) and queues it; :meth:`close` runs what is queued and ends the thread. After a job the
    thread spins ``spin_seconds`` for the next one before it sleeps (0: it sleeps at once).
    """

    def __init__(self, lib: CpuExpertsLibrary, spin_seconds: float = 0.0) -> None:
        entry = _entry(lib)
        if entry is None:
            raise RuntimeError(f"cpu_experts: {lib.path.name} has no native worker")
        if not 0.0 <= spin_seconds <= 1.0:
            raise ValueError(f"cpu_experts: spin_seconds must be in [0, 1], got {spin_seconds}")
        handle = entry.start(float(spin_seconds))
        if not handle:
            raise RuntimeError("cpu_experts: could not start the native worker thread")
        self._entry, self._handle = entry, handle
        self._last: NativeJob | None = None

    def submit(
        self,
        experts: CheckedExperts,
        hidden: torch.Tensor,
        rows: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        swiglu_limit: float | None,
        threads: int,
        out: torch.Tensor | None = None,
        flag: tuple[int, int] | None = None,
    ) -> NativeJob:
        """Queue the job; ``flag`` is ``(address of a pinned int32, value)`` stored once the sums are in ``out``."""
        if self._handle is None:
            raise RuntimeError("cpu_experts: the native worker is closed")
        job = checked_job(experts, hidden, rows, gates, swiglu_limit, threads, out)
        code, n, table = experts.quant_code, len(experts.pointers), experts.table.buffer_info()[0]
        tile = experts.key[2] if code else (0, 0)
        address, value = flag if flag is not None else (0, 0)
        status = ctypes.c_int(0)
        handle = self._entry.submit(
            self._handle, code, n, table, *tile, *job.tail, address or None, value, ctypes.byref(status)
        )
        if not handle:
            raise_for(status.value)
            raise RuntimeError("cpu_experts: the native worker refused a job")
        self._last = NativeJob(self._entry, self._handle, handle, job.out, (hidden, job.out))
        return self._last

    def submit_fed(
        self,
        experts: CheckedExperts,
        start: tuple[int, int],
        inbox: FedInbox,
        swiglu_limit: float | None,
        threads: int,
        flag: tuple[int, int] | None = None,
    ) -> NativeJob:
        """Queue a fed job (``cpu_worker.c``): once the int32 at ``start[0]`` reaches ``start[1]`` (the device's
        stream write; the worker then stores 0 there, so one constant value starts every job of that word), the
        pairs of ``inbox`` whose id is >= 0 are computed from ``experts`` (one layer's, all of them, in expert order:
        ids index it) into ``inbox.out``; then ``flag`` is stored. The caller keeps ``experts`` and the inbox alive
        until the job ran."""
        if self._handle is None:
            raise RuntimeError("cpu_experts: the native worker is closed")
        inbox.check(experts)
        code, n, table = experts.quant_code, len(experts.pointers), experts.table.buffer_info()[0]
        tile = experts.key[2] if code else (0, 0)
        address, value = flag if flag is not None else (0, 0)
        limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
        tokens, top_k = inbox.ids.shape
        status = ctypes.c_int(0)
        handle = self._entry.submit_fed(
            self._handle, code, n, table, *tile, start[0], start[1], inbox.ids.data_ptr(), inbox.weights.data_ptr(),
            tokens, top_k, inbox.hidden.data_ptr(), experts.key[1], experts.inter, int(swiglu_limit is not None),
            limit, inbox.out.data_ptr(), int(threads), address or None, value, ctypes.byref(status),
        )  # fmt: skip
        if not handle:
            raise_for(status.value)
            raise RuntimeError("cpu_experts: the native worker refused a job")
        self._last = NativeJob(self._entry, self._handle, handle, inbox.out, (inbox, experts))
        return self._last

    def cancel_fed(self) -> None:
        """Abandon every fed job queued so far whose start has not come (status ``MOETIER_ABANDONED``, no flag
        stored): for a step that failed before the device work that starts them was enqueued."""
        if self._handle is not None:
            self._entry.cancel_fed(self._handle)

    def drain(self) -> None:
        """Wait until every job queued so far has run."""
        last = self._last
        if last is not None:
            last.wait()

    def close(self) -> None:
        """Run what is queued, then end the thread (jobs already queued stay waitable)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._entry.stop(handle)
