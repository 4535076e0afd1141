"""Paged KV pools sized once at start-up from the engine's KV-token budget (and an optional snapshot reserve)."""

import logging

import pytest
import torch
from test_engine import make_engine, random_prompt, run

from moetier.engine.sampling import SamplingParams
from moetier.models.cache import kv_rows
from moetier.models.paged_kv import INITIAL_BLOCKS, PagedKVSpace, paged_kv
from moetier.server.metrics import ServerMetrics

# Tiny DeepSeek-V4 (tests/test_deepseek_v4.py): layers sliding, CSA (rate 4), HCA (rate 8), CSA, HCA;
# compressed entries of head_dim 32 (CSA and HCA, one pool), CSA indexer entries of 16 (a second pool).
V4 = {"max_streams": 2, "max_model_len": 64, "kv_block_tokens": 4, "kv_layout": "paged", "tokenizer": None}


def _v4_blocks(budget, streams, block, snapshot_rows=(0, 0, 0)):
    """Blocks per pool width by hand: per store, ceil(rows / block) + (streams - 1) for the partial blocks."""
    rows = (budget // 4, budget // 8, budget // 4)  # CSA entries, HCA entries, CSA indexer entries
    store = [-(-(r + extra) // block) + streams - 1 for r, extra in zip(rows, snapshot_rows, strict=True)]
    return {32: 2 * store[0] + 2 * store[1], 16: 2 * store[2]}


def _blocks_by_width(engine):
    return {pool.width: pool.blocks for pool in engine.runner.kv_space.pools}


@pytest.mark.parametrize(("kv_dtype", "row_bytes"), [("auto", {32: 128, 16: 64}), ("fp8", {32: 36, 16: 20})])
def test_v4_pools_are_allocated_at_start_up_for_the_budget(families, caplog, kv_dtype, row_bytes):
    loaded, _ = families("deepseek_v4")
    with caplog.at_level(logging.INFO, logger="moetier.engine.engine"):
        engine = make_engine(loaded, enable_prefix_caching=False, kv_dtype=kv_dtype, **V4)
    # 128 tokens: CSA entries 32 rows -> 8 + 1 blocks, HCA 16 rows -> 4 + 1, indexer 32 rows -> 8 + 1.
    assert _v4_blocks(128, 2, 4) == {32: 28, 16: 18}
    assert _blocks_by_width(engine) == {32: 28, 16: 18}
    nbytes = 4 * (28 * row_bytes[32] + 18 * row_bytes[16])  # fp8: 1 byte a value + a float32 scale per row
    stats = engine.stats()
    assert (stats.kv_pool_blocks, stats.kv_pool_blocks_used, stats.kv_pool_bytes_allocated) == (46, 0, nbytes)
    storage = "float32" if kv_dtype == "auto" else "fp8"
    gib = f"{nbytes / 2**30:.6f}"
    line = f"KV cache (paged, {storage}): 2 pools, 46 blocks of 4 rows, {gib} GiB, for 128 tokens (2 streams x 64)"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")] == [line]


def test_a_snapshot_reserve_gets_its_share_of_blocks(families, caplog):
    loaded, _ = families("deepseek_v4")
    with caplog.at_level(logging.INFO, logger="moetier.engine.engine"):
        engine = make_engine(loaded, prefix_cache_bytes=8192, prefix_cache_reserve_bytes=4096, **V4)
    # A 128-token probe holds (2 x 32 + 2 x 16) rows of 128 B and 2 x 32 of 64 B: 16384 B, 128 B a token;
    # 4096 B of snapshots = 32 tokens: 8 more rows per CSA store, 4 per HCA store, 8 per indexer store.
    assert _v4_blocks(128, 2, 4, snapshot_rows=(8, 4, 8)) == {32: 34, 16: 22}
    assert _blocks_by_width(engine) == {32: 34, 16: 22}
    assert any(r.getMessage().endswith("for 128 tokens (2 streams x 64) + 32 tokens reserved for prefix-cache "
                                       "snapshots") for r in caplog.records)  # fmt: skip


def _serve(engine, vocab):
    """Five requests of up to 64 tokens, two at a time (the whole budget), sharing a 32-token prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    shared = random_prompt(32, seed=1, vocab=vocab)
    tails = [random_prompt(n, seed=90 + i, vocab=vocab) for i, n in enumerate((8, 12, 1, 8, 15))]
    requests = [(f"r{i}", shared + tail, params) for i, tail in enumerate(tails)]
    return {rid: [t for u in ups for t in u.new_token_ids] for rid, ups in run(engine, requests).items()}


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("deepseek_v4", {**V4, "prefix_cache_bytes": 64 << 10}),
        ("qwen3_moe", {**V4, "kv_block_tokens": 8, "prefix_cache_bytes": 64 << 10}),
        ("deepseek_v3", {**V4, "kv_block_tokens": 8, "enable_prefix_caching": False}),
    ],
)
def test_serving_within_the_budget_never_grows_a_pool(families, caplog, family, config):
    loaded, vocab = families(family)
    engine = make_engine(loaded, **config)
    sized = _blocks_by_width(engine)
    with caplog.at_level(logging.WARNING, logger="moetier.models.paged_kv"):
        paged = _serve(engine, vocab)
    assert _blocks_by_width(engine) == sized
    assert not [r for r in caplog.records if "grew" in r.getMessage()]
    if config.get("enable_prefix_caching", True):
        assert engine.stats().prefix_cache_entries > 0  # snapshots held blocks too
    contiguous = {k: v for k, v in config.items() if k not in ("kv_layout", "kv_block_tokens")}
    assert paged == _serve(make_engine(loaded, **contiguous), vocab)


def test_qwen_pool_size_and_kv_usage_in_blocks(families):
    loaded, vocab = families("qwen3_moe")
    engine = make_engine(loaded, **{**V4, "kv_block_tokens": 8, "prefix_cache_bytes": 64 << 10})
    # One pool: keys and values of 4 layers share the row shape (2 KV heads x 16), 8 stores of 128 B rows.
    # 128 tokens (no snapshot share: snapshots borrow spare blocks): 16 blocks, + 1 partial, per store.
    assert _blocks_by_width(engine) == {16: 8 * 17}
    metrics = ServerMetrics(engine.stats, lambda: "tiny")
    engine.add_request("a", random_prompt(30, seed=5, vocab=vocab), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the 30-token prompt: 4 blocks in each of the 8 stores
    assert engine.stats().kv_pool_blocks_used == 32
    assert metrics.registry.get_sample_value("moetier:kv_cache_usage_perc", {"model_name": "tiny"}) == 32 / 136


def test_contiguous_layout_logs_its_budget(families, caplog):
    loaded, _ = families("qwen3_moe")
    with caplog.at_level(logging.INFO, logger="moetier.engine.engine"):
        engine = make_engine(loaded, tokenizer=None, max_streams=2, max_model_len=64, kv_token_budget=100)
    assert engine.runner.kv_space is None and engine.stats().kv_pool_blocks is None
    # GQA: 4 layers x keys + values x 2 heads x 16 = 256 float32 values a token: 1 KiB, 100 KiB in all.
    line = f"KV cache (contiguous, float32): 100 tokens (the KV-token budget), about {100 * 1024 / 2**30:.6f} GiB"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")] == [line]


def _sized_space(kv_dtype, block=4, tokens=8):
    space = PagedKVSpace("cpu", block_tokens=block)
    sizing = space.size_for(lambda n: kv_rows((2,), n, 6, torch.float32, "cpu", kv_dtype), tokens, 1, 0, "THE_KNOB")
    assert (sizing.pools, sizing.blocks) == (1, 2)
    return space


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_a_pool_that_runs_out_grows_keeps_its_rows_and_warns_once(caplog, kv_dtype):
    space = _sized_space(kv_dtype)
    with paged_kv(space):
        store = kv_rows((2,), 200, 6, torch.float32, "cpu", kv_dtype)
    rows = torch.randn(2, 150, 6, generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.DEBUG, logger="moetier.models.paged_kv"):
        store.write(0, rows[:, :5])  # 2 blocks: the sized pool
        before = store.read(5).clone()
        assert space.pools[0].blocks == 2 and not caplog.records
        store.write(5, rows[:, 5:20])  # 5 blocks: grows by INITIAL_BLOCKS (more than half of 2)
        assert space.pools[0].blocks == 2 + INITIAL_BLOCKS
        assert torch.equal(store.read(5), before)  # the blocks moved into the larger pool intact
        store.write(20, rows[:, 20:150])  # 38 blocks: grows twice more (by 16, then by half of 34)
    assert space.pools[0].blocks == 34 + 17
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len([r for r in caplog.records if "grew" in r.getMessage()]) == 3
    message = warnings[0].getMessage()
    assert message.startswith("paged KV pool (2, 6) grew from 2 to 18 blocks") and "raise THE_KNOB" in message
    fresh = kv_rows((2,), 200, 6, torch.float32, "cpu", kv_dtype)  # contiguous: the reference
    fresh.write(0, rows)
    assert torch.equal(store.read(150), fresh.read(150))


def test_an_unsized_space_grows_quietly(caplog):
    space = PagedKVSpace("cpu", block_tokens=2)
    with paged_kv(space), caplog.at_level(logging.DEBUG, logger="moetier.models.paged_kv"):
        kv_rows((), 100, 4, torch.float32, "cpu").write(0, torch.randn(40, 4))
    assert space.pools[0].blocks == 2 * INITIAL_BLOCKS and not caplog.records
