"""A decode call's device launch table in one kernel (and, for the mapped route's fed CPU tier, its inbox).

:func:`moetier.kernels.device_routing.device_tables` builds the table from ~15 torch ops (a gather, a per-token
argsort, stacks and a cat), and the mapped route's fed CPU share adds a gather, a select and three copies: each a
launch the host pays for on every MoE layer of every step (measured on the H200: the mapped route's host time
was 0.58 ms a layer, 1.0 ms with the fed share, while its kernels took less). :func:`build_table` writes the same
table from one program per token: each pair's group ``(offset, pair, count)`` and down row ``(pair, offset)``,
and the token's row (its pairs by increasing expert id, ties in pair order, ``-1`` padding), the sort done as
ranks (a token has top-k pairs, a handful). With a ``pick`` vector the pairs whose expert it marks are left
out (count 0, down row -1, not in the token's row: the kernels read none of their expert), and with a
:class:`FeedTarget` the same program writes them to the CPU tier's inbox in pinned host memory (the GPU
addresses it directly): their ids (-1 for the device's pairs), the gates as float32 and the token's hidden row.

With a :class:`CallSplit` the ``pick`` vector only says which experts the CPU *may* take (those not cached), and the
kernel splits each call's eligible experts itself: ``floor(share * n + 0.5)`` of the call's ``n`` distinct eligible
experts go to the CPU, the cheapest for it first (fewest tokens in the call, then a fixed per-expert priority), so
both sides get their share of *this* call's misses. With ``CallSplit.unit_rows`` the share is met to a part of an
expert: the CPU takes whole experts, then the last rows of the next one in its order, whose first rows the device
computes (the table's rows per pair; the inbox ids carry that row, ``cpu_worker.fed_ids``). A fixed split of the
expert ids (``pick`` alone) gives them that share only on average: at one stream a layer misses ~4 experts, and
which side gets how many of them is a coin toss per expert, so the slower side of each call waits for ~2.75 experts'
time where an even split needs 2 (an H200 trace had the device waiting 0.07-0.50 ms a layer for the CPU's job).
Measured on the H200 against the fixed split, runs interleaved: +7-12% at 2 streams, no sign beyond the spread at 1
and 4, where the step is bound by other things (results/h200-20261203-90b676f-fed-split). Each program decides for
the whole call (a call has at most ``DEVICE_ROUTING_MAX_PAIRS`` pairs), so all agree. :func:`split_rows`
(:func:`split_skip`) is the same decision in torch (off CUDA, and the kernel's reference in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.kernels.cpu_worker import FED_FROM_SHIFT
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs use device_tables' torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


@dataclass(frozen=True)
class FeedTarget:
    """Where the table kernel writes the CPU tier's inputs: byte offsets from ``base`` (a uint8 device tensor, the
    kernel's pointer origin) of the inbox's ids (int64 ``[T, K]``), gates (float32 ``[T, K]``) and hidden rows
    (bf16 ``[T, H]``), which live in pinned host memory the device can address."""

    base: torch.Tensor
    ids: int
    gates: int
    hidden: int


@dataclass(frozen=True)
class CallSplit:
    """How a call's eligible experts are split between the CPU and the device: ``priority`` (int32 ``[E]``, distinct
    values below 2**16: the order the CPU takes experts with as many tokens) and ``share`` (float32 ``[1]``, the
    CPU's fraction of each call's distinct eligible experts), both on the call's device.

    With ``unit_rows`` (0: whole experts only) the share is met to a part of ``unit_rows`` of an expert's ``inter``
    intermediate rows: the CPU takes whole experts, then the last rows of the next one, whose first rows the device
    computes (``inter / unit_rows`` parts, a power of two, so the kernel's float32 arithmetic is the reference's)."""

    priority: torch.Tensor
    share: torch.Tensor
    unit_rows: int = 0
    inter: int = 0

    def __post_init__(self) -> None:
        if self.unit_rows:
            units = self.inter // self.unit_rows if self.unit_rows > 0 else 0
            if units < 2 or units * self.unit_rows != self.inter or units & (units - 1):
                raise ValueError(f"CallSplit: {self.inter} rows do not cut in a power of two of {self.unit_rows}")

    @property
    def units(self) -> int:
        """The parts an expert is cut in (1: whole experts only)."""
        return self.inter // self.unit_rows if self.unit_rows else 1


# A call's tokens per expert times this plus its priority orders the CPU's picks (priorities are < 2**16).
_KEY_STRIDE = 1 << 16


def split_skip(topk_ids: torch.Tensor, pick: torch.Tensor, split: CallSplit) -> torch.Tensor:
    """The pairs (bool ``[T, K]``) whose expert :func:`build_table` gives the CPU whole for ``split``: of the call's
    ``n`` distinct experts that ``pick`` marks, the ``floor(share * n + 0.5)`` (with ``unit_rows``: whole parts of
    ``share * n``, see :func:`split_rows`) with the fewest tokens in the call, ties by ``priority``."""
    return split_rows(topk_ids, pick, split)[0]


def split_rows(topk_ids: torch.Tensor, pick: torch.Tensor, split: CallSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_skip`'s pairs and each pair's intermediate rows on the device (int64 ``[T, K]``): 0 for the CPU's
    whole experts, ``inter`` for the device's, and for the next expert in the CPU's order, when ``share * n`` leaves
    ``u`` of ``units`` parts over (``floor(share * n * units + 0.5)`` parts in all, float32 as the kernel's), its
    first ``(units - u) * unit_rows`` (the CPU computes the rest). Without ``unit_rows``, ``inter`` is taken as 1."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    experts, uses = torch.unique(flat, return_counts=True)
    eligible = pick[experts] != 0
    experts, uses = experts[eligible], uses[eligible]
    n = torch.tensor(float(experts.numel()), dtype=torch.float32, device=flat.device)
    units, share = split.units, split.share.reshape(-1)[0].to(flat.device)
    total = int(torch.floor(share * n * units + 0.5))
    n_cpu, part = divmod(total, units)
    order = experts[torch.argsort(uses * _KEY_STRIDE + split.priority[experts].to(torch.int64))]
    ids = topk_ids.to(torch.int64)
    skip = torch.isin(ids, order[:n_cpu])
    inter = split.inter if split.unit_rows else 1
    rows = torch.where(skip, 0, inter)
    if part > 0 and n_cpu < order.numel():
        rows = torch.where(ids == order[n_cpu], (units - part) * split.unit_rows, rows)
    return skip, rows


def split_priorities(experts: int, salt: int) -> list[int]:
    """A fixed, well spread order of a layer's ``experts`` (``salt``: the layer's): each one's rank in it."""
    order = sorted(range(experts), key=lambda e: mix32(salt * experts + e))
    ranks = [0] * experts
    for rank, expert in enumerate(order):
        ranks[expert] = rank
    return ranks


def mix32(x: int) -> int:
    """A 32-bit integer hash (murmur3's finaliser)."""
    x = (x * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


if triton is not None:

    @triton.jit
    def _call_skip(
        ids,
        k_ok,
        ids_ptr,
        pick_ptr,
        prio_ptr,
        share_ptr,
        PAIRS: tl.constexpr,
        CALL: tl.constexpr,
        STRIDE: tl.constexpr,
        UNITS: tl.constexpr,
        UNIT_ROWS: tl.constexpr,
    ):
        """Which of a token's pairs (``ids``) the CPU takes under a :class:`CallSplit`, whole (``skip``) and split
        (``parted``: the device computes its first ``rows`` intermediate rows, the CPU the rest), and ``rows``:
        every program decides for the whole call (``CALL``: ``PAIRS`` padded to a power of two), so they all agree.
        Experts are cut in ``UNITS`` parts of ``UNIT_ROWS`` rows (``UNITS`` 1: whole experts only)."""
        q = tl.arange(0, CALL)
        q_ok = q < PAIRS
        q_ids = tl.load(ids_ptr + q, mask=q_ok, other=-1).to(tl.int64)  # -1: padding matches no expert
        eligible = q_ok & (tl.load(pick_ptr + q_ids, mask=q_ok, other=0) != 0)
        same = q_ids[:, None] == q_ids[None, :]
        uses = tl.sum(same.to(tl.int32), axis=1)
        earlier = tl.sum((same & (q[None, :] < q[:, None])).to(tl.int32), axis=1)
        first = eligible & (earlier == 0)  # each eligible expert once, at its first pair
        n = tl.sum(first.to(tl.int32), axis=0)
        key = uses * STRIDE + tl.load(prio_ptr + q_ids, mask=q_ok, other=0)
        rank = tl.sum((first[None, :] & (key[None, :] < key[:, None])).to(tl.int32), axis=1)
        total = tl.floor(tl.load(share_ptr) * n.to(tl.float32) * UNITS + 0.5).to(tl.int32)  # the CPU's parts
        n_cpu, units = total // UNITS, total % UNITS
        chosen = first & (rank < n_cpu)
        cut = first & (rank == n_cpu) & (units > 0)
        same = ids[:, None] == q_ids[None, :]
        skip = (tl.sum((same & chosen[None, :]).to(tl.int32), axis=1) > 0) & k_ok
        parted = (tl.sum((same & cut[None, :]).to(tl.int32), axis=1) > 0) & k_ok
        return skip, parted, (UNITS - units) * UNIT_ROWS

    @triton.jit
    def _table_kernel(
        ids_ptr,
        offsets_ptr,
        pick_ptr,
        prio_ptr,
        share_ptr,
        cpu_counts_ptr,
        table_ptr,
        rows_ptr,
        gates_ptr,
        hidden_ptr,
        base_ptr,
        feed_ids,
        feed_gates,
        feed_hidden,
        stride_h,
        TOP_K: tl.constexpr,
        WIDTH: tl.constexpr,
        PAIRS: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PICK: tl.constexpr,
        SPLIT: tl.constexpr,
        COUNT: tl.constexpr,
        CALL: tl.constexpr,
        KEY_STRIDE: tl.constexpr,
        FEED: tl.constexpr,
        UNITS: tl.constexpr,
        UNIT_ROWS: tl.constexpr,
        ROWS: tl.constexpr,
        FROM_SHIFT: tl.constexpr,
    ):
        t = tl.program_id(0)
        k = tl.arange(0, WIDTH)
        k_ok = k < TOP_K
        pair = t * TOP_K + k
        ids = tl.load(ids_ptr + pair, mask=k_ok, other=0).to(tl.int64)
        block = tl.load(offsets_ptr + ids, mask=k_ok, other=0)
        skip = tl.zeros((WIDTH,), dtype=tl.int1)
        parted = tl.zeros((WIDTH,), dtype=tl.int1)
        rows = UNITS * UNIT_ROWS  # the split expert's rows the device computes (every row: no split)
        if SPLIT:
            skip, parted, rows = _call_skip(
                ids, k_ok, ids_ptr, pick_ptr, prio_ptr, share_ptr, PAIRS, CALL, KEY_STRIDE, UNITS, UNIT_ROWS
            )
        elif PICK:
            skip = (tl.load(pick_ptr + ids, mask=k_ok, other=0) != 0) & k_ok
        if COUNT:
            tl.atomic_add(cpu_counts_ptr + ids, tl.full((WIDTH,), 1, dtype=tl.int64), mask=skip)
        none = tl.full((WIDTH,), -1, dtype=tl.int64)
        kept = tl.where(skip, none, pair.to(tl.int64))
        tl.store(table_ptr + 3 * pair, block, mask=k_ok)
        tl.store(table_ptr + 3 * pair + 1, pair.to(tl.int64), mask=k_ok)
        tl.store(table_ptr + 3 * pair + 2, tl.where(skip, 0, 1).to(tl.int64), mask=k_ok)
        tl.store(table_ptr + 3 * PAIRS + 2 * pair, kept, mask=k_ok)
        tl.store(table_ptr + 3 * PAIRS + 2 * pair + 1, block, mask=k_ok)
        # Pair k's place in the token's row: the pairs before it by (expert id, k), as a stable argsort orders.
        before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (k[None, :] < k[:, None]))
        rank = tl.sum((before & k_ok[None, :]).to(tl.int32), axis=1)
        row = table_ptr + 5 * PAIRS + t * (WIDTH + 1)
        tl.store(row, t.to(tl.int64))
        tl.store(row + 1 + rank, kept, mask=k_ok)
        tl.store(row + 1 + k, none, mask=k >= TOP_K)
        tl.store(table_ptr + 5 * PAIRS + (PAIRS // TOP_K) * (WIDTH + 1) + pair, t.to(tl.int64), mask=k_ok)
        if ROWS:  # each pair's rows on the device: none of the CPU's whole experts, the first ones of a split one
            mine = tl.where(parted, rows, UNITS * UNIT_ROWS).to(tl.int64)
            tl.store(rows_ptr + pair, tl.where(skip, 0, mine), mask=k_ok)
        if FEED:  # the CPU's pairs, a split expert's with its first row above FED_FROM_SHIFT (cpu_worker.fed_ids)
            cpu_ids = tl.where(skip, ids, none)
            if ROWS:
                cpu_ids = tl.where(parted, ids | (rows.to(tl.int64) << FROM_SHIFT), cpu_ids)
            tl.store((base_ptr + feed_ids).to(tl.pointer_type(tl.int64), bitcast=True) + pair, cpu_ids, mask=k_ok)
            gates = tl.load(gates_ptr + pair, mask=k_ok, other=0.0).to(tl.float32)
            tl.store((base_ptr + feed_gates).to(tl.pointer_type(tl.float32), bitcast=True) + pair, gates, mask=k_ok)
            dst = (base_ptr + feed_hidden).to(tl.pointer_type(tl.bfloat16), bitcast=True) + t * HIDDEN
            for h0 in range(0, HIDDEN, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                h_ok = h < HIDDEN
                tl.store(dst + h, tl.load(hidden_ptr + t * stride_h + h, mask=h_ok), mask=h_ok)


def row_width(top_k: int) -> int:
    """A token's row of the table: its pairs padded to the next power of two (the sum kernel's width)."""
    return 1 << (top_k - 1).bit_length()


def table_kernel_usable(ids: torch.Tensor) -> bool:
    """Whether :func:`build_table` runs for ids on this device (CUDA with Triton, or Triton's interpreter)."""
    return triton is not None and triton_usable(ids)


def build_table(
    offsets: torch.Tensor,
    topk_ids: torch.Tensor,
    pick: torch.Tensor | None = None,
    feed: FeedTarget | None = None,
    gates: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    split: CallSplit | None = None,
    cpu_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The launch table of :func:`~moetier.kernels.device_routing.device_tables` for ``topk_ids`` ``[T, K]``, each
    pair's token and (for a ``split`` with ``unit_rows``, else None) each pair's intermediate rows on the device
    (:func:`split_rows`), with the pairs whose expert ``pick`` (uint8 ``[E]``) marks left out (with ``split``: the
    pairs :func:`split_skip` gives the CPU; each left-out pair adds one to its expert's ``cpu_counts``, int64
    ``[E]``, where given) and, with ``feed``, written with ``gates`` and ``hidden`` (bf16) to the CPU tier's inbox
    (a split expert's pairs too, its ids carrying the device's rows: ``cpu_worker.fed_ids``); the caller checked
    :func:`table_kernel_usable`. All come from one allocation the kernel fills (nothing made ahead: the call may
    be captured in a CUDA graph)."""
    tokens, top_k = topk_ids.shape
    pairs, width = tokens * top_k, row_width(top_k)
    size = 5 * pairs + tokens * (width + 1)
    rows = split is not None and split.unit_rows > 0
    table = torch.empty(size + pairs * (2 if rows else 1), dtype=torch.int64, device=topk_ids.device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    fed = feed is not None
    base = feed.base if fed else table
    hidden_size = hidden.shape[1] if fed else 1
    if split is not None and pick is None:
        raise ValueError("build_table: a call split needs the pick vector of the experts the CPU may take")
    counts = cpu_counts if pick is not None else None
    _table_kernel[(tokens,)](
        ids, offsets, pick if pick is not None else table,
        split.priority if split is not None else table, split.share if split is not None else table,
        counts if counts is not None else table, table, table[size + pairs :] if rows else table,
        gates.contiguous() if fed else table, hidden if fed else table, base,
        feed.ids if fed else 0, feed.gates if fed else 0, feed.hidden if fed else 0,
        hidden.stride(0) if fed else 0,
        TOP_K=top_k, WIDTH=width, PAIRS=pairs, HIDDEN=hidden_size, BLOCK_H=1024, PICK=pick is not None,
        SPLIT=split is not None, COUNT=counts is not None, CALL=max(1 << (pairs - 1).bit_length(), 16),
        KEY_STRIDE=_KEY_STRIDE, FEED=fed, UNITS=split.units if split is not None else 1,
        UNIT_ROWS=split.unit_rows if rows else 0, ROWS=rows, FROM_SHIFT=FED_FROM_SHIFT,
    )  # fmt: skip
    return table[:size], table[size : size + pairs], table[size + pairs :] if rows else None
