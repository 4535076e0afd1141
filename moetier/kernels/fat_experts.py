"""Prefill's fat expert groups (more than ``MAX_GROUP_TOKENS`` tokens each) in three kernel launches per batch.

Per expert, the eager path (:func:`moetier.kernels.grouped_experts.run_per_expert`) issues ~15 torch ops, and an
fp4 or fp8 expert three dequantisation kernels more: ~0.4 ms of host time an expert on the H100's host, against
~0.2 ms of device time (`results/h100-20261206-a39ce57-fp4-prefill-dequant`: a 16384-token prefill of the 3-layer
bench model ran 0.28 s of kernels in a 1.45 s window). Prefill was bound by the host in every placement. Here a
batch of groups is described by one int64 table (each group cut into tiles of ``BLOCK_M`` of its tokens) and
computed by three launches whatever its size:

1. ``_gate_up_kernel``: per (tile, block of intermediate channels), the gate and up GEMMs of the tile's tokens on
   the tensor cores, the weights dequantised in the tile loads (fp4 and fp8 blocks are never written out dense),
   then SwiGLU with :func:`swiglu_expert`'s roundings;
2. ``_down_kernel``: per (tile, block of output channels), the down GEMM, rounded to the activations' dtype, times
   each pair's routing weight in float32 (as ``y.float() * gates.float()``);
3. ``_sum_kernel``: per touched token, its rows added one after another into the float32 accumulator in the
   batch's group order: the per-expert path's sequence of ``index_add_`` calls, with no atomics (deterministic).

Roundings are the per-expert path's; only the order of the GEMMs' float32 sums differs from cuBLAS's. Every group
of more than ``MAX_GROUP_TOKENS`` tokens takes this path on a device where it runs, whichever placement computes
it (resident, cache slot, staging slot), so placements agree to the order of fp32 sums. A batch holds at most
``MAX_BATCH_PAIRS`` pairs (its float32 rows are the workspace: 128 MiB at hidden 4096). After one failure the
per-expert path runs from then on.

**Opt-in** (``MOETIER_FAT_EXPERTS=1`` or ``=dense``, read per call). Measured on an H100 (fp4 V4-Flash widths, 3
layers, 8192-token chunks): at first these kernels made prefill ~1.7x slower
(`results/h100-20261207-122fb79-fat-experts-ab`). The fp4 kernels then read the activations' even and odd columns
as two strided loads that were neither vectorised nor pipelined (the code Triton makes for sm_90 with the JIT's
16-byte pointer marks, `tests/test_kernels_compile.py`); they now load the columns once, wide, and split them in
registers. The kernel profile after that (`results/h100-20261207-e150f80-prefill-host-cuts`, a 16384-token sync
prefill) names the cost: with the weights dequantised in the tile loads (``=1``) the gate/up kernel took 274.5 ms
and down 98.5 ms; with each fat expert dequantised once first (``=dense``: ``fp4_dequant``'s one launch an
expert, ~41 us, 40.8 ms in all) the dense kernels took 28.9 + 25.8 ms. ``dense`` against the per-expert path in
that call: sync +15% / +9% at 8192 / 16384 tokens, resident -15% at 8192, tiered -13% / -17% (a streamed expert
is computed alone, and a one-expert batch costs more host work than the eager path). One repeat a figure, so the
per-expert path stays the default. Next: ``dense`` only for calls of many fat groups, and the in-tile decode
once an expert tile rather than once a token tile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from moetier.tiers.experts import ExpertWeights

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the per-expert path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K, SUM_BLOCK = 64, 64, 64, 1024
MAX_BATCH_PAIRS = 8192
MAX_DENSE_GROUPS = 8  # MOETIER_FAT_EXPERTS=dense: experts dequantised at a time (~50 MB each at V4-Flash widths)
_TILE_FIELDS = 4  # (block offset, first pair, tokens, first workspace row)

Group = tuple[ExpertWeights, int, int]  # (weights, first pair, pair count), as in grouped_experts

_BROKEN: list[str] = []

if triton is not None:
    from moetier.kernels.expert_tiles import activation, block_offset, dense_tile, fp4_tiles, fp8_tile

    @triton.jit
    def _dot(acc, a, w, IEEE: tl.constexpr):
        """``acc + a @ w.T`` in float32: exact products for float32 (and under the interpreter, whose bf16 dot is
        wrong)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(w), acc)

    @triton.jit
    def _step(
        acc, rows, rows_ok, weights, part, scale, n, n_ok, k0, width: tl.constexpr, dtype: tl.constexpr,
        QUANT: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """``acc`` plus one ``BLOCK_K`` step from ``k0`` of ``inputs @ matrix.T``: ``rows`` (``[M, 1]`` pointers)
        are the inputs' rows, ``n`` the matrix's rows (output channels), the matrix one part of an expert block of
        any format (``QUANT``: 0 dense, 1 fp8, 2 fp4, 3 fp4 with e8m0 scale bytes), ``width`` its columns."""
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(rows + k[None, :], mask=rows_ok[:, None] & (k < width)[None, :], other=0.0)
        if QUANT >= 2:  # even and odd columns apart (a packed byte holds one of each), split from one wide load
            even, odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))
            low, high = fp4_tiles(weights, part, scale, n, n_ok, k0, width, dtype, TILE_R, TILE_C, BLOCK_K, QUANT == 3)
            return _dot(_dot(acc, even, low, IEEE), odd, high, IEEE)
        if QUANT == 1:
            w = fp8_tile(weights, part, scale, n, n_ok, k0, width, dtype, TILE_R, TILE_C, BLOCK_K)
        else:
            w = dense_tile(weights, part, n, k, n_ok[:, None] & (k < width)[None, :], width, dtype)
        return _dot(acc, a, w, IEEE)

    @triton.jit
    def _tile(table_ptr, blocks_ptr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's tile of the table (see :func:`launch_table`): its expert block, its first pair, its first
        workspace row, and its rows ``m`` with their mask."""
        entry = table_ptr + 4 * tl.program_id(0)
        weights = blocks_ptr + block_offset(entry, ALIGN)
        first, count, row0 = tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
        m = tl.arange(0, BLOCK_M)
        return weights, first, row0, m, m < count

    @triton.jit
    def _gate_up_kernel(
        x_ptr, table_ptr, blocks_ptr, pair_token_ptr, act_ptr, stride_x, limit,
        hidden: tl.constexpr, inter: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr,
        QUANT: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, GATE_SCALE: tl.constexpr, UP_SCALE: tl.constexpr,
        TILE_R: tl.constexpr, TILE_C: tl.constexpr, ALIGN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(1)
        dtype = x_ptr.dtype.element_ty
        weights, first, row0, m, m_ok = _tile(table_ptr, blocks_ptr, ALIGN, BLOCK_M)
        tokens = tl.load(pair_token_ptr + first + m, mask=m_ok, other=0)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rows = x_ptr + tokens[:, None] * stride_x
        for k0 in range(0, hidden, BLOCK_K):
            acc_gate = _step(acc_gate, rows, m_ok, weights, GATE, GATE_SCALE, n, n_ok, k0, hidden, dtype,
                             QUANT, TILE_R, TILE_C, BLOCK_K, IEEE)  # fmt: skip
            acc_up = _step(acc_up, rows, m_ok, weights, UP, UP_SCALE, n, n_ok, k0, hidden, dtype,
                           QUANT, TILE_R, TILE_C, BLOCK_K, IEEE)  # fmt: skip
        act = activation(acc_gate, acc_up, limit, dtype, HAS_LIMIT)
        tl.store(act_ptr + (row0 + m)[:, None] * inter + n[None, :], act, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(
        act_ptr, table_ptr, blocks_ptr, pair_gate_ptr, y_ptr,
        hidden: tl.constexpr, inter: tl.constexpr, IEEE: tl.constexpr,
        QUANT: tl.constexpr, DOWN: tl.constexpr, DOWN_SCALE: tl.constexpr,
        TILE_R: tl.constexpr, TILE_C: tl.constexpr, ALIGN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(1)
        dtype = act_ptr.dtype.element_ty
        weights, first, row0, m, m_ok = _tile(table_ptr, blocks_ptr, ALIGN, BLOCK_M)
        h = block * BLOCK_N + tl.arange(0, BLOCK_N)
        h_ok = h < hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rows = act_ptr + (row0 + m)[:, None] * inter
        for k0 in range(0, inter, BLOCK_K):
            acc = _step(acc, rows, m_ok, weights, DOWN, DOWN_SCALE, h, h_ok, k0, inter, dtype,
                        QUANT, TILE_R, TILE_C, BLOCK_K, IEEE)  # fmt: skip
        gate = tl.load(pair_gate_ptr + first + m, mask=m_ok, other=0.0).to(tl.float32)
        y = acc.to(dtype).to(tl.float32) * gate[:, None]
        tl.store(y_ptr + (row0 + m)[:, None] * hidden + h[None, :], y, mask=m_ok[:, None] & h_ok[None, :])

    @triton.jit
    def _sum_kernel(
        y_ptr, rows_ptr, token_table_ptr, out_ptr, hidden: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # One program per (touched token, block of channels) owns those outputs; the token's rows (in batch order)
        # are added one at a time, as successive index_add_ calls add them. MAX_ROWS (a power of two, at least the
        # most rows a token has in the batch: at most top-k) fixes the trip count, so few variants compile.
        entry, block = tl.program_id(0), tl.program_id(1)
        token = tl.load(token_table_ptr + 3 * entry)
        first, count = tl.load(token_table_ptr + 3 * entry + 1), tl.load(token_table_ptr + 3 * entry + 2)
        h = block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        total = tl.load(out_ptr + token * hidden + h, mask=h_ok, other=0.0)
        for j in range(MAX_ROWS):
            if j < count:
                row = tl.load(rows_ptr + first + j)
                total += tl.load(y_ptr + row * hidden + h, mask=h_ok, other=0.0)
        tl.store(out_ptr + token * hidden + h, total, mask=h_ok)


_SETTINGS = ("0", "1", "dense")
_WARNED: set[str] = set()  # unknown MOETIER_FAT_EXPERTS values already warned about


def fat_enabled() -> bool:
    """Whether fat groups may take these kernels: only with ``MOETIER_FAT_EXPERTS=1`` or ``=dense`` (read per call),
    as they are slower than the per-expert path on the H100 so far (see the module docstring). ``dense``: each
    quantised expert is dequantised once (:meth:`ExpertWeights.dequantized`: one launch an fp4 expert), at most
    ``MAX_DENSE_GROUPS`` at a time, and the dense kernels run: an A/B of the in-tile dequantisation's cost. Any
    other value warns once and leaves them off."""
    setting = os.environ.get("MOETIER_FAT_EXPERTS", "0")
    if setting not in _SETTINGS and setting not in _WARNED:
        _WARNED.add(setting)
        log.warning("MOETIER_FAT_EXPERTS=%r is not one of %s: the fat-group kernels stay off", setting, _SETTINGS)
    return triton is not None and not _BROKEN and setting in ("1", "dense")


def _dense_first(placement: tuple) -> bool:
    return placement[0] != 0 and os.environ.get("MOETIER_FAT_EXPERTS") == "dense"


def mark_broken(exc: BaseException) -> None:
    """A fat-group kernel failed: log it once and send every later call to the per-expert path."""
    _BROKEN.append(str(exc))
    log.warning("fat expert kernels failed (%s); using per-expert GEMMs from now on", exc)


def batches(groups: Sequence[Group], max_pairs: int, max_groups: int | None = None) -> list[list[Group]]:
    """``groups`` in order, cut into runs of at most ``max_pairs`` pairs (a group larger than that alone) and at
    most ``max_groups`` groups."""
    runs: list[list[Group]] = []
    pairs = max_pairs
    for group in groups:
        if not runs or pairs + group[2] > max_pairs or (max_groups is not None and len(runs[-1]) >= max_groups):
            runs.append([])
            pairs = 0
        runs[-1].append(group)
        pairs += group[2]
    return runs


def launch_table(groups: Sequence[Group], owner_of_pair: np.ndarray) -> tuple[np.ndarray, int, int, int, int, int]:
    """One batch's table (int64): its tiles, then its workspace rows sorted by token, then per touched token
    ``(token, first sorted row, rows)``; with the tile count, the batch's pairs, the touched tokens, the most rows
    a token has, and the alignment of every block (16 when all block addresses are 16-byte aligned, else 1).

    A tile is ``(block byte offset from the first group's block, first pair, tokens, first workspace row)``: up to
    ``BLOCK_M`` consecutive pairs of one group; a batch's workspace rows follow its groups' pairs in order.
    ``owner_of_pair`` is each expert-sorted pair's token. Vectorised (numpy): a prefill batch has thousands of pairs.
    """
    base = groups[0][0].block.data_ptr()
    offsets = np.array([w.block.data_ptr() - base for w, _, _ in groups], dtype=np.int64)
    starts = np.array([s for _, s, _ in groups], dtype=np.int64)
    counts = np.array([c for _, _, c in groups], dtype=np.int64)
    row0 = np.cumsum(counts) - counts  # each group's first workspace row
    tiles_of = (counts + BLOCK_M - 1) // BLOCK_M
    group_of_tile = np.repeat(np.arange(len(groups)), tiles_of)
    nth = np.arange(group_of_tile.size) - np.repeat(np.cumsum(tiles_of) - tiles_of, tiles_of)
    tiles = np.stack(
        [
            offsets[group_of_tile],
            starts[group_of_tile] + nth * BLOCK_M,
            np.minimum(BLOCK_M, counts[group_of_tile] - nth * BLOCK_M),
            row0[group_of_tile] + nth * BLOCK_M,
        ],
        axis=1,
    )
    pairs = int(counts.sum())
    pair_of_row = np.repeat(starts - row0, counts) + np.arange(pairs)
    owners = owner_of_pair[pair_of_row]
    by_token = np.argsort(owners, kind="stable")  # a token's rows stay in batch (group) order
    tokens, first, rows = np.unique(owners[by_token], return_index=True, return_counts=True)
    per_token = np.stack([tokens, first, rows], axis=1)
    align = 16 if base % 16 == 0 and not (offsets % 16).any() else 1
    table = np.concatenate([tiles.ravel(), by_token.astype(np.int64), per_token.ravel().astype(np.int64)])
    return table, len(tiles), pairs, len(tokens), int(rows.max()), align


def run_fat(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
    placement: tuple,
    pair_tokens_host: torch.Tensor | None = None,
) -> None:
    """Add the groups' expert outputs into ``out`` (as :func:`run_per_expert` does), in batches of three launches.

    The caller checked that every block is on ``hidden``'s device and laid out alike, and passes that layout's
    ``placement`` (:func:`moetier.kernels.grouped_experts._placement`)."""
    owners = (pair_tokens.cpu() if pair_tokens_host is None else pair_tokens_host).numpy()
    pair_tokens, pair_gates = pair_tokens.contiguous(), pair_gates.contiguous()
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    dense_first = _dense_first(placement)
    for batch in batches(groups, MAX_BATCH_PAIRS, MAX_DENSE_GROUPS if dense_first else None):
        if dense_first:
            from moetier.kernels.grouped_experts import _placement  # imports this module: imported here

            batch = [(w.dequantized(x.dtype), s, c) for w, s, c in batch]
            placement = _placement(batch[0][0])
        table, n_tiles, pairs, touched, most, align = launch_table(batch, owners)
        host = torch.from_numpy(table)
        device_table = (host.pin_memory() if x.is_cuda else host).to(x.device, non_blocking=True)
        _launch(out, x, pair_tokens, pair_gates, batch[0][0], placement, swiglu_limit, device_table,
                (n_tiles, pairs, touched, most, align))  # fmt: skip


def _launch(out, x, pair_tokens, pair_gates, first: ExpertWeights, placement, limit, table, sizes) -> None:
    n_tiles, pairs, touched, most, align = sizes
    quant, gate, up, down, gate_scale, up_scale, down_scale, tile_r, tile_c, _pow2 = placement
    inter, size = (first.gate_q.shape[0] if first.quantized else first.down.shape[1]), x.shape[1]
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, size), dtype=torch.float32, device=x.device)
    blocks = first.block.view(torch.uint8)  # the table's offsets count from here
    ieee = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    common = {"IEEE": ieee, "QUANT": quant, "TILE_R": tile_r, "TILE_C": tile_c, "ALIGN": align,
              "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}  # fmt: skip
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, BLOCK_N))](
        x, table, blocks, pair_tokens, act, x.stride(0), float(limit or 0.0), hidden=size, inter=inter,
        HAS_LIMIT=limit is not None, GATE=gate, UP=up, GATE_SCALE=gate_scale, UP_SCALE=up_scale, **common,
    )  # fmt: skip
    _down_kernel[(n_tiles, triton.cdiv(size, BLOCK_N))](
        act, table, blocks, pair_gates, y, hidden=size, inter=inter, DOWN=down, DOWN_SCALE=down_scale, **common
    )
    rows_at = _TILE_FIELDS * n_tiles
    _sum_kernel[(touched, triton.cdiv(size, SUM_BLOCK))](
        y, table[rows_at:], table[rows_at + pairs :], out, hidden=size, MAX_ROWS=triton.next_power_of_2(most),
        BLOCK_H=SUM_BLOCK,
    )  # fmt: skip
