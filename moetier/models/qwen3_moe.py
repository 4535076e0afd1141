"""Qwen3-MoE: grouped-query attention with per-head q/k RMS norm, softmax top-k router, no shared expert."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import ConfigError
from moetier.models.base import CausalLM, ExpertTarget, ForwardBatch, ParamTarget, WeightTarget, register_model
from moetier.models.cache import ContiguousKVCache
from moetier.models.layers import (
    DenseMLP,
    PreNormDecoderLayer,
    RMSNorm,
    apply_rope,
    attention,
    causal_mask,
    prenorm_stack_forward,
    rope_inverse_frequencies,
)
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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: ContiguousKVCache):
        tokens, dim = x.shape[0], self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(tokens, -1, dim)).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(tokens, -1, dim)).transpose(0, 1)
        v = self.v_proj(x).view(tokens, -1, dim).transpose(0, 1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = cache.write(self.layer, k, v)
        mask = causal_mask(tokens, keys.shape[1], x.device)
        out = attention(q, keys, values, mask, dim**-0.5)
        return self.o_proj(out.reshape(tokens, -1))


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


class Qwen3MoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer: int, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Qwen3MoeRouter(cfg)
        object.__setattr__(self, "dispatcher", dispatcher)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.dispatcher.dispatch(self.layer, x, ids, weights)


def _decoder_layer(cfg: Qwen3MoeConfig, layer: int, dispatcher: ExpertDispatcher) -> PreNormDecoderLayer:
    if cfg.is_moe_layer(layer):
        mlp: nn.Module = Qwen3MoeBlock(cfg, layer, dispatcher)
    else:
        mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    return PreNormDecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, Qwen3MoeAttention(cfg, layer), mlp)


_EXPERT_NAME = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
)
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B)."""

    def __init__(self, config: Qwen3MoeConfig, dispatcher: ExpertDispatcher) -> None:
        super().__init__(config, dispatcher)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_decoder_layer(config, i, dispatcher) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

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
        self.inv_freq, self.rope_factor = rope_inverse_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )

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
        return prenorm_stack_forward(self, input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
