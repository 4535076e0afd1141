"""Every routed expert of a decode call in three kernel launches, wherever each expert's block lives.

Eager, one expert costs ~12 small ops (gather its tokens, gate/up GEMM, split, clamps, SiLU, product,
down GEMM, casts, gate scaling, scatter-add); a decode step of DeepSeek-V4-Flash runs six or more
experts per layer, so the step is bound by their launches, not by reading the weights. Here the
experts are described by a small table (each expert block's device address, and the run of
expert-sorted pairs it serves), so one launch computes every expert's gate/up projection and
activation, a second every (token, expert) pair's down projection scaled by its routing weight, and
a third adds each token's pairs, in a fixed order, into the float32 accumulator. Every loop has a
trip count fixed per model, so each kernel compiles once (Triton compiles per constant: a count that
varied per call would compile mid-decode). The blocks may be anywhere in device memory (resident store,
cache slots, staging slots): the kernel reads them through their addresses.

Roundings follow :func:`moetier.tiers.experts.swiglu_expert` in the weights' dtype: gate and up are
rounded to it after their float32 dot products, as are SiLU(gate), the activation and the expert's
output before the gate scaling; only the order of the float32 sums differs from cuBLAS. Groups of
more than ``MAX_GROUP_TOKENS`` tokens (prefill's busy experts) keep the per-expert GEMMs, which use the
tensor cores better; the choice is made per group, so a group computes the same in every placement.
Used on CUDA when Triton is importable (``MOETIER_TRITON=0`` turns it off); after one failure the
per-expert path runs from then on.

Expert blocks may be dense (the activations' dtype), fp8-block (e4m3 values and float32 tile scales) or
fp4-block (packed e2m1 nibbles, low nibble first, and float32 tile scales); quantised weights are
dequantised in the kernel exactly as the loader does. ``MOETIER_FP4_GROUPED=0`` (read per call) sends
fp4 experts to the per-expert path instead (the fp4 path passed its GPU test on an H200 on 2026-12-01).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from moetier.kernels.rmsnorm import triton_usable
from moetier.tiers.experts import ExpertWeights, swiglu_expert

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the per-expert path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_GROUP_TOKENS = 16  # the token tile of the gate/up kernel; tl.dot needs at least 16 rows
_BLOCK_I, _BLOCK_H, _BLOCK_K, _SUM_BLOCK = 32, 32, 128, 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# One (expert block, run of sorted pairs) per group: what the per-expert path loops over.
Group = tuple[ExpertWeights, int, int]  # (weights, first pair, pair count)


if triton is not None:

    @triton.jit
    def _weight_tile(
        block,
        part,
        scales,
        rows,
        cols,
        mask,
        width: tl.constexpr,
        dtype: tl.constexpr,
        QUANT: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
    ):
        """Rows x cols of one matrix of an expert block, in ``dtype``. Dense (``QUANT`` 0): ``part`` is the
        matrix's first element. Quantised: ``part``/``scales`` are byte offsets of its stored values and its
        float32 tile scales, one per ``TILE_R x TILE_C`` tile; ``QUANT`` 1 stores e4m3 values, 2 packed e2m1
        (column ``c`` is byte ``c // 2`` of the row, low nibble when ``c`` is even). Each value is dequantised
        as the loader does, ``(float(v) * scale).to(dtype)``."""
        if QUANT == 0:
            base = block.to(tl.pointer_type(dtype))
            return tl.load(base + part + rows[:, None] * width + cols[None, :], mask=mask, other=0.0)
        else:
            base = block.to(tl.pointer_type(tl.uint8))
            grid = (width + TILE_C - 1) // TILE_C
            scale_at = (rows // TILE_R)[:, None] * grid + (cols // TILE_C)[None, :]
            scale = tl.load((base + scales).to(tl.pointer_type(tl.float32)) + scale_at, mask=mask, other=0.0)
            if QUANT == 1:
                raw = tl.load(base + part + rows[:, None] * width + cols[None, :], mask=mask, other=0)
                value = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                raw = tl.load(base + part + rows[:, None] * (width // 2) + (cols // 2)[None, :], mask=mask, other=0)
                code = tl.where((cols % 2 == 1)[None, :], raw >> 4, raw & 0xF)
                # e2m1: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exponent 0 is subnormal.
                # Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, each exact in float32 (moetier.weights.fp4's table).
                half = (code & 1).to(tl.float32) * 0.5
                exponent = (code >> 1) & 3
                power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
                magnitude = tl.where(exponent == 0, half, (1.0 + half) * power)
                value = tl.where((code & 8) != 0, -magnitude, magnitude)
            return (value * scale).to(dtype)

    @triton.jit
    def _gate_up_kernel(
        x_ptr,
        table_ptr,
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
        QUANT: tl.constexpr,
        GATE: tl.constexpr,
        UP: tl.constexpr,
        GATE_SCALE: tl.constexpr,
        UP_SCALE: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
    ):
        # One program per (group, block of intermediate channels), for all of the group's tokens at once.
        # GATE/UP (and their scales) locate the two matrices in a block: elements dense, bytes quantised.
        group, block = tl.program_id(0), tl.program_id(1)
        dtype = x_ptr.dtype.element_ty
        weights = tl.load(table_ptr + 3 * group)
        start = tl.load(table_ptr + 3 * group + 1)
        count = tl.load(table_ptr + 3 * group + 2)
        t = tl.arange(0, BLOCK_T)
        t_ok = t < count
        rows = tl.load(pair_token_ptr + start + t, mask=t_ok, other=0)
        i = block * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = i < inter
        acc_gate = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = i_ok[:, None] & k_ok[None, :]
            w_gate = _weight_tile(weights, GATE, GATE_SCALE, i, k, w_mask, hidden, dtype, QUANT, TILE_R, TILE_C)
            w_up = _weight_tile(weights, UP, UP_SCALE, i, k, w_mask, hidden, dtype, QUANT, TILE_R, TILE_C)
            if IEEE:  # float32 (or bf16 under the interpreter, whose bf16 dot is wrong): exact products
                x = x.to(tl.float32)
                acc_gate += tl.dot(x, tl.trans(w_gate.to(tl.float32)), input_precision="ieee")
                acc_up += tl.dot(x, tl.trans(w_up.to(tl.float32)), input_precision="ieee")
            else:
                acc_gate += tl.dot(x, tl.trans(w_gate))
                acc_up += tl.dot(x, tl.trans(w_up))
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        act = (silu * up).to(dtype)
        tl.store(act_ptr + (start + t)[:, None] * inter + i[None, :], act, mask=t_ok[:, None] & i_ok[None, :])

    @triton.jit
    def _down_kernel(
        act_ptr,
        table_ptr,
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
    ):
        # One program per (pair of this call, block of output channels): y = round(down @ act) * gate.
        row, block = tl.program_id(0), tl.program_id(1)
        dtype = act_ptr.dtype.element_ty
        pair = tl.load(table_ptr + 2 * row)
        weights = tl.load(table_ptr + 2 * row + 1)
        h = block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(act_ptr + pair * inter + k, mask=k_ok, other=0.0).to(tl.float32)
            w_mask = h_ok[:, None] & k_ok[None, :]
            w = _weight_tile(weights, DOWN, DOWN_SCALE, h, k, w_mask, inter, dtype, QUANT, TILE_R, TILE_C)
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


def grouped_usable(hidden: torch.Tensor, groups: Sequence[Group]) -> bool:
    """Whether :func:`run_experts` would take the grouped path for these (thin) groups."""
    return (
        not _BROKEN
        and bool(groups)
        and triton_usable(hidden)
        and hidden.dtype in _DTYPES
        and all(_block_fits(w, hidden) for w, _, _ in groups)
        and len({_placement(w) for w, _, _ in groups}) == 1  # one kernel: every block laid out alike
        and max(count for _, _, count in groups) <= MAX_GROUP_TOKENS
    )


def _block_fits(weights: ExpertWeights, hidden: torch.Tensor) -> bool:
    """Dense blocks in the activations' dtype, e4m3 fp8-block ones, or (unless ``MOETIER_FP4_GROUPED=0``)
    packed fp4-block ones, on the activations' device."""
    if weights.block.device != hidden.device:
        return False
    if weights.quantized:
        if weights.quant_kind == "fp4-block":
            return fp4_grouped_enabled() and weights.down_q.dtype == torch.uint8
        return weights.quant_kind == "fp8-block" and weights.down_q.dtype == torch.float8_e4m3fn
    return weights.block.dtype == hidden.dtype


def fp4_grouped_enabled() -> bool:
    """Whether fp4-block experts may take the grouped kernels (unless ``MOETIER_FP4_GROUPED=0``, read per call)."""
    return os.environ.get("MOETIER_FP4_GROUPED", "1") != "0"


def _placement(weights: ExpertWeights) -> tuple:
    """The kernels' constants for a block: its ``QUANT`` (0 dense, 1 fp8, 2 fp4), where its matrices lie,
    the tile.

    Dense: element offsets of gate, up and down in ``[gate; up; down]``. Quantised: byte offsets of the
    three float8 (or packed e2m1) matrices and their scale grids (the layout's ``quant_parts``), and the tile.
    """
    if not weights.quantized:
        inter, size = weights.down.shape[1], weights.down.shape[0]
        return (0, 0, inter * size, 2 * inter * size, 0, 0, 0, 1, 1)
    block = weights.block.data_ptr()
    offset = lambda view: view.data_ptr() - block  # noqa: E731 - a local shorthand
    views = (weights.gate_q, weights.up_q, weights.down_q, weights.gate_scale, weights.up_scale, weights.down_scale)
    quant = 2 if weights.quant_kind == "fp4-block" else 1
    return (quant, *(offset(v) for v in views), *weights.tile)


def _tables(groups: Sequence[Group], pair_tokens_host: torch.Tensor, per_token: int) -> tuple:
    """The three launch tables in one int64 tensor (one host-to-device copy) and where each starts.

    Per group ``(block address, first pair, pair count)``; per pair of this call ``(pair, block address)``;
    per token the groups touch, the token and its ``per_token`` rows of the pair list (-1 where it has
    fewer), in the call's pair order. Only touched tokens get a row: a streamed prefill expert serves a
    few of a chunk's thousands of tokens, and the host work must follow its pairs, not the chunk.
    """
    by_group = [v for w, s, c in groups for v in (w.block.data_ptr(), s, c)]
    by_pair: list[int] = []
    by_token: dict[int, list[int]] = {}
    for weights, start, count in groups:
        address = weights.block.data_ptr()
        owners = pair_tokens_host[start : start + count].tolist()
        for pair, owner in zip(range(start, start + count), owners, strict=True):
            by_token.setdefault(owner, []).append(len(by_pair) // 2)
            by_pair += (pair, address)
    width = max(per_token, max((len(rows) for rows in by_token.values()), default=1))
    padded = [v for token, rows in by_token.items() for v in (token, *rows, *[-1] * (width - len(rows)))]
    table = torch.tensor(by_group + by_pair + padded, dtype=torch.int64)
    return table, len(by_group), len(by_group) + len(by_pair), len(by_pair) // 2, width, len(by_token)


def run_grouped(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
    pair_tokens_host: torch.Tensor | None = None,
    per_token: int = 1,
) -> None:
    """The Triton path of :func:`run_experts` (no checks: see :func:`grouped_usable`)."""
    first = groups[0][0]
    # gate is [I, H] (fp4: [I, H/2] bytes), down [H, I]: the intermediate size is gate's rows.
    inter, size = (first.gate_q.shape[0] if first.quantized else first.down.shape[1]), hidden.shape[1]
    quant, gate, up, down, gate_scale, up_scale, down_scale, tile_r, tile_c = _placement(first)
    tile = {"QUANT": quant, "TILE_R": tile_r, "TILE_C": tile_c}
    host = pair_tokens.cpu() if pair_tokens_host is None else pair_tokens_host
    table, pair_at, token_at, pairs, width, touched = _tables(groups, host, triton.next_power_of_2(per_token))
    table = table.to(hidden.device, non_blocking=True)
    pair_tokens = pair_tokens.contiguous()
    act = torch.empty((pair_tokens.shape[0], inter), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((pairs, size), dtype=torch.float32, device=hidden.device)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    _gate_up_kernel[(len(groups), triton.cdiv(inter, _BLOCK_I))](
        x, table, pair_tokens, act, x.stride(0), float(swiglu_limit or 0.0), size, inter,
        HAS_LIMIT=swiglu_limit is not None,
        IEEE=hidden.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_T=MAX_GROUP_TOKENS, BLOCK_I=_BLOCK_I, BLOCK_K=_BLOCK_K,
        GATE=gate, UP=up, GATE_SCALE=gate_scale, UP_SCALE=up_scale, **tile,
    )  # fmt: skip
    _down_kernel[(pairs, triton.cdiv(size, _BLOCK_H))](
        act, table[pair_at:], pair_gates.contiguous(), y, size, inter, BLOCK_H=_BLOCK_H, BLOCK_K=_BLOCK_K,
        DOWN=down, DOWN_SCALE=down_scale, **tile,
    )  # fmt: skip
    _sum_kernel[(touched, triton.cdiv(size, _SUM_BLOCK))](
        y, table[token_at:], out, size, PER_TOKEN=width, BLOCK_H=_SUM_BLOCK
    )


def run_per_expert(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
) -> None:
    """The reference path: :func:`swiglu_expert` per group, scaled and added into ``out`` in group order."""
    for weights, start, count in groups:
        tokens = pair_tokens[start : start + count]
        gates = pair_gates[start : start + count, None]
        y = swiglu_expert(hidden[tokens], weights, swiglu_limit).float() * gates.float()
        out.index_add_(0, tokens, y)


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
    launches when :func:`grouped_usable`, larger ones (and everything off CUDA) per expert.
    """
    # Per group, not per call: a group of a given size takes the same kernel whichever call it is in
    # (a resident prefill, a streamed expert, a decode), so placements agree to the order of fp32 sums.
    thin = [g for g in groups if g[2] <= MAX_GROUP_TOKENS]
    if grouped_usable(hidden, thin):
        try:
            run_grouped(out, hidden, pair_tokens, pair_gates, thin, swiglu_limit, pair_tokens_host, per_token)
            groups = [g for g in groups if g[2] > MAX_GROUP_TOKENS]
        except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
            _BROKEN.append(str(exc))
            log.warning("grouped expert kernel failed (%s); using per-expert GEMMs from now on", exc)
    run_per_expert(out, hidden, pair_tokens, pair_gates, groups, swiglu_limit)
