"""``moetier bench v4-kernels``: V4's decode kernels against their torch ops (CPU: both sides the torch ops, a smoke
test of the cases and the receipt; the kernels' speed is measured on CUDA)."""

from __future__ import annotations

import json

import torch

from moetier.bench import v4_kernels
from moetier.cli import main


def test_every_case_runs_both_sides_and_the_receipt_says_so(tmp_path, capsys):
    assert main(["bench", "v4-kernels", "--calls", "1", "--slots", "16", "--out", str(tmp_path)]) == 0
    receipt = json.loads(next(tmp_path.glob("v4-kernels-*.json")).read_text())
    names = [r["case"] for r in receipt["results"]]
    assert len(names) == 3 * 2 + 3 + 4 + 2 + 2 and "attention tiles, CSA top-512 picks" in names  # 3 kernels
    assert all(r["kernel_us"] > 0 and r["torch_us"] > 0 for r in receipt["results"]) and not receipt["broken"]
    assert "an eager loop: no kernel" in next(tmp_path.glob("v4-kernels-*.md")).read_text()


def test_the_sides_compute_the_same_on_the_cpu():
    g = torch.Generator().manual_seed(1)
    device = torch.device("cpu")
    for kernel, reference in (v4_kernels.swiglu_sides(3, device, g), v4_kernels.greedy_sides(2, device, g),
                              v4_kernels.router_sides(2, False, device, g)):  # fmt: skip
        ours, theirs = kernel(), reference()
        ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_fp8_linear_sides_compute_the_same_on_the_cpu():
    g = torch.Generator().manual_seed(2)
    for shape in ((64, 256, 1), (64, 256, 2)):
        kernel, reference = v4_kernels.fp8_linear_sides(shape, 3, torch.device("cpu"), g)
        assert torch.equal(kernel(), reference())  # off CUDA the fp8 linear dequantises: the GEMM's bits


def test_bad_cases_and_counts_are_refused_with_a_clear_error(capsys):
    assert main(["bench", "v4-kernels", "--cases", "attention,nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err
    assert main(["bench", "v4-kernels", "--calls", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["bench", "v4-kernels", "--slots", "16,many"]) == 2
    assert "comma-separated entry counts" in capsys.readouterr().err
    assert main(["bench", "v4-kernels", "--device", "gpu0"]) == 2
    assert "is not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "v4-kernels", "--device", "cuda"]) == 2
        assert "no CUDA device here" in capsys.readouterr().err
