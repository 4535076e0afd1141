"""moetier.bench.trace_phases: a fed mapped call's device share and wait for the CPU tier, from a decode trace."""

from __future__ import annotations

import gzip
import json

import pytest

from moetier.bench.trace_phases import call_phases, device_events, main, summary, trace_note


def _event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": cat}


TRACE = {
    "traceEvents": [
        _event("nvjet_attention", 0, 50),
        _event("_table_kernel", 100, 5),
        _event("_gate_up_quant_kernel", 110, 200),
        _event("_down_kernel", 310, 100),
        _event("Memcpy HtoD (Pinned -> Device)", 480, 3, "gpu_memcpy"),  # the CPU ended 70 us after the device
        _event("_table_kernel", 1000, 5),
        _event("_gate_up_quant_kernel", 1010, 300),
        _event("_down_kernel", 1310, 150),
        _event("Memcpy HtoD (Pinned -> Device)", 1462, 3, "gpu_memcpy"),  # the device was the longer side
        {"name": "segments", "ts": 5, "dur": 900, "cat": "user_annotation"},  # host events are not the device's
        _event("_table_kernel", 2000, 5),  # a call cut off by the trace's end: left out
    ]
}


def test_each_fed_call_gives_its_device_share_its_phase_and_the_wait_for_the_cpu():
    calls = call_phases(device_events(TRACE))
    assert [(c.start, c.device, c.phase, c.late) for c in calls] == [(100, 300, 380, 70), (1000, 450, 462, 2)]
    assert calls[0].balanced == pytest.approx(2 * 300 * 380 / 680)  # both sides ending together
    assert calls[1].balanced == pytest.approx(2 * 450 * 462 / 912)
    means = summary(calls)
    assert means["calls"] == 2 and means["late_us"] == pytest.approx(36) and means["device_us"] == pytest.approx(375)


def test_the_command_line_prints_the_calls_in_a_window_and_refuses_a_missing_trace(tmp_path, capsys):
    path = tmp_path / "decode-trace-tiered.json.gz"
    with gzip.open(path, "wt") as dst:
        json.dump(TRACE, dst)
    assert main([str(path), "--to", "500"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["calls"] == 1
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json.gz")])
    assert "is not a file" in capsys.readouterr().err
    (tmp_path / "plain.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "plain.json")])
    assert "is not a gzipped JSON trace" in capsys.readouterr().err


def test_a_receipt_notes_the_traced_fed_calls_and_nothing_for_a_trace_without_them(tmp_path):
    path, empty = tmp_path / "fed.json.gz", tmp_path / "resident.json.gz"
    for target, trace in ((path, TRACE), (empty, {"traceEvents": [_event("nvjet_attention", 0, 50)]})):
        with gzip.open(target, "wt") as dst:
            json.dump(trace, dst)
    note = trace_note("tiered", path)
    assert note.startswith("tiered: traced fed calls (1 stream, 2)") and "wait for them 36 us" in note
    assert trace_note("resident", empty) is None
