"""The mapped route: misses read by the device's kernels from the pinned home copy, through one device table."""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from test_split_choice import _Clock
from test_tiers_fidelity import _random_store, _routing
from test_tiers_policies import random_store

from moetier.errors import ConfigError
from moetier.tiers import tiered_dispatcher
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.split_choice import SplitChooser
from moetier.tiers.tiered_dispatcher import TieredDispatcher

LAYOUT = ExpertLayout((0, 1), num_experts=12, hidden_size=32, intermediate_size=16, top_k=3, swiglu_limit=2.0)


def _table_entries(dispatcher: TieredDispatcher) -> dict[tuple[int, int], object]:
    """Each (layer, expert)'s block as the device table addresses it (resolved on the host)."""
    mapped = dispatcher.mapped
    offsets = mapped.table.tolist()
    return {
        (layer, e): mapped._block_at(offsets[row * mapped.experts + e]).block
        for row, layer in enumerate(mapped.layers)
        for e in range(mapped.experts)
    }


def _check_table_follows_cache(dispatcher: TieredDispatcher) -> int:
    """Every entry is its expert's home copy or the slot holding it now; returns how many point at slots."""
    at_slots = 0
    for key, block in _table_entries(dispatcher).items():
        slot = dispatcher.cache.get(key)
        home = dispatcher.store.expert(*key).block
        if slot is not None and block.data_ptr() == slot.tensor.data_ptr():
            at_slots += 1
        else:
            assert block.data_ptr() == home.data_ptr(), key
    return at_slots


@pytest.mark.parametrize("every", [1, 3])
def test_mapped_decode_matches_resident_through_admissions_and_resizes(every):
    store = _random_store(LAYOUT, torch.float32)
    resident = ResidentDispatcher(store)
    options = {"mapped_admissions": 1, "mapped_bookkeeping_every": every}
    tiered = TieredDispatcher(store, cache_slots=5, miss_route="mapped", policy="lfu", **options)
    generator = torch.Generator().manual_seed(2)
    pointed = []
    for step, tokens in enumerate((1, 1, 2, 1, 4, 1, 1, 3, 1, 1, 1, 2)):
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(tokens, LAYOUT, generator, torch.float32, skew=1.5)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
        pointed.append(_check_table_follows_cache(tiered))
        if step in (5, 8):
            tiered.resize_cache((2, 6)[step == 8])  # elastic, between steps: the table must let go of freed slots
    tiered.flush_metrics()
    tiered.close()
    totals = tiered.metrics.snapshot()["totals"]
    assert max(pointed) > 0 and totals["uses_hit"] > 0 and totals["evictions"] > 0
    assert totals["copy_pairs"] == totals["cpu_pairs"] == 0 and totals["mapped_pairs"] == totals["uses_miss"]
    # At most one evicting admission per step (mapped_admissions; the shrink to 2 slots evicts up to 3 more),
    # and each admission is one expert over PCIe.
    assert totals["evictions"] <= 12 + 3
    assert totals["admissions"] > 0 and totals["admit_bytes"] == totals["admissions"] * tiered.block_bytes


def test_admissions_follow_the_counts_of_earlier_steps_and_the_cap():
    """Counts come back a step late (copied at a step's start, taken in at the next), so a step's experts are
    admitted two steps on and read from their slots once copied; free slots take every miss, evicting
    admissions stop at ``mapped_admissions`` a step."""
    store = random_store()  # 6 experts per layer, top-2
    options = {"mapped_admissions": 1, "mapped_bookkeeping_every": 1}
    tiered = TieredDispatcher(store, cache_slots=2, miss_route="mapped", policy="lru", **options)
    hidden, weights = torch.randn(1, store.layout.hidden_size), torch.full((1, 2), 0.5)

    def step(*experts: int) -> None:
        tiered.dispatch(0, hidden, torch.tensor([experts]), weights)

    for _ in range(3):
        step(3, 5)
    assert set(tiered.cache.resident()) == {(0, 3), (0, 5)} and _check_table_follows_cache(tiered) == 0
    step(0, 1)
    assert _check_table_follows_cache(tiered) == 2
    step(2, 4)
    step(2, 4)  # takes in step(0, 1): the cache is full, so one of 0 and 1 evicts one of 3 and 5
    resident = set(tiered.cache.resident())
    assert len(resident & {(0, 0), (0, 1)}) == 1 and len(resident & {(0, 3), (0, 5)}) == 1
    tiered.close()
    assert tiered.metrics.total().evictions == 1


def test_the_host_keeps_the_books_every_few_steps_and_points_at_landed_slots_between():
    """With ``mapped_bookkeeping_every=3`` the counts are taken in and experts admitted at steps 1, 4, 7...; an
    admission's slot is pointed at from the first step after its copy landed, bookkeeping or not."""
    store = random_store()  # 6 experts per layer, top-2
    options = {"mapped_admissions": 1, "mapped_bookkeeping_every": 3}
    tiered = TieredDispatcher(store, cache_slots=2, miss_route="mapped", policy="lru", **options)
    hidden, weights = torch.randn(1, store.layout.hidden_size), torch.full((1, 2), 0.5)
    resident, pointed = [], []
    for _ in range(6):
        tiered.dispatch(0, hidden, torch.tensor([[3, 5]]), weights)
        resident.append(set(tiered.cache.resident()))
        pointed.append(_check_table_follows_cache(tiered))
    tiered.flush_metrics()
    tiered.close()
    # Step 3 copies the counts back, step 4 takes them in and admits both, step 5 points at their landed slots.
    assert resident[:3] == [set()] * 3 and resident[3:] == [{(0, 3), (0, 5)}] * 3
    assert pointed == [0, 0, 0, 0, 2, 2]
    layer = tiered.metrics.layer(0)
    assert layer.calls == 6 and layer.uses_miss == 4 * 2 and layer.uses_hit == 2 * 2
    assert layer.experts_miss == 4 * 2 and layer.experts_hit == 2 * 2  # per call, as the other routes count them


def test_the_chooser_takes_the_mapped_route_once_it_measures_faster(monkeypatch):
    store = random_store()
    options = {"cache_slots": 2, "calibrate": False, "adapt_costs": True, "cpu_share": None, "mapped": True}
    dispatcher = TieredDispatcher(store, **options)
    dispatcher.prepare("cpu")
    dispatcher.chooser = SplitChooser(block_steps=2, rounds=1, settle_steps=1)
    dispatcher.metrics.split_choices = dispatcher.chooser.report
    monkeypatch.setattr(tiered_dispatcher, "time", _Clock(dispatcher, {"auto": 9.0, "copy": 6.0, "mapped": 3.0}))
    reads = []
    read = tiered_dispatcher.read_host_inputs
    monkeypatch.setattr(tiered_dispatcher, "read_host_inputs", lambda *a: reads.append(1) or read(*a))
    generator = torch.Generator().manual_seed(0)
    routes = []
    for _ in range(14):
        hidden, ids, weights = _routing(1, store.layout, generator, torch.float32)
        dispatcher.dispatch(0, hidden, ids, weights)
        routes.append(dispatcher._step_route)
    dispatcher.close()
    assert routes[:10] == ["auto"] * 3 + ["copy"] * 3 + ["mapped"] * 3 + ["mapped"]
    assert routes[10:] == ["mapped"] * 4
    assert dispatcher.chooser.report()[1]["route"] == "mapped"
    assert len(reads) == 6  # only the split's and copies' steps read the routing on the host


def test_the_chooser_leaves_mapped_out_where_it_is_not_wanted():
    dispatcher = TieredDispatcher(random_store(), cache_slots=2, calibrate=False, adapt_costs=True)
    dispatcher.prepare("cpu")  # mapped=None: tried on CUDA only
    dispatcher.chooser = SplitChooser(playoff_margin=0.0)  # the trial alone (host times on CPU may come close)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # a trial of two routes: 2 rounds x (1 settle + 3 timed steps), after one untimed
        dispatcher.dispatch(0, *_routing(1, dispatcher.store.layout, generator, torch.float32))
    dispatcher.close()
    assert set(dispatcher.chooser.report()[1]) == {"route", "auto_ms", "copy_ms"}


def test_mapped_options_are_validated():
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="mapped_admissions"):
            TieredDispatcher(random_store(), cache_slots=1, mapped_admissions=bad)
        with pytest.raises(ConfigError, match="mapped_bookkeeping_every"):
            TieredDispatcher(random_store(), cache_slots=1, mapped_bookkeeping_every=bad)
    with pytest.raises(ConfigError, match="mapped"):
        TieredDispatcher(random_store(), cache_slots=1, miss_route="zero-copy")


# --- CUDA: the kernels read the pinned arena over PCIe -------------------------------------------------


def _pinned_and_device_stores(layout: ExpertLayout, dtype: torch.dtype) -> tuple[ExpertStore, ExpertStore]:
    source = _random_store(layout, dtype)
    arena = HostExpertArena(chunk_bytes=64 << 20, progress=False)
    home, device = ExpertStore(layout, dtype, arena), ExpertStore(layout, dtype, device_allocator("cuda"))
    for key, weights in source.items():
        home.block_for_loading(*key).block.copy_(weights.block)
        device.block_for_loading(*key).block.copy_(weights.block)
    assert arena.pinned
    return home, device


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mapped_calls_give_the_resident_kernels_bits(dtype):
    """Host-read and VRAM-read blocks through the same device-built launch: the same bits, through admissions
    (copies landing while steps run), a shrink and a regrow."""
    layout = ExpertLayout((0, 1), num_experts=32, hidden_size=1024, intermediate_size=512, top_k=4, swiglu_limit=7.0)
    home, device_store = _pinned_and_device_stores(layout, dtype)
    resident = ResidentDispatcher(device_store, device_routing=True)
    tiered = TieredDispatcher(
        home, cache_slots=6, miss_route="mapped", mapped_admissions=2, policy="lfu", mapped_cpu_share=0.0
    )
    generator = torch.Generator().manual_seed(5)
    for step in range(40):
        tokens = (1, 2, 4, 1)[step % 4]
        for layer in layout.moe_layers:
            hidden, ids, weights = (t.cuda() for t in _routing(tokens, layout, generator, dtype, skew=3.0))
            ours, theirs = tiered.dispatch(layer, hidden, ids, weights), resident.dispatch(layer, hidden, ids, weights)
            assert torch.equal(ours, theirs), (step, layer)
        if step in (15, 25):
            tiered.resize_cache((2, 8)[step == 25])
    torch.cuda.synchronize()
    tiered.flush_metrics()
    tiered.close()
    totals = tiered.metrics.snapshot()["totals"]
    assert totals["uses_hit"] > 0 and totals["mapped_pairs"] > 0 and totals["evictions"] > 0
    assert totals["copy_pairs"] == 0 and totals["cpu_pairs"] == 0


@pytest.mark.gpu
def test_a_pageable_home_copy_is_never_read_by_the_kernels():
    """Pageable memory is not in the GPU's address space: a mapped dispatcher over it copies its misses instead."""
    layout = ExpertLayout((0, 1), num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)
    source = _random_store(layout, torch.float32)
    home = ExpertStore(layout, torch.float32, HostExpertArena(chunk_bytes=16 << 20, pin=False, progress=False))
    device_store = ExpertStore(layout, torch.float32, device_allocator("cuda"))
    for key, weights in source.items():
        home.block_for_loading(*key).block.copy_(weights.block)
        device_store.block_for_loading(*key).block.copy_(weights.block)
    resident = ResidentDispatcher(device_store)
    tiered = TieredDispatcher(home, cache_slots=2, miss_route="mapped")
    generator = torch.Generator().manual_seed(6)
    for _ in range(4):
        for layer in layout.moe_layers:
            hidden, ids, weights = (t.cuda() for t in _routing(1, layout, generator, torch.float32))
            ours = tiered.dispatch(layer, hidden, ids, weights)
            assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
    tiered.close()
    totals = tiered.metrics.snapshot()["totals"]
    assert totals["mapped_pairs"] == 0 and totals["copy_pairs"] > 0


def test_a_failing_mapped_call_falls_back_to_copies_and_stays_off(monkeypatch, caplog):
    store = _random_store(LAYOUT, torch.float32)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=3, miss_route="mapped")
    tiered.prepare("cpu")
    calls = []

    def broken(layer, out, *args):
        calls.append(layer)
        out += 1.0  # a partial result the fallback must not keep
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(tiered.mapped, "dispatch", broken)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(1, LAYOUT, generator, torch.float32)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
    tiered.close()
    assert calls == [0] and "mapped expert route failed" in caplog.text
    assert tiered.metrics.total().copy_pairs > 0
