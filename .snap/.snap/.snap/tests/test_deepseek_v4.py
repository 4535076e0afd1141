"""DeepSeek-V4 against transformers: prefill logits, cached decode logits and greedy tokens.

The tiny config has every attention type (sliding, CSA, HCA), hash-routed and score-routed MoE
layers and 4 mHC streams; window 8, CSA rate 4, HCA rate 8 and index_topk 4, so over a 48-token
prompt plus 32 decode steps the window slides, 20 CSA / 10 HCA entries form and the indexer drops
most of them. Every tensor transformers initialises to zeros or ones (sinks, pooling biases, mHC
biases and scales, norms, router bias, ``tid2eid``) is randomised so none can be ignored.
"""

import json
import shutil

import pytest
import torch
from reference import compare_with_transformers, load_reference, moetier_run, relative_error
from safetensors.torch import load_file, save_file

from moetier.config import ModelLoadConfig
from moetier.models.base import ExpertTarget, IgnoreTarget, ParamTarget
from moetier.weights.loader import load_model

NUM_EXPERTS, TOP_K, VOCAB = 8, 2, 256
LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def tiny_v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=48,
        num_experts_per_tok=TOP_K,
        n_routed_experts=NUM_EXPERTS,
        layer_types=LAYER_TYPES,
        compress_rates=COMPRESS_RATES,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        hc_mult=4,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        # 8 indexer heads: with fewer, several entries often score exactly 0 (all ReLUs off) and
        # torch.topk breaks such ties differently for different shapes (transformers' own full
        # forward and cached decode then disagree).
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        partial_rotary_factor=0.25,
        max_position_embeddings=256,
        rope_parameters={**YARN, "rope_theta": 10000.0},  # yarn applies to the compress rope only
        initializer_range=0.1,
    )


@torch.no_grad()
def _randomize(model) -> None:
    generator = torch.Generator().manual_seed(7)

    def normal(t, mean, std):
        t.copy_(torch.randn(t.shape, generator=generator) * std + mean)

    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("tid2eid"):
            rows = [torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(tensor.shape[0])]
            tensor.copy_(torch.stack(rows))
        elif name.endswith(("sinks", "position_bias")) or name.endswith(("hc.base", "hc_base")):
            normal(tensor, 0.0, 0.5)
        elif name.endswith(("hc.scale", "hc_scale")) or "norm" in name:
            normal(tensor, 1.0, 0.2)
        elif name.endswith("e_score_correction_bias"):
            normal(tensor, 0.0, 0.3)


def save_tiny_v4(path, dtype) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_v4_config(), dtype=torch.float32)
    _randomize(model)
    model.to(dtype).save_pretrained(path)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_fp32")
    save_tiny_v4(path, torch.float32)
    return path


def _load(path):
    return load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)


def _assert_matches(result) -> None:
    print(f"prefill {result.prefill_error:.2e} last {result.last_error:.2e} steps max {max(result.step_errors):.2e}")
    assert result.prefill_error < 1e-4
    assert result.last_error < 1e-4
    assert max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens


def test_deepseek_v4_fp32_matches_transformers(fp32_checkpoint):
    hf = load_reference(fp32_checkpoint, torch.float32)
    _assert_matches(compare_with_transformers(hf, fp32_checkpoint, dtype=torch.float32))


def test_deepseek_v4_bf16_checkpoint_matches_transformers(tmp_path):
    save_tiny_v4(tmp_path, torch.bfloat16)
    hf = load_reference(tmp_path, torch.float32)  # both sides compute in fp32 from the same stored weights
    _assert_matches(compare_with_transformers(hf, tmp_path, dtype=torch.float32))


def _release_name(name: str) -> str:
    """transformers' save_pretrained spelling -> the DeepSeek release's."""
    name = name.removeprefix("model.")
    renames = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn"}
    renames |= {"hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    return renames.get(name, name.replace(".attn.norm.", ".attn.kv_norm."))


def _release_config(hf: dict) -> dict:
    """transformers' config.json -> the release's keys (per-layer ratios, hash-layer count, flat yarn)."""
    ratio = {"sliding_attention": 0, **COMPRESS_RATES}
    config = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    config |= {"compress_ratios": [ratio[t] for t in hf["layer_types"]] + [0], "num_hash_layers": 2}
    legacy_yarn = {"type": "yarn", **{k: v for k, v in YARN.items() if k != "rope_type"}}
    config |= {"qk_rope_head_dim": 8, "rope_scaling": legacy_yarn, "rope_theta": 10000.0}
    del config["rope_parameters"], config["partial_rotary_factor"]
    return config


def test_release_names_and_transformers_names_load_identically(fp32_checkpoint, tmp_path):
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    expected = moetier_run(_load(fp32_checkpoint), prompt, steps=4)

    release = tmp_path / "release"
    release.mkdir()
    tensors = {_release_name(k): v for k, v in load_file(fp32_checkpoint / "model.safetensors").items()}
    tensors["mtp.0.attn.wq_a.weight"] = torch.randn(3, 3)  # multi-token-prediction layers are ignored
    assert "layers.1.attn.indexer.compressor.wkv.weight" in tensors and "head.weight" in tensors
    save_file(tensors, release / "model.safetensors")
    hf_config = json.loads((fp32_checkpoint / "config.json").read_text())
    (release / "config.json").write_text(json.dumps(_release_config(hf_config)))

    in_memory = tmp_path / "in_memory"  # transformers' module names, fused [E, 2I, H] / [E, H, I] experts
    in_memory.mkdir()
    state = load_reference(fp32_checkpoint, torch.float32).state_dict()
    assert "model.layers.2.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, in_memory / "model.safetensors")
    shutil.copy(fp32_checkpoint / "config.json", in_memory / "config.json")

    for path in (release, in_memory):
        prefill, steps, tokens = moetier_run(_load(path), prompt, steps=4)
        assert torch.equal(prefill, expected[0])
        assert all(torch.equal(a, b) for a, b in zip(steps, expected[1], strict=True))
        assert tokens == expected[2]


def test_indexer_top_k_changes_the_result(fp32_checkpoint):
    """Guard against a test that cannot fail: attending to every CSA entry must move the logits."""
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    loaded = _load(fp32_checkpoint)
    reference = moetier_run(loaded, prompt, steps=0)[0]
    for layer in loaded.model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.topk = 1000
    assert relative_error(moetier_run(loaded, prompt, steps=0)[0], reference) > 1e-3


def test_checkpoint_name_variants(fp32_checkpoint):
    name_of = _load(fp32_checkpoint).model.map_checkpoint_name
    kv_norm = ParamTarget("layers.3.attn.kv_norm.weight")
    for name in (
        "layers.3.attn.kv_norm.weight",
        "model.layers.3.attn.norm.weight",
        "model.layers.3.self_attn.kv_norm.weight",
    ):
        assert name_of(name) == kv_norm
    pooled = ParamTarget("layers.3.attn.indexer.compressor.ape")
    assert name_of("model.layers.3.self_attn.compressor.indexer.position_bias") == pooled
    assert name_of("model.layers.2.mlp.shared_experts.up_proj.weight") == name_of(
        "layers.2.ffn.shared_experts.w3.weight"
    )
    assert name_of("layers.2.ffn.experts.5.w3.weight") == ExpertTarget(2, 5, "up")
    assert name_of("model.layers.2.mlp.experts.down_proj") == ExpertTarget(2, None, "down")
    assert isinstance(name_of("mtp.0.ffn.experts.0.w1.weight"), IgnoreTarget)
    assert isinstance(name_of("layers.0.ffn.gate.bias"), IgnoreTarget)  # hash-routed layer: no score bias
    for unknown in ("layers.0.attn.compressor.wkv.weight", "layers.9.attn.wq_a.weight", "layers.2.ffn.gate.tid2eid"):
        with pytest.raises(KeyError):
            name_of(unknown)


def test_bf16_compute_stays_close_to_fp32(fp32_checkpoint):
    """bf16 activations (the GPU dtype; transformers cannot run V4 in bf16), fp32 where the reference keeps it."""
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    fp32_logits = moetier_run(_load(fp32_checkpoint), prompt, steps=0)[0]
    loaded = load_model(fp32_checkpoint, ModelLoadConfig(dtype=torch.bfloat16, device="cpu"), progress=False)
    layer = loaded.model.layers[1]
    assert layer.attn_hc.fn.dtype == layer.attn.attn_sink.dtype == layer.attn.compressor.ape.dtype == torch.float32
    assert layer.attn.wq_a.weight.dtype == torch.bfloat16
    prefill, steps, _ = moetier_run(loaded, prompt, steps=4)
    per_position = (prefill - fp32_logits).norm(dim=-1) / fp32_logits.norm(dim=-1)
    print(f"bf16 vs fp32 per-position error: median {per_position.median():.2e}")
    assert per_position.median() < 0.1 and all(s.isfinite().all() for s in steps)
