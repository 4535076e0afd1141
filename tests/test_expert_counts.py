"""The mapped route's count kernel (moetier.kernels.expert_counts) against the torch ops it replaces, under Triton's
interpreter and on CUDA: the same five count rows after calls with repeated experts, 1 to 64 pairs, on a strided
view of the counts (one layer's columns), from counts already holding earlier calls'."""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys, torch
from moetier.kernels import expert_counts as k

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
results = []
experts, layers = 24, 3
for tokens, top_k in ((1, 6), (4, 6), (8, 8), (3, 1), (16, 4)):
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[0, -1] = ids[0, 0]  # a call's repeated expert (two tokens of one call may share one)
    in_slot = (torch.rand(layers * experts, generator=g) < 0.4).long()
    start = torch.randint(0, 50, (5, layers * experts), generator=g)
    span = slice(experts, 2 * experts)  # the middle layer's columns: a strided view
    ours, theirs = start.clone().to(device), start.clone()
    takes = k.kernel_takes(ours[:, span], in_slot[span].to(device), ids.to(device).reshape(-1))
    scratch = torch.zeros(experts, dtype=torch.long, device=device)
    k.count_uses(ours[:, span], in_slot[span].to(device), ids.to(device), scratch)
    k.count_uses_reference(theirs[:, span], in_slot[span], ids.reshape(-1), torch.zeros(experts, dtype=torch.long))
    results.append({"case": f"{tokens}x{top_k}", "equal": bool(torch.equal(ours.cpu(), theirs)),
                    "row1": bool(torch.equal(ours.cpu()[1], start[1])), "broken": list(k._BROKEN), "takes": takes,
                    "moved": int((theirs - start).abs().sum())})
print(json.dumps(results))
"""


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 5
    for r in results:
        assert r["takes"] and r["equal"] and r["row1"] and not r["broken"] and r["moved"] > 0, r


def test_the_count_kernel_matches_the_torch_ops_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"))


@pytest.mark.gpu
def test_the_count_kernel_matches_the_torch_ops_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_kernel_check(_CHECK, "cuda"))


def test_the_reference_counts_pairs_calls_and_slot_reads():
    from moetier.kernels.expert_counts import count_uses

    counts = torch.zeros((5, 4), dtype=torch.long)
    in_slot = torch.tensor([1, 0, 0, 1])
    count_uses(counts, in_slot, torch.tensor([[0, 1], [0, 3]]), torch.zeros(4, dtype=torch.long))
    assert counts.tolist() == [
        [2, 1, 0, 1],  # pairs
        [0, 0, 0, 0],  # the CPU tier's pairs: the table kernel's row
        [2, 0, 0, 1],  # pairs from a slot
        [1, 1, 0, 1],  # calls
        [1, 0, 0, 1],  # calls from a slot
    ]
