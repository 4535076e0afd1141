"""DeepSeek-V4 attention: a sliding window, plus compressed entries in CSA and HCA layers.

Every layer attends over its last ``sliding_window`` tokens. HCA layers also attend over all
*compressed entries* (one per ``rate`` tokens, a softmax-gated pool of the window's projections);
CSA layers pool overlapping windows (width ``2 * rate``, stride ``rate``) and a lightning indexer
keeps only the ``index_topk`` best entries per query. One shared head serves as key and value
(K = V), each head has a learned sink logit, and the output goes through a grouped projection.
RoPE in V4 rotates *interleaved* channel pairs of the trailing ``rope_head_dim`` channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetier.models.deepseek_v4_cache import CompressorState, LayerCache
from moetier.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
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
        """Selected entry ids ``[T, k]`` and whether each may be attended (``[T, k]`` bool)."""
        keys = self.compressor(x, state, rope.compress)
        cos, sin = rope.token["compress"]
        q = self.wq_b(q_residual).view(x.shape[0], self.heads, self.dim)
        q = apply_interleaved_rope(q, cos[:, None], sin[:, None])
        scores = F.relu(torch.einsum("thd,cd->thc", q.float(), keys.float())) * self.dim**-0.5
        head_weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = (scores * head_weights[..., None]).sum(dim=1)
        visible = visible_entries(rope.positions, keys.shape[0], self.compressor.rate)
        ids = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return ids, visible.gather(1, ids)


# One attended key set: keys shared by all queries ([S, D]) or per query ([T, S, D]), and a [T, S] mask.
KeySet = tuple[torch.Tensor, torch.Tensor]


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
        """``x`` ``[T, hidden]`` (normed) at ``rope.positions`` -> ``[T, hidden]``; appends to ``state``."""
        tokens = x.shape[0]
        cos, sin = rope.token[self.rope_kind]
        q_residual = self.q_norm(self.wq_a(x))
        q = rms_unweighted(self.wq_b(q_residual).view(tokens, self.heads, self.head_dim), self.eps)
        q = apply_interleaved_rope(q, cos[:, None], sin[:, None])
        kv = apply_interleaved_rope(self.kv_norm(self.wkv(x)), cos, sin)
        key_sets = [sliding_keys(state.window.extend(kv), tokens, self.window)]
        if self.compressor is not None:
            key_sets.append(self._compressed_keys(x, q_residual, rope, state))
        out = sink_attention(q, key_sets, self.attn_sink, self.head_dim**-0.5)
        # K = V carries rope on its trailing channels: rotate the output back by the query's angle.
        out = apply_interleaved_rope(out, cos[:, None], -sin[:, None])
        return self._project_out(out)

    def _compressed_keys(self, x: torch.Tensor, q_residual: torch.Tensor, rope: StepRope, state: LayerCache) -> KeySet:
        entries = self.compressor(x, state.compressor, rope.compress)
        if self.indexer is None:  # HCA: every completed entry
            return entries, visible_entries(rope.positions, entries.shape[0], self.compressor.rate)
        ids, valid = self.indexer(x, q_residual, rope, state.indexer)
        if state.indexer.count != state.compressor.count:
            raise RuntimeError("CSA compressor and indexer disagree on the number of compressed entries")
        return entries[ids], valid  # per query: only its top-k entries are gathered

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: each head group maps to ``o_lora_rank`` channels, then one mix."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)
        weight = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1))
