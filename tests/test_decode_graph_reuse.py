"""V4's decode graphs across a served sequence's life: how often its cache moves (and its graphs are captured again).

A layer's decode graph reads its sequences' contiguous caches in place, so it is keyed by them
(:mod:`moetier.models.deepseek_v4_step`); under optimistic KV admission a cache that outgrows its reservation
moves into a larger one, and every layer's graph is captured again. V4's contiguous caches double their
reservation (``contiguous_cache_growth``): the scheduler's rule is checked alone, then a served request on the
tiny V4 through fake graphs (:class:`FakeGraphs`, test_v4_graph_segments) captures fewer graphs than the 1/8
rule would, with the same tokens.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_engine import make_engine, random_prompt, run, tokens_of
from test_v4_graph_segments import FakeGraphs

from moetier.engine.sampling import SamplingParams
from moetier.engine.scheduler import Scheduler, Sequence, SequenceState

GREEDY = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


def decoding(prompt: int, new: int) -> Sequence:
    return Sequence("r", list(range(prompt)), GREEDY, max_new_tokens=new)


def reservations(scheduler: Scheduler, seq: Sequence, tokens: int) -> list[int]:
    """``seq`` admitted, then one generated token a step up to ``tokens``: its reservation after each growth."""
    scheduler.add(seq)
    scheduler.schedule()
    seen = [seq.kv_reserved]
    while seq.num_tokens < tokens:
        seq.num_computed = seq.num_tokens  # the step computed the pending token and sampled the next
        seq.output_ids.append(0)
        scheduler.schedule()
        if seq.kv_reserved != seen[-1]:
            seen.append(seq.kv_reserved)
    return seen


def test_the_default_grows_by_an_eighth_and_powers_of_two_double():
    eighth = reservations(Scheduler(1, 4096, 100_000, "optimistic", headroom=16), decoding(100, 2000), 1200)
    assert eighth[:4] == [116, 132, 148, 166]  # the headroom (16) until an eighth of the reservation is more
    assert all(b - a == max(16, a // 8) for a, b in zip(eighth, eighth[1:], strict=False))
    doubling = reservations(Scheduler(1, 4096, 100_000, "optimistic", 16, True), decoding(100, 2000), 1200)
    assert doubling == [128, 256, 512, 1024, 2048]
    assert len(eighth) > 3 * len(doubling)
    assert reservations(Scheduler(1, 4096, 100_000, "optimistic", 16, True), decoding(100, 900), 1000)[-1] == 1000


def test_powers_of_two_fall_back_to_an_eighth_when_doubling_would_take_half_the_free_budget():
    # Budget 1000: at 512 reserved, doubling would take 512 of the 488 free; an eighth (64) is granted instead.
    seen = reservations(Scheduler(1, 4096, 1000, "optimistic", 16, True), decoding(100, 800), 600)
    assert seen[:4] == [128, 256, 512, 576]
    assert all(s <= 1000 for s in seen)


def test_a_power_of_two_that_does_not_fit_admits_the_exact_reservation():
    scheduler = Scheduler(2, 4096, 250, "optimistic", 16, True)  # a stream's share: 125 tokens
    first, second = decoding(140, 50), Sequence("s", list(range(60)), GREEDY, max_new_tokens=50)
    scheduler.add(first)
    scheduler.schedule()
    scheduler.add(second)
    scheduler.schedule()
    # The first needs more than a share (156: no rounding); the second's power of two (128, capped at the share:
    # 125) does not fit the 94 left, its exact reservation (76) does.
    assert (first.kv_reserved, second.kv_reserved) == (156, 76)
    lone = Scheduler(2, 4096, 1000, "optimistic", 16, True)
    lone.add(short := decoding(20, 10))
    lone.schedule()
    assert short.kv_reserved == 64 > short.kv_tokens  # past its own life: room for a longer next turn


def test_a_doubled_grant_is_released_whole():
    scheduler = Scheduler(1, 4096, 10_000, "optimistic", 16, True)
    seq = decoding(100, 500)
    reservations(scheduler, seq, 300)
    assert scheduler.kv_tokens_used == seq.kv_reserved == 512
    scheduler.finish(seq)
    assert scheduler.kv_tokens_used == 0 and seq.state is SequenceState.FINISHED


# --- served on the tiny V4 -------------------------------------------------------------------------------


@torch.no_grad()
def served(loaded, power_of_two: bool, monkeypatch) -> tuple[list[int], FakeGraphs, int]:
    """One 100-token greedy request (20-token prompt, 8 tokens of headroom) through fake graphs: its tokens, the
    graphs, and how many times its cache moved."""
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(loaded.model, "graphs", graphs)
    engine = make_engine(loaded, tokenizer=None, kv_headroom_tokens=8, max_model_len=256)
    engine.scheduler.power_of_two = power_of_two
    moves = []
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    request = ("r", random_prompt(20, seed=3, vocab=256), params)
    original = engine.runner._store

    def counted_store(request_id, cache, capacity):
        moves.append(capacity)
        return original(request_id, cache, capacity)

    monkeypatch.setattr(engine.runner, "_store", counted_store)
    tokens = tokens_of(run(engine, [request])["r"])
    return tokens, graphs, len(moves) - 1


def test_v4_contiguous_caches_double_and_capture_less(families, monkeypatch):
    loaded, _ = families("deepseek_v4")
    engine = make_engine(loaded, tokenizer=None)
    assert engine.kv_layout == "contiguous" and engine.scheduler.power_of_two
    doubled, graphs, moves = served(loaded, True, monkeypatch)
    eighth, eighth_graphs, eighth_moves = served(loaded, False, monkeypatch)
    assert doubled == eighth and len(doubled) == 100
    assert graphs.failures == eighth_graphs.failures == {}
    print(f"moves {moves} vs {eighth_moves}, captures {graphs.captures} vs {eighth_graphs.captures}")
    assert moves == 2 and eighth_moves == 10  # 32 -> 64 -> 120 (its whole life) against 28, +8 ..., then +1/8
    assert graphs.captures < eighth_graphs.captures


def test_other_families_keep_the_eighth(families):
    loaded, _ = families("qwen3_moe")
    engine = make_engine(loaded, tokenizer=None)
    assert not engine.scheduler.power_of_two and engine.runner.spares is None


# --- caches reused in place ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from test_v4_decode_ops import tiny_model

    return tiny_model(tmp_path_factory.mktemp("dsv4_reuse"))


@torch.no_grad()
def logits_of(model, cache, prompt: int, steps: int, seed: int) -> list[torch.Tensor]:
    """A ``prompt``-token prefill into ``cache``, then ``steps`` single-token decodes: every forward's logits."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.embed.num_embeddings
    out = [model.compute_logits(model(torch.randint(0, vocab, (prompt,), generator=generator), cache))]
    for _ in range(steps):
        out.append(model.compute_logits(model(torch.randint(0, vocab, (1,), generator=generator), cache)))
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_a_reset_cache_decodes_as_a_new_one(v4, kv_dtype):
    used = v4.new_cache(96, kv_dtype)
    logits_of(v4, used, prompt=37, steps=30, seed=1)  # windows wrapped, entries written, predecessors set
    serial = used.serial
    assert used.reset() and used.serial == serial and used.length == 0
    fresh = logits_of(v4, v4.new_cache(96, kv_dtype), prompt=9, steps=40, seed=2)
    again = logits_of(v4, used, prompt=9, steps=40, seed=2)
    assert same(again, fresh)
    assert not torch.equal(fresh[0], fresh[-1])


def test_a_prefix_copied_into_a_used_cache_decodes_as_its_clone(v4):
    source = v4.new_cache(64)
    logits_of(v4, source, prompt=29, steps=3, seed=3)
    target = v4.new_cache(128)
    logits_of(v4, target, prompt=50, steps=20, seed=4)  # junk beyond what the copy writes
    clone = source.clone_into(128)
    assert source.copy_into(target) and target.length == source.length == 32
    assert same(logits_of(v4, target, prompt=3, steps=30, seed=5), logits_of(v4, clone, prompt=3, steps=30, seed=5))
    with pytest.raises(ValueError, match="cannot copy"):
        target.copy_into(v4.new_cache(16))


def test_paged_caches_are_not_reused(v4):
    from moetier.models.paged_kv import PagedKVSpace, paged_kv

    with paged_kv(PagedKVSpace("cpu", block_tokens=16)):
        paged = v4.new_cache(64)
    assert not paged.reset() and not paged.copy_into(v4.new_cache(64)) and not v4.new_cache(64).copy_into(paged)


@torch.no_grad()
def test_a_batch_in_another_order_replays_its_graphs_and_keeps_its_rows(v4, monkeypatch):
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(v4, "graphs", graphs)
    ours, reference = [v4.new_cache(64) for _ in range(2)], []
    for i, cache in enumerate(ours):
        logits_of(v4, cache, prompt=11 + 6 * i, steps=0, seed=6 + i)
        reference.append(cache.clone_into(64))
    generator = torch.Generator().manual_seed(8)
    for step, order in enumerate([(0, 1), (1, 0), (1, 0), (0, 1)]):
        tokens = torch.randint(0, 256, (2,), generator=generator)
        graphed = v4(tokens[list(order)], [ours[b] for b in order], [1, 1])
        monkeypatch.setattr(v4, "graphs", FakeGraphs(warmup=1))  # the reference: eager, in the batch's order
        monkeypatch.setattr(v4, "segmented_decode", False)
        eager = v4(tokens[list(order)], [reference[b] for b in order], [1, 1])
        monkeypatch.setattr(v4, "segmented_decode", True)
        monkeypatch.setattr(v4, "graphs", graphs)
        assert torch.equal(v4.compute_logits(graphed), v4.compute_logits(eager)), step
    per_step = len(v4.layers) + 2
    assert graphs.warm_ups == graphs.captures == per_step and graphs.replays == 3 * per_step  # one key throughout


# --- served: a finished sequence's cache serves the next one ---------------------------------------------


def fake_graphed_engine(loaded, monkeypatch, **config):
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(loaded.model, "graphs", graphs)
    return make_engine(loaded, tokenizer=None, max_model_len=256, **config), graphs


def greedy_request(request_id: str, prompt: list[int], tokens: int = 24):
    return request_id, prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def test_a_finished_requests_cache_and_graphs_serve_the_next(families, monkeypatch):
    loaded, vocab = families("deepseek_v4")
    first, second = random_prompt(18, seed=11, vocab=vocab), random_prompt(18, seed=12, vocab=vocab)
    plain, _ = fake_graphed_engine(loaded, monkeypatch, spare_cache_seconds=0, enable_prefix_caching=False)
    assert plain.runner.spares is None
    expected = [tokens_of(run(plain, [greedy_request(r, p)])[r]) for r, p in (("a", first), ("b", second))]

    engine, graphs = fake_graphed_engine(loaded, monkeypatch, enable_prefix_caching=False)
    assert tokens_of(run(engine, [greedy_request("a", first)])["a"]) == expected[0]
    captured, spares = graphs.captures, engine.runner.spares
    assert len(spares) == 1 and spares.taken == 0
    assert tokens_of(run(engine, [greedy_request("b", second)])["b"]) == expected[1]
    assert spares.taken == 1 and len(spares) == 1  # the same cache, back again
    assert graphs.captures == captured and graphs.failures == {}  # its graphs replayed: nothing captured


def test_a_cached_prefix_is_copied_into_a_spare(families, monkeypatch):
    loaded, vocab = families("deepseek_v4")
    prompt = random_prompt(40, seed=13, vocab=vocab)
    turns = [greedy_request("turn-1", prompt), greedy_request("turn-2", prompt + random_prompt(9, 14, vocab))]
    plain, _ = fake_graphed_engine(loaded, monkeypatch, spare_cache_seconds=0)
    expected = [tokens_of(run(plain, [turn])[turn[0]]) for turn in turns]
    engine, graphs = fake_graphed_engine(loaded, monkeypatch)
    assert [tokens_of(run(engine, [turn])[turn[0]]) for turn in turns] == expected
    assert engine.prefix_cache.hits >= 1 and engine.runner.spares.taken == 1
    assert graphs.failures == {}


def test_spares_stay_within_the_streams_and_the_budget(families, monkeypatch):
    loaded, vocab = families("deepseek_v4")
    engine, _ = fake_graphed_engine(loaded, monkeypatch, max_streams=2, kv_token_budget=160)
    spares = engine.runner.spares
    requests = [greedy_request(f"r{i}", random_prompt(10 + 7 * i, 20 + i, vocab), 8 + 9 * i) for i in range(5)]
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_work():
        engine.step()
        live = [engine.runner.capacity_of(s.request_id) for s in engine.scheduler.running]
        assert len(live) + len(spares) <= 2 and sum(live) + spares.tokens <= 160
    assert spares.taken >= 1 and len(spares) >= 1
    clock = [time.monotonic() + 1e6]
    spares.clock = lambda: clock[0]
    held = len(spares)
    assert engine.expire_spares() is None and len(spares) == held  # all experts resident: their memory serves nothing
    spares.reclaimable = lambda: True  # as where an expert cache lends them its memory
    clock[0] = time.monotonic()
    assert 0 < engine.expire_spares() <= 30  # waiting: dropped 30 s after they became spares
    clock[0] += 30
    assert engine.expire_spares() is None and not len(spares)


def test_the_async_engine_drops_spares_while_idle(families):
    """No request comes: the engine thread wakes when the spare has waited ``spare_cache_seconds`` and drops it
    (where the expert cache lends it its memory: stood in for here, test_elastic_cache has the real one)."""
    import asyncio

    from moetier.engine.async_engine import AsyncEngine

    loaded, vocab = families("deepseek_v4")
    engine = make_engine(loaded, tokenizer=None, max_model_len=256, spare_cache_seconds=0.3)
    engine.runner.spares.reclaimable = lambda: True

    async def main():
        server = AsyncEngine(engine)
        try:
            request_id, prompt, params = greedy_request("a", random_prompt(12, 30, vocab), 4)
            updates = [u async for u in server.generate(request_id, prompt, params)]
            assert updates[-1].finished
            seen, deadline = [], time.monotonic() + 10
            while len(engine.runner.spares) and time.monotonic() < deadline:
                seen.append(len(engine.runner.spares))
                await asyncio.sleep(0.05)
            return seen
        finally:
            await server.shutdown()

    seen = asyncio.run(main())
    assert seen and seen[0] == 1  # it waited as a spare first
    assert not len(engine.runner.spares) and engine.runner.spares.dropped == 1


def test_spares_serve_the_largest_wants_first_from_the_smallest_room():
    from moetier.engine.spare_caches import SpareCaches

    spares = SpareCaches(limit=4, token_budget=10_000, keep_seconds=30.0)
    for capacity in (64, 256, 128):
        spares.put(object(), capacity, live=[])
    assert spares.unserved([100, 60, 300, 200]) == [300]
    assert spares.unserved([200, 200]) == [200] and spares.unserved([]) == []
    assert spares.take(100)[1] == 128 and spares.take(300) is None and spares.tokens == 64 + 256
    spares.put(object(), 512, live=[4096, 4096, 1000])  # 3 live + 3 spares > 4, and over the token budget
    assert len(spares) == 1 and spares.tokens == 512 and spares.dropped == 2
    with pytest.raises(ValueError, match="positive"):
        SpareCaches(limit=0, token_budget=10, keep_seconds=1.0)


# --- CUDA (run on the GPU machine) -----------------------------------------------------------------------


def tiered_options(path, dtype: torch.dtype, config, slots: int = 4):
    """Tier options whose plan for an engine of ``config`` caches ``slots`` experts (most routed experts miss),
    everything else as planned (its prefix cache too: borrowed snapshots' worth where spare caches are kept)."""
    from moetier.engine.spare_caches import borrowed_prefix_snapshots
    from moetier.engine.types import checkpoint_config
    from moetier.tiers.plan import PlanBudget, TierOptions, make_plan

    snapshots = borrowed_prefix_snapshots(checkpoint_config(path), config, torch.device("cpu"))
    budget = PlanBudget("3GiB", context=config.max_model_len, max_streams=config.max_streams,
                        prefix_cache=config.prefix_cache_bytes, prefix_snapshots=snapshots)  # fmt: skip
    roomy = make_plan(path, budget, dtype)
    fixed = roomy.backbone_bytes + roomy.kv_bytes + roomy.workspace_bytes + roomy.staging_bytes
    # Misses on the CPU tier: the timed route chooser could pick another route (other bf16 roundings) per engine.
    # The cache never shrinks: a kept spare cache's KV would borrow a slot (4 -> 3 slots measured), and another
    # hit/miss split is other bf16 roundings (a token of the pair differed on an H100 without this floor).
    return TierOptions(gpu_memory=fixed + roomy.prefix_cache_bytes + slots * roomy.expert_block_bytes, policy="lfu",
                       cpu_threads=2, miss_route="cpu", min_cache_slots=slots)  # fmt: skip


def served_turns(path, dtype: torch.dtype, device: str, spare_seconds: float, tiered: bool, graphs=None):
    """Four agent-like turns (each the last prompt + its output + 7 tokens), then two concurrent requests: every
    request's tokens and the engine's stats."""
    from moetier.engine.engine import Engine, EngineConfig

    config = EngineConfig(max_model_len=256, max_streams=2, spare_cache_seconds=spare_seconds)
    tiers = tiered_options(path, dtype, config) if tiered else None
    engine = Engine.from_path(path, config=config, dtype=dtype, device=device, tokenizer=None, load_progress=False,
                              tiers=tiers)  # fmt: skip
    if graphs is not None:
        engine.model.graphs = graphs
    outputs, prompt = [], random_prompt(30, seed=40, vocab=256)
    for turn in range(4):
        (tokens,) = [tokens_of(u) for u in run(engine, [greedy_request(f"t{turn}", prompt, 20)]).values()]
        outputs.append(tokens)
        prompt = prompt + tokens + random_prompt(7, seed=41 + turn, vocab=256)
    pair = [greedy_request(f"p{i}", random_prompt(25 + 9 * i, seed=50 + i, vocab=256), 16 + 8 * i) for i in (0, 1)]
    outputs += [tokens_of(u) for u in run(engine, pair).values()]
    return outputs, engine.stats()


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    from test_deepseek_v4 import save_tiny_v4

    path = tmp_path_factory.mktemp("dsv4_served_turns")
    save_tiny_v4(path, torch.float32)
    return path


@pytest.mark.parametrize("tiered", [False, True], ids=["resident", "tiered"])
def test_served_turns_with_spares_equal_those_without(v4_path, tiered):
    """Fake graphs on the CPU (each replay reruns the segment); the tiered engine's experts mostly miss."""
    reused, stats = served_turns(v4_path, torch.float32, "cpu", 30.0, tiered, FakeGraphs())
    fresh, fresh_stats = served_turns(v4_path, torch.float32, "cpu", 0.0, tiered, FakeGraphs())
    assert reused == fresh and stats.spare_cache_reuses_total == 4 and fresh_stats.spare_caches is None
    assert 0 < stats.decode_graph_captures_total < fresh_stats.decode_graph_captures_total
    if tiered:  # 4 cached of 5 layers x 8 experts
        assert stats.expert_cache_slots == stats.expert_cache_max_slots == 4


def test_the_plan_reserves_borrowed_snapshots_not_the_prefix_bound(v4_path):
    """With spare caches, V4's prefix snapshots borrow the kept caches' entries: the plan reserves VRAM for
    SNAPSHOTS_PER_STREAM rolling states a stream (the rest of the 1 GiB bound goes to the expert cache), the prefix
    cache is bounded by that reservation, and served turns still start from their snapshots."""
    from dataclasses import replace

    from moetier.engine.engine import Engine, EngineConfig
    from moetier.engine.spare_caches import SNAPSHOTS_PER_STREAM
    from moetier.tiers.plan import make_plan

    def engine_for(spare_seconds: float) -> Engine:
        config = EngineConfig(max_model_len=256, max_streams=2, spare_cache_seconds=spare_seconds)
        return Engine.from_path(v4_path, config=config, dtype=torch.float32, device="cpu", tokenizer=None,
                                load_progress=False, tiers=tiered_options(v4_path, torch.float32, config))  # fmt: skip

    owning, borrowing = engine_for(0.0), engine_for(30.0)
    bound = EngineConfig().prefix_cache_bytes
    assert owning.plan.prefix_cache_bytes == owning.config.prefix_cache_bytes == bound
    plan = borrowing.plan
    reserved = SNAPSHOTS_PER_STREAM * 2 * plan.kv_stream_bytes
    assert plan.prefix_cache_bytes == borrowing.config.prefix_cache_bytes == reserved < bound
    assert "16 snapshots borrowing their caches' entries" in plan.table()
    small = replace(plan.budget, prefix_cache=3 * plan.kv_stream_bytes)  # a bound below 16 snapshots: the bound
    assert make_plan(v4_path, small, torch.float32).prefix_cache_bytes == 3 * plan.kv_stream_bytes
    prompt = random_prompt(40, seed=60, vocab=256)
    for turn in range(3):
        (tokens,) = [tokens_of(u) for u in run(borrowing, [greedy_request(f"t{turn}", prompt, 12)]).values()]
        prompt = prompt + tokens + random_prompt(5, seed=61 + turn, vocab=256)
    stats = borrowing.stats()
    assert stats.prefix_cache_lookup_hits == 2 and stats.spare_cache_reuses_total == 2
    # Each borrowed snapshot holds one stream's rolling state at most: the reservation's unit is not an underestimate.
    assert 0 < stats.prefix_cache_bytes <= stats.prefix_cache_entries * plan.kv_stream_bytes


# --- CUDA (run on the GPU machine) -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tiered", [False, True], ids=["resident", "tiered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_served_turns_reuse_caches_and_graphs(v4_path, dtype, tiered):
    """Real CUDA graphs: agent-like turns and a pair of concurrent requests served with finished caches reused give
    the tokens of an engine that never reuses them, and capture fewer graphs."""
    reused, stats = served_turns(v4_path, dtype, "cuda", 30.0, tiered)
    fresh, fresh_stats = served_turns(v4_path, dtype, "cuda", 0.0, tiered)
    captures, fresh_captures = stats.decode_graph_captures_total, fresh_stats.decode_graph_captures_total
    print(f"\n{dtype} tiered={tiered}: captures {captures} with spare caches, {fresh_captures} without")
    assert reused == fresh and stats.spare_cache_reuses_total == 4
    assert 0 < captures < fresh_captures


# --- prefix snapshots that borrow the cache's entries ----------------------------------------------------


def decode_logits(model, cache, steps: int, seed: int) -> list[torch.Tensor]:
    return logits_of(model, cache, prompt=1, steps=steps - 1, seed=seed)


def test_a_borrowed_snapshot_serves_as_an_owned_one_while_its_lender_keeps_the_state(v4):
    import gc

    lender = v4.new_cache(128)
    logits_of(v4, lender, prompt=40, steps=0, seed=21)
    borrowed, owned = lender.borrowed_snapshot(40), lender.snapshot(40)
    entries = sum(state.entries.nbytes for layer in owned.layers for state in layer.states())
    assert borrowed.servable and borrowed.length == owned.length == 40 and borrowed.nbytes == owned.nbytes - entries
    logits_of(v4, lender, prompt=3, steps=5, seed=22)  # the lender goes on: its first entries stay
    assert borrowed.servable and lender.borrowers and list(lender.borrowers) == [borrowed]
    later = lender.borrowed_snapshot(lender.length)
    expected = decode_logits(v4, owned.clone_into(128), 30, seed=23)
    assert same(decode_logits(v4, borrowed.clone_into(128), 30, seed=23), expected)
    other = v4.new_cache(128)
    logits_of(v4, other, prompt=60, steps=0, seed=24)  # junk beyond what the copy writes
    assert borrowed.copy_into(other) and same(decode_logits(v4, other, 30, seed=23), expected)
    # Into the lender itself: only the rolling state; snapshots up to its length stay, the later one goes.
    assert borrowed.copy_into(lender) and lender.restarts == [40]
    assert borrowed.servable and not later.servable
    assert same(decode_logits(v4, lender, 30, seed=23), expected)
    assert borrowed.servable  # the sequence restarted at 40 wrote past it only
    lender.reset()
    assert not borrowed.servable
    with pytest.raises(ValueError, match="reused or dropped"):
        borrowed.clone_into(128)
    again = other.borrowed_snapshot(other.length)
    del other
    gc.collect()
    assert not again.servable  # its lender is gone


def test_a_borrowed_snapshot_at_a_mark(v4):
    cache = v4.new_cache(96)
    logits_of(v4, cache, prompt=32, steps=0, seed=25)
    cache.mark()
    logits_of(v4, cache, prompt=5, steps=0, seed=26)
    borrowed, owned = cache.borrowed_snapshot(32), cache.snapshot(32)
    assert same(decode_logits(v4, borrowed.clone_into(96), 20, 27), decode_logits(v4, owned.clone_into(96), 20, 27))
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.borrowed_snapshot(20)


def test_long_turns_hit_a_prefix_cache_too_small_for_an_owned_snapshot(families, monkeypatch):
    """An agent's context outgrows the prefix cache's budget for a copy; borrowed snapshots (a few rolling
    tensors) still serve every follow-up, in the finished turn's own cache, with the cold run's tokens."""
    loaded, vocab = families("deepseek_v4")
    prompt = random_prompt(180, seed=31, vocab=vocab)
    sizes = []
    for spare_seconds in (0, 30):  # what one snapshot of the first turn costs: a copy, then borrowed
        probe, _ = fake_graphed_engine(loaded, monkeypatch, spare_cache_seconds=spare_seconds)
        run(probe, [greedy_request("probe", prompt, 8)])
        sizes.append(probe.stats().prefix_cache_bytes / probe.stats().prefix_cache_entries)
    owned_bytes, borrowed_bytes = sizes
    assert borrowed_bytes < owned_bytes
    budget = {"prefix_cache_bytes": int(owned_bytes + borrowed_bytes) // 2}

    def turns(engine) -> list[list[int]]:
        outputs, text = [], list(prompt)
        for turn in range(3):
            (tokens,) = [tokens_of(u) for u in run(engine, [greedy_request(f"t{turn}", text, 8)]).values()]
            outputs.append(tokens)
            text = text + tokens + random_prompt(6, seed=32 + turn, vocab=vocab)
        return outputs

    copies, _ = fake_graphed_engine(loaded, monkeypatch, spare_cache_seconds=0, **budget)
    borrowing, _ = fake_graphed_engine(loaded, monkeypatch, **budget)
    assert turns(copies) == turns(borrowing)
    assert copies.stats().prefix_cache_lookup_hits == 0  # no copy fits the budget: every turn prefilled in full
    stats = borrowing.stats()
    assert stats.prefix_cache_lookup_hits == 2 and 0 < stats.prefix_cache_bytes <= budget["prefix_cache_bytes"]
    assert stats.spare_cache_reuses_total == 2
    # Each follow-up restarted in the finished turn's own cache at its snapshot (the last block boundary of its
    # 188 and 202 tokens), the entries before it kept.
    (cache,) = [spare.cache for spare in borrowing.runner.spares._spares]
    assert cache.restarts == [176, 192]
