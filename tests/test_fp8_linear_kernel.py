"""The few-row fp8 linear kernel (moetier.kernels.fp8_linear) against the dequantise-then-GEMM path it replaces,
under Triton's interpreter and on CUDA: each weight rounds as the loader rounds it, so results differ only by the
float32 summation order (then one rounding to the output dtype). Cases: 1-100 tokens, bf16 / fp16 / fp32, e4m3 and
e5m2, ragged rows and inputs (partial tiles and steps), a split over the inputs, grouped projections, a bias, token
tiles of 64 and 128 (a short prefill's rows)."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from interpreted import nearest_bf16, widened_bf16_dots
from moetier.kernels import fp8_linear as k

device = sys.argv[1]
if device == "cpu":
    nearest_bf16()
    widened_bf16_dots()
g = torch.Generator().manual_seed(0)
results = []
cases = [  # name, tokens, rows, inputs, tile, value dtype, groups, splits wanted
    ("one token", 1, 64, 256, (128, 128), torch.float8_e4m3fn, 1),
    ("ragged", 5, 72, 300, (128, 128), torch.float8_e4m3fn, 1),
    ("16 tokens, split", 16, 64, 1024, (128, 128), torch.float8_e4m3fn, 1),
    ("e5m2, small tiles", 3, 40, 256, (8, 128), torch.float8_e5m2, 1),
    ("grouped", 2, 64, 256, (16, 128), torch.float8_e4m3fn, 2),
    ("40 tokens (a 64-token tile)", 40, 64, 256, (128, 128), torch.float8_e4m3fn, 1),
    ("a short prefill, 100 tokens", 100, 48, 384, (128, 128), torch.float8_e4m3fn, 1),
]
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for name, tokens, rows, cols, tile, values_dtype, groups in cases:
        codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
        values = codes.view(values_dtype)
        values = torch.where(values.float().isfinite() & (values.float().abs() < 64), values.float(), 0.0)
        values = values.to(values_dtype)
        grid = (-(-rows // tile[0]), -(-cols // tile[1]))
        scale = (torch.rand(grid, generator=g) + 0.5) / 64
        x = torch.randn(tokens, groups * cols, generator=g).to(dtype)
        bias = torch.randn(rows, generator=g).to(dtype) if name == "ragged" else None
        x, values, scale = x.to(device), values.to(device), scale.to(device)
        bias = None if bias is None else bias.to(device)
        x2 = x.reshape(-1, x.shape[-1])
        takes = k._kernel_takes(x2, values, scale, tile, groups)
        splits = k.splits_for(rows, cols, k._sm_count(x.device))
        ours = k.fp8_linear(x, values, scale, tile, bias, groups=groups)
        # float64 sums of the loader's weights (dequantised to dtype): ours rounds once from a float32 sum
        weights, xs = k.dequantized(values, scale, tile, dtype).double(), x.double()
        exact = xs @ weights.T if groups == 1 else k.grouped_reference(xs, weights, groups)
        exact = exact if bias is None else exact + bias.double()
        err = ((ours.double() - exact).abs() / (exact.abs() + exact.abs().mean())).max().item()  # cancellations
        results.append({"case": f"{name} {dtype}", "takes": takes, "splits": splits, "err": err,
                        "shape": list(ours.shape) == [tokens, rows], "dtype": str(ours.dtype) == str(dtype),
                        "broken": list(k._BROKEN)})
print(json.dumps(results))
"""

_BOUND = {"bfloat16": 2**-7, "float16": 2**-10, "float32": 2e-6}  # the output's roundings (a bias adds one)


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 21
    for r in results:
        assert r["takes"] and r["shape"] and r["dtype"] and not r["broken"], r
        assert r["err"] < _BOUND[r["case"].rsplit(".", 1)[-1]], r
    assert any(r["splits"] > 1 for r in results)  # the split over inputs ran


def test_the_fp8_linear_kernel_matches_the_dequantised_gemm_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"))


@pytest.mark.gpu
def test_the_fp8_linear_kernel_matches_the_dequantised_gemm_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_kernel_check(_CHECK, "cuda"))


def test_fp8_linear_takes_the_dense_path_off_cuda_and_for_shapes_the_kernel_refuses():
    from moetier.kernels import fp8_linear as k

    values = torch.randn(32, 128).to(torch.float8_e4m3fn)
    scale, x = torch.rand(1, 1) + 0.5, torch.randn(3, 128, dtype=torch.bfloat16)
    dense = k.dequantized(values, scale, (128, 128), torch.bfloat16)
    assert torch.equal(k.fp8_linear(x, values, scale, (128, 128)), torch.nn.functional.linear(x, dense))
    assert k._kernel_takes(x, values, scale, (128, 128), 1)
    assert k._kernel_takes(torch.randn(128, 128, dtype=torch.bfloat16), values, scale, (128, 128), 1)
    assert not k._kernel_takes(torch.randn(129, 128, dtype=torch.bfloat16), values, scale, (128, 128), 1)  # rows
    assert not k._kernel_takes(x, values, scale.double(), (128, 128), 1)  # float64 scales
    assert not k._kernel_takes(x, values, torch.rand(1, 2), (128, 64), 1)  # a scale tile narrower than a step
    assert not k._kernel_takes(x, values, scale, (128, 128), 3)  # groups not dividing the rows
    with pytest.raises(ValueError, match="do not tile"):
        k.fp8_linear(x, values, torch.rand(2, 2), (128, 128))  # the dense path's own error
