"""The tiered dispatcher's pair sort: the Python path (decode) and the tensor path (prefill) agree exactly."""

import torch

from moetier.tiers.call_routing import SMALL_ROUTING_PAIRS, _sort_large, _sort_small, add_rows, sort_pairs


def test_small_and_large_sorts_agree_and_are_stable():
    g = torch.Generator().manual_seed(3)
    for tokens, top_k, experts in ((1, 6, 256), (4, 6, 256), (3, 4, 5), (40, 6, 16)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        small, large = _sort_small(ids.reshape(-1).tolist()), _sort_large(ids.reshape(-1))
        assert torch.equal(small[0], large[0]) and small[1:] == large[1:]
        order = torch.argsort(ids.reshape(-1), stable=True)  # equal ids keep token order
        assert torch.equal(small[0], order)
        assert sum(small[2]) == tokens * top_k and small[1] == sorted(set(ids.reshape(-1).tolist()))


def test_sort_pairs_takes_the_tensor_path_past_the_threshold():
    ids = torch.randint(0, 64, (SMALL_ROUTING_PAIRS // 4 + 1, 4))
    order, experts, counts = sort_pairs(ids)
    assert ids.numel() > SMALL_ROUTING_PAIRS and order.dtype == torch.int64
    assert torch.equal(ids.reshape(-1)[order], torch.repeat_interleave(torch.tensor(experts), torch.tensor(counts)))


def test_add_rows_adds_into_every_row_or_the_given_ones():
    out, values = torch.randn(4, 3), torch.randn(2, 3)
    expected = out.clone()
    expected[[1, 3]] += values
    add_rows(out, torch.tensor([1, 3]), values)
    assert torch.equal(out, expected)
    full = torch.randn(4, 3)
    before = out.clone()
    add_rows(out, None, full)
    assert torch.equal(out, before + full)
