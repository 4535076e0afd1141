"""``moetier bench dispatch-host``: every dispatcher timed, clocked and counted, on the CPU here."""

import json

import pytest

from moetier.bench.dispatch_host import DISPATCHERS, DispatchHostBenchConfig, markdown_table, run_bench
from moetier.cli import main
from moetier.errors import ConfigError

TINY = dict(layers=2, experts=16, hidden=32, intermediate=16, top_k=4, cache_slots=4, calls=12, repeats=1)


def test_every_dispatcher_and_token_count_gets_times_phases_and_aten_calls():
    receipt = run_bench(DispatchHostBenchConfig(**TINY, tokens=[1, 3], device="cpu"))
    rows = {(r["dispatcher"], r["tokens"]): r for r in receipt["results"]}
    assert set(rows) == {(d, t) for d in DISPATCHERS for t in (1, 3)}
    for row in rows.values():
        assert 0 < row["us_per_call"]["best"] <= row["us_per_call"]["worst"]
        assert row["aten_calls_per_call"] == pytest.approx(sum(row["aten_calls_by_op"].values()))
        assert row["aten_calls_per_call"] > 0
        assert not row["graphable"]  # no CUDA: the device tables do not apply
    tiered = rows[("tiered", 1)]
    assert {"tiers.route", "tiers.split", "tiers.device"} <= set(tiered["phases_us_per_call"])
    assert 0.0 <= tiered["hit_rate"] <= 1.0
    # Counts are exact: the same calls through the same dispatcher make the same aten calls.
    again = run_bench(DispatchHostBenchConfig(**TINY, tokens=[1], dispatchers=["resident-host"], device="cpu"))
    assert again["results"][0]["aten_calls_by_op"] == rows[("resident-host", 1)]["aten_calls_by_op"]
    assert "| tiered | 3 |" in markdown_table(receipt)


@pytest.mark.parametrize(
    "bad",
    [{"calls": 0}, {"top_k": 17}, {"tokens": []}, {"dispatchers": ["fast"]}, {"device": "tpu"}, {"cache_slots": -1}],
)
def test_bad_settings_are_refused_with_one_line(bad):
    with pytest.raises(ConfigError) as err:
        run_bench(DispatchHostBenchConfig(**{**TINY, **bad}))
    assert "\n" not in str(err.value)


def test_the_cli_writes_a_receipt(tmp_path, capsys):
    args = ["bench", "dispatch-host", "--layers", "1", "--experts", "8", "--hidden", "16", "--intermediate", "8"]
    args += ["--top-k", "2", "--cache-slots", "2", "--calls", "4", "--repeats", "1", "--tokens", "1"]
    assert main([*args, "--dispatchers", "tiered", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (receipt,) = tmp_path.glob("dispatch-host-*.json")
    assert [r["dispatcher"] for r in json.loads(receipt.read_text())["results"]] == ["tiered"]
    assert "aten calls/call" in capsys.readouterr().out
