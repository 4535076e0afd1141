"""The CPU tier's C kernel (``cpu_experts.c``): a whole job of bf16 SwiGLU experts on the calling
thread and its team of helper threads (``cpu_team.c``: a job is done when its work is, not when its last thread
arrives).

Experts kept as float8 e4m3fn with float32 tile scales (DeepSeek-V3's release format) run through
:meth:`CpuExpertsLibrary.run_fp8`, and packed fp4 e2m1 ones with one float32 scale per 32 inputs
(DeepSeek-V4's) through :meth:`CpuExpertsLibrary.run_fp4`: each weight row is dequantised into a bf16
buffer exactly as the loader does (:func:`moetier.weights.fp8.dequantize_blocks`,
:func:`moetier.weights.fp4.dequantize_fp4`), so the result is bit for bit the bf16 path's on the
dequantised weights, reading half (fp8) or 0.31x (fp4, with its scales) the bytes. fp4 tiles whose
power-of-two scale makes every dequantised value exact (the release's) are decoded in registers instead,
into the same values, straight into the dot products (``cpu_experts_fp4.c``).

The source (``cpu_experts.c``, with the ``cpu_experts_fp4.c``, ``cpu_job.c``, ``cpu_team.c`` and ``cpu_worker.c``
it includes) is compiled with the system C compiler (``-O3 -march=native -pthread``) into a per-host cache
(:mod:`moetier.kernels.cpu_build`).

Without a compiler, or when the build fails, one warning says why and :func:`available` is False:
the CPU tier then runs torch. ``MOETIER_CPU_KERNEL`` selects: unset (or ``auto``) uses the kernel when
its build has a SIMD path (:data:`FAST_ISAS`: ``avx512_bf16``, ``avx512f`` or ``avx2``; the portable
build is slower than torch's kernels past 1-2 tokens), ``1`` uses any build, ``0`` turns it off.
``moetier bench cpu-tier`` measures any build against torch, which is how a path earns its place there.
:meth:`CpuExpertsLibrary.run_checked` runs experts :func:`check_experts` passed, checking only the job's own
rows, gates and buffers: the CPU tier's per-job path, for experts it saw pass before.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import operator
import os
import subprocess
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from moetier.kernels.cpu_build import build

log = logging.getLogger(__name__)

# The builds the tier uses by default: each beat torch on the CPU tier's jobs. avx2 (moetier bench cpu-tier,
# 6 experts of 4096 x 2048 on an AVX2-only EPYC, 2 cores): 16.8 against torch's 33.8 ms per 1-token job on
# one thread, 11.0 against 18.4 on two; 31 against 122 at 4 tokens. fp4 experts (--formats fp4, same host, the
# second core busy with other jobs): 26 against torch's ~1000 ms per 1-token job on one thread, 47 against 1400 at 4.
FAST_ISAS = ("avx512_bf16", "avx512f", "avx2")
_ERRORS = {
    -1: "bad arguments (an expert id, offsets or a row index out of range)",
    -2: "out of memory for the activations",
    -3: "abandoned: the worker stopped before the device stored the job's start value",
}
# The C kernel's QUANT_* codes: how a quantised job's weights are stored.
QUANT_E4M3, QUANT_E2M1, QUANT_E2M1_E8M0 = 1, 2, 3
# OR'ed into an e2m1 job's quant code where every expert's scales were found exact for the fused fp4 path (all
# powers of two the e2m1 products keep exact: checked once per expert, moetier_scales_exact): its dot products then
# skip their scan of each row's scales (H200, 1-token fp4 jobs at 14 threads: 72.6 -> 78.3 GB/s, medians of an
# ABAB; nothing clear at 4 tokens: results/h200-20261204-eb488f1-stamps-rope-exact/31f88d7-exact).
QUANT_EXACT_SCALES = 0x100


class QuantExpert(Protocol):
    """What :meth:`CpuExpertsLibrary.run_fp8` / :meth:`~CpuExpertsLibrary.run_fp4` read of one expert (a
    quantised ``ExpertWeights`` is one). Shapes are in values; fp4 stores ``[R, C]`` as uint8 ``[R, C / 2]``."""

    gate_q: torch.Tensor | None  # float8_e4m3fn [I, H], or uint8 [I, H / 2] (fp4)
    up_q: torch.Tensor | None  # as gate_q
    down_q: torch.Tensor | None  # float8_e4m3fn [H, I], or uint8 [H, I / 2] (fp4)
    gate_scale: torch.Tensor | None  # float32 [ceil(I / tile_rows), ceil(H / tile_cols)]
    up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None  # float32 [ceil(H / tile_rows), ceil(I / tile_cols)]


@dataclass(frozen=True)
class _QuantFormat:
    """How one quantised format's experts are checked and passed to ``moetier_cpu_experts_quantised``."""

    code: int  # QUANT_E4M3, QUANT_E2M1 or QUANT_E2M1_E8M0
    dtype: torch.dtype  # of the stored values
    per_byte: int  # values per stored element along a row
    scale_dtype: torch.dtype = torch.float32  # of the scale grids: float32, or uint8 e8m0 exponent bytes

    def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[0], shape[1] // self.per_byte


_FP8 = _QuantFormat(QUANT_E4M3, torch.float8_e4m3fn, 1)
_FP4 = _QuantFormat(QUANT_E2M1, torch.uint8, 2)
_FP4_E8M0 = _QuantFormat(QUANT_E2M1_E8M0, torch.uint8, 2, torch.uint8)
_FORMATS = {"fp8": _FP8, "fp4": _FP4, "fp4_e8m0": _FP4_E8M0}
# A quantised expert's tensors, in the order of moetier_cpu_experts_quantised's pointer arrays.
QUANT_PARTS = ("gate_q", "up_q", "down_q", "gate_scale", "up_scale", "down_scale")
quant_tensors = operator.attrgetter(*QUANT_PARTS)  # expert -> its QUANT_PARTS tensors, as a tuple
_SMALL_PACK = 256  # pairs up to which a job's rows and gates go through Python lists (cheaper than torch.cat)
_EXACT_GATES = frozenset((torch.float32, torch.bfloat16, torch.float16))  # gates fp32 holds exactly


@dataclass(slots=True)
class CheckedExperts:
    """A job's experts as :func:`check_experts` passed them, for :meth:`CpuExpertsLibrary.run_checked`: ``key``
    (:func:`job_key`), I, each expert's data pointers, and those as one C array part by part (never NULL)."""

    key: tuple[Any, ...]
    inter: int
    pointers: list[tuple[int, ...]]
    exact: list[bool] = field(default_factory=list)  # per expert (fp4): every scale exact (scales_exact); else []
    table: array = field(init=False)

    def __post_init__(self) -> None:
        self.table = array("Q", itertools.chain.from_iterable(zip(*self.pointers, strict=True))) or array("Q", (0,))

    @property
    def quant_code(self) -> int:
        """The C entry points' ``quant``: the format's code, with QUANT_EXACT_SCALES where every expert's scales are
        exact (the experts' scales never change once checked: the home copy's do not)."""
        exact = len(self.exact) == len(self.pointers) > 0 and all(self.exact)
        return self.key[0] | (QUANT_EXACT_SCALES if exact else 0)


def job_key(name: str | None, hidden_size: int, tile: tuple[int, int] | None) -> tuple[Any, ...]:
    """What a job's experts are checked for: bf16 (``name`` None) or "fp8"/"fp4" on ``tile``, and H."""
    return (0, hidden_size) if name is None else (_FORMATS[_quant_name(name)].code, hidden_size, tile)


def check_experts(
    name: str | None, hidden: torch.Tensor, tile: tuple[int, int] | None, tensors: Sequence[tuple[Any, ...]]
) -> CheckedExperts:
    """Check ``hidden`` and a job's experts, each as ``(gate_up, down)`` (bf16, ``name`` None) or as its
    :data:`QUANT_PARTS` ("fp8", "fp4" on ``tile``), as :meth:`~CpuExpertsLibrary.run` and ``run_fp8``/``run_fp4``
    do: ValueError for any dtype, shape or layout they refuse."""
    hidden_size = _check(hidden, torch.bfloat16, "hidden", ndim=2).shape[1]
    exact: list[bool] = []
    if name is None:
        inter = _check_experts(tensors, hidden_size)
    else:
        fmt = _FORMATS[_quant_name(name)]
        tile = _check_tile(tile, fmt)  # type: ignore[arg-type]
        inter = _check_quant_experts(tensors, hidden_size, tile, fmt)
        if fmt.code in (QUANT_E2M1, QUANT_E2M1_E8M0) and tile[1] == 32:  # the fused path's tiles
            exact = [all(scales_exact(parts[i]) for i in (3, 4, 5)) for parts in tensors]
    pointers = [tuple(map(torch.Tensor.data_ptr, t)) for t in tensors]
    return CheckedExperts(job_key(name, hidden_size, tile), inter, pointers, exact)


def scales_exact(scales: torch.Tensor) -> bool:
    """Whether every scale of a contiguous CPU grid (float32, or uint8 e8m0 exponent bytes) keeps the e2m1 products
    exact, as the fused fp4 path needs (a power of two in [2^-125, 2^125]): the C kernel's check (False without it)."""
    lib = _load(())
    if lib is None or lib.scales_exact is None or not scales.is_contiguous() or scales.device.type != "cpu":
        return False
    if scales.dtype not in (torch.float32, torch.uint8):
        return False
    return bool(lib.scales_exact(scales.data_ptr(), scales.numel(), int(scales.dtype == torch.uint8)))


_lock = threading.Lock()
_built: dict[tuple[str, ...], CpuExpertsLibrary | None] = {}


class CpuExpertsLibrary:
    """The loaded shared library: :attr:`isa` names its SIMD path, :meth:`run` computes one job."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        fn = self._lib.moetier_cpu_experts
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        # n_experts; gate_up, down (pointer arrays), offsets, rows, gates, hidden; out_rows, hidden, inter;
        # has_limit, limit; out; threads (the order of moetier_cpu_experts in the C source).
        fn.argtypes = [i64, *[ptr] * 6, i64, i64, i64, ctypes.c_int, ctypes.c_float, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._run = fn
        self._lib.moetier_cpu_experts_isa.restype = ctypes.c_char_p
        self.isa: str = self._lib.moetier_cpu_experts_isa().decode()
        self._run_quantised = self._bind_quantised()
        # moetier_scales_exact(scales, n, bytes) (cpu_experts_fp4.c), or None in a build from a source without it
        self.scales_exact = getattr(self._lib, "moetier_scales_exact", None)
        if self.scales_exact is not None:
            self.scales_exact.argtypes, self.scales_exact.restype = [ptr, i64, ctypes.c_int], ctypes.c_int

    def _bind_quantised(self) -> Any:
        """The quantised (fp8 and fp4) entry point, or None for a library built from a source without it."""
        fn = getattr(self._lib, "moetier_cpu_experts_quantised", None)
        if fn is None:
            return None
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        # quant, n_experts; gate, up, down, their scales (pointer arrays); tile rows, cols; then as
        # moetier_cpu_experts.
        fn.argtypes = [c_int, i64, *[ptr] * 6, i64, i64, *[ptr] * 4, i64, i64, i64, c_int, ctypes.c_float, ptr]
        fn.argtypes += [c_int]
        fn.restype = c_int
        decode = self._lib.moetier_e4m3_to_f32
        decode.argtypes, decode.restype = [ptr, ptr, i64], None
        dequantize = self._lib.moetier_dequantize
        dequantize.argtypes, dequantize.restype = [c_int, ptr, ptr, i64, i64, i64, i64, ptr], c_int
        return fn

    def pin_threads(self, cores: Sequence[int]) -> None:
        """Pin the kernel's threads started from now on (native workers, team helpers) to ``cores``, thread ``i`` of
        a team to ``cores[i % len(cores)]`` (empty: stop pinning); ValueError for a core the C side refuses.
        Process-wide for this build; threads already running keep their cores."""
        fn = getattr(self._lib, "moetier_pin_threads", None)
        if fn is None:
            raise RuntimeError(f"cpu_experts: {self.path.name} cannot pin its threads (a build without it)")
        array_type = ctypes.c_int * max(len(cores), 1)
        if fn(array_type(*cores), len(cores)) != 0:
            raise ValueError(f"cpu_experts: cannot pin threads to cores {list(cores)}")

    @property
    def cdll(self) -> ctypes.CDLL:
        """The loaded build itself (its other entry points: :mod:`moetier.kernels.cpu_worker`)."""
        return self._lib

    @property
    def supports_fp8(self) -> bool:
        """Whether this build has the float8 e4m3fn entry point."""
        return self._run_quantised is not None

    @property
    def supports_fp4(self) -> bool:
        """Whether this build has the packed fp4 (e2m1) entry point (the same one as fp8's)."""
        return self._run_quantised is not None

    @property
    def supports_fp4_e8m0(self) -> bool:
        """Whether this build runs packed fp4 with e8m0 scale bytes (QUANT_E2M1_E8M0, the same entry point)."""
        return self._run_quantised is not None

    def run(
        self,
        hidden: torch.Tensor,
        gate_up: Sequence[torch.Tensor],
        down: Sequence[torch.Tensor],
        rows: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        swiglu_limit: float | None,
        threads: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[U, H]`` fp32 = sum over experts e of ``gates[e][:, None] * expert_e(hidden[rows[e]])`` at ``rows[e]``.

        ``hidden`` is bf16 ``[U, H]``; expert e has ``gate_up[e]`` bf16 ``[2I, H]`` (gate rows first) and
        ``down[e]`` bf16 ``[H, I]``, all contiguous on the CPU; ``rows[e]`` (integer) and ``gates[e]``
        (float) have one entry per token. ``out`` (fp32 ``[U, H]``, contiguous) is overwritten, or
        allocated when None. Raises ValueError for any other dtype, shape or layout.
        """
        if not len(gate_up) == len(down) == len(rows) == len(gates):
            raise ValueError("cpu_experts: gate_up, down, rows and gates must have one entry per expert")
        checked = check_experts(None, hidden, None, list(zip(gate_up, down, strict=True)))
        return self.run_checked(checked, hidden, rows, gates, swiglu_limit, threads, out)

    def run_fp8(
        self,
        hidden: torch.Tensor,
        experts: Sequence[QuantExpert],
        tile: tuple[int, int],
        rows: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        swiglu_limit: float | None,
        threads: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`run` for float8 e4m3fn experts with one float32 scale per ``tile`` (rows, cols) tile.

        Each expert has ``gate_q``/``up_q`` ``[I, H]`` and ``down_q`` ``[H, I]`` (float8_e4m3fn) and
        ``*_scale`` grids ``[ceil(R / tile[0]), ceil(C / tile[1])]`` (float32), all contiguous on the CPU.
        The result equals :meth:`run` on the weights dequantised to bf16 (``dequantize_blocks``), exactly.
        """
        return self._run_quant("fp8", hidden, experts, tile, rows, gates, swiglu_limit, threads, out)

    def run_fp4(
        self,
        hidden: torch.Tensor,
        experts: Sequence[QuantExpert],
        tile: tuple[int, int],
        rows: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        swiglu_limit: float | None,
        threads: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`run` for packed fp4 (e2m1) experts with one float32 scale per ``tile`` of values.

        Each expert has ``gate_q``/``up_q`` uint8 ``[I, H / 2]`` and ``down_q`` ``[H, I / 2]`` (value ``2j`` of
        a row in the low nibble of byte ``j``) and float32 ``*_scale`` grids ``[ceil(R / tile[0]),
        ceil(C / tile[1])]`` over the ``[R, C]`` values (DeepSeek-V4: ``tile`` (1, 32)), or uint8 grids of e8m0
        exponent bytes (``2 ** (e - 127)``), all contiguous on the CPU; ``H``, ``I`` and ``tile[1]`` even. The
        result equals :meth:`run` on the weights dequantised to bf16 (``dequantize_fp4``), exactly.
        """
        name = fp4_name(experts[0].gate_scale if experts else None)
        return self._run_quant(name, hidden, experts, tile, rows, gates, swiglu_limit, threads, out)

    def _run_quant(
        self, name: str, hidden: torch.Tensor, experts: Sequence[QuantExpert], tile: tuple[int, int], *job: Any
    ) -> torch.Tensor:
        """``run_fp8``/``run_fp4`` (``name``); ``job`` is (rows, gates, swiglu_limit, threads, out)."""
        self._require_quantised()
        if not len(experts) == len(job[0]) == len(job[1]):
            raise ValueError("cpu_experts: experts, rows and gates must have one entry per expert")
        checked = check_experts(name, hidden, tile, [quant_tensors(e) for e in experts])
        return self.run_checked(checked, hidden, *job)

    def run_checked(
        self,
        experts: CheckedExperts,
        hidden: torch.Tensor,
        rows: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        swiglu_limit: float | None,
        threads: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`run` (or ``run_fp8``/``run_fp4``) on experts :func:`check_experts` passed, whose tensors live on
        unmoved (the CPU tier remembers which did): only ``hidden``, ``rows``, ``gates`` and ``out`` are checked."""
        job = checked_job(experts, hidden, rows, gates, swiglu_limit, threads, out)
        code, n, table = experts.quant_code, len(experts.pointers), experts.table.buffer_info()[0]
        stride = 8 * n  # each part's run of n pointers
        if code == 0:
            status = self._run(n, table, table + stride, *job.tail)
        else:
            self._require_quantised()
            arrays = range(table, table + len(QUANT_PARTS) * stride, stride) if n else (table,) * len(QUANT_PARTS)
            status = self._run_quantised(code, n, *arrays, *experts.key[2], *job.tail)
        del job.keep  # alive until here: the C call read them
        raise_for(status)
        return job.out

    def _require_quantised(self) -> None:
        if self._run_quantised is None:
            raise RuntimeError(f"cpu_experts: {self.path.name} has no quantised (fp8/fp4) entry point")

    def decode_e4m3(self, codes: torch.Tensor) -> torch.Tensor:
        """The kernel's own decode of uint8 float8 e4m3fn codes to float32 (for tests)."""
        self._require_quantised()
        codes = _check(codes.reshape(-1).contiguous(), torch.uint8, "codes", ndim=1)
        values = torch.empty(codes.shape, dtype=torch.float32)
        self._lib.moetier_e4m3_to_f32(codes.data_ptr(), values.data_ptr(), codes.numel())
        return values

    def dequantize_e4m3(self, q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
        """The kernel's row dequantisation of one float8 e4m3fn matrix to bf16 (for tests)."""
        return self._dequantize(_FP8, q, scale, tile)

    def dequantize_e2m1(self, q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
        """The kernel's row dequantisation of one packed fp4 matrix (uint8 ``[R, C / 2]``) to bf16 ``[R, C]``
        (for tests: compare with ``dequantize_fp4``)."""
        return self._dequantize(_FP4, q, scale, tile)

    def _dequantize(
        self, fmt: _QuantFormat, q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]
    ) -> torch.Tensor:
        self._require_quantised()
        rows, stored_cols = _check(q, fmt.dtype, "q", ndim=2).shape
        cols, tile = stored_cols * fmt.per_byte, _check_tile(tile, fmt)
        if tuple(_check(scale, torch.float32, "scale", ndim=2).shape) != (-(-rows // tile[0]), -(-cols // tile[1])):
            raise ValueError(f"cpu_experts: scale {tuple(scale.shape)} does not tile {(rows, cols)} in {tile}")
        out = torch.empty((rows, cols), dtype=torch.bfloat16)
        status = self._lib.moetier_dequantize(
            fmt.code, q.data_ptr(), scale.data_ptr(), rows, cols, *tile, out.data_ptr()
        )
        raise_for(status)
        return out


@dataclass(slots=True)
class PackedJob:
    """A checked job's C arguments: ``tail`` (offsets, rows, gates, hidden, U, H, I, has_limit, limit, out,
    threads: the entry points' trailing arguments), the result buffer, and what must outlive the C call."""

    tail: tuple[Any, ...]
    out: torch.Tensor
    keep: Any


def checked_job(
    experts: CheckedExperts,
    hidden: torch.Tensor,
    rows: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
    swiglu_limit: float | None,
    threads: int,
    out: torch.Tensor | None,
) -> PackedJob:
    """Check a job's own rows, gates and buffers against experts :func:`check_experts` passed, and pack it."""
    if not len(experts.pointers) == len(rows) == len(gates):
        raise ValueError("cpu_experts: experts, rows and gates must have one entry per expert")
    units, hidden_size = _check(hidden, torch.bfloat16, "hidden", ndim=2).shape
    if hidden_size != experts.key[1]:
        raise ValueError(f"cpu_experts: hidden {tuple(hidden.shape)} is not of the experts' H {experts.key[1]}")
    out = _check_out(out, units, hidden_size)
    keep, flat_rows, flat_gates, offsets = _pack(rows, gates)
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    tail = (offsets, flat_rows, flat_gates, hidden.data_ptr(), units, hidden_size, experts.inter)
    tail += (int(swiglu_limit is not None), limit, out.data_ptr(), int(threads))
    return PackedJob(tail, out, keep)


def raise_for(status: int) -> None:
    """ValueError naming a nonzero status of the C entry points."""
    if status != 0:
        raise ValueError(f"cpu_experts: {_ERRORS.get(status, f'error {status}')}")


def fp4_name(scale: torch.Tensor | None) -> str:
    """The kernel's name for packed fp4 experts with this scale grid: "fp4_e8m0" for uint8 exponent bytes."""
    return "fp4_e8m0" if scale is not None and scale.dtype == torch.uint8 else "fp4"


def _check_out(out: torch.Tensor | None, units: int, hidden_size: int) -> torch.Tensor:
    if out is None:
        return torch.empty((units, hidden_size), dtype=torch.float32)
    if out.shape != (units, hidden_size):
        raise ValueError(f"cpu_experts: out has shape {tuple(out.shape)}, expected {(units, hidden_size)}")
    return _check(out, torch.float32, "out", ndim=2)


def _check_tile(tile: tuple[int, int], fmt: _QuantFormat) -> tuple[int, int]:
    if len(tile) != 2 or not all(isinstance(t, int) and t > 0 for t in tile):
        raise ValueError(f"cpu_experts: tile must be two positive integers, got {tile!r}")
    if tile[1] % fmt.per_byte:  # fp4: every tile starts on a whole byte
        raise ValueError(f"cpu_experts: packed fp4 tile columns must be even, got {tile!r}")
    return int(tile[0]), int(tile[1])


def _check_quant_experts(
    experts: Sequence[tuple[Any, ...]], hidden_size: int, tile: tuple[int, int], fmt: _QuantFormat
) -> int:
    """The intermediate size I shared by every quantised expert (each given as its :data:`QUANT_PARTS`; 1 when
    there are none); ValueError on any mismatch. Shapes are in values (fp4 stores half as many bytes per row)."""
    inter = experts[0][2].shape[-1] * fmt.per_byte if experts and experts[0][2] is not None else 0
    if hidden_size % fmt.per_byte:
        raise ValueError(f"cpu_experts: packed fp4 needs an even hidden size, got {hidden_size}")
    shapes = {"gate": (inter, hidden_size), "up": (inter, hidden_size), "down": (hidden_size, inter)}
    for e, parts in enumerate(experts):
        for i, (name, shape) in enumerate(shapes.items()):
            q, scale = parts[i], parts[i + 3]  # QUANT_PARTS: the values, then their scales
            if q is None or scale is None:
                raise ValueError(f"cpu_experts: expert {e} has no {name}_q / {name}_scale (not quantised)")
            _check(q, fmt.dtype, f"expert {e} {name}_q", ndim=2)
            _check(scale, fmt.scale_dtype, f"expert {e} {name}_scale", ndim=2)
            stored, grid = fmt.stored_shape(shape), (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))
            if tuple(q.shape) != stored or tuple(scale.shape) != grid:
                raise ValueError(
                    f"cpu_experts: expert {e} has {name}_q {tuple(q.shape)} and {name}_scale {tuple(scale.shape)}, "
                    f"expected {stored} and {grid} ({tile[0]}x{tile[1]} tiles)"
                )
    return max(inter, 1)


def _check(t: torch.Tensor, dtype: torch.dtype, name: str, ndim: int) -> torch.Tensor:
    if t.dtype != dtype or t.dim() != ndim or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"cpu_experts: {name} must be a contiguous {ndim}-d {dtype} CPU tensor, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
        )
    return t


def _check_experts(experts: Sequence[tuple[Any, ...]], hidden_size: int) -> int:
    """The intermediate size I shared by every ``(gate_up, down)`` expert (1 when there are none); ValueError on
    any mismatch."""
    inter = experts[0][1].shape[-1] if experts else 0
    for e, (gu, dn) in enumerate(experts):
        _check(gu, torch.bfloat16, f"gate_up[{e}]", ndim=2)
        _check(dn, torch.bfloat16, f"down[{e}]", ndim=2)
        if tuple(gu.shape) != (2 * inter, hidden_size) or tuple(dn.shape) != (hidden_size, inter):
            raise ValueError(
                f"cpu_experts: expert {e} has gate_up {tuple(gu.shape)} and down {tuple(dn.shape)}, "
                f"expected {(2 * inter, hidden_size)} and {(hidden_size, inter)}"
            )
    return max(inter, 1)


def _pack(rows: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], int, int, int]:
    """All experts' rows (int64) and gates (fp32) end to end, and the offsets ``[0, n0, n0 + n1, ...]``: what the
    caller keeps alive across the C call, and the addresses of the rows, gates and offsets (CPU memory). Decode's
    few pairs go through Python lists (cheaper than torch.cat), the same values: 1-d rows of integers, 1-d gates
    of a dtype fp32 holds exactly; anything else raises TypeError or OverflowError there, and torch packs it."""
    try:
        row_lists = [r if isinstance(r, list) else r.tolist() for r in rows]
        counts = list(map(len, row_lists))
        tensors = [g for g in gates if not isinstance(g, list)]  # lists: values fp32 holds (CpuGroup's contract)
        if sum(counts) > _SMALL_PACK or not _EXACT_GATES.issuperset([g.dtype for g in tensors]):
            raise TypeError("many pairs, or gates of a dtype fp32 does not hold")
        gate_lists = [g if isinstance(g, list) else g.tolist() for g in gates]
        if list(map(len, gate_lists)) != counts:
            raise TypeError("gates not 1-d, or not one per row")
        offsets_rows = array("q", itertools.accumulate(counts, initial=0))  # then the rows: one array
        offsets_rows.extend(itertools.chain.from_iterable(row_lists))
        flat_gates = array("f", itertools.chain.from_iterable(gate_lists)) or array("f", (0.0,))  # never NULL
        offsets_at = offsets_rows.buffer_info()[0]
        return (offsets_rows, flat_gates), offsets_at + 8 * (len(counts) + 1), flat_gates.buffer_info()[0], offsets_at
    except (TypeError, OverflowError):
        flat_rows, flat_gates, counts = _pack_torch(rows, gates)
    offsets = array("q", itertools.accumulate(counts, initial=0))
    return (flat_rows, flat_gates, offsets), flat_rows.data_ptr(), flat_gates.data_ptr(), offsets.buffer_info()[0]


def _pack_torch(rows: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> tuple[Any, Any, list[int]]:
    """All experts' rows as int64 and gates as fp32, end to end (contiguous CPU tensors), and their counts."""
    rows = [torch.as_tensor(r, dtype=torch.int64) if isinstance(r, list) else r for r in rows]
    gates = [torch.as_tensor(g, dtype=torch.float32) if isinstance(g, list) else g for g in gates]
    counts = [int(r.numel()) for r in rows]
    if any(int(g.numel()) != c for g, c in zip(gates, counts, strict=True)):
        raise ValueError("cpu_experts: each expert needs one gate per row")
    flat_rows = torch.cat([r.reshape(-1).to(torch.int64) for r in rows]) if rows else torch.empty(0, dtype=torch.int64)
    flat_gates = torch.cat([g.reshape(-1).float() for g in gates]) if gates else torch.empty(0)
    if not (flat_rows.is_cpu and flat_gates.is_cpu):
        raise ValueError(
            f"cpu_experts: rows and gates must be CPU tensors, got {flat_rows.device}, {flat_gates.device}"
        )
    return flat_rows.contiguous(), flat_gates.contiguous(), counts


# --- building ------------------------------------------------------------------------------------------


def mode() -> str:
    """``MOETIER_CPU_KERNEL``: "0" (off), "1" (any build) or "auto" (:data:`FAST_ISAS` builds); read on every call."""
    value = os.environ.get("MOETIER_CPU_KERNEL", "auto").strip().lower()
    return value if value in ("0", "1") else "auto"


def available() -> bool:
    """Whether the CPU tier should use the kernel: built (on the first call) and allowed by :func:`mode`."""
    return usable_library() is not None


def usable_library() -> CpuExpertsLibrary | None:
    """The default build when :func:`available` (one read of the environment), else None."""
    kind = mode()
    lib = None if kind == "0" else _load(())
    if lib is None:
        return None
    if lib.isa in FAST_ISAS or kind == "1":
        return lib
    _log_once(
        "portable",
        f"moetier CPU expert kernel built without a SIMD path ({lib.isa}): the CPU tier runs torch "
        "(MOETIER_CPU_KERNEL=1 uses it anyway)",
    )
    return None


_logged: set[str] = set()


def _log_once(key: str, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info(message)


def library(extra_flags: tuple[str, ...] = ()) -> CpuExpertsLibrary | None:
    """The kernel built with :data:`moetier.kernels.cpu_build.FLAGS` plus ``extra_flags`` (cached per process), or None.

    None when disabled by ``MOETIER_CPU_KERNEL=0`` (silently) or when it cannot be built or loaded
    (one warning per flag set, naming the reason).
    """
    return None if mode() == "0" else _load(extra_flags)


def _load(extra_flags: tuple[str, ...]) -> CpuExpertsLibrary | None:
    """:func:`library` without the environment check; the lock only for the first build of a flag set."""
    lib = _built.get(extra_flags, False)  # False: not built yet
    if lib is not False:
        return lib
    with _lock:
        if extra_flags not in _built:
            _built[extra_flags] = _build_and_load(extra_flags)
        return _built[extra_flags]


def _build_and_load(extra_flags: tuple[str, ...]) -> CpuExpertsLibrary | None:
    try:
        return CpuExpertsLibrary(build(extra_flags))
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("moetier CPU expert kernel unavailable, the CPU tier runs torch: %s", _one_line(exc))
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join((str(exc).strip() or type(exc).__name__).split())[:500]


# The quantised expert formats the kernel runs: e4m3 fp8-block, packed e2m1 fp4-block (float32 or e8m0 scales)
QUANT_NAMES = ("fp8", "fp4", "fp4_e8m0")


def kernel_isa() -> str | None:
    """The SIMD path of the default build ("avx512_bf16", "avx512f", "avx2", "portable"), None when not built."""
    lib = library()
    return None if lib is None else lib.isa


def run_experts(
    hidden: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
    rows: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
    swiglu_limit: float | None,
    threads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:meth:`CpuExpertsLibrary.run` with the default build (whatever its ISA); RuntimeError when there is none."""
    return _default_library().run(hidden, gate_up, down, rows, gates, swiglu_limit, threads, out)


def _quant_name(name: str) -> str:
    if name not in QUANT_NAMES:
        raise ValueError(f"unknown quantised expert format {name!r}; the kernel runs {', '.join(QUANT_NAMES)}")
    return name


def _default_library() -> CpuExpertsLibrary:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU expert kernel is unavailable (MOETIER_CPU_KERNEL=0 or not buildable; see the log)")
    return lib
