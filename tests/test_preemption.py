"""Optimistic KV admission with preemption by recompute.

Three requests whose prompts fit together but whose generations cannot (prompt 8 + 24 new tokens each,
a 60-token budget, 4 tokens of headroom) are run with the default ``kv_admission="optimistic"``: the
newest running request is preempted, waits first in the queue and recomputes its prompt + output when
re-admitted. The reference for every request is the same request alone on a roomy engine: greedy and
seeded temperature sampling (with penalties and logprobs, so the sampler state's survival is checked)
must give the same tokens, streamed once each. ``"reserve"`` admission keeps the old behaviour.
"""

import logging

import pytest
from test_engine import make_engine, random_prompt, run, tokens_of

from moetier.engine.engine import EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.server.metrics import ServerMetrics

PROMPT, NEW, BUDGET, HEADROOM = 8, 24, 60, 4
# Tight: all three are admitted (3 x 12 tokens) but their lives (3 x 32) need 96.
TIGHT = {"max_streams": 3, "kv_token_budget": BUDGET, "kv_headroom_tokens": HEADROOM, "prefix_block_tokens": 4}


def greedy(max_tokens: int = NEW, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def requests_for(vocab: int, params: list[SamplingParams]) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", random_prompt(PROMPT, seed=70 + i, vocab=vocab), p) for i, p in enumerate(params)]


def alone(loaded, request) -> list:
    """The request's updates on an engine where nothing else runs and nothing is ever short."""
    return run(make_engine(loaded, tokenizer=None, kv_admission="reserve"), [request])[request[0]]


class Watched:
    """An engine whose scheduler state is checked after every step, and whose preemptions are recorded as
    (victim id, ids of the sequences running then with their arrival order); ``victim_outputs`` holds the
    number of tokens each victim had generated when preempted."""

    def __init__(self, loaded, **config):
        self.engine = make_engine(loaded, tokenizer=None, **config)
        self.preempted: list[tuple[str, dict[str, int]]] = []
        self.victim_outputs: list[int] = []
        self.max_running = 0
        scheduler, hook = self.engine.scheduler, self.engine.scheduler.on_preempt

        def record(seq):
            self.preempted.append((seq.request_id, {s.request_id: s.arrival for s in scheduler.running}))
            self.victim_outputs.append(len(seq.output_ids))
            hook(seq)

        scheduler.on_preempt = record

    def run(self, requests, abort_first_victim: bool = False) -> dict[str, list]:
        engine, scheduler = self.engine, self.engine.scheduler
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
        updates = {request_id: [] for request_id, _, _ in requests}
        aborted = None
        for _ in range(1000):
            if not engine.has_work():
                break
            for update in engine.step():
                updates[update.request_id].append(update)
            self.max_running = max(self.max_running, len(scheduler.running))
            # Reservations add up, stay within the budget, and every cache fits in its sequence's; a reused cache
            # (spares: V4) may hold more, but the live and spare caches together stay within the budget.
            assert scheduler.kv_tokens_used == sum(s.kv_reserved for s in scheduler.running) <= BUDGET
            capacities = [engine.runner.capacity_of(seq.request_id) for seq in scheduler.running]
            spares = engine.runner.spares
            if spares is None:
                assert all(c <= s.kv_reserved for c, s in zip(capacities, scheduler.running, strict=True))
            else:
                assert sum(capacities) + spares.tokens <= BUDGET and len(capacities) + len(spares) <= 3
            assert all(s.kv_reserved == 0 and s.num_computed == 0 for s in scheduler.waiting)
            if abort_first_victim and self.preempted and aborted is None:
                aborted = self.preempted[0][0]
                assert aborted in {s.request_id for s in scheduler.waiting}  # a waiting (preempted) request
                engine.abort(aborted)
        assert not engine.has_work()
        return updates


def assert_streamed_once(updates, expected: list[int]) -> None:
    """One token per update, none repeated: what the client saw is exactly ``expected``."""
    assert tokens_of(updates) == expected
    carrying = [u for u in updates if u.new_token_ids]
    assert [u.completion_tokens for u in carrying] == list(range(1, len(expected) + 1))
    assert updates[-1].finished and sum(u.finished for u in updates) == 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_greedy_requests_give_the_tokens_of_each_alone(qwen, prefix_caching, caplog):
    requests = requests_for(320, [greedy(), greedy(), greedy()])
    watched = Watched(qwen, enable_prefix_caching=prefix_caching, **TIGHT)
    with caplog.at_level(logging.INFO, logger="moetier.engine.scheduler"):
        updates = watched.run(requests)

    stats = watched.engine.stats()
    assert stats.preemptions_total == len(watched.preempted) > 0 and watched.max_running == 3
    assert max(watched.victim_outputs) > 0  # generated tokens were recomputed, not only prompts
    lines = [r for r in caplog.records if "preempted request" in r.getMessage()]
    assert len(lines) == stats.preemptions_total and all(r.levelno == logging.INFO for r in lines)
    for request in requests:
        expected = tokens_of(alone(qwen, request))
        assert len(set(expected)) > 2  # a real continuation
        assert_streamed_once(updates[request[0]], expected)
        assert updates[request[0]][-1].finish_reason == "length"
    # LIFO: every victim is the running sequence that arrived last; the oldest request is never preempted.
    for victim, running in watched.preempted:
        assert running[victim] == max(running.values())
    assert "r0" not in {victim for victim, _ in watched.preempted}
    # Counted once: prompt and generated tokens as if nothing had been preempted.
    assert stats.prompt_tokens_total == 3 * PROMPT and stats.generation_tokens_total == 3 * NEW
    if prefix_caching:  # the victims' snapshots served part of their recompute
        assert stats.prefix_cache_hits > 0
    assert stats.kv_tokens_used == 0 and watched.engine.runner.num_caches == 0

    metrics = ServerMetrics(watched.engine.stats, lambda: "tiny").render().decode()
    assert f'moetier:preemptions_total{{model_name="tiny"}} {float(stats.preemptions_total)}' in metrics


def test_preemption_keeps_the_sampler_state(qwen):
    """Seeded temperature sampling with penalties and logprobs: the generator's position and the penalty
    counts survive the recompute, so the draws (and the logprobs sent) are those of the request alone."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=1.1, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, seed=4, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(
            max_tokens=NEW,
            temperature=1.3,
            seed=5,
            ignore_eos=True,
            repetition_penalty=1.2,
            logprobs=1,
            prompt_logprobs=2,
        ),
    ]
    requests = requests_for(320, params)
    watched = Watched(qwen, **TIGHT)
    updates = watched.run(requests)
    assert watched.engine.stats().preemptions_total > 0
    victims = {victim for victim, _ in watched.preempted}
    assert victims & {"r1", "r2"}
    for request in requests:
        reference = alone(qwen, request)
        assert_streamed_once(updates[request[0]], tokens_of(reference))
        if request[2].logprobs is not None:
            got = [lp for u in updates[request[0]] for lp in u.logprobs]
            want = [lp for u in reference for lp in u.logprobs]
            assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want, strict=True)) < 1e-4
    # Prompt logprobs: sent once, on the first update, never recomputed into the list.
    sent = [u.prompt_logprobs for u in updates["r2"] if u.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == PROMPT and "r2" in victims
    want = alone(qwen, requests[2])[0].prompt_logprobs
    assert [e.token_id for e in sent[0][1:]] == [e.token_id for e in want[1:]] == requests[2][1][1:]
    greedy_tokens = tokens_of(alone(qwen, (requests[0][0], requests[0][1], greedy())))
    assert tokens_of(updates["r0"]) != greedy_tokens  # really sampled


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v3"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_recompute_rebuilds_other_families_caches(families, family, prefix_caching):
    """DeepSeek-V4's sliding window, compressor state and compressed entries are rebuilt by the recompute
    (from scratch, or from the victim's own snapshot); V3's latent cache likewise."""
    loaded, vocab = families(family)
    requests = requests_for(vocab, [greedy(), greedy(), greedy()])
    watched = Watched(loaded, enable_prefix_caching=prefix_caching, **TIGHT)
    updates = watched.run(requests)
    assert watched.engine.stats().preemptions_total > 0
    for request in requests:
        assert_streamed_once(updates[request[0]], tokens_of(alone(loaded, request)))


def test_reserve_admission_never_preempts(qwen):
    requests = requests_for(320, [greedy(), greedy(), greedy()])
    watched = Watched(qwen, kv_admission="reserve", **TIGHT)
    updates = watched.run(requests)
    assert watched.engine.stats().preemptions_total == 0 and not watched.preempted
    assert watched.max_running == 1  # 32 KV tokens each for their whole life: one at a time in 60
    for request in requests:
        assert_streamed_once(updates[request[0]], tokens_of(alone(qwen, request)))


def test_aborting_a_preempted_request(qwen):
    requests = requests_for(320, [greedy(), greedy(), greedy()])
    watched = Watched(qwen, **TIGHT)
    updates = watched.run(requests, abort_first_victim=True)
    victim = watched.preempted[0][0]
    final = updates[victim][-1]
    assert final.finished and final.finish_reason == "abort" and not final.new_token_ids
    assert 0 < len(tokens_of(updates[victim])) < NEW
    expected = tokens_of(alone(qwen, next(r for r in requests if r[0] == victim)))
    assert tokens_of(updates[victim]) == expected[: len(tokens_of(updates[victim]))]
    for request in requests:
        if request[0] != victim:
            assert_streamed_once(updates[request[0]], tokens_of(alone(qwen, request)))
    assert watched.engine.stats().kv_tokens_used == 0 and watched.engine.runner.num_caches == 0


def test_a_request_alone_that_cannot_grow_ends_with_length(qwen, caplog):
    prompt = random_prompt(PROMPT, seed=90)
    engine = make_engine(qwen, tokenizer=None, kv_token_budget=20, kv_headroom_tokens=HEADROOM)
    with caplog.at_level(logging.WARNING, logger="moetier.engine.scheduler"):
        updates = run(engine, [("long", prompt, greedy(40))])["long"]
    # Room for 20 tokens: 8 of prompt and 12 generated ones are computed; the last position samples a 13th.
    expected = tokens_of(alone(qwen, ("long", prompt, greedy(40))))
    assert_streamed_once(updates, expected[:13])
    assert updates[-1].finish_reason == "length" and engine.stats().preemptions_total == 0
    assert any("cannot grow" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert engine.stats().kv_tokens_used == 0 and engine.runner.num_caches == 0

    with pytest.raises(ConfigError, match=r"needs 21 KV tokens \(prompt \+ 1 generated token\) .* is 20"):
        engine.add_request("too-long", random_prompt(20, seed=1), greedy())
    reserve = make_engine(qwen, tokenizer=None, kv_token_budget=20, kv_admission="reserve")
    with pytest.raises(ConfigError, match=r"needs 48 KV tokens \(prompt \+ max_tokens\) .* is 20"):
        reserve.add_request("long", prompt, greedy(40))


def test_config_validation():
    with pytest.raises(ConfigError, match="kv_admission must be one of reserve, optimistic"):
        EngineConfig(kv_admission="lazy")
    with pytest.raises(ConfigError, match="kv_headroom_tokens"):
        EngineConfig(kv_headroom_tokens=0)
    assert EngineConfig().kv_admission == "optimistic" and EngineConfig().kv_headroom_tokens == 256
