"""Qwen3-MoE against transformers: prefill logits, cached decode logits and greedy tokens."""

import pytest
import torch
from reference import compare_with_transformers, load_reference, save_tiny


def tiny_qwen3_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        rope_theta=10000.0,
        max_position_embeddings=512,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_moe_matches_transformers(tmp_path, dtype):
    save_tiny(tiny_qwen3_config(), tmp_path, dtype=dtype)
    hf = load_reference(tmp_path, torch.float32)  # both sides compute in fp32 from the same stored weights
    result = compare_with_transformers(hf, tmp_path, dtype=torch.float32)
    assert result.prefill_error < 1e-4
    assert result.last_error < 1e-4
    assert max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens
