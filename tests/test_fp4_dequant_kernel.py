"""The FP4 dequantisation kernel (moetier.kernels.fp4_dequant) against the torch ops it replaces
(moetier.weights.fp4.dequantize_fp4): bit for bit, under Triton's interpreter and on CUDA, for e8m0 exponent bytes
and float32 scales, every target dtype, partial tiles, signed packed bytes, and a whole expert's dense block."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from interpreted import nearest_bf16
from moetier.kernels import fp4_dequant as k
from moetier.weights.fp4 import dequantize_fp4
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights

device = sys.argv[1]
if device == "cpu":
    nearest_bf16()  # float32 scales need a round to nearest even, as CUDA's
g = torch.Generator().manual_seed(0)
bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
results = []

def scales_of(kind, shape):
    if kind == "e8m0":  # around 2 ** 0, and the grid's extremes (0: the subnormal 2 ** -127; 254: overflow to inf)
        e = torch.randint(112, 140, shape, generator=g, dtype=torch.int32)
        e.view(-1)[:3] = torch.tensor([0, 1, 254])
        return e.to(torch.uint8)
    return torch.randn(shape, generator=g).abs() + 0.01  # float32, any value: the product rounds

cases = [  # name, rows, packed bytes a row, rows a scale, values a scale, scale kind, packed dtype
    ("release tiles", 48, 128, 1, 32, "e8m0", torch.uint8),
    ("partial tiles", 37, 200, 1, 8, "e8m0", torch.uint8),
    ("2-row scale blocks, signed bytes", 38, 64, 2, 16, "e8m0", torch.int8),
    ("float32 scales", 21, 160, 1, 32, "float32", torch.uint8),
]
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for name, rows, row_bytes, bn, bk, kind, packed_dtype in cases:
        packed = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.int32).to(torch.uint8)
        packed = packed.view(packed_dtype)
        scale = scales_of(kind, (rows // bn, 2 * row_bytes // bk))
        packed, scale = packed.to(device), scale.to(device)
        out = torch.empty(rows, 2 * row_bytes, dtype=dtype, device=device)
        fits = k._fits(out, packed, scale)
        ours = k._dequantize_triton(out, packed, scale)
        ref = dequantize_fp4(packed, scale, dtype)
        same = bool(torch.equal(ours.view(bits[dtype]), ref.view(bits[dtype])))
        results.append({"case": f"{name} {dtype}", "fits": fits, "bits": same})

# A whole expert as the tiers dequantise it (one launch for gate, up and down, into one block) against the torch
# ops' matrices concatenated: the default format, and float32 scales of 2-row blocks with partial tiles.
for tile, fmt, hidden, inter in (((1, 32), "e8m0", 64, 32), ((2, 16), "float32", 80, 48)):
    quant = ExpertQuant(kind="fp4-block", tile=tile, pow2_scales=fmt == "e8m0", scale_format=fmt)
    layout = ExpertLayout(moe_layers=(0,), num_experts=1, hidden_size=hidden, intermediate_size=inter, top_k=1,
                          quant=quant)
    block = torch.randint(0, 256, (layout.block_numel,), generator=g, dtype=torch.int32).to(torch.uint8)
    weights = ExpertWeights.from_block(block, layout)
    for s in (weights.gate_scale, weights.up_scale, weights.down_scale):
        s.copy_(scales_of("e8m0" if s.dtype == torch.uint8 else "float32", tuple(s.shape)))
    weights = ExpertWeights.from_block(block.to(device), layout)
    dense = weights.dequantized(torch.bfloat16)
    pairs = [(weights.gate_q, weights.gate_scale), (weights.up_q, weights.up_scale),
             (weights.down_q, weights.down_scale)]
    ref = torch.cat([dequantize_fp4(q, s, torch.bfloat16).flatten() for q, s in pairs])
    outs = [torch.empty(q.shape[0], 2 * q.shape[1], dtype=torch.bfloat16, device=device) for q, _ in pairs]
    fits = k._expert_fits(outs, pairs)
    same = bool(torch.equal(dense.block.view(torch.int16), ref.view(torch.int16)))
    shapes = list(dense.gate_up.shape) == [2 * inter, hidden] and list(dense.down.shape) == [hidden, inter]
    results.append({"case": f"expert block {tile} {fmt}", "fits": fits, "bits": same and shapes})
print(json.dumps(results))
"""


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 14
    for r in results:
        assert r["fits"] and r["bits"], r


def test_the_fp4_dequant_kernel_gives_the_torch_ops_bits_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"))


@pytest.mark.gpu
def test_the_fp4_dequant_kernel_gives_the_torch_ops_bits_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_kernel_check(_CHECK, "cuda"))


def test_fp4_dequant_runs_the_torch_ops_off_cuda_and_where_the_kernel_does_not_fit():
    from moetier.kernels import fp4_dequant as k
    from moetier.weights.fp4 import dequantize_fp4

    packed = torch.randint(0, 256, (8, 16), dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(120, 130, (8, 1), dtype=torch.int32).to(torch.uint8)
    out = torch.empty(8, 32, dtype=torch.bfloat16)
    assert k._fits(out, packed, scale)
    assert torch.equal(k.dequantize_fp4_into(out, packed, scale), dequantize_fp4(packed, scale, torch.bfloat16))
    assert not k._fits(out, packed, torch.ones(8, 32, dtype=torch.uint8))  # a scale a value: bytes split
    assert not k._fits(out[:, :16], packed, scale)  # the wrong output shape
    assert not k._fits(torch.empty(8, 32, dtype=torch.float64), packed, scale)
    assert not k._fits(out, packed, scale.to(torch.int16))  # integer scales other than e8m0 bytes
    assert not k._fits(torch.empty(32, 8, dtype=torch.bfloat16).t(), packed, scale)  # not contiguous
    with pytest.raises(ValueError, match="does not divide"):  # the torch ops' own error for a bad grid
        k.dequantize_fp4_into(out, packed, torch.ones(3, 1, dtype=torch.uint8))


def test_an_experts_one_launch_takes_only_matching_matrices_and_falls_back_to_the_torch_ops():
    from moetier.kernels import fp4_dequant as k
    from moetier.weights.fp4 import dequantize_fp4, scale_to_float

    g = torch.Generator().manual_seed(1)
    inter, hidden = 16, 32
    packed = [torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
              for shape in ((inter, hidden // 2), (inter, hidden // 2), (hidden, inter // 2))]  # fmt: skip
    scales = [torch.randint(120, 130, (q.shape[0], 2 * q.shape[1] // 8), generator=g).to(torch.uint8) for q in packed]
    pairs = list(zip(packed, scales, strict=True))
    outs = [torch.empty(q.shape[0], 2 * q.shape[1], dtype=torch.bfloat16) for q in packed]
    assert k._expert_fits(outs, pairs)
    k.dequantize_fp4_expert_into(outs, pairs)  # CPU tensors, no interpreter: the torch ops a matrix
    assert all(torch.equal(o, dequantize_fp4(q, s, torch.bfloat16)) for o, (q, s) in zip(outs, pairs, strict=True))
    coarse = [(q, s[:, ::2].contiguous()) for q, s in pairs[:2]] + pairs[2:]  # gate/up blocks unlike down's
    assert not k._expert_fits(outs, coarse)
    mixed = pairs[:2] + [(pairs[2][0], scale_to_float(pairs[2][1]))]  # down's scales float32, the others' bytes
    assert not k._expert_fits(outs, mixed)
    square = pairs[:2] + [(pairs[0][0], pairs[0][1])]  # down not [hidden, inter / 2]
    assert not k._expert_fits([outs[0], outs[1], outs[0]], square)
