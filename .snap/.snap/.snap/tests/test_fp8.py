"""DeepSeek's FP8 block format: dequantisation against transformers and float64, and a whole FP8 model."""

import json
import math
import re

import pytest
import torch
from reference import compare_with_transformers, load_reference, relative_error, save_tiny
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import tiny_v3_config

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import format_for
from moetier.weights.fp8 import dequantize_blocks

FP8_MAX = 448.0  # largest finite float8 e4m3 value
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
# The linear weights DeepSeek ships in FP8: attention projections, dense/shared MLPs and routed experts.
QUANTISED = re.compile(
    r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)


def quantize_blocks(weight: torch.Tensor, block=(128, 128), fp8=torch.float8_e4m3fn):
    """Per-tile absmax quantisation (partial edge tiles allowed): float8 weight and float32 ``scale_inv``."""
    rows, cols = weight.shape[-2:]
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    w = weight.double()
    scale = torch.empty(*weight.shape[:-2], *grid, dtype=torch.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[..., i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[..., i, j] = tile.abs().amax(dim=(-2, -1)).clamp(min=1e-12) / FP8_MAX
    scale = scale.float()
    return (w / expand_scales(scale, rows, cols, block)).to(fp8), scale


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block) -> torch.Tensor:
    """Each scale repeated over its tile, cropped to ``[rows, cols]``, in float64."""
    full = scale.double().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Float64 dequantisation written independently of moetier's (tile expansion instead of padding)."""
    return q.double() * expand_scales(scale, *q.shape[-2:], block)


def random_weight(*shape: int, seed: int = 0) -> torch.Tensor:
    # Rows of very different magnitude so that per-tile scales genuinely differ.
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-2])[:, None]


@pytest.mark.parametrize("shape", [(256, 384), (3, 256, 128)])
def test_dequantize_matches_transformers(shape):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, scale = quantize_blocks(random_weight(*shape))
    assert scale.unique().numel() > 1
    ours = dequantize_blocks(q, scale, (128, 128), torch.float32)
    theirs = Fp8Dequantize(type("Quantizer", (), {"quantization_config": FineGrainedFP8Config()})())._dequantize_one(
        q, scale, output_dtype=torch.float32
    )
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("shape", "block", "fp8"),
    [
        ((300, 200), (128, 128), torch.float8_e4m3fn),  # partial tiles in both dims
        ((2, 130, 257), (128, 128), torch.float8_e4m3fn),  # leading expert dim, 2-wide edge tiles
        ((96, 80), (64, 32), torch.float8_e5m2),  # a non-default block, the other float8 encoding
    ],
)
def test_dequantize_ragged_matches_float64(shape, block, fp8):
    q, scale = quantize_blocks(random_weight(*shape, seed=1), block, fp8)
    expected = reference_dequantize(q, scale, block)
    ours = dequantize_blocks(q, scale, block, torch.float32)
    assert relative_error(ours, expected) < 1e-7
    bf16 = dequantize_blocks(q, scale, block, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and relative_error(bf16, expected) < 1e-2
    with pytest.raises(ValueError, match="do not tile"):
        dequantize_blocks(q, scale[..., :-1], block, torch.float32)


def _write_checkpoint(path, tensors, quant=QUANT_CONFIG):
    path.mkdir(exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": quant}))
    return Checkpoint(path)


def test_format_reads_block_size_and_checks_scale_shapes(tmp_path):
    weight = random_weight(100, 70, seed=2)
    q, scale = quantize_blocks(weight, (32, 32))
    ckpt = _write_checkpoint(
        tmp_path / "ok",
        {"a.weight": q, "a.weight_scale_inv": scale, "n.weight": weight[0]},
        QUANT_CONFIG | {"weight_block_size": [32, 32]},
    )
    fmt = format_for("a.weight", ckpt)
    assert fmt.companions("a.weight") == ["a.weight_scale_inv"] and fmt.block == (32, 32)
    assert format_for("n.weight", ckpt).name == "plain"
    dense = fmt.dequantize(ckpt.get("a.weight"), [ckpt.get("a.weight_scale_inv")], torch.float32)
    assert relative_error(dense, reference_dequantize(q, scale, (32, 32))) < 1e-7

    bad = _write_checkpoint(tmp_path / "bad", {"a.weight": q, "a.weight_scale_inv": scale})  # 128x128 in config
    with pytest.raises(CheckpointError, match=r"a\.weight_scale_inv has shape \[4, 3\].*needs \[1, 1\]"):
        format_for("a.weight", bad)


def quantize_checkpoint(src, dst, num_layers: int) -> dict[str, torch.Tensor]:
    """DeepSeek's release layout from a plain checkpoint; returns the float64 dequantised weights.

    Also appends a multi-token-prediction layer (index ``num_layers``), which the runtime must skip.
    """
    tensors, dequantised = {}, {}
    for name, value in load_file(src / "model.safetensors").items():
        if QUANTISED.search(name):
            q, scale = quantize_blocks(value)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantised[name] = reference_dequantize(q, scale)
        else:
            tensors[name] = value
    mtp = f"model.layers.{num_layers}"
    for part in ("eh_proj", "mlp.experts.0.gate_proj"):
        q, scale = quantize_blocks(random_weight(64, 128))
        tensors |= {f"{mtp}.{part}.weight": q, f"{mtp}.{part}.weight_scale_inv": scale}
    tensors[f"{mtp}.enorm.weight"] = torch.rand(128)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": QUANT_CONFIG}))
    return dequantised


def overwrite_reference(hf, dequantised: dict[str, torch.Tensor]) -> None:
    """Put the dequantised weights into transformers' model (experts live fused there: gate_up / down)."""
    expert = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
    with torch.no_grad():
        for name, value in dequantised.items():
            match = expert.match(name)
            if match is None:
                hf.get_parameter(name).copy_(value)
                continue
            layer, index, part = int(match[1]), int(match[2]), match[3]
            experts = hf.model.layers[layer].mlp.experts
            inter = experts.down_proj.shape[-1]
            if part == "down":
                experts.down_proj[index].copy_(value)
            else:
                rows = slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
                experts.gate_up_proj[index, rows].copy_(value)


# Every weight dimension either fits one 128 tile or is a multiple of 128: transformers' own FP8
# dequantisation infers the tile from the scale grid and is only right for such shapes.
ALIGNED = dict(
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    q_lora_rank=128,
    kv_lora_rank=112,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
)
# Partial edge tiles, as in the release checkpoint's kv_a_proj_with_mqa (576 rows).
RAGGED = dict(
    hidden_size=192,
    intermediate_size=320,
    moe_intermediate_size=160,
    q_lora_rank=144,
    kv_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)


@pytest.mark.parametrize("shapes", ["aligned", "ragged"])
def test_fp8_deepseek_v3_matches_transformers(tmp_path, shapes):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    dims = ALIGNED if shapes == "aligned" else RAGGED
    config = tiny_v3_config(
        **dims,
        num_hidden_layers=3,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    save_tiny(config, tmp_path / "plain", dtype=torch.bfloat16)
    dequantised = quantize_checkpoint(tmp_path / "plain", tmp_path / "fp8", config.num_hidden_layers)
    if shapes == "aligned":  # transformers' own FP8 loading path, dequantising on CPU
        hf = AutoModelForCausalLM.from_pretrained(
            tmp_path / "fp8", dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
        ).eval()
        o_proj = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(hf.get_parameter(o_proj), dequantised[o_proj].float())
    else:  # transformers cannot dequantise partial tiles: give the plain model the same dequantised weights
        hf = load_reference(tmp_path / "plain", torch.float32)
        overwrite_reference(hf, dequantised)
    result = compare_with_transformers(hf, tmp_path / "fp8", dtype=torch.float32)
    assert result.prefill_error < 1e-4
    assert result.last_error < 1e-4
    assert max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens


def test_release_v4_scale_name_and_ue8m0_scales(tmp_path):
    """DeepSeek-V4's release stores FP8 scales as ``*.scale`` in ue8m0 (powers of two)."""
    weight = random_weight(256, 200, seed=3)
    q, scale = quantize_blocks(weight)
    pow2 = torch.exp2(torch.ceil(torch.log2(scale)))  # ue8m0 can only hold powers of two
    q = (weight / expand_scales(pow2, 256, 200, (128, 128))).to(torch.float8_e4m3fn)
    ckpt = _write_checkpoint(tmp_path / "v4", {"a.weight": q, "a.scale": pow2.to(torch.float8_e8m0fnu)})
    fmt = format_for("a.weight", ckpt)
    assert fmt.name == "fp8-block" and fmt.companions("a.weight") == ["a.scale"]
    dense = fmt.dequantize(ckpt.get("a.weight"), [ckpt.get("a.scale")], torch.float32)
    assert relative_error(dense, reference_dequantize(q, pow2)) < 1e-7
    assert relative_error(dense, weight) < 0.1  # really a quantisation of the original weight
