"""The tiered dispatcher's pair sort: the Python path (decode) and the tensor path (prefill) agree exactly."""

import pytest
import torch

from moetier.tiers.call_routing import (
    SMALL_ROUTING_PAIRS,
    _sort_large,
    _sort_on_device,
    _sort_small,
    _split_read_back,
    add_rows,
    sort_pairs,
    sort_pairs_for_device,
)


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


def test_the_device_sort_reads_back_the_host_sorts_groups():
    """The accelerator path's sort and read-back (run here on CPU tensors) give the host sort's order and groups."""
    g = torch.Generator().manual_seed(5)
    for tokens, top_k, experts in ((64, 6, 256), (300, 4, 16), (50, 2, 3)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
        order_dev, by_expert = _sort_on_device(ids, experts)
        both = torch.cat((order_dev, by_expert))
        assert by_expert.numel() == experts  # sized by the expert count, not the largest id seen
        order, found, counts = _split_read_back(both, ids.numel())
        host = _sort_large(ids)
        assert torch.equal(order, host[0]) and (found, counts) == (host[1], host[2])


def test_sort_pairs_for_device_gives_each_sorted_pairs_token_and_weight():
    g = torch.Generator().manual_seed(6)
    for tokens in (3, SMALL_ROUTING_PAIRS):  # both sides of the Python/tensor threshold
        ids = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(tokens)])
        weights = torch.rand(tokens, 4, generator=g)
        order, experts, counts, pair_tokens, pair_gates = sort_pairs_for_device(ids, weights, 32)
        host_order, host_experts, host_counts = sort_pairs(ids)
        assert torch.equal(order, host_order) and (experts, counts) == (host_experts, host_counts)
        assert torch.equal(pair_tokens, order // 4) and torch.equal(pair_gates, weights.reshape(-1)[order])


@pytest.mark.gpu
def test_the_device_sort_on_cuda_gives_the_host_sorts_pairs():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(8192)])
    weights = torch.rand(8192, 6, generator=g)
    host = sort_pairs_for_device(ids, weights, 256)
    dev = sort_pairs_for_device(ids.cuda(), weights.cuda(), 256)
    assert torch.equal(dev[0], host[0]) and dev[1:3] == host[1:3]
    assert all(torch.equal(d.cpu(), h) for d, h in zip(dev[3:], host[3:], strict=True))
