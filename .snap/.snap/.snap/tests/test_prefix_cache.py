"""Exact prefix caching: a resent conversation prefills only its new turn and answers exactly as a cold engine.

The reference for every served-from-cache request is the same request on an engine with prefix caching
off (fp32 logits within 1e-5 relative, identical greedy tokens); the tokens the runner computed are
counted from the scheduler's plans.
"""

import pytest
import torch
from test_engine import Recorder, make_engine, random_prompt, run, tokens_of

from moetier.engine.engine import EngineConfig
from moetier.engine.prefix_cache import PrefixCache, chain_hashes
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.models.base import SequenceCache


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


class Traced:
    """An engine with its plans (Recorder) and every sampling row's logits recorded per request."""

    def __init__(self, loaded, **config):
        self.engine = make_engine(loaded, tokenizer=None, **config)
        self.recorder = Recorder(self.engine)
        self.logits: dict[str, list[torch.Tensor]] = {}
        execute = self.engine.runner.execute

        def recording(plan):
            out = execute(plan)
            for i, seq in enumerate(out.sampled):
                self.logits.setdefault(seq.request_id, []).append(out.logits[i].clone())
            return out

        self.engine.runner.execute = recording

    def run(self, requests) -> dict[str, list[int]]:
        return {rid: tokens_of(updates) for rid, updates in run(self.engine, requests).items()}

    def chunks(self, request_id: str) -> list[tuple[int, int]]:
        """(start, num_tokens) of every chunk computed for ``request_id``."""
        return [(start, n) for plan in self.recorder.plans for rid, start, n in plan if rid == request_id]

    def prefilled(self, request_id: str, prompt_len: int) -> int:
        return sum(min(start + n, prompt_len) - start for start, n in self.chunks(request_id) if start < prompt_len)


def assert_same_as_cold(loaded, warm: Traced, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request's tokens on a cold engine (caching off), after checking the warm logits against its."""
    cold = Traced(loaded, enable_prefix_caching=False)
    expected = cold.run([(request_id, prompt, params)])[request_id]
    assert warm.engine.stats().prefix_cache_lookups > 0  # the warm engine really cached
    assert len(set(expected)) > 1
    ours = torch.stack(warm.logits[request_id])
    ref = torch.stack(cold.logits[request_id])
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"{request_id}: relative logits error vs cold {error:.2e}")
    assert error < 1e-5, f"{request_id}: relative logits error {error:.2e}"
    assert cold.prefilled(request_id, len(prompt)) == len(prompt)
    return expected


# --- the agent use case, per family --------------------------------------------------------------------


@pytest.mark.parametrize("family,block", [("qwen3_moe", 8), ("deepseek_v3", 8), ("deepseek_v4", 6)])
def test_resent_conversation_prefills_only_the_new_turn(families, family, block):
    loaded, vocab = families(family)
    warm = Traced(loaded, prefill_chunk_tokens=16, prefix_block_tokens=block)
    turn1 = random_prompt(29, seed=1, vocab=vocab)
    out1 = warm.run([("t1", turn1, greedy(10))])["t1"]
    turn2 = turn1 + out1 + random_prompt(11, seed=2, vocab=vocab)  # the agent resends everything
    out2 = warm.run([("t2", turn2, greedy(8))])["t2"]

    cached = (29 + 10 - 1) // block * block  # prompt + output computed, down to a block boundary
    assert warm.chunks("t2")[0][0] == cached
    assert warm.prefilled("t2", len(turn2)) == len(turn2) - cached
    assert out1 == assert_same_as_cold(loaded, warm, "t1", turn1, greedy(10))
    assert out2 == assert_same_as_cold(loaded, warm, "t2", turn2, greedy(8))
    stats = warm.engine.stats()
    assert (stats.prefix_cache_lookups, stats.prefix_cache_lookup_hits) == (2, 1)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (len(turn1) + len(turn2), cached)
    assert stats.prompt_tokens_total == len(turn1) + len(turn2)  # served tokens still count as prompt tokens
    # Plain KV keeps one snapshot per conversation (the longer replaces the shorter). V4 keeps each turn's
    # prompt snapshot (24, 48: where the scheduler ended a chunk at the prompt's last block boundary) and
    # finished-turn snapshot (36, 54: marked during decoding), since each serves only its own length.
    lengths = sorted(warm.engine.prefix_cache.lengths())
    assert lengths == ([24, 36, 48, 54] if family == "deepseek_v4" else [56])
    assert stats.prefix_cache_entries == len(lengths) and stats.prefix_cache_bytes > 0
    assert warm.engine.runner.num_caches == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_a_shared_leading_part_hits_only_where_the_cache_can_be_cut(families, family):
    """Truncatable KV serves any block prefix of a longer snapshot; V4's rolling state serves only its own length."""
    loaded, vocab = families(family)
    warm = Traced(loaded, prefix_block_tokens=8)
    first = random_prompt(40, seed=3, vocab=vocab)
    warm.run([("a", first, greedy(1))])
    second = first[:21] + random_prompt(12, seed=4, vocab=vocab)  # diverges inside block 3
    out = warm.run([("b", second, greedy(6))])["b"]
    cached = 16 if family == "qwen3_moe" else 0
    assert warm.prefilled("b", len(second)) == len(second) - cached
    assert warm.engine.stats().prefix_cache_hits == cached
    assert out == assert_same_as_cold(loaded, warm, "b", second, greedy(6))


@pytest.mark.parametrize("length", [32, 33])
def test_a_fully_cached_prompt_still_computes_its_last_tokens(qwen, length):
    warm = Traced(qwen, prefix_block_tokens=8)
    prompt = random_prompt(length, seed=5)
    warm.run([("a", prompt, greedy(1))])
    out = warm.run([("b", prompt, greedy(6))])["b"]
    expected_cached = 24 if length == 32 else 32  # at least one token is left to compute
    assert warm.chunks("b")[0] == (expected_cached, length - expected_cached)
    assert out == assert_same_as_cold(qwen, warm, "b", prompt, greedy(6))


# --- concurrency, eviction, abort, switches ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_concurrent_requests_start_from_one_shared_snapshot(families, family):
    loaded, vocab = families(family)
    warm = Traced(loaded, prefix_block_tokens=8, max_streams=3, prefill_chunk_tokens=64)
    system = random_prompt(24, seed=6, vocab=vocab)
    warm.run([("sys", system, greedy(1))])
    prompts = {f"r{i}": system + random_prompt(5 + 4 * i, seed=7 + i, vocab=vocab) for i in range(3)}
    outs = warm.run([(rid, p, greedy(7)) for rid, p in prompts.items()])
    assert max(len(plan) for plan in warm.recorder.plans) == 3  # they really ran together
    for rid, prompt in prompts.items():
        assert warm.chunks(rid)[0][0] == 24
        assert outs[rid] == assert_same_as_cold(loaded, warm, rid, prompt, greedy(7))
    assert warm.engine.stats().prefix_cache_lookup_hits == 3


def entry_bytes(loaded, prompt_len: int, block: int) -> int:
    probe = make_engine(loaded, tokenizer=None, prefix_block_tokens=block)
    run(probe, [("p", random_prompt(prompt_len, seed=99), greedy(1))])
    return probe.stats().prefix_cache_bytes


def test_lru_eviction_under_a_tiny_budget_keeps_results_exact(qwen):
    size = entry_bytes(qwen, 24, 8)
    warm = Traced(qwen, prefix_block_tokens=8, prefix_cache_bytes=2 * size + size // 2)
    a, b, c = (random_prompt(24, seed=s) for s in (11, 12, 13))
    warm.run([("a", a, greedy(1)), ("b", b, greedy(1))])
    warm.run([("a2", a, greedy(1))])  # hit: A becomes the most recently used
    warm.run([("c", c, greedy(1))])  # evicts B, the least recently used
    stats = warm.engine.stats()
    assert (stats.prefix_cache_entries, stats.prefix_cache_bytes) == (2, 2 * size)
    out_a = warm.run([("a3", a, greedy(5))])["a3"]
    out_b = warm.run([("b2", b, greedy(5))])["b2"]
    assert warm.chunks("a2")[0][0] == 16 and warm.chunks("a3")[0][0] == 16
    assert warm.chunks("b2")[0] == (0, 24)  # evicted: computed in full
    # B's return evicted C, not A (used by a3 since); served prefixes: A and B, not C.
    cache = warm.engine.prefix_cache
    assert cache.evictions == 2
    assert [cache.contains(chain_hashes(p, 8)) for p in (a, b, c)] == [True, True, False]
    assert out_a == assert_same_as_cold(qwen, warm, "a3", a, greedy(5))
    assert out_b == assert_same_as_cold(qwen, warm, "b2", b, greedy(5))
    # A budget below one snapshot stores nothing and still serves requests.
    tiny = Traced(qwen, prefix_block_tokens=8, prefix_cache_bytes=size - 1)
    tiny.run([("a", a, greedy(1)), ("a2", a, greedy(1))])
    assert tiny.engine.stats().prefix_cache_entries == 0 and tiny.chunks("a2") == [(0, 24)]


def test_disabled_caching_and_prompt_logprobs_compute_every_token(qwen):
    prompt = random_prompt(30, seed=14)
    off = Traced(qwen, enable_prefix_caching=False, prefix_block_tokens=8)
    off.run([("a", prompt, greedy(2)), ("b", prompt, greedy(2))])
    off.run([("c", prompt, greedy(2))])
    assert off.engine.prefix_cache is None and off.chunks("c")[0] == (0, 30)
    assert off.engine.stats().prefix_cache_queries == 0
    on = Traced(qwen, prefix_block_tokens=8)
    on.run([("a", prompt, greedy(2))])
    on.run([("b", prompt, greedy(2, prompt_logprobs=2))])  # needs the logits of every prompt position
    assert on.chunks("b")[0] == (0, 30) and on.engine.stats().prefix_cache_lookups == 1


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_aborted_requests_leave_no_snapshot_of_their_unfinished_work(families, family):
    loaded, vocab = families(family)
    warm = Traced(loaded, prefix_block_tokens=8, prefill_chunk_tokens=8)
    engine = warm.engine
    prompt = random_prompt(20, seed=15, vocab=vocab)
    engine.add_request("early", prompt, greedy(20))
    engine.step()  # 8 of 20 prompt tokens, short of the prompt's last boundary (16)
    engine.abort("early")
    engine.step()
    assert engine.stats().prefix_cache_entries == 0
    engine.add_request("mid", prompt, greedy(20))
    emitted = []
    while len(emitted) < 12:
        emitted += [t for u in engine.step() for t in u.new_token_ids]
    engine.abort("mid")  # the prompt snapshot (16) stays; nothing from the aborted decode (24) is stored
    engine.step()
    assert engine.stats().prefix_cache_entries == 1
    follow = prompt + emitted + random_prompt(6, seed=19, vocab=vocab)
    out = warm.run([("next", follow, greedy(6))])["next"]
    assert warm.chunks("next")[0][0] == 16
    assert out == assert_same_as_cold(loaded, warm, "next", follow, greedy(6))
    assert engine.runner.num_caches == 0 and engine.stats().kv_tokens_used == 0


def test_engine_config_validates_prefix_settings():
    with pytest.raises(ConfigError, match="prefix_block_tokens"):
        EngineConfig(prefix_block_tokens=0)
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        EngineConfig(prefix_cache_bytes=-1)


# --- the cache itself, on stand-in snapshots ------------------------------------------------------------


class FakeSnapshot(SequenceCache):
    def __init__(self, length: int, truncatable: bool, size: int = 100) -> None:
        self.length, self.truncatable, self.size = length, truncatable, size

    @property
    def nbytes(self) -> int:
        return self.size


def test_chain_hashes_name_whole_prefixes():
    tokens = list(range(40))
    hashes = chain_hashes(tokens, 8)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert chain_hashes(tokens[:19], 8) == hashes[:2]  # a partial block is not hashed
    assert chain_hashes(tokens, 8, hashes[:2]) == hashes  # extends without recomputing
    changed = [99, *tokens[1:]]
    assert all(a != b for a, b in zip(chain_hashes(changed, 8), hashes, strict=True))  # block 0 feeds every hash


def test_prefix_cache_lru_order_and_what_each_snapshot_serves():
    cache = PrefixCache(block_tokens=4, capacity_bytes=250)
    one, two, three = (chain_hashes(random_prompt(16, seed=s), 4) for s in (1, 2, 3))
    assert cache.insert(one[:3], FakeSnapshot(12, truncatable=True))
    assert cache.insert(one, FakeSnapshot(16, truncatable=True))  # extends one[:3], which is dropped
    assert len(cache) == 1 and cache.bytes_used == 100
    assert cache.lookup(one[:2], 9).length == 8  # a truncatable snapshot serves its shorter prefixes
    assert cache.lookup(one, 16).length == 12  # one token must be left to compute
    assert cache.insert(two, FakeSnapshot(16, truncatable=False))
    assert cache.lookup(two[:3], 13) is None  # rolling state serves only its own length
    assert not cache.insert(one[:2], FakeSnapshot(8, truncatable=True))  # already servable
    cache.lookup(one, 17)  # one is now the most recently used: two goes first
    assert cache.insert(three, FakeSnapshot(16, truncatable=True))
    assert cache.lookup(two, 17) is None and cache.lookup(one, 17).length == 16
    assert cache.evictions == 1 and cache.bytes_used == 200
    assert not cache.insert(three[:1], FakeSnapshot(4, truncatable=False, size=300))  # over the whole budget
    assert (cache.queries, cache.hits, cache.hit_tokens) == (6, 4, 8 + 12 + 16 + 16)
