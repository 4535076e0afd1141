"""DeepSeek-V4 decode attention: one new token per sequence, every key it has visible to it.

Decode of a few streams is bound by kernel launches, so the attention of all sequences runs as one
batched computation: each sequence's keys (its window, then its compressed entries) are copied into
one zero-padded ``[B, S, D]`` tensor and the padding is masked out of the softmax. A masked key's
probability is exactly zero and its (zero) value adds nothing, so each row gets the softmax of its
own keys; only the GEMMs' blocking over the longer padded rows may round differently.
"""

from __future__ import annotations

import torch

from moetier.models.layers import stack_padded

# Padding masks ``[B, S]`` (True = padding) by the sequences' key counts; several layers of one step
# share a key layout (every sliding layer; compressed layers of one rate), so they share the mask.
MaskCache = dict[tuple[int, ...], torch.Tensor]


def sink_attention_one(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of one query (``[H, D]``) over keys it sees in full (``[S, D]``, K = V), with a
    per-head sink logit that joins the normaliser but carries no value."""
    scores = torch.mm(q, keys.t()) * scale
    probs = torch.softmax(torch.cat([scores.float(), sinks.float()[:, None]], dim=-1), dim=-1).to(q.dtype)
    return torch.mm(probs[:, :-1], keys)


def padded_keys(keys: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """Each sequence's key parts (``[n, D]`` each, concatenated in order) in one zero-padded ``[B, S, D]``
    tensor, and each sequence's key count."""
    lengths = [sum(part.shape[0] for part in parts) for parts in keys]
    return stack_padded(keys), lengths


def padding_mask(lengths: list[int], device: torch.device, masks: MaskCache) -> torch.Tensor:
    """``[B, max(lengths)]`` bool, True past each sequence's ``lengths[b]`` keys (built once per layout)."""
    key = tuple(lengths)
    if key not in masks:
        counts = torch.tensor(lengths, device=device)
        masks[key] = torch.arange(max(lengths), device=device)[None, :] >= counts[:, None]
    return masks[key]


def sink_attention_decode(
    q: torch.Tensor, keys: list[list[torch.Tensor]], sinks: torch.Tensor, scale: float, masks: MaskCache
) -> torch.Tensor:
    """:func:`sink_attention_one` for ``B`` sequences at once: ``q`` ``[B, H, D]``, ``keys[b]`` the key parts
    of sequence ``b`` -> ``[B, H, D]``. One sequence runs unpadded (no mask, the fewest ops)."""
    if len(keys) == 1:
        parts = keys[0]
        return sink_attention_one(q[0], parts[0] if len(parts) == 1 else torch.cat(parts), sinks, scale)[None]
    padded, lengths = padded_keys(keys)
    tokens, heads = q.shape[:2]
    logits = torch.bmm(q, padded.transpose(1, 2)) * scale
    logits = logits.float()
    if min(lengths) != max(lengths):
        logits = logits.masked_fill_(padding_mask(lengths, q.device, masks)[:, None, :], float("-inf"))
    sink = sinks.float().view(1, heads, 1).expand(tokens, heads, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1).to(q.dtype)
    return torch.bmm(probs[..., :-1], padded)
