"""Backbone linears kept fp8-block (``backbone_format="fp8"``, the default) compute what dequantised ones do.

Tiny DeepSeek-V4 and DeepSeek-V3 checkpoints with their attention, dense-layer and shared-expert linears stored
float8 (as the releases store them) load twice: linears kept fp8, and dequantised at load. Off CUDA an fp8 linear
dequantises its weight each call, so the two runs must agree bit for bit; on CUDA the few-row kernel differs from
cuBLAS only in summation order (tests/test_fp8_linear_kernel.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from reference import moetier_run, relative_error, save_tiny
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import tiny_v3_config
from test_deepseek_v4 import save_tiny_v4
from test_fp8 import quantize_blocks, quantize_checkpoint

from moetier import cli
from moetier.config import ModelLoadConfig, resolve_backbone_format
from moetier.errors import ConfigError
from moetier.models.fp8_linear import Fp8BlockLinear
from moetier.tiers.plan import PlanBudget, TierOptions, checkpoint_sizes, make_plan, plan_for
from moetier.weights.loader import load_model

PROMPT_LEN, STEPS = 20, 8
# DeepSeek-V4's backbone linears in transformers' checkpoint names (attention, compressors, indexer, shared experts).
V4_LINEAR = re.compile(r"\.attn\.(.+\.)?(w\w*|weights_proj)\.weight$|\.shared_experts\.w[123]\.weight$")


def _quantize_v4(src, dst, tile):
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if V4_LINEAR.search(name) and value.dim() == 2:
            q, scale = quantize_blocks(value.float(), tile)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
        else:
            tensors[name] = value
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(tile)}
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))


@pytest.fixture(scope="module")
def v4_checkpoints(tmp_path_factory):
    """DeepSeek-V4 with fp8 linears in 16x16 tiles (every fused group aligned: fused) and in 128x128 tiles (one
    partial tile each: the groups run linear by linear)."""
    root = tmp_path_factory.mktemp("fp8_backbone_v4")
    save_tiny_v4(root / "plain", torch.bfloat16)
    _quantize_v4(root / "plain", root / "tile16", (16, 16))
    _quantize_v4(root / "plain", root / "tile128", (128, 128))
    return root


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_backbone_v3")
    save_tiny(tiny_v3_config(num_hidden_layers=3, first_k_dense_replace=1), root / "plain", dtype=torch.bfloat16)
    quantize_checkpoint(root / "plain", root / "fp8", 3)
    return root / "fp8"


def _load(path, backbone_format, dtype=torch.bfloat16):
    config = ModelLoadConfig(dtype=dtype, backbone_format=backbone_format)
    return load_model(path, config, progress=False)


def _prompt(path):
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))


def _fp8_linears(model) -> dict[str, Fp8BlockLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}


def _bytes(model) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _assert_identical(run, reference):
    (prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens) = run, reference
    assert tokens == ref_tokens
    assert torch.equal(prefill, ref_prefill)
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


@pytest.mark.parametrize("tile", ["tile16", "tile128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v4_fp8_linears_give_the_dequantised_runs_bits(v4_checkpoints, tile, dtype):
    path = v4_checkpoints / tile
    kept, dense = _load(path, "fp8", dtype), _load(path, "dense", dtype)
    linears = _fp8_linears(kept.model)
    assert not _fp8_linears(dense.model)
    layer = kept.model.layers[1].attn
    assert isinstance(layer.wo_a, Fp8BlockLinear) and isinstance(layer.wq_a, Fp8BlockLinear)
    assert isinstance(kept.model.layers[0].ffn.shared_experts.gate_proj, Fp8BlockLinear)
    assert len(linears) >= 5 * 7  # every layer's attention projections and shared expert
    for linear in linears.values():
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.scale.dtype == torch.float32
    fused = layer.x_proj
    assert (fused.weight is not None) == (tile == "tile16")  # 128x128: partial tile rows refuse to fuse
    if tile == "tile16":
        assert fused.weight.dtype == torch.float8_e4m3fn and fused.tile == (16, 16)
    assert _bytes(kept.model) < _bytes(dense.model)
    prompt = _prompt(path)
    _assert_identical(moetier_run(kept, prompt, STEPS), moetier_run(dense, prompt, STEPS))


def test_v3_fp8_linears_give_the_dequantised_runs_bits_and_absorbed_ones_stay_dense(v3_checkpoint):
    kept, dense = _load(v3_checkpoint, "fp8"), _load(v3_checkpoint, "dense")
    linears = _fp8_linears(kept.model)
    assert any(name.endswith("q_a_proj") for name in linears)
    assert any(name.endswith("mlp.down_proj") for name in linears)
    assert not any("kv_b_proj" in name for name in linears)  # its weight is read, not called: dequantised at load
    assert kept.model.dtype == torch.bfloat16
    prompt = _prompt(v3_checkpoint)
    _assert_identical(moetier_run(kept, prompt, STEPS), moetier_run(dense, prompt, STEPS))


def test_plan_counts_the_backbone_that_loads(v4_checkpoints):
    path = v4_checkpoints / "tile128"
    for backbone_format in ("fp8", "dense"):
        sizes = checkpoint_sizes(path, torch.bfloat16, backbone_format=backbone_format)
        assert sizes.backbone == _bytes(_load(path, backbone_format).model)
    kept = checkpoint_sizes(path, torch.bfloat16).backbone
    dense = checkpoint_sizes(path, torch.bfloat16, backbone_format="dense").backbone
    assert kept < dense
    plan = make_plan(path, PlanBudget(gpu_memory="1GiB", context=256, backbone_format="dense"))
    assert plan.backbone_bytes == dense
    assert plan.fp8_linears == 0 and "fp8-block as stored" not in plan.table()
    kept_plan = make_plan(path, PlanBudget(gpu_memory="1GiB", context=256))
    swapped = len(_fp8_linears(_load(path, "fp8").model))
    assert kept_plan.fp8_linears == swapped > 0
    assert f"{swapped} linears fp8-block as stored" in kept_plan.table()


def test_auto_keeps_the_backbone_fp8_on_cuda_and_dequantises_it_elsewhere(v4_checkpoints):
    """``auto`` (the default): fp8 where the kernel runs; off CUDA an fp8 linear would dequantise every call, so the
    CPU load is the dense one (the same bits, see above); the plan places a GPU's memory: fp8."""
    assert resolve_backbone_format("auto", "cuda") == "fp8" and resolve_backbone_format("auto", "cpu") == "dense"
    assert resolve_backbone_format("fp8", "cpu") == "fp8" and resolve_backbone_format("dense", "cuda") == "dense"
    path = v4_checkpoints / "tile128"
    auto = load_model(path, ModelLoadConfig(dtype=torch.bfloat16), progress=False)
    assert not _fp8_linears(auto.model) and _bytes(auto.model) == _bytes(_load(path, "dense").model)
    fp8 = checkpoint_sizes(path, torch.bfloat16, "dense", "fp8")
    assert checkpoint_sizes(path, torch.bfloat16).backbone == fp8.backbone  # a plan of its own: a GPU's
    planned = plan_for(path, TierOptions(gpu_memory="1GiB"), ModelLoadConfig(dtype=torch.bfloat16), 256, 1)
    assert planned.backbone_bytes == _bytes(auto.model) and planned.fp8_linears == 0  # a CPU load's plan: dense


def test_backbone_format_is_checked_and_parsed(v4_checkpoints, capsys):
    with pytest.raises(ConfigError, match="backbone_format must be one of auto, fp8, dense"):
        ModelLoadConfig(backbone_format="int4")
    with pytest.raises(ConfigError, match="backbone_format"):
        PlanBudget(gpu_memory="1GiB", backbone_format="bf16")
    path = v4_checkpoints / "tile128"
    assert cli.main(["plan", "--model", str(path), "--gpu-memory", "1GiB", "--backbone-format", "dense"]) == 0
    dense_out = capsys.readouterr().out
    assert cli.main(["plan", "--model", str(path), "--gpu-memory", "1GiB"]) == 0
    assert capsys.readouterr().out != dense_out  # the fp8 backbone is smaller
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", str(path), "--gpu-memory", "1GiB", "--backbone-format", "int4"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_plain_checkpoint_loads_the_same_either_way(v4_checkpoints):
    path = v4_checkpoints / "plain"
    kept = _load(path, "fp8")
    assert not _fp8_linears(kept.model)
    prompt = _prompt(path)
    _assert_identical(moetier_run(kept, prompt, 4), moetier_run(_load(path, "dense"), prompt, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_fp8_linears_on_cuda_follow_the_dequantised_run(v4_checkpoints, dtype):
    """On CUDA the linears run the fp8 kernel (prefill's 20 rows too: up to 128 rows)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from moetier.kernels import fp8_linear

    path = v4_checkpoints / "tile128"
    config = {"dtype": dtype, "device": "cuda"}
    kept = load_model(path, ModelLoadConfig(**config), progress=False)
    dense = load_model(path, ModelLoadConfig(**config, backbone_format="dense"), progress=False)
    wq_a = kept.model.layers[0].attn.wq_a
    one_token = torch.randn(1, wq_a.in_features, device="cuda", dtype=dtype)
    assert fp8_linear._kernel_takes(one_token, wq_a.weight, wq_a.scale, wq_a.tile, 1)
    prompt = _prompt(path)
    (prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens) = (
        moetier_run(kept, prompt, STEPS),
        moetier_run(dense, prompt, STEPS),
    )
    assert not fp8_linear._BROKEN
    # The kernel's float32 sums and cuBLAS's differ in order only (and the 128x128 tiles leave the fp8 model's
    # projections unfused where the dense model runs one GEMM over them).
    assert relative_error(prefill, ref_prefill) < (1e-5 if dtype == torch.float32 else 3e-2)
    if dtype == torch.float32:  # summation order only: far below any token's margin
        assert tokens == ref_tokens
        assert max(relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)) < 1e-4
    else:  # bf16 roundings of differently ordered sums: the first step, before any token may differ
        assert relative_error(steps[0], ref_steps[0]) < 3e-2
