"""Recorded routing traces: recording from a tiny checkpoint, replay order and cycling, the benches under a trace."""

import argparse
import json

import pytest
import torch

from moetier import cli
from moetier.bench import decode, make_model
from moetier.bench.common import load_checkpoint
from moetier.bench.trace_routing import (
    RecordTraceConfig,
    RoutingTrace,
    TraceRoutingDispatcher,
    file_sha256,
    load_for_bench,
    load_trace,
    record_trace,
    save_trace,
)
from moetier.errors import ConfigError
from moetier.tiers.dispatcher import ExpertDispatcher, ResidentDispatcher

TINY_V4 = [
    "--shape", "deepseek-v4-flash", "--layers", "3", "--experts-per-layer", "16", "--hidden-size", "64",
    "--moe-intermediate-size", "32", "--vocab-size", "384", "--quiet",
    "--set", "num_attention_heads=4", "--set", "head_dim=32", "--set", "qk_rope_head_dim=8",
    "--set", "q_lora_rank=32", "--set", "o_lora_rank=16", "--set", "o_groups=2", "--set", "index_n_heads=4",
    "--set", "index_head_dim=16", "--set", "index_topk=4", "--set", "sliding_window=8",
    "--set", "num_experts_per_tok=2",  # top-2: a trace on experts {0, 1} is then a legal routing
]  # fmt: skip
LAYERS, EXPERTS, TOP_K = (0, 1, 2), 16, 2


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "v4"
    parser = argparse.ArgumentParser()
    make_model.configure_parser(parser)
    assert make_model.run(parser.parse_args([*TINY_V4, "--out", str(out), "--device", "cpu", "--dtype", "fp32"])) == 0
    return out


@pytest.fixture(scope="module")
def loaded(bench_model):
    loaded, _, _ = load_checkpoint(bench_model, "fp32", "cpu")
    return loaded


class Spy(ExpertDispatcher):
    """Keeps every call's ids and weights; computes nothing (zeros)."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def dispatch(self, layer, hidden, topk_ids, topk_weights):
        self.calls.append((layer, topk_ids.clone(), topk_weights.clone()))
        return torch.zeros_like(hidden)

    def seen(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [i for lay, i, _ in self.calls if lay == layer]
        weights = [w for lay, _, w in self.calls if lay == layer]
        return torch.cat(ids), torch.cat(weights)


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0] + 1)
    return torch.cat([model(ids[first : first + chunk], cache) for first in range(0, ids.shape[0], chunk)])


def _skewed_trace(rows: int = 64, seed: int = 0) -> RoutingTrace:
    """Every token on experts {0, 1} (in a random order per row), no weights: uniform 1/2."""
    generator = torch.Generator().manual_seed(seed)
    ids = {}
    for layer in LAYERS:
        flip = torch.randint(0, 2, (rows, 1), generator=generator)
        ids[layer] = torch.cat([flip, 1 - flip], dim=1)
    return RoutingTrace(ids, num_experts=EXPERTS, top_k=TOP_K, metadata={"model": "skewed-synthetic"})


def test_recorded_trace_replays_the_models_own_routing(bench_model, loaded, tmp_path):
    trace = record_trace(RecordTraceConfig(bench_model, tmp_path / "t.safetensors", 20, 8, dtype="fp32", device="cpu"))
    assert trace.layers == list(LAYERS) and trace.top_k == TOP_K and trace.num_experts == EXPERTS
    assert all(trace.ids[layer].shape == (20, TOP_K) for layer in LAYERS)
    # The model's own routing is spread out (so the skewed test below measures the trace, not the model).
    assert min(len(set(trace.ids[layer].flatten().tolist())) for layer in LAYERS) > 4
    for name in ("t.safetensors", "t.npz"):  # both file kinds round-trip exactly
        back = load_trace(save_trace(trace, tmp_path / name))
        assert back.metadata["tokens"] == "20" and back.metadata["prompt"] == "random token ids, seed 0"
        for i in LAYERS:
            assert torch.equal(back.ids[i], trace.ids[i]) and torch.equal(back.weights[i], trace.weights[i])

    model, store = loaded.model, loaded.store
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    model.use_dispatcher(ResidentDispatcher(store))
    reference = _prefill(model, prompt, 8)
    # Replaying the model's own ids and weights reproduces its output ...
    model.use_dispatcher(TraceRoutingDispatcher(ResidentDispatcher(store), back))
    torch.testing.assert_close(_prefill(model, prompt, 8), reference, rtol=1e-5, atol=1e-5)
    # ... and a different trace really replaces the routing.
    shifted = RoutingTrace({i: (t + 1) % EXPERTS for i, t in back.ids.items()}, EXPERTS, TOP_K, back.weights)
    model.use_dispatcher(TraceRoutingDispatcher(ResidentDispatcher(store), shifted))
    assert (_prefill(model, prompt, 8) - reference).abs().max() > 1e-2


def test_replay_feeds_trace_rows_in_token_order_and_cycles(bench_model, loaded, tmp_path):
    trace = record_trace(RecordTraceConfig(bench_model, tmp_path / "t.safetensors", 12, 12, dtype="fp32", device="cpu"))
    model = loaded.model
    spy = Spy(loaded.store)
    replay = TraceRoutingDispatcher(spy, trace)
    model.use_dispatcher(replay)
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(5))
    _prefill(model, prompt, 8)  # chunks of 8, 8, 4 tokens: 20 rows per layer from a 12-row trace
    order = list(range(12)) + list(range(8))
    for layer in LAYERS:
        ids, weights = spy.seen(layer)
        assert torch.equal(ids, trace.ids[layer][order]) and torch.equal(weights, trace.weights[layer][order])
        assert replay.cursor[layer] == 8 and replay.wraps[layer] == 1
    assert [c[1].shape[0] for c in spy.calls if c[0] == 0] == [8, 8, 4]
    # A 3-stream decode step takes 3 rows; rows of a layer without recorded weights are uniform 1/top_k.
    hand = RoutingTrace({i: trace.ids[i][:5] for i in LAYERS}, EXPERTS, TOP_K)
    replay = TraceRoutingDispatcher(spy, hand)
    spy.calls.clear()
    hidden = torch.randn(3, model.config.hidden_size)
    for _ in range(2):
        replay.dispatch(1, hidden, torch.zeros(3, TOP_K, dtype=torch.int64), torch.zeros(3, TOP_K))
    ids, weights = spy.seen(1)
    assert torch.equal(ids, hand.ids[1][[0, 1, 2, 3, 4, 0]]) and torch.all(weights == 0.5)


def test_skewed_trace_drives_decode_coverage_and_hit_rate(bench_model, tmp_path, monkeypatch):
    path = save_trace(_skewed_trace(), tmp_path / "skewed.safetensors")
    # Bandwidths are irrelevant here and the full-size measurement takes seconds of 2 GiB sums.
    monkeypatch.setattr(decode, "measure_bounds", lambda quick: {"host_read_gbps": 10.0, "h2d_pinned_gbps": None})
    args = ["bench", "decode", "--model", str(bench_model), "--routing-trace", str(path), "--modes", "copy,tiered"]
    args += ["--streams", "1,2", "--prompt-len", "8", "--warmup", "1", "--steps", "4", "--repeats", "2"]
    args += ["--cache-fraction", str(2 * len(LAYERS) / (len(LAYERS) * EXPERTS)), "--dtype", "fp32", "--device", "cpu"]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 0
    receipt = json.loads(next((tmp_path / "out").glob("decode-*.json")).read_text())
    assert receipt["plan"]["cache_slots"] == 2 * len(LAYERS)  # two slots per layer
    info = receipt["config"]["routing_trace"]
    assert info["sha256"] == file_sha256(path) and info["metadata"]["model"] == "skewed-synthetic"
    assert info["metadata"]["top_k"] == "2" and info["rows_per_layer"] == {"0": 64, "1": 64, "2": 64}
    assert any("skewed.safetensors" in note for note in receipt["notes"])
    for r in receipt["results"]:
        assert r["distinct_experts_per_layer"] == {"0": 2, "1": 2, "2": 2}, r["mode"]
        assert r["hit_rate"] >= 0.95, (r["mode"], r["streams"], r["hit_rate"])
        assert r["routing_trace_wraps"] == 0  # 2 streams x (8 + 1 + 8) tokens < 64 rows


def test_prefill_cli_round_trip_reports_the_traces_coverage(bench_model, tmp_path, capsys):
    trace_path = tmp_path / "rec.npz"
    record = ["bench", "record-trace", "--model", str(bench_model), "--out", str(trace_path), "--tokens", "24"]
    assert cli.main([*record, "--chunk-tokens", "24", "--dtype", "fp32", "--device", "cpu"]) == 0
    assert "3 MoE layers x 24 tokens, top_k=2 of 16 experts" in capsys.readouterr().out
    trace = load_trace(trace_path)
    args = ["bench", "prefill", "--model", str(bench_model), "--routing-trace", str(trace_path), "--modes", "sync"]
    args += ["--prompt-lens", "32", "--chunk-tokens", "16", "--dtype", "fp32", "--device", "cpu", "--quick-bounds"]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 0
    receipt = json.loads(next((tmp_path / "out").glob("prefill-*.json")).read_text())
    assert receipt["config"]["routing_trace"]["sha256"] == file_sha256(trace_path)
    (result,) = receipt["results"]
    # 32 prompt tokens from a 24-row trace: chunk 1 = rows 0-15, chunk 2 = rows 16-23 then 0-7.
    chunks = [list(range(16)), list(range(16, 24)) + list(range(8))]
    expected = [{str(i): len(set(trace.ids[i][rows].flatten().tolist())) for i in LAYERS} for rows in chunks]
    assert result["distinct_experts_per_chunk"] == expected and result["routing_trace_wraps"] == 1


def test_mismatched_traces_are_one_line_errors(bench_model, loaded, tmp_path, capsys):
    ids = {i: torch.zeros(4, 3, dtype=torch.int64) + torch.arange(3) for i in LAYERS}
    wide = save_trace(RoutingTrace(ids, EXPERTS, 3), tmp_path / "k3.safetensors")
    message = "routing trace is top_k=3 over 16 experts but the model routes top_k=2 over 16 experts"
    with pytest.raises(ConfigError, match=message):
        TraceRoutingDispatcher(ResidentDispatcher(loaded.store), load_trace(wide))
    with pytest.raises(ConfigError, match=message):
        load_for_bench(wide, bench_model)
    many = RoutingTrace({i: torch.zeros(4, 2, dtype=torch.int64) for i in LAYERS}, 32, TOP_K)
    with pytest.raises(ConfigError, match="top_k=2 over 32 experts but the model routes top_k=2 over 16"):
        TraceRoutingDispatcher(ResidentDispatcher(loaded.store), many)
    partial = RoutingTrace({0: torch.zeros(4, 2, dtype=torch.int64)}, EXPERTS, TOP_K)
    with pytest.raises(ConfigError, match=r"no ids for MoE layer\(s\) \[1, 2\]"):
        TraceRoutingDispatcher(ResidentDispatcher(loaded.store), partial)
    with pytest.raises(ConfigError, match="holds experts 0..16, outside 0..15"):
        RoutingTrace({0: torch.tensor([[0, 16]])}, EXPERTS, TOP_K)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_trace(tmp_path / "junk.safetensors")
    # Through the command line: exit 2 and one line, before any weight is loaded.
    args = ["bench", "decode", "--model", str(bench_model), "--routing-trace", str(wide), "--device", "cpu"]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moetier: error: {message}" and not (tmp_path / "out").exists()
