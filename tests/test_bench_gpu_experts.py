"""``moetier bench gpu-experts``: its checks on CPU, and (gpu) one small run of every format and path."""

import pytest
import torch

from moetier import cli
from moetier.bench import gpu_experts
from moetier.errors import ConfigError


def test_bad_arguments_get_one_line_errors(capsys):
    assert cli.main(["bench", "gpu-experts", "--experts", "4", "--top-k", "6"]) == 2
    assert "fewer than one call's top_k x tokens experts" in capsys.readouterr().err
    assert cli.main(["bench", "gpu-experts", "--formats", "int3"]) == 2
    assert "--formats must be a non-empty subset of bf16,fp8,fp4" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--paths"):
        gpu_experts.GpuExpertsBenchConfig(paths=["cublas"]).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_refuses_a_machine_without_cuda(capsys):
    assert cli.main(["bench", "gpu-experts"]) == 2
    assert "has no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_every_format_and_path_runs_and_agrees(tmp_path):
    cfg = gpu_experts.GpuExpertsBenchConfig(experts=16, hidden=512, intermediate=256, tokens=[1, 2], calls=4)
    receipt = gpu_experts.run_bench(cfg)
    assert {(r["format"], r["path"], r["tokens"]) for r in receipt["results"]} == {
        (f, p, t) for f in ("bf16", "fp8", "fp4") for p in gpu_experts.PATHS for t in (1, 2)
    }
    for fmt, info in receipt["formats"].items():
        assert all(rel < 0.01 for rel in info["grouped_vs_per_expert_rel"].values()), (fmt, info)
        assert any("gate_up" in name for name in info["grouped_kernel_us"]["1"]), info  # the profiler saw the kernels
    assert all(r["us_per_call"]["median"] > 0 and r["gbps"] > 0 for r in receipt["results"])
    assert "| fp4 | grouped | 1 |" in gpu_experts.markdown_table(receipt)
