"""V4's decode graphs across a served sequence's life: how often its cache moves (and its graphs are captured again).

A layer's decode graph reads its sequences' contiguous caches in place, so it is keyed by them
(:mod:`moetier.models.deepseek_v4_step`); under optimistic KV admission a cache that outgrows its reservation
moves into a larger one, and every layer's graph is captured again. V4's contiguous caches double their
reservation (``contiguous_cache_growth``): the scheduler's rule is checked alone, then a served request on the
tiny V4 through fake graphs (:class:`FakeGraphs`, test_v4_graph_segments) captures fewer graphs than the 1/8
rule would, with the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import make_engine, random_prompt, run, tokens_of
from test_v4_graph_segments import FakeGraphs

from moetier.engine.sampling import SamplingParams
from moetier.engine.scheduler import Scheduler, Sequence, SequenceState
from moetier.errors import ConfigError

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


def test_the_default_grows_by_an_eighth_and_doubling_by_the_reservation():
    eighth = reservations(Scheduler(1, 4096, 100_000, "optimistic", headroom=16), decoding(100, 2000), 1200)
    assert eighth[:4] == [116, 132, 148, 166]  # the headroom (16) until an eighth of the reservation is more
    assert all(b - a == max(16, a // 8) for a, b in zip(eighth, eighth[1:], strict=False))
    doubling = reservations(Scheduler(1, 4096, 100_000, "optimistic", 16, growth=1.0), decoding(100, 2000), 1200)
    assert doubling == [116, 232, 464, 928, 1856]
    assert len(eighth) > 3 * len(doubling)


def test_doubling_falls_back_to_an_eighth_when_it_would_take_half_the_free_budget():
    # Budget 1000: at 464 reserved, doubling would take 464 of the 536 free; an eighth (58) is granted instead.
    seen = reservations(Scheduler(1, 4096, 1000, "optimistic", 16, growth=1.0), decoding(100, 800), 600)
    assert seen[:4] == [116, 232, 464, 522]
    assert all(s <= 1000 for s in seen)


def test_growth_must_be_a_share():
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ConfigError, match="growth must be in"):
            Scheduler(1, 16, 64, "optimistic", growth=bad)


def test_a_doubled_grant_is_released_whole():
    scheduler = Scheduler(1, 4096, 10_000, "optimistic", 16, growth=1.0)
    seq = decoding(100, 500)
    reservations(scheduler, seq, 300)
    assert scheduler.kv_tokens_used == seq.kv_reserved == 464
    scheduler.finish(seq)
    assert scheduler.kv_tokens_used == 0 and seq.state is SequenceState.FINISHED


# --- served on the tiny V4 -------------------------------------------------------------------------------


@torch.no_grad()
def served(loaded, growth: float | None, monkeypatch) -> tuple[list[int], FakeGraphs, int]:
    """One 100-token greedy request (20-token prompt, 8 tokens of headroom) through fake graphs: its tokens, the
    graphs, and how many times its cache moved."""
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(loaded.model, "graphs", graphs)
    engine = make_engine(loaded, tokenizer=None, kv_headroom_tokens=8, max_model_len=256)
    if growth is not None:
        engine.scheduler.growth = growth
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
    assert engine.kv_layout == "contiguous" and engine.scheduler.growth == 1.0
    doubled, graphs, moves = served(loaded, None, monkeypatch)
    eighth, eighth_graphs, eighth_moves = served(loaded, 0.125, monkeypatch)
    assert doubled == eighth and len(doubled) == 100
    assert graphs.failures == eighth_graphs.failures == {}
    print(f"moves {moves} vs {eighth_moves}, captures {graphs.captures} vs {eighth_graphs.captures}")
    assert moves == 3 and eighth_moves == 10  # 28 -> 56 -> 112 -> 120 (its whole life) against +8, then +1/8
    assert graphs.captures < eighth_graphs.captures


def test_other_families_keep_the_eighth(families):
    loaded, _ = families("qwen3_moe")
    assert make_engine(loaded, tokenizer=None).scheduler.growth == 0.125
