"""Decode attention that reads paged KV rows in place: no gather, no padding, split across the context.

A decode step used to copy every sequence's whole context out of the block pool each layer (a gather,
with fp8 dequantisation) and then again into one padded ``[B, kv_heads, S, D]`` tensor before a
matmul / softmax / matmul; at 100k tokens those copies cost ~10% of decode. Here each program loads
key and value rows straight from the pool through the stores' token -> pool-row index, dequantises fp8
rows on the fly (e4m3 values times their row group's float32 scale) and keeps an online softmax in
float32 (flash-decoding):

- pass 1: one program per (sequence, KV head, block of the query heads sharing it, split of the
  context): the split's keys in tiles of ``BLOCK_N``, partial output, running max and sum written out;
- pass 2: one program per (sequence, query head) combines the splits (skipped with a single split:
  pass 1 then writes the normalised output itself).

Splits are what keep one long stream busy: a single 100k-token sequence has 4 (sequence, KV head)
programs on Qwen3-235B, so the context is cut into enough splits to give every SM work. The number is
chosen on the host from the longest sequence (a Python int: no host sync); short sequences of a batch
just leave their later splits empty.

Rows: ``k_data`` ``[pool rows, kv_heads, width]`` (or ``[pool rows, width]``: one KV head, MLA) in bf16,
fp16, fp32 or e4m3 with ``k_scales`` ``[pool rows, (kv_heads,) groups]`` float32 (:class:`KVRows`'
layout). The key width is ``d1 + d2``: a first part of ``d1`` columns and an optional second part
(MLA's roped key), each with at most one scale group. Values are separate rows (``v_data``, one group)
or, for MLA's absorbed decode, the first ``d1`` columns of the key rows themselves (read once).
``index`` holds the pool row of every sequence's tokens, sequence after sequence (``[sum(lengths)]``,
int64: the stores' indexes concatenated); ``lengths`` ``[B]`` is on the device. Query head ``h`` uses
KV head ``h // (Hq / kv_heads)`` (``q.view(B, kv_heads, -1, D)``'s grouping).

Numerics: scores and softmax in float32; with bf16/fp16 queries the dot products take the query dtype
(fp8 values are exact in bf16; their scale multiplies the float32 score, and the probabilities before
the value product), within bf16 rounding of the gather path. float32 queries (and the interpreter,
whose low-precision dot is wrong) use IEEE float32 dots: ~1e-6 of the gather path. Used on CUDA when
Triton is importable (``MOETIER_TRITON=0`` turns it off) and under ``TRITON_INTERPRET=1``; after one
failure callers take the gather path from then on.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from moetier.kernels.rmsnorm import triton_usable

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the gather path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STORAGE = (*_DTYPES, torch.float8_e4m3fn)
_LOG2E = 1.4426950408889634
_MIN_SPLIT_TILES = 4  # a split reads at least this many key tiles: the combine stays small beside it
_MAX_SPLITS = 128
_COMBINE_COLUMNS = 32  # output columns per combine program: [MAX_SPLITS, 32] float32 at most
_BROKEN: list[str] = []
_SM_COUNTS: dict[int, int] = {}

if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        # (A constexpr condition: Triton picks one branch at compile time.)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee") if IEEE else tl.dot(a, b)

    @triton.jit
    def _load_rows(ptr, rows, row_stride, offset, cols, width, valid, FP8: tl.constexpr, DTYPE: tl.constexpr):
        """``[BLOCK_N, BLOCK_D]`` columns ``offset + cols`` of pool ``rows`` in ``DTYPE`` (fp8: not scaled)."""
        mask = valid[:, None] & (cols < width)[None, :]
        raw = tl.load(ptr + rows[:, None] * row_stride + offset + cols[None, :], mask=mask, other=0)
        if FP8:
            raw = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return raw.to(DTYPE)

    @triton.jit
    def _attend_tile(
        t0, hi, m, l_sum, acc, q1, q2, k_index, v_index, k_ptr, ks_ptr, v_ptr, vs_ptr,
        k_row, ks_row, v_row, vs_row, qk_scale,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, SCALE2: tl.constexpr, FP8: tl.constexpr,
        V_IS_K: tl.constexpr, IEEE: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """Keys ``[t0, t0 + BLOCK_N)`` (those below ``hi``) folded into the online softmax -> (m, l_sum, acc).
        ``k_index``/``v_index`` point at the sequence's first token, the row pointers at its KV head."""
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < hi
        rows = tl.load(k_index + t, mask=valid, other=0).to(tl.int64)
        k1 = _load_rows(k_ptr, rows, k_row, 0, tl.arange(0, BLOCK_D1), D1, valid, FP8, DTYPE)
        scores = _dot(q1, tl.trans(k1), IEEE)
        if FP8:  # one scale per row and part: it scales the dot product, not every column
            k_scale = tl.load(ks_ptr + rows * ks_row, mask=valid, other=1.0)
            scores = scores * k_scale[None, :]
        if D2 > 0:
            k2 = _load_rows(k_ptr, rows, k_row, D1, tl.arange(0, BLOCK_D2), D2, valid, FP8, DTYPE)
            rope = _dot(q2, tl.trans(k2), IEEE)
            if FP8:
                rope = rope * tl.load(ks_ptr + rows * ks_row + SCALE2, mask=valid, other=1.0)[None, :]
            scores += rope
        # The first tile of a split always holds a key, so the running max is finite from then on.
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if V_IS_K:  # MLA: the values are the keys' first part, already loaded
            values = k1
            if FP8:
                p = p * k_scale[None, :]
        else:
            v_rows = tl.load(v_index + t, mask=valid, other=0).to(tl.int64)
            values = _load_rows(v_ptr, v_rows, v_row, 0, tl.arange(0, BLOCK_DV), DV, valid, FP8, DTYPE)
            if FP8:
                p = p * tl.load(vs_ptr + v_rows * vs_row, mask=valid, other=1.0)[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(DTYPE), values, IEEE)
        return m_new, l_sum, acc

    @triton.jit
    def _sequence_start(lengths_ptr, b, batch, INTERPRET: tl.constexpr):
        """Where sequence ``b``'s tokens start in the index: after the earlier sequences' (a masked sum over
        the batch, a runtime count: no recompilation per batch size)."""
        start = tl.zeros([], dtype=tl.int64)
        if INTERPRET:  # the interpreter cannot take a loop bound that is a kernel argument
            j = tl.zeros([], dtype=tl.int32)
            while j < batch:
                start += tl.where(j < b, tl.load(lengths_ptr + j).to(tl.int64), 0)
                j += 1
        else:
            for j in range(0, batch):
                start += tl.where(j < b, tl.load(lengths_ptr + j).to(tl.int64), 0)
        return start

    # Counts that vary with the batch and the context stay runtime values (Triton would otherwise compile a
    # variant for 1 and for multiples of 16: mid-decode, when a stream joins or the context grows).
    @triton.jit(do_not_specialize=["split_tokens", "splits", "batch"])
    def _split_kernel(
        q_ptr, k_ptr, ks_ptr, k_index, v_ptr, vs_ptr, v_index, lengths_ptr,
        part_acc, part_m, part_l, out_ptr,
        qk_scale, split_tokens, splits, batch,
        q_seq, q_head, k_row, k_head, ks_row, ks_head, v_row, v_head, vs_row, vs_head,
        GROUP: tl.constexpr, KV_HEADS: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
        SCALE2: tl.constexpr, FP8: tl.constexpr, V_IS_K: tl.constexpr, DIRECT: tl.constexpr,
        IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        head_blocks: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
        pid, split = tl.program_id(0), tl.program_id(1)
        b = pid // (KV_HEADS * head_blocks)
        kvh = (pid // head_blocks) % KV_HEADS
        g = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # query heads of this KV head
        g_ok = g < GROUP
        heads = kvh * GROUP + g
        dtype: tl.constexpr = tl.float32 if IEEE else q_ptr.dtype.element_ty
        start = _sequence_start(lengths_ptr, b, batch, INTERPRET)
        length = tl.load(lengths_ptr + b).to(tl.int64)
        lo = split.to(tl.int64) * split_tokens
        hi = tl.minimum(lo + split_tokens, length)

        d1, d2, dv = tl.arange(0, BLOCK_D1), tl.arange(0, BLOCK_D2), tl.arange(0, BLOCK_DV)
        q_rows = q_ptr + b.to(tl.int64) * q_seq + heads[:, None] * q_head
        q1 = tl.load(q_rows + d1[None, :], mask=g_ok[:, None] & (d1 < D1)[None, :], other=0).to(dtype)
        q2 = q1  # unused without a second key part
        if D2 > 0:
            q2 = tl.load(q_rows + D1 + d2[None, :], mask=g_ok[:, None] & (d2 < D2)[None, :], other=0).to(dtype)
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        k_seq, v_seq = k_index + start, v_index + start
        k_at, ks_at = k_ptr + kvh * k_head, ks_ptr + kvh * ks_head
        v_at, vs_at = v_ptr + kvh * v_head, vs_ptr + kvh * vs_head
        if INTERPRET:  # the interpreter cannot take a loop bound read from memory (int() of a 1-d array)
            t0 = lo
            while t0 < hi:
                m, l_sum, acc = _attend_tile(
                    t0, hi, m, l_sum, acc, q1, q2, k_seq, v_seq, k_at, ks_at, v_at, vs_at, k_row, ks_row, v_row,
                    vs_row, qk_scale, D1, D2, DV, SCALE2, FP8, V_IS_K, IEEE, dtype, BLOCK_N, BLOCK_D1, BLOCK_D2,
                    BLOCK_DV,
                )  # fmt: skip
                t0 += BLOCK_N
        else:  # a for loop: Triton pipelines its loads
            for t0 in range(lo, hi, BLOCK_N):
                m, l_sum, acc = _attend_tile(
                    t0, hi, m, l_sum, acc, q1, q2, k_seq, v_seq, k_at, ks_at, v_at, vs_at, k_row, ks_row, v_row,
                    vs_row, qk_scale, D1, D2, DV, SCALE2, FP8, V_IS_K, IEEE, dtype, BLOCK_N, BLOCK_D1, BLOCK_D2,
                    BLOCK_DV,
                )  # fmt: skip

        keep = g_ok[:, None] & (dv < DV)[None, :]
        if DIRECT:  # one split: this is the answer
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            hq: tl.constexpr = KV_HEADS * GROUP
            target = out_ptr + b.to(tl.int64) * (hq * DV) + heads[:, None] * DV + dv[None, :]
            tl.store(target, out.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            row = (b.to(tl.int64) * (KV_HEADS * GROUP) + heads) * splits + split
            tl.store(part_acc + row[:, None] * DV + dv[None, :], acc, mask=keep)
            tl.store(part_m + row, m, mask=g_ok)
            tl.store(part_l + row, l_sum, mask=g_ok)

    @triton.jit(do_not_specialize=["splits"])
    def _combine_kernel(
        part_acc, part_m, part_l, out_ptr, splits,
        DV: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """Program (``r`` = b * Hq + h, column block): the splits' partial outputs weighted by their maxima.
        Every split count up to ``MAX_SPLITS`` shares one compilation (masked lanes read nothing)."""
        r = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, MAX_SPLITS)
        dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ok = s < splits
        m = tl.load(part_m + r * splits + s, mask=ok, other=float("-inf"))
        # Split 0 always holds a key, so the max is finite; an empty split weighs nothing.
        weight = tl.where(m > float("-inf"), tl.exp2(m - tl.max(m, 0)), 0.0)
        total = tl.sum(weight * tl.load(part_l + r * splits + s, mask=ok, other=0.0), 0)
        tile = tl.load(
            part_acc + (r * splits + s)[:, None] * DV + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0
        )
        out = tl.sum(weight[:, None] * tile, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + r * DV + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


class InPlaceRows(Protocol):
    """A paged row store read in place (:class:`moetier.models.paged_kv.PagedKVRows`)."""

    groups: tuple[int, ...]

    def pool_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def token_rows(self, end: int) -> torch.Tensor: ...


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dim >= 16


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests exercise the combine
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def choose_splits(programs: int, max_len: int, block_n: int, sm_count: int) -> int:
    """Splits of the context for ``programs`` (sequence, KV head, head block) programs: about two programs
    per SM in all, each split at least :data:`_MIN_SPLIT_TILES` tiles long."""
    tiles = max(1, math.ceil(max_len / block_n))
    want = math.ceil(2 * sm_count / max(1, programs))
    splits = max(1, min(want, tiles // _MIN_SPLIT_TILES, _MAX_SPLITS))
    return math.ceil(tiles / math.ceil(tiles / splits))  # no split left empty by the rounding


def _heads_view(data: torch.Tensor) -> torch.Tensor:
    """``[rows, width]`` (one KV head) as ``[rows, 1, width]``; ``[rows, heads, width]`` as it is."""
    return data[:, None] if data.dim() == 2 else data


def paged_decode_attention(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scales: torch.Tensor | None,
    k_index: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    scale: float,
    v_data: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    v_index: torch.Tensor | None = None,
    d1: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged rows -> ``[B, Hq * Dv]`` in ``q``'s dtype.

    ``q`` ``[B, Hq, Dk]``; rows, scales and indexes as the module docstring says; ``max_len`` is the
    longest of ``lengths`` (host int: it sizes the splits; every length must be >= 1). ``v_data`` None:
    the values are the first ``d1`` key columns (MLA); otherwise ``d1`` defaults to the key width.
    ``k_scales``' groups must be one (the whole key) or two (``d1`` and the rest). ``splits`` forces the
    split count (tests). Callers check :func:`paged_attention_usable` first.
    """
    batch, hq = q.shape[:2]
    keys = _heads_view(k_data)
    kv_heads, width = keys.shape[1], keys.shape[2]
    d1 = width if d1 is None else d1
    d2, dv = width - d1, (d1 if v_data is None else v_data.shape[-1])
    values = keys if v_data is None else _heads_view(v_data)
    group = hq // kv_heads
    fp8 = keys.dtype == torch.float8_e4m3fn
    raw_k = keys.view(torch.uint8) if fp8 else keys
    raw_v = values.view(torch.uint8) if fp8 else values
    ks = _heads_view(k_scales) if fp8 else raw_k
    vs = _heads_view(v_scales) if fp8 and v_data is not None else ks
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_h = min(_pow2(group), 16 if max(d1, dv) > 256 else 64)
    # Wide rows (MLA) and float32 tiles: 32 keys a tile keeps them in registers (64 spills, sm_90's ptxas).
    block_n = 32 if max(d1, dv) > 256 or q.dtype == torch.float32 else 64
    programs = batch * kv_heads * math.ceil(group / block_h)
    if splits is None:
        splits = choose_splits(programs, max_len, block_n, _sm_count(q.device))
    splits = max(1, min(splits, _MAX_SPLITS))
    split_tokens = math.ceil(math.ceil(max_len / splits) / block_n) * block_n
    out = torch.empty(batch, hq * dv, dtype=q.dtype, device=q.device)
    direct = splits == 1
    part_acc = out if direct else torch.empty(batch * hq * splits, dv, dtype=torch.float32, device=q.device)
    part_m = out if direct else torch.empty(batch * hq * splits, dtype=torch.float32, device=q.device)
    part_l = out if direct else torch.empty_like(part_m)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    ieee = q.dtype == torch.float32 or interpret
    big = max(d1, dv) > 128
    _split_kernel[(programs, splits)](
        q, raw_k, ks, k_index, raw_v, vs, k_index if v_index is None else v_index, lengths,
        part_acc, part_m, part_l, out,
        scale * _LOG2E, split_tokens, splits, batch,
        q.stride(0), q.stride(1), raw_k.stride(0), raw_k.stride(1), ks.stride(0), ks.stride(1),
        raw_v.stride(0), raw_v.stride(1), vs.stride(0), vs.stride(1),
        GROUP=group, KV_HEADS=kv_heads, D1=d1, D2=d2, DV=dv,
        SCALE2=1 if fp8 and ks.shape[-1] == 2 else 0, FP8=fp8, V_IS_K=v_data is None, DIRECT=direct,
        IEEE=ieee, INTERPRET=interpret, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_D1=_pow2(d1), BLOCK_D2=_pow2(d2) if d2 else 16, BLOCK_DV=_pow2(dv),
        num_warps=8 if big else 4, num_stages=2,  # two stages: fp8 tiles pipelined in fewer registers than three
    )  # fmt: skip
    if not direct:
        block_dv = min(_COMBINE_COLUMNS, _pow2(dv))
        _combine_kernel[(batch * hq, triton.cdiv(dv, block_dv))](
            part_acc, part_m, part_l, out, splits, DV=dv, MAX_SPLITS=_MAX_SPLITS, BLOCK_DV=block_dv
        )  # fmt: skip
    return out


def paged_attention_usable(
    q: torch.Tensor,
    keys: Sequence[InPlaceRows],
    values: Sequence[InPlaceRows] | None = None,
    d1: int | None = None,
) -> bool:
    """Whether :func:`try_paged_attention` can serve ``q`` ``[B, Hq, Dk]`` over these per-sequence stores:
    Triton on CUDA (or the interpreter), paged stores of one pool for the keys (and one for the values), in
    layouts the kernel reads. ``values`` None: MLA, the values are the first ``d1`` key columns."""
    if _BROKEN or triton is None or not triton_usable(q) or q.dim() != 3 or q.dtype not in _DTYPES:
        return False
    k_shape = _pool_shape(q, keys, d1)
    if k_shape is None or q.shape[-1] != k_shape[1] or q.shape[1] % k_shape[0]:
        return False
    if values is None:
        return d1 is not None and 0 < d1 <= k_shape[1]
    v_shape = _pool_shape(q, values, None)
    return v_shape is not None and v_shape[0] == k_shape[0] and d1 in (None, k_shape[1])


def _pool_shape(q: torch.Tensor, stores: Sequence[InPlaceRows], d1: int | None) -> tuple[int, int] | None:
    """(KV heads, width) of ``stores`` when they are paged, all of one pool, in a layout the kernel reads."""
    if not stores or not all(hasattr(s, "pool_rows") and s.data is stores[0].data for s in stores):
        return None  # contiguous stores, or stores of different pools
    data, scales = stores[0].pool_rows()
    if data.dtype not in _STORAGE or data.dim() not in (2, 3) or data.device != q.device:
        return None
    width = data.shape[-1]
    groups = tuple(stores[0].groups)
    # fp8: one scale group per kernel part (the whole row, or the first d1 columns and the rest).
    if scales is not None and groups != (width,) and not (len(groups) == 2 and groups[0] == d1):
        return None
    return (data.shape[1] if data.dim() == 3 else 1), width


def try_paged_attention(
    q: torch.Tensor,
    keys: Sequence[InPlaceRows],
    values: Sequence[InPlaceRows] | None,
    lengths: Sequence[int],
    lengths_dev: torch.Tensor,
    scale: float,
    d1: int | None = None,
) -> torch.Tensor | None:
    """:func:`paged_decode_attention` over per-sequence stores already written this step -> ``[B, Hq * Dv]``,
    or None when the kernel failed (it stays off; the caller gathers). ``lengths``: each sequence's keys
    (host ints), equal to ``lengths_dev`` (their device copy, e.g. positions + 1: no host-to-device copy)."""
    try:
        k_data, k_scales = keys[0].pool_rows()  # after the writes: a write may have grown the pool
        k_index = _concat_index(keys, lengths)
        v_data = v_scales = v_index = None
        if values is not None:
            v_data, v_scales = values[0].pool_rows()
            v_index = _concat_index(values, lengths)
        return paged_decode_attention(
            q, k_data, k_scales, k_index, lengths_dev, max(lengths), scale, v_data, v_scales, v_index, d1
        )
    except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
        _BROKEN.append(str(exc))
        log.warning("paged attention kernel failed (%s); gathering KV for attention from now on", exc)
        return None


def _concat_index(stores: Sequence[InPlaceRows], lengths: Sequence[int]) -> torch.Tensor:
    """The pool rows of every sequence's tokens, sequence after sequence (one sequence: a view, no copy)."""
    parts = [s.token_rows(n) for s, n in zip(stores, lengths, strict=True)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
