"""Building blocks shared by the model families: norms, rotary embeddings, attention, dense MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moetier.kernels.swiglu import swiglu


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class PreNormDecoderLayer(nn.Module):
    """The Llama-style residual block: ``x + attn(norm(x))`` (per sequence), then ``x + mlp(norm(x))``.

    ``attention(x, (cos, sin), cache)`` runs one sequence's rows; ``mlp`` runs over every row of the
    batch at once (a dense MLP or a MoE block calling the dispatcher). The attribute names are the
    checkpoints' (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``).
    """

    def __init__(self, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch) -> torch.Tensor:
        cos, sin = rope
        attend = lambda xs, s: self.self_attn(xs, (cos[s.rows], sin[s.rows]), s.cache)
        x = x + batch.per_sequence(self.input_layernorm(x), attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def prenorm_stack_forward(model: nn.Module, input_ids: torch.Tensor, batch) -> torch.Tensor:
    """Embed, run every :class:`PreNormDecoderLayer` with rotary tables for the batch's positions, norm.

    ``model`` provides ``embed_tokens``, ``layers``, ``norm``, ``inv_freq`` and ``rope_factor``.
    """
    x = model.embed_tokens(input_ids)
    rope = rope_cos_sin(batch.positions, model.inv_freq, model.rope_factor, x.dtype)
    for layer in model.layers:
        x = layer(x, rope, batch)
    batch.advance()
    return model.norm(x)


class DenseMLP(nn.Module):
    """SwiGLU feed-forward with its own weights (dense layers and shared experts)."""

    def __init__(self, hidden: int, inter: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inverse_frequencies(
    rot_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``[rot_dim/2]``) and the cos/sin attention factor.

    ``scaling`` follows Hugging Face ``rope_parameters`` / ``rope_scaling``: ``rope_type`` default
    or yarn (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope_type {kind!r} (supported: default, yarn)")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, rot_dim, theta, original)
    high = _yarn_correction_dim(beta_slow, rot_dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = inv_freq / factor
    inv_freq = interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, rot_dim]`` (halves repeated, rotate-half convention) for ``positions``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., T, D]``, heads before T) with ``cos``/``sin`` of shape ``[T, D]``."""
    return x * cos + rotate_half(x) * sin


def causal_mask(q_len: int, kv_len: int, device: torch.device, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``[q_len, kv_len]`` mask (True = attend) for queries at the last ``q_len`` positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention for one sequence: ``q`` ``[Hq, T, D]``, ``k``/``v`` ``[Hkv, S, D*]`` -> ``[T, Hq, Dv]``.

    Grouped-query heads are expanded here; softmax runs in float32 for stability.
    """
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def stack_padded(rows: list[torch.Tensor | list[torch.Tensor]]) -> torch.Tensor:
    """Per sequence a tensor ``[*lead, L_i, D]`` (token axis -2), or a list of such parts read in order, as
    one zero-padded ``[B, *lead, max L_i, D]`` tensor. Batched decode attention pads every sequence's keys
    to the longest and masks the padding; a lone single-part sequence is returned as a view."""
    parts = [row if isinstance(row, list) else [row] for row in rows]
    if len(parts) == 1 and len(parts[0]) == 1:
        return parts[0][0][None]
    first = parts[0][0]
    longest = max(sum(p.shape[-2] for p in seq) for seq in parts)
    padded = first.new_zeros(len(parts), *first.shape[:-2], longest, first.shape[-1])
    for row, seq in zip(padded, parts, strict=True):
        start = 0
        for part in seq:
            row[..., start : start + part.shape[-2], :] = part
            start += part.shape[-2]
    return padded
