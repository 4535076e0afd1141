"""The per-expert path's batches (``per_expert.run_per_expert``) give the bits of one expert at a time.

A batch gathers its groups' rows once, runs one SwiGLU and one gate scaling over all of them, and leaves each
expert its dequantisation, its two GEMMs and its scatter-add; every op is row-wise or elementwise, so the
result must equal the loop over :func:`swiglu_expert` exactly, whatever the batches' cuts.
"""

from __future__ import annotations

import pytest
import torch

from moetier.kernels import per_expert as k
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights, swiglu_expert

HIDDEN, INTER, TOKENS = 64, 32, 40
FP4 = ExpertQuant(kind="fp4-block", tile=(1, 32))
FP8 = ExpertQuant(kind="fp8-block", tile=(16, 32))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(kind: str, count: int, generator: torch.Generator) -> list[ExpertWeights]:
    quant = {"dense": None, "fp4": FP4, "fp8": FP8}[kind]
    layout = ExpertLayout((0,), num_experts=count, hidden_size=HIDDEN, intermediate_size=INTER, top_k=1, quant=quant)
    experts = []
    for _ in range(count):
        if quant is None:
            block = (0.1 * torch.randn(layout.block_numel, generator=generator)).bfloat16()
            experts.append(ExpertWeights.from_block(block.to(DEVICE), layout))
            continue
        weights = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
        for part in ("gate", "up", "down"):
            q, scale = getattr(weights, f"{part}_q"), getattr(weights, f"{part}_scale")
            if kind == "fp4":
                q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=generator))
            else:
                values = torch.randn(q.shape, generator=generator).clamp(-8, 8).to(torch.float8_e4m3fn)
                q.copy_(values)
            scale.copy_(2.0 ** torch.randint(-6, -2, scale.shape, generator=generator).float())
        experts.append(ExpertWeights.from_block(weights.block.to(DEVICE), layout))
    return experts


def _call(generator: torch.Generator, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden rows, expert-sorted pair tokens (each expert's distinct) and gates for groups of ``counts`` pairs."""
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).bfloat16()
    tokens = torch.cat([torch.randperm(TOKENS, generator=generator)[:c].sort().values for c in counts])
    gates = torch.rand(tokens.numel(), generator=generator).bfloat16()
    return hidden.to(DEVICE), tokens.to(DEVICE), gates.to(DEVICE)


def _loop(hidden, tokens, gates, groups, limit) -> torch.Tensor:
    """The path as it was: one expert at a time, ``y.float() * gate.float()`` added in group order."""
    out = torch.zeros(TOKENS, HIDDEN, device=DEVICE)
    for weights, start, count in groups:
        rows = tokens[start : start + count]
        y = swiglu_expert(hidden[rows], weights, limit).float() * gates[start : start + count, None].float()
        out.index_add_(0, rows, y)
    return out


def _groups(experts, counts, skip=()):
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [(w, s, c) for i, (w, s, c) in enumerate(zip(experts, starts, counts, strict=True)) if i not in skip]


@pytest.mark.parametrize("kind", ["dense", "fp4", "fp8"])
@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("caps", [(4096, 192 << 20), (24, 2 * 3 * INTER * HIDDEN * 2)])
def test_batches_give_the_bits_of_one_expert_at_a_time(monkeypatch, kind, limit, caps):
    monkeypatch.setenv("MOETIER_FAT_EXPERTS", "0")
    monkeypatch.setattr(k, "_BATCH_ROWS", caps[0])
    monkeypatch.setattr(k, "_BATCH_DEQUANT_BYTES", caps[1])
    generator = torch.Generator().manual_seed(7)
    counts = [17, 9, 30, 1, 12, 25]  # 30 and 25 exceed the small cap's rows: batches of their own
    experts = _experts(kind, len(counts), generator)
    hidden, tokens, gates = _call(generator, counts)
    for skip in ((), (1, 4)):  # adjoining runs, and runs with gaps (another path took those groups)
        groups = _groups(experts, counts, skip)
        ours = torch.zeros(TOKENS, HIDDEN, device=DEVICE)
        k.run_per_expert(ours, hidden, tokens, gates, groups, limit)
        expected = _loop(hidden, tokens, gates, groups, limit)
        assert expected.abs().sum() > 0 and torch.equal(ours, expected)


def test_batches_keep_group_order_and_their_caps():
    generator = torch.Generator().manual_seed(3)
    fp4 = _experts("fp4", 3, generator)
    dense = _experts("dense", 2, generator)
    one_copy = 3 * INTER * HIDDEN * 2  # an fp4 expert's bf16 copy
    with pytest.MonkeyPatch.context() as env:
        env.setattr(k, "_BATCH_ROWS", 10)
        env.setattr(k, "_BATCH_DEQUANT_BYTES", 2 * one_copy)
        groups = [(fp4[0], 0, 4), (fp4[1], 4, 4), (fp4[2], 8, 2), (dense[0], 10, 12), (dense[1], 22, 3)]
        batches = k._batches(groups, torch.bfloat16)
    # two fp4 copies at most; 10 rows at most (12 alone); dense experts hold no copy
    assert [[g[1] for g in b] for b in batches] == [[0, 4], [8], [10], [22]]
    assert [g for b in batches for g in b] == groups


def test_a_shape_change_starts_a_new_batch():
    generator = torch.Generator().manual_seed(5)
    small = _experts("dense", 1, generator)[0]
    layout = ExpertLayout((0,), num_experts=1, hidden_size=HIDDEN, intermediate_size=2 * INTER, top_k=1)
    wide = ExpertWeights.from_block(torch.randn(layout.block_numel).bfloat16().to(DEVICE), layout)
    batches = k._batches([(small, 0, 3), (wide, 3, 3)], torch.bfloat16)
    assert len(batches) == 2


def test_batches_off_give_the_same_bits_and_one_fat_expert_a_streaming_call(monkeypatch):
    from moetier.tiers.copy_path import stream_fat_per_call

    generator = torch.Generator().manual_seed(11)
    counts = [5, 20, 3]
    experts = _experts("fp4", len(counts), generator)
    hidden, tokens, gates = _call(generator, counts)
    groups = _groups(experts, counts)
    on = torch.zeros(TOKENS, HIDDEN, device=DEVICE)
    k.run_per_expert(on, hidden, tokens, gates, groups, 0.7)
    monkeypatch.setenv("MOETIER_EXPERT_BATCHES", "0")
    off = torch.zeros(TOKENS, HIDDEN, device=DEVICE)
    k.run_per_expert(off, hidden, tokens, gates, groups, 0.7)
    assert torch.equal(on, off) and stream_fat_per_call(64) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "fp4"])
def test_batches_on_cuda_give_the_loops_bits(monkeypatch, kind):
    """On CUDA the batch's SwiGLU is the Triton kernel and its GEMMs read row slices of one gathered tensor:
    still the loop's bits (cuBLAS on the same rows, the kernel with torch's roundings), caps cut or not."""
    monkeypatch.setenv("MOETIER_FAT_EXPERTS", "0")
    generator = torch.Generator().manual_seed(13)
    counts = [300, 17, 64, 1, 129, 40, 255]
    experts = _experts(kind, len(counts), generator)
    hidden, tokens, gates = _call_on_cuda(generator, counts)
    groups = _groups(experts, counts, skip=(3,))
    expected = torch.zeros(hidden.shape[0], HIDDEN, device="cuda")
    for weights, start, count in groups:
        rows = tokens[start : start + count]
        y = swiglu_expert(hidden[rows], weights, 0.7).float() * gates[start : start + count, None].float()
        expected.index_add_(0, rows, y)
    for caps in ((4096, 192 << 20), (200, 2 * 3 * INTER * HIDDEN * 2)):
        monkeypatch.setattr(k, "_BATCH_ROWS", caps[0])
        monkeypatch.setattr(k, "_BATCH_DEQUANT_BYTES", caps[1])
        ours = torch.zeros_like(expected)
        k.run_per_expert(ours, hidden, tokens, gates, groups, 0.7)
        assert torch.equal(ours, expected)


def _call_on_cuda(generator: torch.Generator, counts: list[int]):
    rows = 2 * max(counts)
    hidden = torch.randn(rows, HIDDEN, generator=generator).bfloat16()
    tokens = torch.cat([torch.randperm(rows, generator=generator)[:c].sort().values for c in counts])
    gates = torch.rand(tokens.numel(), generator=generator).bfloat16()
    return hidden.cuda(), tokens.cuda(), gates.cuda()
