"""Real model shapes for benchmark checkpoints: the ``config.json`` and the list of tensors to write.

Each shape carries the published widths, expert count, top-k, layer-type mix and Hugging Face
tensor names of one model. :func:`build_config` scales it down *only* in depth (``layers``), keeping
the per-layer pattern sensible (a few-layer DeepSeek-V4 still has sliding, CSA and HCA attention, a
hash-routed and a learned-router MoE layer); the ``overrides`` exist for tiny test models.
:func:`tensor_plan` lists, in file order, every tensor ``save_pretrained`` would write for the config.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from moetier.errors import ConfigError

# ----------------------------------------------------------------------------------------------
# Tensor plan


@dataclass(frozen=True)
class Normal:
    """Independent normal values with mean 0 and standard deviation ``std``."""

    std: float


@dataclass(frozen=True)
class Fill:
    """Every element equals ``value`` (ones for norms, zeros for biases, sinks and offsets)."""

    value: float


@dataclass(frozen=True)
class Router:
    """Router state computed per layer (random weight, selection bias, hash table), possibly skewed."""

    layer: int
    part: Literal["weight", "bias", "tid2eid"]


Init = Normal | Fill | Router

# "model" means the checkpoint's --dtype; the others are stored as named whatever --dtype is.
StoredDtype = Literal["model", "F32", "I64", "F8", "I8", "F8_E8M0"]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Init
    dtype: StoredDtype = "model"

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


# ----------------------------------------------------------------------------------------------
# Published configurations (full depth)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

_DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "compress_rates": {CSA: 4, HCA: 128},
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # YaRN on the compressed branches only (the published rope_scaling block).
    "compress_rope_yarn": {
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    # The release ships one MTP layer; a benchmark checkpoint has none (transformers ignores it too).
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
}

_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
}

_QWEN3_235B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 94,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "use_cache": True,
}


# ----------------------------------------------------------------------------------------------
# Depth scaling: keep each family's layer mix when only a few layers are written


def _scaled_count(layers: int, real: int, real_layers: int) -> int:
    """``real`` special layers out of ``real_layers``, scaled to ``layers`` but at least one."""
    return max(1, min(real, round(real * layers / real_layers)))


def deepseek_v4_layer_types(layers: int) -> list[str]:
    """V4-Flash: 2 sliding layers, then CSA / HCA alternating (starting with CSA).

    Fewer layers keep one sliding layer from 3 layers on, and always both compressors from 2 on.
    """
    sliding = 0 if layers < 3 else _scaled_count(layers, 2, 43)
    return [SLIDING] * sliding + [CSA if i % 2 == 0 else HCA for i in range(layers - sliding)]


def deepseek_v4_mlp_layer_types(layers: int) -> list[str]:
    """V4-Flash: the first 3 MoE layers are hash-routed; at least one learned-router layer is kept."""
    hashed = 0 if layers < 2 else _scaled_count(layers, 3, 43)
    return ["hash_moe"] * hashed + ["moe"] * (layers - hashed)


def deepseek_v3_dense_layers(layers: int) -> int:
    """V3: the first 3 of 61 layers are dense; at least one MoE layer is kept."""
    return 0 if layers < 2 else _scaled_count(layers, 3, 61)


# ----------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class BenchShape:
    """One published model: its full config and how to derive the fields that depend on others."""

    name: str
    base: dict[str, Any]
    experts_key: str
    finalize: Callable[[dict[str, Any], set[str]], None]
    plan: Callable[[dict[str, Any]], list[TensorSpec]]


def _finalize_v4(cfg: dict[str, Any], explicit: set[str]) -> None:
    layers = cfg["num_hidden_layers"]
    if "layer_types" not in explicit:
        cfg["layer_types"] = deepseek_v4_layer_types(layers)
    if "mlp_layer_types" not in explicit:
        cfg["mlp_layer_types"] = deepseek_v4_mlp_layer_types(layers)
    rotary = cfg["qk_rope_head_dim"] / cfg["head_dim"]
    cfg["partial_rotary_factor"] = rotary
    yarn = cfg.pop("compress_rope_yarn", None)
    main = {"rope_type": "default", "rope_theta": cfg["rope_theta"], "partial_rotary_factor": rotary}
    compress = {"rope_type": "default", "rope_theta": cfg["compress_rope_theta"], "partial_rotary_factor": rotary}
    if yarn:
        # transformers forces attention_factor=1 for V4's compressed YaRN (the reference skips mscale).
        compress.update(rope_type="yarn", attention_factor=1.0, **yarn)
    cfg["rope_parameters"] = {"main": main, "compress": compress}
    _check(len(cfg["layer_types"]) == layers, "layer_types must have one entry per layer")
    _check(len(cfg["mlp_layer_types"]) == layers, "mlp_layer_types must have one entry per layer")
    _check(cfg["num_attention_heads"] % cfg["o_groups"] == 0, "num_attention_heads must be a multiple of o_groups")
    _check(cfg["qk_rope_head_dim"] <= cfg["head_dim"], "qk_rope_head_dim must not exceed head_dim")
    _check_topk(cfg, cfg["n_routed_experts"])


def _finalize_v3(cfg: dict[str, Any], explicit: set[str]) -> None:
    if "first_k_dense_replace" not in explicit:
        cfg["first_k_dense_replace"] = deepseek_v3_dense_layers(cfg["num_hidden_layers"])
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    experts, groups = cfg["n_routed_experts"], cfg["n_group"]
    _check_topk(cfg, experts)
    _check(experts % groups == 0, f"n_routed_experts={experts} must be a multiple of n_group={groups}")
    # The grouped router scores each group by its two best experts, then keeps topk_group groups.
    _check(experts // groups >= 2, f"each of the n_group={groups} groups needs at least 2 experts")
    _check(1 <= cfg["topk_group"] <= groups, "topk_group must be in [1, n_group]")
    _check(
        cfg["topk_group"] * experts // groups >= cfg["num_experts_per_tok"],
        "topk_group groups must hold at least num_experts_per_tok experts",
    )


def _finalize_qwen3(cfg: dict[str, Any], explicit: set[str]) -> None:
    if "max_window_layers" not in explicit:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    _check(cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0, "heads must be a multiple of kv heads")
    _check_topk(cfg, cfg["num_experts"])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_topk(cfg: dict[str, Any], experts: int) -> None:
    top_k = cfg["num_experts_per_tok"]
    _check(1 <= top_k <= experts, f"num_experts_per_tok={top_k} must be in [1, experts={experts}]")


# ----------------------------------------------------------------------------------------------
# Tensor plans, in file order (per layer: attention, norms, router, shared expert, routed experts)


def _linear(name: str, out_features: int, in_features: int, std: float) -> TensorSpec:
    return TensorSpec(name, (out_features, in_features), Normal(std))


def _ones(name: str, size: int) -> TensorSpec:
    return TensorSpec(name, (size,), Fill(1.0))


def _swiglu(prefix: str, names: tuple[str, str, str], hidden: int, inter: int, std: float) -> list[TensorSpec]:
    gate, down, up = names
    return [
        _linear(f"{prefix}.{gate}.weight", inter, hidden, std),
        _linear(f"{prefix}.{down}.weight", hidden, inter, std),
        _linear(f"{prefix}.{up}.weight", inter, hidden, std),
    ]


def _experts(prefix: str, names, count: int, hidden: int, inter: int, std: float) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    for expert in range(count):
        specs += _swiglu(f"{prefix}.{expert}", names, hidden, inter, std)
    return specs


def _v4_hyper_connection(prefix: str, hc: int, hidden: int, std: float) -> list[TensorSpec]:
    # mHC mixers: fn normal, base zeros, scale ones (the reference init); kept float32 like the reference.
    mix = (2 + hc) * hc
    return [
        TensorSpec(f"{prefix}_base", (mix,), Fill(0.0), "F32"),
        TensorSpec(f"{prefix}_fn", (mix, hc * hidden), Normal(std), "F32"),
        TensorSpec(f"{prefix}_scale", (3,), Fill(1.0), "F32"),
    ]


def _v4_compressor(prefix: str, rate: int, head_dim: int, width: int, hidden: int, std: float) -> list[TensorSpec]:
    """A KV compressor: ``width`` is ``2*head_dim`` for the overlapping CSA windows, ``head_dim`` for HCA."""
    return [
        TensorSpec(f"{prefix}.ape", (rate, width), Fill(0.0), "F32"),
        _ones(f"{prefix}.norm.weight", head_dim),
        _linear(f"{prefix}.wgate.weight", width, hidden, std),
        _linear(f"{prefix}.wkv.weight", width, hidden, std),
    ]


def _v4_attention(cfg: dict[str, Any], layer: int, std: float) -> list[TensorSpec]:
    p, hidden = f"model.layers.{layer}.attn", cfg["hidden_size"]
    heads, dim = cfg["num_attention_heads"], cfg["head_dim"]
    q_rank, groups, o_rank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    specs = [TensorSpec(f"{p}.attn_sink", (heads,), Fill(0.0), "F32")]
    kind = cfg["layer_types"][layer]
    if kind == CSA:
        rate, idx_dim = cfg["compress_rates"][CSA], cfg["index_head_dim"]
        specs += _v4_compressor(f"{p}.compressor", rate, dim, 2 * dim, hidden, std)
        specs += _v4_compressor(f"{p}.indexer.compressor", rate, idx_dim, 2 * idx_dim, hidden, std)
        specs += [
            _linear(f"{p}.indexer.weights_proj.weight", cfg["index_n_heads"], hidden, std),
            _linear(f"{p}.indexer.wq_b.weight", cfg["index_n_heads"] * idx_dim, q_rank, std),
        ]
    elif kind == HCA:
        specs += _v4_compressor(f"{p}.compressor", cfg["compress_rates"][HCA], dim, dim, hidden, std)
    return specs + [
        _ones(f"{p}.norm.weight", dim),
        _ones(f"{p}.q_norm.weight", q_rank),
        _linear(f"{p}.wkv.weight", dim, hidden, std),
        _linear(f"{p}.wo_a.weight", groups * o_rank, heads * dim // groups, std),
        _linear(f"{p}.wo_b.weight", hidden, groups * o_rank, std),
        _linear(f"{p}.wq_a.weight", q_rank, hidden, std),
        _linear(f"{p}.wq_b.weight", heads * dim, q_rank, std),
    ]


def _v4_plan(cfg: dict[str, Any]) -> list[TensorSpec]:
    hidden, std, hc = cfg["hidden_size"], cfg["initializer_range"], cfg["hc_mult"]
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    names = ("w1", "w2", "w3")
    specs = [_linear("model.embed_tokens.weight", cfg["vocab_size"], hidden, std)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs += _v4_attention(cfg, layer, std)
        specs += [_ones(f"{p}.attn_norm.weight", hidden), _ones(f"{p}.ffn_norm.weight", hidden)]
        specs += _v4_hyper_connection(f"{p}.hc_attn", hc, hidden, std)
        specs += _v4_hyper_connection(f"{p}.hc_ffn", hc, hidden, std)
        if cfg["mlp_layer_types"][layer] == "hash_moe":
            specs.append(
                TensorSpec(
                    f"{p}.ffn.gate.tid2eid",
                    (cfg["vocab_size"], cfg["num_experts_per_tok"]),
                    Router(layer, "tid2eid"),
                    "I64",
                )
            )
        else:
            specs.append(TensorSpec(f"{p}.ffn.gate.bias", (experts,), Router(layer, "bias"), "F32"))
        specs.append(TensorSpec(f"{p}.ffn.gate.weight", (experts, hidden), Router(layer, "weight")))
        # V4's shared expert is one expert of moe_intermediate_size (n_shared_experts does not widen it).
        specs += _swiglu(f"{p}.ffn.shared_experts", names, hidden, inter, std)
        specs += _experts(f"{p}.ffn.experts", names, experts, hidden, inter, std)
    return specs + [
        TensorSpec("model.hc_head.hc_base", (hc,), Fill(0.0), "F32"),
        TensorSpec("model.hc_head.hc_fn", (hc, hc * hidden), Normal(std), "F32"),
        TensorSpec("model.hc_head.hc_scale", (1,), Fill(1.0), "F32"),
        _ones("model.norm.weight", hidden),
        _linear("head.weight", cfg["vocab_size"], hidden, std),
    ]


def _v3_attention(cfg: dict[str, Any], prefix: str, std: float) -> list[TensorSpec]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    if q_rank is None:
        specs = [_linear(f"{prefix}.q_proj.weight", heads * (nope + rope), hidden, std)]
    else:
        specs = [
            _ones(f"{prefix}.q_a_layernorm.weight", q_rank),
            _linear(f"{prefix}.q_a_proj.weight", q_rank, hidden, std),
            _linear(f"{prefix}.q_b_proj.weight", heads * (nope + rope), q_rank, std),
        ]
    return specs + [
        _ones(f"{prefix}.kv_a_layernorm.weight", kv_rank),
        _linear(f"{prefix}.kv_a_proj_with_mqa.weight", kv_rank + rope, hidden, std),
        _linear(f"{prefix}.kv_b_proj.weight", heads * (nope + v_dim), kv_rank, std),
        _linear(f"{prefix}.o_proj.weight", hidden, heads * v_dim, std),
    ]


def _v3_plan(cfg: dict[str, Any]) -> list[TensorSpec]:
    hidden, std = cfg["hidden_size"], cfg["initializer_range"]
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    names = ("gate_proj", "down_proj", "up_proj")
    specs = [_linear("model.embed_tokens.weight", cfg["vocab_size"], hidden, std)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs += _v3_attention(cfg, f"{p}.self_attn", std)
        specs += [_ones(f"{p}.input_layernorm.weight", hidden), _ones(f"{p}.post_attention_layernorm.weight", hidden)]
        if layer < cfg["first_k_dense_replace"]:
            specs += _swiglu(f"{p}.mlp", names, hidden, cfg["intermediate_size"], std)
            continue
        specs += [
            TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (experts,), Router(layer, "bias"), "F32"),
            TensorSpec(f"{p}.mlp.gate.weight", (experts, hidden), Router(layer, "weight")),
        ]
        specs += _swiglu(f"{p}.mlp.shared_experts", names, hidden, inter * cfg["n_shared_experts"], std)
        specs += _experts(f"{p}.mlp.experts", names, experts, hidden, inter, std)
    return specs + [_ones("model.norm.weight", hidden), _linear("lm_head.weight", cfg["vocab_size"], hidden, std)]


def qwen3_is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    return layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0


def _qwen3_plan(cfg: dict[str, Any]) -> list[TensorSpec]:
    hidden, std, heads, kv_heads, dim = (
        cfg["hidden_size"],
        cfg["initializer_range"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    names = ("gate_proj", "down_proj", "up_proj")
    specs = [_linear("model.embed_tokens.weight", cfg["vocab_size"], hidden, std)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs += [
            _ones(f"{p}.self_attn.q_norm.weight", dim),
            _ones(f"{p}.self_attn.k_norm.weight", dim),
            _linear(f"{p}.self_attn.q_proj.weight", heads * dim, hidden, std),
            _linear(f"{p}.self_attn.k_proj.weight", kv_heads * dim, hidden, std),
            _linear(f"{p}.self_attn.v_proj.weight", kv_heads * dim, hidden, std),
            _linear(f"{p}.self_attn.o_proj.weight", hidden, heads * dim, std),
            _ones(f"{p}.input_layernorm.weight", hidden),
            _ones(f"{p}.post_attention_layernorm.weight", hidden),
        ]
        if not qwen3_is_moe_layer(cfg, layer):
            specs += _swiglu(f"{p}.mlp", names, hidden, cfg["intermediate_size"], std)
            continue
        specs.append(TensorSpec(f"{p}.mlp.gate.weight", (experts, hidden), Router(layer, "weight")))
        specs += _experts(f"{p}.mlp.experts", names, experts, hidden, inter, std)
    return specs + [_ones("model.norm.weight", hidden), _linear("lm_head.weight", cfg["vocab_size"], hidden, std)]


SHAPES: dict[str, BenchShape] = {
    shape.name: shape
    for shape in (
        BenchShape("deepseek-v4-flash", _DEEPSEEK_V4_FLASH, "n_routed_experts", _finalize_v4, _v4_plan),
        BenchShape("deepseek-v3", _DEEPSEEK_V3, "n_routed_experts", _finalize_v3, _v3_plan),
        BenchShape("qwen3-235b", _QWEN3_235B, "num_experts", _finalize_qwen3, _qwen3_plan),
    )
}

_PLANS = {shape.base["model_type"]: shape.plan for shape in SHAPES.values()}


def build_config(
    shape: str,
    layers: int,
    *,
    vocab_size: int | None = None,
    experts: int | None = None,
    hidden_size: int | None = None,
    moe_intermediate_size: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict of ``shape`` with ``layers`` decoder layers.

    The keyword arguments replace single published values (``experts`` the routed-expert count);
    ``overrides`` replaces any field before derived fields (layer patterns, RoPE blocks) are filled in.
    Raises :class:`ConfigError` for an unknown shape or an inconsistent result.
    """
    if shape not in SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    if layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {layers}")
    spec = SHAPES[shape]
    cfg = copy.deepcopy(spec.base)
    changes: dict[str, Any] = {"num_hidden_layers": layers}
    for key, value in (
        ("vocab_size", vocab_size),
        (spec.experts_key, experts),
        ("hidden_size", hidden_size),
        ("moe_intermediate_size", moe_intermediate_size),
    ):
        if value is not None:
            if value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
            changes[key] = value
    changes.update(overrides or {})
    cfg.update(copy.deepcopy(changes))
    spec.finalize(cfg, set(overrides or {}))
    _keep_special_tokens_in_vocab(cfg)
    return cfg


def _keep_special_tokens_in_vocab(cfg: dict[str, Any]) -> None:
    # A shrunken vocabulary cannot hold the published BOS/EOS ids; use DeepSeek's 0 and 1 instead.
    for key, fallback in (("bos_token_id", 0), ("eos_token_id", 1)):
        token = cfg.get(key)
        if isinstance(token, int) and token >= cfg["vocab_size"]:
            cfg[key] = min(fallback, cfg["vocab_size"] - 1)


def tensor_plan(cfg: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of ``cfg``'s checkpoint, in the order they are written."""
    try:
        return _PLANS[cfg["model_type"]](cfg)
    except KeyError as exc:
        raise ConfigError(f"cannot plan tensors: missing config field {exc}") from None


def routed_experts(cfg: dict[str, Any]) -> int:
    return cfg.get("n_routed_experts") or cfg["num_experts"]
