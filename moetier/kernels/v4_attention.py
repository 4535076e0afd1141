"""DeepSeek-V4's fixed-shape decode attention (:mod:`moetier.models.deepseek_v4_static_decode`), two kernels a sequence.

In torch a V4 decode layer's attention core is ~20 kernels a step (the window key into its ring, the rows' masks,
zeroing masked keys, the logits' product, scale and mask, the sink's concatenation, the softmax, the cast and the
values' product): ~35 us of a 1-token step on the H200 for ~2 us of work, in every layer
(results/h200-20261204-eb488f1-stamps-rope-exact/ad9776c-angles). Here two launches a sequence (below; or one, one
program a head) do all of it: the new key is written to ring row ``p % window`` (and used in place of that row),
window rows past ``p`` are masked while the ring fills, compressed entries ``w`` are masked unless
``w < (p + 1) // rate`` (for CSA's top-k, the entries at ``ids``, read in place or, from an fp8 store, read out
first), and the softmax joins the per-head sink logit, all from the position on the device. A first version's
16-head tensor-core tiles made 4 programs a sequence: 20-25 us a call on the H200
(results/h200-20261204-f53dfd5-v4-attention-tiles).

The arithmetic keeps torch's roundings where they are cheap to keep: the logits are rounded to the model's dtype,
scaled, rounded again (as ``bmm`` then ``mul_`` in that dtype), and two passes over the keys give each key's
probability ``exp(l - m) / sum`` rounded to the dtype before the values' product (not an online softmax's
rescaled sums). What differs is the order of the float32 sums and the exponential, so bf16 outputs match the
torch ops to a rounding on CUDA (tested), and bit for bit under Triton's interpreter made to round as CUDA does.
Off CUDA the torch ops run (:func:`attend_reference`); the interpreter runs the kernel in the CPU tests.

One program a head reads every key in series, twice: past ~128 entries the torch ops' products win (a long
context's compressed entries: HCA's grow by one every 128 tokens, CSA attends its top-512 picks). The split kernels
(:func:`attend_split`) spread the keys: a first launch gives each (head, chunk of :data:`CHUNK_KEYS` keys) a program
that writes its logits and its chunk's (max, sum); a second gives each (head, slice of channels) a program that joins
the chunks' sums into the softmax's and multiplies the rounded probabilities into its channels of the values. The
tile kernels (:mod:`moetier.kernels.v4_attention_tiles`, the default) do the same with 16 heads a program on tensor
cores, so the keys are read once a tile of heads, and sum the values in groups of keys. The roundings are those of one
program a head; only the float32 sums are grouped otherwise. Measured on an H100, us a call
(results/h100-20261206-e18caff-attention-tiles; torch ops in brackets): 16 entries one program a head 32.3, split
15.9, tiles 11.3 [54.2]; CSA's top-512 picks 119.8, 32.8, 20.8 [52.1]; 1024 entries split 51.1, tiles 16.8 [56.2];
4096: 166.3, 20.7 [65.2]; 16384: 623.6, 57.9 [134.5].
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# Keys the kernels take (the tile kernels' workspace grows with them: 8 MiB at V4-Flash widths, a 2M-token HCA).
MAX_KEYS = 128 + 16384
# Keys the split kernels take where MOETIER_V4_ATTENTION=split: past ~1150 (linear between the measured 1024 and 4096
# entries) the torch ops were faster, since their second launch's programs each read every key in series.
SPLIT_KEYS = 128 + 1024
# Keys one program a head takes where MOETIER_V4_ATTENTION=no-split (the kernels before the split ones: an A/B).
PER_HEAD_KEYS = 128 + 128
KERNELS = ("per-head", "split", "tiles")
# Keys a program of the split kernels' first launch reads (its logits, max and sum); channels a program of the
# second multiplies (at most 64: a 512-wide head is 8 programs).
CHUNK_KEYS = 64
CHANNELS_PER_PROGRAM = 64

_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with the torch ops


@dataclass(frozen=True)
class AttentionStep:
    """One sequence's decode attention (:func:`attend`): its queries ``q`` ``[H, D]``, its window's ring ``ring``
    ``[W, D]`` and this step's key ``new_key`` ``[D]``, the position (int64 ``[1]`` on the device), its compressed
    entries (``entries`` ``[E, D]`` in the model's dtype, or None: ``slots`` of them, or the rows ``ids``), the
    compression ``rate``, the per-head ``sinks`` (float32 ``[H]``), the softmax ``scale``, where the output goes
    (``out`` ``[H, D]``, contiguous, or None: a fresh tensor), and whether ``entries`` are the rows ``ids`` already
    read out in their order (``gathered``: row ``j`` is entry ``ids[j]``, as an fp8 store's read of its picks gives
    them; else ``ids`` index ``entries``)."""

    q: torch.Tensor
    ring: torch.Tensor
    new_key: torch.Tensor
    position: torch.Tensor
    entries: torch.Tensor | None
    ids: torch.Tensor | None
    slots: int
    rate: int
    sinks: torch.Tensor
    scale: float
    out: torch.Tensor | None = None
    gathered: bool = False

    def parts(self) -> tuple:
        """The fields in their order (no copies: ``dataclasses.astuple`` would deep-copy the tensors)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def attend_reference(step: AttentionStep) -> torch.Tensor:
    """One sequence's decode attention with the torch ops -> ``[H, D]`` (see :func:`attend`)."""
    q, ring, new_key, position, entries, ids, slots, rate, sinks, scale, out, gathered = step.parts()
    size = ring.shape[0]
    ring.index_copy_(0, position % size, new_key[None])
    keys, valid = ring, torch.arange(size, device=ring.device) <= position
    count = slots if ids is None else ids.shape[0]
    if entries is not None and count:
        rows = torch.arange(count, device=ring.device) if ids is None else ids
        at = torch.arange(count, device=ring.device) if gathered else rows
        inside = at < entries.shape[0]
        at = at.clamp(max=max(entries.shape[0] - 1, 0))
        picked = entries.index_select(0, at) if entries.shape[0] else entries.new_zeros(count, entries.shape[1])
        seen = (rows < (position + 1) // rate) & inside
        keys, valid = torch.cat([keys, picked]), torch.cat([valid, seen])
    keys = keys.masked_fill(~valid[:, None], 0)
    logits = (q @ keys.T).mul_(scale).masked_fill_(~valid[None, :], float("-inf"))
    probs = torch.softmax(torch.cat([logits, sinks.float()[:, None]], dim=-1), dim=-1).to(q.dtype)
    result = probs[:, :-1] @ keys
    return result if out is None else out.copy_(result)


if triton is not None:

    @triton.jit
    def _logits(q, keys, valid, scale, ROUND: tl.constexpr):
        """One head's logits over a block of keys ``[S]`` (float32 sums of exact products), rounded as torch's
        ``bmm`` then ``mul_`` in the model's dtype."""
        s = tl.sum(keys.to(tl.float32) * q[None, :], axis=1)
        if ROUND:
            s = s.to(keys.dtype).to(tl.float32)
            s = (s * scale).to(keys.dtype).to(tl.float32)
        else:
            s = s * scale
        return tl.where(valid, s, float("-inf"))

    @triton.jit
    def _window_rows(start, p, W: tl.constexpr, S: tl.constexpr):
        """Ring rows ``start .. start + S`` and which of them count (not past ``p`` while the ring fills)."""
        r = start + tl.arange(0, S)
        return r, (r < W) & (r <= p)

    @triton.jit
    def _window_keys(ring, new_key, d, start, p, W: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
        """Ring rows ``start .. start + S``: zeros where masked (:func:`_window_rows`), the new key at its row."""
        r, valid = _window_rows(start, p, W, S)
        keys = tl.load(ring + r[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        keys = tl.where((r == p % W)[:, None], new_key[None, :], keys)
        return keys, valid

    @triton.jit
    def _entry_rows(
        ids, start, count, ready, capacity, S: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr
    ):  # fmt: skip
        """Entry slots ``start .. start + S``: the rows of ``entries`` they read (rows ``ids`` for CSA's top-k;
        ``GATHERED``: read out already, row ``j``) and which of them count (complete, inside the store)."""
        j = start + tl.arange(0, S)
        inside = j < count
        row = tl.load(ids + j, mask=inside, other=0) if PICKED else j
        at = j if GATHERED else row
        return at, inside & (row < ready) & (at < capacity)

    @triton.jit
    def _entry_keys(
        entries, ids, start, count, ready, capacity, d,
        S: tl.constexpr, D: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr,
    ):  # fmt: skip
        """Entry slots ``start .. start + S`` (:func:`_entry_rows`): zeros where not yet complete."""
        at, valid = _entry_rows(ids, start, count, ready, capacity, S, PICKED, GATHERED)
        keys = tl.load(entries + at[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        return keys, valid

    @triton.jit
    def _running_softmax(m, total, s):
        """The largest logit and the sum of ``exp(l - max)`` so far, ``(m, total)``, joined by a block's logits."""
        m_new = tl.maximum(m, tl.max(s, axis=0))
        return m_new, total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), axis=0)

    @triton.jit
    def _step_inputs(q, ring, new_key, position, rate, h, owner, W: tl.constexpr, D: tl.constexpr):
        """A head's program's start: the channels, the position, the entries complete, the head's query (float32)
        and the new key, written to its ring row by the ``owner`` program (every program reads it in that row's
        place)."""
        d = tl.arange(0, D)
        p = tl.load(position)
        query = tl.load(q + h * D + d).to(tl.float32)
        fresh = tl.load(new_key + d)
        if owner:
            tl.store(ring + (p % W) * D + d, fresh)
        return d, p, (p + 1) // rate, query, fresh

    @triton.jit
    def _attend_kernel(
        q, ring, new_key, position, entries, ids, sinks, out, capacity, rate, scale, slots,
        W: tl.constexpr, D: tl.constexpr, S: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr,
        ROUND: tl.constexpr,
    ):  # fmt: skip
        # The entry slots are a run-time count, looped over by ``while`` (Triton's interpreter cannot take a kernel
        # argument as a ``range`` bound): one compiled kernel as a long session's bucket doubles, where a
        # constexpr count compiled again (~1 s) at each doubling.
        # One program a head: a decode step's few keys (window + entries) are read by every head from L2, and
        # ~64 programs keep as many SMs busy where a [16-head] tensor-core tile kept 4 (20-25 us a call, H200).
        h = tl.program_id(0)
        d, p, ready, query, fresh = _step_inputs(q, ring, new_key, position, rate, h, h == 0, W, D)
        # Pass 1: the head's largest logit and the softmax's denominator (the sink included, as exp(sink - m)).
        m = tl.load(sinks + h)
        total = m * 0.0 + 1.0  # exp(sink - sink); a float32 tensor, as the loop carries it
        for start in range(0, W, S):
            keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
            s = _logits(query, keys, valid, scale, ROUND)
            m, total = _running_softmax(m, total, s)
        start = 0
        while start < slots:
            keys, valid = _entry_keys(entries, ids, start, slots, ready, capacity, d, S, D, PICKED, GATHERED)
            s = _logits(query, keys, valid, scale, ROUND)
            m, total = _running_softmax(m, total, s)
            start += S
        # Pass 2: the probabilities, rounded to the model's dtype as torch's ``.to(q.dtype)``, times the keys.
        acc = tl.zeros([D], tl.float32)
        for start in range(0, W, S):
            keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
            s = _logits(query, keys, valid, scale, ROUND)
            probs = (tl.exp(s - m) / total).to(keys.dtype).to(tl.float32)
            acc += tl.sum(probs[:, None] * keys.to(tl.float32), axis=0)
        start = 0
        while start < slots:
            keys, valid = _entry_keys(entries, ids, start, slots, ready, capacity, d, S, D, PICKED, GATHERED)
            s = _logits(query, keys, valid, scale, ROUND)
            probs = (tl.exp(s - m) / total).to(keys.dtype).to(tl.float32)
            acc += tl.sum(probs[:, None] * keys.to(tl.float32), axis=0)
            start += S
        tl.store(out + h * D + d, acc.to(out.dtype.element_ty))

    @triton.jit
    def _split_logits_kernel(
        q, ring, new_key, position, entries, ids, sinks, logits, stats, capacity, rate, scale, slots, splits,
        row_stride, W: tl.constexpr, D: tl.constexpr, S: tl.constexpr, C: tl.constexpr, WINDOW_SPLITS: tl.constexpr,
        PICKED: tl.constexpr, GATHERED: tl.constexpr, ROUND: tl.constexpr,
    ):  # fmt: skip
        # Program (head h, chunk i): chunks 0 .. WINDOW_SPLITS - 1 are the window's rows (C a chunk, the last one
        # masked past W), the rest the entry slots. Its logits go to the head's workspace row (window row r at r,
        # slot j at WINDOW_SPLITS * C + j, -inf where masked), its (max, sum) to ``stats[h, i]``. The max starts at
        # the head's sink logit, as the softmax's does: a chunk of masked keys gives (sink, 0), never exp(-inf + inf).
        h = tl.program_id(0)
        i = tl.program_id(1)
        d, p, ready, query, fresh = _step_inputs(q, ring, new_key, position, rate, h, (h == 0) & (i == 0), W, D)
        m = tl.load(sinks + h)
        total = m * 0.0
        row = logits + h * row_stride
        if i < WINDOW_SPLITS:
            for b in range(0, C // S):
                start = i * C + b * S
                keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
                s = _logits(query, keys, valid, scale, ROUND)
                r = start + tl.arange(0, S)
                tl.store(row + r, s, mask=r < W)
                m, total = _running_softmax(m, total, s)
        else:
            for b in range(0, C // S):
                start = (i - WINDOW_SPLITS) * C + b * S
                keys, valid = _entry_keys(entries, ids, start, slots, ready, capacity, d, S, D, PICKED, GATHERED)
                s = _logits(query, keys, valid, scale, ROUND)
                j = start + tl.arange(0, S)
                tl.store(row + WINDOW_SPLITS * C + j, s, mask=j < slots)
                m, total = _running_softmax(m, total, s)
        tl.store(stats + (h * splits + i) * 2, m)
        tl.store(stats + (h * splits + i) * 2 + 1, total)

    @triton.jit
    def _split_values_kernel(
        ring, new_key, position, entries, ids, sinks, logits, stats, out, capacity, rate, slots, splits, row_stride,
        W: tl.constexpr, D: tl.constexpr, DS: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
        WINDOW_SPLITS: tl.constexpr, PICKED: tl.constexpr, GATHERED: tl.constexpr,
    ):  # fmt: skip
        # Program (head h, channels c * DS ..): the softmax's max and denominator from the chunks' (max, sum), then
        # the probabilities (from the stored logits, rounded to the model's dtype) times its channels of every key.
        h = tl.program_id(0)
        d = tl.program_id(1) * DS + tl.arange(0, DS)
        p = tl.load(position)
        ready = (p + 1) // rate
        sink = tl.load(sinks + h)
        at = h * splits * 2
        m = sink
        start = 0
        while start < splits:
            i = start + tl.arange(0, 64)
            m = tl.maximum(m, tl.max(tl.load(stats + at + i * 2, mask=i < splits, other=float("-inf")), axis=0))
            start += 64
        total = tl.exp(sink - m)
        start = 0
        while start < splits:
            i = start + tl.arange(0, 64)
            chunk_m = tl.load(stats + at + i * 2, mask=i < splits, other=float("-inf"))
            chunk_total = tl.load(stats + at + i * 2 + 1, mask=i < splits, other=0.0)
            total += tl.sum(chunk_total * tl.exp(chunk_m - m), axis=0)
            start += 64
        fresh = tl.load(new_key + d)
        row = logits + h * row_stride
        acc = tl.zeros([DS], tl.float32)
        for start in range(0, W, S):
            keys, valid = _window_keys(ring, fresh, d, start, p, W, S, D)
            r = start + tl.arange(0, S)
            s = tl.load(row + r, mask=r < W, other=float("-inf"))
            probs = (tl.exp(s - m) / total).to(keys.dtype).to(tl.float32)
            acc += tl.sum(probs[:, None] * keys.to(tl.float32), axis=0)
        start = 0
        while start < slots:
            keys, valid = _entry_keys(entries, ids, start, slots, ready, capacity, d, S, D, PICKED, GATHERED)
            j = start + tl.arange(0, S)
            s = tl.load(row + WINDOW_SPLITS * C + j, mask=j < slots, other=float("-inf"))
            probs = (tl.exp(s - m) / total).to(keys.dtype).to(tl.float32)
            acc += tl.sum(probs[:, None] * keys.to(tl.float32), axis=0)
            start += S
        tl.store(out + h * D + d, acc.to(out.dtype.element_ty))


def keys_per_block(dim: int) -> int:
    """Keys a program reads at once: ``[keys, dim]`` of at most 16k values (64 a thread of 8 warps), at most 64."""
    return max(1, min(64, 16384 // dim))


def usable(q: torch.Tensor) -> bool:
    """Whether the kernel runs for queries like ``q`` (Triton on its device, and the kernel never failed)."""
    return triton_usable(q) and not _BROKEN


def key_count(step: AttentionStep) -> int:
    """The keys ``step`` attends: its window's rows and its entry slots (or CSA's picks)."""
    entries = 0 if step.entries is None else step.ids.shape[0] if step.ids is not None else step.slots
    return step.ring.shape[0] + entries


def fits(step: AttentionStep) -> bool:
    """Whether :func:`attend`'s arguments suit the kernels (else it runs the torch ops): at most :data:`MAX_KEYS`
    keys among them."""
    q, ring, new_key, position, entries, ids, slots, _, sinks, _, _, _ = step.parts()
    heads, dim = q.shape
    tensors = [q, ring, new_key] + ([] if entries is None else [entries])
    return (
        q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(t.dtype == q.dtype and t.is_contiguous() and t.device == q.device for t in tensors)
        and dim >= 16 and dim & (dim - 1) == 0 and dim <= 1024
        and ring.shape[1] == dim and new_key.shape == (dim,) and (entries is None or entries.shape[1] == dim)
        and position.dtype == torch.int64 and position.numel() == 1 and position.device == q.device
        and sinks.dtype == torch.float32 and sinks.shape == (heads,) and sinks.is_contiguous()
        and (ids is None or (ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()))
        and key_count(step) <= MAX_KEYS
    )  # fmt: skip


def _kernel_arguments(step: AttentionStep) -> tuple[torch.Tensor, torch.Tensor, int, int, dict]:
    """What both kernels take of ``step``: the entries' table and ids (stand-ins where none: never read, masked),
    the slot count, the entries' capacity and the constexprs of the keys' kind."""
    entries, ids = step.entries, step.ids
    slots = 0 if entries is None else (ids.shape[0] if ids is not None else step.slots)
    capacity = 0 if entries is None else entries.shape[0]
    table = entries if entries is not None and capacity else step.ring
    picks = ids if ids is not None else step.position
    kinds = {"PICKED": ids is not None, "GATHERED": step.gathered and ids is not None}
    return table, picks, slots, capacity, kinds


def attend_per_head(step: AttentionStep) -> torch.Tensor:
    """The kernel of one program a head (the caller checked :func:`fits`; see :func:`attend`)."""
    q, ring, new_key, position, _, _, _, rate, sinks, scale, out, _ = step.parts()
    heads, dim = q.shape
    out = torch.empty_like(q) if out is None else out
    table, picks, slots, capacity, kinds = _kernel_arguments(step)
    _attend_kernel[(heads,)](
        q, ring, new_key, position, table, picks, sinks, out, capacity, max(rate, 1), scale, slots,
        W=ring.shape[0], D=dim, S=keys_per_block(dim), ROUND=q.dtype != torch.float32,
        num_warps=8 if dim >= 256 else 4, **kinds,
    )  # fmt: skip
    return out


def attend_split(step: AttentionStep) -> torch.Tensor:
    """The split kernels, two launches (the caller checked :func:`fits`; see the module's docstring)."""
    q, ring, new_key, position, _, _, _, rate, sinks, scale, out, _ = step.parts()
    heads, dim = q.shape
    out = torch.empty_like(q) if out is None else out
    table, picks, slots, capacity, kinds = _kernel_arguments(step)
    window_splits = triton.cdiv(ring.shape[0], CHUNK_KEYS)
    splits = window_splits + triton.cdiv(slots, CHUNK_KEYS)
    row_stride = window_splits * CHUNK_KEYS + slots
    logits = torch.empty(heads, row_stride, device=q.device, dtype=torch.float32)
    stats = torch.empty(heads, splits, 2, device=q.device, dtype=torch.float32)
    shared = {"W": ring.shape[0], "D": dim, "C": CHUNK_KEYS, "WINDOW_SPLITS": window_splits, **kinds}
    _split_logits_kernel[(heads, splits)](
        q, ring, new_key, position, table, picks, sinks, logits, stats, capacity, max(rate, 1), scale, slots,
        splits, row_stride, S=min(keys_per_block(dim), CHUNK_KEYS), ROUND=q.dtype != torch.float32,
        num_warps=8 if dim >= 256 else 4, **shared,
    )  # fmt: skip
    channels = min(dim, CHANNELS_PER_PROGRAM)
    _split_values_kernel[(heads, dim // channels)](
        ring, new_key, position, table, picks, sinks, logits, stats, out, capacity, max(rate, 1), slots, splits,
        row_stride, DS=channels, S=max(1, min(64, 4096 // channels)), num_warps=4, **shared,
    )  # fmt: skip
    return out


_log = logging.getLogger(__name__)
_WARNED_CHOICES: set[str] = set()


def kernel_choice() -> str:
    """``MOETIER_V4_ATTENTION``: "no-split" (one program a head to :data:`PER_HEAD_KEYS` keys, the torch ops past:
    the kernels before the split ones), "split" (the split kernels to :data:`SPLIT_KEYS` keys, the torch ops past),
    else "auto" (the tile kernels of :mod:`moetier.kernels.v4_attention_tiles` to :data:`MAX_KEYS` keys: faster than
    either at every count measured, results/h100-20261206-e18caff-attention-tiles); read on every call (a CUDA graph
    reads it at its capture). The other two are an A/B's knobs; any other value is "auto", with one warning a value."""
    value = os.environ.get("MOETIER_V4_ATTENTION", "auto").strip().lower()
    if value in ("no-split", "split", "auto"):
        return value
    if value not in _WARNED_CHOICES:  # a typo in an A/B must not pass for the knob's value
        _WARNED_CHOICES.add(value)
        _log.warning("MOETIER_V4_ATTENTION=%r is not auto, split or no-split: running auto", value)
    return "auto"


def kernel_for(step: AttentionStep, choice: str | None = None) -> str | None:
    """The kernel :func:`attend` runs for ``step`` under ``choice`` (default :func:`kernel_choice`): one of
    :data:`KERNELS`, or None (the torch ops) past the choice's key count. The caller checked :func:`fits`."""
    choice, keys = choice or kernel_choice(), key_count(step)
    if choice == "no-split":
        return "per-head" if keys <= PER_HEAD_KEYS else None
    if choice == "split":
        return "split" if keys <= SPLIT_KEYS else None
    return "tiles"


def attend_triton(step: AttentionStep, kernel: str | None = None) -> torch.Tensor:
    """A kernel of :data:`KERNELS` (the caller checked :func:`fits`; see :func:`attend`): ``kernel``, or (None) the
    one :func:`kernel_for` names."""
    kernel = kernel or kernel_for(step) or "tiles"
    if kernel == "tiles":
        from moetier.kernels.v4_attention_tiles import attend_tiles  # it imports this module's parts

        return attend_tiles(step)
    return attend_split(step) if kernel == "split" else attend_per_head(step)


def _kernel_fits(step: AttentionStep) -> bool:
    """Whether a kernel takes ``step`` (Triton on its device, :func:`fits`, and a kernel for its key count under
    :func:`kernel_choice`)."""
    return triton_usable(step.q) and fits(step) and kernel_for(step) is not None


def attend(step: AttentionStep) -> torch.Tensor:
    """One sequence's decode attention (``step``'s) -> ``[H, D]`` (into ``step.out`` when given).

    ``q`` ``[H, D]`` attends its sliding window (``ring`` ``[W, D]``, the ring of
    :class:`~moetier.models.deepseek_v4_cache.SlidingWindowKV`, into which ``new_key`` ``[D]`` goes at row
    ``position % W`` first) and compressed entries (``entries`` ``[E, D]`` in the model's dtype, or None):
    entry slots ``0 .. slots - 1``, or the rows ``ids`` (``[k]`` int64, CSA's top-k), each masked unless its row
    is below ``(position + 1) // rate`` and ``E``. Per-head ``sinks`` (float32 ``[H]``) join the softmax; K = V.
    ``position`` is an int64 ``[1]`` on the device: nothing waits for the host, and a CUDA graph replays it. One
    kernel where Triton runs on ``q``'s device, else :func:`attend_reference`."""
    return kernel_or_reference(
        _BROKEN,
        "V4 decode attention kernel",
        _kernel_fits(step),
        lambda: attend_triton(step),
        lambda: attend_reference(step),
    )
