"""Paged KV: block-pool row stores against contiguous ones, and the engine on either layout."""

import gc

import pytest
import torch
from test_engine import make_engine, random_prompt, run

from moetier.engine.engine import EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.models.cache import KVRows, kv_rows
from moetier.models.paged_kv import INITIAL_BLOCKS, PagedKVRows, PagedKVSpace, paged_kv
from moetier.server.app import ServeConfig

STORES = [  # lead dims, width, storage kind, fp8 groups
    ((), 8, None, None),
    ((2,), 8, None, None),
    ((), 8, "bf16", None),
    ((2,), 12, "fp8", (4, 8)),
]


def _pair(space, lead, width, kv_dtype, groups, capacity=200):
    reference = KVRows(lead, capacity, width, torch.float32, "cpu", kv_dtype, groups)
    with paged_kv(space):
        paged = kv_rows(lead, capacity, width, torch.float32, "cpu", kv_dtype, groups)
    assert isinstance(paged, PagedKVRows) and paged.kv_dtype == reference.kv_dtype
    return reference, paged


@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize(("lead", "width", "kv_dtype", "groups"), STORES)
def test_paged_rows_read_back_what_contiguous_rows_do(block, lead, width, kv_dtype, groups):
    space = PagedKVSpace("cpu", block_tokens=block)
    reference, paged = _pair(space, lead, width, kv_dtype, groups)
    g = torch.Generator().manual_seed(block)
    end = 0
    for n in (1, 3, block, 2 * block + 1, 1, 1, 37):  # decode-sized and prefill-sized writes, block edges
        rows = torch.randn(*lead, n, width, generator=g)
        reference.write(end, rows)
        paged.write(end, rows)
        end += n
        assert torch.equal(paged.read(end), reference.read(end))
        assert torch.equal(paged.read(end // 2), reference.read(end // 2))
        some = torch.randperm(end, generator=g)[:5]  # a reader of a few rows (V4's top-k entries)
        assert torch.equal(reference.read_at(some), reference.read(end).index_select(-2, some))
        assert torch.equal(paged.read_at(some), reference.read_at(some))
    assert paged.nbytes == reference.nbytes  # the engine's accounting is the same on both layouts
    assert len(paged.blocks) == -(-end // block)


@pytest.mark.parametrize(("lead", "width", "kv_dtype", "groups"), STORES)
def test_copies_share_blocks_and_copy_on_write_keeps_both_sides(lead, width, kv_dtype, groups):
    space = PagedKVSpace("cpu", block_tokens=4)
    reference, paged = _pair(space, lead, width, kv_dtype, groups)
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(*lead, 10, width, generator=g)
    reference.write(0, rows)
    paged.write(0, rows)
    used = space.stats().blocks_used
    snapshot, ref_snapshot = paged.copy(200, 6), reference.copy(200, 6)  # mid-block: block 1 is shared
    assert space.stats().blocks_used == used and snapshot.blocks == paged.blocks[:2]
    assert space.stats().blocks_shared == 2
    more = torch.randn(*lead, 5, width, generator=g)
    snapshot.write(6, more)  # copy-on-write of the shared partial block, then a fresh block
    ref_snapshot.write(6, more)
    assert torch.equal(snapshot.read(11), ref_snapshot.read(11))
    assert torch.equal(paged.read(10), reference.read(10))  # the original never sees the snapshot's rows
    assert snapshot.blocks[0] == paged.blocks[0] and snapshot.blocks[1] != paged.blocks[1]
    assert space.stats().blocks_used == used + 2 and space.stats().blocks_shared == 1


def test_blocks_return_to_the_pool_when_the_last_holder_goes_and_the_pool_grows():
    space = PagedKVSpace("cpu", block_tokens=2)
    _, paged = _pair(space, (), 4, None, None, capacity=4 * INITIAL_BLOCKS)
    paged.write(0, torch.randn(3 * INITIAL_BLOCKS, 4))  # 1.5x the first pool: it doubles once
    copy = paged.copy(4 * INITIAL_BLOCKS, 3 * INITIAL_BLOCKS)
    stats = space.stats()
    assert stats.blocks_used == 3 * INITIAL_BLOCKS // 2 and stats.blocks_allocated == 2 * INITIAL_BLOCKS
    del paged
    gc.collect()
    assert space.stats().blocks_used == 3 * INITIAL_BLOCKS // 2  # the copy still holds every block
    del copy
    gc.collect()
    assert space.stats().blocks_used == 0
    with pytest.raises(ConfigError, match="capacity"):
        _pair(space, (), 4, None, None, capacity=3)[1].write(2, torch.randn(2, 4))


def _greedy(loaded, prompts, **config):
    engine = make_engine(loaded, tokenizer=None, max_streams=len(prompts), **config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    updates = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return engine, {rid: [t for u in ups for t in u.new_token_ids] for rid, ups in updates.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_engine_on_paged_kv_generates_what_it_does_on_contiguous_kv(families, family, kv_dtype):
    loaded, vocab = families(family)
    prompts = [random_prompt(n, seed=n, vocab=vocab) for n in (9, 40, 23)]
    _, contiguous = _greedy(loaded, prompts, kv_dtype=kv_dtype)
    engine, paged = _greedy(loaded, prompts, kv_dtype=kv_dtype, kv_layout="paged", kv_block_tokens=8)
    assert paged == contiguous
    stats = engine.stats()
    assert stats.kv_pool_bytes_allocated >= stats.kv_pool_bytes_used > 0  # the prefix cache holds snapshots


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_a_resent_conversation_shares_its_prefix_blocks(families, family):
    loaded, vocab = families(family)
    first = random_prompt(64, seed=3, vocab=vocab)
    engine = make_engine(loaded, tokenizer=None, max_streams=2, kv_layout="paged", kv_block_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    turn1 = run(engine, [("a", first, params)])["a"]
    follow = first + [t for u in turn1 for t in u.new_token_ids] + random_prompt(5, seed=4, vocab=vocab)
    space = engine.runner.kv_space
    assert space.stats().blocks_shared == 0  # turn 1 is done: only its snapshot holds blocks
    engine.add_request("b", follow, params)
    updates = engine.step()  # admitted from the snapshot: only the new tokens are computed
    assert engine.stats().prefix_cache_hits > 0
    # Turn 2's cache holds the snapshot's full blocks too (its partly filled ones were copied on write).
    assert space.stats().blocks_shared > 0
    while engine.has_work():
        updates += engine.step()
    alone = make_engine(loaded, tokenizer=None, max_streams=1, enable_prefix_caching=False)
    expected = run(alone, [("b", follow, params)])["b"]
    got = [t for u in updates if u.request_id == "b" for t in u.new_token_ids]
    assert got == [t for u in expected for t in u.new_token_ids]


def test_preempted_requests_recompute_on_paged_kv(families):
    """Three requests that cannot all grow in the budget (as tests/test_preemption.py squeezes them)."""
    loaded, vocab = families("qwen3_moe")
    prompts = [random_prompt(20, seed=70 + i, vocab=vocab) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    reserve = {"tokenizer": None, "kv_admission": "reserve"}
    alone = {rid: run(make_engine(loaded, **reserve), [(rid, p, params)])[rid] for rid, p, _ in requests}
    tight = {"max_streams": 3, "kv_token_budget": 96, "kv_headroom_tokens": 4, "prefix_block_tokens": 4}
    engine = make_engine(loaded, tokenizer=None, kv_layout="paged", kv_block_tokens=4, **tight)
    squeezed = run(engine, requests)
    assert engine.stats().preemptions_total > 0
    for rid in alone:
        assert [t for u in squeezed[rid] for t in u.new_token_ids] == [t for u in alone[rid] for t in u.new_token_ids]


def test_layout_options_are_validated():
    with pytest.raises(ConfigError, match="kv_layout"):
        EngineConfig(kv_layout="ring")
    with pytest.raises(ConfigError, match="kv_block_tokens"):
        EngineConfig(kv_block_tokens=0)
    with pytest.raises(ConfigError, match="KV block size"):
        PagedKVSpace("cpu", block_tokens=0)
    with pytest.raises(ConfigError, match="kv_layout"):
        ServeConfig(kv_layout="ring")
    assert ServeConfig(kv_layout="paged").kv_layout == "paged"


def test_auto_layout_is_paged_only_where_decode_reads_blocks_in_place(monkeypatch):
    from moetier.engine import kv_sizing
    from moetier.engine.kv_sizing import resolve_kv_layout
    from moetier.models.deepseek_v3 import DeepseekV3ForCausalLM
    from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM
    from moetier.models.qwen3_moe import Qwen3MoeForCausalLM

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not kv_sizing.kernels_run_on(cpu)
    # CI has no GPU: Triton is taken as running on CUDA (the real check needs a device to ask).
    monkeypatch.setattr(kv_sizing, "kernels_run_on", lambda device: device.type == "cuda")
    assert EngineConfig().kv_layout == "auto" and ServeConfig().kv_layout == "auto"
    for model in (Qwen3MoeForCausalLM, DeepseekV3ForCausalLM):
        assert resolve_kv_layout("auto", model, cuda) == "paged"
        assert resolve_kv_layout("auto", model, cpu) == "contiguous"  # the gather path: nothing gained
    assert resolve_kv_layout("auto", DeepseekV4ForCausalLM, cuda) == "contiguous"  # V4 reads still gather
    for layout in ("contiguous", "paged"):
        assert resolve_kv_layout(layout, DeepseekV4ForCausalLM, cpu) == layout
