"""DeepSeek-V4 configuration: what the runtime needs, from transformers' or the release's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetier.errors import ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

# The release's per-layer ``compress_ratios`` (0: window only; 4: CSA with indexer; larger: HCA).
_CSA_RATIO = 4


@dataclass
class DeepseekV4Config:
    """The subset of a DeepSeek-V4 ``config.json`` the runtime needs, validated on construction.

    ``layer_types`` picks each layer's attention (sliding window only, CSA or HCA); ``compress_rates``
    gives the CSA/HCA window lengths; ``mlp_layer_types`` marks the hash-routed layers. ``main_rope``
    (sliding layers) and ``compress_rope`` (CSA/HCA layers, their compressors and the indexer) are
    Hugging Face rope dicts (``rope_type``, ``rope_theta`` and the yarn keys).
    """

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    n_shared_experts: int = 1
    num_key_value_heads: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float | None = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    main_rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    compress_rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 160000.0})
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        self.layer_types, self.mlp_layer_types = tuple(self.layer_types), tuple(self.mlp_layer_types)
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ConfigError(f"layer_types and mlp_layer_types must list {n} layers")
        if bad := set(self.layer_types) - set(LAYER_TYPES):
            raise ConfigError(f"unknown DeepSeek-V4 layer types {sorted(bad)}; expected {LAYER_TYPES}")
        if bad := set(self.mlp_layer_types) - set(MLP_TYPES):
            raise ConfigError(f"unknown DeepSeek-V4 mlp layer types {sorted(bad)}; expected {MLP_TYPES}")
        for kind in set(self.layer_types) - {SLIDING}:
            if self.compress_rates.get(kind, 0) < 1:
                raise ConfigError(f"compress_rates[{kind!r}] must be a positive window length")
        if self.num_key_value_heads != 1:
            raise ConfigError("DeepSeek-V4 attention has one shared key/value head (num_key_value_heads=1)")
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ConfigError(f"rope head dim {self.rope_head_dim} must be even and in (0, head_dim]")
        if CSA in self.layer_types and self.index_head_dim < self.rope_head_dim:
            raise ConfigError("index_head_dim must hold the rope head dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("num_attention_heads * head_dim must split evenly into o_groups")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError("num_experts_per_tok must be in [1, n_routed_experts]")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.sliding_window < 1 or self.hc_mult < 1 or self.hc_sinkhorn_iters < 1 or self.index_topk < 1:
            raise ConfigError("sliding_window, hc_mult, hc_sinkhorn_iters and index_topk must be >= 1")

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry in ``layer`` (0 for a sliding-window-only layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV4Config:
        """Read transformers' config.json, or the release's (``compress_ratios``, ``num_hash_layers``, ...)."""
        n = hf["num_hidden_layers"]
        head_dim = hf["head_dim"]
        layer_types, compress_rates = _attention_schedule(hf, n)
        main_rope, compress_rope = _rope_settings(hf)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=hf["num_attention_heads"],
            head_dim=head_dim,
            q_lora_rank=hf["q_lora_rank"],
            rope_head_dim=_rope_head_dim(hf, head_dim),
            n_routed_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            layer_types=layer_types,
            mlp_layer_types=_mlp_schedule(hf, n),
            compress_rates=compress_rates,
            n_shared_experts=hf.get("n_shared_experts", 1),
            num_key_value_heads=hf.get("num_key_value_heads", 1),
            scoring_func=hf.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
            swiglu_limit=hf.get("swiglu_limit", 10.0),
            sliding_window=hf.get("sliding_window", 128),
            o_groups=hf.get("o_groups", 8),
            o_lora_rank=hf.get("o_lora_rank", 1024),
            index_n_heads=hf.get("index_n_heads", 64),
            index_head_dim=hf.get("index_head_dim", 128),
            index_topk=hf.get("index_topk", 512),
            hc_mult=hf.get("hc_mult", 4),
            hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=float(hf.get("hc_eps", 1e-6)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            max_position_embeddings=hf.get("max_position_embeddings", 1048576),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
        )


def _attention_schedule(hf: dict[str, Any], n: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """(layer_types, compress_rates) from ``layer_types``/``compress_rates`` or the release's ``compress_ratios``."""
    rates = dict(
        hf.get("compress_rates") or {CSA: hf.get("compress_rate_csa", 4), HCA: hf.get("compress_rate_hca", 128)}
    )
    if hf.get("layer_types"):
        return tuple(hf["layer_types"][:n]), rates
    ratios = hf.get("compress_ratios")
    if ratios is None:
        # transformers' default schedule (V4-Pro): two HCA layers, then CSA and HCA alternating.
        tail = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        return tuple(([HCA] * min(n, 2) + tail)[:n]), rates
    # The release lists ratios for the main layers, then the MTP layers: keep the first n.
    hca_ratios = {r for r in ratios[:n] if r > 1 and r != _CSA_RATIO}
    if len(hca_ratios) > 1:
        raise ValueError(f"compress_ratios mixes several HCA rates {sorted(hca_ratios)}")
    if hca_ratios:
        rates[HCA] = hca_ratios.pop()
    rates[CSA] = _CSA_RATIO
    kinds = [SLIDING if r <= 1 else CSA if r == _CSA_RATIO else HCA for r in ratios[:n]]
    return tuple(kinds), rates


def _mlp_schedule(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    if hf.get("mlp_layer_types"):
        return tuple(hf["mlp_layer_types"][:n])
    hashed = min(n, hf.get("num_hash_layers", 3))
    return ("hash_moe",) * hashed + ("moe",) * (n - hashed)


def _rope_head_dim(hf: dict[str, Any], head_dim: int) -> int:
    if hf.get("partial_rotary_factor") is not None:
        return int(head_dim * hf["partial_rotary_factor"])
    return hf.get("qk_rope_head_dim") or head_dim // 8


def _rope_settings(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``main`` and ``compress`` rope dicts, from nested ``rope_parameters`` or flat/legacy keys.

    Flat scaling keys (e.g. the release's yarn ``rope_scaling``) apply to the compress rope only, and
    a yarn compress rope defaults to ``attention_factor=1``: V4 does not scale cos/sin by yarn's mscale.
    """
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return dict(params["main"]), dict(params["compress"])
    flat = {**(hf.get("rope_scaling") or {}), **{k: v for k, v in params.items() if not isinstance(v, dict)}}
    kind = flat.get("rope_type", flat.get("type", "default"))
    main = {"rope_type": "default", "rope_theta": float(hf.get("rope_theta", flat.get("rope_theta", 10000.0)))}
    compress = {**flat, "rope_type": kind, "rope_theta": float(hf.get("compress_rope_theta", 160000.0))}
    if kind == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress
