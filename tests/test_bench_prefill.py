"""``moetier bench prefill`` on a tiny real-layout V4 checkpoint, and its synchronous copy-then-compute baseline."""

import argparse
import json

import pytest
import torch

from moetier.bench import make_model
from moetier.bench.overlap import intersection_length, overlap_summary
from moetier.bench.prefill import (
    DEFAULT_MODES,
    PrefillBenchConfig,
    SyncCopyDispatcher,
    attention_bytes,
    markdown_table,
    run_prefill_bench,
    write_receipt,
)
from moetier.bench.trace_kernels import heaviest_kernels
from moetier.errors import ConfigError
from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator

TINY_V4 = [
    "--shape", "deepseek-v4-flash", "--layers", "3", "--experts-per-layer", "16", "--hidden-size", "64",
    "--moe-intermediate-size", "32", "--vocab-size", "384", "--quiet",
    "--set", "num_attention_heads=4", "--set", "head_dim=32", "--set", "qk_rope_head_dim=8",
    "--set", "q_lora_rank=32", "--set", "o_lora_rank=16", "--set", "o_groups=2", "--set", "index_n_heads=4",
    "--set", "index_head_dim=16", "--set", "index_topk=4", "--set", "sliding_window=8",
]  # fmt: skip
TOO_LONG = 1 << 20


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "v4"
    parser = argparse.ArgumentParser()
    make_model.configure_parser(parser)
    assert make_model.run(parser.parse_args([*TINY_V4, "--out", str(out), "--device", "cpu"])) == 0
    return out


def _store(seed: int = 0) -> ExpertStore:
    layout = ExpertLayout(
        moe_layers=(0, 1), num_experts=8, hidden_size=16, intermediate_size=8, top_k=2, swiglu_limit=7.0
    )
    store = ExpertStore(layout, torch.float32, device_allocator("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            block = store.block_for_loading(layer, expert).block
            block.copy_(torch.randn(block.shape, generator=generator) * 0.3)
    return store


@pytest.mark.parametrize("staging", [None, 3])
def test_sync_dispatcher_copies_every_used_expert_before_computing(staging):
    store = _store()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 16, generator=generator)
    ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(10)])  # experts 6, 7 unused
    weights = torch.rand(10, 2, generator=generator)
    trace: list = []
    sync = SyncCopyDispatcher(store, staging_experts=staging, trace=trace)
    out = sync.dispatch(1, hidden, ids, weights)
    torch.testing.assert_close(out, ResidentDispatcher(store).dispatch(1, hidden, ids, weights), rtol=1e-6, atol=1e-6)
    used = sorted(set(ids.flatten().tolist()))
    assert len(used) < 8
    batch = staging or len(used)
    # Each batch: all its copies issued (and waited for) before any of its experts computes.
    for first in range(0, len(used), batch):
        part = used[first : first + batch]
        expected = [("copy", 1, e) for e in part] + [("compute", 1, e) for e in part]
        assert trace[2 * first : 2 * first + 2 * len(part)] == expected
    assert len(trace) == 2 * len(used)
    totals = sync.metrics.total()
    assert totals.copy_bytes == len(used) * store.layout.block_bytes(torch.float32)
    assert totals.experts_miss == len(used) and totals.uses_miss == ids.numel() and sync.metrics.tokens == 0


def test_receipt_is_complete_and_ratios_come_from_the_same_run(bench_model, tmp_path):
    config = DeepseekV4ForCausalLM.config_from_hf(json.loads((bench_model / "config.json").read_text()))
    budget = int(attention_bytes(config, TOO_LONG, 32, 4) / 0.8) - 1  # the longest prompt does not fit
    assert attention_bytes(config, 96, 32, 4) < 0.8 * budget
    cfg = PrefillBenchConfig(
        model=bench_model,
        prompt_lens=[5, 48, 96, TOO_LONG],
        chunk_tokens=32,
        dtype="fp32",
        device="cpu",
        cache_fraction=0.1,
        repeats=2,
        quick_bounds=True,
        memory_budget_bytes=budget,
        profile=True,
        host_profile=True,
    )
    receipt = run_prefill_bench(cfg)
    by_key = {(r["mode"], r["prompt_len"]): r for r in receipt["results"]}
    assert set(by_key) == {(m, n) for m in DEFAULT_MODES for n in (5, 48, 96)}
    assert {(s["mode"], s["prompt_len"]) for s in receipt["skipped"]} == {(m, TOO_LONG) for m in DEFAULT_MODES}
    assert any(f"{TOO_LONG} tokens: skipped" in note for note in receipt["notes"])
    assert receipt["environment"]["versions"]["torch"] and receipt["bounds"]["host_read_gbps"] > 0
    bandwidth = receipt["bounds"][receipt["bounds"]["streaming_bound_uses"]]
    block = receipt["plan"]["expert_block_bytes"]
    assert block == 3 * 32 * 64 * 4 and receipt["plan"]["cache_slots"] == round(0.1 * 3 * 16)
    for (_, length), r in by_key.items():
        chunks = r["distinct_experts_per_chunk"]
        assert r["chunks"] == len(chunks) == -(-length // 32) and r["chunk_tokens"] == min(32, length)
        assert all(set(c) == {"0", "1", "2"} and 0 < min(c.values()) <= max(c.values()) <= 16 for c in chunks)
        assert set(r["distinct_experts_per_layer_per_chunk"]) == {"0", "1", "2"}
        assert r["ttft_s"]["min"] <= r["ttft_s"]["median"] <= r["ttft_s"]["max"] and len(r["seconds"]) == 2
        touched = sum(block * sum(c.values()) for c in chunks)
        assert r["bound_tok_s"] == pytest.approx(length * bandwidth * 1e9 / touched)
        assert r["ratio_to_bound"] == pytest.approx(r["tok_s"]["median"] / r["bound_tok_s"])
        overlap_bound = min(r["bound_tok_s"], by_key["resident", length]["tok_s"]["median"])
        assert r["ratio_to_overlap_bound"] == pytest.approx(r["tok_s"]["median"] / overlap_bound)
        assert r["ratio_to_sync"] == pytest.approx(r["tok_s"]["median"] / by_key["sync", length]["tok_s"]["median"])
        assert r["ratio_to_resident"] == pytest.approx(
            r["tok_s"]["median"] / by_key["resident", length]["tok_s"]["median"]
        )
        # fp32: every placement computes the same first token, and the same routing.
        assert r["first_token"] == by_key["resident", length]["first_token"]
        assert chunks == by_key["sync", length]["distinct_experts_per_chunk"]
    assert max(by_key["sync", 5]["distinct_experts_per_chunk"][0].values()) < 16  # a 5-token chunk: partial coverage
    for length in (5, 48, 96):
        sync, tiered = by_key["sync", length], by_key["tiered", length]
        # The baseline copies exactly the experts each chunk touched, in every layer.
        assert sync["copy_bytes"] == sum(block * sum(c.values()) for c in sync["distinct_experts_per_chunk"])
        assert sync["hit_rate"] == 0.0 and sync["copy_wait_seconds"] > 0
        assert 0 <= tiered["hit_rate"] <= 1 and tiered["copy_bytes"] <= sync["copy_bytes"]
        assert by_key["resident", length]["coverage_from"] == "sync"
    # Off CUDA the profile sees no device copies or kernels, but it ran both profiled modes over two chunks.
    assert set(receipt["profile"]) == {"sync", "tiered"}
    assert all(p["tokens"] == 64 and p["copies"] == 0 for p in receipt["profile"].values())
    # The host profile ran every mode over two chunks and names where its Python went, heaviest first.
    assert set(receipt["host_profile"]) == set(DEFAULT_MODES)
    for summary in receipt["host_profile"].values():
        top = summary["top_by_own_time"]
        assert summary["tokens"] == 64 and summary["calls"] > len(top) > 0 and summary["wall_s_under_profiler"] > 0
        assert [r["own_ms"] for r in top] == sorted((r["own_ms"] for r in top), reverse=True)
        assert all(r["cum_ms"] >= r["own_ms"] for r in top)
    cumulative = {r["function"]: r for r in receipt["host_profile"]["tiered"]["top_by_own_time"]}
    assert any("tiers/" in name or "kernels/" in name or "models/" in name for name in cumulative)
    path = write_receipt(receipt, tmp_path)
    assert json.loads(path.read_text())["kind"] == "prefill"
    assert "- host profile tiered (64 tokens)" in markdown_table(receipt)
    assert "| tiered | 96 |" in markdown_table(receipt) and path.with_suffix(".md").exists()


def test_config_rejects_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="unknown prefill bench mode"):
        PrefillBenchConfig(model=tmp_path, modes=["naive"])
    with pytest.raises(ConfigError, match="chunk-tokens"):
        PrefillBenchConfig(model=tmp_path, chunk_tokens=0)
    with pytest.raises(ConfigError, match="staging-slots"):  # refused before any weights load
        PrefillBenchConfig(model=tmp_path, staging_slots=0)


def test_cli_writes_one_json_and_one_markdown(bench_model, tmp_path):
    from moetier.cli import main

    args = ["bench", "prefill", "--model", str(bench_model), "--prompt-lens", "40", "--chunk-tokens", "16"]
    args += ["--modes", "sync,tiered", "--dtype", "fp32", "--device", "cpu", "--quick-bounds"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    (receipt,) = tmp_path.glob("prefill-*.json")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]
    results = json.loads(receipt.read_text())["results"]
    assert [(r["mode"], r["chunks"]) for r in results] == [("sync", 3), ("tiered", 3)]
    assert results[1]["ratio_to_sync"] == pytest.approx(results[1]["tok_s"]["median"] / results[0]["tok_s"]["median"])
    assert main(["bench", "prefill", "--model", str(bench_model), "--prompt-lens", "8q"]) == 2  # one-line error


def test_overlap_summary_measures_hidden_copy_time():
    def event(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 100),
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 100),  # overlaps the first copy
            event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 400),  # not an expert copy
            event("kernel", "gemm", 120, 60),  # 30 us under copies
            event("kernel", "gemm", 170, 100),  # 0 us more under copies (its first 10 us are the previous kernel's)
            event("cpu_op", "aten::mm", 0, 1000),  # host events do not count
        ]
    }
    summary = overlap_summary(trace)
    assert summary["copies"] == 2 and summary["kernels"] == 2
    assert summary["copy_busy_s"] == pytest.approx(150e-6) and summary["kernel_busy_s"] == pytest.approx(150e-6)
    assert summary["overlap_s"] == pytest.approx(30e-6)
    assert summary["copy_hidden_share"] == pytest.approx(0.2) and summary["window_s"] == pytest.approx(270e-6)
    assert summary["hidden_share_of_shorter"] == pytest.approx(0.2)  # equal busy times here
    assert intersection_length([(0, 10), (20, 30)], [(5, 25)]) == 10
    heaviest = heaviest_kernels(trace)
    assert heaviest == [{"name": "gemm", "count": 2, "us": 160.0}]  # kernels only, by name, summed
