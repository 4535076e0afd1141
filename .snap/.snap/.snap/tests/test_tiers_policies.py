"""Cache policies, the VRAM expert cache, the host arena and the miss split, on hand-made sequences (CPU)."""

import json

import pytest
import torch

from moetier.errors import ConfigError
from moetier.tiers.expert_cache import ExpertCache
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.metrics import TierMetrics
from moetier.tiers.policies import (
    POLICIES,
    DecayedFrequencyPolicy,
    LRUPolicy,
    StaticPolicy,
    load_routing_stats,
    make_policy,
    save_routing_stats,
)
from moetier.tiers.route_costs import RouteCosts, split_misses

LAYOUT = ExpertLayout(moe_layers=(0, 2), num_experts=6, hidden_size=16, intermediate_size=8, top_k=2)


def random_store(dtype=torch.float32, allocator=None) -> ExpertStore:
    store = ExpertStore(LAYOUT, dtype, allocator or device_allocator("cpu"))
    generator = torch.Generator().manual_seed(0)
    for layer in LAYOUT.moe_layers:
        for expert in range(LAYOUT.num_experts):
            block = store.block_for_loading(layer, expert).block
            block.copy_(torch.randn(block.shape, generator=generator))
    return store


def insert_all(policy, keys):
    for key in keys:
        policy.inserted(key)


# --- policies ----------------------------------------------------------------------------------


def test_registry_knows_the_three_policies_and_rejects_unknown_ones():
    assert {"lru", "lfu", "static"} <= set(POLICIES)
    assert isinstance(make_policy("lfu", half_life=8), DecayedFrequencyPolicy)
    with pytest.raises(ConfigError):
        make_policy("fifo")
    with pytest.raises(ConfigError):
        make_policy("lru", half_life=3)


def test_lru_evicts_least_recently_used_and_skips_protected():
    policy = LRUPolicy()
    a, b, c = (0, 1), (0, 2), (2, 1)
    insert_all(policy, [a, b, c])  # recency: a < b < c
    assert policy.choose_victim(set()) == a
    policy.record(0, [1], [3], step=1)  # a used again: b is now the oldest
    assert policy.choose_victim(set()) == b
    assert policy.choose_victim({b}) == c
    assert policy.choose_victim({a, b, c}) is None
    policy.removed(b)
    assert policy.choose_victim(set()) == c
    assert policy.should_admit((0, 5), c)


def test_lfu_decay_forgets_old_heat_and_gates_admission():
    policy = DecayedFrequencyPolicy(half_life=10)
    hot_then_cold, warm = (0, 0), (0, 1)
    insert_all(policy, [hot_then_cold, warm])
    policy.record(0, [0], [16], step=1)
    policy.record(0, [1], [3], step=1)
    assert policy.choose_victim(set()) == warm  # 3 < 16
    assert policy.choose_victim({warm}) == hot_then_cold
    # Twenty steps later (two half-lives) the old 16 counts as 4; warm's 3 * 0.25 + 3 = 3.75 is still lower.
    policy.record(0, [1], [3], step=21)
    assert policy.score(hot_then_cold) == pytest.approx(4.0)
    assert policy.choose_victim(set()) == warm
    # One more half-life: hot 2, warm 3.75 / 2 + 1 = 2.875: the formerly hot expert goes first.
    policy.record(0, [1], [1], step=31)
    policy.record(2, [4], [1], step=31)
    assert policy.score(warm) == pytest.approx(2.875)
    assert policy.choose_victim(set()) == hot_then_cold
    # Admission: a miss must beat the victim's score; a free slot always admits.
    assert not policy.should_admit((2, 4), hot_then_cold)  # 1 < 2
    policy.record(2, [4], [5], step=31)
    assert policy.should_admit((2, 4), hot_then_cold)  # 6 > 2
    assert policy.should_admit((2, 5), None)


def test_lfu_scores_stay_finite_and_ordered_over_many_half_lives():
    policy = DecayedFrequencyPolicy(half_life=1.0)
    a, b = (0, 0), (0, 1)
    insert_all(policy, [a, b])
    for step in range(1, 2000):
        policy.record(0, [0, 1], [2, 1], step)
    assert policy.choose_victim(set()) == b
    assert 2.0 < policy.score(a) < 5.0  # geometric sum of 2 per step with ratio 1/2 -> 4
    assert all(s < 1e300 for s in policy._score.values())


def test_static_policy_ranks_by_count_never_admits_and_round_trips_json(tmp_path):
    stats = {"0": [5, 0, 9, 1, 0, 0], "2": {"3": 7, "0": 2}}
    policy = StaticPolicy(stats=stats)
    assert policy.preferred(3) == [(0, 2), (2, 3), (0, 0)]
    insert_all(policy, policy.preferred(3))
    assert policy.choose_victim(set()) == (0, 0)  # lowest ranked goes first on a shrink
    assert policy.choose_victim({(0, 0)}) == (2, 3)
    assert not policy.should_admit((2, 0), None)
    path = tmp_path / "routing.json"
    save_routing_stats({0: {0: 5, 2: 9, 3: 1}, 2: {3: 7, 0: 2}}, path)
    assert load_routing_stats(path)[2] == {0: 2, 3: 7}
    assert StaticPolicy(stats_path=path).preferred(3) == [(0, 2), (2, 3), (0, 0)]
    path.write_text(json.dumps({"0": "not counts"}))
    with pytest.raises(ConfigError):
        StaticPolicy(stats_path=path)


# --- the cache ---------------------------------------------------------------------------------


def test_cache_admits_evicts_by_policy_and_protects_in_use_experts():
    store, metrics = random_store(), TierMetrics()
    cache = ExpertCache(store, "cpu", n_slots=2, policy=LRUPolicy(), n_staging=1, metrics=metrics)
    for key in [(0, 1), (0, 2)]:
        slot = cache.plan_admission(key, protected={key})
        cache.fill(slot, store.expert(*key).block)
    assert torch.equal(cache.get((0, 2)).tensor, store.expert(0, 2).block)
    # Full: a new miss evicts the least recent unprotected expert.
    cache.policy.record(0, [1], [1], step=2)
    slot = cache.plan_admission((2, 5), protected={(2, 5)})
    assert (0, 2) not in cache and cache.get((2, 5)) is None  # reserved, copy not yet enqueued
    cache.fill(slot, store.expert(2, 5).block)
    assert torch.equal(cache.get((2, 5)).tensor, store.expert(2, 5).block)
    # Everything resident is in use by this dispatch: nothing is evicted, the miss is not admitted.
    assert cache.plan_admission((0, 4), protected={(0, 1), (2, 5), (0, 4)}) is None
    assert set(cache.resident()) == {(0, 1), (2, 5)}
    assert metrics.layer(0).admissions == 2 and metrics.layer(0).evictions == 1
    assert metrics.layer(2).admissions == 1 and metrics.layer(2).evictions == 0


def test_cache_resize_is_elastic():
    store = random_store()
    cache = ExpertCache(store, "cpu", n_slots=3, policy=LRUPolicy())
    for key in [(0, 0), (0, 1), (2, 2)]:
        cache.fill(cache.plan_admission(key, set()), store.expert(*key).block)
    cache.policy.record(0, [0], [1], step=5)  # (0, 1) is now the least recent
    assert cache.resize(5) == 5 and len(cache.resident()) == 3
    assert cache.resize(2) == 2
    assert set(cache.resident()) == {(0, 0), (2, 2)}
    assert cache.resize(0, protected={(2, 2)}) == 1  # cannot drop an expert in use
    assert cache.resident() == [(2, 2)]
    assert torch.equal(cache.get((2, 2)).tensor, store.expert(2, 2).block)


def test_static_cache_warms_with_the_top_experts_and_refills_on_growth():
    store = random_store()
    stats = {0: [0, 10, 0, 0, 3, 0], 2: [8, 0, 0, 0, 0, 5]}
    cache = ExpertCache(store, "cpu", n_slots=2, policy=StaticPolicy(stats=stats))
    assert set(cache.resident()) == {(0, 1), (2, 0)}
    assert torch.equal(cache.get((2, 0)).tensor, store.expert(2, 0).block)
    assert cache.plan_admission((0, 3), set()) is None
    cache.resize(4)
    assert set(cache.resident()) == {(0, 1), (2, 0), (2, 5), (0, 4)}
    cache.resize(3)
    assert (0, 4) not in cache


# --- host arena ---------------------------------------------------------------------------------


def test_arena_packs_aligned_blocks_into_reserved_chunks():
    block_bytes = LAYOUT.block_bytes(torch.bfloat16)  # 768 bytes: several blocks per 4 KiB chunk
    arena = HostExpertArena(chunk_bytes=4096, alignment=1024, progress=False)
    assert not arena.pinned and arena.pin_note  # no CUDA here: pageable, and it says why
    arena.reserve_blocks(12, block_bytes)
    reserved = len(arena.chunks)
    assert reserved == 3  # 4 aligned blocks per chunk
    store = random_store(torch.bfloat16, allocator=arena)
    assert len(arena.chunks) == reserved  # 12 blocks fit in the reservation
    ptrs = sorted(weights.block.data_ptr() for _, weights in store.items())
    assert all(p % 1024 == 0 for p in ptrs)
    chunk_ranges = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in arena.chunks]
    for _, weights in store.items():
        start = weights.block.data_ptr()
        assert any(lo <= start and start + block_bytes <= hi for lo, hi in chunk_ranges)
    assert len(set(ptrs)) == 12 and arena.used_bytes == 12 * block_bytes
    # Beyond the reservation the arena grows (the reserved bytes hold at most 20 blocks, alignment
    # slack included, so 9 more cannot all fit).
    extra = [arena(LAYOUT.block_numel, torch.bfloat16) for _ in range(9)]
    assert len(arena.chunks) > reserved and all(block.data_ptr() % 1024 == 0 for block in extra)
    with pytest.raises(ConfigError):
        HostExpertArena(alignment=1000)


def test_arena_for_layout_reserves_every_expert():
    arena = HostExpertArena.for_layout(LAYOUT, torch.float32, chunk_bytes=1 << 13, alignment=512, progress=False)
    block = LAYOUT.block_bytes(torch.float32)  # 1536 bytes: 5 per 8 KiB chunk
    assert len(arena.chunks) == 3
    assert 12 * block <= arena.allocated_bytes <= 12 * block + 3 * (block + arena.alignment)


# --- miss split and metrics ----------------------------------------------------------------------


def test_split_misses_by_route_and_by_cost():
    tokens = [1, 9, 2, 2, 1, 3]
    assert split_misses(tokens, "cpu", RouteCosts()) == ([0, 1, 2, 3, 4, 5], [])
    assert split_misses(tokens, "copy", RouteCosts()) == ([], [0, 1, 2, 3, 4, 5])
    # The CPU is 3x cheaper per expert: it takes ~3/4 of the experts; fat groups go first.
    cpu, copy = split_misses(tokens, "auto", RouteCosts.from_share(0.75))
    assert sorted(cpu + copy) == list(range(6)) and len(cpu) in (4, 5)
    # Per-token cost on the CPU: the fat group goes to the copy path, then both queues stay balanced
    # (LPT order 9, 3, 2, 2, 1, 1 -> copy 3.09 | cpu 4 | copy 6.11 | cpu 7 | cpu 9 | copy 9.12).
    costs = RouteCosts(cpu_fixed=1.0, cpu_per_token=1.0, copy_fixed=3.0, copy_per_token=0.01)
    assert split_misses(tokens, "auto", costs) == ([0, 3, 5], [1, 2, 4])
    assert split_misses(tokens, "auto", RouteCosts.from_share(0.0)) == ([], [0, 1, 2, 3, 4, 5])


def test_metrics_snapshot_rates():
    metrics = TierMetrics()
    metrics.tokens = 4
    first, second = metrics.layer(0), metrics.layer(2)
    first.uses_hit, first.uses_miss, second.uses_miss = 3, 5, 8
    first.copy_bytes, second.cpu_seconds = 100, 0.5
    metrics.record_routing(0, [1, 2], [3, 5])
    metrics.record_routing(0, [2], [1])
    snap = metrics.snapshot()
    assert snap["hit_rate"] == pytest.approx(3 / 16)
    assert snap["misses_per_token"] == pytest.approx(13 / 4)
    assert snap["per_layer"]["0"]["hit_rate"] == pytest.approx(3 / 8)
    assert snap["copy_bytes"] == 100 and snap["cpu_seconds"] == 0.5
    assert metrics.routing_counts() == {0: {1: 3, 2: 6}}
    json.dumps(snap)
