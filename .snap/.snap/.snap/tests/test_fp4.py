"""DeepSeek-V4's FP4 expert format: bit-level decoding, transformers' dequantisation, end-to-end loading.

The float64 reference here is written from the format's definition (e2m1 bit fields, low nibble
first, one scale per block) and shares no code with ``moetier.weights.fp4``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import compare_with_transformers, load_reference, save_tiny
from safetensors.torch import load_file, save_file
from test_qwen3_moe import tiny_qwen3_config

from moetier.config import ModelLoadConfig
from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import format_for
from moetier.weights.fp4 import FP4Format, dequantize_fp4, unpack_e2m1
from moetier.weights.loader import load_model

BLOCK = 32  # the release: one scale per 32 inputs of a row


def e2m1_value(code: int) -> float:
    """One 4-bit e2m1 code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:
        return sign * 0.5 * mantissa  # subnormal
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


E2M1_TABLE = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)


def reference_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values: byte ``j`` holds element ``2j`` in its low nibble and ``2j+1`` in its high one."""
    codes = packed.contiguous().view(torch.uint8).long()
    values = E2M1_TABLE[torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)]
    # uint8 scales are raw ue8m0 exponent bytes; everything else holds the scale's value
    factors = 2.0 ** (scale.double() - 127) if scale.dtype == torch.uint8 else scale.double()
    rows, cols = values.shape[-2:]
    factors = factors.repeat_interleave(rows // scale.shape[-2], dim=-2)
    return values * factors.repeat_interleave(cols // scale.shape[-1], dim=-1)


def encode_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``[..., N, K]`` to the nearest e2m1 value times a power of two per 32 inputs.

    Returns the packed bytes ``[..., N, K/2]`` (uint8) and the ue8m0 exponent bytes ``[..., N, K/32]``.
    """
    blocks = weight.double().unflatten(-1, (-1, BLOCK))
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1) / 6.0)).clamp(-100, 100)
    scaled = blocks / 2.0 ** exponent[..., None]
    codes = (scaled[..., None] - E2M1_TABLE).abs().argmin(-1).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def random_fp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes (every code appears) and ue8m0 exponents around 2**0 for a ``[..., N, K]`` weight."""
    generator = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, generator=generator)
    exponents = torch.randint(117, 137, (*lead, rows, cols // BLOCK), dtype=torch.uint8, generator=generator)
    return packed, exponents


def test_e2m1_nibbles_decode_low_first():
    every_byte = torch.arange(256, dtype=torch.uint8)[None]
    values = unpack_e2m1(every_byte)[0].double()
    assert values.shape == (512,)
    assert values[0::2].tolist() == [e2m1_value(b & 0xF) for b in range(256)]
    assert values[1::2].tolist() == [e2m1_value(b >> 4) for b in range(256)]
    assert sorted(set(E2M1_TABLE.abs().tolist())) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


SCALE_KINDS = ["ue8m0", "uint8", "float32"]


def as_scale(exponents: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    if kind == "ue8m0":
        return exponents.view(torch.float8_e8m0fnu)
    if kind == "uint8":
        return exponents
    # float32 scales need not be powers of two: exercise the single rounding to the target dtype.
    jitter = torch.rand(exponents.shape, generator=torch.Generator().manual_seed(seed)) + 0.5
    return (2.0 ** (exponents.double() - 127) * jitter).float()


@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 128), (3, 64, 64)])
def test_dequantize_matches_transformers_and_definition(kind, dtype, shape):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    packed, exponents = random_fp4(shape, seed=len(shape))
    scale = as_scale(exponents, kind, seed=7)
    ours = dequantize_fp4(packed.view(torch.int8), scale, dtype)
    assert ours.dtype == dtype and ours.shape == shape
    assert ours.abs().max() > 0 and (ours < 0).any()
    # transformers' own CPU dequantisation of int8-packed FP4 (the path it takes with dequantize=True)
    theirs = Fp8Dequantize(None)._dequantize_one(packed.view(torch.int8), scale, output_dtype=dtype)
    assert torch.equal(ours, theirs)
    # e2m1 times a float32 scale is exact in float64, so one rounding to ``dtype`` must agree bit for bit
    assert torch.equal(ours, reference_dequantize(packed, scale).to(dtype))
    # the same bytes as torch's float4 dtype (what safetensors "F4" loads as) and as uint8
    assert torch.equal(dequantize_fp4(packed.view(torch.float4_e2m1fn_x2), scale, dtype), ours)
    assert torch.equal(dequantize_fp4(packed, scale, dtype), ours)


def test_dequantize_rejects_a_scale_grid_that_does_not_tile():
    packed, exponents = random_fp4((64, 64), seed=3)
    with pytest.raises(ValueError, match="does not divide"):
        dequantize_fp4(packed, exponents[:, :1].expand(64, 3).contiguous(), torch.float32)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["Qwen3MoeForCausalLM"]}))
    save_file({name: t.clone() for name, t in tensors.items()}, str(path / "model.safetensors"))
    return Checkpoint(path)


def test_format_claims_exactly_the_packed_weights(tmp_path):
    packed, exponents = random_fp4((64, 64), seed=5)
    fused_packed, fused_exponents = random_fp4((2, 64, 64), seed=6)
    ckpt = write_checkpoint(
        tmp_path,
        {
            "release.w1.weight": packed.view(torch.int8),  # DeepSeek-V4 release naming
            "release.w1.scale": exponents.view(torch.float8_e8m0fnu),
            "renamed.w2.weight": packed,  # transformers' name for the same scale
            "renamed.w2.weight_scale_inv": exponents,
            "float4.w3.weight": packed.view(torch.float4_e2m1fn_x2),
            "float4.w3.scale": as_scale(exponents, "float32", seed=1),
            "experts.gate_up_proj": fused_packed.view(torch.int8),  # fused, as transformers holds experts
            "experts.gate_up_proj_scale_inv": fused_exponents.view(torch.float8_e8m0fnu),
            "orphan.weight": packed.view(torch.int8),  # scale missing: claimed, so the loader names it
            "dense.weight": torch.randn(64, 64),
            "tid2eid": torch.randint(0, 8, (16, 2), dtype=torch.int32),
            "mask.bits": packed,  # uint8 that is not a weight
        },
    )
    expected = {
        "release.w1.weight": "release.w1.scale",
        "renamed.w2.weight": "renamed.w2.weight_scale_inv",
        "float4.w3.weight": "float4.w3.scale",
        "experts.gate_up_proj": "experts.gate_up_proj_scale_inv",
        "orphan.weight": "orphan.scale",
    }
    claimed = {}
    for name in ckpt.names():
        fmt = format_for(name, ckpt)
        if isinstance(fmt, FP4Format):
            (claimed[name],) = fmt.companions(name)
    assert claimed == expected
    for name, scale in expected.items():
        if ckpt.has(scale):
            fmt = format_for(name, ckpt)
            dense = fmt.dequantize(ckpt.get(name), [ckpt.get(scale)], torch.float32)
            assert torch.equal(dense, reference_dequantize(ckpt.get(name), ckpt.get(scale)).float())


def test_mismatched_scale_grid_fails_at_claim_time(tmp_path):
    packed, exponents = random_fp4((64, 64), seed=5)
    ckpt = write_checkpoint(tmp_path, {"a.weight": packed, "a.scale": exponents[:48].contiguous()})
    with pytest.raises(CheckpointError, match=r"a\.scale has shape \[48, 2\].*a\.weight") as info:
        format_for("a.weight", ckpt)
    assert "\n" not in str(info.value)


# --- end to end: a tiny Qwen3-MoE whose routed experts are re-encoded in the release's FP4 format ---

RELEASE_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


def fp4_encode_experts(src: Path, dst: Path, fused: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Rewrite ``src`` into ``dst`` with FP4 experts; return each MoE layer's dequantised (gate_up, down).

    Per-expert layout uses the release's naming (int8 weight, ue8m0 ``.scale``); the fused layout
    uses transformers' (``experts.gate_up_proj`` + float32 ``gate_up_proj_scale_inv``).
    """
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    experts, layers = config["num_local_experts"], {}
    for name in list(tensors):
        if ".mlp.experts.0.gate_proj." in name:
            layers[int(name.split(".")[2])] = name.split(".mlp.")[0]
    dequantised = {}
    for layer, prefix in layers.items():
        per_expert = [
            [tensors.pop(f"{prefix}.mlp.experts.{e}.{part}_proj.weight") for e in range(experts)]
            for part in ("gate", "up", "down")
        ]
        gate_up = torch.cat([torch.stack(per_expert[0]), torch.stack(per_expert[1])], dim=1)
        down = torch.stack(per_expert[2])
        dequantised[layer] = []
        for part, weight in (("gate_up", gate_up), ("down", down)):
            packed, exponents = encode_fp4(weight)
            dequantised[layer].append(reference_dequantize(packed, exponents).float())
            if fused:
                tensors[f"{prefix}.mlp.experts.{part}_proj"] = packed.view(torch.int8)
                tensors[f"{prefix}.mlp.experts.{part}_proj_scale_inv"] = (2.0 ** (exponents.double() - 127)).float()
            else:
                _add_per_expert(tensors, f"{prefix}.mlp.experts", part, packed, exponents)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config.update(expert_dtype="fp4", quantization_config=RELEASE_QUANT_CONFIG)
    (dst / "config.json").write_text(json.dumps(config))
    return {layer: tuple(pair) for layer, pair in dequantised.items()}


def _add_per_expert(tensors: dict, prefix: str, part: str, packed: torch.Tensor, exponents: torch.Tensor) -> None:
    halves = {"gate_up": ("gate", "up"), "down": ("down",)}[part]
    for e in range(packed.shape[0]):
        for index, half in enumerate(halves):
            rows = packed.shape[1] // len(halves)
            piece = slice(index * rows, (index + 1) * rows)
            tensors[f"{prefix}.{e}.{half}_proj.weight"] = packed[e, piece].contiguous().view(torch.int8)
            tensors[f"{prefix}.{e}.{half}_proj.scale"] = exponents[e, piece].contiguous().view(torch.float8_e8m0fnu)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_fp32")
    save_tiny(tiny_qwen3_config(), path)
    return path


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert-release-names", "fused-transformers-names"])
def test_fp4_experts_load_exactly_and_match_transformers(tiny_checkpoint, tmp_path, fused):
    path = tmp_path / "fp4"
    dequantised = fp4_encode_experts(tiny_checkpoint, path, fused)
    assert (
        path.joinpath("model.safetensors").stat().st_size < tiny_checkpoint.joinpath("model.safetensors").stat().st_size
    )
    loaded = load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    for layer, (gate_up, down) in dequantised.items():
        for expert in range(gate_up.shape[0]):
            weights = loaded.store.expert(layer, expert)
            assert torch.equal(weights.gate_up, gate_up[expert])
            assert torch.equal(weights.down, down[expert])
    # ue8m0 scales times e2m1 values are exact in bf16 too
    bf16 = load_model(path, ModelLoadConfig(dtype=torch.bfloat16, device="cpu"), progress=False)
    layer = next(iter(dequantised))
    assert torch.equal(bf16.store.expert(layer, 1).gate_up, dequantised[layer][0][1].bfloat16())

    hf = load_reference(tiny_checkpoint, torch.float32)
    with torch.no_grad():
        for layer, (gate_up, down) in dequantised.items():
            hf.model.layers[layer].mlp.experts.gate_up_proj.copy_(gate_up)
            hf.model.layers[layer].mlp.experts.down_proj.copy_(down)
    result = compare_with_transformers(hf, path, dtype=torch.float32, steps=8)
    print(f"fp4 experts, fused={fused}: prefill {result.prefill_error:.2e}, decode max {max(result.step_errors):.2e}")
    assert result.prefill_error < 1e-4
    assert max(result.step_errors) < 1e-4
    assert result.ours_tokens == result.reference_tokens


def test_fp4_expert_without_its_scale_is_a_one_line_error(tiny_checkpoint, tmp_path):
    path = tmp_path / "fp4"
    fp4_encode_experts(tiny_checkpoint, path, fused=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    message = str(info.value)
    assert "model.layers.2.mlp.experts.5.down_proj.weight is fp4-quantised" in message
    assert "model.layers.2.mlp.experts.5.down_proj.scale is missing" in message
    assert "\n" not in message
