"""``moetier bench hf`` (the transformers + accelerate baseline) and its merge into ``bench decode --hf-baseline``."""

import json
import shutil

import pytest
import torch
from reference import load_reference, reference_run, save_tiny
from test_qwen3_moe import tiny_qwen3_config

from moetier.bench import hf_baseline
from moetier.bench.decode import DecodeBenchConfig, markdown_table, run_decode_bench
from moetier.bench.hf_baseline import HFBenchConfig, bench_prompts, run_hf_bench
from moetier.cli import main
from moetier.errors import ConfigError

PROMPT_LEN, WARMUP, STEPS, REPEATS = 10, 1, 3, 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen3-moe"
    save_tiny(tiny_qwen3_config(), path, dtype=torch.float32)
    return path


def _reference_tokens(path, streams: int, count: int, seed: int = 0) -> list[int]:
    """transformers' own greedy decoding (batch of one) of the first bench prompt for ``streams``."""
    hf = load_reference(path)
    prompt = bench_prompts(seed, streams, PROMPT_LEN, hf.config.vocab_size)[0]
    return reference_run(hf, prompt, count)[2]


def test_cli_receipt_measures_transformers_greedy_decode(qwen, tmp_path):
    argv = ["bench", "hf", "--model", str(qwen), "--streams", "1,2", "--prompt-len", str(PROMPT_LEN)]
    argv += ["--warmup", str(WARMUP), "--steps", str(STEPS), "--repeats", str(REPEATS), "--dtype", "fp32"]
    assert main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("hf-decode-*.json")
    receipt = json.loads(path.read_text())
    assert receipt["kind"] == "hf-decode" and receipt["error"] is None
    assert receipt["dtype_used"] == "fp32" and receipt["fallback_reason"] is None
    assert receipt["placement"]["mode"].startswith("cpu-only") and "CPU-only" in receipt["notes"][0]
    # The placement accounts for every parameter and buffer.
    reference = load_reference(qwen)
    weights = sum(t.numel() * 4 for t in [*reference.parameters(), *reference.buffers()])
    assert receipt["placement"]["per_device"] == {"cpu": {"modules": 1, "bytes": weights}}
    assert receipt["placement"]["load_seconds"] > 0
    for r in receipt["results"]:
        assert r["mode"] == "hf-accelerate" and r["timed_steps"] == STEPS * REPEATS and not r["stopped_early"]
        assert len(r["seconds"]) == REPEATS and r["prefill_seconds"] > 0
        assert 0 < r["tok_s"]["min"] <= r["tok_s"]["median"] <= r["tok_s"]["max"]
        assert r["tok_s"]["max"] == pytest.approx(max(r["streams"] * STEPS / s for s in r["seconds"]))
        # The baseline runs the real model: its first stream decodes what transformers' greedy decoding does.
        count = 1 + WARMUP + STEPS * REPEATS
        assert r["tokens"] == _reference_tokens(qwen, r["streams"], count)
    assert len(set(receipt["results"][0]["tokens"])) > 1  # not a degenerate constant stream
    assert "| hf-accelerate | 2 |" in path.with_suffix(".md").read_text()


def test_time_cap_stops_early_and_says_so(qwen):
    cfg = HFBenchConfig(qwen, [1], PROMPT_LEN, steps=50, repeats=3, max_seconds=1e-6, dtype="fp32", device="cpu")
    (result,) = run_hf_bench(cfg)["results"]
    assert result["timed_steps"] == 1 and result["steps_per_repeat"] == [1] and result["stopped_early"]


def test_corrupt_checkpoint_gives_an_error_receipt(qwen, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    out = tmp_path / "out"
    assert main(["bench", "hf", "--model", str(broken), "--device", "cpu", "--out", str(out)]) == 1
    (path,) = out.glob("hf-decode-*.json")
    receipt = json.loads(path.read_text())
    assert receipt["error"].startswith("load: ") and receipt["results"] == [] and receipt["traceback"]
    assert "ERROR: load:" in path.with_suffix(".md").read_text()


@pytest.mark.parametrize("fallback", ["fp32", "autocast", "none"])
def test_a_failed_forward_falls_back_as_asked(qwen, monkeypatch, fallback):
    real_forward = hf_baseline._Stopwatch._forward

    def bf16_breaks(self, ids):  # what transformers' DeepSeek-V4 does in bf16: fp32 norm output into a bf16 linear
        if self.model.dtype == torch.bfloat16 and not self.autocast:
            raise RuntimeError("expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16")
        return real_forward(self, ids)

    monkeypatch.setattr(hf_baseline._Stopwatch, "_forward", bf16_breaks)
    cfg = HFBenchConfig(qwen, streams=[1], prompt_len=PROMPT_LEN, steps=2, device="cpu", fallback=fallback)
    receipt = run_hf_bench(cfg)
    assert "same dtype" in (receipt["fallback_reason"] or receipt["error"])
    if fallback == "none":
        assert receipt["error"].startswith("decode: forward at 1 stream(s): RuntimeError") and not receipt["results"]
        return
    assert receipt["error"] is None and receipt["results"][0]["timed_steps"] == 2
    assert receipt["autocast"] == (fallback == "autocast")
    assert receipt["dtype_used"] == {"fp32": "fp32", "autocast": "bf16 (torch.autocast)"}[fallback]
    assert receipt["placement"]["dtype"] == {"fp32": "float32", "autocast": "bfloat16"}[fallback]


def test_decode_merges_the_baseline_with_ratios_from_the_same_receipt(qwen):
    cfg = DecodeBenchConfig(
        model=qwen,
        modes=["naive", "tiered"],
        streams=[1, 2],
        steps=2,
        repeats=1,
        warmup=1,
        prompt_len=PROMPT_LEN,
        dtype="fp32",
        device="cpu",
        cache_fraction=0.25,
        quick_bounds=True,
        hf_baseline=True,
        hf_args="--steps 2 --warmup 1",
    )
    receipt = run_decode_bench(cfg)
    hf = receipt["hf_baseline"]
    assert hf["error"] is None and hf["config"]["prompt_len"] == PROMPT_LEN and hf["config"]["streams"] == [1, 2]
    by_key = {(r["mode"], r["streams"]): r for r in receipt["results"]}
    assert {m for m, _ in by_key} == {"naive", "tiered", "hf-accelerate"}
    for (mode, streams), r in by_key.items():
        hf_median = by_key["hf-accelerate", streams]["tok_s"]["median"]
        assert hf_median == hf["results"][[1, 2].index(streams)]["tok_s"]["median"]
        if mode != "hf-accelerate":
            assert r["ratio_to_hf"] == pytest.approx(r["tok_s"]["median"] / hf_median)
    # The subprocess decoded the prompt bench decode feeds (same seed, length and stream count).
    assert hf["results"][0]["tokens"] == _reference_tokens(qwen, 1, 1 + 1 + 2)
    table = markdown_table(receipt)
    assert "| x hf |" in table and "| hf-accelerate | 1 |" in table and "hf-accelerate: cpu-only" in table


def test_subprocess_failure_becomes_a_note(qwen):
    cfg = DecodeBenchConfig(model=qwen, hf_baseline=True, device="cpu", hf_args="--fallback bogus")
    hf = hf_baseline.run_subprocess(cfg)
    assert "exited 2 without a receipt" in hf["error"] and "invalid choice: 'bogus'" in hf["error"]
    results, notes = [], []
    hf_baseline.merge_into_decode(results, notes, hf)
    assert results == [] and notes[0].startswith("hf-accelerate baseline failed")


def test_config_rejects_bad_values(qwen):
    with pytest.raises(ConfigError, match="gpu-memory"):
        HFBenchConfig(qwen, gpu_memory="24G")
    with pytest.raises(ConfigError, match="fallback"):
        HFBenchConfig(qwen, fallback="fp16")
    with pytest.raises(ConfigError, match="max-seconds"):
        HFBenchConfig(qwen, max_seconds=0)
