"""V4 decode attention for long contexts: :mod:`moetier.kernels.v4_attention`'s split kernels on tensor-core tiles.

The split kernels give each head its own programs, so every head reads every key (from L2: the keys of one
sequence are shared by its 64 heads); past ~1000 keys that is ~75 MB of L2 reads a call at V4-Flash widths, and
the values' programs each read their channels of every key in series. Here a program takes :data:`HEADS_PER_TILE`
heads at once, so the keys are read once per tile of heads:

- logits: program (tile of heads, chunk of :data:`~moetier.kernels.v4_attention.CHUNK_KEYS` keys), the tile's
  queries times the chunk's keys as ``tl.dot`` products over slices of the channels (float32 sums of exact
  products), rounded as torch's ``bmm`` then ``mul_``; it writes the logits and each head's chunk (max, sum), as
  the split kernels do;
- values: program (tile of heads, slice of channels, group of :data:`GROUP_KEYS` keys), the rounded probabilities
  times its group's keys (``tl.dot``); with more than one group the float32 partials are summed in group order
  by a third launch, else the program writes the output.

The roundings are those of the split kernels (probabilities rounded to the model's dtype before the values'
product); only the float32 sums are grouped otherwise. float32 models take ``tl.dot`` in IEEE float32, not TF32.
"""

from __future__ import annotations

import torch

from moetier.kernels.v4_attention import (
    CHANNELS_PER_PROGRAM,
    CHUNK_KEYS,
    AttentionStep,
    _kernel_arguments,
    triton,
)

if triton is not None:
    import triton.language as tl

    from moetier.kernels.v4_attention import _entry_keys, _entry_rows, _window_keys, _window_rows

# Heads a program takes (tl.dot's smallest tile side); keys a values program sums (a multiple of the blocks).
HEADS_PER_TILE = 16
GROUP_KEYS = 512
# Keys a program reads at once, and channels of a logits product's slice.
TILE_KEYS = 64
TILE_CHANNELS = 64


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` in float32 sums (IEEE float32 products for float32 inputs, never TF32)."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _chunk_valid(
        ids, start, p, ready, capacity, slots, in_window,
        W: tl.constexpr, S: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr,
    ):  # fmt: skip
        """Which of keys ``start .. start + S`` of the window (``in_window``) or of the entry slots count."""
        if in_window:
            _rows, valid = _window_rows(start, p, W, S)  # a name per branch: the rows' types differ
        else:
            _at, valid = _entry_rows(ids, start, slots, ready, capacity, S, PICKED, GATHERED)
        return valid

    @triton.jit
    def _chunk_keys(
        ring, fresh, entries, ids, start, p, ready, capacity, slots, d, in_window,
        W: tl.constexpr, S: tl.constexpr, D: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr,
    ):  # fmt: skip
        """Keys ``start .. start + S`` of the window (``in_window``) or of the entry slots, channels ``d``."""
        if in_window:
            keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
        else:
            keys, valid = _entry_keys(entries, ids, start, slots, ready, capacity, d, S, D, PICKED, GATHERED)
        return keys, valid

    @triton.jit
    def _tile_logits_kernel(
        q, ring, new_key, position, entries, ids, sinks, logits, stats, capacity, rate, scale, slots, splits,
        row_stride, heads,
        W: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, S: tl.constexpr, DK: tl.constexpr, C: tl.constexpr,
        WINDOW_SPLITS: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr, ROUND: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # Program (tile t of heads, chunk i): chunks as the split kernels' (the window's first, then the slots').
        t = tl.program_id(0)
        i = tl.program_id(1)
        h = t * HB + tl.arange(0, HB)
        live = h < heads
        p = tl.load(position)
        ready = (p + 1) // rate
        if (t == 0) & (i == 0):  # the new key into its ring row; every program reads it in that row's place
            every = tl.arange(0, D)
            tl.store(ring + (p % W) * D + every, tl.load(new_key + every))
        in_window = i < WINDOW_SPLITS
        m = tl.load(sinks + h, mask=live, other=0.0)
        total = m * 0.0
        rows = logits + h * row_stride
        for b in range(0, C // S):
            start = tl.where(in_window, i * C, (i - WINDOW_SPLITS) * C) + b * S
            valid = _chunk_valid(ids, start, p, ready, capacity, slots, in_window, W, S, PICKED, GATHERED)
            acc = tl.zeros([HB, S], tl.float32)
            for k in range(0, D, DK):
                d = k + tl.arange(0, DK)
                query = tl.load(q + h[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
                fresh = tl.load(new_key + d)
                keys, _ = _chunk_keys(
                    ring, fresh, entries, ids, start, p, ready, capacity, slots, d, in_window, W, S, D, PICKED,
                    GATHERED,
                )  # fmt: skip
                acc += _dot(query, tl.trans(keys), IEEE)
            if ROUND:  # as torch's bmm then mul_ in the model's dtype
                s = acc.to(q.dtype.element_ty).to(tl.float32)
                s = (s * scale).to(q.dtype.element_ty).to(tl.float32)
            else:
                s = acc * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            j = start + tl.arange(0, S)
            column = tl.where(in_window, j, WINDOW_SPLITS * C + j)
            inside = tl.where(in_window, j < W, j < slots)
            tl.store(rows[:, None] + column[None, :], s, mask=live[:, None] & inside[None, :])
            m_new = tl.maximum(m, tl.max(s, axis=1))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m = m_new
        tl.store(stats + (h * splits + i) * 2, m, mask=live)
        tl.store(stats + (h * splits + i) * 2 + 1, total, mask=live)

    @triton.jit
    def _joined_softmax(sinks, stats, h, live, splits):
        """The tile's heads' softmax max and denominator from their chunks' (max, sum) and sinks."""
        sink = tl.load(sinks + h, mask=live, other=0.0)
        m = sink
        start = 0
        while start < splits:
            i = start + tl.arange(0, 64)
            at = (h[:, None] * splits + i[None, :]) * 2
            inside = live[:, None] & (i < splits)[None, :]
            m = tl.maximum(m, tl.max(tl.load(stats + at, mask=inside, other=float("-inf")), axis=1))
            start += 64
        total = tl.exp(sink - m)
        start = 0
        while start < splits:
            i = start + tl.arange(0, 64)
            at = (h[:, None] * splits + i[None, :]) * 2
            inside = live[:, None] & (i < splits)[None, :]
            chunk_m = tl.load(stats + at, mask=inside, other=float("-inf"))
            chunk_total = tl.load(stats + at + 1, mask=inside, other=0.0)
            total += tl.sum(chunk_total * tl.exp(chunk_m - m[:, None]), axis=1)
            start += 64
        return m, total

    @triton.jit
    def _tile_values_kernel(
        ring, new_key, position, entries, ids, sinks, logits, stats, out, partials, capacity, rate, slots, splits,
        row_stride, heads, group_keys,
        W: tl.constexpr, D: tl.constexpr, DS: tl.constexpr, HB: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
        WINDOW_SPLITS: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr, IEEE: tl.constexpr,
        GROUPED: tl.constexpr,
    ):  # fmt: skip
        # Program (tile t of heads, channels c * DS .., group g): keys g * group_keys .. of the window's rows and
        # then the slots, numbered in that order (group_keys a multiple of S: a block never crosses a group).
        t = tl.program_id(0)
        d = tl.program_id(1) * DS + tl.arange(0, DS)
        g = tl.program_id(2)
        h = t * HB + tl.arange(0, HB)
        live = h < heads
        p = tl.load(position)
        ready = (p + 1) // rate
        m, total = _joined_softmax(sinks, stats, h, live, splits)
        rows = logits + h * row_stride
        fresh = tl.load(new_key + d)
        first = g * group_keys
        last = tl.minimum(first + group_keys, W + slots)
        acc = tl.zeros([HB, DS], tl.float32)
        start = first
        while start < tl.minimum(last, W):
            keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
            r = start + tl.arange(0, S)
            s = tl.load(rows[:, None] + r[None, :], mask=live[:, None] & (r < W)[None, :], other=float("-inf"))
            probs = (tl.exp(s - m[:, None]) / total[:, None]).to(keys.dtype)
            acc += _dot(probs, keys, IEEE)
            start += S
        end = last - W
        start = tl.maximum(first - W, 0)
        while start < end:
            keys, valid = _entry_keys(entries, ids, start, end, ready, capacity, d, S, D, PICKED, GATHERED)
            j = start + tl.arange(0, S)
            at = WINDOW_SPLITS * C + j
            s = tl.load(rows[:, None] + at[None, :], mask=live[:, None] & (j < end)[None, :], other=float("-inf"))
            probs = (tl.exp(s - m[:, None]) / total[:, None]).to(keys.dtype)
            acc += _dot(probs, keys, IEEE)
            start += S
        place = h[:, None] * D + d[None, :]
        if GROUPED:
            tl.store(partials + g * heads * D + place, acc, mask=live[:, None])
        else:
            tl.store(out + place, acc.to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _group_sum_kernel(partials, out, heads, groups, D: tl.constexpr, DS: tl.constexpr):
        # Program (head h, channels c * DS ..): the groups' partials summed in group order, rounded once.
        h = tl.program_id(0)
        d = tl.program_id(1) * DS + tl.arange(0, DS)
        acc = tl.zeros([DS], tl.float32)
        g = 0
        while g < groups:
            acc += tl.load(partials + (g * heads + h) * D + d)
            g += 1
        tl.store(out + h * D + d, acc.to(out.dtype.element_ty))


def attend_tiles(step: AttentionStep) -> torch.Tensor:
    """The tile kernels, two launches (three past :data:`GROUP_KEYS` keys); the caller checked
    :func:`~moetier.kernels.v4_attention.fits`."""
    q, ring, new_key, position, _, _, _, rate, sinks, scale, out, _ = step.parts()
    heads, dim = q.shape
    out = torch.empty_like(q) if out is None else out
    table, picks, slots, capacity, kinds = _kernel_arguments(step)
    window, chunk = ring.shape[0], CHUNK_KEYS
    window_splits = triton.cdiv(window, chunk)
    splits = window_splits + triton.cdiv(slots, chunk)
    row_stride = window_splits * chunk + slots
    tiles = triton.cdiv(heads, HEADS_PER_TILE)
    logits = torch.empty(heads, row_stride, device=q.device, dtype=torch.float32)
    stats = torch.empty(heads, splits, 2, device=q.device, dtype=torch.float32)
    exact = q.dtype == torch.float32
    shared = {"W": window, "D": dim, "HB": HEADS_PER_TILE, "C": chunk, "WINDOW_SPLITS": window_splits, **kinds}
    _tile_logits_kernel[(tiles, splits)](
        q, ring, new_key, position, table, picks, sinks, logits, stats, capacity, max(rate, 1), scale, slots,
        splits, row_stride, heads, S=TILE_KEYS, DK=min(dim, TILE_CHANNELS), ROUND=not exact, IEEE=exact,
        num_warps=4, **shared,
    )  # fmt: skip
    groups = triton.cdiv(window + slots, GROUP_KEYS)
    channels = min(dim, CHANNELS_PER_PROGRAM)
    partials = torch.empty(groups, heads, dim, device=q.device, dtype=torch.float32) if groups > 1 else out
    _tile_values_kernel[(tiles, dim // channels, groups)](
        ring, new_key, position, table, picks, sinks, logits, stats, out, partials, capacity, max(rate, 1), slots,
        splits, row_stride, heads, GROUP_KEYS, DS=channels, S=TILE_KEYS, IEEE=exact, GROUPED=groups > 1,
        num_warps=4, **shared,
    )  # fmt: skip
    if groups > 1:
        _group_sum_kernel[(heads, dim // channels)](partials, out, heads, groups, D=dim, DS=channels, num_warps=2)
    return out
