"""The fp8 dequantisation kernel (moetier.kernels.fp8_dequant) against the torch ops it replaces
(moetier.weights.fp8.dequantize_blocks): bit for bit, under Triton's interpreter and on CUDA, for e4m3 and e5m2
values (every byte, subnormals, zeros of both signs; NaNs where the torch ops have them), every target dtype, edge
tiles, and a whole expert's dense block."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from interpreted import nearest_bf16
from moetier.kernels import fp8_dequant as k
from moetier.weights.fp8 import dequantize_blocks
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights

device = sys.argv[1]
if device == "cpu":
    nearest_bf16()  # the products round: to nearest even, as CUDA's casts
g = torch.Generator().manual_seed(0)
bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

def same(ours, ref):
    nan = ref.isnan()
    return bool(torch.equal(nan, ours.isnan()) and torch.equal(ours[~nan].view(bits[ours.dtype]),
                                                                ref[~nan].view(bits[ref.dtype])))

results = []
cases = [  # name, rows, cols, tile, value dtype
    ("release tiles, every byte", 256, 256, (128, 128), torch.float8_e4m3fn),
    ("edge tiles", 37, 300, (16, 128), torch.float8_e4m3fn),
    ("e5m2", 40, 72, (8, 32), torch.float8_e5m2),
]
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for name, rows, cols, tile, values_dtype in cases:
        codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
        codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte once
        values = codes.view(values_dtype)
        grid = (-(-rows // tile[0]), -(-cols // tile[1]))
        scale = torch.rand(grid, generator=g) * 4 + 1e-3
        values, scale = values.to(device), scale.to(device)
        out = torch.empty(rows, cols, dtype=dtype, device=device)
        fits = k._fits(out, values, scale, tile)
        ours = k._dequantize_triton(out, values, scale, tile)
        results.append({"case": f"{name} {dtype}", "fits": fits, "bits": same(ours, dequantize_blocks(values, scale,
                                                                                                      tile, dtype))})

layout = ExpertLayout(moe_layers=(0,), num_experts=1, hidden_size=256, intermediate_size=128, top_k=1,
                      quant=ExpertQuant(kind="fp8-block", tile=(128, 128)))
block = torch.randint(0, 256, (layout.block_numel,), generator=g, dtype=torch.int32).to(torch.uint8)
weights = ExpertWeights.from_block(block, layout)
for s in (weights.gate_scale, weights.up_scale, weights.down_scale):
    s.copy_(torch.rand(tuple(s.shape), generator=g) + 0.5)
weights = ExpertWeights.from_block(block.to(device), layout)
dense = weights.dequantized(torch.bfloat16)
pairs = [(weights.gate_q, weights.gate_scale), (weights.up_q, weights.up_scale), (weights.down_q, weights.down_scale)]
ref = torch.cat([dequantize_blocks(q, s, (128, 128), torch.bfloat16).flatten() for q, s in pairs])
fits = all(k._fits(torch.empty(q.shape, device=device), q, s, (128, 128)) for q, s in pairs)
shapes = list(dense.gate_up.shape) == [256, 256] and list(dense.down.shape) == [256, 128]
results.append({"case": "expert block", "fits": fits, "bits": same(dense.block, ref) and shapes})
print(json.dumps(results))
"""


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 10
    for r in results:
        assert r["fits"] and r["bits"], r


def test_the_fp8_dequant_kernel_gives_the_torch_ops_bits_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"))


@pytest.mark.gpu
def test_the_fp8_dequant_kernel_gives_the_torch_ops_bits_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_kernel_check(_CHECK, "cuda"))


def test_fp8_dequant_runs_the_torch_ops_off_cuda_and_where_the_kernel_does_not_fit():
    from moetier.kernels import fp8_dequant as k
    from moetier.weights.fp8 import dequantize_blocks

    values = torch.randn(8, 16).to(torch.float8_e4m3fn)
    scale, out = torch.rand(1, 1) + 0.5, torch.empty(8, 16, dtype=torch.bfloat16)
    assert k._fits(out, values, scale, (8, 16))
    assert torch.equal(
        k.dequantize_fp8_into(out, values, scale, (8, 16)), dequantize_blocks(values, scale, (8, 16), torch.bfloat16)
    )
    assert not k._fits(out, values.float(), scale, (8, 16))  # not float8
    assert not k._fits(out, values, scale, (4, 16))  # the wrong grid for the tile
    assert not k._fits(out, values, torch.ones(1, 1, dtype=torch.int32), (8, 16))  # integer scales
    assert not k._fits(out[:, :8], values, scale, (8, 16))
    with pytest.raises(ValueError, match="do not tile"):  # the torch ops' own error
        k.dequantize_fp8_into(out, values, scale, (4, 16))
