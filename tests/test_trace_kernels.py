"""moetier.bench.trace_kernels: a decode step's kernels (count, busy time, span, by name), from a decode trace."""

from __future__ import annotations

import gzip
import json

import pytest

from moetier.bench.trace_kernels import idle_between, main, short_name, step_end_name, steps, summary

_ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
_MASK = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::(anonymous namespace)::masked_fill_kernel(at::TensorIterator&)> >(int)"  # noqa: E501


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel"}


def _step(start: float, extra: float = 0.0) -> list[dict]:
    """Three small kernels and an LM head: 10 + 20 + 5 + 250 us busy, the head starting ``extra`` us late."""
    return [
        _kernel(_ADD, start, 10),
        _kernel(_MASK, start + 12, 20),
        _kernel("_rms_norm_kernel", start + 33, 5),
        _kernel("nvjet_sm90_lm_head", start + 40 + extra, 250),
    ]


TRACE = {
    "traceEvents": _step(0, extra=500)  # the profiler's first step: left out of the summary
    + _step(1000)
    + _step(2000, extra=100)  # a step the host delayed
    + _step(3000)
    + [{"name": "segments", "ts": 5, "dur": 900, "cat": "user_annotation"}]  # host events are not kernels
}


def test_torch_kernels_are_named_by_their_operation():
    assert short_name(_ADD) == "vectorized_elementwise_kernel[CUDAFunctor_add]"
    assert short_name(_MASK) == "elementwise_kernel[masked_fill_kernel]"
    assert short_name("_attend_kernel") == "_attend_kernel"


def test_steps_end_at_the_lm_head_and_the_summary_takes_medians_after_the_first():
    found = steps(TRACE)
    assert [s.count for s in found] == [4, 4, 4, 4]
    assert [s.span_us for s in found] == [790, 290, 390, 290]
    assert all(s.busy_us == 285 for s in found)
    assert [s.idle_us for s in found] == [505, 5, 105, 5]  # the gaps: 2 + 1 + 2 us, and the head's delay
    assert found[1].groups[0].name == "nvjet_sm90_lm_head" and found[1].groups[0].count == 1
    result = summary(found, top=2)
    assert result["steps"] == 3 and result["kernels"] == 4 and result["span_us"] == 290 and result["busy_us"] == 285
    assert [g["name"] for g in result["heaviest"]] == ["nvjet_sm90_lm_head", "elementwise_kernel[masked_fill_kernel]"]


def test_the_command_line_prints_steps_and_json(tmp_path, capsys):
    path = tmp_path / "decode-trace-resident.json.gz"
    with gzip.open(path, "wt") as dst:
        json.dump(TRACE, dst)
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["span_us"] == 290
    assert main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 0: 4 kernels" in out and "median of 3: 4.0 kernels, 285.0 us busy, 290.0 us span, 5.0 us idle" in out


def _tiered_step(start: float) -> list[dict]:
    """Two MoE layers whose mapped expert kernel (300 us) is longer than the step end's bound, a CPU sums' copy on
    a second stream beside the second one, then the LM head."""
    return [
        _kernel("_rms_norm_kernel", start, 5),
        _kernel("_gate_up_quant_kernel", start + 10, 300),
        _kernel("_rms_norm_kernel", start + 320, 5),
        _kernel("_gate_up_quant_kernel", start + 330, 300),
        _kernel("_sum_kernel", start + 400, 50),  # beside the expert kernel: covered once
        _kernel("nvjet_sm90_lm_head", start + 640, 250),
    ]


def test_tiered_steps_end_at_the_head_not_at_the_long_expert_kernels():
    trace = {"traceEvents": _tiered_step(0) + _tiered_step(1000) + _tiered_step(2000)}
    assert step_end_name(trace["traceEvents"]) == "nvjet_sm90_lm_head"
    found = steps(trace)
    assert [s.count for s in found] == [6, 6, 6]
    assert all(s.span_us == 890 and s.busy_us == 910 for s in found)
    assert all(s.idle_us == 890 - 860 for s in found)  # 5 + 5 + 10 + 10 us of gaps
    assert step_end_name([_kernel("_rms_norm_kernel", 0, 5)]) is None


def test_the_step_end_is_the_name_that_is_always_long_then_the_rarest():
    head, gate_up, down = "nvjet_sm90_lm_head", "_gate_up_quant_kernel", "_down_kernel"
    # A down kernel once long (a layer with many misses), the expert kernels short where cached: the head wins.
    kernels = [_kernel(down, 0, 210), _kernel(down, 300, 100), _kernel(gate_up, 400, 50), _kernel(gate_up, 500, 300)]
    assert step_end_name(kernels + [_kernel(head, 900, 250)]) == head
    # All long: the rarest; a tie goes to the name seen last.
    assert step_end_name([_kernel(gate_up, 0, 300), _kernel(gate_up, 400, 300), _kernel(head, 800, 250)]) == head
    assert step_end_name([_kernel(gate_up, 0, 300), _kernel(head, 400, 250)]) == head


def test_a_missing_trace_is_refused_with_a_one_line_error(tmp_path, capsys):
    """The command line reads its trace through trace_phases.read_trace_argument (tested there for broken files)."""
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json.gz")])
    assert "is not a file" in capsys.readouterr().err


def test_idle_gaps_are_named_by_the_events_either_side_per_measured_step(tmp_path, capsys):
    copy = {"name": "Memcpy HtoD (Pinned -> Device)", "ts": 0.0, "dur": 3.0, "cat": "gpu_memcpy"}
    trace = {"traceEvents": []}
    for start in (0, 1000, 2000, 3000):  # four steps: the three after the first are measured
        trace["traceEvents"] += _tiered_step(start) + [dict(copy, ts=start + 316.0)]  # in the 310-320 gap
    gaps = {(g["before"], g["after"]): g["us"] for g in idle_between(trace)}
    # Each step: 6 us after the expert kernel (copy at 316), 1 us after the copy (to 320), 5 us after each norm, ...
    assert gaps[("_gate_up_quant_kernel", "Memcpy HtoD")] == pytest.approx(6.0)
    assert gaps[("Memcpy HtoD", "_rms_norm_kernel")] == pytest.approx(1.0)
    assert gaps[("_rms_norm_kernel", "_gate_up_quant_kernel")] == pytest.approx(10.0)
    assert gaps[("_gate_up_quant_kernel", "nvjet_sm90_lm_head")] == pytest.approx(10.0)
    assert gaps[("nvjet_sm90_lm_head", "_rms_norm_kernel")] == pytest.approx(110.0)  # the host between steps
    assert idle_between({"traceEvents": _tiered_step(0) + _tiered_step(1000)}) == []  # too few steps to measure
    path = tmp_path / "decode-trace-tiered.json.gz"
    with gzip.open(path, "wt") as dst:
        json.dump(trace, dst)
    assert main([str(path), "--top", "0", "--gaps", "2"]) == 0
    assert "110.0 us idle between nvjet_sm90_lm_head and _rms_norm_kernel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(path), "--gaps", "-1"])
    assert "--gaps must be >= 0" in capsys.readouterr().err
