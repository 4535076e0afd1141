"""The benchmark checkpoint writer: real names/shapes, readable shards, streaming memory, routing skew."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moetier.bench.make_model import WriteOptions, main, write_bench_model
from moetier.bench.safetensors_out import INDEX_FILE
from moetier.bench.shapes import (
    CSA,
    HCA,
    SLIDING,
    build_config,
    deepseek_v3_dense_layers,
    deepseek_v4_layer_types,
    deepseek_v4_mlp_layer_types,
)
from moetier.bench.skew import spearman
from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint

# Tiny widths for every family (the writer keeps names, layer mix and routing of the real shape).
TINY = {
    "deepseek-v4-flash": dict(
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        sliding_window=8,
        compress_rates={CSA: 4, HCA: 8},
        num_experts_per_tok=4,
    ),
    "deepseek-v3": dict(
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "qwen3-235b": dict(
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=4
    ),
}
# Layers that cover each family's mix: V4 sliding/CSA/HCA + hash/learned MoE, V3 dense + MoE,
# Qwen3 a dense (mlp_only) layer between MoE layers.
LAYERS = {"deepseek-v4-flash": 5, "deepseek-v3": 3, "qwen3-235b": 3}
VOCAB = 320


def tiny_config(shape, layers=None, experts=32, vocab=VOCAB, **extra):
    overrides = {**TINY[shape], **extra}
    if shape == "qwen3-235b":
        overrides.setdefault("mlp_only_layers", [1])
    return build_config(
        shape,
        layers or LAYERS[shape],
        vocab_size=vocab,
        experts=experts,
        hidden_size=64,
        moe_intermediate_size=32,
        overrides=overrides,
    )


def stored_tensors(folder):
    """{name: (shape, dtype, shard)} over every shard in ``folder``."""
    found = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            names = list(handle.keys())  # the handle itself is not iterable
            for name in names:
                piece = handle.get_slice(name)
                found[name] = (tuple(piece.get_shape()), piece.get_dtype(), shard.name)
    return found


def test_layer_patterns_keep_the_published_mix():
    flash = deepseek_v4_layer_types(43)
    assert flash[:2] == [SLIDING, SLIDING] and flash[2::2] == [CSA] * 21 and flash[3::2] == [HCA] * 20
    assert deepseek_v4_mlp_layer_types(43) == ["hash_moe"] * 3 + ["moe"] * 40
    assert deepseek_v3_dense_layers(61) == 3
    for layers in range(3, 12):
        assert {SLIDING, CSA, HCA} <= set(deepseek_v4_layer_types(layers))
    for layers in range(2, 12):
        assert set(deepseek_v4_mlp_layer_types(layers)) == {"hash_moe", "moe"}
        assert 1 <= deepseek_v3_dense_layers(layers) < layers
    full = build_config("deepseek-v4-flash", 4)
    assert (full["hidden_size"], full["n_routed_experts"], full["num_experts_per_tok"]) == (4096, 256, 6)
    assert full["rope_parameters"]["compress"]["rope_type"] == "yarn"


@pytest.mark.parametrize("shape", sorted(TINY))
def test_checkpoint_matches_transformers(tmp_path, shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(shape, experts=8, num_experts_per_tok=2)
    # Tiny shards force several files, so the index is exercised.
    summary = write_bench_model(cfg, tmp_path / "ours", WriteOptions(shard_bytes=300_000, progress=False, seed=3))
    ours = stored_tensors(tmp_path / "ours")
    assert len(summary.shards) > 1 and len(ours) == summary.tensors

    # Names and shapes exactly as transformers' save_pretrained writes them for the same config.
    hf_config = AutoConfig.from_pretrained(tmp_path / "ours")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts_per_tok", "layer_types"):
        assert getattr(hf_config, key, None) == cfg.get(key)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "reference")
    reference = stored_tensors(tmp_path / "reference")
    assert {n: s for n, (s, _, _) in ours.items()} == {n: s for n, (s, _, _) in reference.items()}

    # The index names every tensor's real shard and the real total size.
    index = json.loads((tmp_path / "ours" / INDEX_FILE).read_text())
    assert index["weight_map"] == {name: shard for name, (_, _, shard) in ours.items()}
    checkpoint = Checkpoint(tmp_path / "ours")
    assert index["metadata"]["total_size"] == checkpoint.total_bytes() == summary.total_bytes
    assert set(checkpoint.names()) == set(ours)

    # transformers loads it with nothing missing or unexpected, and the logits are usable.
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std(dim=0).mean() > 0.05  # positions differ: the model did not collapse
    assert logits.argmax(-1).unique().numel() > 10


def test_weight_values_follow_the_reference_init(tmp_path):
    cfg = tiny_config("deepseek-v4-flash", experts=8)
    write_bench_model(cfg, tmp_path, WriteOptions(progress=False))
    ckpt = Checkpoint(tmp_path)
    expert = ckpt.get("model.layers.3.ffn.experts.5.w1.weight").float()
    assert ckpt.tensors["model.layers.3.ffn.experts.5.w1.weight"].dtype == "BF16"
    assert abs(expert.std().item() - 0.02) < 0.002 and abs(expert.mean().item()) < 0.002
    assert torch.equal(ckpt.get("model.layers.2.attn_norm.weight").float(), torch.ones(64))
    assert torch.equal(ckpt.get("model.layers.1.hc_ffn_scale"), torch.ones(3))
    assert ckpt.get("model.layers.1.hc_ffn_fn").dtype == torch.float32
    assert not ckpt.get("model.layers.4.ffn.gate.bias").any()  # no skew: plain router
    table = ckpt.get("model.layers.0.ffn.gate.tid2eid")
    assert table.dtype == torch.int64 and table.shape == (VOCAB, 4)
    assert table.min() >= 0 and table.max() < 8
    assert all(len(set(row)) == 4 for row in table.tolist())  # distinct experts per token
    # Two experts of one layer are different draws.
    assert not torch.equal(expert, ckpt.get("model.layers.3.ffn.experts.6.w1.weight").float())


@pytest.mark.parametrize("shape", sorted(TINY))
def test_loads_into_moetier(tmp_path, shape):
    from reference import compare_with_transformers, load_reference

    from moetier.models import model_class_for

    cfg = tiny_config(shape, experts=8, num_experts_per_tok=2)
    try:
        model_class_for(cfg["architectures"])
    except CheckpointError:
        pytest.skip(f"moetier has no {cfg['architectures'][0]} family yet")
    write_bench_model(cfg, tmp_path, WriteOptions(progress=False, shard_bytes=300_000))
    result = compare_with_transformers(load_reference(tmp_path), tmp_path, prompt_len=24, steps=6)
    assert result.prefill_error < 1e-4 and max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens


def _router_picks(gate, hidden, tokens):
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(123))
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True))  # what a router sees after its RMSNorm
    with torch.no_grad():
        return gate(x[None])[2]


@pytest.mark.parametrize("shape", sorted(TINY))
def test_routing_skew_follows_popularity(tmp_path, shape):
    """transformers' own router, fed fresh random hidden states, picks experts about as often as drawn."""
    from transformers import AutoModelForCausalLM

    # A 4096-token vocabulary gives the hash table enough rows (x top-k picks) to show its frequencies.
    cfg = tiny_config(shape, layers=2, vocab=4096, **({"mlp_only_layers": []} if shape == "qwen3-235b" else {}))
    write_bench_model(cfg, tmp_path, WriteOptions(progress=False, routing_skew=1.0, seed=7))
    skew = json.loads((tmp_path / "routing_skew.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    experts, top_k, tokens = 32, 4, 20000
    moe_layer = 1  # V4: layer 0 is hash-routed; V3: layer 0 is dense
    picks = _router_picks(model.model.layers[moe_layer].mlp.gate, 64, tokens)
    observed = np.bincount(picks.reshape(-1).numpy(), minlength=experts) / (tokens * top_k)
    layer = skew["layers"][str(moe_layer)]
    popularity, target = np.array(layer["popularity"]), np.array(layer["target"])
    tv_target = 0.5 * np.abs(observed - target).sum()
    tv_uniform = 0.5 * np.abs(observed - 1 / experts).sum()
    print(f"{shape}: TV to target {tv_target:.3f}, Spearman {spearman(observed, popularity):.3f}")
    assert spearman(observed, popularity) > 0.9
    assert tv_target < 0.05
    assert tv_uniform > 0.15  # the skew is real, not a near-uniform router that happens to rank well
    if shape == "deepseek-v4-flash":  # the hash layer's table follows its own popularity
        table = model.model.layers[0].mlp.gate.tid2eid
        columns = np.bincount(table.reshape(-1).numpy(), minlength=experts) / table.numel()
        hashed = skew["layers"]["0"]
        assert 0.5 * np.abs(columns - np.array(hashed["target"])).sum() < 0.05
        assert spearman(columns, np.array(hashed["popularity"])) > 0.9


_PEAK_SCRIPT = """
import json, re, sys, torch
from moetier.bench.make_model import WriteOptions, write_bench_model
from moetier.bench.shapes import build_config

def mib(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024

cfg = build_config("qwen3-235b", 2, vocab_size=4096, experts=32, hidden_size=1024, moe_intermediate_size=512,
                   overrides={"num_attention_heads": 8, "num_key_value_heads": 2, "num_experts_per_tok": 4})
torch.ones(1).normal_()  # warm up the allocator and generator before measuring
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark
before = mib("VmRSS")
summary = write_bench_model(cfg, sys.argv[1], WriteOptions(device="cpu", chunk_bytes=8 << 20, progress=False))
print(json.dumps({"before": before, "peak": mib("VmHWM"), "bytes": summary.total_bytes, "gbps": summary.gb_per_s}))
"""


def test_writer_streams_in_chunks(tmp_path):
    """Peak RSS grows by a few 8 MiB chunks while a ~225 MB checkpoint is written."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True, check=True, timeout=300
    )
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    growth_mib, output_mib = stats["peak"] - stats["before"], stats["bytes"] / 2**20
    print(f"peak RSS growth {growth_mib:.0f} MiB for {output_mib:.0f} MiB written at {stats['gbps']:.2f} GB/s")
    assert output_mib > 200
    assert growth_mib < 0.25 * output_mib


def test_cli_is_deterministic_and_rejects_bad_input(tmp_path, capsys):
    args = ["--shape", "qwen3-235b", "--layers", "2", "--vocab-size", "256", "--experts-per-layer", "8"]
    args += ["--hidden-size", "64", "--moe-intermediate-size", "32", "--quiet", "--device", "cpu"]
    args += ["--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "head_dim=16"]
    # 256 ids cannot hold a byte-level tokenizer: asked for one, the writer fails before writing anything.
    assert main([*args, "--out", str(tmp_path / "small")]) == 2
    assert "--no-tokenizer" in capsys.readouterr().err and not (tmp_path / "small").exists()
    args.append("--no-tokenizer")

    def digest(folder):
        return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    assert main([*args, "--out", str(tmp_path / "a"), "--seed", "1"]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--seed", "1"]) == 0
    assert main([*args, "--out", str(tmp_path / "c"), "--seed", "2"]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")
    assert "wrote" in capsys.readouterr().out

    assert main([*args, "--out", str(tmp_path / "a")]) == 2  # not empty, no --force
    assert main([*args, "--out", str(tmp_path / "d"), "--set", "num_experts_per_tok=9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--force" in err[0] and "num_experts_per_tok=9" in err[1]
    assert main([*args, "--out", str(tmp_path / "a"), "--seed", "2", "--force"]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "c")
