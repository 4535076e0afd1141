"""DeepSeek-V3 against transformers: prefill logits, cached decode logits and greedy tokens."""

import pytest
import torch
from reference import compare_with_transformers, load_reference, relative_error, save_tiny

from moetier.config import ModelLoadConfig
from moetier.errors import ConfigError
from moetier.models import deepseek_v3
from moetier.models.base import ExpertTarget, IgnoreTarget, ParamTarget
from moetier.models.layers import rope_inverse_frequencies
from moetier.weights.loader import load_model

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    # mscale != mscale_all_dim: the cos/sin factor is not 1 and the softmax scale gets mscale_all_dim's term.
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

VARIANTS = {
    # q LoRA, interleaved rope, 4 groups of 4 experts with the best 2 groups eligible.
    "q_lora": dict(
        q_lora_rank=48,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
    ),
    # Plain q_proj, yarn scaling, half-split rope, unnormalised top-k, two shared experts, two dense layers.
    "yarn_plain_q": dict(
        q_lora_rank=None,
        rope_parameters=YARN,
        rope_interleave=False,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        n_shared_experts=2,
        first_k_dense_replace=2,
    ),
}


def tiny_v3_config(**overrides):
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=512,
    )
    return DeepseekV3Config(**(settings | overrides))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_matches_transformers(tmp_path, variant, dtype):
    save_tiny(tiny_v3_config(**VARIANTS[variant]), tmp_path, dtype=dtype)
    hf = load_reference(tmp_path, torch.float32)  # both sides compute in fp32 from the same stored weights
    result = compare_with_transformers(hf, tmp_path, dtype=torch.float32)
    assert result.prefill_error < 1e-4
    assert result.last_error < 1e-4
    assert max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_chunked_prefill_in_each_attention_form(tmp_path, monkeypatch, form):
    """Both exact MLA forms, fed in chunks over a partly filled cache, give transformers' prefill logits."""
    save_tiny(tiny_v3_config(**VARIANTS["q_lora"]), tmp_path)
    hf = load_reference(tmp_path, torch.float32)
    prompt = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0].float()
    monkeypatch.setattr(deepseek_v3, "absorbed_is_cheaper", lambda cfg, q_len, kv_len: form == "absorbed")
    model = load_model(tmp_path, ModelLoadConfig(dtype=torch.float32), progress=False).model
    cache = model.new_cache(64)
    with torch.no_grad():
        logits = torch.cat([model.compute_logits(model(chunk, cache)) for chunk in prompt.split([29, 16, 1, 2])])
    assert cache.length == 48
    assert relative_error(logits, expected) < 1e-4


def test_attention_form_choice():
    cfg = deepseek_v3.DeepseekV3ForCausalLM.config_from_hf(
        tiny_v3_config(**VARIANTS["q_lora"]).to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    )
    assert deepseek_v3.absorbed_is_cheaper(cfg, q_len=1, kv_len=100)  # decode
    assert not deepseek_v3.absorbed_is_cheaper(cfg, q_len=100, kv_len=100)  # prefill from empty


def test_config_rejects_impossible_routing():
    hf = tiny_v3_config(**VARIANTS["q_lora"]).to_dict()
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        deepseek_v3.DeepseekV3ForCausalLM.config_from_hf(hf | {"topk_group": 1, "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="n_group"):
        deepseek_v3.DeepseekV3ForCausalLM.config_from_hf(hf | {"n_group": 3})


# The release config.json of deepseek-ai/DeepSeek-V3 (legacy rope keys, FP8, one MTP layer), abridged.
RELEASE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_release_config_reads_like_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cls = deepseek_v3.DeepseekV3ForCausalLM
    cfg = cls.config_from_hf(RELEASE)
    hf_cfg = DeepseekV3Config.from_dict(RELEASE)
    with torch.device("meta"):
        hf_scale = DeepseekV3Attention(hf_cfg, 0).scaling
    assert cfg.softmax_scale() == pytest.approx(hf_scale, rel=1e-12) and hf_scale != pytest.approx(192**-0.5)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None)
    inv_freq, factor = rope_inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.allclose(inv_freq, hf_inv_freq, rtol=1e-6, atol=0) and factor == hf_factor
    assert cls.expert_layout(cfg).moe_layers == tuple(range(3, 61))

    with torch.device("meta"):
        model = cls(cfg, dispatcher=None)
    assert isinstance(model.map_checkpoint_name("model.layers.61.mlp.experts.0.gate_proj.weight"), IgnoreTarget)
    assert isinstance(model.map_checkpoint_name("model.layers.61.embed_tokens.weight"), IgnoreTarget)
    assert model.map_checkpoint_name("model.layers.3.mlp.experts.255.down_proj.weight") == ExpertTarget(3, 255, "down")
    assert model.map_checkpoint_name("model.layers.4.mlp.experts.gate_up_proj") == ExpertTarget(4, None, "gate_up")
    bias = "model.layers.5.mlp.gate.e_score_correction_bias"
    assert model.map_checkpoint_name(bias) == ParamTarget(bias.removeprefix("model."))
    assert model.map_checkpoint_name("model.layers.0.mlp.gate_proj.weight") == ParamTarget(
        "layers.0.mlp.gate_proj.weight"
    )
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    assert params["layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert "layers.2.mlp.gate_proj.weight" in params and "layers.3.mlp.shared_experts.up_proj.weight" in params
