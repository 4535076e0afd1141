"""Paged prefix-cache snapshots borrow the pools' spare blocks and are evicted when running sequences need them.

The pools are sized for the KV-token budget only; snapshots hold what running sequences do not need, a
pool with no free block drops least recently used snapshots before it would grow, and the answers are
those of an engine that never evicts.
"""

import gc
import logging
import threading

import pytest
import torch
from test_engine import make_engine, random_prompt, run, tokens_of

from moetier.engine.prefix_cache import PrefixCache, chain_hashes
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.models.cache import ContiguousKVCache
from moetier.models.paged_kv import KVBlockPool, PagedKVSpace, paged_kv
from moetier.server.metrics import ServerMetrics

# Two streams of 64 tokens: 128 tokens of budget. Qwen3-MoE: one pool of 8 stores (keys and values of 4
# layers), blocks of 8 rows: 16 blocks + 1 partial per store. V4: blocks of 4 compressed entries.
CONFIGS = {
    "qwen3_moe": {"kv_block_tokens": 8, "prefix_block_tokens": 8},
    "deepseek_v4": {"kv_block_tokens": 4},  # HCA's half-filled entry blocks: copy-on-write of shared blocks
}
BASE = {"max_streams": 2, "max_model_len": 64, "tokenizer": None, "prefill_chunk_tokens": 16}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def paged(loaded, family, **extra):
    return make_engine(loaded, kv_layout="paged", **BASE, **CONFIGS[family], **extra)


def blocks(engine) -> list[int]:
    return [pool.blocks for pool in engine.runner.kv_space.pools]


def served(engine, prompt: list[int]) -> int:
    """Tokens the prefix cache would serve ``prompt`` now."""
    cache = engine.prefix_cache
    return cache.peek(chain_hashes(prompt, cache.block_tokens), len(prompt))


def assert_no_leak(engine) -> None:
    """Every block back in its pool once the prefix cache is cleared: references and marks all zero."""
    engine.prefix_cache.clear()
    gc.collect()
    for pool in engine.runner.kv_space.pools:
        assert set(pool.refs) == {0} and set(pool.marks) == {0} and pool.lent == 0
        assert pool.used == 0
    assert engine.prefix_cache.bytes_used == 0


# --- the engine ------------------------------------------------------------------------------------------


def test_start_up_sizes_the_pools_for_the_budget_only(families, caplog):
    loaded, _ = families("qwen3_moe")
    with caplog.at_level(logging.INFO, logger="moetier.engine.engine"):
        engine = paged(loaded, "qwen3_moe")  # prefix caching on, prefix_cache_bytes 1 GiB
    assert engine.prefix_cache is not None and engine.prefix_cache.capacity_bytes == 1 << 30
    assert blocks(engine) == [8 * 17] and engine.runner.kv_space.sizing.snapshot_tokens == 0
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert line.endswith("for 128 tokens (2 streams x 64)") and "snapshot" not in line


def test_finished_conversations_stay_cached_in_spare_blocks_and_are_evicted_lru(families, caplog):
    loaded, vocab = families("qwen3_moe")
    engine = paged(loaded, "qwen3_moe")
    space, cache = engine.runner.kv_space, engine.prefix_cache
    sized = blocks(engine)
    prompts = [random_prompt(30, seed=10 + i, vocab=vocab) for i in range(3)]
    outputs = {}
    with caplog.at_level(logging.WARNING, logger="moetier.models.paged_kv"):
        for i, prompt in enumerate(prompts):  # one at a time: each leaves prompt + output (32 tokens) cached
            outputs[f"c{i}"] = tokens_of(run(engine, [(f"c{i}", prompt, greedy(10))])[f"c{i}"])
        stats = engine.stats()
        assert stats.prefix_cache_entries == 3 and stats.kv_pool_blocks_used == 0
        assert stats.kv_pool_blocks_lent == space.stats().blocks_lent == 3 * 8 * 4  # 4 blocks a store a snapshot
        usage = ServerMetrics(engine.stats, lambda: "tiny").registry.get_sample_value
        assert usage("moetier:kv_cache_usage_perc", {"model_name": "tiny"}) == 0  # lent blocks are not in use
        assert stats.prefix_cache_bytes == space.stats().bytes_lent  # only blocks: no state outside the pools
        # A 64-token request needs 8 blocks per store; 5 are free: the oldest snapshot (c0) gives its 4.
        long = random_prompt(44, seed=20, vocab=vocab)
        outputs["d"] = tokens_of(run(engine, [("d", long, greedy(20))])["d"])
        assert cache.evictions == 1
        conversations = [p + outputs[f"c{i}"] for i, p in enumerate(prompts)]
        assert [served(engine, c + [5]) for c in conversations] == [0, 32, 32]
        # A resent conversation hits its snapshot (prompt + output, down to a block boundary).
        follow = conversations[2] + random_prompt(6, seed=21, vocab=vocab)
        before = engine.stats().prefix_cache_hits
        outputs["c2b"] = tokens_of(run(engine, [("c2b", follow, greedy(8))])["c2b"])
        assert engine.stats().prefix_cache_hits - before == 32
        # Two 64-token requests at once need every block but one per store: the snapshots give them up.
        pair = [(f"e{i}", random_prompt(44, seed=30 + i, vocab=vocab), greedy(20)) for i in range(2)]
        outputs.update({rid: tokens_of(ups) for rid, ups in run(engine, pair).items()})
    assert cache.evictions > 1 and blocks(engine) == sized
    assert not caplog.records  # no pool grew, nothing warned

    # The same requests on a contiguous engine that evicts nothing answer the same.
    contiguous = make_engine(loaded, **BASE, prefix_block_tokens=8)
    for rid, prompt, params in [*[(f"c{i}", p, greedy(10)) for i, p in enumerate(prompts)], ("d", long, greedy(20)),
                                ("c2b", follow, greedy(8)), *pair]:  # fmt: skip
        assert tokens_of(run(contiguous, [(rid, prompt, params)])[rid]) == outputs[rid], rid
    assert contiguous.prefix_cache.evictions == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_evicting_snapshots_for_running_sequences_never_grows_a_pool_nor_changes_an_answer(families, caplog, family):
    loaded, vocab = families(family)
    shared = random_prompt(24, seed=3, vocab=vocab)
    requests = [(f"r{i}", shared + random_prompt(9 + 5 * i, seed=40 + i, vocab=vocab), greedy(21)) for i in range(6)]
    requests += [(f"s{i}", random_prompt(40, seed=50 + i, vocab=vocab), greedy(20)) for i in range(4)]

    def serve(engine) -> dict[str, list[int]]:
        out = {}
        for i in range(0, len(requests), 2):  # two at a time: the whole budget
            out.update({rid: tokens_of(ups) for rid, ups in run(engine, requests[i : i + 2]).items()})
        # Conversations resent with a new turn, newest first: served from their snapshots while still cached.
        for rid, prompt, _ in [*requests[-1:-3:-1], *requests[:2]]:
            out[f"{rid}b"] = tokens_of(run(engine, [(f"{rid}b", prompt + out[rid] + [7], greedy(3))])[f"{rid}b"])
        return out

    engine = paged(loaded, family)
    sized = blocks(engine)
    with caplog.at_level(logging.WARNING, logger="moetier.models.paged_kv"):
        borrowed = serve(engine)
    assert engine.prefix_cache.evictions > 0 and engine.stats().prefix_cache_hits > 0
    assert blocks(engine) == sized and not caplog.records
    # A reserve as large as everything the snapshots take: nothing is evicted, the answers are the same.
    roomy = paged(loaded, family, prefix_cache_reserve_bytes=1 << 20)
    assert serve(roomy) == borrowed and roomy.prefix_cache.evictions == 0
    assert_no_leak(engine)
    assert_no_leak(roomy)


def test_the_reserve_is_bounded_by_the_prefix_cache_budget():
    from moetier.engine.types import EngineConfig

    with pytest.raises(ConfigError, match="prefix_cache_reserve_bytes"):
        EngineConfig(prefix_cache_bytes=100, prefix_cache_reserve_bytes=101)
    with pytest.raises(ConfigError, match="prefix_cache_reserve_bytes"):
        EngineConfig(prefix_cache_reserve_bytes=-1)


# --- the pool and the prefix cache -----------------------------------------------------------------------


def _sized_pool(blocks: int, hook) -> KVBlockPool:
    return KVBlockPool((), 2, torch.float32, 1, "cpu", block_tokens=2, blocks=blocks, reclaim=hook)


def test_a_full_pool_reclaims_outside_its_lock_before_it_grows():
    held: list[int] = []
    calls = []

    def hook(pool, block):  # a snapshot dropped: its block goes back (the pool's lock must be free here)
        calls.append(block)
        if not held:
            return False
        pool.release([held.pop()])
        return True

    pool = _sized_pool(2, hook)
    first, second = pool.allocate(), pool.allocate()
    held.append(second)
    got = []
    worker = threading.Thread(target=lambda: got.append(pool.allocate()))
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the reclaim hook deadlocked on the pool's lock"
    assert got == [second] and pool.blocks == 2 and calls == [None]
    assert pool.allocate() not in (first, second) and pool.blocks > 2 and calls == [None, None]  # nothing left


def test_copy_on_write_keeps_the_block_when_reclaiming_left_the_writer_alone():
    pool = _sized_pool(1, None)
    block = pool.allocate()
    pool.retain([block])  # a snapshot shares the writer's only block, and no block is free
    pool.mark([block])
    assert not pool.is_lent(block) and pool.lent == 0

    def hook(p, source):  # drop the snapshot holding the copy-on-write's source
        assert source == block
        p.unmark([source])
        p.release([source])
        return True

    pool.reclaim = hook
    assert pool.copy_block(block) == block and pool.refs[block] == 2  # the caller drops one reference next
    pool.release([block])
    assert pool.refs == [1] and pool.blocks == 1


def _live_cache(space: PagedKVSpace, tokens: int) -> ContiguousKVCache:
    with paged_kv(space):
        cache = ContiguousKVCache(2, 1, 32, 4, 4, torch.float32, "cpu")
    for layer in range(2):
        cache.write(layer, torch.randn(1, tokens, 4), torch.randn(1, tokens, 4))
    cache.advance(tokens)
    return cache


def test_paged_snapshots_cost_only_the_blocks_no_sequence_holds():
    space = PagedKVSpace("cpu", block_tokens=4)
    block_bytes = 4 * 4 * 4  # 4 rows of 4 float32 values
    cache = PrefixCache(block_tokens=4, capacity_bytes=16 * block_bytes, space=space)
    assert space.reclaim_hook == cache.reclaim
    tokens = [list(range(12)), list(range(50, 58))]
    first = _live_cache(space, 12)  # 3 blocks in each of 4 stores (one pool)
    assert cache.insert(chain_hashes(tokens[0], 4), first.snapshot(12))
    pool = space.pools[0]
    pool.reserve(32)  # room for both sequences and the snapshots: nothing is reclaimed here
    assert cache.bytes_used == 0 and pool.shared == 12 and pool.lent == 0  # every block shared with the sequence
    del first
    gc.collect()
    assert cache.bytes_used == 12 * block_bytes and pool.lent == 12  # the snapshot now holds them alone
    second = _live_cache(space, 8)
    assert cache.insert(chain_hashes(tokens[1], 4), second.snapshot(8)) and cache.bytes_used == 12 * block_bytes
    del second
    gc.collect()
    assert cache.bytes_used == 20 * block_bytes > cache.capacity_bytes
    cache.trim()  # what the engine does after freeing a sequence: the older snapshot goes
    assert len(cache) == 1 and cache.evictions == 1 and cache.bytes_used == 8 * block_bytes == pool.used * block_bytes
    assert cache.peek(chain_hashes(tokens[1], 4), 9) == 8

    assert not cache.reclaim(KVBlockPool((), 3, torch.float32, 1, "cpu", 4), None)  # holds nothing of that pool
    assert cache.reclaim(pool, None) and len(cache) == 0 and cache.evictions == 2
    assert pool.lent == 0 and pool.used == 0 and not cache.reclaim(pool, None)
