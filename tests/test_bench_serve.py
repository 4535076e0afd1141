"""``moetier bench serve`` against the demo model: a complete receipt, no errors, timings that add up."""

import json

import pytest
from server_harness import LiveServer, demo_config

from moetier.bench.serve import (
    ServeBenchConfig,
    make_prompts,
    markdown_table,
    run_level,
    run_serve_bench,
    write_receipt,
)
from moetier.errors import ConfigError


@pytest.fixture(scope="module")
def server():
    live = LiveServer(demo_config(max_streams=2)).start()
    yield live
    live.stop()


def test_receipt_per_concurrency_with_zero_errors(server, tmp_path):
    cfg = ServeBenchConfig(
        url=server.base + "/v1", concurrency=[1, 2], requests=3, prompt_tokens=12, max_tokens=6, request_timeout=60
    )
    before = server.wait_idle()
    receipt = run_serve_bench(cfg)
    after = server.wait_idle()
    assert receipt["server"]["model"] == "demo" and not receipt["server"]["started_by_bench"]
    assert receipt["server"]["warmup_errors"] == [] and receipt["environment"]["versions"]["torch"]
    assert [r["concurrency"] for r in receipt["results"]] == [1, 2]
    for r in receipt["results"]:
        assert r["errors"] == 0 and r["error_messages"] == [] and r["requests"] == 3
        # ignore_eos: every request generates exactly max_tokens, and the level's total adds up.
        assert r["completion_tokens"] == [6, 6, 6] and r["output_tokens"] == 18
        assert r["output_tok_s"] == pytest.approx(18 / r["wall_seconds"])
        assert all(1 <= chunks <= 6 for chunks in r["text_chunks"]) and r["finish_reasons"] == ["length"]
        assert all(p >= 1 for p in r["prompt_tokens"])
        for key in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            s = r[key]
            assert 0 < s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], key
        assert r["ttft_s"]["max"] < r["latency_s"]["max"] and r["ttft_s"]["min"] < r["latency_s"]["min"]
        assert r["tpot_s"]["max"] < r["latency_s"]["max"]
    # The server generated exactly what the client counted: warm-up plus 3 requests per level, 6 tokens each.
    assert after.generation_tokens_total - before.generation_tokens_total == (1 + 2 * 3) * 6
    measured_prompts = sum(sum(r["prompt_tokens"]) for r in receipt["results"])
    assert measured_prompts < after.prompt_tokens_total - before.prompt_tokens_total  # the warm-up's are extra
    path = write_receipt(receipt, tmp_path)
    assert json.loads(path.read_text())["kind"] == "serve"
    assert "| 2 | 0 |" in markdown_table(receipt) and path.with_suffix(".md").exists()


def test_errors_are_counted_not_raised(server):
    import openai

    # Every request of this client fails (no such route): the level records the failures, it does not raise.
    client = openai.OpenAI(base_url=server.base + "/no-such-api", api_key="none", max_retries=0)
    cfg = ServeBenchConfig(url=server.base + "/v1", concurrency=[2], requests=2, max_tokens=4, warmup=0)
    result = run_level(client, "demo", make_prompts(2, 4, seed=0), 2, cfg)
    assert result["errors"] == 2 and result["output_tokens"] == 0 and result["requests"] == 2
    assert any("404" in message or "NotFound" in message for message in result["error_messages"])
    assert result["ttft_s"]["p50"] is None and result["output_tok_s"] == 0


def test_prompts_are_fixed_by_the_seed_and_the_config_checks_its_input():
    assert make_prompts(3, 5, seed=1) == make_prompts(3, 5, seed=1) != make_prompts(3, 5, seed=2)
    assert all(len(p.split()) == 5 for p in make_prompts(3, 5, seed=1))
    with pytest.raises(ConfigError, match="loopback"):
        ServeBenchConfig(url="http://example.com:8000/v1")
    with pytest.raises(ConfigError, match="exactly one"):
        ServeBenchConfig()
    with pytest.raises(ConfigError, match="concurrency"):
        ServeBenchConfig(url="http://127.0.0.1:8000/v1", concurrency=[0])


def test_cli_starts_a_loopback_server_measures_and_stops_it(tmp_path, monkeypatch):
    from moetier.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the child builds its demo model here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["bench", "serve", "--start-model", "demo", "--serve-args=--device cpu --log-level warning"]
    args += ["--concurrency", "1", "--requests", "2", "--prompt-tokens", "8", "--max-tokens", "3"]
    assert main([*args, "--start-timeout", "90", "--out", str(tmp_path / "out")]) == 0
    receipt = json.loads(next((tmp_path / "out").glob("serve-*.json")).read_text())
    server = receipt["server"]
    assert server["started_by_bench"] and server["url"].startswith("http://127.0.0.1:") and server["exit_status"] == 0
    assert "--device" in server["command"] and server["start_seconds"] > 0
    assert receipt["results"][0]["errors"] == 0 and receipt["results"][0]["output_tokens"] == 2 * 3


def test_agent_sessions_extend_their_prefix_and_report_the_servers_counters(server):
    cfg = ServeBenchConfig(
        url=server.base + "/v1", concurrency=[2], requests=2, prompt_tokens=20, max_tokens=5, turns=3, turn_tokens=6,
        request_timeout=60,
    )  # fmt: skip
    before = server.wait_idle()
    receipt = run_serve_bench(cfg)
    after = server.wait_idle()
    (level,) = receipt["results"]
    assert level["errors"] == 0 and level["requests"] == 2 * 3 and level["turns"] == 3
    assert level["completion_tokens"] == [5] * 6
    # Each follow-up's prompt holds the last one's, its 5 generated tokens and 6 more words.
    assert len(set(level["prompt_tokens"])) > 2 and max(level["prompt_tokens"]) > min(level["prompt_tokens"]) + 10
    assert level["first_turn_ttft_s"]["max"] is not None and level["followup_ttft_s"]["max"] is not None
    counters = level["server_counters"]
    # The demo model is a V4 on the CPU: no graphs, but follow-ups start in finished turns' caches from the
    # prefix cache, and the counters moved by what the engine's stats did.
    assert counters["decode_graph_captures"] == 0 and counters["spare_cache_reuses"] >= 2
    assert counters["prefix_cache_hits"] > 0 and counters["preemptions"] == 0
    assert counters["prefix_cache_hits"] <= after.prefix_cache_hits - before.prefix_cache_hits
    assert "| 2 | 0 |" in markdown_table(receipt) and "3 turn(s)" in markdown_table(receipt)


def test_session_config_checks():
    with pytest.raises(ConfigError, match="--turns"):
        ServeBenchConfig(url="http://127.0.0.1:1/v1", turns=0)
