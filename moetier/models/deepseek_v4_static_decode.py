"""DeepSeek-V4 decode attention in fixed shapes: one token per sequence, no host decision, CUDA-graph replayable.

The eager decode core (:mod:`deepseek_v4_attention_decode`) lets the host decide each step: whether a
compressor's window closes, how many entries there are, whether the indexer runs. Here the device decides
from the step's positions, so the same ops run every step and a layer's whole step (projections, attention,
output, routing) is one graph (:mod:`deepseek_v4_step`). Per sequence ``b`` at position ``p``:

- the window key goes to ring row ``p % window`` (:class:`SlidingWindowKV`); every ring row is a key, those
  past ``p`` masked while the ring is not yet full;
- each compressor stores its row at ``p % rate`` and pools the open window every step, masked to its rows so
  far (the previous window's first half joins for CSA); the entry is written at ``p // rate`` only where the
  window closes (:meth:`KVRows.write_where`), and the predecessor half replaced there too;
- the compressed keys are the first ``bucket`` entries, masked to the complete ones (``w < (p + 1) // rate``);
  a CSA layer with more than ``index_topk`` of them lets the indexer score all ``bucket`` and reads back the
  top-k (invisible ones score -inf and stay masked);
- one masked sink attention over window and compressed keys, batched over the sequences.

``bucket`` (:func:`entry_bucket`, a power of two at least every sequence's entry count after the step) is the
one shape that changes with the context: the graph is keyed by it, so a long session captures a layer a
handful of times. Masked keys are zeroed before both products (unwritten rows hold anything), so a masked
key adds exactly nothing. Key order differs from the eager core's (ring order, top-k order), which only
changes the sums' rounding. The host mirrors the counts afterwards (:func:`advance`).

It runs on contiguous entry stores (fixed addresses); paged stores keep the eager core (:func:`supports`).
Sequences of different capacities batch together: a store shorter than the bucket is read whole and padded
with zero rows, which the masks hide (a sequence never has entries past its own capacity).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moetier.kernels import v4_attention as attn_kernel
from moetier.kernels import v4_compress as compress_kernel
from moetier.models.cache import KVRows
from moetier.models.deepseek_v4_cache import CompressorState, LayerCache
from moetier.models.deepseek_v4_decode import SCORE_DTYPES
from moetier.models.deepseek_v4_rope import RotaryTable, Rotation, rotate_

if TYPE_CHECKING:
    from moetier.models.deepseek_v4_attention import Compressor, DeepseekV4Attention, Projections


MIN_BUCKET = 16  # entries a layer reads at least: fewer captures at the start of a sequence


def supports(states: list[LayerCache]) -> bool:
    """Whether these sequences' states (one layer's) suit the fixed-shape step: contiguous entry stores (fixed
    addresses), of any capacities."""
    return all(type(s.entries) is KVRows for state in states for s in (state.compressor, state.indexer) if s)


def entry_capacity(states: list[LayerCache]) -> int:
    """The largest entry capacity among these sequences' compressor stores (0 without a compressor)."""
    return max((s.compressor.entries.capacity for s in states if s.compressor is not None), default=0)


def entry_bucket(states: list[LayerCache]) -> int:
    """Entries the step reads per sequence: a power of two (at least :data:`MIN_BUCKET`) covering every
    sequence's entry count once this step's row is in, at most the largest store's capacity; 0 without a
    compressor."""
    if states[0].compressor is None:
        return 0
    count = max(s.compressor.count + (s.compressor.n_open + 1 == s.compressor.rate) for s in states)
    bucket = MIN_BUCKET
    while bucket < count:
        bucket *= 2
    return min(bucket, entry_capacity(states))


def attend(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    index_q: torch.Tensor | None,
    inputs: Projections,
    positions: torch.Tensor,
    table: RotaryTable,
    states: list[LayerCache],
    bucket: int,
) -> torch.Tensor:
    """One token per sequence (``positions`` ``[B]`` on the device) appended to ``states`` and attended ->
    ``[B, heads, head_dim]`` (still rotated). Capturable for fixed ``states`` and ``bucket``; call
    :func:`advance` after (outside any graph). Where the attention kernel runs (:mod:`moetier.kernels.v4_attention`),
    the window's write, the masks and the sink attention are one launch a sequence."""
    if _kernel_fits(attn, q, inputs, positions, states, bucket):  # compressors and CSA's picks as below, the kernel
        ids = None
        if attn.compressor is not None:
            ids = _step_compressors(attn, index_q, inputs, positions, table, states, bucket)
        out = torch.empty_like(q)
        for step in _attention_steps(attn, q, inputs, positions, states, ids, bucket, out):
            attn_kernel.attend(step)
        return out
    keys, valid = _window_step([s.window for s in states], inputs.kv, positions)
    if attn.compressor is not None:
        entries, visible = _compressed_keys(attn, index_q, inputs, positions, table, states, bucket)
        keys, valid = torch.cat([keys, entries], dim=1), torch.cat([valid, visible], dim=1)
    keys = keys.masked_fill(~valid[..., None], 0)
    logits = torch.bmm(q, keys.transpose(1, 2)).mul_(attn.scale).masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([logits, attn.sink_logits(len(states))], dim=-1), dim=-1).to(q.dtype)
    return torch.bmm(probs[..., :-1], keys)


def _kernel_fits(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    inputs: Projections,
    positions: torch.Tensor,
    states: list[LayerCache],
    bucket: int,
) -> bool:
    """Whether every sequence's attention suits the kernel: few enough keys (the bucket, or CSA's top-k), entries
    in the model's dtype (fp8 stores: as read out for it), none read out here."""
    if not attn_kernel.usable(q):
        return False
    slots = bucket if attn.indexer is None or bucket <= attn.indexer.topk else attn.indexer.topk
    steps = _attention_steps(attn, q, inputs, positions, states, None, slots, check=True)
    return all(attn_kernel.fits(step) for step in steps)


def _attention_steps(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    inputs: Projections,
    positions: torch.Tensor,
    states: list[LayerCache],
    ids: torch.Tensor | None,
    bucket: int,
    out: torch.Tensor | None = None,
    check: bool = False,
) -> list[attn_kernel.AttentionStep]:
    """Each sequence's attention for the kernel: its ring, key and position, its entries (all ``bucket`` slots, or
    its row of CSA's picks ``ids``), into its row of ``out``. With ``check``, only what :func:`attn_kernel.fits`
    reads (an fp8 store's rows are not read out)."""
    rate = 1 if attn.compressor is None else attn.compressor.rate
    sinks = attn.sink_logits(1)[0, :, 0]
    steps = []
    for b, state in enumerate(states):
        picks = None if ids is None else ids[b]
        entries, gathered = None, False
        if attn.compressor is not None:
            entries, gathered = _kernel_entries(state.compressor.entries, bucket, picks, q, check)
        steps.append(
            attn_kernel.AttentionStep(
                q[b],
                state.window.buffer,
                inputs.kv[b],
                positions[b : b + 1],
                entries,
                picks,
                bucket,
                rate,
                sinks,
                attn.scale,
                None if out is None else out[b],
                gathered,
            )  # fmt: skip
        )
    return steps


def _kernel_entries(
    store: KVRows, bucket: int, picks: torch.Tensor | None, q: torch.Tensor, check: bool
) -> tuple[torch.Tensor, bool]:
    """A sequence's entries as the kernel reads them, and whether they are its picks read out: a store in the model's
    dtype as it is (the kernel reads the rows it needs); an fp8 store's first ``bucket`` rows, or its ``picks``,
    converted (one kernel, as the torch path reads them; with ``check`` an empty stand-in of the model's dtype)."""
    if store.scales is None:
        return store.data, False
    if check:
        return q.new_empty((0, q.shape[-1])), False
    if picks is None:
        return _read_padded(store, bucket), False
    return _read_picked(store, picks), True


def advance(states: list[LayerCache]) -> None:
    """The host's counts after a step of :func:`attend` (the device wrote the rows)."""
    for state in states:
        state.window.advance()
        for store in (state.compressor, state.indexer):
            if store is not None:
                store.advance()


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _window_step(windows: list, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's key into its ring; the rings ``[B, window, D]`` and which rows hold keys ``[B, window]``."""
    size = windows[0].size
    rows = positions % size
    for b, window in enumerate(windows):
        window.buffer.index_copy_(0, rows[b : b + 1], kv[b : b + 1])
    valid = torch.arange(size, device=positions.device)[None, :] <= positions[:, None]
    return _stack([w.buffer for w in windows]), valid


def _compress_step(
    compressor: Compressor, states: list[CompressorState], kv_gate: torch.Tensor, positions: torch.Tensor, table
) -> None:
    """Each sequence's row into its open window; the window pooled (masked to its rows so far), rotated at
    its entry's position, and written as entry ``p // rate`` where it closes. Where the compressor kernel runs
    (:mod:`moetier.kernels.v4_compress`), two launches a sequence."""
    rate, width, dim = compressor.rate, states[0].width, compressor.dim
    capacities = [state.entries.capacity for state in states]
    largest = max(capacities)
    if compress_kernel.usable(kv_gate):
        rows = table.entry_table(max(largest, 1), rate, kv_gate.dtype)
        norm = compressor.norm
        for b, state in enumerate(states):
            compress_kernel.compress_decode(compress_kernel.CompressorStep(
                state.open, state.prev_kv, state.prev_gate, compressor.ape, norm.weight, norm.eps, kv_gate[b : b + 1],
                positions[b : b + 1], rows, state.entries, compressor.overlap, rate, width, dim,
            ))  # fmt: skip
        return
    slot = positions % rate
    for b, state in enumerate(states):
        state.open.index_copy_(0, slot[b : b + 1], kv_gate[b : b + 1])
    if largest == 0:  # sequences shorter than one window: no entry will close
        return
    opens = _stack([s.open for s in states])  # [B, rate, 2 * width]
    empty = (torch.arange(rate, device=positions.device)[None, :] > slot[:, None])[..., None]
    kv = opens[..., :width].masked_fill(empty, 0)
    gate = (opens[..., width:] + compressor.ape.float()).masked_fill(empty, float("-inf"))
    closing = slot == rate - 1
    if compressor.overlap:
        prev_kv = _stack([s.prev_kv[0] for s in states])
        prev_gate = _stack([s.prev_gate[0] for s in states])
        pooled_kv = torch.cat([prev_kv, kv[..., dim:]], dim=1)
        pooled_gate = torch.cat([prev_gate, gate[..., dim:]], dim=1)
        for b, state in enumerate(states):  # after the reads above: a closing window becomes the predecessor
            close = closing[b : b + 1, None, None]
            state.prev_kv.copy_(torch.where(close, kv[b : b + 1, :, :dim], state.prev_kv))
            state.prev_gate.copy_(torch.where(close, gate[b : b + 1, :, :dim], state.prev_gate))
        kv, gate = pooled_kv, pooled_gate
    pooled = compressor._pool(kv, gate)
    at = (positions // rate).clamp(max=largest - 1)  # past the last entry only while not closing
    rotation = table.entry_table(largest, rate, pooled.dtype).index_select(0, at)
    rotate_(pooled, Rotation(*rotation.unbind(1)))
    for b, (state, capacity) in enumerate(zip(states, capacities, strict=True)):
        if capacity == 0:  # this sequence closes no window before it ends
            continue
        row = at[b : b + 1] if capacity == largest else at[b : b + 1].clamp(max=capacity - 1)
        state.entries.write_where(row, pooled[b : b + 1], closing[b : b + 1])  # a closing row is < capacity


def _compressed_keys(
    attn: DeepseekV4Attention,
    index_q: torch.Tensor | None,
    inputs: Projections,
    positions: torch.Tensor,
    table: RotaryTable,
    states: list[LayerCache],
    bucket: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys this step attends per sequence and whether each may be ``[B, n, D]``, ``[B, n]``."""
    ids = _step_compressors(attn, index_q, inputs, positions, table, states, bucket)
    visible = _visible(positions, attn.compressor.rate, bucket)
    if ids is None:  # every entry so far (CSA: the top-k of all of them)
        return _stack([_read_padded(s.compressor.entries, bucket) for s in states]), visible
    picked = _stack([_read_picked(s.compressor.entries, ids[b]) for b, s in enumerate(states)])
    return picked, visible.gather(1, ids)


def _visible(positions: torch.Tensor, rate: int, bucket: int) -> torch.Tensor:
    """``[B, bucket]``: which of the first ``bucket`` entries are complete for each sequence's query."""
    return torch.arange(bucket, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]


def _step_compressors(
    attn: DeepseekV4Attention,
    index_q: torch.Tensor | None,
    inputs: Projections,
    positions: torch.Tensor,
    table: RotaryTable,
    states: list[LayerCache],
    bucket: int,
) -> torch.Tensor | None:
    """Each compressor's step (the indexer's too); CSA with more than ``index_topk`` entries in the bucket: the
    indexer's ``[B, topk]`` picks among them, else None (every entry of the bucket is attended)."""
    compressor, indexer = attn.compressor, attn.indexer
    _compress_step(compressor, [s.compressor for s in states], inputs.kv_gate, positions, table)
    if indexer is not None:
        _compress_step(indexer.compressor, [s.indexer for s in states], inputs.index_kv_gate, positions, table)
    if indexer is None or bucket <= indexer.topk:
        return None
    keys = _stack([_read_padded(s.indexer.entries, bucket) for s in states])
    if keys.dtype not in SCORE_DTYPES:
        keys = keys.float()
    return select(indexer, index_q, inputs.index_weights, keys, _visible(positions, compressor.rate, bucket))


def _read_padded(entries: KVRows, bucket: int) -> torch.Tensor:
    """The first ``bucket`` rows ``[bucket, D]``; a store with fewer rows is read whole and padded with zero rows
    (entries it never has: masked)."""
    rows = entries.read(min(bucket, entries.capacity))
    return rows if rows.shape[0] == bucket else F.pad(rows, (0, 0, 0, bucket - rows.shape[0]))


def _read_picked(entries: KVRows, ids: torch.Tensor) -> torch.Tensor:
    """The rows at ``ids`` ``[k]``; picks past a shorter store's rows (invisible, masked) read its last row, and a
    store with no rows reads zeros."""
    if entries.capacity == 0:
        return torch.zeros(ids.shape[0], entries.data.shape[-1], dtype=entries.dtype, device=ids.device)
    return entries.read_at(ids.clamp(max=entries.capacity - 1))


def select(indexer, index_q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor):
    """The indexer's ``[B, topk]`` picks among ``keys`` ``[B, bucket, dim]``: entries not ``visible`` score -inf
    (their keys zeroed first: unwritten rows hold anything)."""
    scores = indexer._scores(index_q, weights, keys.masked_fill(~visible[..., None], 0))
    return scores.masked_fill_(~visible, float("-inf")).topk(indexer.topk, dim=-1).indices
