"""Checkpoint layouts (single file, shards, fused experts), load dtypes, the progress bar and peak host memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import relative_error, save_tiny
from safetensors.torch import load_file, save_file
from test_qwen3_moe import tiny_qwen3_config

from moetier.config import ModelLoadConfig
from moetier.models import MODEL_REGISTRY
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM
from moetier.weights.checkpoint import INDEX_FILE
from moetier.weights.loader import LoadedModel, load_model


def load(path: Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> LoadedModel:
    return load_model(path, ModelLoadConfig(dtype=dtype, device="cpu"), progress=progress)


@torch.no_grad()
def prefill_logits(loaded: LoadedModel, tokens: int = 40, seed: int = 3) -> torch.Tensor:
    model = loaded.model
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    return model.compute_logits(model(prompt, model.new_cache(tokens)))


def fuse_experts(src: Path, dst: Path) -> None:
    """Rewrite ``src`` with transformers' fused expert tensors: ``gate_up_proj`` [E,2I,H], ``down_proj`` [E,H,I]."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    moe_layers = sorted({int(n.split(".")[2]) for n in tensors if ".mlp.experts." in n})
    for layer in moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        parts = {
            part: torch.stack(
                [tensors.pop(f"{prefix}.{e}.{part}_proj.weight") for e in range(config["num_local_experts"])]
            )
            for part in ("gate", "up", "down")
        }
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([parts["gate"], parts["up"]], dim=1)
        tensors[f"{prefix}.down_proj"] = parts["down"]
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The same tiny Qwen3-MoE weights saved whole, in several shards, and with fused experts."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("layouts")
    save_tiny(tiny_qwen3_config(), root / "single")
    AutoModelForCausalLM.from_pretrained(root / "single").save_pretrained(root / "sharded", max_shard_size="300KB")
    fuse_experts(root / "single", root / "fused")
    return {kind: root / kind for kind in ("single", "sharded", "fused")}


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    params_b = dict(b.model.named_parameters())
    for name, param in a.model.named_parameters():
        assert torch.equal(param, params_b[name]), name
    experts_b = dict(b.store.items())
    assert len(experts_b) == len(dict(a.store.items())) > 0
    for key, weights in a.store.items():
        assert torch.equal(weights.block, experts_b[key].block), key


def test_sharded_checkpoint_loads_like_the_single_file(checkpoints):
    sharded = checkpoints["sharded"]
    index = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) >= 3 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    single, split = load(checkpoints["single"]), load(sharded)
    assert_same_model(single, split)
    assert torch.equal(prefill_logits(split), prefill_logits(single))


def test_fused_expert_layout_loads_like_per_expert_tensors(checkpoints):
    fused_names = load_file(str(checkpoints["fused"] / "model.safetensors"))
    assert fused_names["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert fused_names["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert not any(".experts.0." in name for name in fused_names)
    per_expert, fused = load(checkpoints["single"]), load(checkpoints["fused"])
    assert_same_model(per_expert, fused)
    # gate rows come first in a fused block, as in transformers' gate_up_proj
    original = load_file(str(checkpoints["single"] / "model.safetensors"))
    block = fused.store.expert(3, 6)
    assert torch.equal(block.gate_up[:32], original["model.layers.3.mlp.experts.6.gate_proj.weight"])
    assert torch.equal(block.gate_up[32:], original["model.layers.3.mlp.experts.6.up_proj.weight"])
    assert torch.equal(prefill_logits(fused), prefill_logits(per_expert))


class _Fp32NormsQwen3(Qwen3MoeForCausalLM):
    """Qwen3-MoE asking for float32 norms and routers, to exercise ``keep_fp32`` (Qwen3 itself asks for none)."""

    keep_fp32 = ("norm", "mlp.gate.")


@pytest.fixture
def fp32_norms_checkpoint(checkpoints, tmp_path):
    arch = "Fp32NormsTestQwen3MoeForCausalLM"
    path = Path(shutil.copytree(checkpoints["single"], tmp_path / "fp32_norms"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": [arch]}))
    MODEL_REGISTRY[arch] = _Fp32NormsQwen3
    yield path
    del MODEL_REGISTRY[arch]


def test_bf16_load_keeps_fp32_only_where_asked(fp32_norms_checkpoint):
    loaded = load(fp32_norms_checkpoint, torch.bfloat16)
    stored = load_file(str(fp32_norms_checkpoint / "model.safetensors"))
    kept = set()
    for name, param in loaded.model.named_parameters():
        keep = any(pattern in name for pattern in _Fp32NormsQwen3.keep_fp32)
        assert param.dtype == (torch.float32 if keep else torch.bfloat16), name
        source = stored["lm_head.weight" if name == "lm_head.weight" else f"model.{name}"]
        assert torch.equal(param, source.to(param.dtype)), name
        kept.update([name] if keep else [])
    assert {"norm.weight", "layers.0.mlp.gate.weight", "layers.2.self_attn.q_norm.weight"} <= kept
    assert loaded.store.dtype == torch.bfloat16
    block = loaded.store.expert(2, 3)
    assert block.block.dtype == torch.bfloat16
    assert torch.equal(block.down, stored["model.layers.2.mlp.experts.3.down_proj.weight"].bfloat16())


def test_bf16_model_runs_close_to_fp32(checkpoints):
    bf16 = load(checkpoints["single"], torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    error = relative_error(prefill_logits(bf16), prefill_logits(load(checkpoints["single"])))
    assert 0 < error < 5e-2


def test_progress_bar_goes_to_stderr_only_when_asked(checkpoints, capsys):
    load(checkpoints["sharded"], progress=True)
    shown = capsys.readouterr()
    assert "loading weights" in shown.err and "100%" in shown.err
    assert "loading weights" not in shown.out
    load(checkpoints["sharded"], progress=False)
    assert "loading weights" not in capsys.readouterr().err


# --- peak host memory: "near the model size, never twice it" ---

# Tiny widths, many wide experts: routed experts are ~99.7% of the bytes.
BIG = {"hidden": 128, "moe_inter": 512, "experts": 96, "layers": 4, "vocab": 256}

# Peak RSS is read from VmHWM, the high-water mark of this process image, reset once the imports
# are done. ru_maxrss would not do: Linux carries it across fork+exec, so the child would report
# the pytest parent's RSS (measured: 2.5x) rather than its own peak.
PEAK_SCRIPT = r"""
import json, os, re, sys, time
import torch
torch.set_num_threads(1)  # the copies are memory-bound; extra threads only fight the other tests for 2 cores
from moetier.config import ModelLoadConfig
from moetier.weights.loader import load_model

def status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))

config = ModelLoadConfig(dtype=torch.float32, device="cpu")
load_model(sys.argv[1], config, progress=False)  # the loader imports model families on first use
base = status_kb("VmRSS") * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
start = time.perf_counter()
loaded = load_model(sys.argv[2], config, progress=False)
seconds = time.perf_counter() - start
peak = status_kb("VmHWM") * 1024
down = loaded.store.expert(3, 95).down
print(json.dumps({"base": base, "peak": peak, "seconds": seconds, "expert_bytes": loaded.store.total_bytes(),
                  "corner": down[-1, -4:].tolist()}))
"""


def write_big_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A ~300 MB fp32 Qwen3-MoE checkpoint of uniform random weights; returns the last expert's down_proj."""
    hidden, inter, experts, layers, vocab = (BIG[k] for k in ("hidden", "moe_inter", "experts", "layers", "vocab"))
    heads, kv_heads, head_dim = 4, 2, 32
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 256,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 128,
    }
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.rand(*shape, generator=generator) - 0.5
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden)}
    tensors["model.norm.weight"] = rand(hidden)
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": rand(hidden),
            f"{prefix}.post_attention_layernorm.weight": rand(hidden),
            f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": rand(head_dim),
            f"{prefix}.self_attn.k_norm.weight": rand(head_dim),
            f"{prefix}.mlp.gate.weight": rand(experts, hidden),
        }
        for e in range(experts):
            tensors[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            tensors[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            tensors[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors[f"model.layers.{layers - 1}.mlp.experts.{experts - 1}.down_proj.weight"]


@pytest.mark.slow
def test_peak_host_memory_stays_near_the_checkpoint_size(checkpoints, tmp_path):
    big = tmp_path / "big"
    try:
        last_down = write_big_checkpoint(big)
        size = (big / "model.safetensors").stat().st_size
        assert 280e6 < size < 320e6
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        run = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, str(checkpoints["single"]), str(big)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    finally:
        shutil.rmtree(big, ignore_errors=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["corner"] == last_down[-1, -4:].tolist()  # the weights really arrived
    assert result["expert_bytes"] > 0.99 * size
    ratio = (result["peak"] - result["base"]) / size
    print(f"peak host memory while loading {size / 1e6:.0f} MB: {ratio:.2f}x the checkpoint, {result['seconds']:.2f} s")
    assert 0.95 < ratio < 1.5
