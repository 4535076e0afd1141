"""One DeepSeek-V4 compressor's fixed-shape decode step for one sequence in two launches (:func:`compress_decode`).

The fixed-shape decode step (:func:`moetier.models.deepseek_v4_static_decode._compress_step`) pools each
compressor's open window every step, masked to its rows so far, and writes the entry only where the window
closes, so that the device decides everything from the position. In torch that is ~25 tiny kernels a
compressor (the row copy, the masks, the bias, the overlap's concatenations and predecessor update, the softmax
and its transposes, the weighted sum, the norm's ~6, the rotation's 4, the masked write's 3), and a CSA layer has
two compressors (its own and the indexer's). Here two launches do a sequence's whole step: the first stores the row
at ``p % rate`` and pools the window, its programs splitting the channels (the softmax runs over rows per channel:
three passes, max, sum of exponentials, weighted sum; HCA's 128-row window is 16 programs of 32 channels, each
reading its columns once a pass), and makes a closing CSA window's first half the next one's predecessor (each
program its own channels, after it read them); the second norms the pooled row (weighted RMS), rotates its
trailing channels at the entry's position and stores the entry where the window closes.

Roundings are the torch ops' (:func:`compress_decode_reference`): the softmax in float32, its weights and each
``kv * weight`` rounded to the kv dtype, their sum taken in float32 and rounded once, the norm as
:func:`moetier.kernels.rmsnorm.rms_norm_reference` and the rotation as
:func:`moetier.kernels.rope_rotate.rotate_reference`; only the order of the sums differs. fp8 entries are
quantised by :meth:`KVRows.write_where` after the kernel (a few torch ops). Used on CUDA when Triton is importable
(``MOETIER_TRITON=0`` turns it off); everywhere else, for inputs it does not take, or after the kernel once failed,
the torch ops run. The softmax's ``exp`` is CUDA's ``expf`` (libdevice), as torch's; Triton's interpreter runs the
kernel in the CPU tests with numpy's and its own bf16 truncation (the tests give it round-to-nearest).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import rms_norm_reference, triton_usable
from moetier.kernels.rope_rotate import rotate_reference

if TYPE_CHECKING:
    from moetier.models.cache import KVRows

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# The most channels one program holds (a row of ``dim`` float32 values per tensor), and the most elements of a
# block of window rows (``rows x dim``: 16 values a thread of 8 warps): rate 128 is read in blocks, not at once.
MAX_DIM = 1024
BLOCK_ELEMENTS = 4096

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# Set once when the kernel fails, so serving carries on with the torch ops.
_BROKEN: list[str] = []


@dataclass(frozen=True)
class CompressorStep:
    """One sequence's compressor step (:func:`compress_decode`): its state's tensors (``open_rows``, ``[rate,
    2 * width]``; CSA's predecessor ``prev_kv``/``prev_gate``, ``[1, rate, dim]``, else None; ``entries``), the
    compressor's parameters (``ape`` ``[rate, width]``, the norm's ``norm_weight`` and ``eps``, ``overlap``, ``rate``,
    ``width``, ``dim``), this step's projections ``row`` (``[1, 2 * width]``: kv then gate channels) and
    ``position`` (int64 ``[1]`` on the device), and the entries' rotation ``table`` (float32 ``[rows, 3, R]``,
    row ``w``: cos, sin, sin_inverse at position ``w * rate``; at least the entries' capacity rows)."""

    open_rows: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None
    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    row: torch.Tensor
    position: torch.Tensor
    table: torch.Tensor
    entries: KVRows
    overlap: bool
    rate: int
    width: int
    dim: int

    def parts(self) -> tuple:
        """The fields in their order (no copies: ``dataclasses.astuple`` would deep-copy the tensors)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def compress_decode_reference(step: CompressorStep) -> None:
    """One sequence's compressor step in torch ops (the fixed-shape step's, see :func:`compress_decode`)."""
    open_rows, prev_kv, prev_gate, ape, norm_weight, eps, row, position, table, entries, overlap, rate, width, dim = (
        step.parts()
    )
    slot = position % rate
    open_rows.index_copy_(0, slot, row.reshape(1, -1))
    capacity = entries.capacity
    if capacity == 0:  # a sequence shorter than one window: no entry will close
        return
    empty = (torch.arange(rate, device=position.device) > slot)[:, None]
    kv = open_rows[:, :width].masked_fill(empty, 0)
    gate = (open_rows[:, width:] + ape.float()).masked_fill(empty, float("-inf"))
    closing = slot == rate - 1
    if overlap:  # the previous window's first half, then this one's second half
        pooled_kv = torch.cat([prev_kv[0], kv[:, dim:]])
        pooled_gate = torch.cat([prev_gate[0], gate[:, dim:]])
        prev_kv.copy_(torch.where(closing, kv[None, :, :dim], prev_kv))  # after the reads: the next predecessor
        prev_gate.copy_(torch.where(closing, gate[None, :, :dim], prev_gate))
        kv, gate = pooled_kv, pooled_gate
    weights = torch.softmax(gate.t(), dim=-1).t().to(kv.dtype)  # over the rows, per channel
    pooled = rms_norm_reference((kv * weights).sum(dim=0, keepdim=True), norm_weight, eps)
    at = (position // rate).clamp(max=capacity - 1)  # past the last entry only while not closing
    rotation = table.index_select(0, at)
    rotate_reference(pooled, rotation[:, 0], rotation[:, 1])
    entries.write_where(at, pooled, closing)


if triton is not None:

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        """``exp`` in float32: CUDA's ``expf`` (libdevice, as torch's softmax) when compiled; ``tl.exp`` (``ex2.approx``
        on CUDA) where libdevice is missing (Triton's interpreter)."""
        return libdevice.exp(x) if LIBDEVICE else tl.exp(x)

    @triton.jit
    def _open_rows(open, row, r, at, slot, stride_open, keep):
        """Open rows ``r`` at channel offsets ``at``: the step's own row (``r == slot``) from ``row`` itself, as the
        row store into ``open`` by another program may not have landed yet."""
        stored = tl.load(open + r * stride_open + at, mask=keep & (r != slot), other=0.0)
        fresh = tl.load(row + at + r * 0, mask=keep & (r == slot), other=0.0)
        return tl.where(r == slot, fresh, stored)

    @triton.jit
    def _window_rows(
        open, row, ape, prev_kv, prev_gate, r, c, slot, stride_open, stride_ape, stride_prev_kv, stride_prev_gate,
        RATE: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr,
    ):  # fmt: skip
        """Rows ``r`` (``[ROWS, 1]``) of the pooled window, channels ``c`` (``[1, CB]``): kv (its dtype) and the
        biased gate (float32); an empty row (past the slot, or past the window) is kv 0 and gate -inf."""
        if OVERLAP:  # rows 0 .. RATE - 1 are the predecessor's, then the own rows' second halves
            before = r < RATE
            own = r - RATE
            keep = (own >= 0) & (own <= slot)
            kv = tl.load(prev_kv + r * stride_prev_kv + c, mask=before, other=0.0)
            gate = tl.load(prev_gate + r * stride_prev_gate + c, mask=before, other=float("-inf"))
            kv = tl.where(before, kv, _open_rows(open, row, own, DIM + c, slot, stride_open, keep))
            bias = tl.load(ape + own * stride_ape + DIM + c, mask=keep, other=0.0).to(tl.float32)
            biased = _open_rows(open, row, own, WIDTH + DIM + c, slot, stride_open, keep).to(tl.float32) + bias
            gate = tl.where(before, gate, tl.where(keep, biased, float("-inf")))
        else:
            keep = r <= slot
            kv = _open_rows(open, row, r, c, slot, stride_open, keep)
            bias = tl.load(ape + r * stride_ape + c, mask=keep, other=0.0).to(tl.float32)
            biased = _open_rows(open, row, r, WIDTH + c, slot, stride_open, keep).to(tl.float32) + bias
            gate = tl.where(keep, biased, float("-inf"))
        return kv, gate

    @triton.jit
    def _pool_kernel(
        open, row, prev_kv, prev_gate, ape, position, pooled,
        stride_open, stride_ape, stride_prev_kv, stride_prev_gate,
        RATE: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr, POOL: tl.constexpr,
        WINDOW: tl.constexpr, ROWS: tl.constexpr, CB: tl.constexpr, ROW_BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        # Channels ``CB`` a program: the softmax runs over rows per channel, so a long window (HCA's 128 rows)
        # splits over programs by channels, each reading its columns once a pass (one program over all channels
        # looped over blocks of rows, ~50 serial reads a step at rate 128).
        p = tl.load(position)
        slot = p % RATE
        block = tl.program_id(0)
        if block == 0:  # the step's row into the open window (the other programs read it from ``row``)
            k = tl.arange(0, ROW_BLOCK)
            fill = k < 2 * WIDTH
            tl.store(open + slot * stride_open + k, tl.load(row + k, mask=fill), mask=fill)
        if POOL:
            dtype = open.dtype.element_ty
            i = tl.arange(0, ROWS)[:, None]
            c = block * CB + tl.arange(0, CB)[None, :]
            top = tl.full((CB,), float("-inf"), tl.float32)
            for first in range(0, WINDOW, ROWS):
                _, gate = _window_rows(
                    open, row, ape, prev_kv, prev_gate, first + i, c, slot, stride_open, stride_ape, stride_prev_kv,
                    stride_prev_gate, RATE, WIDTH, DIM, OVERLAP,
                )  # fmt: skip
                top = tl.maximum(top, tl.max(gate, axis=0))
            total = tl.zeros((CB,), tl.float32)
            for first in range(0, WINDOW, ROWS):
                _, gate = _window_rows(
                    open, row, ape, prev_kv, prev_gate, first + i, c, slot, stride_open, stride_ape, stride_prev_kv,
                    stride_prev_gate, RATE, WIDTH, DIM, OVERLAP,
                )  # fmt: skip
                total += tl.sum(_exp(gate - top[None, :], LIBDEVICE), axis=0)
            acc = tl.zeros((CB,), tl.float32)
            for first in range(0, WINDOW, ROWS):
                kv, gate = _window_rows(
                    open, row, ape, prev_kv, prev_gate, first + i, c, slot, stride_open, stride_ape, stride_prev_kv,
                    stride_prev_gate, RATE, WIDTH, DIM, OVERLAP,
                )  # fmt: skip
                w = tl.div_rn(_exp(gate - top[None, :], LIBDEVICE), tl.broadcast_to(total[None, :], (ROWS, CB)))
                w = w.to(dtype).to(tl.float32)  # the weights in the kv dtype, as the reference rounds them
                acc += tl.sum((kv.to(tl.float32) * w).to(dtype).to(tl.float32), axis=0)
            tl.store(pooled + block * CB + tl.arange(0, CB), acc.to(dtype))
            if OVERLAP:  # a closing window's first half becomes the next one's predecessor, after it was read
                tl.debug_barrier()  # this program's channels of the predecessor only: no other program reads them
                closing = slot == RATE - 1
                for first in range(0, RATE, ROWS):
                    r = first + i
                    keep = (r < RATE) & closing
                    kv = _open_rows(open, row, r, c, slot, stride_open, keep)
                    bias = tl.load(ape + r * stride_ape + c, mask=keep).to(tl.float32)
                    biased = _open_rows(open, row, r, WIDTH + c, slot, stride_open, keep).to(tl.float32) + bias
                    tl.store(prev_kv + r * stride_prev_kv + c, kv, mask=keep)
                    tl.store(prev_gate + r * stride_prev_gate + c, biased, mask=keep)

    @triton.jit
    def _finish_kernel(
        pooled, weight, position, table, entries, out, at_out, closing_out, stride_table, stride_part, stride_entries,
        capacity, eps, RATE: tl.constexpr, DIM: tl.constexpr, R: tl.constexpr, STORE: tl.constexpr,
    ):  # fmt: skip
        p = tl.load(position)
        closing = p % RATE == RATE - 1
        dtype = pooled.dtype.element_ty
        j = tl.arange(0, DIM)
        # The weighted RMS norm of the rounded sum, as the norm kernel computes it.
        x = tl.load(pooled + j).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DIM + eps)
        normed = (x * scale).to(dtype).to(tl.float32)
        y = (tl.load(weight + j).to(tl.float32) * normed).to(dtype)
        # The trailing R channels rotated at the entry's position, as the rotation kernel does.
        tl.store(out + j, y)
        tl.debug_barrier()
        at = tl.minimum(p // RATE, capacity - 1)
        rope = j >= DIM - R
        angle = table + at * stride_table + j - (DIM - R)
        pair = tl.load(out + (j ^ 1), mask=rope).to(tl.float32)  # the other channel of the pair
        cos = tl.load(angle, mask=rope)
        sin = tl.load(angle + stride_part, mask=rope)
        y = tl.where(rope, tl.fma(pair, sin, y.to(tl.float32) * cos).to(dtype), y)
        if STORE:  # the entry row, only where the window closes
            tl.store(entries + at * stride_entries + j, y.to(entries.dtype.element_ty), mask=(j < DIM) & closing)
        else:  # the row, its index and whether it closes, for the caller's write
            tl.debug_barrier()
            tl.store(out + j, y)
            tl.store(at_out, at)
            tl.store(closing_out, closing.to(tl.uint8))


def pool_blocks(rate: int, dim: int, overlap: bool) -> tuple[int, int, int]:
    """The pool kernel's blocks: the rows pooled (CSA: ``2 * rate``), the rows a program reads at once and the
    channels a program takes (powers of two, a block at most :data:`BLOCK_ELEMENTS` values)."""
    window = 2 * rate if overlap else rate
    rows = min(triton.next_power_of_2(window), max(1, BLOCK_ELEMENTS // 2))
    return window, rows, max(2, min(dim, BLOCK_ELEMENTS // rows))  # dim is a power of two: so are the channels


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like ``x`` (Triton on its device, and the kernel never failed)."""
    return triton_usable(x) and not _BROKEN


def _fits(step: CompressorStep) -> bool:
    """Whether the kernel takes these inputs (shapes and dtypes as the model's, unit strides on the channels,
    ``dim`` and the rotated width powers of two); anything else runs :func:`compress_decode_reference`."""
    open_rows, prev_kv, prev_gate, ape, norm_weight, eps, row, position, table, entries, overlap, rate, width, dim = (
        step.parts()
    )
    from moetier.models.cache import KVRows  # here: the models import the kernels

    device, dtype, rope = open_rows.device, open_rows.dtype, table.shape[-1] if table.dim() == 3 else 0
    plain = entries.scales is None
    data = entries.data
    parts = [open_rows, row, ape, norm_weight, position, table, data]
    if overlap:
        if prev_kv is None or prev_gate is None:
            return False
        parts += [prev_kv, prev_gate]
        if not (
            prev_kv.shape == prev_gate.shape == (1, rate, dim)
            and prev_kv.dtype == dtype and prev_gate.dtype == torch.float32
        ):  # fmt: skip
            return False
    return (
        type(entries) is KVRows
        and all(t.device == device and t.stride(-1) == 1 for t in parts)
        and dtype in _FLOATS and row.dtype == dtype and ape.dtype in _FLOATS and norm_weight.dtype in _FLOATS
        and 2 <= dim <= MAX_DIM and dim & (dim - 1) == 0 and width == (2 * dim if overlap else dim) and rate >= 1
        and open_rows.shape == (rate, 2 * width) and row.numel() == 2 * width and row.dim() in (1, 2)
        and ape.shape == (rate, width) and norm_weight.shape == (dim,)
        and position.dtype == torch.int64 and position.numel() == 1
        and table.dtype == torch.float32 and table.dim() == 3 and table.shape[1] >= 2
        and table.shape[0] >= entries.capacity and 2 <= rope <= dim and rope & (rope - 1) == 0
        and data.dim() == 2 and data.shape[-1] == dim and (not plain or data.dtype in _FLOATS)
    )  # fmt: skip


def compress_decode_triton(step: CompressorStep) -> None:
    """The kernel (the caller checked :func:`_fits`); fp8 entries are written by :meth:`KVRows.write_where` after."""
    open_rows, prev_kv, prev_gate, ape, norm_weight, eps, row, position, table, entries, overlap, rate, width, dim = (
        step.parts()
    )
    capacity, data, device = entries.capacity, entries.data, open_rows.device
    store = entries.scales is None  # plain entries: the kernel writes the entry; fp8: write_where after
    out = torch.empty(dim, dtype=open_rows.dtype, device=device)  # the rotation's scratch, then fp8's row
    at = closing = flags = out  # the entry's index and whether it closes: fp8 entries only
    if not store:
        at = torch.empty(1, dtype=torch.int64, device=device)
        closing = torch.empty(1, dtype=torch.bool, device=device)
        flags = closing.view(torch.uint8)
    prev_kv = open_rows if prev_kv is None else prev_kv[0]
    prev_gate = open_rows if prev_gate is None else prev_gate[0]
    window, rows, channels = pool_blocks(rate, dim, overlap)
    raw = torch.empty(dim, dtype=open_rows.dtype, device=device)  # the pooled sum, before the norm
    _pool_kernel[(dim // channels if capacity > 0 else 1,)](
        open_rows, row, prev_kv, prev_gate, ape, position, raw,
        open_rows.stride(0), ape.stride(0), prev_kv.stride(0), prev_gate.stride(0),
        RATE=rate, WIDTH=width, DIM=dim, OVERLAP=overlap, POOL=capacity > 0, WINDOW=window, ROWS=rows, CB=channels,
        ROW_BLOCK=triton.next_power_of_2(2 * width), LIBDEVICE=open_rows.is_cuda, num_warps=4,
    )  # fmt: skip
    if capacity > 0:
        _finish_kernel[(1,)](
            raw, norm_weight, position, table, data, out, at, flags, table.stride(0), table.stride(1), data.stride(0),
            capacity, eps, RATE=rate, DIM=dim, R=table.shape[-1], STORE=store, num_warps=4 if dim <= 256 else 8,
        )  # fmt: skip
    if not store and capacity > 0:
        entries.write_where(at, out[None], closing)


def compress_decode(step: CompressorStep) -> None:
    """One sequence's compressor step at ``position`` (int64 ``[1]`` on the device, ``p``), decided on the device
    (no host sync; the same launches every step, so a CUDA graph replays it):

    ``row`` (``[1, 2 * width]``: kv then gate channels) is stored as open row ``p % rate``; with entries, the
    open window's rows so far (CSA: after the predecessor ``prev_kv``/``prev_gate``, the own rows' second
    halves) are pooled (softmax of the gate plus ``ape`` over the rows, per channel), normed (``norm_weight``,
    ``eps``), the trailing channels rotated by ``table`` row ``min(p // rate, capacity - 1)`` (cos, sin), and
    written there where the window closes (``p % rate == rate - 1``), where a CSA window's first half also
    becomes the predecessor. In one kernel where Triton runs and the inputs fit, else in torch ops
    (:func:`compress_decode_reference`)."""
    kernel_or_reference(
        _BROKEN, "V4 compressor kernel", triton_usable(step.open_rows) and _fits(step),
        lambda: compress_decode_triton(step), lambda: compress_decode_reference(step),
    )  # fmt: skip
