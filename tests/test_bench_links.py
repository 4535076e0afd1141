"""``moetier bench links``: its checks, the window that runs links together, a CPU run of the CPU tier against the
DRAM read, and (gpu) the device links beside the CPU tier."""

import json
import threading
import time

import pytest
import torch

from moetier import cli
from moetier.bench import links
from moetier.errors import ConfigError

TINY = ["--experts", "8", "--hidden", "256", "--intermediate", "128", "--cpu-threads", "1", "--read-mib", "8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--combos", "cpu+gpu"], "'cpu+gpu' must join distinct runners of cpu, mapped, dma, read with +"),
        (["--combos", "cpu+cpu"], "'cpu+cpu' must join distinct runners"),
        (["--combos", ","], "--combos must list at least one combination"),
        (["--tokens", "1,2"], "--tokens takes one row count >= 1"),
        (["--seconds", "0"], "--seconds must be in [0.05, 60]"),
        (["--expert-format", "int3"], "--expert-format must be one of bf16, fp8, fp4"),
        (["--experts", "2", "--cpu-experts", "3"], "--experts 2 is fewer than one call's experts x tokens"),
        (["--cpu-threads", "0"], "--cpu-threads must be >= 1"),
        (["--read-mib", "0"], "--read-mib must be >= 1"),
    ],
)
def test_bad_arguments_get_one_line_errors(capsys, argv, message):
    assert cli.main(["bench", "links", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_device_links_are_refused_without_cuda_naming_the_cpu_combos(capsys):
    assert cli.main(["bench", "links", *TINY]) == 2
    err = capsys.readouterr().err
    assert "dma, mapped need a CUDA device" in err and "--combos cpu,read,cpu+read" in err


class _Sleeper(links.Runner):
    """A link of fixed-length steps of `nbytes`; it records when it ran."""

    def __init__(self, name: str, step_s: float, nbytes: int, fail_after: int | None = None) -> None:
        self.name, self.step_s, self.nbytes, self.fail_after = name, step_s, nbytes, fail_after
        self.spans: list[tuple[float, float]] = []

    def step(self) -> int:
        if self.fail_after is not None and len(self.spans) >= self.fail_after:
            raise RuntimeError(f"{self.name} failed")
        began = time.perf_counter()
        time.sleep(self.step_s)
        self.spans.append((began, time.perf_counter()))
        return self.nbytes


def test_a_window_runs_its_links_at_once_and_counts_each_ones_bytes():
    fast, slow = _Sleeper("fast", 0.002, 1000), _Sleeper("slow", 0.02, 5000)
    window_fast, window_slow = links.run_window([fast, slow], 0.3)
    assert window_fast.steps == len(fast.spans) and window_fast.bytes == 1000 * window_fast.steps
    assert window_slow.bytes == 5000 * window_slow.steps
    assert window_fast.steps > 5 * window_slow.steps > 0  # each at its own pace, neither waiting for the other
    # Together: the spans overlap (both started within a few ms and both ran for the whole window).
    assert abs(fast.spans[0][0] - slow.spans[0][0]) < 0.05
    assert min(w.seconds for w in (window_fast, window_slow)) >= 0.3


def test_a_failing_link_fails_the_window_without_hanging_the_others():
    ok, bad = _Sleeper("ok", 0.002, 1), _Sleeper("bad", 0.002, 1, fail_after=3)
    with pytest.raises(RuntimeError, match="bad failed"):
        links.run_window([ok, bad], 0.2)


def test_the_cpu_tier_and_the_dram_read_run_alone_and_together(tmp_path, capsys):
    argv = ["bench", "links", *TINY, "--combos", "cpu,read,cpu+read", "--seconds", "0.1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    receipt = json.loads(next(tmp_path.glob("links-*.json")).read_text())
    rows = {r["combo"]: r for r in receipt["results"]}
    assert list(rows) == ["cpu", "read", "cpu+read"]
    for row in rows.values():
        assert all(v > 0 for v in row["gbps"].values()) and all(s > 0 for s in row["steps"].values())
        assert row["total_gbps"] == pytest.approx(sum(row["gbps"].values()))
        assert row["x_read"] == pytest.approx(row["total_gbps"] / receipt["read_gbps"])
    assert set(rows["cpu+read"]["gbps"]) == {"cpu", "read"} and rows["read"]["x_read"] == pytest.approx(1.0)
    assert receipt["best_split"] is None  # no device link ran
    assert receipt["cpu_kernel"] and len(receipt["cpu_kernel"]) == 1
    assert rows["read"]["cpu_job_ms"] is None  # no CPU job ran in that combination
    for combo in ("cpu", "cpu+read"):  # where a job's time went, from the native worker's marks
        phases = rows[combo]["cpu_job_ms"]
        assert list(phases) == ["job", "team_start", "gate_up", "gate_up_spread", "down", "down_spread", "rest"]
        # Medians are not additive (the sum of two phases' medians may pass the job's median), but each phase
        # lies inside its job in every sample, so each phase's median is at most the job's.
        assert all(v >= 0 for v in phases.values())
        assert max(phases["gate_up"], phases["down"], phases["team_start"]) <= phases["job"]
        assert 1 <= rows[combo]["cpu_joined"] <= receipt["config"]["cpu_threads"]
    out = capsys.readouterr().out
    assert "| cpu+read |" in out and "CPU jobs, median ms" in out


def test_config_defaults_measure_a_decode_layers_split():
    cfg = links.LinksBenchConfig()
    cfg.validate()
    assert (cfg.expert_format, cfg.cpu_experts, cfg.gpu_experts, cfg.tokens) == ("fp4", 2, 2, [1])
    assert "cpu+mapped" in cfg.combos and "read+dma" in cfg.combos
    with pytest.raises(ConfigError, match="distinct runners"):
        links.LinksBenchConfig(combos=["read+read"]).validate()


def test_runners_hold_their_own_threads_only_while_measuring():
    before = threading.active_count()
    links.run_window([_Sleeper("a", 0.001, 1), _Sleeper("b", 0.001, 1)], 0.05)
    assert threading.active_count() == before


@pytest.mark.gpu
def test_device_links_run_beside_the_cpu_tier(tmp_path):
    combos = "cpu,mapped,dma,read,cpu+mapped,cpu+dma"
    argv = ["bench", "links", *TINY, "--combos", combos, "--seconds", "0.2", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    receipt = json.loads(next(tmp_path.glob("links-*.json")).read_text())
    rows = {r["combo"]: r for r in receipt["results"]}
    assert all(v > 0 for r in rows.values() for v in r["gbps"].values())
    assert receipt["best_split"]["combo"] in ("cpu+mapped", "cpu+dma")


def test_job_phases_are_medians_of_each_part_over_the_jobs():
    # Two jobs whose phases add up inside each job, but whose phase medians add past the job median: the
    # receipt reports each part's own median, and the rest stays the job's time outside its phases.
    names = ("seconds", "allocated", "entered_first", "entered_last", "gate_up_first", "gate_up_last")
    names += ("down_first", "down_last")
    rows = [(1.0, 0, 0.1, 0.1, 0.2, 0.9, 0.95, 1.0), (1.0, 0, 0, 0, 0.1, 0.1, 0.5, 0.9)]
    rows.append((1.2, 0, 0, 0.05, 0.1, 0.6, 0.9, 1.1))
    marks = [dict(zip(names, row, strict=True)) for row in rows]
    phases = links.job_phases_ms(marks)
    assert phases["job"] == pytest.approx(1000.0)
    assert phases["gate_up"] == pytest.approx(600.0) and phases["down"] == pytest.approx(500.0)
    assert phases["team_start"] == pytest.approx(50.0) and phases["rest"] == pytest.approx(100.0)
    assert phases["down_spread"] == pytest.approx(200.0) and phases["gate_up_spread"] == pytest.approx(500.0)
    assert links.job_phases_ms([]) is None
