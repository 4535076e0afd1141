"""Next-layer experts copied into VRAM by the device itself, and the table entries that follow (the mapped route).

A mapped decode step (:mod:`moetier.tiers.mapped`) reads every missed expert over PCIe inside its MoE call, and
between two MoE layers (the attention, launched eagerly by the host) PCIe and the CPU tier sit idle. The model
predicts the next layer's experts at the current one (:meth:`ExpertDispatcher.hint`), but only on the device:
asking the host for them would cost the wait the mapped route exists to avoid. So the device acts on them:

- :func:`launch_ahead` (one kernel, on a side stream, while the attention runs) picks up to ``S`` predicted
  experts of the layer whose table entry points home (not cached), in the prediction's rank order (every
  sequence's first choice, then every second one, ...; duplicates once), copies each home block into one of the
  ``S`` staging slots it is given, then points the table entry at that slot and clears its CPU pick, so the
  layer's call reads it from VRAM and computes it on the device. It records what it changed (``chosen``: the
  expert per slot or -1, ``saved``: the pick it cleared).
- :func:`launch_restore` (one tiny kernel inside the layer's call, after its experts ran: it may be captured in
  a CUDA graph) points those entries home again, puts their picks back, counts ``[copied, used]`` (used: the
  call routed a token to it) and clears ``chosen``.

Every program of the copy kernel makes the same choice (the candidates are a few dozen): an entry a sibling
program already pointed at one of the given slots still counts as free, so the choice does not depend on which
program runs first, and no entry is read by a call before the whole kernel is done (the call's stream waits
for it). The ``*_reference`` functions are the same semantics in torch ops on any device: the CPU path and the
tests' oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# Programs of the copy kernel per slot, and the words each moves per step (32 KB: 8 programs of two slots keep
# ~256 KB of reads in flight over PCIe). Few programs on purpose: the copy runs beside the next layer's attention,
# and in the H200 trace (results/h200-20261202-195484d-trace) 256 KB chunks (~100 programs for two fp4 experts, one
# per SM) held the attention's projection GEMM back until the copy ended (a 0.54 ms stall inside its graph).
PROGRAMS_PER_SLOT = 4
_STEP_WORDS = 8192
_WARPS = 8

if triton is not None:

    @triton.jit
    def _chosen_expert(ids_ptr, table_ptr, home_ptr, slots_ptr, slot, BATCH: tl.constexpr, TOP_K: tl.constexpr,
                       CANDIDATES: tl.constexpr, SLOTS: tl.constexpr):  # fmt: skip
        """The expert slot ``slot`` receives (-1: none): the ``slot``-th distinct free candidate, rank-major."""
        c = tl.arange(0, CANDIDATES)
        real = c < BATCH * TOP_K
        # Rank-major order: candidate c is token c % BATCH's prediction of rank c // BATCH.
        expert = tl.load(ids_ptr + (c % BATCH) * TOP_K + c // BATCH, mask=real, other=-1).to(tl.int64)
        real = real & (expert >= 0)
        entry = tl.load(table_ptr + expert, mask=real, other=0)
        free = entry == tl.load(home_ptr + expert, mask=real, other=1)
        for s in tl.static_range(SLOTS):  # already pointed at one of this launch's slots by a sibling program
            free = free | (entry == tl.load(slots_ptr + s))
        earlier = (expert[:, None] == expert[None, :]) & (c[None, :] < c[:, None]) & real[None, :]
        take = real & free & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
        order = tl.cumsum(take.to(tl.int32), axis=0) - 1
        mine = take & (order == slot)
        return tl.where(tl.sum(mine.to(tl.int32), axis=0) > 0, tl.sum(tl.where(mine, expert, 0), axis=0), -1)

    @triton.jit
    def _ahead_kernel(ids_ptr, table_ptr, home_ptr, pick_ptr, slots_ptr, chosen_ptr, saved_ptr, base_ptr,
                      BATCH: tl.constexpr, TOP_K: tl.constexpr, CANDIDATES: tl.constexpr, SLOTS: tl.constexpr,
                      WORDS: tl.constexpr, CHUNK_WORDS: tl.constexpr, STEP: tl.constexpr):  # fmt: skip
        slot = tl.program_id(0)
        chunk = tl.program_id(1)
        expert = _chosen_expert(ids_ptr, table_ptr, home_ptr, slots_ptr, slot, BATCH, TOP_K, CANDIDATES, SLOTS)
        if expert >= 0:
            source = tl.multiple_of(tl.load(home_ptr + expert), 16)
            target = tl.multiple_of(tl.load(slots_ptr + slot), 16)
            src = (base_ptr + source).to(tl.pointer_type(tl.int32), bitcast=True)
            dst = (base_ptr + target).to(tl.pointer_type(tl.int32), bitcast=True)
            for w0 in range(0, CHUNK_WORDS, STEP):
                w = chunk * CHUNK_WORDS + w0 + tl.arange(0, STEP)
                inside = w < WORDS
                tl.store(dst + w, tl.load(src + w, mask=inside), mask=inside)
            if chunk == 0:  # read by the layer's call only once the whole kernel is done
                tl.store(table_ptr + expert, target)
                tl.store(saved_ptr + slot, tl.load(pick_ptr + expert))
                tl.store(pick_ptr + expert, 0)  # stored as the pointer's uint8
        if chunk == 0:
            tl.store(chosen_ptr + slot, expert)

    @triton.jit
    def _restore_kernel(chosen_ptr, saved_ptr, table_ptr, home_ptr, pick_ptr, ids_ptr, stats_ptr,
                        SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr,
                        COUNT: tl.constexpr):  # fmt: skip
        s = tl.arange(0, SLOTS_P2)
        expert = tl.load(chosen_ptr + s, mask=s < SLOTS, other=-1)
        held = expert >= 0
        tl.store(table_ptr + expert, tl.load(home_ptr + expert, mask=held, other=0), mask=held)
        tl.store(pick_ptr + expert, tl.load(saved_ptr + s, mask=held, other=0), mask=held)
        tl.store(chosen_ptr + s, tl.full((SLOTS_P2,), -1, dtype=tl.int64), mask=s < SLOTS)
        if COUNT:
            p = tl.arange(0, PAIRS_P2)
            ids = tl.load(ids_ptr + p, mask=p < PAIRS, other=-2).to(tl.int64)
            used = held & (tl.sum((expert[:, None] == ids[None, :]).to(tl.int32), axis=1) > 0)
            tl.store(stats_ptr, tl.load(stats_ptr) + tl.sum(held.to(tl.int64), axis=0))
            tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + tl.sum(used.to(tl.int64), axis=0))


def ahead_kernels_usable(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``x`` (CUDA with Triton, or Triton's interpreter)."""
    return triton is not None and triton_usable(x)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_ahead(
    ids: torch.Tensor,
    table: torch.Tensor,
    home: torch.Tensor,
    pick: torch.Tensor,
    slots: torch.Tensor,
    chosen: torch.Tensor,
    saved: torch.Tensor,
    base: torch.Tensor,
    block_bytes: int,
) -> None:
    """Copy the chosen predicted experts of ``ids`` (int64 ``[B, K]``) into the slots and point ``table`` (one
    layer's int64 entries, byte offsets from ``base``, a uint8 tensor) at them (module doc). ``home``: the
    entries' home offsets; ``pick`` (uint8): the CPU tier's picks; ``slots``: int64 offsets of the slots;
    ``chosen`` (int64) / ``saved`` (uint8): ``[len(slots)]`` records. ``block_bytes`` a multiple of 16, every
    offset 16-aligned."""
    batch, top_k = ids.shape
    words = block_bytes // 4
    chunk_words = triton.cdiv(triton.cdiv(words, PROGRAMS_PER_SLOT), _STEP_WORDS) * _STEP_WORDS
    grid = (slots.numel(), triton.cdiv(words, chunk_words))
    _ahead_kernel[grid](
        ids, table, home, pick, slots, chosen, saved, base,
        BATCH=batch, TOP_K=top_k, CANDIDATES=_pow2(batch * top_k), SLOTS=slots.numel(),
        WORDS=words, CHUNK_WORDS=chunk_words, STEP=_STEP_WORDS, num_warps=_WARPS,
    )  # fmt: skip


def launch_restore(
    chosen: torch.Tensor,
    saved: torch.Tensor,
    table: torch.Tensor,
    home: torch.Tensor,
    pick: torch.Tensor,
    ids: torch.Tensor | None,
    stats: torch.Tensor,
) -> None:
    """Undo :func:`launch_ahead` for one layer and, with the call's ``ids``, add ``[copied, used]`` to ``stats``
    (int64 ``[2]``); without ``ids`` (a failed step's clean-up) count nothing."""
    pairs = 0 if ids is None else ids.numel()
    _restore_kernel[(1,)](
        chosen, saved, table, home, pick, ids if ids is not None else chosen, stats,
        SLOTS=chosen.numel(), SLOTS_P2=_pow2(chosen.numel()), PAIRS=pairs, PAIRS_P2=_pow2(max(1, pairs)),
        COUNT=ids is not None,
    )  # fmt: skip


def ahead_choice(ids: torch.Tensor, table: torch.Tensor, home: torch.Tensor, slots: int) -> list[int]:
    """The experts :func:`launch_ahead` copies, slot by slot (host lists; the reference's and the tests' choice)."""
    entries, homes = table.tolist(), home.tolist()
    chosen: list[int] = []
    for expert in ids.t().reshape(-1).tolist():  # rank-major
        if len(chosen) == slots:
            break
        if expert >= 0 and entries[expert] == homes[expert] and expert not in chosen:
            chosen.append(expert)
    return chosen


def ahead_reference(
    ids: torch.Tensor,
    table: torch.Tensor,
    home: torch.Tensor,
    pick: torch.Tensor,
    slots: torch.Tensor,
    chosen: torch.Tensor,
    saved: torch.Tensor,
    blocks: list[torch.Tensor],
    home_block: Callable[[int], torch.Tensor],
) -> None:
    """:func:`launch_ahead` in torch ops: ``blocks`` are the slots' tensors, ``home_block(expert)`` the layer's
    home block of an expert (the bytes copied)."""
    picked = ahead_choice(ids, table, home, slots.numel())
    chosen.fill_(-1)
    for slot, expert in enumerate(picked):
        blocks[slot].copy_(home_block(expert))
        table[expert] = slots[slot]
        saved[slot] = pick[expert]
        pick[expert] = 0
        chosen[slot] = expert


def restore_reference(
    chosen: torch.Tensor,
    saved: torch.Tensor,
    table: torch.Tensor,
    home: torch.Tensor,
    pick: torch.Tensor,
    ids: torch.Tensor | None,
    stats: torch.Tensor,
) -> None:
    """:func:`launch_restore` in torch ops."""
    used_ids = set(ids.reshape(-1).tolist()) if ids is not None else set()
    for slot, expert in enumerate(chosen.tolist()):
        if expert < 0:
            continue
        table[expert] = home[expert]
        pick[expert] = saved[slot]
        if ids is not None:
            stats[0] += 1
            stats[1] += int(expert in used_ids)
    chosen.fill_(-1)
