"""The V4 rotation and angle kernels (moetier.kernels.rope_rotate) against the torch ops they replace: bit for bit
on CUDA, within the interpreter's own bf16 truncation, unfused multiply-add and numpy's cos/sin under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from moetier.kernels import rope_rotate as k

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
results = []

def angles(n, width, table):
    cos = torch.randn(n, width, generator=g).to(torch.bfloat16).float()
    sin = torch.randn(n, width, generator=g).to(torch.bfloat16).float()
    if table:  # cos, sin and sin_inverse rows of one [N, 3, R] table, as the compressed entries' rotations are
        t = torch.stack((cos, sin, -sin), dim=1).to(device)
        return t[:, 0], t[:, 2]
    return cos.to(device), sin.to(device)

cases = [("2d", (37, 24), 8, False), ("heads", (3, 64, 40), 16, False), ("strided", (5, 48), 16, True),
         ("one", (1, 64, 512), 64, True), ("empty", (0, 24), 8, False)]
for dtype in (torch.bfloat16, torch.float32):
    for name, shape, width, table in cases:
        base = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype).to(device)
        x = base[..., : shape[-1]] if name == "strided" else base[..., : shape[-1]].contiguous()
        cos, sin = angles(shape[0], width, table)
        ours, ref = x.clone() if name != "strided" else base.clone()[..., : shape[-1]], x.clone()
        fits = k._kernel_fits(ours, cos, sin)
        k.rotate_triton(ours, cos, sin)
        k.rotate_reference(ref, cos, sin)
        diff = (ours.float() - ref.float()).abs()
        bound = (ref.float().abs() * 2.0 ** -7 + 1e-6) if dtype == torch.bfloat16 else (ref.float().abs() * 1e-6 + 1e-7)
        results.append({"case": name, "dtype": str(dtype), "fits": fits, "equal": bool(torch.equal(ours, ref)),
                        "within": bool((diff <= bound).all()), "kept": bool(torch.equal(ours[..., :-width],
                        x[..., :-width])), "strided": ours.stride(0) != ours.shape[-1]})

inv_freq = (1.0 / 10000 ** (torch.arange(0, 32, dtype=torch.float32) / 32)).to(device)
for dtype in (torch.bfloat16, torch.float32):
    for name, positions in (("steps", torch.arange(0, 300)), ("far", torch.tensor([70_000, 131_071, 1_000_003])),
                            ("one", torch.tensor([4097])), ("none", torch.zeros(0, dtype=torch.int64))):
        positions = positions.to(device)
        for factor in (1.0, 0.8125):
            ours = k.angles_triton(positions, inv_freq, factor, dtype)  # the kernel itself, never the fallback
            ref = k.angles_reference(positions, inv_freq, factor, dtype)
            tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
            results.append({"case": "angles-" + name, "dtype": str(dtype), "fits": True,
                            "equal": all(torch.equal(a, b) for a, b in zip(ours, ref)),
                            "within": all(bool(((a - b).abs() <= tol * b.abs() + 1e-5).all())
                                          for a, b in zip(ours, ref)),
                            "kept": all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(ours, ref)),
                            "strided": False})
print(json.dumps(results))
"""


def run_check(device: str) -> list[dict]:
    return run_kernel_check(_CHECK, device)


def _assert_results(results: list[dict], exact: bool) -> None:
    assert len(results) == 10 + 16
    for r in results:
        assert r["fits"] and r["within"] and r["kept"], r  # the channels before the rope ones untouched
        assert r["equal"] or not exact, r
    assert any(r["strided"] for r in results)


def test_the_rotation_kernel_matches_the_torch_ops_interpreted():
    _assert_results(run_check("cpu"), exact=False)


@pytest.mark.gpu
def test_the_rotation_kernel_gives_the_torch_ops_bits_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_check("cuda"), exact=True)


def test_the_rotation_stays_in_torch_where_the_kernel_does_not_fit():
    from moetier.kernels import rope_rotate as k

    x = torch.randn(4, 24)
    cos, sin = torch.randn(4, 12), torch.randn(4, 12)  # 12 channels: not a power of two
    assert not k._kernel_fits(x, cos, sin)
    got, ref = k.rotate(x.clone(), cos, sin), k.rotate_reference(x.clone(), cos, sin)
    assert torch.equal(got, ref)
    assert not k._kernel_fits(x, cos.double(), sin.double())  # float32 angles only
