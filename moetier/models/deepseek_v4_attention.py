"""DeepSeek-V4 attention: a sliding window, plus compressed entries in CSA and HCA layers.

Every layer attends over its last ``sliding_window`` tokens. HCA layers also attend over all
*compressed entries* (one per ``rate`` tokens, a softmax-gated pool of the window's projections);
CSA layers pool overlapping windows (width ``2 * rate``, stride ``rate``) and a lightning indexer
keeps only the ``index_topk`` best entries per query. One shared head serves as key and value
(K = V), each head has a learned sink logit, and the output goes through a grouped projection.
RoPE (:mod:`deepseek_v4_rope`) rotates interleaved channel pairs of the trailing ``rope_head_dim`` channels.
Long prefills run the indexer and the attention in blocks of queries (:data:`QUERY_BLOCK_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moetier.kernels.fp8_linear import grouped_reference
from moetier.kernels.rmsnorm import rms_norm
from moetier.models import deepseek_v4_attention_decode as attention_decode
from moetier.models.deepseek_v4_cache import CompressorState, LayerCache, RowWrites
from moetier.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from moetier.models.deepseek_v4_decode import (
    SCORE_DTYPES,
    CompressedKeys,
    KeySet,
    padded_keys,
    sink_attention,
    sink_column,
    sliding_keys,
)
from moetier.models.deepseek_v4_rope import Rotation, StepRope, rotate_
from moetier.models.fp8_linear import Fp8BlockLinear
from moetier.models.fused_linears import FusedLinears as FusedLinears  # re-exported: its home was here
from moetier.models.layers import RMSNorm


class V4RMSNorm(RMSNorm):
    """RMSNorm whose output keeps the input dtype even when its weight stays float32 (one fused kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_unweighted(x: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMS-normalise the last dim without a weight (statistics in float32), in ``out_dtype`` (default ``x``'s):
    ``rms_unweighted(x, eps, torch.float32)`` is ``rms_unweighted(x.float(), eps)`` without the extra cast."""
    return rms_norm(x, None, eps, out_dtype)


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
        # compressor (kv and weights, fp32 gate, its channels-first copy for the softmax, the softmax); entries
        # (fp8: dequantised)
        held += queries * width * (2 * elem + 12) + entries * dim * elem
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
    *next* window's entry, the second half its own, so entries pool ``2 * rate`` tokens. The attention
    layer projects the tokens (``wkv`` then ``wgate`` channels, fused with its other projections of ``x``).
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = V4RMSNorm(dim, eps)

    def forward(
        self,
        kv_gate: torch.Tensor,
        state: CompressorState | list[CompressorState],
        rope: StepRope,
        read: bool = True,
        writes: RowWrites | None = None,
    ) -> torch.Tensor | None:
        """Feed the tokens' projections ``kv_gate`` (``[T, 2 * width]``) into ``state``; return every entry
        emitted so far ``[count, dim]`` (None with ``read`` False: the caller reads what it needs). A step
        that closes no window only stores its row.

        Decode passes one state per row (a list): row ``i`` goes to ``state[i]`` (through ``writes``, flushed
        here only if a window closes), the windows the rows close are pooled together (one batched
        computation whatever the number of sequences closing one) and nothing is read (None)."""
        if isinstance(state, list):
            self.decode(kv_gate, state, rope, writes or RowWrites())
            return None
        closed = state.close_windows(kv_gate)
        if closed is not None:
            kv, gate, first = closed
            gate = gate + self.ape.float()  # float32 (the bias is kept in float32)
            if self.overlap:
                kv, gate = self._pair_with_previous(kv, gate, state)
            pooled = self._pool(kv, gate)
            state.append(rotate_(pooled, rope.entries(first, kv.shape[0], self.rate, pooled.dtype)))
        return state.emitted if read else None

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Windows ``[n, rows, dim]`` (kv, and the biased float32 gate) -> their normed entries ``[n, dim]``."""
        # Over the window's rows with the channels first: softmax over a middle dimension runs a kernel that loops
        # over the rows per channel (28-78 us a call at rate 128 on the H200, every decode step since the
        # fixed-shape step pools the open window each step); over the last dimension it is one warp per row.
        weights = torch.softmax(gate.transpose(1, 2), dim=-1).transpose(1, 2).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=1))

    def decode(self, kv_gate: torch.Tensor, states: list[CompressorState], rope: StepRope, writes: RowWrites) -> None:
        """One token per state (row ``i`` of ``kv_gate`` to ``states[i]``); the states whose window closes
        emit its entry, pooled as :meth:`forward` pools one state's windows (the same per-window math).
        Decode calls it directly (not through the module: fewer host calls)."""
        if len(states) == 1:  # one sequence: no split, no lists (it closes a window every ``rate`` steps)
            closing = states if states[0].push(kv_gate, writes) else None
        else:
            closing = [state for state, row in zip(states, kv_gate.split(1), strict=True) if state.push(row, writes)]
        if not closing:
            return
        writes.flush()  # the closing windows' last rows
        count, width = len(closing), closing[0].width
        if count == 1 and not self.overlap:
            windows = closing[0].open[None]
        else:  # a fresh copy: overlapping windows keep their first halves as the next ones' predecessors
            windows = torch.stack([state.open for state in closing])
        kv, gate = windows[..., :width], windows[..., width:] + self.ape.float()  # float32 (the bias is)
        if self.overlap:
            kv, gate = self._pair_each_with_previous(kv, gate, closing)
        pooled = self._pool(kv, gate)
        rotate_(pooled, rope.entries_of(tuple(state.count for state in closing), self.rate, pooled.dtype))
        for i, state in enumerate(closing):
            state.append(pooled if count == 1 else pooled[i : i + 1])

    def _pair_with_previous(
        self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, rate, 2*dim]`` windows -> ``[n, 2*rate, dim]``: previous window's first half, then own second half.
        The very first window's predecessor is the state's initial zeros with a -inf gate (weight 0)."""
        d = self.dim
        prev_kv, prev_gate = state.prev_kv, state.prev_gate
        if kv.shape[0] > 1:
            prev_kv = torch.cat([prev_kv, kv[:-1, :, :d]])
            prev_gate = torch.cat([prev_gate, gate[:-1, :, :d]])
        paired = torch.cat([prev_kv, kv[..., d:]], dim=1), torch.cat([prev_gate, gate[..., d:]], dim=1)
        state.prev_kv.copy_(kv[-1:, :, :d])  # in place, after the reads above: the state's tensors never move
        state.prev_gate.copy_(gate[-1:, :, :d])
        return paired

    def _pair_each_with_previous(
        self, kv: torch.Tensor, gate: torch.Tensor, states: list[CompressorState]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: window ``i`` of ``[n, rate, 2*dim]`` is ``states[i]``'s -> ``[n, 2*rate, dim]``, each paired
        with its own state's previous window as :meth:`_pair_with_previous` pairs one state's windows."""
        d = self.dim
        if len(states) == 1:
            prev_kv, prev_gate = states[0].prev_kv, states[0].prev_gate
        else:
            prev_kv = torch.cat([state.prev_kv for state in states])
            prev_gate = torch.cat([state.prev_gate for state in states])
        paired = torch.cat([prev_kv, kv[..., d:]], dim=1), torch.cat([prev_gate, gate[..., d:]], dim=1)
        for i, state in enumerate(states):
            state.prev_kv.copy_(kv[i : i + 1, :, :d])
            state.prev_gate.copy_(gate[i : i + 1, :, :d])
        return paired


def _head_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[T, heads, C]`` dot products of ``q`` (``[T, heads, dim]``) with keys ``[C, dim]`` (shared) or
    ``[T, C, dim]`` (per query)."""
    if keys.dim() == 3:
        return torch.bmm(q, keys.transpose(-1, -2))  # matmul's own bmm, without its views
    return F.linear(q, keys)  # matmul's own mm (q folded to [T * heads, dim]) in one host call


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
        self,
        kv_gate: torch.Tensor,
        head_weights: torch.Tensor,
        q_residual: torch.Tensor | None,
        rope: StepRope,
        state: CompressorState | list[CompressorState],
        q: torch.Tensor | None = None,
        writes: RowWrites | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Selected entry ids ``[T, k]`` and whether each may be attended (``[T, k]`` bool).

        ``kv_gate`` feeds the compressor, ``head_weights`` (``[T, heads]``) is ``weights_proj(x)``. Queries
        come from ``q_residual``. Every query row goes through the same operations whatever the block size,
        which only bounds the workspace (BLAS may round a row's dot products differently for another row
        count; ties fall as ``torch.topk`` breaks them within one row).

        Decode (one token per sequence): ``state`` is the list of the sequences' states (row ``i`` feeds
        ``state[i]``, its row copy through ``writes``), ``q`` their projected, rotated queries
        ``[B, heads, dim]`` and ``head_weights`` as :meth:`score_weights` gives them. Each query sees all of
        its sequence's entries, so the visibility is None (all) and no mask is built; see :meth:`_decode`
        for the ids.
        """
        if isinstance(state, list):
            return self.decode(kv_gate, head_weights, q, rope, state, writes or RowWrites()), None
        keys = self.compressor(kv_gate, state, rope)
        if keys.dtype not in SCORE_DTYPES:
            keys = keys.float()
        weights = self.score_weights(head_weights, keys.dtype)
        per_query = indexer_query_bytes(self.heads, self.dim, keys.shape[0], kv_gate.element_size())
        rotation = rope.token["compress"]
        picked = [
            self._select(q_residual[rows], rotation.rows(rows), weights[rows], rope.positions[rows], keys)
            for rows in query_blocks(q_residual.shape[0], per_query)
        ]
        if len(picked) == 1:
            return picked[0]
        return torch.cat([ids for ids, _ in picked]), torch.cat([valid for _, valid in picked])

    def score_weights(self, head_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What :meth:`_scores` weighs the heads' scores with, for keys of ``dtype``: ``weights_proj(x)``
        (``[T, heads]``) in float32 times ``heads ** -0.5``, and for 16-bit keys also times ``dim ** -0.5``
        in that dtype, ``[T, 1, heads]`` (the head-summing matmul's operand). Token-wise: a decode step
        computes them in its graphed segment (:meth:`DeepseekV4Attention.decode_projections`, which also
        shapes the float32 ones ``[T, heads, 1]``, as :meth:`_scores` multiplies with them)."""
        weights = head_weights.float() * self.heads**-0.5
        if dtype in SCORE_DTYPES:
            return (weights * self.dim**-0.5).to(dtype)[:, None, :]
        return weights

    def decode(
        self,
        kv_gate: torch.Tensor,
        weights: torch.Tensor,
        q: torch.Tensor,
        rope: StepRope,
        states: list[CompressorState],
        writes: RowWrites,
    ) -> torch.Tensor | None:
        """Decode's selection: ``[B, topk]`` ids, row ``i`` the top-k entries of ``states[i]`` where it has more
        than ``topk`` entries; a sequence with at most ``topk`` attends all of them (what a top-k of all its
        entries selects), its row means nothing, and so ids are None when no sequence has more.

        The sequences' keys are scored together, zero-padded to the longest; each row's top-k then runs
        over its own entries only (``torch.topk`` may break ties differently in a longer row), so every
        sequence selects what it would alone. One query per sequence: always one block of queries.
        Decode calls it directly (not through the module: fewer host calls)."""
        self.compressor.decode(kv_gate, states, rope, writes)
        if len(states) == 1:  # one sequence: its entries as they are, no padding
            if states[0].count <= self.topk:
                return None
            keys, counts = states[0].emitted, None
        else:
            counts = [state.count for state in states]
            if max(counts) <= self.topk:
                return None
            keys, _ = padded_keys([[state.emitted] for state in states], rope.zero_rows)
        if keys.dtype not in SCORE_DTYPES:
            keys = keys.float()
        scores = self._scores(q, weights, keys)
        if counts is None or min(counts) == max(counts):  # no padding
            return scores.topk(self.topk, dim=-1).indices
        rows = [scores[i, :n].topk(self.topk).indices if n > self.topk else None for i, n in enumerate(counts)]
        filler = next(row for row in rows if row is not None)
        return torch.stack([filler if row is None else row for row in rows])

    def _scores(self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[T, C]`` fp32 scores of rotated queries ``q`` (``[T, heads, dim]``) over ``keys`` (``[C, dim]``, or
        ``[T, C, dim]``: each query its own keys). ``head_weights``: float32 ``[T, heads]`` (times
        ``heads ** -0.5``), or for 16-bit keys also as :meth:`score_weights` finishes them (``[T, 1, heads]``).

        fp32 keys (an fp32 model): the reference's fp32 arithmetic. 16-bit keys: the per-head scores
        are computed in that dtype and summed over heads by a second matmul (fp32 accumulation), as
        the lightning indexer is meant to run (DeepSeek's own kernels score in FP8). At a 16k-token
        chunk over 128k tokens the fp32 ``[T, heads, C]`` matmul was ~9 TFLOP per CSA layer, most of
        the prefill's attention time.
        """
        if keys.dtype in SCORE_DTYPES:
            scores = _head_scores(q.to(keys.dtype), keys).relu_()
            weights = head_weights
            if weights.dim() == 2:
                weights = (head_weights * self.dim**-0.5).to(keys.dtype)[:, None, :]
            return torch.bmm(weights, scores).squeeze(1).float()  # matmul's own kernel here, without its views
        # In place: one [block, heads, C] fp32 tensor alive, the same element-wise ops as relu(s) * c * w.
        scores = _head_scores(q.float(), keys)
        weights = head_weights if head_weights.dim() == 3 else head_weights[..., None]  # decode's come shaped
        return scores.relu_().mul_(self.dim**-0.5).mul_(weights).sum(dim=1)

    def _select(
        self,
        q_residual: torch.Tensor,
        rotation: Rotation,
        weights: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k entry ids and their visibility for one block of queries (``keys`` ``[C, dim]``, ``weights``
        from :meth:`score_weights`)."""
        q = rotate_(self.wq_b(q_residual).view(q_residual.shape[0], self.heads, self.dim), rotation)
        scores = self._scores(q, weights, keys)
        visible = visible_entries(positions, keys.shape[0], self.compressor.rate)
        ids = scores.masked_fill_(~visible, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return ids, visible.gather(1, ids)


@dataclass
class Projections:
    """The token-wise inputs of one layer's attention, for all rows of a forward.

    ``kv`` is normed and rotated; ``kv_gate`` feeds the compressor, ``index_kv_gate`` and ``index_weights``
    the indexer (None where the layer has none).
    """

    q_residual: torch.Tensor
    kv: torch.Tensor
    kv_gate: torch.Tensor | None
    index_kv_gate: torch.Tensor | None
    index_weights: torch.Tensor | None

    def rows(self, rows: slice) -> Projections:
        pick = lambda t: None if t is None else t[rows]
        return Projections(
            self.q_residual[rows], self.kv[rows], pick(self.kv_gate), pick(self.index_kv_gate), pick(self.index_weights)
        )


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
        self.scale = self.head_dim**-0.5
        self._sink_key: tuple[int, int] | None = None
        self._sink_columns: dict[int, torch.Tensor] = {}
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != SLIDING:
            rate = cfg.compress_rate(layer)
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, self.kind == CSA, cfg.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, cfg.compress_rate(layer))
        # Every projection of x in one GEMM, and (decode) both query projections of q_residual in another.
        x_groups = [[self.wq_a], [self.wkv]]
        q_groups = [[self.wq_b]]
        if self.compressor is not None:
            x_groups.append([self.compressor.wkv, self.compressor.wgate])
        if self.indexer is not None:
            x_groups += [[self.indexer.compressor.wkv, self.indexer.compressor.wgate], [self.indexer.weights_proj]]
            q_groups.append([self.indexer.wq_b])
        self.x_proj, self.q_proj = FusedLinears(x_groups), FusedLinears(q_groups)

    def fuse_projections(self) -> None:
        """Concatenate the projection weights (once loaded): fewer, larger GEMMs per step."""
        self.x_proj.fuse()
        self.q_proj.fuse()

    def forward(self, x: torch.Tensor, rope: StepRope, sequences: list[tuple[slice, LayerCache]]) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normed, every sequence's rows) at ``rope.positions`` -> ``[T, hidden]``.

        ``sequences`` are each sequence's rows and this layer's state, appended to. Token-wise projections
        run over all rows at once. When every sequence brings one token (decode), each query sees all of
        its keys: no masks, and the query and output projections run batched. Otherwise, per sequence,
        keys, compressors and the indexer see all its tokens at once (they roll the cache forward) and
        queries run in blocks (:func:`query_blocks`).
        """
        inputs = self.project(x, rope.token[self.rope_kind])
        if all(rows.stop - rows.start == 1 for rows, _ in sequences):
            return self._decode(inputs, rope, [state for _, state in sequences])
        outs = []
        for rows, state in sequences:
            seq_rope = rope if len(sequences) == 1 else rope.rows(rows)
            outs.append(self._sequence(inputs if len(sequences) == 1 else inputs.rows(rows), seq_rope, state))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def project(self, x: torch.Tensor, rotation: Rotation) -> Projections:
        """The token-wise projections of ``x`` (``[T, hidden]``); ``rotation`` (this layer's kind) rotates ``kv``."""
        parts = self.x_proj(x)
        q_residual = self.q_norm(parts[0])
        kv = rotate_(self.kv_norm(parts[1]), rotation)
        kv_gate = parts[2] if self.compressor is not None else None
        index_kv_gate, index_weights = (parts[3], parts[4]) if self.indexer is not None else (None, None)
        return Projections(q_residual, kv, kv_gate, index_kv_gate, index_weights)

    # Decode (one token per sequence) in three parts: the token-wise query side and output side hold no
    # per-sequence state (a decode step captures them in CUDA graphs), the attention between them does.

    def _decode(self, inputs: Projections, rope: StepRope, states: list[LayerCache]) -> torch.Tensor:
        """One token per sequence: every window key and emitted entry is visible to it."""
        q, index_q = self.decode_queries(inputs.q_residual, rope.token)
        out = self.decode_attend(q, index_q, self.decode_projections(inputs), rope, states)
        return self.decode_output(out, rope.token[self.rope_kind])

    def decode_queries(
        self, q_residual: torch.Tensor, token: dict[str, Rotation]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotated queries ``[B, heads, head_dim]`` (normed) and the indexer's (``[B, index heads, dim]``, None
        without an indexer) of one token per sequence; ``token`` holds the rows' rotations by rope kind."""
        tokens = q_residual.shape[0]
        projected = self.q_proj(q_residual)
        q = rms_unweighted(projected[0].view(tokens, self.heads, self.head_dim), self.eps)
        q = rotate_(q, token[self.rope_kind])
        if self.indexer is None:
            return q, None
        index_q = projected[1].view(tokens, self.indexer.heads, self.indexer.dim)
        return q, rotate_(index_q, token["compress"])  # in place: its rows of the fused GEMM's output

    def decode_projections(self, inputs: Projections) -> Projections:
        """``inputs`` as :meth:`decode_attend` reads them: the indexer's head weights already as it scores
        with them (:meth:`Indexer.score_weights`; the entries it scores come back in the model dtype, that
        of ``kv``). Token-wise: a decode step computes them in its graphed segment."""
        if self.indexer is None:
            return inputs
        weights = self.indexer.score_weights(inputs.index_weights, inputs.kv.dtype)
        if weights.dim() == 2:  # float32 ``[B, heads]``: shaped as the scores take them, a view here not per step
            weights = weights[..., None]
        return replace(inputs, index_weights=weights)

    def decode_attend(
        self,
        q: torch.Tensor,
        index_q: torch.Tensor | None,
        inputs: Projections,
        rope: StepRope,
        states: list[LayerCache],
    ) -> torch.Tensor:
        """Append each sequence's token to its state (row ``i`` of ``inputs``, from :meth:`decode_projections`,
        to ``states[i]``) and attend: the per-sequence part of decode. Returns the attention output
        ``[B, heads, head_dim]``, still rotated.

        Per sequence only what its own state needs: the window's and compressors' row copies and the read of
        its compressed entries (CSA: only the top-k, so paged or fp8 stores convert just those). Windows that
        close are pooled together, the indexer scores every sequence at once, and the attention runs over
        one padded tensor (:mod:`deepseek_v4_attention_decode`, :mod:`deepseek_v4_decode`)."""
        return attention_decode.decode_attend(self, q, index_q, inputs, rope, states)

    def sink_logits(self, batch: int) -> torch.Tensor:
        """The sinks as decode's softmax joins them (:func:`sink_column`, ``[batch, heads, 1]`` float32), kept
        per batch size: a float32 parameter's are views of it; any change of the parameter (in place, or
        its data replaced) makes new ones."""
        sinks = self.attn_sink
        key = (sinks.data_ptr(), sinks._version)
        if key != self._sink_key:
            self._sink_key, self._sink_columns = key, {}
        column = self._sink_columns.get(batch)
        if column is None:
            column = self._sink_columns[batch] = sink_column(sinks.detach(), batch)
        return column

    def decode_output(self, out: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """Attention output ``[B, heads, head_dim]`` (rotated back in place) -> ``[B, hidden]``."""
        # K = V carries rope on its trailing channels: rotate the output back by the query's angle.
        return self._project_out(rotate_(out, rotation, inverse=True))

    def _sequence(self, inputs: Projections, rope: StepRope, state: LayerCache) -> torch.Tensor:
        """One sequence's tokens (any number), queries in blocks."""
        tokens, rotation = inputs.kv.shape[0], rope.token[self.rope_kind]
        windows, window_mask = sliding_keys(state.window.extend(inputs.kv), tokens, self.window)
        compressed = None if self.compressor is None else self._compressed_keys(inputs, rope, state)
        outs = []
        for rows in query_blocks(tokens, self._query_bytes(compressed, inputs.kv.element_size())):
            key_sets = [(windows[rows], window_mask[rows])]
            if compressed is not None:
                key_sets.append(compressed.rows(rows))
            outs.append(self._attend(inputs.q_residual[rows], rotation.rows(rows), key_sets))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, q_residual: torch.Tensor, rotation: Rotation, key_sets: list[KeySet]) -> torch.Tensor:
        """One block of queries: project, attend over ``key_sets``, project out -> ``[block, hidden]``."""
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.heads, self.head_dim)
        q = rotate_(rms_unweighted(q, self.eps), rotation)
        out = sink_attention(q, key_sets, self.attn_sink, self.scale)
        # K = V carries rope on its trailing channels: rotate the output back by the query's angle.
        return self._project_out(rotate_(out, rotation, inverse=True))

    def _query_bytes(self, compressed: CompressedKeys | None, elem: int) -> int:
        per_query = 0 if compressed is None else compressed.per_query
        gathered = 0 if compressed is None or compressed.ids is None else per_query
        return attention_query_bytes(self.heads, self.head_dim, self.window + per_query, self.window + gathered, elem)

    def _compressed_keys(self, inputs: Projections, rope: StepRope, state: LayerCache) -> CompressedKeys:
        entries = self.compressor(inputs.kv_gate, state.compressor, rope)
        if self.indexer is None:  # HCA: every completed entry
            return CompressedKeys(entries, visible_entries(rope.positions, entries.shape[0], self.compressor.rate))
        ids, valid = self.indexer(inputs.index_kv_gate, inputs.index_weights, inputs.q_residual, rope, state.indexer)
        self.check_counts(state)
        return CompressedKeys(entries, valid, ids)

    @staticmethod
    def check_counts(state: LayerCache) -> None:
        if state.indexer.count != state.compressor.count:
            raise RuntimeError("CSA compressor and indexer disagree on the number of compressed entries")

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: each head group maps to ``o_lora_rank`` channels, then one mix."""
        if isinstance(self.wo_a, Fp8BlockLinear):
            return self.wo_b(self.wo_a.grouped(out.reshape(out.shape[0], -1), self.o_groups))
        return self.wo_b(grouped_reference(out.reshape(out.shape[0], -1), self.wo_a.weight, self.o_groups))
