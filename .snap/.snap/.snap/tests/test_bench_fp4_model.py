"""Benchmark checkpoints with fp4 experts: written as DeepSeek-V4's release is, loaded either way alike."""

import argparse
import json

import pytest
import torch
from reference import assert_same_run, moetier_run
from test_bench_decode import TINY_V4

from moetier.bench.decode import DecodeBenchConfig, run_decode_bench
from moetier.bench.fp4_model import BLOCK, CODE_MEAN_SQUARE, scales_for_std
from moetier.bench.make_model import WriteOptions, configure_parser, plan_bench_model, run
from moetier.bench.shapes import build_config
from moetier.config import ModelLoadConfig
from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.tiers.host_store import HostExpertArena
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.fp4 import dequantize_fp4
from moetier.weights.loader import load_model
from moetier.weights.quant_experts import FP4_TILE

HIDDEN, INTER, EXPERTS, LAYERS, STEPS = 64, 32, 16, 3, 6


def _run(*args: str) -> int:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return run(parser.parse_args(list(args)))


@pytest.fixture(scope="module")
def fp4_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "v4-fp4"
    assert _run(*TINY_V4, "--out", str(out), "--device", "cpu", "--fp4-experts") == 0
    return out


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(1))


def _load(path, dtype, expert_format, **kwargs):
    return load_model(
        path, ModelLoadConfig(dtype=dtype, device="cpu", expert_format=expert_format), progress=False, **kwargs
    )


def test_experts_are_written_in_the_release_layout_and_declared(fp4_model):
    config = json.loads((fp4_model / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    ckpt = Checkpoint(fp4_model)
    for layer in range(LAYERS):  # the hash-routed layer 0 too
        for part, (rows, cols) in {"w1": (INTER, HIDDEN), "w2": (HIDDEN, INTER), "w3": (INTER, HIDDEN)}.items():
            name = f"model.layers.{layer}.ffn.experts.5.{part}"
            weight, scale = ckpt.tensors[f"{name}.weight"], ckpt.tensors[f"{name}.scale"]
            assert (weight.dtype, weight.shape) == ("I8", (rows, cols // 2))  # two e2m1 values a byte
            assert (scale.dtype, scale.shape) == ("F8_E8M0", (rows, cols // BLOCK))  # one ue8m0 per 32 inputs
    assert FP4_TILE[1] == BLOCK
    assert ckpt.tensors["model.layers.0.attn.wq_a.weight"].dtype == "BF16"  # only routed experts are fp4
    assert ckpt.tensors["model.layers.0.ffn.shared_experts.w1.weight"].dtype == "BF16"
    assert not any(n.endswith("weight_scale_inv") for n in ckpt.tensors)  # the release's ".scale" naming


def test_codes_and_power_of_two_scales_give_the_dense_init_spread(fp4_model):
    ckpt = Checkpoint(fp4_model)
    expected = scales_for_std(0.02)  # the shape's initializer_range
    values, codes, exponents = [], [], []
    for expert in range(EXPERTS):
        name = f"model.layers.1.ffn.experts.{expert}.w1"
        packed, scale = ckpt.get(f"{name}.weight"), ckpt.get(f"{name}.scale")
        assert scale.dtype == torch.float8_e8m0fnu
        exponents.append(scale.view(torch.uint8).int() - 127)
        codes.append(packed.view(torch.uint8))
        values.append(dequantize_fp4(packed, scale, torch.float32))
    exponents, codes, values = torch.cat(exponents), torch.cat(codes), torch.cat(values)
    # Powers of two, 2**e or 2**(e+1) with the drawn odds: every scale a power of two, as the release's are.
    assert set(exponents.unique().tolist()) == {expected.exponent, expected.exponent + 1}
    assert abs((exponents > expected.exponent).float().mean().item() - expected.p_up) < 0.05
    nibbles = torch.cat([codes & 0xF, codes >> 4]).long()
    assert torch.bincount(nibbles.flatten(), minlength=16).min() > 0.8 * nibbles.numel() / 16  # all codes used
    assert abs(values.std().item() - 0.02) < 0.002 and abs(values.mean().item()) < 0.002
    assert expected.mean_square * CODE_MEAN_SQUARE == pytest.approx(0.02**2)


def test_sizes_count_the_fp4_bytes(fp4_model):
    receipt = json.loads((fp4_model / "bench_model.json").read_text())
    assert receipt["expert_format"] == "fp4" and receipt["total_bytes"] == Checkpoint(fp4_model).total_bytes()
    cfg = build_config("deepseek-v4-flash", 3)  # the real widths, planned only
    dense, fp4 = plan_bench_model(cfg, WriteOptions()), plan_bench_model(cfg, WriteOptions(fp4_experts=True))
    # half a byte a value plus a one-byte scale per 32 values, against bf16's two bytes
    assert fp4.expert_bytes / dense.expert_bytes == (0.5 + 1 / 32) / 2
    assert dense.total_bytes - fp4.total_bytes == dense.expert_bytes - fp4.expert_bytes
    assert fp4.cfg["expert_dtype"] == "fp4" and "expert_dtype" not in dense.cfg


def test_fp4_home_copy_decodes_as_dequantising_at_load(fp4_model, prompt):
    runs = {}
    for fmt in ("dense", "fp4"):
        loaded = _load(fp4_model, torch.float32, fmt)
        assert (loaded.store.layout.quant is None) == (fmt == "dense")
        runs[fmt] = moetier_run(loaded, prompt, STEPS)
        if fmt == "fp4":  # the home copy: half a byte a value plus an e8m0 scale byte per 32, against fp32's 4
            assert loaded.store.total_bytes() == LAYERS * EXPERTS * 3 * INTER * HIDDEN * (0.5 + 1 / BLOCK)
    (ref_prefill, ref_steps, ref_tokens), (prefill, steps, tokens) = runs["dense"], runs["fp4"]
    assert torch.isfinite(ref_prefill).all() and ref_prefill.std(dim=0).mean() > 0.05  # a live, finite model
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


def _tiered(path, dtype, expert_format, route):
    """``path`` loaded behind the tiered dispatcher with a 2-slot cache (most expert uses miss)."""
    arena = HostExpertArena.for_checkpoint(path, dtype, expert_format, progress=False)
    options = dict(cache_slots=2, miss_route=route, cpu_threads=1)
    return _load(path, dtype, expert_format, dispatcher="tiered", expert_allocator=arena, dispatcher_options=options)


@pytest.mark.parametrize("route", ["cpu", "copy"])
def test_tiered_fp4_experts_with_a_small_cache_decode_the_same_tokens(fp4_model, prompt, route):
    ref_prefill, ref_steps, ref_tokens = moetier_run(_load(fp4_model, torch.float32, "dense"), prompt, STEPS)
    loaded = _tiered(fp4_model, torch.float32, "fp4", route)
    dispatcher = loaded.model.dispatcher
    prefill, steps, tokens = moetier_run(loaded, prompt, STEPS)
    dispatcher.close()
    assert_same_run((prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens))
    snap = dispatcher.metrics.snapshot()
    assert snap["hit_rate"] < 0.5 and snap["totals"]["cpu_pairs" if route == "cpu" else "copy_bytes"] > 0
    assert dispatcher.block_bytes == loaded.store.layout.block_numel  # fp4 cache slots


def test_bf16_misses_run_the_c_kernels_fp4_path_bit_for_bit(fp4_model, prompt):
    """The power-of-two scales take the C kernel's fp4 path, which decodes exactly as its bf16 path on the
    experts dequantised at load."""
    if not cpu_experts.available():
        pytest.skip("the C kernel is not built here (no compiler, or a build the tier does not use)")
    runs, kernels = {}, {}
    for fmt in ("dense", "fp4"):
        loaded = _tiered(fp4_model, torch.bfloat16, fmt, "cpu")
        runs[fmt] = moetier_run(loaded, prompt, STEPS)
        kernels[fmt] = loaded.model.dispatcher.cpu_tier.last_kernel
        loaded.model.dispatcher.close()
    isa = cpu_experts.kernel_isa()
    assert kernels == {"dense": f"c-{isa}", "fp4": f"c-{isa}-fp4_e8m0"}  # ue8m0: the scales kept as bytes
    (ref_prefill, ref_steps, ref_tokens), (prefill, steps, tokens) = runs["dense"], runs["fp4"]
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


def test_decode_bench_runs_on_the_fp4_home_copy(fp4_model):
    cfg = DecodeBenchConfig(
        model=fp4_model, modes=["naive", "tiered"], streams=[1], steps=2, repeats=1, warmup=1, prompt_len=8,
        dtype="fp32", device="cpu", quick_bounds=True, cache_fraction=0.1, expert_format="fp4",
    )  # fmt: skip
    receipt = run_decode_bench(cfg)
    assert receipt["config"]["expert_format"] == "fp4"
    assert receipt["plan"]["expert_block_bytes"] == 3 * INTER * HIDDEN * (0.5 + 1 / BLOCK)  # well under fp32's
    assert receipt["greedy_tokens_agree"]["tiered@1"] == 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--shape", "deepseek-v3", "--layers", "2", "--fp4-experts"], "never ship; use a deepseek-v4 shape"),
        ([*TINY_V4, "--fp4-experts", "--fp8-experts"], "--fp8-experts and --fp4-experts are exclusive"),
        ([*TINY_V4, "--fp4-experts", "--moe-intermediate-size", "48"], "multiples of 32"),
    ],
)
def test_bad_requests_fail_in_one_line_before_writing(tmp_path, capsys, extra, message):
    out = tmp_path / "model"
    assert _run(*extra, "--out", str(out), "--device", "cpu", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not out.exists()
    with pytest.raises(ConfigError, match="exclusive"):
        WriteOptions(fp8_experts=True, fp4_experts=True)
