"""Decode prefetch from model hints (``ExpertDispatcher.hint``): the tiered dispatcher copies the next MoE
layer's predicted experts ahead, uses them when the prediction was right, drops them when it was wrong,
and never changes a result either way."""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from test_tiers_fidelity import _random_store, _routing

from moetier.errors import ConfigError
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout
from moetier.tiers.hints import HintBuffer
from moetier.tiers.tiered_dispatcher import TieredDispatcher

LAYOUT = ExpertLayout((0, 1), num_experts=8, hidden_size=32, intermediate_size=16, top_k=2, swiglu_limit=2.0)


def _pair(**options):
    store = _random_store(LAYOUT, torch.float32)
    # hint_min_precision 0: every predicted expert is prefetched (the gate has its own tests)
    options = {"miss_route": "copy", "staging_slots": 4, "cache_slots": 0, "hint_min_precision": 0.0, **options}
    return ResidentDispatcher(store), TieredDispatcher(store, **options)


def _step(tiered, resident, generator, tokens: int, hint_for_1=None) -> torch.Tensor:
    """One decode step over both layers, the hint for layer 1 given before layer 0 dispatches (as models do);
    returns layer 1's routed ids. Both layers' results are checked against the resident dispatcher."""
    calls = [_routing(tokens, LAYOUT, generator, torch.float32) for _ in LAYOUT.moe_layers]
    tiered.hint(1, calls[1][1] if hint_for_1 is None else hint_for_1)
    for layer, (hidden, ids, weights) in zip(LAYOUT.moe_layers, calls, strict=True):
        ours = tiered.dispatch(layer, hidden, ids, weights)
        assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
    return calls[1][1]


def test_right_hints_are_prefetched_and_used():
    resident, tiered = _pair()
    assert tiered.wants_hints
    generator, used = torch.Generator().manual_seed(1), 0
    for _ in range(6):
        ids = _step(tiered, resident, generator, tokens=2)
        used += ids.unique().numel()
    counters = tiered.metrics.layer(1)
    # up to decode_prefetch (4) experts per hint; 2 tokens x top-2 touch at most 4
    assert counters.prefetch_used == used and counters.prefetch_wasted == 0
    assert counters.prefetch_bytes == used * tiered.block_bytes == counters.copy_bytes
    assert counters.as_dict()["hint_precision"] == 1.0 and counters.as_dict()["hint_recall"] == 1.0
    assert tiered.metrics.layer(0).prefetch_bytes == 0  # nothing hints the first layer


def test_wrong_hints_are_dropped_and_results_stay_exact():
    resident, tiered = _pair()
    generator = torch.Generator().manual_seed(2)
    wasted = 0
    for _ in range(5):
        # predict experts no token routes to: every prefetch is wasted, every miss copied after all
        hint = torch.tensor([[6, 7]])
        ids = _step(tiered, resident, generator, tokens=1, hint_for_1=hint)
        wasted += len({6, 7} - set(ids.flatten().tolist()))
    counters = tiered.metrics.layer(1)
    assert counters.prefetch_wasted == wasted > 0
    assert counters.hint_experts == 10 and counters.hint_correct == 10 - wasted


def test_a_prefetched_expert_the_cache_admits_moves_on_the_device():
    """LRU admits every miss: the prefetched copy is moved into the cache slot, not copied over PCIe again."""
    resident, tiered = _pair(cache_slots=4, policy="lru")
    generator = torch.Generator().manual_seed(3)
    ids = _step(tiered, resident, generator, tokens=1)
    counters = tiered.metrics.layer(1)
    experts = ids.unique().tolist()
    assert counters.prefetch_used == len(experts) and counters.admissions == len(experts)
    assert counters.copy_bytes == counters.prefetch_bytes == len(experts) * tiered.block_bytes
    assert all(tiered.cache.get((1, e)) is not None for e in experts)
    assert tiered.cache.free_staging == 4  # the staging slots came back at once
    for _ in range(4):  # later steps hit (or prefetch) and stay exact
        _step(tiered, resident, generator, tokens=1)


def test_the_prefetch_is_capped_and_left_for_a_staging_ring_with_no_room():
    resident, tiered = _pair(decode_prefetch=1)
    generator = torch.Generator().manual_seed(4)
    _step(tiered, resident, generator, tokens=3)
    assert tiered.metrics.layer(1).prefetch_bytes == tiered.block_bytes  # at most one per hint


@pytest.mark.parametrize("options", [{"decode_prefetch": 0}, {"miss_route": "cpu"}])
def test_hints_are_ignored_when_off(options):
    resident, tiered = _pair(**options)
    assert not tiered.wants_hints and not ResidentDispatcher(tiered.store).wants_hints
    _step(tiered, resident, torch.Generator().manual_seed(5), tokens=2)
    assert tiered.metrics.layer(1).prefetch_bytes == 0 and tiered.metrics.layer(1).hint_experts == 0


def test_prefill_sized_hints_are_ignored():
    resident, tiered = _pair(stream_min_tokens=4)
    _step(tiered, resident, torch.Generator().manual_seed(6), tokens=5)  # a streaming call: its own prefetch
    assert tiered.metrics.layer(1).hint_experts == 0


def test_decode_prefetch_is_validated():
    with pytest.raises(ConfigError, match="decode_prefetch"):
        TieredDispatcher(_random_store(LAYOUT, torch.float32), cache_slots=1, decode_prefetch=-1)


def test_hint_buffer_ranks_by_predictions_and_scores_once():
    hints = HintBuffer()
    hints.record(3, torch.tensor([[5, 2], [5, 7], [5, 2]]))
    assert hints.take(2) == []  # a hint for another layer
    assert hints.take(3) == [5, 2, 7] and hints.take(3) == []  # consumed
    assert hints.score(3, [5, 9]) == (3, 1) and hints.score(3, [5]) == (0, 0)


def test_only_ranks_that_proved_precise_are_trusted():
    hints = HintBuffer(min_precision=0.8, min_samples=4, decay=1.0)
    for _ in range(3):
        hints.record(1, torch.tensor([[4, 5]]))
        assert hints.trusted(hints.take(1)) == []  # too few scored calls yet
        hints.score(1, [4, 6])  # rank 0 right, rank 1 wrong
    hints.record(1, torch.tensor([[4, 5]]))
    ranked = hints.take(1)
    hints.score(1, [4])
    assert hints.rank_precision() == [1.0, 0.0]
    assert hints.trusted(ranked) == [4] and hints.trusted([7, 8, 9]) == [7]  # rank 0 only; rank 2 never scored


def test_imprecise_hints_are_not_prefetched_but_still_scored():
    resident, tiered = _pair(hint_min_precision=0.8)
    generator = torch.Generator().manual_seed(7)
    for _ in range(24):  # every hint wrong: never trusted, so nothing is copied ahead
        _step(tiered, resident, generator, tokens=1, hint_for_1=torch.tensor([[6, 7]]))
    counters = tiered.metrics.layer(1)
    assert counters.prefetch_bytes == 0 and counters.hint_experts == 48
    assert max(tiered.hint_rank_precision) < 0.8
    with pytest.raises(ConfigError, match="hint_min_precision"):
        TieredDispatcher(tiered.store, cache_slots=1, hint_min_precision=1.5)


def test_precise_hints_become_trusted_and_are_prefetched():
    resident, tiered = _pair(hint_min_precision=0.8)
    generator = torch.Generator().manual_seed(8)
    for _ in range(30):  # the true ids as hints: precision 1 on every rank
        _step(tiered, resident, generator, tokens=1)
    counters = tiered.metrics.layer(1)
    assert counters.prefetch_used > 0 and counters.prefetch_wasted == 0
    assert min(tiered.hint_rank_precision) == 1.0
