"""``moetier bench gpu-experts``: its checks on CPU, the fp4 block sizes it sweeps, and (gpu) small runs of every
format and path, and of host blocks under two fp4 block sizes."""

import dataclasses
import importlib.util

import pytest
import torch

from moetier import cli
from moetier.bench import gpu_experts
from moetier.errors import ConfigError
from moetier.kernels import grouped_experts
from moetier.kernels.grouped_experts import Fp4Blocks

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def test_bad_arguments_get_one_line_errors(capsys):
    assert cli.main(["bench", "gpu-experts", "--experts", "4", "--top-k", "6"]) == 2
    assert "fewer than one call's top_k x tokens experts" in capsys.readouterr().err
    assert cli.main(["bench", "gpu-experts", "--formats", "int3"]) == 2
    assert "--formats must be a non-empty subset of bf16,fp8,fp4" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--paths"):
        gpu_experts.GpuExpertsBenchConfig(paths=["cublas"]).validate()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--where", "gpu"], "--where must list some of device,host once each"),
        (["--where", "host,host"], "--where must list some of device,host once each"),
        (["--where", ","], "--where must list some of device,host"),
        (["--where", "host", "--paths", "per-expert"], "--where host runs the grouped path only"),
        (["--where", "host", "--tokens", "11", "--experts", "96"], "at most 16 tokens and 64 (token, expert) pairs"),
        (["--fp4-blocks", "8x15x1024"], "--fp4-blocks: fp4 block h must be a power of two in [2, 256], got 15"),
        (["--fp4-blocks", "abc"], "--fp4-blocks: fp4 blocks must be N x H x K integers such as 8x16x1024"),
        (["--fp4-blocks", "8x16x1024,8x16"], "got '8x16'"),
        (["--fp4-blocks", "8x16x16"], "fp4 block k must be a power of two in [32, 8192], got 16"),
        (["--fp4-blocks", "128x16x1024"], "a program's tile (rows x k) must be at most 65536 values"),
        (["--fp4-blocks", " , "], "--fp4-blocks must list N x H x K sizes"),
        (["--beside", "2"], "--beside must be >= 0 and needs --where host, got 2"),
        (["--where", "host", "--beside", "-1"], "--beside must be >= 0 and needs --where host, got -1"),
    ],
)
def test_bad_where_and_fp4_blocks_get_one_line_errors(capsys, argv, message):
    assert cli.main(["bench", "gpu-experts", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_where_and_fp4_blocks_parse_into_the_config(monkeypatch):
    class Made(Exception):
        pass

    def stop(cfg):
        seen["cfg"] = cfg
        raise Made

    seen = {}
    monkeypatch.setattr(gpu_experts, "run_bench", stop)
    argv = ["bench", "gpu-experts", "--where", "host, device", "--fp4-blocks", " 8x16x1024, 16X32X512,8x16x1024"]
    with pytest.raises(Made):
        gpu_experts.run(cli.build_parser().parse_args(argv))
    cfg = seen["cfg"]
    assert cfg.where == ["host", "device"]
    assert cfg.fp4_blocks == [Fp4Blocks(), Fp4Blocks(16, 32, 512)]  # repeats dropped, order kept
    cfg.validate()
    defaults = gpu_experts.GpuExpertsBenchConfig()
    assert defaults.where == ["device"] and defaults.fp4_blocks == [Fp4Blocks(8, 16, 1024)]
    assert dataclasses.asdict(defaults)["fp4_blocks"] == [{"n": 8, "h": 16, "k": 1024}]  # the receipt's config


def test_fp4_blocks_validate_and_print_as_they_parse():
    assert Fp4Blocks() == Fp4Blocks(grouped_experts._FP4_BLOCK_N, grouped_experts._FP4_BLOCK_H, 1024)
    assert str(Fp4Blocks(h=32)) == "8x32x1024" and Fp4Blocks.parse("8x32x1024") == Fp4Blocks(h=32)
    assert Fp4Blocks(2, 256, 256).h == 256 and Fp4Blocks(64, 8, 1024).n == 64 and Fp4Blocks(8, 8, 8192).k == 8192
    for bad in ({"n": 12}, {"h": 1}, {"h": 512}, {"k": 16}, {"k": 16384}, {"n": 0}, {"n": -8}, {"n": 8.0}, {"h": True}):
        with pytest.raises(ValueError, match="power of two"):
            Fp4Blocks(**bad)
    with pytest.raises(ValueError, match="tile"):
        Fp4Blocks(n=32, k=4096)
    for text in ("8x16", "8x16x1024x2", "8x-16x1024", "a x b x c", ""):
        with pytest.raises(ValueError, match="N x H x K"):
            Fp4Blocks.parse(text)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fp4Blocks().n = 16  # type: ignore[misc]


def test_fp4_blocks_context_restores_the_previous_value():
    assert grouped_experts.current_fp4_blocks() == Fp4Blocks()
    with pytest.raises(RuntimeError), grouped_experts.fp4_blocks(Fp4Blocks(h=32)) as blocks:
        assert grouped_experts.current_fp4_blocks() is blocks
        with grouped_experts.fp4_blocks(Fp4Blocks(k=512)):
            assert grouped_experts.current_fp4_blocks() == Fp4Blocks(k=512)
        assert grouped_experts.current_fp4_blocks() is blocks
        raise RuntimeError("a failed sweep step")
    assert grouped_experts.current_fp4_blocks() == Fp4Blocks()
    with pytest.raises(TypeError):
        grouped_experts.set_fp4_blocks((8, 16, 1024))  # type: ignore[arg-type]


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the grid and the constants."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, grid, kwargs))


def _launches(monkeypatch, fmt):
    """The three launches ``launch_grouped`` makes for one call of 2 tokens x top-2 over ``fmt`` experts (no
    kernel runs: each is a recorder)."""
    from moetier.bench.cpu_tier import make_experts
    from moetier.kernels.device_routing import routed_layout

    launches = []
    for name in ("_gate_up_kernel", "_gate_up_quant_kernel", "_down_kernel", "_sum_kernel"):
        monkeypatch.setattr(grouped_experts, name, _Recorder(name, launches), raising=False)
    cfg = gpu_experts.GpuExpertsBenchConfig(experts=4, hidden=256, intermediate=128, top_k=2)
    _, experts = make_experts(cfg, fmt)
    first = experts[0]
    layout = routed_layout(2, 2, 16)
    table = torch.zeros(5 * layout.pairs + layout.touched * (layout.width + 1), dtype=torch.int64)
    out, hidden = torch.zeros(2, 256), torch.randn(2, 256).to(torch.bfloat16)
    pair_tokens, gates = torch.tensor([0, 0, 1, 1]), torch.rand(4)
    placement = grouped_experts._placement(first)
    grouped_experts.launch_grouped(out, hidden, pair_tokens, gates, first, placement, 10.0, table, layout)
    return [(name, grid, {k: v for k, v in kw.items() if k.startswith("BLOCK")}) for name, grid, kw in launches]


@needs_triton
def test_default_fp4_blocks_leave_the_launches_unchanged(monkeypatch):
    # The launches as they were with the module constants (8, 16, 1024) and no override.
    before = [
        ("_gate_up_quant_kernel", (4, 128 // 8), {"BLOCK_N": 8, "BLOCK_K": 1024}),
        ("_down_kernel", (4, 256 // 16), {"BLOCK_H": 16, "BLOCK_K": 1024}),
        ("_sum_kernel", (2, 1), {"BLOCK_H": 1024}),
    ]
    assert _launches(monkeypatch, "fp4") == before
    with grouped_experts.fp4_blocks(Fp4Blocks()):
        assert _launches(monkeypatch, "fp4") == before
    with grouped_experts.fp4_blocks(Fp4Blocks(4, 32, 512)):
        assert _launches(monkeypatch, "fp4") == [
            ("_gate_up_quant_kernel", (4, 128 // 4), {"BLOCK_N": 4, "BLOCK_K": 512}),
            ("_down_kernel", (4, 256 // 32), {"BLOCK_H": 32, "BLOCK_K": 512}),
            ("_sum_kernel", (2, 1), {"BLOCK_H": 1024}),
        ]
        # fp8 (and dense) blocks keep their own sizes whatever the fp4 ones are
        assert _launches(monkeypatch, "fp8") == [
            ("_gate_up_quant_kernel", (4, 128 // 16), {"BLOCK_N": 16, "BLOCK_K": 128}),
            ("_down_kernel", (4, 256 // 32), {"BLOCK_H": 32, "BLOCK_K": 128}),
            ("_sum_kernel", (2, 1), {"BLOCK_H": 1024}),
        ]
    assert _launches(monkeypatch, "fp4") == before


_FP4_BLOCKS_CHECK = """
import json, torch
import moetier.kernels.grouped_experts as k
from moetier.bench import gpu_experts
from moetier.bench.cpu_tier import make_experts
from moetier.tiers.experts import ExpertWeights

DEVICE = {device!r}
cfg = gpu_experts.GpuExpertsBenchConfig(experts=2, hidden=64, intermediate=96, top_k=2)
layout, experts = make_experts(cfg, "fp4")
experts = [ExpertWeights.from_block(w.block.to(DEVICE), layout) for w in experts]
g = torch.Generator().manual_seed(3)
counts, tokens = [2, 1], 3
groups = [(w, sum(counts[:i]), c) for i, (w, c) in enumerate(zip(experts, counts))]
x = torch.randn(tokens, 64, generator=g).to(DEVICE)
pair_tokens = torch.cat([torch.randperm(tokens, generator=g)[:c] for c in counts]).to(DEVICE)
gates = torch.rand(pair_tokens.shape[0], generator=g).to(DEVICE)
out = {{}}
for blocks in {configs!r}:
    with k.fp4_blocks(k.Fp4Blocks.parse(blocks)):
        acc = torch.zeros(tokens, 64, device=DEVICE)
        k.run_grouped(acc, x, pair_tokens, gates, groups, 0.8)
        out[blocks] = acc.double().cpu()
ref = out["8x16x1024"]
print(json.dumps({{b: ((o - ref).norm() / ref.norm()).item() for b, o in out.items()}}))
"""


@needs_triton
def test_other_fp4_blocks_compute_what_the_default_does_under_the_interpreter():
    _check_fp4_blocks("cpu")


@pytest.mark.gpu
def test_other_fp4_blocks_compute_what_the_default_does_on_cuda():
    _check_fp4_blocks("cuda")


def _check_fp4_blocks(device: str) -> None:
    from test_grouped_experts import _run_script

    # a step of one scale unit, a partial row block (96 rows) and a step past the row (128 of 96 columns)
    configs = ["8x16x1024", "4x32x32", "64x8x128", "16x64x64"]
    rel = _run_script(_FP4_BLOCKS_CHECK.format(device=device, configs=configs), device)
    assert set(rel) == set(configs) and all(v < 1e-6 for v in rel.values()), rel  # float32: sum order only


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
    for r in receipt["results"]:
        assert r["us_per_call"]["median"] > 0 and r["gbps"] > 0 and r["where"] == "device", r
        if r["path"] == "grouped":  # the profiler saw the kernels; one blocks config: its own reference
            assert any("gate_up" in name for name in r["kernel_us"]) and r["rel_vs_default"] == 0.0, r
    assert "| fp4 | grouped | 1 | device | 8x16x1024 |" in gpu_experts.markdown_table(receipt)


@pytest.mark.gpu
def test_host_blocks_under_two_fp4_block_sizes_match_the_default():
    blocks = [Fp4Blocks(), Fp4Blocks(4, 32, 256)]
    cfg = gpu_experts.GpuExpertsBenchConfig(
        experts=16, hidden=512, intermediate=256, tokens=[1, 2], formats=["fp4"], where=["host", "device"],
        fp4_blocks=blocks, calls=3, warmup=1,
    )  # fmt: skip
    receipt = gpu_experts.run_bench(cfg)
    grouped = [r for r in receipt["results"] if r["path"] == "grouped"]
    assert {(r["where"], r["tokens"], r["fp4_blocks"]) for r in grouped} == {
        (w, t, str(b)) for w in ("host", "device") for t in (1, 2) for b in blocks
    }
    assert {r["where"] for r in receipt["results"] if r["path"] == "per-expert"} == {"device"}
    assert receipt["h2d_gbps"] > 0 and all(r["x_copy"] > 0 for r in receipt["results"])
    for r in grouped:  # every (where, blocks) against the default blocks on host blocks: the same sums
        assert r["rel_vs_default"] < 1e-3, r
        assert all(name in {n[:8] for n in r["kernel_us"]} for name in ("_gate_up", "_down_ke", "_sum_ker")), r
        if r["where"] == "host" and r["fp4_blocks"] == str(Fp4Blocks()):
            assert r["rel_vs_default"] == 0.0, r  # the reference itself: the kernels are deterministic
    assert all(rel < 0.01 for rel in receipt["formats"]["fp4"]["grouped_vs_per_expert_rel"].values())
    assert "| fp4 | grouped | 2 | host | 4x32x256 |" in gpu_experts.markdown_table(receipt)


@pytest.mark.gpu
def test_host_calls_beside_the_backbone_linears_report_both_alone_and_together():
    cfg = gpu_experts.GpuExpertsBenchConfig(
        experts=16, hidden=512, intermediate=256, tokens=[1], formats=["fp4"], where=["host"], paths=["grouped"],
        calls=3, warmup=1, beside=2,
    )  # fmt: skip
    receipt = gpu_experts.run_bench(cfg)
    (row,) = receipt["results"]
    for key, high in (("beside", False), ("beside_high", True)):
        beside = row[key]
        call, linears, together = (beside[k]["median"] for k in ("call_us", "beside_us", "together_us"))
        assert beside["passes"] == 2 and beside["high_priority"] is high and min(call, linears) > 0
        # Together takes at least the longer of the two (nothing runs faster beside other work), at most about both.
        assert 0.9 * max(call, linears) <= together <= 1.2 * (call + linears), beside
        assert beside["hidden_share"] == pytest.approx((call + linears - together) / min(call, linears))
    assert "| fp4 | 1 | 8x16x1024 |" in gpu_experts.markdown_table(receipt).split("Beside:")[1]


def test_the_beside_table_shows_the_high_priority_row_where_measured():
    def timing(call: float, linears: float, together: float) -> dict:
        share = (call + linears - together) / min(call, linears)
        return {k: {"median": v} for k, v in (("call_us", call), ("beside_us", linears), ("together_us", together))} | {
            "passes": 3,
            "hidden_share": share,
        }

    both = {"format": "fp4", "tokens": 1, "fp4_blocks": None, "beside": timing(4000, 240, 4200)}
    both["beside_high"] = timing(4000, 240, 4040)
    older = {"format": "fp4", "tokens": 4, "fp4_blocks": "8x4x1024", "beside": timing(9000, 240, 9240)}
    lines = gpu_experts._beside_lines([both, older, {"format": "fp4", "tokens": 2}])
    assert "| fp4 | 1 | - | 4000 | 240 | 4200 | 0.17 | 4040 | 0.83 |" in lines
    assert "| fp4 | 4 | 8x4x1024 | 9000 | 240 | 9240 | 0.00 | - | - |" in lines  # a receipt from before: no row
    assert len([line for line in lines if line.startswith("| fp4 |")]) == 2
    assert gpu_experts._beside_lines([{"format": "fp4", "tokens": 1}]) == []
