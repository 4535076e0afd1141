"""Every routed expert of a decode call in three kernel launches, wherever each expert's block lives.

Eager, one expert costs ~12 small ops (gather its tokens, gate/up GEMM, split, clamps, SiLU, product,
down GEMM, casts, gate scaling, scatter-add); a decode step of DeepSeek-V4-Flash runs six or more
experts per layer, so the step is bound by their launches, not by reading the weights. Here the
experts are described by a small table (each expert block's byte offset from one base pointer, and
the run of expert-sorted pairs it serves), so one launch computes every expert's gate/up projection
and activation, a second every (token, expert) pair's down projection scaled by its routing weight,
and a third adds each token's pairs, in a fixed order, into the float32 accumulator. Every loop has a
trip count fixed per model, so each kernel compiles once (Triton compiles per constant: a count that
varied per call would compile mid-decode). The blocks may be anywhere in device memory (resident store,
cache slots, staging slots).

Roundings follow :func:`moetier.tiers.experts.swiglu_expert` in the weights' dtype: gate and up are
rounded to it after their float32 dot products, as are SiLU(gate), the activation and the expert's
output before the gate scaling; only the order of the float32 sums differs from cuBLAS. Groups of
more than ``MAX_GROUP_TOKENS`` tokens (prefill's busy experts) keep the per-expert GEMMs
(:mod:`moetier.kernels.per_expert`), which use the tensor cores better; the choice is made per group, so a
group computes the same in every placement.
Used on CUDA when Triton is importable (``MOETIER_TRITON=0`` turns it off); after one failure the
per-expert path runs from then on.

Expert blocks may be dense (the activations' dtype: gate/up on the tensor cores), fp8-block (e4m3
values and float32 tile scales) or fp4-block (packed e2m1 nibbles, low nibble first, and float32 tile
scales). Quantised gate/up run as matrix-vector products per token (``_gate_up_quant_kernel``): at
decode a group has a token or a few, and dequantising the weights is the work. Weights are dequantised
exactly as the loader does; with power-of-two scales (ue8m0, ``ExpertQuant.pow2_scales``) the fp4
kernels scale each 32-value sum instead, the same number for less work (:mod:`moetier.kernels.expert_tiles`).
``MOETIER_FP4_GROUPED=0`` (read per call) sends fp4 experts to the per-expert path instead; the fp4 kernels'
block sizes are :class:`Fp4Blocks` (a bench may sweep them: :func:`fp4_blocks`).
The host side runs per MoE layer of every step, so it is kept to list work and one pinned table copy.
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetier.kernels import fat_experts
from moetier.kernels.fp4_blocks import (  # noqa: F401 - re-exported: the bench sweeps through this module
    FP4_BLOCK_H,
    FP4_BLOCK_K,
    FP4_BLOCK_N,
    HOST_READ_FP4_BLOCKS,
    Fp4Blocks,
    current_fp4_blocks,
    fp4_blocks,
    set_fp4_blocks,
)
from moetier.kernels.per_expert import (  # noqa: F401 - expert_batches_enabled: re-exported (copy_path)
    Group,
    expert_batches_enabled,
    run_per_expert,
)
from moetier.kernels.rmsnorm import triton_usable
from moetier.tiers.experts import ExpertWeights, swiglu_expert  # noqa: F401 - the tests' reference, re-exported

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the per-expert path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_GROUP_TOKENS = 16  # the token tile of the gate/up kernel; tl.dot needs at least 16 rows
_BLOCK_I, _BLOCK_H, _BLOCK_K, _SUM_BLOCK = 32, 32, 128, 1024
# Quantised gate/up: rows per program (fp8). fp4: rows per gate/up program, output channels per down program,
# and the column step (32 scale units of 32 values: 512 bytes and 128 bytes of scales a row). Measured on the H200
# against (16, 32, 256), the same rows and step as fp8's (`results/h200-20261201-f31864b`, one process): the kernels
# read pinned host blocks at 41 GB/s, not 31 (the mapped route), and a 1-token call from VRAM took 387 us, not 479
# (VRAM timings of that probe vary up to 1.7x between hosts; the host reads repeated at 41-42 GB/s).
_QUANT_BLOCK_N = 16
_FP4_BLOCK_N, _FP4_BLOCK_H, _FP4_BLOCK_K = FP4_BLOCK_N, FP4_BLOCK_H, FP4_BLOCK_K  # the defaults, as before
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:
    from moetier.kernels.expert_tiles import (
        activation,
        block_offset,
        dense_tile,
        even_odd,
        fp4_row_dot,
        fp8_row_dot,
        units,
    )

    @triton.jit
    def _gate_up_kernel(
        x_ptr,
        table_ptr,
        blocks_ptr,
        pair_token_ptr,
        act_ptr,
        stride_x,
        limit,
        hidden: tl.constexpr,
        inter: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GATE: tl.constexpr,
        UP: tl.constexpr,
        ALIGN: tl.constexpr,
        rows_ptr,
        ROWS: tl.constexpr,
    ):
        # Dense blocks, one program per (group, block of intermediate channels), for all of the group's tokens
        # at once on the tensor cores. GATE/UP are the element offsets of the two matrices in a block. With ROWS,
        # rows_ptr holds each pair's intermediate rows this call computes (a split expert's first ones; groups are
        # single pairs then): the rest is left unread.
        group, block = tl.program_id(0), tl.program_id(1)
        dtype = x_ptr.dtype.element_ty
        weights = blocks_ptr + block_offset(table_ptr + 3 * group, ALIGN)
        start = tl.load(table_ptr + 3 * group + 1)
        count = tl.load(table_ptr + 3 * group + 2)
        if count > 0:  # a pair the call leaves to another tier (device_routing's skip): read nothing
            t = tl.arange(0, BLOCK_T)
            t_ok = t < count
            rows = tl.load(pair_token_ptr + start + t, mask=t_ok, other=0)
            i = block * BLOCK_I + tl.arange(0, BLOCK_I)
            i_ok = i < inter
            if ROWS:
                i_ok = i_ok & (i < tl.load(rows_ptr + start))
            acc_gate = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < hidden
                x = tl.load(
                    x_ptr + rows[:, None] * stride_x + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0
                )
                w_mask = i_ok[:, None] & k_ok[None, :]
                w_gate = dense_tile(weights, GATE, i, k, w_mask, hidden, dtype)
                w_up = dense_tile(weights, UP, i, k, w_mask, hidden, dtype)
                if IEEE:  # float32 (or bf16 under the interpreter, whose bf16 dot is wrong): exact products
                    x = x.to(tl.float32)
                    acc_gate += tl.dot(x, tl.trans(w_gate.to(tl.float32)), input_precision="ieee")
                    acc_up += tl.dot(x, tl.trans(w_up.to(tl.float32)), input_precision="ieee")
                else:
                    acc_gate += tl.dot(x, tl.trans(w_gate))
                    acc_up += tl.dot(x, tl.trans(w_up))
            act = activation(acc_gate, acc_up, limit, dtype, HAS_LIMIT)
            tl.store(act_ptr + (start + t)[:, None] * inter + i[None, :], act, mask=t_ok[:, None] & i_ok[None, :])

    @triton.jit
    def _gate_up_row(
        x_ptr,
        pair_token_ptr,
        act_ptr,
        stride_x,
        limit,
        weights,
        pair,
        n,
        n_ok,
        hidden: tl.constexpr,
        inter: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        BLOCK_K: tl.constexpr,
        QUANT: tl.constexpr,
        GATE: tl.constexpr,
        UP: tl.constexpr,
        GATE_SCALE: tl.constexpr,
        UP_SCALE: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        UNIT: tl.constexpr,
        POW2: tl.constexpr,
    ):
        """One pair's activations ``act[pair, n]`` from a quantised block (see _gate_up_quant_kernel)."""
        dtype = x_ptr.dtype.element_ty
        x_row = x_ptr + tl.load(pair_token_ptr + pair) * stride_x
        acc_gate = tl.zeros(n.shape, dtype=tl.float32)
        acc_up = tl.zeros(n.shape, dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if QUANT >= 2:
                x_even, x_odd = even_odd(x_row, k0, hidden, UNIT, BLOCK_K // UNIT, hidden)
                acc_gate += fp4_row_dot(weights, GATE, GATE_SCALE, n, n_ok, k0, x_even, x_odd, hidden, dtype,
                                         TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, POW2, QUANT == 3, hidden)  # fmt: skip
                acc_up += fp4_row_dot(weights, UP, UP_SCALE, n, n_ok, k0, x_even, x_odd, hidden, dtype,
                                       TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, POW2, QUANT == 3, hidden)  # fmt: skip
            else:
                x = units(x_row, k0, hidden, UNIT, BLOCK_K // UNIT, hidden)
                acc_gate += fp8_row_dot(weights, GATE, GATE_SCALE, n, n_ok, k0, x, hidden, dtype,
                                        TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, hidden)  # fmt: skip
                acc_up += fp8_row_dot(weights, UP, UP_SCALE, n, n_ok, k0, x, hidden, dtype,
                                      TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, hidden)  # fmt: skip
        act = activation(acc_gate, acc_up, limit, dtype, HAS_LIMIT)
        tl.store(act_ptr + pair * inter + n, act, mask=n_ok)

    @triton.jit
    def _gate_up_quant_kernel(
        x_ptr,
        table_ptr,
        blocks_ptr,
        pair_token_ptr,
        act_ptr,
        stride_x,
        limit,
        hidden: tl.constexpr,
        inter: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        QUANT: tl.constexpr,
        GATE: tl.constexpr,
        UP: tl.constexpr,
        GATE_SCALE: tl.constexpr,
        UP_SCALE: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        UNIT: tl.constexpr,
        POW2: tl.constexpr,
        ALIGN: tl.constexpr,
        MAX_TOKENS: tl.constexpr,
        rows_ptr,
        ROWS: tl.constexpr,
    ):
        # Quantised blocks, one program per (group, block of intermediate channels), a matrix-vector product
        # per token of the group: decode rows carry one token or a few, so the weights' dequantisation, not
        # the multiply, is the work, and tensor cores would need the dequantised tile moved into their layout.
        group, block = tl.program_id(0), tl.program_id(1)
        weights = blocks_ptr + block_offset(table_ptr + 3 * group, ALIGN)
        start = tl.load(table_ptr + 3 * group + 1)
        count = tl.load(table_ptr + 3 * group + 2)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        if ROWS:  # a split expert's first rows only (see _gate_up_kernel)
            n_ok = n_ok & (n < tl.load(rows_ptr + start))
        for t in range(MAX_TOKENS):  # a fixed trip count: one compiled kernel whatever the group sizes
            if t < count:
                _gate_up_row(x_ptr, pair_token_ptr, act_ptr, stride_x, limit, weights, start + t, n, n_ok,
                             hidden, inter, HAS_LIMIT, BLOCK_K, QUANT, GATE, UP, GATE_SCALE, UP_SCALE,
                             TILE_R, TILE_C, UNIT, POW2)  # fmt: skip

    @triton.jit
    def _down_kernel(
        act_ptr,
        table_ptr,
        blocks_ptr,
        pair_gate_ptr,
        y_ptr,
        hidden: tl.constexpr,
        inter: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        QUANT: tl.constexpr,
        DOWN: tl.constexpr,
        DOWN_SCALE: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        UNIT: tl.constexpr,
        POW2: tl.constexpr,
        ALIGN: tl.constexpr,
        rows_ptr,
        ROWS: tl.constexpr,
    ):
        # One program per (pair of this call, block of output channels): y = round(down @ act) * gate. With ROWS,
        # only the columns below the pair's rows in rows_ptr (a split expert's first ones, see _gate_up_kernel).
        row, block = tl.program_id(0), tl.program_id(1)
        dtype = act_ptr.dtype.element_ty
        pair = tl.load(table_ptr + 2 * row)
        if pair >= 0:  # -1: a pair left to another tier; its row is never summed
            weights = blocks_ptr + block_offset(table_ptr + 2 * row + 1, ALIGN)
            h = block * BLOCK_H + tl.arange(0, BLOCK_H)
            h_ok = h < hidden
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            upto = inter
            if ROWS:
                upto = tl.load(rows_ptr + pair)
            for k0 in range(0, inter, BLOCK_K):
                if QUANT >= 2:
                    a_even, a_odd = even_odd(act_ptr + pair * inter, k0, inter, UNIT, BLOCK_K // UNIT, upto)
                    acc += fp4_row_dot(weights, DOWN, DOWN_SCALE, h, h_ok, k0, a_even, a_odd, inter, dtype,
                                        TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, POW2, QUANT == 3, upto)  # fmt: skip
                elif QUANT == 1:
                    a = units(act_ptr + pair * inter, k0, inter, UNIT, BLOCK_K // UNIT, upto)
                    acc += fp8_row_dot(weights, DOWN, DOWN_SCALE, h, h_ok, k0, a, inter, dtype,
                                       TILE_R, TILE_C, UNIT, BLOCK_K // UNIT, upto)  # fmt: skip
                else:
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < upto  # at most inter
                    a = tl.load(act_ptr + pair * inter + k, mask=k_ok, other=0.0).to(tl.float32)
                    w = dense_tile(weights, DOWN, h, k, h_ok[:, None] & k_ok[None, :], inter, dtype)
                    acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            gate = tl.load(pair_gate_ptr + pair).to(dtype).to(tl.float32)
            tl.store(y_ptr + row * hidden + h, acc.to(dtype).to(tl.float32) * gate, mask=h_ok)

    @triton.jit
    def _sum_kernel(y_ptr, table_ptr, out_ptr, hidden: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per (touched token, block of channels) owns those outputs: the token's expert outputs
        # are added in the call's pair order, with no atomics, so the sum is deterministic. A table row is
        # the token then its PER_TOKEN pair rows (-1 padding).
        entry, block = tl.program_id(0), tl.program_id(1)
        token = tl.load(table_ptr + entry * (PER_TOKEN + 1))
        h = block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(PER_TOKEN):
            row = tl.load(table_ptr + entry * (PER_TOKEN + 1) + 1 + j)
            total += tl.load(y_ptr + row * hidden + h, mask=h_ok & (row >= 0), other=0.0)
        cur = tl.load(out_ptr + token * hidden + h, mask=h_ok, other=0.0)
        tl.store(out_ptr + token * hidden + h, cur + total, mask=h_ok)


_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with per-expert GEMMs


def mark_broken(exc: BaseException) -> None:
    """A grouped kernel failed: log it once and send every later call to the per-expert path."""
    _BROKEN.append(str(exc))
    log.warning("grouped expert kernel failed (%s); using per-expert GEMMs from now on", exc)


def grouped_usable(hidden: torch.Tensor, groups: Sequence[Group]) -> bool:
    """Whether :func:`run_experts` would take the grouped path for these (thin) groups."""
    return _grouped_placement(hidden, groups) is not None


def _grouped_placement(hidden: torch.Tensor, groups: Sequence[Group]) -> tuple | None:
    """The kernels' constants (:func:`_placement`) when the grouped path takes these groups, else None.

    Runs per MoE layer of every decode step, so the per-group work is a few attribute reads: every
    block must be on the activations' device and laid out alike (one kernel), and the layout is judged
    once (:func:`_layout_fits`) and its constants cached per layout.
    """
    if _BROKEN or not groups or max(count for _, _, count in groups) > MAX_GROUP_TOKENS:
        return None
    return layout_placement(hidden, groups)


def layout_placement(hidden: torch.Tensor, groups: Sequence[Group]) -> tuple | None:
    """The kernels' constants when Triton runs on ``hidden``'s device and every block is there, laid out alike
    in a format the kernels read; else None (any group size: the thin groups' and the fat groups' kernels)."""
    if not groups or hidden.dtype not in _DTYPES or not triton_usable(hidden):
        return None
    device, key = hidden.device, _layout_key(groups[0][0])
    if any(w.block.device != device or _layout_key(w) != key for w, _, _ in groups):
        return None
    if not _layout_fits(groups[0][0], hidden.dtype):
        return None
    if (placement := _PLACEMENTS.get(key)) is None:
        placement = _PLACEMENTS.setdefault(key, _placement(groups[0][0]))
    return placement


_PLACEMENTS: dict[tuple, tuple] = {}  # layout key -> the kernels' constants


def _layout_key(weights: ExpertWeights) -> tuple:
    """What fixes where a block's matrices lie: its dtype, quantisation, and the down matrix's shape
    (hidden x intermediate, or its packed bytes) — equal keys, equal :func:`_placement`."""
    down = weights.down_q if weights.quantized else weights.down
    return (weights.block.dtype, weights.quant_kind, weights.tile, weights.pow2_scales, weights.e8m0_scales,
            down.shape, down.dtype)  # fmt: skip


def _layout_fits(weights: ExpertWeights, dtype: torch.dtype) -> bool:
    """Dense blocks in the activations' dtype, e4m3 fp8-block ones, or (unless ``MOETIER_FP4_GROUPED=0``)
    packed fp4-block ones whose scale tile the kernels read (:func:`_fp4_unit`)."""
    if weights.quantized:
        if weights.quant_kind == "fp4-block":
            return fp4_grouped_enabled() and weights.down_q.dtype == torch.uint8 and _fp4_unit(weights.tile[1]) > 0
        return weights.quant_kind == "fp8-block" and weights.down_q.dtype == torch.float8_e4m3fn
    return weights.block.dtype == dtype


def _fp4_unit(tile_c: int) -> int:
    """Columns the fp4 kernels read under one scale: 32 when the tile is a multiple of 32 (the release's
    32), else the tile itself; a power of two (``tl.arange``), else 0 (the grouped path does not take it)."""
    unit = 32 if tile_c % 32 == 0 else tile_c
    return unit if unit >= 2 and unit & (unit - 1) == 0 else 0


def _fp8_unit(tile_c: int) -> int:
    """Columns the fp8 kernels read under one scale: the largest power of two dividing the tile, at most
    a column step (``_BLOCK_K``); dense blocks ignore it."""
    return min(tile_c & -tile_c, _BLOCK_K)


def fp4_grouped_enabled() -> bool:
    """Whether fp4-block experts may take the grouped kernels (unless ``MOETIER_FP4_GROUPED=0``, read per call)."""
    return os.environ.get("MOETIER_FP4_GROUPED", "1") != "0"


def _placement(weights: ExpertWeights) -> tuple:
    """The kernels' constants for a block: its ``QUANT`` (0 dense, 1 fp8, 2 fp4, 3 fp4 with e8m0 scale bytes),
    where its matrices lie,
    the tile, whether its scales are all powers of two.

    Dense: element offsets of gate, up and down in ``[gate; up; down]``. Quantised: byte offsets of the
    three float8 (or packed e2m1) matrices and their scale grids (the layout's ``quant_parts``), and the tile.
    """
    if not weights.quantized:
        inter, size = weights.down.shape[1], weights.down.shape[0]
        return (0, 0, inter * size, 2 * inter * size, 0, 0, 0, 1, 1, False)
    block = weights.block.data_ptr()
    offset = lambda view: view.data_ptr() - block  # noqa: E731 - a local shorthand
    views = (weights.gate_q, weights.up_q, weights.down_q, weights.gate_scale, weights.up_scale, weights.down_scale)
    quant = 1 if weights.quant_kind != "fp4-block" else 3 if weights.e8m0_scales else 2
    return (quant, *(offset(v) for v in views), *weights.tile, weights.pow2_scales)


def _table_values(
    groups: Sequence[Group], owner_of_pair: Sequence[int] | dict[int, int], per_token: int
) -> tuple[list[int], LaunchLayout]:
    """The three launch tables as one list of int64 values, and where each part starts.

    Blocks are given as byte offsets from the first group's block (the kernels' ``blocks_ptr``). Per
    group ``(block offset, first pair, pair count)``; per pair of this call ``(pair, block offset)``; per
    token the groups touch, the token and its ``per_token`` rows of the pair list (-1 where it has fewer),
    in the call's pair order. Only touched tokens get a row: a streamed prefill expert serves a few of a
    chunk's thousands of tokens, and the host work must follow its pairs, not the chunk. The layout's
    ``align`` is 16 when every block address is 16-byte aligned, else 1. ``owner_of_pair`` is each sorted
    pair's token.
    """
    base = groups[0][0].block.data_ptr()
    offsets = [w.block.data_ptr() - base for w, _, _ in groups]
    by_group = [v for (_, s, c), offset in zip(groups, offsets, strict=True) for v in (offset, s, c)]
    by_pair: list[int] = []
    by_token: dict[int, list[int]] = {}
    for (_, start, count), offset in zip(groups, offsets, strict=True):
        for pair in range(start, start + count):
            owner = owner_of_pair[pair]
            by_token.setdefault(owner, []).append(len(by_pair) // 2)
            by_pair += (pair, offset)
    width = max(per_token, max((len(rows) for rows in by_token.values()), default=1))
    padded = [v for token, rows in by_token.items() for v in (token, *rows, *[-1] * (width - len(rows)))]
    align = 16 if base % 16 == 0 and all(offset % 16 == 0 for offset in offsets) else 1
    pair_at, token_at = len(by_group), len(by_group) + len(by_pair)
    layout = LaunchLayout(len(groups), pair_at, token_at, len(by_pair) // 2, width, len(by_token), align)
    return by_group + by_pair + padded, layout


def _owners(host: torch.Tensor, groups: Sequence[Group]) -> Sequence[int] | dict[int, int]:
    """Each of the groups' pairs' token, indexed by pair: the whole call's list where the groups hold most of
    its pairs, else only theirs (a streamed prefill expert: reading a chunk's ~49k pairs per expert cost ~0.8 ms,
    145 ms of a 16384-token tiered prefill's host profile on the H100)."""
    pairs = sum(count for _, _, count in groups)
    if host.numel() <= 4 * pairs:
        return host.tolist()
    owners: dict[int, int] = {}
    for _, start, count in groups:
        owners.update(zip(range(start, start + count), host[start : start + count].tolist(), strict=True))
    return owners


def run_grouped(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
    pair_tokens_host: torch.Tensor | None = None,
    per_token: int = 1,
    placement: tuple | None = None,
) -> None:
    """The Triton path of :func:`run_experts` (no checks: see :func:`grouped_usable`); ``placement`` is the
    groups' :func:`_placement` when the caller has it."""
    first = groups[0][0]
    placement = _placement(first) if placement is None else placement
    host = pair_tokens.cpu() if pair_tokens_host is None else pair_tokens_host
    values, layout = _table_values(groups, _owners(host, groups), triton.next_power_of_2(per_token))
    # From an array (torch.tensor of a list converts element by element, ~3x slower); pinned (torch's caching
    # host allocator) so the copy to the device is a true async DMA.
    table = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    table = (table.pin_memory() if torch.cuda.is_available() else table).to(hidden.device, non_blocking=True)
    launch_grouped(out, hidden, pair_tokens, pair_gates, first, placement, swiglu_limit, table, layout)


@dataclass(frozen=True)
class LaunchLayout:
    """Where a launch table's three parts start and how many rows each has (see :func:`_table_values`)."""

    groups: int  # (block offset, first pair, pair count) rows from 0
    pair_at: int  # (pair, block offset) rows from here, ``pairs`` of them
    token_at: int  # (token, ``width`` pair rows) rows from here, ``touched`` of them
    pairs: int
    width: int
    touched: int
    align: int  # 16 when every block address is 16-byte aligned, else 1


def launch_grouped(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    first: ExpertWeights,
    placement: tuple,
    swiglu_limit: float | None,
    table: torch.Tensor,
    layout: LaunchLayout,
    fp4: Fp4Blocks | None = None,
    rows: torch.Tensor | None = None,
) -> None:
    """The three launches over a launch table on the device (its block offsets count from ``first``'s block);
    ``fp4``: the fp4 kernels' block sizes for this call (default: :func:`current_fp4_blocks`); ``rows`` (int64
    ``[pairs]``, a table of single-pair groups only): the intermediate rows each pair computes, from the first (a
    split expert's share; the others' rows read nothing)."""
    # gate is [I, H] (fp4: [I, H/2] bytes), down [H, I]: the intermediate size is gate's rows.
    inter, size = (first.gate_q.shape[0] if first.quantized else first.down.shape[1]), hidden.shape[1]
    quant, gate, up, down, gate_scale, up_scale, down_scale, tile_r, tile_c, pow2 = placement
    align = layout.align
    pair_tokens = pair_tokens.contiguous()
    act = torch.empty((pair_tokens.shape[0], inter), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((layout.pairs, size), dtype=torch.float32, device=hidden.device)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    blocks = first.block.view(torch.uint8)  # the table's offsets count from here
    limits = {"limit": float(swiglu_limit or 0.0), "HAS_LIMIT": swiglu_limit is not None}
    unit = _fp4_unit(tile_c) if quant >= 2 else _fp8_unit(tile_c)
    quantised = {"QUANT": quant, "TILE_R": tile_r, "TILE_C": tile_c, "UNIT": unit, "POW2": pow2, "ALIGN": align}
    fp4 = (fp4 or current_fp4_blocks()) if quant >= 2 else None
    block_k, block_h = (fp4.k, fp4.h) if fp4 else (_BLOCK_K, _BLOCK_H)
    block_n = fp4.n if fp4 else _QUANT_BLOCK_N
    split = {"rows_ptr": table if rows is None else rows, "ROWS": rows is not None}
    if quant == 0:
        _gate_up_kernel[(layout.groups, triton.cdiv(inter, _BLOCK_I))](
            x, table, blocks, pair_tokens, act, x.stride(0), hidden=size, inter=inter, **limits,
            IEEE=hidden.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
            BLOCK_T=MAX_GROUP_TOKENS, BLOCK_I=_BLOCK_I, BLOCK_K=_BLOCK_K, GATE=gate, UP=up, ALIGN=align, **split,
        )  # fmt: skip
    else:
        _gate_up_quant_kernel[(layout.groups, triton.cdiv(inter, block_n))](
            x, table, blocks, pair_tokens, act, x.stride(0), hidden=size, inter=inter, **limits,
            BLOCK_N=block_n, BLOCK_K=block_k, MAX_TOKENS=MAX_GROUP_TOKENS,
            GATE=gate, UP=up, GATE_SCALE=gate_scale, UP_SCALE=up_scale, **quantised, **split,
        )  # fmt: skip
    _down_kernel[(layout.pairs, triton.cdiv(size, block_h))](
        act, table[layout.pair_at:], blocks, pair_gates.contiguous(), y, size, inter, BLOCK_H=block_h,
        BLOCK_K=block_k, DOWN=down, DOWN_SCALE=down_scale, **quantised, **split,
    )  # fmt: skip
    _sum_kernel[(layout.touched, triton.cdiv(size, _SUM_BLOCK))](
        y, table[layout.token_at :], out, size, PER_TOKEN=layout.width, BLOCK_H=_SUM_BLOCK
    )


def run_experts(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
    pair_tokens_host: torch.Tensor | None = None,
    per_token: int = 1,
) -> None:
    """Add ``sum over groups and their pairs p of gate[p] * expert(hidden[token[p]])`` into ``out``.

    ``out`` is the float32 ``[T, H]`` accumulator; ``pair_tokens`` (int64) and ``pair_gates`` index the
    expert-sorted pairs, and each group ``(weights, start, count)`` is one expert and its run of pairs
    (a token appears at most once per group). ``pair_tokens_host`` (the same on the host, when the caller
    has it: saves a device sync) and ``per_token`` (the most pairs a token has, top-k: keeps one compiled
    kernel per model) serve the grouped path: groups of at most ``MAX_GROUP_TOKENS`` tokens run in three
    launches when :func:`grouped_usable`, larger ones (prefill's) in three launches a batch where asked for
    (:mod:`moetier.kernels.fat_experts`, opt-in: not faster so far); the rest (everything off CUDA) per expert.
    """
    # Per group, not per call: a group of a given size takes the same kernel whichever call it is in
    # (a resident prefill, a streamed expert, a decode), so placements agree to the order of fp32 sums.
    thin = [g for g in groups if g[2] <= MAX_GROUP_TOKENS]
    fat = [g for g in groups if g[2] > MAX_GROUP_TOKENS]
    thin_done = fat_done = False
    if (placement := _grouped_placement(hidden, thin)) is not None:
        try:
            args = (out, hidden, pair_tokens, pair_gates, thin, swiglu_limit, pair_tokens_host, per_token, placement)
            run_grouped(*args)
            thin_done = True
        except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
            mark_broken(exc)
    if fat and fat_experts.fat_enabled() and (placement := layout_placement(hidden, fat)) is not None:
        try:
            fat_experts.run_fat(out, hidden, pair_tokens, pair_gates, fat, swiglu_limit, placement, pair_tokens_host)
            fat_done = True
        except Exception as exc:  # noqa: BLE001 - as above
            fat_experts.mark_broken(exc)
    # What neither kernel set took, in call order.
    eager = [g for g in groups if not (fat_done if g[2] > MAX_GROUP_TOKENS else thin_done)]
    run_per_expert(out, hidden, pair_tokens, pair_gates, eager, swiglu_limit)
