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
