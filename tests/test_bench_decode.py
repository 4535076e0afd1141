"""``moetier bench decode`` on a tiny real-layout checkpoint: a complete receipt whose ratios come from one run."""

import argparse
import json
from functools import partial

import pytest
import torch
from test_tiers_policies import random_store

from moetier.bench import decode as decode_bench
from moetier.bench.decode import (
    DEFAULT_MODES,
    MODES,
    DecodeBenchConfig,
    markdown_table,
    run_decode_bench,
    write_receipt,
)
from moetier.bench.make_model import configure_parser, run
from moetier.errors import ConfigError

TINY_V4 = [
    "--shape", "deepseek-v4-flash", "--layers", "3", "--experts-per-layer", "16", "--hidden-size", "64",
    "--moe-intermediate-size", "32", "--vocab-size", "384", "--quiet",
    "--set", "num_attention_heads=4", "--set", "head_dim=32", "--set", "qk_rope_head_dim=8",
    "--set", "q_lora_rank=32", "--set", "o_lora_rank=16", "--set", "o_groups=2", "--set", "index_n_heads=4",
    "--set", "index_head_dim=16", "--set", "index_topk=4", "--set", "sliding_window=8",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    import argparse

    out = tmp_path_factory.mktemp("bench") / "v4"
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert run(parser.parse_args([*TINY_V4, "--out", str(out), "--device", "cpu"])) == 0
    return out


def test_receipt_is_complete_and_ratios_come_from_the_same_run(bench_model, tmp_path):
    cfg = DecodeBenchConfig(
        model=bench_model,
        streams=[1, 2],
        steps=3,
        repeats=2,
        warmup=1,
        prompt_len=12,
        dtype="fp32",
        device="cpu",
        cache_fraction=0.1,
        quick_bounds=True,
        profile=True,
        host_steps=2,
    )
    receipt = run_decode_bench(cfg)
    assert {r["mode"] for r in receipt["results"]} == set(DEFAULT_MODES)
    assert receipt["environment"]["versions"]["torch"] and receipt["bounds"]["host_read_gbps"] > 0
    assert receipt["bounds"]["host_read_source"] == "cpu"  # off CUDA there is no DMA read beside the CPU's
    assert "(the CPU's read alone: no DMA engine to read beside it)" in markdown_table(receipt).splitlines()[0]
    assert receipt["plan"]["cache_slots"] == round(0.1 * 3 * 16)
    by_key = {(r["mode"], r["streams"]): r for r in receipt["results"]}
    for (mode, streams), r in by_key.items():
        assert r["tok_s"]["min"] <= r["tok_s"]["median"] <= r["tok_s"]["max"]
        assert r["ratio_to_naive"] == pytest.approx(r["tok_s"]["median"] / by_key["naive", streams]["tok_s"]["median"])
        if mode != "resident":  # every offloaded mode reports its coverage and traffic
            assert set(r["distinct_experts_per_layer"]) == {"0", "1", "2"}
            assert 0 < max(r["distinct_experts_per_layer"].values()) <= 16
            assert r["bound_dram_tok_s"] > 0 and 0 <= r["hit_rate"] <= 1
            resident = by_key["resident", streams]["tok_s"]["median"]
            step = streams / resident + streams / r["bound_dram_tok_s"]  # seconds: the two one after the other
            assert r["bound_serial_tok_s"] == pytest.approx(streams / step) and r["bound_serial_tok_s"] < resident
            assert r["ratio_to_serial_bound"] == pytest.approx(r["tok_s"]["median"] / r["bound_serial_tok_s"])
            if mode != "naive":  # the x naive a split would reach at either bound
                naive = by_key["naive", streams]["tok_s"]["median"]
                assert r["naive_ratio_at_dram_bound"] == pytest.approx(r["bound_dram_tok_s"] / naive)
                assert r["naive_ratio_at_serial_bound"] == pytest.approx(r["bound_serial_tok_s"] / naive)
                assert r["naive_ratio_at_serial_bound"] < r["naive_ratio_at_dram_bound"]
    assert by_key["naive", 1]["hit_rate"] == 0.0  # no cache at all
    assert by_key["naive", 1]["copy_bytes_per_token"] > 0 and by_key["cpu", 1]["cpu_pairs_per_token"] > 0
    # fp32: every placement computes the same tokens.
    assert all(share == 1.0 for share in receipt["greedy_tokens_agree"].values())
    path = write_receipt(receipt, tmp_path)
    assert json.loads(path.read_text())["kind"] == "decode"
    assert "| tiered | 2 |" in markdown_table(receipt) and path.with_suffix(".md").exists()
    profile = path.with_name(path.stem + "-profile.txt").read_text()
    assert "aten::" in profile and "cProfile of 2 steps" in profile and "dispatch" in profile
    # Host phases per step, clocked without a profiler, for every result.
    for r in receipt["results"]:
        phases = r["host_ms_per_step"]
        # The attention runs inside each layer's segment (contiguous caches: deepseek_v4_static_decode).
        assert phases["step"] >= phases["v4.dispatch"] > 0 and phases["segments"] > 0 and "v4.attend" not in phases
    tiered = by_key["tiered", 1]["host_ms_per_step"]
    assert tiered["v4.dispatch"] >= tiered["tiers.route"] > 0 and tiered["tiers.cpu_job"] > 0
    assert "| tiered | 1 |" in markdown_table(receipt).split("Host wall ms per step")[1]


def test_host_wait_mode_runs_everywhere_and_tiered_says_when_the_host_waited(bench_model):
    assert "tiered-host" in MODES and "tiered-host" not in DEFAULT_MODES
    cfg = DecodeBenchConfig(
        model=bench_model,
        modes=["naive", "tiered", "tiered-host"],
        streams=[1],
        steps=2,
        repeats=1,
        warmup=1,
        prompt_len=8,
        dtype="fp32",
        device="cpu",
        cache_fraction=0.1,
        quick_bounds=True,
        host_steps=2,
    )
    receipt = run_decode_bench(cfg)
    assert {r["mode"] for r in receipt["results"]} == {"naive", "tiered", "tiered-host"}
    assert any(note.startswith("tiered: the host thread waited") for note in receipt["notes"])  # no CUDA here
    assert not any(note.startswith("tiered-host:") for note in receipt["notes"])  # it waits by design
    assert receipt["greedy_tokens_agree"]["tiered-host@1"] == receipt["greedy_tokens_agree"]["tiered@1"] == 1.0


def test_resident_with_host_tables_is_a_mode_with_the_same_tokens(bench_model):
    cfg = DecodeBenchConfig(
        model=bench_model, modes=["resident", "resident-host"], streams=[1], steps=2, repeats=1, warmup=1,
        prompt_len=8, dtype="fp32", device="cpu", quick_bounds=True, host_steps=2,
    )  # fmt: skip
    receipt = run_decode_bench(cfg)
    assert [r["mode"] for r in receipt["results"]] == ["resident", "resident-host"]
    assert receipt["greedy_tokens_agree"]["resident-host@1"] == 1.0
    assert "resident-host" in MODES and "resident-host" not in DEFAULT_MODES


def test_config_rejects_bad_values(bench_model):
    with pytest.raises(ConfigError, match="unknown bench mode"):
        DecodeBenchConfig(model=bench_model, modes=["warp"])
    with pytest.raises(ConfigError, match="cache-fraction"):
        DecodeBenchConfig(model=bench_model, cache_fraction=1.5)
    with pytest.raises(ConfigError, match="host-steps"):
        DecodeBenchConfig(model=bench_model, host_steps=0)
    with pytest.raises(ConfigError, match="not TieredConfig fields"):
        DecodeBenchConfig(model=bench_model, tiered_options={"mapped_books": 1})
    with pytest.raises(ConfigError, match="mapped_bookkeeping_every must be an integer >= 1"):
        DecodeBenchConfig(model=bench_model, tiered_options={"mapped_bookkeeping_every": 0})


def test_tiered_options_reach_every_tiered_mode_but_naive(bench_model):
    """``--tiered KEY=JSON``: one TieredConfig field for the measured modes, the naive baseline left as it is."""
    cfg = DecodeBenchConfig(model=bench_model, tiered_options={"mapped_bookkeeping_every": 7, "decode_prefetch": 1})
    store = random_store()
    for mode, every in (("mapped-cpu", 7), ("tiered", 7), ("naive", 4)):
        dispatcher = decode_bench._dispatcher(mode, store, cfg, torch.device("cpu"), 2)
        assert dispatcher.mapped.bookkeeping_every == every, mode
        assert dispatcher.config.decode_prefetch == (0 if mode == "naive" else 1)
        dispatcher.close()


def test_paged_fp8_kv_caches_run_and_bad_layouts_are_refused(bench_model):
    cfg = DecodeBenchConfig(
        model=bench_model, modes=["naive"], streams=[2], steps=2, repeats=1, warmup=1, prompt_len=8,
        dtype="fp32", device="cpu", quick_bounds=True, host_steps=2, kv_layout="paged", kv_dtype="fp8",
    )  # fmt: skip
    receipt = run_decode_bench(cfg)
    assert receipt["config"]["kv_layout"] == "paged" and receipt["config"]["kv_dtype"] == "fp8"
    assert receipt["results"][0]["tok_s"]["median"] > 0
    with pytest.raises(ConfigError, match="kv-layout"):
        DecodeBenchConfig(model=bench_model, kv_layout="ring")
    with pytest.raises(ConfigError, match="kv-dtype"):
        DecodeBenchConfig(model=bench_model, kv_dtype="int4")


def test_trace_saves_the_timeline_of_the_profiled_steps(bench_model, tmp_path):
    import gzip

    cfg = DecodeBenchConfig(
        model=bench_model, modes=["naive", "tiered"], streams=[1], steps=2, repeats=1, warmup=1, prompt_len=8,
        dtype="fp32", device="cpu", cache_fraction=0.1, quick_bounds=True, host_steps=2, trace=["tiered"],
        trace_dir=tmp_path,
    )  # fmt: skip
    run_decode_bench(cfg)
    assert [p.name for p in tmp_path.iterdir()] == ["decode-trace-tiered.json.gz"]  # only the asked mode
    events = json.loads(gzip.decompress((tmp_path / "decode-trace-tiered.json.gz").read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    # The phases of a decode step, the CPU tier's job on its worker thread among them.
    assert {"segments", "v4.dispatch", "tiers.route", "tiers.device", "tiers.cpu_job"} <= names
    with pytest.raises(ConfigError, match="unknown bench mode"):
        DecodeBenchConfig(model=bench_model, trace=["warp"])


def test_long_prompts_are_prefilled_in_chunks_with_the_same_greedy_tokens(bench_model):
    """Long-context runs prefill each stream in chunks (bounded attention scores): same tokens as one call."""
    import torch

    from moetier.bench.common import load_checkpoint
    from moetier.bench.decode import _DecodeRun, _time_decode

    loaded, device, _ = load_checkpoint(bench_model, "fp32", "cpu")
    vocab = loaded.model.config.vocab_size
    tokens = {}
    for chunk in (64, 7):  # one call, then chunks of 7 (not a divisor of 20)
        cfg = DecodeBenchConfig(
            model=bench_model, streams=[2], steps=3, repeats=1, warmup=1, prompt_len=20, prefill_chunk=chunk,
            dtype="fp32", device="cpu",
        )  # fmt: skip
        run = _DecodeRun(loaded.model, 2, cfg, vocab)
        first = run.prefill()
        assert all(c.length == 20 for c in run.caches)
        tokens[chunk] = (
            first.tolist(),
            _time_decode(partial(_DecodeRun, loaded.model, 2, cfg, vocab), loaded.model.dispatcher)[1],
        )
        assert torch.is_tensor(first)
    assert tokens[64] == tokens[7]
    with pytest.raises(ConfigError, match="prefill-chunk"):
        DecodeBenchConfig(model=bench_model, prefill_chunk=0)


def test_warm_up_waits_for_the_split_trial_within_the_caches_room(bench_model):
    """A dispatcher whose split chooser never settles: the warm-up stops at the cap, and the caches hold it all."""
    from moetier.bench import decode
    from moetier.bench.common import load_checkpoint

    loaded, _, _ = load_checkpoint(bench_model, "fp32", "cpu")
    cfg = DecodeBenchConfig(model=bench_model, streams=[1], steps=2, repeats=1, warmup=1, prompt_len=8, dtype="fp32")

    class Unsettled:
        asked = 0

        def split_settled(self, tokens: int) -> bool:
            self.asked += 1
            return False

    def run():
        return decode._DecodeRun(loaded.model, 1, cfg, loaded.model.config.vocab_size)

    seconds, tokens, trial_steps = decode._time_decode(run, Unsettled())
    assert trial_steps == decode._TRIAL_STEPS_CAP and len(tokens) == 2 and len(seconds) == 1


def test_forced_inputs_time_the_same_tokens_after_the_same_context_whatever_the_trial(bench_model, monkeypatch):
    """``inputs="forced"``: each step is fed tokens drawn from the seed, not its own output, and the timed steps run
    on a fresh run once the split chooser settled: however many trial steps a dispatcher took, the timed window's
    inputs and context are the same, so its outputs are too."""
    from moetier.bench import decode
    from moetier.bench.common import load_checkpoint

    loaded, _, _ = load_checkpoint(bench_model, "fp32", "cpu")
    vocab = loaded.model.config.vocab_size
    cfg = DecodeBenchConfig(
        model=bench_model, streams=[2], steps=3, repeats=2, warmup=2, prompt_len=8, dtype="fp32", inputs="forced"
    )

    class SettlesAfter:
        def __init__(self, steps: int) -> None:
            self.left = steps

        def split_settled(self, tokens: int) -> bool:
            self.left -= 1
            return self.left < 0

    fed = []
    real_step = decode._DecodeRun.step

    def recording_step(self, tokens):
        fed.append(tokens.tolist())
        return real_step(self, tokens)

    outputs = {}
    monkeypatch.setattr(decode._DecodeRun, "step", recording_step)
    for trial in (0, 5):
        fed.clear()
        seconds, tokens, steps = decode._time_decode(
            partial(decode._DecodeRun, loaded.model, 2, cfg, vocab), SettlesAfter(trial)
        )
        assert steps == trial and len(seconds) == 2 and len(tokens) == 6
        outputs[trial] = (tokens, fed[-6:])
    monkeypatch.undo()
    assert outputs[0] == outputs[5]  # the same timed inputs, and the same outputs from them
    timed_inputs = outputs[0][1]
    assert len({tuple(t) for t in timed_inputs}) > 1  # drawn, not one token over and over
    greedy = decode._DecodeRun(loaded.model, 2, DecodeBenchConfig(model=bench_model, prompt_len=8), vocab)
    produced = greedy.step(greedy.prefill())
    assert torch.equal(produced, greedy.outputs)  # greedy runs feed back what they produced
    first_stream_fed = [row[0] for row in timed_inputs]
    assert first_stream_fed[1:] != outputs[0][0][:-1]  # not its outputs fed back, as greedy runs do
    with pytest.raises(ConfigError, match="--inputs must be one of greedy, forced"):
        DecodeBenchConfig(model=bench_model, inputs="sampled")
    parser = argparse.ArgumentParser()
    decode.configure_parser(parser)
    args = parser.parse_args(["--model", str(bench_model), "--inputs", "forced"])
    assert args.inputs == "forced"


def test_mapped_modes_with_fixed_reads_ahead_compute_the_same_tokens(bench_model):
    """``mapped-cpu-ahead<K>`` reads K experts ahead at every batch size (none for ``-noahead``): same tokens."""
    modes = ["naive", "mapped-cpu-noahead", "mapped-cpu-ahead1", "mapped-cpu-ahead2"]
    cfg = DecodeBenchConfig(
        model=bench_model, modes=modes, streams=[1, 2], steps=3, repeats=1, warmup=1, prompt_len=8,
        dtype="fp32", device="cpu", cache_fraction=0.1, quick_bounds=True, host_steps=2,
    )  # fmt: skip
    receipt = run_decode_bench(cfg)
    by_key = {(r["mode"], r["streams"]): r for r in receipt["results"]}
    assert all(share == 1.0 for share in receipt["greedy_tokens_agree"].values())
    for streams in (1, 2):
        assert by_key["mapped-cpu-noahead", streams]["prefetch_used_per_step"] == 0
        assert by_key["mapped-cpu-noahead", streams]["prefetch_wasted_per_step"] == 0
        for k in (1, 2):
            r = by_key[f"mapped-cpu-ahead{k}", streams]
            copied = r["prefetch_used_per_step"] + r["prefetch_wasted_per_step"]
            # Up to K a predicted layer (two of the three are), every step; off CUDA nothing is timed.
            assert 0 < copied <= 2 * k and r["prefetch_wait_ms"] == 0.0


def test_the_cpu_tiers_team_gets_a_note_where_its_jobs_were_marked():
    from moetier.bench.decode import _cpu_team_note

    marked = {"mode": "cpu", "streams": 1, "cpu_team_start_ms_per_job": 0.0021, "cpu_threads_joined_per_job": 14.0}
    unmarked = {"mode": "cpu", "streams": 2, "cpu_team_start_ms_per_job": 0.0, "cpu_threads_joined_per_job": 0.0}
    assert _cpu_team_note("cpu", [marked, unmarked]) == (
        "cpu: CPU-tier jobs' team start and threads joined, by streams: 1: 0.002 ms, 14.0 threads"
    )
    assert _cpu_team_note("naive", [{"mode": "naive", "streams": 1}]) is None  # no CPU tier, no note


def test_x_naive_ceilings_without_a_resident_run_have_no_serial_one_and_the_table_says_so():
    """A receipt of naive and tiered alone (e.g. beside the transformers baseline) has DRAM bounds but no serial
    ones: the tiered row gets its DRAM ceiling, and the table prints ``-`` for the serial one."""
    row = {"tok_s": {"min": 90.0, "median": 100.0, "max": 110.0}, "hit_rate": 0.4}
    results = [
        {"mode": "naive", "streams": 1, **row, "tok_s": {"min": 20.0, "median": 25.0, "max": 30.0}},
        {"mode": "tiered", "streams": 1, **row, "bound_dram_tok_s": 150.0, "ratio_to_dram_bound": 100.0 / 150.0},
    ]
    decode_bench.add_ratios(results)
    tiered = results[1]
    assert tiered["naive_ratio_at_dram_bound"] == pytest.approx(6.0) and "naive_ratio_at_serial_bound" not in tiered
    assert "naive_ratio_at_dram_bound" not in results[0]  # naive has no ceiling of its own
    receipt = {
        "plan": {"moe_layers": 3, "experts_per_layer": 16, "routed_expert_bytes_total": 1e9, "cache_slots": 4,
                 "cache_share_of_experts": 0.08},
        "bounds": {"host_read_gbps": 100.0, "h2d_pinned_gbps": None},
        "config": {}, "environment": {"git_sha": "abc"}, "results": results, "notes": [],
    }  # fmt: skip
    line = next(x for x in markdown_table(receipt).splitlines() if x.startswith("| tiered | 1 |"))
    assert "| 6.00 / - |" in line


def test_the_table_names_the_dram_rate_the_bounds_use():
    header = decode_bench._host_read
    beside = {"cpu": 60.0, "dma": 50.0, "total": 110.0}
    both = {"host_read_gbps": 110.0, "host_read_cpu_gbps": 92.0, "host_read_beside_dma": beside}
    assert header(both) == "110.0 GB/s (the larger of: CPU alone 92.0; CPU 60.0 + DMA 50.0 at once = 110.0)"
    alone = {"host_read_gbps": 92.0, "host_read_cpu_gbps": 92.0, "host_read_beside_dma": None}
    assert header(alone) == "92.0 GB/s (the CPU's read alone: no DMA engine to read beside it)"
    assert header({"host_read_gbps": 92.0, "h2d_pinned_gbps": 55.0}) == "92.0 GB/s"  # a receipt from before the pair
