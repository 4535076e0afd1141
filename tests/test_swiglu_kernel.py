"""The fused SwiGLU kernel (moetier.kernels.swiglu) against the torch ops it replaces: bit for bit on CUDA; under
Triton's interpreter within its own bf16 truncation (float32 within its exp's)."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from moetier.kernels import swiglu as k

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
results = []
for dtype in (torch.bfloat16, torch.float32):
    for name, rows, cols, limit, fused in (("decode", 1, 2048, 10.0, True), ("prefill", 37, 1500, 10.0, False),
                                           ("no limit", 5, 96, None, True), ("tight", 3, 64, 0.7, True),
                                           ("empty", 0, 64, 10.0, False)):
        both = (torch.randn(rows, 2 * cols, generator=g) * 6).to(dtype).to(device)
        gate, up = (both[:, :cols], both[:, cols:]) if fused else (both[:, :cols].contiguous(),
                                                                    both[:, cols:].contiguous())
        fits = k._fits(gate, up)
        ours = k.swiglu_triton(gate, up, limit)
        ref = k.swiglu_reference(gate, up, limit)
        diff = (ours.float() - ref.float()).abs()
        bound = ref.float().abs() * (2.0 ** -6 if dtype == torch.bfloat16 else 1e-6) + 1e-6
        results.append({"case": name, "dtype": str(dtype), "fits": fits, "equal": bool(torch.equal(ours, ref)),
                        "within": bool((diff <= bound).all()), "shape": list(ours.shape) == [rows, cols],
                        "strided": gate.stride(0) != cols})
print(json.dumps(results))
"""


def _assert_results(results: list[dict], exact: bool) -> None:
    assert len(results) == 10
    for r in results:
        assert r["fits"] and r["within"] and r["shape"], r
        assert r["equal"] or not exact, r
    assert any(r["strided"] for r in results)  # a fused projection's halves, read in place


def test_the_swiglu_kernel_matches_the_torch_ops_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"), exact=False)


@pytest.mark.gpu
def test_the_swiglu_kernel_gives_the_torch_ops_bits_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_kernel_check(_CHECK, "cuda"), exact=True)


def test_swiglu_stays_in_torch_off_cuda_and_where_the_kernel_does_not_fit():
    from moetier.kernels import swiglu as k

    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    assert torch.equal(k.swiglu(gate, up, 10.0), k.swiglu_reference(gate, up, 10.0))  # the CPU: torch's ops
    assert not k._fits(gate.double(), up.double())
    assert not k._fits(gate, up[:, :16])
    assert not k._fits(gate.t(), up.t())  # columns must be contiguous
