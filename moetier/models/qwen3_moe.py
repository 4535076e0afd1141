"""Qwen3-MoE: grouped-query attention with per-head q/k RMS norm, softmax top-k router, no shared expert.

A decode step (one token per sequence) runs as segments, CUDA graphs on CUDA, around the per-sequence
attention and the expert dispatch (:mod:`decode_segments`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import ConfigError
from moetier.kernels.paged_attention import paged_attention_usable, try_paged_attention
from moetier.models.base import CausalLM, ExpertTarget, ForwardBatch, ParamTarget, WeightTarget, register_model
from moetier.models.cache import ContiguousKVCache
from moetier.models.decode_segments import (
    Rope,
    RoutedMoE,
    SegmentedDecoderLayer,
    apply_rope_rows,
    padding_mask,
    prenorm_forward,
)
from moetier.models.graph_segments import SegmentGraphs
from moetier.models.layers import DenseMLP, RMSNorm, attention, causal_mask, rope_inverse_frequencies, stack_padded
from moetier.tiers.dispatcher import ExpertDispatcher
from moetier.tiers.experts import ExpertLayout


@dataclass
class Qwen3MoeConfig:
    """The subset of a Qwen3-MoE ``config.json`` the runtime needs, validated on construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok must be in [1, num_experts]")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def rope_settings(hf: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers-5 ``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    scaling = params if params.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    return float(theta), scaling


def padded_decode_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence (``q`` ``[B, heads, D]``) over its gathered keys/values (per sequence
    ``[kv_heads, L_i, D]``), all sequences padded into one computation -> ``[B, heads * D]``. The gather path,
    and the reference of :mod:`moetier.kernels.paged_attention`."""
    padding = padding_mask(positions, [rows.shape[-2] for rows in keys])
    keys, values = stack_padded(keys), stack_padded(values)  # [B, kv_heads, S, D]
    # Query heads grouped by the KV head they share (repeat_interleave's order): no expanded keys needed.
    tokens, kv_heads = q.shape[0], keys.shape[1]
    scores = torch.matmul(q.view(tokens, kv_heads, -1, q.shape[-1]), keys.transpose(-1, -2)) * scale
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).reshape(tokens, -1)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, heads * dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(heads * dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.scale = dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, cache: ContiguousKVCache) -> torch.Tensor:
        """One sequence's normed rows ``x`` ``[T, H]`` at the rope's positions, appended to ``cache`` -> ``[T, H]``."""
        q, k, v = self.project(x, rope)
        keys, values = cache.write(self.layer, k.transpose(0, 1), v.transpose(0, 1))
        mask = causal_mask(x.shape[0], keys.shape[1], x.device)
        out = attention(q.transpose(0, 1), keys, values, mask, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed rows ``[T, H]`` -> roped queries ``[T, heads, D]``, roped keys and values ``[T, kv_heads, D]``."""
        tokens, dim = x.shape[0], self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(tokens, -1, dim))
        k = self.k_norm(self.k_proj(x).view(tokens, -1, dim))
        v = self.v_proj(x).view(tokens, -1, dim)
        return apply_rope_rows(q, *rope), apply_rope_rows(k, *rope), v

    # Decode (one token per sequence, :mod:`decode_segments`): the projections and the output projection
    # are capturable; the cache writes and the attention between them are not.

    decode_project = project

    def decode_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[ContiguousKVCache],
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Row ``i`` of ``k``/``v`` appended to ``caches[i]``; each query row attends over its sequence's keys
        -> ``[B, heads * D]``. Paged caches of one pool are read in place (one kernel, no gather) where the
        kernel runs; otherwise every sequence's rows are gathered into one padded computation."""
        keys = [c.keys[self.layer] for c in caches]
        values = [c.values[self.layer] for c in caches]
        if not paged_attention_usable(q, keys, values):
            written = [
                c.write(self.layer, k[i : i + 1].transpose(0, 1), v[i : i + 1].transpose(0, 1))
                for i, c in enumerate(caches)
            ]
            gathered_k, gathered_v = (list(rows) for rows in zip(*written, strict=True))
            return padded_decode_attention(q, gathered_k, gathered_v, positions, self.scale)
        lengths = [c.length + 1 for c in caches]
        for i, c in enumerate(caches):  # ContiguousKVCache.write without the read (a store checks its capacity)
            keys[i].write(c.length, k[i : i + 1].transpose(0, 1))
            values[i].write(c.length, v[i : i + 1].transpose(0, 1))
        # positions + 1 are the lengths on the device: no host-to-device copy.
        out = try_paged_attention(q, keys, values, lengths, positions + 1, self.scale)
        if out is None:  # the kernel failed (it stays off): gather the rows just written
            gathered = [s.read(n) for s, n in zip(keys, lengths, strict=True)]
            return padded_decode_attention(
                q, gathered, [s.read(n) for s, n in zip(values, lengths, strict=True)], positions, self.scale
            )
        return out

    def decode_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)


class Qwen3MoeRouter(nn.Module):
    """Softmax over experts, top-k, optionally renormalised."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)


class Qwen3MoeBlock(RoutedMoE):
    """The router's top-k experts, from the dispatcher; no shared expert."""

    def __init__(self, cfg: Qwen3MoeConfig, layer: int, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Qwen3MoeRouter(cfg)
        object.__setattr__(self, "dispatcher", dispatcher)


def _decoder_layer(cfg: Qwen3MoeConfig, layer: int, dispatcher: ExpertDispatcher) -> SegmentedDecoderLayer:
    if cfg.is_moe_layer(layer):
        mlp: nn.Module = Qwen3MoeBlock(cfg, layer, dispatcher)
    else:
        mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    return SegmentedDecoderLayer(layer, cfg.hidden_size, cfg.rms_norm_eps, Qwen3MoeAttention(cfg, layer), mlp)


_EXPERT_NAME = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
)
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B)."""

    reads_paged_kv_in_place = True  # decode attention on paged caches: kernels/paged_attention.py

    # Decode steps (one token per sequence) run as segments (:mod:`decode_segments`), CUDA graphs where
    # ``graphs`` allows; False runs them through the layers' one-call forward, as prefill does.
    segmented_decode = True

    def __init__(self, config: Qwen3MoeConfig, dispatcher: ExpertDispatcher) -> None:
        super().__init__(config, dispatcher)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_decoder_layer(config, i, dispatcher) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.graphs = SegmentGraphs()

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> Qwen3MoeConfig:
        theta, scaling = rope_settings(hf, 1_000_000.0)
        return Qwen3MoeConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            norm_topk_prob=hf.get("norm_topk_prob", False),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        )

    @classmethod
    def expert_layout(cls, config: Qwen3MoeConfig) -> ExpertLayout:
        return ExpertLayout(
            moe_layers=tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)),
            num_experts=config.num_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            top_k=config.num_experts_per_tok,
        )

    def map_checkpoint_name(self, name: str) -> WeightTarget:
        match = _EXPERT_NAME.match(name)
        if match:
            layer, expert, part = match.groups()
            return ExpertTarget(int(layer), None if expert is None else int(expert), _PART[part])
        param = name.removeprefix("model.")
        if param == "lm_head.weight" or name.startswith("model."):
            return ParamTarget(param)
        raise KeyError(name)

    def tied_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def post_load(self) -> None:
        cfg = self.config
        inv_freq, self.rope_factor = rope_inverse_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.inv_freq = inv_freq.to(self.device)  # on the device: a graph capture cannot copy it in
        # Graphs read the weights in place: any captured before (e.g. of an earlier load) are stale.
        self.graphs = SegmentGraphs()

    def new_cache(self, max_tokens: int, kv_dtype: str | None = None) -> ContiguousKVCache:
        cfg = self.config
        return ContiguousKVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            max_tokens,
            cfg.head_dim,
            cfg.head_dim,
            self.dtype,
            self.device,
            kv_dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ContiguousKVCache | Sequence[ContiguousKVCache],
        seq_lens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        batch = ForwardBatch(cache, input_ids.shape[0], seq_lens, input_ids.device)
        return prenorm_forward(self, input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
