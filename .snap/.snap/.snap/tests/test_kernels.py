"""Fused kernels against their eager references, run by Triton's interpreter on CPU.

The interpreter must be chosen before Triton is imported, so the kernel runs in a subprocess.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

_CHECK = """
import json, torch
import moetier.kernels.sinkhorn as k
results = []
for shape in [(1, 4, 4), (7, 4, 4), (3, 2, 8, 8)]:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    ours = k.sinkhorn_triton(logits, 20, 1e-6)
    ref = k.sinkhorn_reference(logits.double(), 20, 1e-6)
    results.append({
        "shape": list(ours.shape), "dtype": str(ours.dtype),
        "max_abs": (ours.double() - ref).abs().max().item(),
        "max_rel": ((ours.double() - ref).abs() / ref.abs()).max().item(),
        "col_sum_err": (ours.sum(-2) - 1).abs().max().item(),
        "dispatched": k.triton_usable(logits),
    })
print(json.dumps(results))
"""


def test_sinkhorn_kernel_matches_the_eager_projection():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for r, shape in zip(results, [(1, 4, 4), (7, 4, 4), (3, 2, 8, 8)], strict=True):
        assert r["shape"] == list(shape) and r["dtype"] == "torch.float32"
        assert r["max_rel"] < 1e-5, r  # float32 kernel vs float64 eager
        assert r["col_sum_err"] < 1e-5 and r["dispatched"]


def test_dispatch_falls_back_to_eager_off_cuda_and_for_odd_sizes():
    import moetier.kernels.sinkhorn as module

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter forced for the whole run")
    cpu = torch.randn(5, 4, 4)
    assert not module.triton_usable(cpu)  # CPU tensor, no interpreter: eager
    assert torch.equal(module.sinkhorn(cpu, 20, 1e-6), module.sinkhorn_reference(cpu, 20, 1e-6))
    assert not module.triton_usable(torch.randn(2, 3, 3, device="meta"))  # n not a power of two


_RMS_CHECK = """
import json, torch
import moetier.kernels.rmsnorm as k
g = torch.Generator().manual_seed(3)
fused = torch.randn(5, 3 * 48, generator=g) * 4  # a fused GEMM output: the norms read column slices of it
cases = {
    "rows": (torch.randn(6, 40, generator=g) * 3, True, None),
    "column_view": (fused[:, 48:96], True, None),
    "heads_view": (fused[:, :96].view(5, 6, 16), False, None),
    "one_row": (torch.randn(40, generator=g), False, None),
    "wide_4d": (torch.randn(2, 3, 2, 72, generator=g), True, None),
    "bf16": (fused[:, 48:96].bfloat16(), True, None),
    "bf16_heads": (fused[:, :96].bfloat16().view(5, 6, 16), False, None),
    "from_16_bit_to_fp32": (fused[:, 48:96].bfloat16(), False, torch.float32),
}
results = {}
for name, (x, weighted, out_dtype) in cases.items():
    weight = torch.rand(x.shape[-1], generator=g) + 0.5 if weighted else None  # float32, as V4 keeps norms
    ours = k.rms_norm(x, weight, 1e-6, out_dtype)
    ref = k.rms_norm_reference(x, weight, 1e-6, out_dtype)
    results[name] = {
        "shape_ok": ours.shape == x.shape, "dtype": str(ours.dtype), "ref_dtype": str(ref.dtype),
        "max_rel": ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item(),
        "dispatched": k.triton_usable(x),
    }
print(json.dumps(results))
"""


def test_rms_norm_kernel_matches_the_eager_norm():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _RMS_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for name, r in results.items():
        assert r["shape_ok"] and r["dispatched"] and r["dtype"] == r["ref_dtype"], (name, r)
        # fp32 out: only the order of the sum of squares differs. bf16 out: Triton's interpreter truncates
        # float32 -> bf16 (GPUs round to nearest even), so elements may sit a rounding step or two apart.
        assert r["max_rel"] < (1e-6 if "bf16" not in name else 2**-6), (name, r)
    assert results["from_16_bit_to_fp32"]["dtype"] == "torch.float32" and results["bf16"]["dtype"] == "torch.bfloat16"


def test_rms_norm_falls_back_to_eager_off_cuda_and_after_a_failure(monkeypatch):
    import moetier.kernels.rmsnorm as module

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter forced for the whole run")
    x, weight = torch.randn(3, 8), torch.rand(8) + 0.5
    assert not module.triton_usable(x)
    assert torch.equal(module.rms_norm(x, weight, 1e-6), module.rms_norm_reference(x, weight, 1e-6))

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(module, "triton_usable", lambda x: True)
    monkeypatch.setattr(module, "rms_norm_triton", broken)
    monkeypatch.setattr(module, "_BROKEN", [])
    assert torch.equal(module.rms_norm(x, None, 1e-6), module.rms_norm_reference(x, None, 1e-6))
    assert module._BROKEN == ["no kernel today"]  # logged once; later calls go straight to eager
    assert torch.equal(module.rms_norm(x, weight, 1e-6), module.rms_norm_reference(x, weight, 1e-6))
