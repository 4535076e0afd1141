"""QUANT_EXACT_SCALES: fp4 experts whose every scale keeps the e2m1 products exact are checked once, and their jobs'
dot products skip the per-row scan of the scales with the same bits (moetier.kernels.cpu_experts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_fp4_experts import HIDDEN, _fp4_weights

from moetier.kernels import cpu_experts
from moetier.kernels.cpu_experts import QUANT_E2M1, QUANT_EXACT_SCALES, check_experts, quant_tensors, scales_exact

needs_kernel = pytest.mark.skipif(not cpu_experts.available(), reason="no C compiler for the CPU tier's kernel")


@needs_kernel
def test_scales_are_exact_where_every_product_with_a_code_is_an_exact_normal_float():
    assert scales_exact(torch.tensor([[2.0**-125, 0.5, -4.0, 2.0**125]]))
    for bad in (0.3, 2.0**-126, 2.0**126, 0.0, float("inf"), float("nan")):
        assert not scales_exact(torch.tensor([[1.0, bad]])), bad
    grid = 2.0 ** torch.randint(-20, 20, (37, 129)).float()  # the vector loop and its tail
    assert scales_exact(grid)
    grid[36, 128] = 0.75
    assert not scales_exact(grid)
    # e8m0 exponent bytes: 2^(e - 127), exact for e in [2, 252]
    assert scales_exact(torch.tensor([[2, 127, 252]], dtype=torch.uint8))
    for byte in (0, 1, 253, 255):
        assert not scales_exact(torch.tensor([[127, byte]], dtype=torch.uint8)), byte
    assert not scales_exact(torch.ones(4, 4, dtype=torch.float64))  # not a scale grid the kernel reads


@needs_kernel
def test_a_job_of_exact_experts_carries_the_flag_and_gives_the_scanned_bits():
    experts = [_fp4_weights(seed) for seed in range(3)]
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    checked = check_experts("fp4", hidden, (1, 32), [quant_tensors(w) for w in experts])
    assert checked.exact == [True] * 3 and checked.quant_code == QUANT_E2M1 | QUANT_EXACT_SCALES
    scanned = replace(checked, exact=[])
    assert scanned.quant_code == QUANT_E2M1
    lib = cpu_experts.usable_library() or cpu_experts.library()
    rows = [torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([0, 1, 2])]  # <= 4 tokens: the fused path
    gates = [torch.tensor([0.5, 1.0]), torch.tensor([2.0]), torch.tensor([1.0, 0.25, 0.75])]
    flagged = lib.run_checked(checked, hidden, rows, gates, 10.0, 2)
    assert torch.equal(flagged, lib.run_checked(scanned, hidden, rows, gates, 10.0, 2))
    # One scale that is not a power of two: that expert is not exact, and the job goes without the flag.
    experts[1].up_scale[3, 1] = 0.3
    mixed = check_experts("fp4", hidden, (1, 32), [quant_tensors(w) for w in experts])
    assert mixed.exact == [True, False, True] and mixed.quant_code == QUANT_E2M1
    dense = [w.dequantized(torch.bfloat16) for w in experts]
    expected = lib.run(hidden, [w.gate_up for w in dense], [w.down for w in dense], rows, gates, 10.0, 2)
    assert torch.equal(lib.run_checked(mixed, hidden, rows, gates, 10.0, 2), expected)


@needs_kernel
def test_the_flag_on_another_format_is_refused():
    experts = [_fp4_weights(0)]
    hidden = torch.randn(1, HIDDEN).bfloat16()
    checked = check_experts("fp4", hidden, (1, 32), [quant_tensors(w) for w in experts])
    forged = replace(checked, key=(cpu_experts.QUANT_E4M3, *checked.key[1:]))  # fp8 with the flag: BAD_ARGS
    assert forged.quant_code & QUANT_EXACT_SCALES
    lib = cpu_experts.usable_library() or cpu_experts.library()
    with pytest.raises(ValueError, match="cpu_experts"):
        lib.run_checked(forged, hidden, [torch.tensor([0])], [torch.tensor([1.0])], None, 1)
