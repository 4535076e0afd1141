"""DeepSeek-V4 attention: a sliding window, plus compressed entries in CSA and HCA layers.

Every layer attends over its last ``sliding_window`` tokens. HCA layers also attend over all
*compressed entries* (one per ``rate`` tokens, a softmax-gated pool of the window's projections);
CSA layers pool overlapping windows (width ``2 * rate``, stride ``rate``) and a lightning indexer
keeps only the ``index_topk`` best entries per query. One shared head serves as key and value
(K = V), each head has a learned sink logit, and the output goes through a grouped projection.
RoPE in V4 rotates *interleaved* channel pairs of the trailing ``rope_head_dim`` channels.
Long prefills run the indexer and the attention in blocks of queries (:data:`QUERY_BLOCK_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetier.models.deepseek_v4_cache import CompressorState, LayerCache
from moetier.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from moetier.models.layers import RMSNorm


class V4RMSNorm(RMSNorm):
    """RMSNorm whose output keeps the input dtype even when its weight stays float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim without a weight (statistics in float32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass
class RotaryTable:
    """Inverse frequencies (``[rope_head_dim / 2]``) and cos/sin factor of one rope kind."""

    inv_freq: torch.Tensor
    factor: float

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, rope_head_dim / 2]`` (one angle per channel pair) at ``positions``, in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i+1)`` of the trailing ``2 * cos.shape[-1]`` channels of ``x``.

    ``cos``/``sin`` must broadcast against ``x[..., :rope_dim / 2]``; the leading (no-position)
    channels pass through. The rotation runs in float32 and is cast back to ``x.dtype``.
    """
    rot = 2 * cos.shape[-1]
    rope = x[..., -rot:].float().unflatten(-1, (-1, 2))
    even, odd = rope[..., 0], rope[..., 1]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rot], rotated.to(x.dtype)], dim=-1)


@dataclass
class StepRope:
    """Rotary inputs of one forward: token positions, their cos/sin per rope kind, and the compress table."""

    positions: torch.Tensor
    token: dict[str, tuple[torch.Tensor, torch.Tensor]]
    compress: RotaryTable


def visible_entries(positions: torch.Tensor, count: int, rate: int) -> torch.Tensor:
    """``[T, count]`` bool: entry ``w`` (tokens up to ``(w + 1) * rate - 1``) is complete for the query."""
    ready = (positions + 1) // rate
    return torch.arange(count, device=positions.device)[None, :] < ready[:, None]


# Prefill workspace: the query-side temporaries of one block (indexer scores, attention logits,
# gathered keys) are sized to stay within this many bytes, so a long prompt's attention needs a
# bounded workspace instead of O(chunk x context): 24 GB GPUs serve 100k+ token contexts.
QUERY_BLOCK_BYTES = 256 << 20


def query_blocks(tokens: int, bytes_per_query: int) -> list[slice]:
    """Consecutive row ranges covering ``tokens`` queries, each needing at most :data:`QUERY_BLOCK_BYTES`
    at ``bytes_per_query`` (but at least one query); a single range when everything fits (decode).

    Blocks differ in size by at most one query: no small tail block (an inefficient GEMM, and one
    whose BLAS kernel may round differently from its neighbours').
    """
    size = max(1, QUERY_BLOCK_BYTES // max(bytes_per_query, 1))
    if tokens <= size:
        return [slice(0, tokens)]
    count = -(-tokens // size)
    base, extra = divmod(tokens, count)
    stops = [(i + 1) * base + min(i + 1, extra) for i in range(count)]
    return [slice(start, stop) for start, stop in zip([0, *stops[:-1]], stops, strict=True)]


def indexer_query_bytes(heads: int, dim: int, entries: int, elem: int) -> int:
    """Estimated workspace of one indexer query over ``entries`` keys: its fp32 ``[heads, entries]``
    scores, the head-summed/masked rows and visibility, and its projected query."""
    return 4 * entries * (heads + 3) + heads * dim * (elem + 8)


def attention_query_bytes(heads: int, head_dim: int, keys: int, per_query_keys: int, elem: int) -> int:
    """Estimated workspace of one attention query over ``keys`` keys (window + compressed).

    fp32 logits over the keys and the sink, counted for its concatenated, masked and softmaxed copies
    plus the cast probabilities (16 bytes per logit); ``per_query_keys`` keys of its own (the sliding
    window, CSA's gathered entries) at ``head_dim``; the query and output rows (fp32 while normalised).
    """
    return 16 * heads * (keys + 1) + per_query_keys * head_dim * elem + heads * head_dim * (3 * elem + 8)


def workspace_bytes(cfg: DeepseekV4Config, layer: int, queries: int, context: int, elem: int) -> int:
    """Estimated peak transient bytes of ``layer``'s attention for ``queries`` new tokens ending at ``context``
    tokens, with ``elem``-byte activations. The cache's own tensors are not included.

    A stated estimate from the formulas that size the query blocks: the larger of one attention block
    and one indexer block (each at most :data:`QUERY_BLOCK_BYTES` unless one query alone needs more),
    plus the tensors held for all queries (projections, window keys, compressor temporaries, block
    outputs and their concatenation, indexer ids, HCA visibility) and the entries read as keys.
    """
    kind, rate = cfg.layer_types[layer], cfg.compress_rate(layer)
    entries = context // rate if rate else 0
    heads, dim, window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    compressed = min(cfg.index_topk, entries) if kind == CSA else entries
    gathered = compressed if kind == CSA else 0
    per_query = attention_query_bytes(heads, dim, window + compressed, window + gathered, elem)
    peak = _block_bytes(queries, per_query)
    held = queries * elem * (2 * cfg.hidden_size + cfg.q_lora_rank + 2 * dim)
    if kind != SLIDING:
        width = 2 * dim if kind == CSA else dim
        held += queries * width * (2 * elem + 8) + entries * dim * elem  # compressor; entries (fp8: dequantised)
    if kind == HCA:
        held += queries * entries  # visibility mask
    if kind == CSA:
        index = indexer_query_bytes(cfg.index_n_heads, cfg.index_head_dim, entries, elem)
        peak = max(peak, _block_bytes(queries, index))
        held += queries * (compressed * 9 + 2 * cfg.index_head_dim * (2 * elem + 8) + cfg.index_n_heads * 4)
        held += entries * cfg.index_head_dim * (elem + 4)  # the indexer's keys and their fp32 copy
    return peak + held


def _block_bytes(queries: int, per_query: int) -> int:
    """Bytes of the largest block :func:`query_blocks` makes of ``queries`` queries."""
    return min(queries, max(1, QUERY_BLOCK_BYTES // max(per_query, 1))) * per_query


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of ``dim`` channels (HCA; CSA with ``overlap``).

    Entry ``w`` is ``norm(sum_j softmax_j(gate_j + ape_j) * kv_j)`` over its window, rotated at position
    ``w * rate``. With ``overlap`` each token projects to ``2 * dim`` channels: the first half joins the
    *next* window's entry, the second half its own, so entries pool ``2 * rate`` tokens.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = V4RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, state: CompressorState, rope: RotaryTable) -> torch.Tensor:
        """Feed ``x`` (``[T, hidden]``) into ``state``; return every entry emitted so far ``[count, dim]``."""
        kv, gate, first = state.close_windows(self.wkv(x), self.wgate(x))
        if kv.shape[0]:
            gate = gate.float() + self.ape.float()
            if self.overlap:
                kv, gate = self._pair_with_previous(kv, gate, state)
            weights = torch.softmax(gate, dim=1).to(kv.dtype)
            pooled = self.norm((kv * weights).sum(dim=1))
            positions = (first + torch.arange(kv.shape[0], device=x.device)) * self.rate
            cos, sin = rope(positions, pooled.dtype)
            state.append(apply_interleaved_rope(pooled, cos, sin))
        return state.emitted

    def _pair_with_previous(
        self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, rate, 2*dim]`` windows -> ``[n, 2*rate, dim]``: previous window's first half, then own second half."""
        d = self.dim
        if state.prev_kv is None:  # the very first window has no predecessor: weight 0 via a -inf gate
            prev_kv = kv.new_zeros(1, self.rate, d)
            prev_gate = gate.new_full((1, self.rate, d), float("-inf"))
        else:
            prev_kv, prev_gate = state.prev_kv[None], state.prev_gate[None]
        state.prev_kv, state.prev_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        prev_kv = torch.cat([prev_kv, kv[:-1, :, :d]])
        prev_gate = torch.cat([prev_gate, gate[:-1, :, :d]])
        return torch.cat([prev_kv, kv[..., d:]], dim=1), torch.cat([prev_gate, gate[..., d:]], dim=1)


class Indexer(nn.Module):
    """Lightning indexer: scores ``sum_h w_h * relu(q_h . k)`` over its own compressed keys, keeps the top-k.

    Its compressor pools the same (overlapping) windows as the CSA compressor at ``index_head_dim``.
    Queries are scored in blocks (:func:`query_blocks`): the ``[queries, heads, entries]`` fp32 scores
    would otherwise grow with chunk x context (32 GiB for 4096 queries over 131072 tokens).
    """

    def __init__(self, cfg: DeepseekV4Config, rate: int) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.compressor = Compressor(cfg.hidden_size, self.dim, rate, overlap=True, eps=cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def forward(
        self, x: torch.Tensor, q_residual: torch.Tensor, rope: StepRope, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected entry ids ``[T, k]`` and whether each may be attended (``[T, k]`` bool).

        Every query row goes through the same operations whatever the block size, which only bounds
        the workspace (BLAS may round a row's dot products differently for another row count; ties
        fall as ``torch.topk`` breaks them within one row).
        """
        keys = self.compressor(x, state, rope.compress).float()
        cos, sin = rope.token["compress"]
        head_weights = self.weights_proj(x).float() * self.heads**-0.5
        per_query = indexer_query_bytes(self.heads, self.dim, keys.shape[0], x.element_size())
        picked = [
            self._select(q_residual[rows], cos[rows], sin[rows], head_weights[rows], rope.positions[rows], keys)
            for rows in query_blocks(x.shape[0], per_query)
        ]
        if len(picked) == 1:
            return picked[0]
        return torch.cat([ids for ids, _ in picked]), torch.cat([valid for _, valid in picked])

    def _select(
        self,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_weights: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k entry ids and their visibility for one block of queries (``keys`` fp32 ``[C, dim]``)."""
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.heads, self.dim)
        q = apply_interleaved_rope(q, cos[:, None], sin[:, None])
        # In place: one [block, heads, C] fp32 tensor alive, the same element-wise ops as relu(s) * c * w.
        scores = torch.einsum("thd,cd->thc", q.float(), keys)
        scores = scores.relu_().mul_(self.dim**-0.5).mul_(head_weights[..., None]).sum(dim=1)
        visible = visible_entries(positions, keys.shape[0], self.compressor.rate)
        ids = scores.masked_fill_(~visible, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return ids, visible.gather(1, ids)


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


class DeepseekV4Attention(nn.Module):
    """One layer's attention; parameter names follow the DeepSeek release checkpoint."""

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer]
        self.heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.o_groups, self.o_lora_rank, self.eps = cfg.o_groups, cfg.o_lora_rank, cfg.rms_norm_eps
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = V4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = self.heads * self.head_dim // self.o_groups
        self.wo_a = nn.Linear(group_in, self.o_groups * self.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.o_groups * self.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != SLIDING:
            rate = cfg.compress_rate(layer)
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, self.kind == CSA, cfg.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, cfg.compress_rate(layer))

    def forward(self, x: torch.Tensor, rope: StepRope, state: LayerCache) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normed) at ``rope.positions`` -> ``[T, hidden]``; appends to ``state``.

        Keys, compressors and the indexer see all ``T`` tokens at once (they roll the cache forward);
        queries then run in blocks (:func:`query_blocks`), one block when all fit, as in decode.
        """
        tokens = x.shape[0]
        cos, sin = rope.token[self.rope_kind]
        q_residual = self.q_norm(self.wq_a(x))
        kv = apply_interleaved_rope(self.kv_norm(self.wkv(x)), cos, sin)
        windows, window_mask = sliding_keys(state.window.extend(kv), tokens, self.window)
        compressed = None if self.compressor is None else self._compressed_keys(x, q_residual, rope, state)
        outs = []
        for rows in query_blocks(tokens, self._query_bytes(compressed, x.element_size())):
            key_sets = [(windows[rows], window_mask[rows])]
            if compressed is not None:
                key_sets.append(compressed.rows(rows))
            outs.append(self._attend(q_residual[rows], cos[rows], sin[rows], key_sets))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(
        self, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_sets: list[KeySet]
    ) -> torch.Tensor:
        """One block of queries: project, attend over ``key_sets``, project out -> ``[block, hidden]``."""
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.heads, self.head_dim)
        q = apply_interleaved_rope(rms_unweighted(q, self.eps), cos[:, None], sin[:, None])
        out = sink_attention(q, key_sets, self.attn_sink, self.head_dim**-0.5)
        # K = V carries rope on its trailing channels: rotate the output back by the query's angle.
        out = apply_interleaved_rope(out, cos[:, None], -sin[:, None])
        return self._project_out(out)

    def _query_bytes(self, compressed: CompressedKeys | None, elem: int) -> int:
        per_query = 0 if compressed is None else compressed.per_query
        gathered = 0 if compressed is None or compressed.ids is None else per_query
        return attention_query_bytes(self.heads, self.head_dim, self.window + per_query, self.window + gathered, elem)

    def _compressed_keys(
        self, x: torch.Tensor, q_residual: torch.Tensor, rope: StepRope, state: LayerCache
    ) -> CompressedKeys:
        entries = self.compressor(x, state.compressor, rope.compress)
        if self.indexer is None:  # HCA: every completed entry
            return CompressedKeys(entries, visible_entries(rope.positions, entries.shape[0], self.compressor.rate))
        ids, valid = self.indexer(x, q_residual, rope, state.indexer)
        if state.indexer.count != state.compressor.count:
            raise RuntimeError("CSA compressor and indexer disagree on the number of compressed entries")
        return CompressedKeys(entries, valid, ids)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: each head group maps to ``o_lora_rank`` channels, then one mix."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)
        weight = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1))
