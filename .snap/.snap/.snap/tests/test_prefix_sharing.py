"""Same-step prefix sharing: requests arriving together with a long common prefix prefill it once.

Prompt tokens computed are counted from the scheduler's plans (``Traced.prefilled``) and the engine's
prefill counter; every request's greedy tokens (and fp32 logits, 1e-5 relative) are checked against
the same request alone on an engine with prefix caching off.
"""

import pytest
from test_engine import random_prompt
from test_prefix_cache import Traced, assert_same_as_cold, greedy

from moetier.engine.prefix_cache import chain_hashes
from moetier.engine.prefix_sharing import common_blocks
from moetier.server.metrics import ServerMetrics

BLOCK = 8
SUFFIXES = {"a": 13, "b": 9, "c": 11}  # a's prompt boundary (72) lies past the shared 64: two stops


def shared_requests(vocab: int, prefix_len: int = 64, max_tokens: int = 6):
    prefix = random_prompt(prefix_len, seed=7, vocab=vocab)
    return [
        (rid, prefix + random_prompt(n, seed=10 + i, vocab=vocab), greedy(max_tokens))
        for i, (rid, n) in enumerate(SUFFIXES.items())
    ]


def drain(traced: Traced, outputs: dict[str, list[int]], max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not traced.engine.has_work():
            return
        for update in traced.engine.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    raise AssertionError("the engine did not drain")


def check_alone(loaded, traced: Traced, requests, outputs) -> None:
    for rid, prompt, params in requests:
        assert outputs[rid] == assert_same_as_cold(loaded, traced, rid, prompt, params)


@pytest.mark.parametrize(
    "family,chunk", [("qwen3_moe", 24), ("qwen3_moe", 128), ("deepseek_v4", 24), ("deepseek_v4", 128)]
)
def test_a_prefix_shared_by_requests_of_one_step_is_prefilled_once(families, family, chunk):
    loaded, vocab = families(family)
    traced = Traced(loaded, prefill_chunk_tokens=chunk, prefix_block_tokens=BLOCK, max_streams=4)
    requests = shared_requests(vocab)
    outputs = traced.run(requests)

    total = 64 + sum(SUFFIXES.values())
    assert traced.prefilled("a", 64 + SUFFIXES["a"]) == 64 + SUFFIXES["a"]
    for rid in "bc":
        assert traced.prefilled(rid, 64 + SUFFIXES[rid]) == SUFFIXES[rid]
        assert traced.chunks(rid)[0][0] == 64  # started from the leader's snapshot
    # The leader's chunks end at the shared boundary (its snapshot point), even when planned in one piece.
    assert any(start + n == 64 for start, n in traced.chunks("a"))
    stats = traced.engine.stats()
    assert stats.prefill_computed_tokens_total == total
    assert (stats.prefix_shared_deferrals_total, stats.prefix_shared_tokens_saved_total) == (2, 128)
    metrics = ServerMetrics(traced.engine.stats, lambda: "tiny").render().decode()
    assert 'moetier:prefix_shared_deferrals_total{model_name="tiny"} 2.0' in metrics
    assert 'moetier:prefix_shared_tokens_saved_total{model_name="tiny"} 128.0' in metrics
    check_alone(loaded, traced, requests, outputs)


def test_without_sharing_every_request_prefills_the_prefix(families):
    """The contrast that makes the test above meaningful: with the wait bound at 0, nothing is shared."""
    loaded, vocab = families("qwen3_moe")
    traced = Traced(loaded, prefill_chunk_tokens=256, prefix_block_tokens=BLOCK, prefix_share_max_wait_s=0)
    traced.run(shared_requests(vocab))
    stats = traced.engine.stats()
    assert stats.prefill_computed_tokens_total == 3 * 64 + sum(SUFFIXES.values())
    assert stats.prefix_shared_deferrals_total == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_followers_of_an_aborted_leader_complete_and_still_share(families, family):
    loaded, vocab = families(family)
    traced = Traced(loaded, prefill_chunk_tokens=16, prefix_block_tokens=BLOCK)
    requests = shared_requests(vocab)
    for rid, prompt, params in requests:
        traced.engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {}
    for _ in range(2):  # a computes 32 of the 64 shared tokens; b and c wait for it
        traced.engine.step()
    assert traced.engine.stats().waiting == 2
    traced.engine.abort("a")
    drain(traced, outputs)

    assert traced.prefilled("a", 64 + SUFFIXES["a"]) == 32
    assert traced.prefilled("b", 64 + SUFFIXES["b"]) == 64 + SUFFIXES["b"]  # b leads now
    assert traced.prefilled("c", 64 + SUFFIXES["c"]) == SUFFIXES["c"]  # and c waits for b
    assert traced.engine.stats().prefix_shared_deferrals_total == 2
    check_alone(loaded, traced, requests[1:], outputs)


def test_short_shared_prefixes_are_not_deferred(families):
    loaded, vocab = families("qwen3_moe")
    requests = shared_requests(vocab, prefix_len=24)  # 3 shared blocks: under the 4-block floor
    traced = Traced(loaded, prefill_chunk_tokens=256, prefix_block_tokens=BLOCK, prefix_share_min_blocks=4)
    traced.run(requests)
    assert {rid for rid, _, _ in traced.recorder.plans[0]} == {"a", "b", "c"}  # all admitted at once
    assert traced.engine.stats().prefix_shared_deferrals_total == 0
    # The floor is what let them through: at 3 blocks the same requests share.
    lower = Traced(loaded, prefill_chunk_tokens=256, prefix_block_tokens=BLOCK, prefix_share_min_blocks=3)
    lower.run(requests)
    assert {rid for rid, _, _ in lower.recorder.plans[0]} == {"a"}
    assert lower.engine.stats().prefix_shared_deferrals_total == 2


def test_prefix_caching_off_means_no_deferral(families):
    loaded, vocab = families("qwen3_moe")
    traced = Traced(loaded, prefill_chunk_tokens=256, prefix_block_tokens=BLOCK, enable_prefix_caching=False)
    traced.run(shared_requests(vocab))
    assert traced.engine.sharing is None
    assert {rid for rid, _, _ in traced.recorder.plans[0]} == {"a", "b", "c"}
    assert traced.engine.stats().prefill_computed_tokens_total == 3 * 64 + sum(SUFFIXES.values())


def test_a_deferral_is_bounded_in_time(families):
    loaded, vocab = families("qwen3_moe")
    traced = Traced(loaded, prefill_chunk_tokens=16, prefix_block_tokens=BLOCK, prefix_share_max_wait_s=5.0)
    sharing = traced.engine.sharing
    now = [0.0]
    sharing.clock = lambda: now[0]
    requests = shared_requests(vocab)
    for rid, prompt, params in requests:
        traced.engine.add_request(rid, prompt, params)
    traced.engine.step()  # b and c are deferred at t=0 while a computes 16 of the 64 shared tokens
    b = traced.engine.scheduler.waiting[0]
    assert (b.request_id, b.deferred_since) == ("b", 0.0)
    now[0] = 4.0
    assert sharing.defer(b)  # a has still not computed the prefix: b keeps waiting
    now[0] = 5.5
    assert not sharing.defer(b)  # past the bound, with a's prefix still unfinished: it stops waiting
    assert sharing.deferrals == 2
    outputs: dict[str, list[int]] = {}
    drain(traced, outputs)
    check_alone(loaded, traced, requests, outputs)


@pytest.mark.parametrize("streams,overtakes", [(4, True), (3, False)])
def test_unrelated_requests_pass_deferred_ones_only_into_unclaimed_streams(families, streams, overtakes):
    loaded, vocab = families("qwen3_moe")
    traced = Traced(loaded, prefill_chunk_tokens=256, prefix_block_tokens=BLOCK, max_streams=streams)
    requests = [*shared_requests(vocab), ("d", random_prompt(20, seed=99, vocab=vocab), greedy(4))]
    traced.run(requests)
    first = {rid for rid, _, _ in traced.recorder.plans[0]}
    assert first == ({"a", "d"} if overtakes else {"a"})
    if not overtakes:  # d waits behind b and c's claims, then runs after them
        admitted = [
            next(i for i, p in enumerate(traced.recorder.plans) if any(r == rid for r, _, _ in p)) for rid in "bcd"
        ]
        assert admitted[2] >= max(admitted[:2])


def test_common_blocks_of_chain_hashes():
    a = chain_hashes(list(range(40)), 8)
    b = chain_hashes(list(range(27)) + [99] * 13, 8)
    assert common_blocks(a, b) == 3
    assert common_blocks(a, a[:2]) == 2
    assert common_blocks(a, []) == 0
