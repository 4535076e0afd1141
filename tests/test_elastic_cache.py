"""The elastic VRAM expert cache: it gives slots to KV beyond the plan's reservation and takes them back.

A tiny Qwen3-MoE (fp32, CPU) planned with KV reserved for 1 of 3 streams: three concurrent requests of a
full window shrink the expert cache while they run and it returns to the plan's size once they finish;
the greedy tokens equal the all-resident engine's; a floor above what three streams need makes the third
request wait instead of shrinking past it; stats and /metrics show the slots.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import save_tiny
from test_qwen3_moe import tiny_qwen3_config
from test_tiers_policies import random_store

from moetier.engine.elastic import ElasticConfig, ElasticExpertBudget, KvSizer, kv_token_cap
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.server.metrics import ServerMetrics
from moetier.tiers.expert_cache import ExpertCache
from moetier.tiers.plan import PlanBudget, TierOptions, make_plan
from moetier.tiers.policies import LRUPolicy

CONTEXT, STREAMS, SLOTS = 64, 3, 10
PROMPT_LEN = 16
# The first request's KV is a full window; the others end earlier, so the cache grows back in steps.
NEW_TOKENS = (CONTEXT - PROMPT_LEN, CONTEXT - PROMPT_LEN - 8, CONTEXT - PROMPT_LEN - 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-elastic")
    save_tiny(tiny_qwen3_config(), path)
    return path


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, 320, (PROMPT_LEN,), generator=generator).tolist() for _ in range(STREAMS)]


def _config() -> EngineConfig:
    return EngineConfig(max_streams=STREAMS, max_model_len=CONTEXT)


def gpu_budget(checkpoint, slots: int, reserve: int) -> int:
    """A GPU budget whose plan holds exactly ``slots`` cached experts with KV reserved for ``reserve`` streams."""
    from moetier.engine.spare_caches import borrowed_prefix_snapshots
    from moetier.engine.types import checkpoint_config

    config = _config()  # its prefix cache as the engine reserves it (borrowed snapshots' worth for V4)
    snapshots = borrowed_prefix_snapshots(checkpoint_config(checkpoint), config, torch.device("cpu"))
    budget = PlanBudget("3GiB", context=CONTEXT, max_streams=STREAMS, kv_reserve_streams=reserve,
                        prefix_cache=config.prefix_cache_bytes, prefix_snapshots=snapshots)  # fmt: skip
    roomy = make_plan(checkpoint, budget, torch.float32)
    fixed = roomy.backbone_bytes + roomy.kv_bytes + roomy.workspace_bytes + roomy.staging_bytes
    fixed += roomy.prefix_cache_bytes
    return fixed + slots * roomy.expert_block_bytes


def _engine(checkpoint, **tiers) -> Engine:
    options = TierOptions(**tiers, policy="lfu", miss_route="cpu", cpu_threads=1) if tiers else None
    return Engine.from_path(
        checkpoint,
        config=_config(),
        dtype=torch.float32,
        device="cpu",
        tokenizer=None,
        load_progress=False,
        tiers=options,
    )


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list]:
    """Generate every prompt concurrently; returns the tokens per request and the stats after each step."""
    for i, (prompt, new) in enumerate(zip(prompts, NEW_TOKENS, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    history = []
    while engine.has_work():
        for update in engine.step():
            assert update.error is None, update.error
            tokens[update.request_id] += update.new_token_ids
        history.append(engine.stats())
    return tokens, history


@pytest.fixture(scope="module")
def resident_tokens(checkpoint, prompts):
    tokens, _ = _run(_engine(checkpoint), prompts)
    assert [len(t) for t in tokens.values()] == list(NEW_TOKENS)
    return tokens


def test_cache_shrinks_for_extra_streams_and_grows_back(checkpoint, prompts, resident_tokens):
    engine = _engine(checkpoint, gpu_memory=gpu_budget(checkpoint, SLOTS, reserve=1), kv_reserve_streams=1)
    plan, cache = engine.plan, engine.model.dispatcher.cache
    assert plan.cache_slots == SLOTS and cache.n_slots == SLOTS and plan.budget.reserved_streams == 1
    assert "1 of 3 streams reserved" in plan.table()
    block, token_bytes = plan.expert_block_bytes, engine.elastic.sizer.token_bytes
    # The plan's KV estimate and the runner's real caches agree (Qwen3: keys + values, no per-stream state).
    assert plan.kv_bytes == CONTEXT * token_bytes and engine.elastic.sizer.stream_bytes == 0

    tokens, history = _run(engine, prompts)

    assert tokens == resident_tokens  # offload and resizing never change the math
    full = max(history, key=lambda s: s.running)
    kv_tokens = STREAMS * PROMPT_LEN + sum(NEW_TOKENS)
    assert full.running == STREAMS and full.kv_cache_bytes == kv_tokens * token_bytes
    expected = SLOTS - math.ceil((full.kv_cache_bytes - plan.kv_bytes) / block)  # whole slots for the excess
    assert plan.top_k < expected < SLOTS
    assert full.expert_cache_slots == expected and full.expert_cache_bytes == expected * block
    assert min(s.expert_cache_slots for s in history) == expected
    for stats in history:  # at every step: the ceiling minus the slots the KV beyond the reservation needs
        assert stats.expert_cache_slots == SLOTS - math.ceil(max(0, stats.kv_cache_bytes - plan.kv_bytes) / block)
    assert len({s.expert_cache_slots for s in history}) == 3  # 5 slots, 7 after the first finish, then 10
    end = engine.stats()
    assert end.running == 0 and end.kv_cache_bytes == 0
    assert end.expert_cache_slots == cache.n_slots == SLOTS
    assert len(cache.resident()) > expected  # the grown slots were warmed with the policy's preferred experts
    assert end.expert_cache_resizes == engine.elastic.shrinks + engine.elastic.grows >= 2
    assert engine.elastic.overcommits == 0

    # Again from the prefix cache: the adopted copies are KV too and make their room first.
    _, history = _run(engine, [prompt + prompt[:4] for prompt in prompts])  # the first 16 tokens hit
    assert engine.stats().prefix_cache_hits == STREAMS * PROMPT_LEN
    assert min(s.expert_cache_slots for s in history) < SLOTS
    for stats in history:
        assert stats.expert_cache_slots == SLOTS - math.ceil(max(0, stats.kv_cache_bytes - plan.kv_bytes) / block)
    assert engine.stats().kv_cache_bytes == 0 and engine.stats().expert_cache_slots == SLOTS

    metrics = ServerMetrics(engine.stats, lambda: "tiny").render().decode()
    assert 'moetier:tier_expert_cache_slots{model_name="tiny"} 10.0' in metrics
    assert f'moetier:tier_expert_cache_resizes_total{{model_name="tiny"}} {engine.elastic.resizes}.0' in metrics
    assert 'moetier:tier_expert_cache_max_slots{model_name="tiny"} 10.0' in metrics


def test_floor_makes_admission_wait_instead_of_shrinking_past_it(checkpoint, prompts, resident_tokens):
    floor = 6  # room for one borrowed stream (3 slots of 10) but not two (6 slots)
    gpu = gpu_budget(checkpoint, SLOTS, reserve=1)
    engine = _engine(checkpoint, gpu_memory=gpu, kv_reserve_streams=1, min_cache_slots=floor)
    # The KV-token budget is what refuses: the reservation plus 4 borrowable slots is 2.5 windows of KV.
    limit = engine.plan.kv_bytes + (SLOTS - floor) * engine.plan.expert_block_bytes
    assert engine.stats().kv_tokens_capacity == int(limit // engine.elastic.sizer.token_bytes) < STREAMS * CONTEXT

    tokens, history = _run(engine, prompts)

    assert tokens == resident_tokens
    assert max(s.running for s in history) == 2
    assert any(s.waiting for s in history)  # the third request waited for the first ones' KV
    assert min(s.expert_cache_slots for s in history) >= floor and engine.elastic.min_slots_seen >= floor
    assert min(s.expert_cache_slots for s in history) < SLOTS
    assert engine.stats().expert_cache_slots == SLOTS and engine.elastic.overcommits == 0


def test_default_plan_reserves_every_stream_and_never_resizes(checkpoint, prompts, resident_tokens):
    engine = _engine(checkpoint, gpu_memory=gpu_budget(checkpoint, 4, reserve=STREAMS))
    assert engine.plan.budget.reserved_streams == STREAMS and engine.stats().kv_tokens_capacity == STREAMS * CONTEXT
    tokens, history = _run(engine, prompts)
    assert tokens == resident_tokens
    assert {s.expert_cache_slots for s in history} == {4} and engine.elastic.resizes == 0
    resident = _engine(checkpoint)
    assert resident.elastic is None and resident.stats().expert_cache_slots is None


def test_deepseek_v4_cache_counts_its_per_stream_state(tmp_path, prompts):
    """V4 caches hold a window and open compressor windows per stream that fill up during forwards: the
    budget counts the plan's per-stream state from the start, so the shrink follows the plan's numbers."""
    v4 = pytest.importorskip("test_deepseek_v4")
    v4.save_tiny_v4(tmp_path, torch.float32)
    prompts = [[t % v4.VOCAB for t in prompt] for prompt in prompts]
    resident, _ = _run(_engine(tmp_path), prompts)
    engine = _engine(tmp_path, gpu_memory=gpu_budget(tmp_path, SLOTS, reserve=1), kv_reserve_streams=1)
    plan, sizer = engine.plan, engine.elastic.sizer
    assert plan.kv_stream_bytes > 0 and sizer.bytes_for(CONTEXT) == plan.kv_bytes  # one reserved stream
    tokens, history = _run(engine, prompts)
    assert tokens == resident
    block = plan.expert_block_bytes
    for stats in history:
        assert stats.expert_cache_slots == SLOTS - math.ceil(max(0, stats.kv_cache_bytes - plan.kv_bytes) / block)
    assert min(s.expert_cache_slots for s in history) < SLOTS
    # The finished sequences' caches wait for the next ones, holding their memory: beyond the one stream's
    # reservation that memory is the experts', so those spares wait spare_cache_seconds, then the experts take it
    # back; what fits the reservation serves nothing else and stays.
    spares = engine.runner.spares
    assert len(spares) > 1 and engine.elastic.borrowing and engine.stats().expert_cache_slots < SLOTS
    assert 0 < engine.expire_spares() <= 30
    spares.clock = lambda: float("inf")
    assert engine.expire_spares() is None and len(spares) == 1 and not engine.elastic.borrowing
    assert 0 < engine.elastic.kv_bytes <= plan.kv_bytes
    assert engine.stats().expert_cache_slots == SLOTS and engine.elastic.overcommits == 0


def test_budget_keeps_protected_experts_and_respects_the_floor():
    store = random_store()
    cache = ExpertCache(store, "cpu", n_slots=4, policy=LRUPolicy(), n_staging=1)
    for key in [(0, 0), (0, 1), (2, 2), (2, 3)]:
        cache.fill(cache.plan_admission(key, set()), store.expert(*key).block)
    in_use = {(0, 1), (2, 3)}  # the experts a running call reads
    config = ElasticConfig(reserved_kv_bytes=1000, block_bytes=cache.block_bytes, max_slots=4, min_slots=1)
    budget = ElasticExpertBudget(config, lambda n: cache.resize(n, protected=in_use))
    budget.allocated("a", 1000 + 3 * cache.block_bytes)  # wants the floor, 1 slot
    assert budget.rebalance() == 2  # the resize stops at the protected experts and says so
    assert set(cache.resident()) == in_use
    for key in in_use:
        assert torch.equal(cache.get(key).tensor, store.expert(*key).block)
    in_use.clear()
    assert budget.rebalance() == 1 == cache.n_slots  # the floor, once nothing is protected
    budget.allocated("b", 5 * cache.block_bytes)  # beyond what the floor can free: counted, never below it
    assert budget.rebalance() == 1 and budget.overcommits == 1
    budget.freed("a")
    budget.freed("b")
    assert budget.rebalance() == 4 == cache.n_slots and budget.kv_bytes == 0
    assert (budget.shrinks, budget.grows, budget.resizes) == (2, 1, 3)


def test_failed_growth_keeps_serving_at_the_size_reached():
    size = [2]

    def resize(n: int) -> int:
        if n > size[0]:
            size[0] += 1  # one slot lands, then the device runs out of memory
            raise torch.OutOfMemoryError("out of memory")
        size[0] = n
        return n

    config = ElasticConfig(reserved_kv_bytes=0, block_bytes=10, max_slots=4, min_slots=1)
    budget = ElasticExpertBudget(config, resize, slots=2, current=lambda: size[0])
    assert budget.rebalance() == 3 == size[0] and budget.grows == 1
    with pytest.raises(torch.OutOfMemoryError):  # a failed shrink is not swallowed: the KV would not fit
        ElasticExpertBudget(config, lambda n: resize(9), slots=4).rebalance(pending_bytes=25)


def test_config_validation_and_token_cap():
    with pytest.raises(ConfigError, match="min_cache_slots 5 exceeds"):
        ElasticConfig(0, 10, max_slots=4, min_slots=5)
    with pytest.raises(ConfigError, match="block_bytes"):
        ElasticConfig(0, 0, max_slots=4, min_slots=1)
    with pytest.raises(ConfigError, match="kv-reserve-streams"):
        TierOptions(gpu_memory="1GiB", kv_reserve_streams=0)
    with pytest.raises(ConfigError, match="min_cache_slots"):
        TierOptions(gpu_memory="1GiB", min_cache_slots=-1)
    config = ElasticConfig(reserved_kv_bytes=6400, block_bytes=1000, max_slots=8, min_slots=2)
    assert [config.slots_for(b) for b in (0, 6400, 6401, 7400, 7401, 10**6)] == [8, 8, 7, 7, 6, 2]
    sizer = KvSizer(token_bytes=100.0, stream_bytes=50)
    assert sizer.bytes_for(10) == 1050
    assert kv_token_cap(config, sizer, max_streams=3) == (6400 + 6000 - 150) // 100
    assert kv_token_cap(config, KvSizer(0.0, 4096), max_streams=3) is None


def test_a_request_that_takes_a_spare_cache_resizes_nothing(tmp_path):
    """V4 (finished caches kept as spares): a request that will start in a spare needs no new KV memory, so the
    expert cache is not shrunk for it (and grown back once it took the spare)."""
    v4 = pytest.importorskip("test_deepseek_v4")
    v4.save_tiny_v4(tmp_path, torch.float32)
    engine = _engine(tmp_path, gpu_memory=gpu_budget(tmp_path, SLOTS, reserve=1), kv_reserve_streams=1)
    generator = torch.Generator().manual_seed(12)
    for i in range(3):
        prompt = torch.randint(0, v4.VOCAB, (PROMPT_LEN,), generator=generator).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        while engine.has_work():
            engine.step()
        if i == 0:
            resizes = engine.elastic.resizes
    assert engine.runner.spares.taken == 2 and len(engine.runner.spares) == 1
    assert engine.elastic.resizes == resizes and engine.elastic.overcommits == 0
