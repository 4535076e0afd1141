"""The serving engine on tiny checkpoints: interleaving, chunked prefill, admission, abort, stops, logprobs.

References are the plain one-sequence loop (:func:`reference.moetier_run`: one-shot prefill, then
one token per forward) and hand-written float64 statements of the penalties; the engine must give
the same tokens whatever else runs with a request and however its prompt is chunked.
"""

import math

import pytest
import torch
from reference import moetier_run, save_tiny
from test_deepseek_v3 import VARIANTS, tiny_v3_config
from test_deepseek_v4 import save_tiny_v4
from test_qwen3_moe import tiny_qwen3_config
from tiny_tokenizer import write_test_tokenizer

from moetier.config import ModelLoadConfig
from moetier.engine.detokenizer import held_back
from moetier.engine.engine import Engine, EngineBusyError, EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.llm import LLM
from moetier.weights.loader import load_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


# --- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-engine")
    save_tiny(tiny_qwen3_config(), path)
    write_test_tokenizer(path, vocab_size=320)
    return path


@pytest.fixture(scope="module")
def qwen(qwen_path):
    return load_model(qwen_path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)


@pytest.fixture(scope="module")
def families(qwen, tmp_path_factory):
    """family name -> (LoadedModel, vocab size), built on first use."""
    built = {"qwen3_moe": (qwen, 320)}
    makers = {
        "deepseek_v3": (lambda p: save_tiny(tiny_v3_config(**VARIANTS["q_lora"]), p), 320),
        "deepseek_v4": (lambda p: save_tiny_v4(p, torch.float32), 256),
    }

    def get(name):
        if name not in built:
            make, vocab = makers[name]
            path = tmp_path_factory.mktemp(name)
            make(path)
            built[name] = (load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False), vocab)
        return built[name]

    return get


def make_engine(loaded, tokenizer="auto", **config):
    return Engine(loaded, EngineConfig(**config), tokenizer=tokenizer)


def random_prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_tokens(loaded, prompt: list[int], steps: int):
    """(prefill logits [P, V], logits that picked each token, greedy tokens) from the one-sequence loop."""
    prefill, step_logits, tokens = moetier_run(loaded, torch.tensor(prompt), steps)
    return prefill, [prefill[-1], *step_logits[:-1]], tokens


class Recorder:
    """Wraps the scheduler to record each step's plan as (request_id, start, num_tokens) triples.

    ``prefill`` holds, per step, the (request_id, num_tokens) of the chunks that compute prompt tokens.
    """

    def __init__(self, engine):
        self.plans, self.prefill = [], []
        schedule = engine.scheduler.schedule

        def record():
            plan = schedule()
            self.plans.append([(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks])
            self.prefill.append([(c.seq.request_id, c.num_tokens) for c in plan.chunks if c.seq.prefilling])
            return plan

        engine.scheduler.schedule = record


def run(engine, requests, max_steps=1000):
    """Add ``requests`` ([(id, prompt, params)]), step until idle; returns id -> list of updates."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    updates = {request_id: [] for request_id, _, _ in requests}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for update in engine.step():
            updates[update.request_id].append(update)
    assert not engine.has_work()
    return updates


def tokens_of(updates) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def text_of(updates) -> str:
    return "".join(u.new_text for u in updates)


# --- interleaving and chunked prefill ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_interleaved_sequences_give_the_tokens_of_each_alone(families, family):
    loaded, vocab = families(family)
    lengths, max_tokens = [5, 13, 29, 40], [6, 12, 9, 10]
    prompts = [random_prompt(n, seed=10 + i, vocab=vocab) for i, n in enumerate(lengths)]
    engine = make_engine(loaded, tokenizer=None, max_streams=4, prefill_chunk_tokens=16)
    recorder = Recorder(engine)
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    updates = run(engine, requests)
    for (request_id, prompt, _), steps in zip(requests, max_tokens, strict=True):
        expected = reference_tokens(loaded, prompt, steps)[2]
        assert tokens_of(updates[request_id]) == expected
        assert len(set(expected)) > 2  # a real continuation
        assert updates[request_id][-1].finish_reason == "length"
    # The 40-token prompt was prefilled over several steps, while the other streams kept decoding.
    r3_steps = [plan for plan in recorder.plans if any(rid == "r3" and start < 40 for rid, start, _ in plan)]
    assert len(r3_steps) >= 3
    assert all(any(rid != "r3" and n == 1 for rid, _, n in plan) for plan in r3_steps[1:])
    assert all(sum(n for _, n in chunks) <= 16 for chunks in recorder.prefill)  # the per-step prefill budget
    assert sum(n for chunks in recorder.prefill for _, n in chunks) == sum(lengths)
    assert max(len(plan) for plan in recorder.plans) == 4
    assert engine.stats().kv_tokens_used == 0 and engine.runner.num_caches == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_chunked_prefill_logprobs_match_the_one_shot_model_logits(families, family):
    loaded, vocab = families(family)
    prompt = random_prompt(30, seed=3, vocab=vocab)
    params = SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=4, **GREEDY)
    engine = make_engine(loaded, tokenizer=None, prefill_chunk_tokens=7)
    recorder = Recorder(engine)
    updates = run(engine, [("a", prompt, params)])["a"]
    assert [n for plan in recorder.plans for _, start, n in plan if start < 30] == [7, 7, 7, 7, 2]

    prefill, picked_by, tokens = reference_tokens(loaded, prompt, 5)
    assert tokens_of(updates) == tokens
    # prompt_logprobs: once, on the first update; entry i scores prompt[i] under the logits at i - 1.
    assert updates[0].prompt_logprobs is not None and all(u.prompt_logprobs is None for u in updates[1:])
    entries = updates[0].prompt_logprobs
    assert len(entries) == 30 and entries[0] is None
    expected = torch.log_softmax(prefill.double(), dim=-1)
    for i, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt[i]
        assert math.isclose(entry.logprob, expected[i - 1, prompt[i]].item(), abs_tol=1e-5)
        top = expected[i - 1].topk(4)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(lp - ref) for (_, lp), ref in zip(entry.top, top.values.tolist(), strict=True)) < 1e-5
    # logprobs of the generated tokens: log_softmax of the model's logits at that step.
    generated = [lp for u in updates for lp in u.logprobs]
    assert [lp.token_id for lp in generated] == tokens
    for lp, logits in zip(generated, picked_by, strict=True):
        ref = torch.log_softmax(logits.double(), dim=-1)
        assert math.isclose(lp.logprob, ref[lp.token_id].item(), abs_tol=1e-5)
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_seeded_sampling_does_not_depend_on_the_other_requests(qwen):
    prompts = [random_prompt(n, seed=20 + n) for n in (6, 9, 17)]
    params = [
        SamplingParams(max_tokens=8, temperature=1.2, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=8, top_k=20, seed=7, ignore_eos=True),
    ]
    requests = [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    together = run(make_engine(qwen, prefill_chunk_tokens=8), requests)
    for request in requests:
        alone = run(make_engine(qwen), [request])
        assert tokens_of(together[request[0]]) == tokens_of(alone[request[0]])
    greedy = reference_tokens(qwen, prompts[0], 8)[2]
    assert tokens_of(together["s0"]) != greedy  # really sampled


# --- admission, KV budget, abort --------------------------------------------------------------------


def test_max_streams_respected_and_waiting_queue_drains_fcfs(qwen):
    engine = make_engine(qwen, max_streams=2)
    recorder = Recorder(engine)
    max_tokens = [5, 2, 4, 3, 2, 2]
    for i, m in enumerate(max_tokens):
        engine.add_request(f"q{i}", random_prompt(8, seed=30 + i), SamplingParams(max_tokens=m, **GREEDY))
    assert engine.stats().waiting == 6 and engine.stats().running == 0
    finished = {}
    while engine.has_work():
        for update in engine.step():
            if update.finished:
                finished[update.request_id] = update
        stats = engine.stats()
        assert stats.running <= 2
        assert stats.kv_tokens_used == sum(8 + m for s in engine.scheduler.running for m in [s.max_new_tokens])
    admitted = []
    for plan in recorder.plans:
        admitted += [rid for rid, _, _ in plan if rid not in admitted]
    assert admitted == [f"q{i}" for i in range(6)]
    assert max(len(plan) for plan in recorder.plans) == 2
    assert {rid: len(u.new_token_ids) and u.completion_tokens for rid, u in finished.items()} == {
        f"q{i}": m for i, m in enumerate(max_tokens)
    }
    assert engine.stats().waiting == 0 and engine.stats().kv_tokens_used == 0


def test_kv_token_budget_limits_admission(qwen):
    engine = make_engine(qwen, max_streams=4, kv_token_budget=45, kv_admission="reserve")
    for i in range(4):
        engine.add_request(f"k{i}", random_prompt(10, seed=40 + i), SamplingParams(max_tokens=10, **GREEDY))
    with pytest.raises(ConfigError, match="needs 46 KV tokens .* kv_token_budget is 45"):
        engine.add_request("huge", random_prompt(36, seed=1), SamplingParams(max_tokens=10))
    peak = 0
    while engine.has_work():
        engine.step()
        stats = engine.stats()
        assert stats.kv_tokens_used == 20 * stats.running <= 45
        peak = max(peak, stats.running)
    assert peak == 2 and engine.stats().generation_tokens_total == 40 and engine.stats().prompt_tokens_total == 40


def test_abort_frees_kv_tokens_at_once_and_others_continue(qwen):
    prompts = {rid: random_prompt(9 + i, seed=50 + i) for i, rid in enumerate("abc")}
    engine = make_engine(qwen, max_streams=3)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=12, **GREEDY))
    engine.add_request("late", random_prompt(5, seed=1), SamplingParams(max_tokens=12, **GREEDY))  # waits
    collected = {rid: [] for rid in [*prompts, "late"]}
    for _ in range(4):
        for update in engine.step():
            collected[update.request_id].append(update)
    before = engine.stats()
    assert (before.running, before.waiting, engine.runner.num_caches) == (3, 1, 3)
    engine.abort("b")
    engine.abort("late")
    engine.abort("never-existed")  # ignored
    after = engine.stats()
    assert before.kv_tokens_used - after.kv_tokens_used == 10 + 12
    assert (after.running, after.waiting, engine.runner.num_caches) == (2, 0, 2)
    first = engine.step()
    aborted = {u.request_id: u for u in first if u.finish_reason == "abort"}
    assert set(aborted) == {"b", "late"} and all(u.finished and not u.new_token_ids for u in aborted.values())
    for update in first:
        collected[update.request_id].append(update)
    while engine.has_work():
        for update in engine.step():
            assert update.request_id in "ac"
            collected[update.request_id].append(update)
    for rid in "ac":
        assert tokens_of(collected[rid]) == reference_tokens(qwen, prompts[rid], 12)[2]
    assert len(tokens_of(collected["b"])) == 4
    assert engine.stats().kv_tokens_used == 0 and engine.runner.num_caches == 0


def test_add_request_errors(qwen):
    engine = make_engine(qwen, max_model_len=20, max_waiting=2)
    params = SamplingParams(max_tokens=4)
    engine.add_request("x", [5, 6, 7], params)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("x", [5, 6, 7], params)
    engine.add_request("y", [5, 6, 7], params)
    with pytest.raises(EngineBusyError, match="2 requests are already waiting"):
        engine.add_request("z", [5, 6, 7], params)
    with pytest.raises(ConfigError, match="prompt has 20 tokens but max_model_len is 20"):
        engine.validate_request(random_prompt(20, seed=0), params)
    with pytest.raises(ConfigError, match="non-empty"):
        engine.validate_request([], params)
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        engine.validate_request([3, 320], params)
    for bad in ({"max_streams": 0}, {"prefill_chunk_tokens": 1.5}, {"kv_token_budget": -1}, {"max_waiting": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_window_caps_generation_with_length(qwen):
    engine = make_engine(qwen, max_model_len=20)
    updates = run(engine, [("w", random_prompt(14, seed=4), SamplingParams(max_tokens=50, **GREEDY))])["w"]
    assert len(tokens_of(updates)) == 6 and updates[-1].finish_reason == "length"
    assert engine.stats().kv_tokens_capacity == 4 * 20


# --- text, stops ----------------------------------------------------------------------------------------


def per_token_pieces(engine, prompt, max_tokens=24):
    updates = run(engine, [("full", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))])["full"]
    return tokens_of(updates), [u.new_text for u in updates]


def spanning_stop(pieces: list[str]) -> tuple[str, int, int]:
    """A stop string that starts in one token's text and ends in the next: (stop, start offset, token index)."""
    text = "".join(pieces)
    offset = 0
    for k in range(len(pieces) - 1):
        offset += len(pieces[k])
        if len(pieces[k]) >= 2 and pieces[k + 1]:
            stop = pieces[k][-2:] + pieces[k + 1][:1]
            if text.find(stop) == offset - 2:
                return stop, offset - 2, k
    raise AssertionError("no suitable stop string in the test output")


def test_stop_string_spanning_deltas_never_leaks(qwen):
    engine = make_engine(qwen)
    prompt = random_prompt(10, seed=1)
    tokens, pieces = per_token_pieces(engine, prompt)
    full = "".join(pieces)
    assert full == engine.tokenizer.decode(tokens)
    stop, at, k = spanning_stop(pieces)

    updates = run(engine, [("s", prompt, SamplingParams(max_tokens=24, stop=stop, **GREEDY))])["s"]
    assert text_of(updates) == full[:at]
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == stop
    assert tokens_of(updates) == tokens[: k + 2]
    # The update of token k already held back the two characters that may start the stop string.
    assert "".join(u.new_text for u in updates[: k + 1]) == full[:at]

    kept = run(
        engine, [("i", prompt, SamplingParams(max_tokens=24, stop=stop, include_stop_str_in_output=True, **GREEDY))]
    )
    assert text_of(kept["i"]) == full[: at + len(stop)]

    # A prefix that never completes is held back for one token only, then released.
    false_alarm = stop[:2] + "\x00"
    updates = run(engine, [("f", prompt, SamplingParams(max_tokens=24, stop=false_alarm, **GREEDY))])["f"]
    emitted = [len("".join(u.new_text for u in updates[: i + 1])) for i in range(len(updates))]
    assert emitted[k] == at and emitted[k + 1] == len("".join(pieces[: k + 2]))
    assert text_of(updates) == full and updates[-1].finish_reason == "length"


def test_held_back_is_the_longest_possible_stop_prefix():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello wor", ["xyz", "or!", "r?"]) == 2
    assert held_back("abab", ["abc"]) == 2
    assert held_back("hello", ["hello"]) == 0  # a complete match is the stop check's business, not held back
    assert held_back("", ["abc"]) == 0 and held_back("abc", []) == 0


def test_stop_token_text_with_include_stop_str_in_output(qwen):
    engine = make_engine(qwen)
    prompt = random_prompt(10, seed=2)
    tokens, _ = per_token_pieces(engine, prompt, 16)
    target = next(t for t in tokens[3:] if engine.tokenizer.decode([t]))
    first = tokens.index(target)
    params = SamplingParams(max_tokens=16, stop_token_ids=[target], include_stop_str_in_output=True, **GREEDY)
    updates = run(engine, [("t", prompt, params)])["t"]
    assert tokens_of(updates) == tokens[: first + 1]
    assert text_of(updates) == engine.tokenizer.decode(tokens[: first + 1])
    assert updates[-1].stop_reason == target
    without = run(engine, [("u", prompt, SamplingParams(max_tokens=16, stop_token_ids=[target], **GREEDY))])["u"]
    assert text_of(without) == engine.tokenizer.decode(tokens[:first])


def test_skip_special_tokens(qwen, monkeypatch):
    engine = make_engine(qwen)
    outputs = engine.runner._outputs

    def force_eos_third(chunk, hidden, out):  # the model "emits" EOS (special) as its third token
        last = outputs(chunk, hidden, out)
        if last is not None and len(chunk.seq.output_ids) == 2:
            last[..., 1] = last.max() + 10
        return last

    monkeypatch.setattr(engine.runner, "_outputs", force_eos_third)
    prompt = random_prompt(6, seed=8)
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=6, skip_special_tokens=skip, **GREEDY)
        updates = run(engine, [("p", prompt, params)])["p"]
        tokens = tokens_of(updates)
        assert tokens[2] == 1 and len(tokens) == 6
        texts[skip] = text_of(updates)
        assert texts[skip] == engine.tokenizer.decode(tokens, skip_special_tokens=skip)
    assert "<｜end▁of▁sentence｜>" in texts[False] and "<｜end▁of▁sentence｜>" not in texts[True]


# --- penalties ----------------------------------------------------------------------------------------


def test_penalties_steer_greedy_decoding_as_specified(qwen):
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 10]
    r, f, p = 1.5, 0.7, 0.4
    params = SamplingParams(
        max_tokens=12, repetition_penalty=r, frequency_penalty=f, presence_penalty=p, logprobs=2, **GREEDY
    )
    updates = run(make_engine(qwen), [("p", prompt, params)])["p"]
    out = tokens_of(updates)
    assert out != reference_tokens(qwen, prompt, 12)[2]  # the penalties changed the continuation
    # Teacher-force the produced sequence: row P-1+k of a one-shot forward holds the logits that picked out[k].
    model = qwen.model
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt + out[:-1]), model.new_cache(len(prompt) + len(out))))
    for k, token in enumerate(out):
        raw = logits[len(prompt) - 1 + k].double().tolist()
        history = prompt + out[:k]
        penalised = []
        for v, x in enumerate(raw):
            count = out[:k].count(v)
            if v in history:
                x = x / r if x > 0 else x * r
            penalised.append(x - f * count - (p if count else 0.0))
        assert token == max(range(len(penalised)), key=penalised.__getitem__)
        # Logprobs stay those of the raw model distribution.
        lp = updates[k].logprobs[0]
        assert math.isclose(lp.logprob, torch.log_softmax(torch.tensor(raw), 0)[token].item(), abs_tol=1e-5)


# --- failures stay with their request -------------------------------------------------------------------


def test_a_failing_request_is_aborted_with_its_error_and_the_others_are_unaffected(qwen, monkeypatch):
    prompts = {rid: random_prompt(8, seed=60 + i) for i, rid in enumerate(["good", "seeded", "bad", "nan", "text"])}
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    alone = tokens_of(run(make_engine(qwen), [("seeded", prompts["seeded"], sampled)])["seeded"])

    engine = make_engine(qwen, max_streams=5)
    forward, outputs, calls = engine.runner._forward, engine.runner._outputs, {"bad": 0}

    def flaky_forward(chunks):
        # From its third step on, any forward holding "bad" faults: the batched one, then its solo retry.
        if any(chunk.seq.request_id == "bad" for chunk in chunks):
            calls["bad"] += 1
            if calls["bad"] >= 3:
                raise RuntimeError("simulated device fault")
        return forward(chunks)

    def nan_outputs(chunk, hidden, out):
        last = outputs(chunk, hidden, out)
        if chunk.seq.request_id == "nan" and last is not None and chunk.seq.output_ids:
            return torch.full_like(last, float("nan"))  # breaks sampling for this row only
        return last

    monkeypatch.setattr(engine.runner, "_forward", flaky_forward)
    monkeypatch.setattr(engine.runner, "_outputs", nan_outputs)
    params = {rid: SamplingParams(max_tokens=8, **GREEDY) for rid in ["good", "bad", "text"]}
    params["nan"] = SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)
    params["seeded"] = sampled
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid])

    def broken_add(token):
        raise ValueError("simulated detokenizer fault")

    engine._requests["text"].text.add = broken_add
    updates = {rid: [] for rid in prompts}
    while engine.has_work():
        for update in engine.step():
            updates[update.request_id].append(update)
    for rid, message in (("bad", "simulated device fault"), ("nan", "probability"), ("text", "detokenizer fault")):
        last = updates[rid][-1]
        assert last.finished and last.finish_reason == "abort" and message in last.error, (rid, last.error)
    assert tokens_of(updates["good"]) == reference_tokens(qwen, prompts["good"], 8)[2]
    assert tokens_of(updates["seeded"]) == alone  # its generator was rewound after the failed batch draw
    assert all(u.error is None for rid in ("good", "seeded") for u in updates[rid])
    assert engine.stats().kv_tokens_used == 0 and engine.runner.num_caches == 0


# --- the offline API on the engine ------------------------------------------------------------------------


def test_llm_fans_out_n_with_child_seeds(qwen_path):
    llm = LLM(qwen_path, device="cpu", load_progress=False)
    prompt = {"prompt_token_ids": random_prompt(7, seed=9)}
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for j, completion in enumerate(out.outputs):
        alone = llm.generate(prompt, params.child(j))[0].outputs[0]
        assert completion.token_ids == alone.token_ids and completion.text == alone.text
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert len(out.prompt_logprobs) == 7 and out.prompt_logprobs[0] is None


def test_each_step_is_one_forward_over_all_scheduled_sequences(qwen, monkeypatch):
    engine = make_engine(qwen, max_streams=3)
    forward, batch_sizes = engine.runner._forward, []

    def counting(chunks):
        batch_sizes.append(len(chunks))
        return forward(chunks)

    monkeypatch.setattr(engine.runner, "_forward", counting)
    params = SamplingParams(max_tokens=5, **GREEDY)
    prompts = {f"r{i}": random_prompt(6 + i, seed=90 + i) for i in range(3)}
    updates = run(engine, [(rid, prompt, params) for rid, prompt in prompts.items()])
    assert max(batch_sizes) == 3 and len(batch_sizes) <= 6  # 3 streams decode together, not one by one
    for rid, prompt in prompts.items():
        assert tokens_of(updates[rid]) == reference_tokens(qwen, prompt, 5)[2]
