"""Prefill progress is visible: the engine's log lines and counters, /metrics, and SSE keep-alive comments.

Engine part: the demo model (tiny DeepSeek-V4 family), prompts prefilled in 16-token chunks, a second request
served mostly from the prefix cache. Server part: the demo model behind a real uvicorn server whose
engine is slowed (each step that prefills sleeps) with 8-token chunks, so a prompt takes ~0.5 s to
prefill while keep-alives go out every 0.05 s; the raw bytes and the official ``openai`` client read
the same streams.
"""

import json
import re
import time

import httpx
import pytest
import torch
from server_harness import LiveServer, demo_config, demo_path

from moetier.config import ModelLoadConfig
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.prefill_meter import PrefillMeter
from moetier.engine.sampling import SamplingParams
from moetier.server.app import load_serving_model
from moetier.weights.loader import load_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}
DONE_LINE = re.compile(
    r"request (\S+): prefilled (\d+) tokens \((\d+) from the prefix cache\) in ([\d.]+) s, (\d+) tok/s"
)
PROGRESS_LINE = re.compile(r"request (\S+): prefill (\d+)/(\d+) tokens, ([\d.]+) s, (\d+) tok/s")


# --- engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return load_model(demo_path(), ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, 900, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def finish(engine: Engine) -> None:
    for _ in range(200):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def messages(caplog, pattern):
    return [m.groups() for r in caplog.records if (m := pattern.search(r.getMessage()))]


def test_prefill_log_lines_counters_and_progress(demo, caplog):
    engine = Engine(demo, EngineConfig(prefill_chunk_tokens=16, prefix_block_tokens=16), tokenizer=None)
    engine.prefill_meter.log_interval = 0.0  # a progress line after every chunk of a prefill
    caplog.set_level("INFO", logger="moetier.engine.prefill_meter")
    first = prompt(50, 0)
    engine.add_request("a", first, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    stats = engine.stats()  # mid-prefill: 16 of 50 computed
    assert stats.prefill_progress == {"a": (16, 50)}
    assert stats.prefill_remaining_tokens == 34
    assert stats.prefill_computed_tokens_total == 16
    finish(engine)
    stats = engine.stats()
    assert stats.prefill_progress == {} and stats.prefill_remaining_tokens == 0
    assert stats.prefill_computed_tokens_total == 50
    assert stats.prefill_seconds_total > 0
    # One prefill only: the decayed rate is within a fraction of a percent of the plain ratio.
    ratio = stats.prefill_computed_tokens_total / stats.prefill_seconds_total
    assert stats.prefill_tokens_per_second == pytest.approx(ratio, rel=0.01)
    assert [g[:3] for g in messages(caplog, PROGRESS_LINE)] == [("a", "16", "50"), ("a", "32", "50"), ("a", "48", "50")]
    [done] = messages(caplog, DONE_LINE)
    assert done[:3] == ("a", "50", "0")
    assert float(done[3]) > 0 and int(done[4]) > 0

    # The same 50 tokens and 10 new ones: 48 (three 16-token blocks) come from the prefix cache.
    caplog.clear()
    seconds_before = stats.prefill_seconds_total
    engine.add_request("b", first + prompt(10, 1), SamplingParams(max_tokens=2, **GREEDY))
    finish(engine)
    stats = engine.stats()
    [done] = messages(caplog, DONE_LINE)
    assert done[:3] == ("b", "60", "48")
    assert stats.prefill_computed_tokens_total == 50 + 12
    assert stats.prompt_tokens_total == 50 + 60  # served prompt tokens still count as prompt tokens
    assert stats.prefill_seconds_total > seconds_before


def test_an_aborted_prefill_is_forgotten(demo, caplog):
    engine = Engine(demo, EngineConfig(prefill_chunk_tokens=16, enable_prefix_caching=False), tokenizer=None)
    caplog.set_level("INFO", logger="moetier.engine.prefill_meter")
    engine.add_request("x", prompt(40, 2), SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.stats().prefill_progress == {"x": (16, 40)}
    engine.abort("x")
    finish(engine)
    stats = engine.stats()
    assert stats.prefill_progress == {} and stats.prefill_remaining_tokens == 0
    assert stats.prefill_computed_tokens_total == 16
    assert not messages(caplog, DONE_LINE)
    assert not engine.prefill_meter._prefills


def test_decayed_rate_follows_recent_work():
    meter = PrefillMeter(horizon=1.0)
    meter.step(1.0, 100)  # 100 tok/s
    assert meter.tokens_per_second == pytest.approx(100)
    for _ in range(10):  # then 10 s at 1000 tok/s: the old second weighs exp(-10) by now
        meter.step(1.0, 1000)
    assert meter.tokens_per_second == pytest.approx(1000, rel=1e-3)
    assert meter.computed_tokens_total == 10_100 and meter.seconds_total == pytest.approx(11.0)


# --- server ---------------------------------------------------------------------------------------------

KEEPALIVE = 0.05
STEP_DELAY = 0.1  # per step that prefills: 8-token chunks, so a ~40-token prompt takes ~0.5 s


def slow_loader(config):
    """The demo model with small prefill chunks and a sleep in every step that computes prompt tokens."""

    def load():
        model = load_serving_model(config)
        engine = model.engine.engine
        engine.scheduler.prefill_chunk_tokens = 8
        execute = engine.runner.execute

        def slow(plan):
            if any(c.seq.prefilling for c in plan.chunks):
                time.sleep(STEP_DELAY)
            return execute(plan)

        engine.runner.execute = slow
        return model

    return load


@pytest.fixture(scope="module")
def server():
    config = demo_config(context=512, keepalive_seconds=KEEPALIVE)
    live = LiveServer(config, slow_loader(config)).start()
    yield live
    live.stop()


@pytest.fixture
def keepalive(server):
    """Set both endpoints' keep-alive interval for one test."""
    state = server.state

    def set_to(seconds):
        state.chat.keepalive_seconds = state.completions.keepalive_seconds = seconds

    yield set_to
    set_to(KEEPALIVE)


class Tee(httpx.BaseTransport):
    """An httpx transport that keeps a copy of every response body's raw bytes."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        raw, body = self.raw, response.stream

        class Stream(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in body:
                    raw.extend(chunk)
                    yield chunk

            def close(self):
                body.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Stream())


def long_chat(seed=0):
    return [{"role": "user", "content": f"Tell me a long story {seed}. " + "Once upon a time, " * 2}]


def data_events(raw: str) -> list:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def comments(raw: str) -> list[str]:
    return [line for line in raw.splitlines() if line.startswith(":")]


def metric(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_streamed_chat_gets_prefill_comments_before_its_first_token(server):
    body = {"model": "demo", "messages": long_chat(1), "max_tokens": 4, "stream": True, **GREEDY}
    lines, in_progress = [], None
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if in_progress is None and line.startswith(": prefill"):  # mid-prefill: /metrics sees it too
                scrape = httpx.get(server.base + "/metrics").text
                in_progress = metric(scrape, "moetier:prefill_in_progress_tokens")
    raw = "\n".join(lines)
    notes = comments(raw)
    progress = [tuple(map(int, re.fullmatch(r": prefill (\d+)/(\d+) tokens", n).groups())) for n in notes if "/" in n]
    assert len(progress) >= 2, notes
    total = progress[0][1]
    assert all(t == total for _, t in progress) and all(0 < d < total for d, _ in progress)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)  # the prefill moves forward
    assert set(notes) <= {": keep-alive"} | {f": prefill {d}/{t} tokens" for d, t in progress}
    assert in_progress is not None and 0 < in_progress <= total
    # Comments come only between the role chunk and the first token's chunk, none after.
    data_lines = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert all(data_lines[0] < i < data_lines[1] for i, line in enumerate(lines) if line.startswith(":"))
    events = data_events(raw)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert raw.rstrip().endswith("data: [DONE]")


def test_openai_client_parses_a_stream_with_keepalives(server):
    tee = Tee()
    client = server.client(http_client=httpx.Client(transport=tee))
    stream = client.chat.completions.create(
        model="demo", messages=long_chat(2), max_tokens=5, stream=True, temperature=0.0, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    raw = tee.raw.decode()
    assert any(n.startswith(": prefill") for n in comments(raw)), raw[:500]
    events = data_events(raw)
    assert len(chunks) == len(events) and [c.id for c in chunks] == [e["id"] for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    parsed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert parsed == "".join(e["choices"][0]["delta"].get("content") or "" for e in events) != ""

    tee.raw.clear()  # the legacy completions endpoint too
    stream = client.completions.create(
        model="demo", prompt="Once upon a time, " * 4, max_tokens=3, stream=True, temperature=0.0
    )
    chunks = list(stream)
    raw = tee.raw.decode()
    assert comments(raw)
    assert "".join(c.choices[0].text for c in chunks) == "".join(e["choices"][0]["text"] for e in data_events(raw))
    assert chunks[-1].choices[0].finish_reason is not None


def test_keepalives_off_sends_no_comments(server, keepalive):
    keepalive(0)
    body = {"model": "demo", "messages": long_chat(3), "max_tokens": 3, "stream": True, **GREEDY}
    started = time.monotonic()
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as response:
        raw = "\n".join(response.iter_lines())
    assert time.monotonic() - started > 4 * KEEPALIVE  # the prefill was slow enough to have had comments
    assert not comments(raw)
    assert data_events(raw)[-1]["choices"][0]["finish_reason"] == "length"


def test_disconnect_during_keepalives_aborts_the_request(server):
    body = {"model": "demo", "messages": long_chat(4), "max_tokens": 200, "stream": True, **GREEDY}
    before = server.engine_stats().generation_tokens_total
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith(":"):
                break  # leave while the prompt is still being prefilled
    stats = server.wait_idle(timeout=10)
    assert stats.prefill_progress == {} and stats.prefill_remaining_tokens == 0
    time.sleep(0.3)
    assert server.engine_stats().generation_tokens_total - before < 5, "the request was not aborted"


def test_metrics_expose_prefill_series(server):
    httpx.post(
        server.base + "/v1/completions",
        json={"model": "demo", "prompt": "A short prompt for the metrics", "max_tokens": 1},
        timeout=30,
    ).raise_for_status()
    server.wait_idle()
    stats = server.engine_stats()
    text = httpx.get(server.base + "/metrics").text
    computed = metric(text, "moetier:prefill_computed_tokens_total")
    seconds = metric(text, "moetier:prefill_seconds_total")
    assert computed == stats.prefill_computed_tokens_total > 0
    assert computed <= metric(text, "moetier:prompt_tokens_total")
    # Each prefilling step sleeps STEP_DELAY, so the seconds are at least that per 8-token chunk.
    assert seconds >= STEP_DELAY * (computed // 8) * 0.9
    rate = metric(text, "moetier:prefill_tokens_per_second")
    assert 0 < rate < 8 / STEP_DELAY * 1.1
    assert metric(text, "moetier:prefill_in_progress_tokens") == 0


def test_keepalive_setting_is_validated_and_reaches_the_cli():
    from moetier.cli import build_parser
    from moetier.errors import ConfigError
    from moetier.server.app import ServeConfig

    assert ServeConfig().keepalive_seconds == 5.0
    for bad in (-1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ConfigError, match="keepalive_seconds"):
            ServeConfig(keepalive_seconds=bad)
    assert build_parser().parse_args(["serve", "--sse-keepalive", "0"]).sse_keepalive == 0.0
    assert build_parser().parse_args(["serve"]).sse_keepalive == 5.0
