"""DeepSeek-V3 (and R1, V3.1): multi-head latent attention, grouped sigmoid router, shared experts.

Attention caches the compressed latent (``kv_lora_rank`` normalised values plus the roped shared
key, ``qk_rope_head_dim``) instead of per-head keys and values: 576 numbers per token and layer
for the full model instead of 128 heads x (192 + 128), 71x less. Each forward picks the cheaper of two exact forms:
expanding the cached latent to per-head keys/values (prefill), or folding ``kv_b_proj`` into the
query and the output (the "absorbed" form). They differ only by float rounding. A decode step (one token
per sequence) takes the absorbed form and runs as segments, CUDA graphs on CUDA, around the cache writes,
the attention and the expert dispatch (:mod:`decode_segments`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import ConfigError
from moetier.kernels.paged_attention import paged_attention_usable, try_paged_attention
from moetier.models.base import (
    CausalLM,
    ExpertTarget,
    ForwardBatch,
    IgnoreTarget,
    ParamTarget,
    SequenceCache,
    WeightTarget,
    register_model,
)
from moetier.models.cache import kv_rows
from moetier.models.decode_segments import (
    Rope,
    RoutedMoE,
    SegmentedDecoderLayer,
    apply_rope_rows,
    padding_mask,
    prenorm_forward,
)
from moetier.models.graph_segments import SegmentGraphs
from moetier.models.layers import DenseMLP, RMSNorm, apply_rope, causal_mask, rope_inverse_frequencies, stack_padded
from moetier.models.qwen3_moe import rope_settings
from moetier.tiers.dispatcher import ExpertDispatcher
from moetier.tiers.experts import ExpertLayout


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class DeepseekV3Config:
    """The subset of a DeepSeek-V3 ``config.json`` the runtime needs, validated on construction.

    Defaults for absent keys are the ones transformers' ``DeepseekV3Config`` applies, so a
    ``config.json`` means the same thing to both implementations.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} must split into n_group={self.n_group} groups")
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError("each expert group needs >= 2 experts (groups are scored by their top-2 experts)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        selectable = self.topk_group * (self.n_routed_experts // self.n_group)
        if not 1 <= self.num_experts_per_tok <= selectable:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {selectable}]")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim must be even")
        if self.n_shared_experts < 0 or not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError("n_shared_experts must be >= 0 and first_k_dense_replace in [0, num_hidden_layers]")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn scaling.

        DeepSeek (and transformers) fold yarn's magnitude correction into the softmax scale on
        top of the cos/sin attention factor.
        """
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            scale *= mscale * mscale
        return scale


class LatentKVCache(SequenceCache):
    """Per layer, preallocated ``[max_tokens, kv_lora_rank + qk_rope_head_dim]`` latent rows.

    Row ``t`` holds token ``t``'s normalised compressed KV followed by its roped shared key.
    Layers write at ``self.length``; the model calls :meth:`advance` once per forward. ``kv_dtype``
    picks the storage (:mod:`moetier.models.cache`); fp8 keeps one scale per token for the latent
    and one for the rope key (``groups``), whose magnitudes differ (normalised vs. projected).
    """

    truncatable = True  # a token's entries never depend on later tokens

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str | None = None,
        groups: tuple[int, ...] | None = None,
    ) -> None:
        self.length = 0
        self.max_tokens = max_tokens
        self.latents = [kv_rows((), max_tokens, width, dtype, device, kv_dtype, groups) for _ in range(num_layers)]

    @property
    def kv_dtype(self) -> str | None:
        return self.latents[0].kv_dtype if self.latents else None

    def write(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Store ``latent`` (``[T, width]``) after the cached tokens; return all latents so far."""
        end = self.length + latent.shape[0]
        if end > self.max_tokens:
            raise ConfigError(f"sequence of {end} tokens exceeds the cache size {self.max_tokens}")
        self.latents[layer].write(self.length, latent)
        return self.latents[layer].read(end)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def snapshot(self, length: int) -> LatentKVCache:
        return self.clone_into(length, length)

    def clone_into(self, max_tokens: int, length: int | None = None) -> LatentKVCache:
        length = self.length if length is None else length
        if not 0 <= length <= min(self.length, max_tokens):
            raise ValueError(f"cannot copy {length} tokens of a {self.length}-token cache into {max_tokens}")
        clone = LatentKVCache.__new__(LatentKVCache)
        clone.max_tokens, clone.length = max_tokens, length
        clone.latents = [rows.copy(max_tokens, length) for rows in self.latents]
        return clone

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.latents)

    def row_stores(self) -> list:
        return list(self.latents)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...)`` -> ``(x0, x2, ..., x1, x3, ...)`` on the last dim.

    DeepSeek rotates adjacent pairs; after this permutation (applied to queries and keys alike,
    so dot products are unchanged) the rotate-half formula does the same rotation.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention over a :class:`LatentKVCache`."""

    def __init__(self, cfg: DeepseekV3Config, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        heads, bias = cfg.num_attention_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.scale = cfg.softmax_scale()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _pairs_to_halves(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.cfg.rope_interleave else x

    def forward(self, x: torch.Tensor, rope: Rope, cache: LatentKVCache) -> torch.Tensor:
        """One sequence's normed rows ``x`` ``[T, H]`` at the rope's positions, appended to ``cache`` -> ``[T, H]``,
        in whichever exact form is cheaper at this length (:func:`absorbed_is_cheaper`)."""
        tokens = x.shape[0]
        q_nope, q_rot, latent = self.project(x, rope)
        q_nope, q_rot = q_nope.transpose(0, 1), q_rot.transpose(0, 1)  # [heads, T, *]
        latents = cache.write(self.layer, latent)  # [S, r + rope]
        mask = causal_mask(tokens, latents.shape[0], x.device)
        if absorbed_is_cheaper(self.cfg, tokens, latents.shape[0]):
            out = self._absorbed(q_nope, q_rot, latents, mask)
        else:
            out = self._expanded(q_nope, q_rot, latents, mask)
        return self.o_proj(out.transpose(0, 1).reshape(tokens, -1))

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed rows ``[T, H]`` -> ``q_nope`` ``[T, heads, n]``, roped ``q_rot`` ``[T, heads, rope]`` and the
        latent to cache ``[T, r + rope]`` (normed compressed KV, roped shared key)."""
        cfg, tokens = self.cfg, x.shape[0]
        q = self._queries(x).view(tokens, -1, cfg.qk_head_dim)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rot = apply_rope_rows(self._pairs_to_halves(q_rot), *rope)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rot = apply_rope(self._pairs_to_halves(k_rot), *rope)
        return q_nope, q_rot, torch.cat((self.kv_a_layernorm(kv_latent), k_rot), dim=-1)

    # Decode (one token per sequence, :mod:`decode_segments`) always takes the absorbed form (the cheaper one
    # from two cached tokens on); its query and output sides are capturable, the cache writes and the
    # attention between them are not.

    def decode_project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed rows ``[B, H]`` -> absorbed queries ``[B, heads, r + rope]`` and the latents to cache."""
        q_nope, q_rot, latent = self.project(x, rope)
        return self._absorb_query(q_nope.transpose(0, 1), q_rot.transpose(0, 1)).transpose(0, 1), latent

    def decode_attend(
        self, q: torch.Tensor, latent: torch.Tensor, caches: list[LatentKVCache], positions: torch.Tensor
    ) -> torch.Tensor:
        """Row ``i`` of ``latent`` appended to ``caches[i]``; each query row attends over its sequence's latents
        -> the latent-space output ``[B, heads, r]``. Paged caches of one pool are read in place (keys: the
        whole latent rows, values: their first ``r`` columns) where the kernel runs; otherwise all sequences'
        latents are gathered into one padded computation."""
        stores = [c.latents[self.layer] for c in caches]
        rank = self.cfg.kv_lora_rank
        if paged_attention_usable(q, stores, None, d1=rank):
            lengths = [c.length + 1 for c in caches]
            for i, (c, store) in enumerate(zip(caches, stores, strict=True)):  # LatentKVCache.write, no read
                store.write(c.length, latent[i : i + 1])
            # positions + 1 are the lengths on the device: no host-to-device copy.
            out = try_paged_attention(q, stores, None, lengths, positions + 1, self.scale, d1=rank)
            if out is not None:
                return out.view(q.shape[0], q.shape[1], rank)
            written = [s.read(n) for s, n in zip(stores, lengths, strict=True)]  # the kernel failed: gather
        else:
            written = [c.write(self.layer, latent[i : i + 1]) for i, c in enumerate(caches)]
        padding = padding_mask(positions, [w.shape[0] for w in written])
        hidden = None if padding is None else padding[:, None, :]  # over every head
        latents = stack_padded(written)  # [B, S, r + rope]
        probs = self._softmax(torch.bmm(q, latents.transpose(1, 2)), hidden, q.dtype)
        return torch.bmm(probs, latents[..., :rank])

    def decode_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """``[B, heads, r]`` -> ``[B, H]``."""
        out = self._expand_output(out_latent.transpose(0, 1)).transpose(0, 1)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _softmax(self, scores: torch.Tensor, hidden: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Softmax of ``scores * scale`` over the last dim, without the keys ``hidden`` marks (None: all keys)."""
        scores = scores * self.scale
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)

    def _expanded(self, q_nope, q_rot, latents, mask) -> torch.Tensor:
        """Per-head keys/values from every cached latent: ``[H, T, Dv]``."""
        cfg = self.cfg
        kv_latent, k_rot = latents.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(kv_latent).view(latents.shape[0], -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.transpose(0, 1).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        # The roped key is shared by all heads: q_rot . k_rot is a broadcast matmul, not a copy per head.
        scores = torch.matmul(q_nope, k_nope.transpose(-1, -2)) + torch.matmul(q_rot, k_rot.T)
        return torch.matmul(self._softmax(scores, ~mask, q_nope.dtype), v)

    def _absorbed(self, q_nope, q_rot, latents, mask) -> torch.Tensor:
        """``kv_b_proj`` folded into the query and the output; attention runs in latent space: ``[H, T, Dv]``."""
        q = self._absorb_query(q_nope, q_rot)
        probs = self._softmax(torch.matmul(q, latents.T), ~mask, q.dtype)
        out_latent = torch.matmul(probs, latents[:, : self.cfg.kv_lora_rank])  # [H, T, r]
        return self._expand_output(out_latent)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s key and value parts per head: ``[H, n, r]``, ``[H, v, r]`` (views)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    def _absorb_query(self, q_nope: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
        """``[H, T, n]``, ``[H, T, rope]`` -> the query in latent space ``[H, T, r + rope]``."""
        return torch.cat((torch.matmul(q_nope, self._absorbed_weights()[0]), q_rot), dim=-1)

    def _expand_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Latent-space attention output ``[H, T, r]`` -> per-head values ``[H, T, v]``."""
        return torch.matmul(out_latent, self._absorbed_weights()[1].transpose(-1, -2))


def absorbed_is_cheaper(cfg: DeepseekV3Config, q_len: int, kv_len: int) -> bool:
    """Whether the absorbed form costs fewer multiply-adds than expanding ``kv_len`` latents.

    Expanded: ``kv_b_proj`` over every cached token plus attention at head width. Absorbed: two
    small per-query projections plus attention at latent width. Decode (``q_len`` << ``kv_len``)
    is absorbed; prefill from an empty cache is expanded.
    """
    r, n, v, rope = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    expanded = kv_len * r * (n + v) + q_len * kv_len * (n + rope + v)
    absorbed = q_len * r * (n + v) + q_len * kv_len * (2 * r + rope)
    return absorbed < expanded


class DeepseekV3Router(nn.Module):
    """Sigmoid scores; experts chosen within the best ``topk_group`` groups using bias-corrected scores.

    ``e_score_correction_bias`` steers the choice only; the returned weights are the raw sigmoid
    scores of the chosen experts (optionally renormalised) times ``routed_scaling_factor``, in float32.
    """

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best_groups = group_scores.topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class DeepseekV3MoE(RoutedMoE):
    """Routed experts (through the dispatcher) plus always-on shared experts."""

    def __init__(self, cfg: DeepseekV3Config, layer: int, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.layer = layer
        self.gate = DeepseekV3Router(cfg)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        object.__setattr__(self, "dispatcher", dispatcher)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)


def _decoder_layer(cfg: DeepseekV3Config, layer: int, dispatcher: ExpertDispatcher) -> SegmentedDecoderLayer:
    if cfg.is_moe_layer(layer):
        mlp: nn.Module = DeepseekV3MoE(cfg, layer, dispatcher)
    else:
        mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
    return SegmentedDecoderLayer(layer, cfg.hidden_size, cfg.rms_norm_eps, DeepseekV3Attention(cfg, layer), mlp)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_NAME = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?$"
)
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / R1 / V3.1 (671B) and smaller models of the same architecture."""

    reads_paged_kv_in_place = True  # decode attention on paged caches: kernels/paged_attention.py

    keep_fp32 = ("e_score_correction_bias",)
    dense_linears = ("kv_b_proj",)  # absorbed into the queries and outputs (its weight is read, not called)
    # Decode steps (one token per sequence) run as segments (:mod:`decode_segments`), CUDA graphs where
    # ``graphs`` allows; False runs them through the layers' one-call forward, as prefill does.
    segmented_decode = True

    def __init__(self, config: DeepseekV3Config, dispatcher: ExpertDispatcher) -> None:
        super().__init__(config, dispatcher)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_decoder_layer(config, i, dispatcher) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.graphs = SegmentGraphs()

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DeepseekV3Config:
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"DeepseekV3ForCausalLM needs scoring_func 'sigmoid', got {hf['scoring_func']!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"DeepseekV3ForCausalLM needs hidden_act 'silu', got {hf['hidden_act']!r}")
        theta, scaling = rope_settings(hf, 10000.0)
        return DeepseekV3Config(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            n_routed_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank"),
            n_shared_experts=hf.get("n_shared_experts", 1) or 0,
            n_group=hf.get("n_group", 8),
            topk_group=hf.get("topk_group", 4),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=hf.get("norm_topk_prob", True),
            first_k_dense_replace=hf.get("first_k_dense_replace", 3),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleave=hf.get("rope_interleave", True),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
        )

    @classmethod
    def expert_layout(cls, config: DeepseekV3Config) -> ExpertLayout:
        return ExpertLayout(
            moe_layers=tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)),
            num_experts=config.n_routed_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            top_k=config.num_experts_per_tok,
        )

    def map_checkpoint_name(self, name: str) -> WeightTarget:
        layer = _LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
            # The release checkpoints append multi-token-prediction modules as extra layers.
            return IgnoreTarget("multi-token-prediction layer")
        match = _EXPERT_NAME.match(name)
        if match:
            index, expert, part = match.groups()
            return ExpertTarget(int(index), None if expert is None else int(expert), _PART[part])
        if name == "lm_head.weight" or name.startswith("model."):
            return ParamTarget(name.removeprefix("model."))
        raise KeyError(name)

    def tied_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def post_load(self) -> None:
        cfg = self.config
        inv_freq, self.rope_factor = rope_inverse_frequencies(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.inv_freq = inv_freq.to(self.device)  # on the device: a graph capture cannot copy it in
        # Graphs read the weights in place: any captured before (e.g. of an earlier load) are stale.
        self.graphs = SegmentGraphs()

    def new_cache(self, max_tokens: int, kv_dtype: str | None = None) -> LatentKVCache:
        cfg = self.config
        width, groups = cfg.kv_lora_rank + cfg.qk_rope_head_dim, (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        return LatentKVCache(cfg.num_hidden_layers, max_tokens, width, self.dtype, self.device, kv_dtype, groups)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: LatentKVCache | Sequence[LatentKVCache],
        seq_lens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        batch = ForwardBatch(cache, input_ids.shape[0], seq_lens, input_ids.device)
        return prenorm_forward(self, input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
