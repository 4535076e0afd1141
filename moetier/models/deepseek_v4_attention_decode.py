"""DeepSeek-V4 decode's eager attention core (:meth:`DeepseekV4Attention.decode_attend`).

Contiguous entry stores take the fixed-shape step (:mod:`deepseek_v4_static_decode`), which a decode
step replays inside each layer's CUDA graph. Paged stores take the eager core below, because each
sequence's window and compressors grow and close at their own steps and its blocks move. It is bound by
the host: every op is a dispatch and a launch (~5-15 us) for a few microseconds of GPU work, so it is
written for few ops. One sequence takes a path of its own, without per-sequence lists, padding or masks;
several run batched over one padded key tensor (:mod:`deepseek_v4_decode`). Nothing here waits for the
device: counts are host ints, index tensors travel without a sync (:func:`host_ints`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetier.models import deepseek_v4_static_decode as static_decode
from moetier.models.deepseek_v4_cache import LayerCache, RowWrites
from moetier.models.deepseek_v4_decode import attend_padded, attend_rows
from moetier.models.deepseek_v4_rope import StepRope

if TYPE_CHECKING:
    from moetier.models.deepseek_v4_attention import DeepseekV4Attention, Projections


def decode_attend(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    index_q: torch.Tensor | None,
    inputs: Projections,
    rope: StepRope,
    states: list[LayerCache],
) -> torch.Tensor:
    """:meth:`DeepseekV4Attention.decode_attend`: one token per sequence -> ``[B, heads, head_dim]``. Contiguous
    states take the fixed-shape step (:mod:`deepseek_v4_static_decode`, the one a decode step's graph replays)."""
    if static_decode.supports(states):
        bucket = static_decode.entry_bucket(states)
        out = static_decode.attend(attn, q, index_q, inputs, rope.positions, rope.compress, states, bucket)
        static_decode.advance(states)
        return out
    if len(states) == 1:
        return _attend_one(attn, q, index_q, inputs, rope, states[0])
    return _attend_many(attn, q, index_q, inputs, rope, states)


def _attend_one(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    index_q: torch.Tensor | None,
    inputs: Projections,
    rope: StepRope,
    state: LayerCache,
) -> torch.Tensor:
    """One sequence: its window keys then its compressed entries (CSA: the top-k), unpadded."""
    writes = RowWrites()  # the window's and compressors' row copies in one launch
    keys = state.window.extend(inputs.kv, writes)
    entries = None
    if attn.compressor is not None:
        attn.compressor.decode(inputs.kv_gate, [state.compressor], rope, writes)
        emitted = state.compressor
        ids = None
        if attn.indexer is not None:
            states = [state.indexer]
            ids = attn.indexer.decode(inputs.index_kv_gate, inputs.index_weights, index_q, rope, states, writes)
            attn.check_counts(state)
        if ids is not None:  # more entries than the top-k (equal counts, checked): read back only those
            entries = emitted.emitted_at(ids[0])
        elif emitted.count:
            entries = emitted.emitted
    writes.flush()
    if entries is not None:
        keys = torch.cat([keys, entries])
    return attend_rows(q, keys, attn.sink_logits(1), attn.scale)


def _attend_many(
    attn: DeepseekV4Attention,
    q: torch.Tensor,
    index_q: torch.Tensor | None,
    inputs: Projections,
    rope: StepRope,
    states: list[LayerCache],
) -> torch.Tensor:
    """Several sequences: each one's rows into its own state, then one batched, padded attention."""
    writes = RowWrites()
    keys = [[state.window.extend(row, writes)] for state, row in zip(states, inputs.kv.split(1), strict=True)]
    if attn.compressor is not None:
        attn.compressor.decode(inputs.kv_gate, [state.compressor for state in states], rope, writes)
        ids = None
        if attn.indexer is not None:
            indexers = [state.indexer for state in states]
            ids = attn.indexer.decode(inputs.index_kv_gate, inputs.index_weights, index_q, rope, indexers, writes)
            for state in states:
                attn.check_counts(state)
        # CSA: a sequence with more than top-k entries reads back only those (its row of ``ids``), any other all
        tops = [None] * len(states) if ids is None else ids.unbind(0)
        topk = 0 if attn.indexer is None else attn.indexer.topk
        for parts, state, top in zip(keys, states, tops, strict=True):
            emitted = state.compressor
            if top is not None and emitted.count > topk:
                parts.append(emitted.emitted_at(top))
            elif emitted.count:
                parts.append(emitted.emitted)
    writes.flush()
    return attend_padded(q, keys, attn.sink_logits(len(states)), attn.scale, rope.key_masks, rope.zero_rows)
