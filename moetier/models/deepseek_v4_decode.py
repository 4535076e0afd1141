"""DeepSeek-V4's sink attention over key sets: a prefill chunk's (:func:`sink_attention`, per-query
windows and compressed entries) and decode's (one new token per sequence, every key it has visible to it).

Decode of a few streams is bound by kernel launches, so the attention of all sequences runs as one
batched computation: each sequence's keys (its window, then its compressed entries) are laid out in
one zero-padded ``[B, S, D]`` tensor (one concatenation of every sequence's parts and its padding rows)
and the padding is masked out of the softmax. A masked key's probability is exactly zero and its (zero)
value adds nothing, so each row gets the softmax of its own keys; only the GEMMs' blocking over the
longer padded rows may round differently. Nothing here waits for the device: the masks' key counts
travel to it without a host sync (:func:`host_ints`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Key dtypes the indexer scores in directly; anything else (fp32, fp8 storage) is scored in fp32.
SCORE_DTYPES = (torch.bfloat16, torch.float16)
# Padding masks ``[B, S]`` (True = padding) by the sequences' key counts; several layers of one step
# share a key layout (every sliding layer; compressed layers of one rate), so they share the mask.
MaskCache = dict[tuple[int, ...], torch.Tensor]
# Zero rows to pad with, by (width, dtype, device): read only, so one block serves every layer of a step.
ZeroRows = dict[tuple[int, torch.dtype, torch.device], torch.Tensor]


def host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. To CUDA through pinned memory and a non-blocking copy:
    ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream to drain
    (a host sync in the middle of the step)."""
    cpu = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


def sink_attention_one(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of one query (``[H, D]``) over keys it sees in full (``[S, D]``, K = V), with a
    per-head sink logit that joins the normaliser but carries no value (:func:`attend_rows`)."""
    return attend_rows(q[None], keys, sink_column(sinks, 1), scale)[0]


def sink_column(sinks: torch.Tensor, batch: int) -> torch.Tensor:
    """The per-head sink logits ``[H]`` as decode's softmax joins them: float32 ``[batch, H, 1]`` (a view)."""
    return sinks.float().view(1, -1, 1).expand(batch, -1, 1)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`sink_attention_one` of ``q`` ``[1, H, D]``, the sinks as :func:`sink_column` gives them -> ``[1, H, D]``.

    Few ops, as decode wants: ``linear`` and ``matmul`` fold the leading 1 into the very ``mm`` of the
    ``[H, D]`` rows (same operands, same bits), the scale goes in place on the fresh logits, and the logits
    join the float32 sinks in one concatenation (a 16-bit model's logits are widened there, exactly as a
    cast would)."""
    scores = F.linear(q, keys).mul_(scale)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1).to(q.dtype)
    return torch.matmul(probs[..., :-1], keys)


def zero_rows(rows: int, like: torch.Tensor, zeros: ZeroRows) -> torch.Tensor:
    """``[rows, D]`` zeros of ``like``'s width, dtype and device, a view of a block kept in ``zeros``."""
    key = (like.shape[-1], like.dtype, like.device)
    block = zeros.get(key)
    if block is None or block.shape[0] < rows:
        block = zeros[key] = like.new_zeros(rows, like.shape[-1])
    return block[:rows]


def padded_keys(keys: list[list[torch.Tensor]], zeros: ZeroRows | None = None) -> tuple[torch.Tensor, list[int]]:
    """Each sequence's key parts (``[n, D]`` each, in order) in one zero-padded ``[B, S, D]`` tensor, and
    each sequence's key count: one concatenation of every part followed by its sequence's padding rows
    (views of one zero block, from ``zeros`` when given): one op whatever the number of sequences and parts."""
    lengths = [sum(part.shape[0] for part in parts) for parts in keys]
    longest, first = max(lengths), keys[0][0]
    pad = zero_rows(longest - min(lengths), first, {} if zeros is None else zeros) if min(lengths) < longest else None
    rows: list[torch.Tensor] = []
    for parts, length in zip(keys, lengths, strict=True):
        rows += parts
        if length < longest:
            rows.append(pad[: longest - length])
    return torch.cat(rows).view(len(keys), longest, first.shape[-1]), lengths


def padding_mask(lengths: list[int], device: torch.device, masks: MaskCache) -> torch.Tensor:
    """``[B, max(lengths)]`` bool, True past each sequence's ``lengths[b]`` keys (built once per layout)."""
    key = tuple(lengths)
    if key not in masks:
        counts = host_ints(lengths, device)
        masks[key] = torch.arange(max(lengths), device=device)[None, :] >= counts[:, None]
    return masks[key]


def sink_attention_decode(
    q: torch.Tensor,
    keys: list[list[torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
    masks: MaskCache,
    zeros: ZeroRows | None = None,
) -> torch.Tensor:
    """:func:`sink_attention_one` for ``B`` sequences at once: ``q`` ``[B, H, D]``, ``keys[b]`` the key parts
    of sequence ``b`` -> ``[B, H, D]``. One sequence runs unpadded (no mask, the fewest ops)."""
    if len(keys) == 1:
        parts = keys[0]
        return attend_rows(q, parts[0] if len(parts) == 1 else torch.cat(parts), sink_column(sinks, 1), scale)
    return attend_padded(q, keys, sink_column(sinks, len(keys)), scale, masks, zeros)


def attend_padded(
    q: torch.Tensor,
    keys: list[list[torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
    masks: MaskCache,
    zeros: ZeroRows | None = None,
) -> torch.Tensor:
    """:func:`sink_attention_decode` of several sequences over their zero-padded keys, the sinks as
    :func:`sink_column` gives them. Padding is masked in the logits' dtype (-inf is exact in any float
    dtype) before they join the float32 sinks."""
    padded, lengths = padded_keys(keys, zeros)
    logits = torch.bmm(q, padded.transpose(1, 2)).mul_(scale)
    if min(lengths) != max(lengths):
        logits = logits.masked_fill_(padding_mask(lengths, q.device, masks)[:, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1).to(q.dtype)
    return torch.bmm(probs[..., :-1], padded)


# One attended key set: keys shared by all queries ([S, D]) or per query ([T, S, D]), and a [T, S] mask.
KeySet = tuple[torch.Tensor, torch.Tensor]


@dataclass
class CompressedKeys:
    """The compressed entries ``[C, D]`` a layer's queries attend, gathered per block of queries.

    HCA: every entry, ``mask`` ``[T, C]`` marks the complete ones. CSA: ``ids`` ``[T, k]`` are each
    query's top-k entries and ``mask`` ``[T, k]`` whether each may be attended; the ``[T, k, D]``
    gather happens per block (2 GiB for 4096 queries of V4-Flash if done at once).
    """

    entries: torch.Tensor
    mask: torch.Tensor
    ids: torch.Tensor | None = None

    @property
    def per_query(self) -> int:
        """Compressed keys each query attends."""
        return self.mask.shape[1]

    def rows(self, rows: slice) -> KeySet:
        if self.ids is None:
            return self.entries, self.mask[rows]
        return self.entries[self.ids[rows]], self.mask[rows]


def sliding_keys(keys: torch.Tensor, num_queries: int, window: int) -> KeySet:
    """Per-query windows ``[T, window, D]`` over ``keys`` (cached tokens then the ``T`` new ones).

    Query ``i`` sees the ``window`` keys ending at its own position: O(T * window), not O(T^2).
    """
    missing = window - 1 - (keys.shape[0] - num_queries)  # fewer than window-1 cached tokens at the start
    padded = F.pad(keys, (0, 0, missing, 0))
    windows = padded.unfold(0, window, 1).transpose(1, 2)
    slot = torch.arange(window, device=keys.device)[None, :] + torch.arange(num_queries, device=keys.device)[:, None]
    return windows, slot >= missing


def sink_attention(q: torch.Tensor, key_sets: list[KeySet], sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` (``[T, H, D]``) over several key sets (K = V) plus a per-head sink logit.

    The sink joins the softmax normaliser but carries no value, so a head may attend to "nothing".
    """
    tokens, heads = q.shape[:2]
    logits = []
    for keys, mask in key_sets:
        pattern = "thd,sd->ths" if keys.dim() == 2 else "thd,tsd->ths"
        scores = torch.einsum(pattern, q, keys) * scale
        logits.append(scores.float().masked_fill(~mask[:, None, :], float("-inf")))
    logits.append(sinks.float().view(1, heads, 1).expand(tokens, heads, 1))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1).to(q.dtype)
    out, start = torch.zeros_like(q), 0
    for keys, _ in key_sets:
        size = keys.shape[-2]
        pattern = "ths,sd->thd" if keys.dim() == 2 else "ths,tsd->thd"
        out = out + torch.einsum(pattern, probs[..., start : start + size], keys)
        start += size
    return out
