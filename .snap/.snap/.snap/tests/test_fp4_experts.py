"""DeepSeek-V4's FP4 experts kept packed in the home copy (``expert_format="fp4"``) compute what dequantised ones do.

One tiny DeepSeek-V4 checkpoint (``tiny_v4_config``: 5 MoE layers of 8 experts, hidden 64, intermediate 32)
has its routed experts re-encoded in the release's FP4 layout: per-expert packed e2m1 bytes with one scale
per 32 inputs of a row, the scales stored ue8m0, raw uint8 exponents or float32 by turns. It is loaded with
its experts dequantised at load (the existing path) and kept fp4.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from reference import assert_same_run, moetier_run, relative_error
from safetensors.torch import load_file, save_file
from test_deepseek_v4 import NUM_EXPERTS, VOCAB, save_tiny_v4
from test_fp4 import RELEASE_QUANT_CONFIG, encode_fp4

from moetier import cli
from moetier.config import ModelLoadConfig
from moetier.errors import CheckpointError, ConfigError
from moetier.kernels import cpu_experts
from moetier.kernels.grouped_experts import _layout_fits
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights, swiglu_expert
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.plan import PlanBudget, make_plan
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.loader import load_model
from moetier.weights.quant_experts import all_powers_of_two, checkpoint_expert_layout, copy_quant_expert

PROMPT_LEN, STEPS = 20, 8
HIDDEN, INTER = 64, 32
FP4 = ExpertQuant(kind="fp4-block", tile=(1, 32))


def _scale_as(exponents: torch.Tensor, expert: int) -> torch.Tensor:
    """The release's ue8m0 scales, or the same powers of two as raw exponent bytes or float32, by expert."""
    kind = expert % 3
    if kind == 0:
        return exponents.view(torch.float8_e8m0fnu)
    return exponents if kind == 1 else (2.0 ** (exponents.double() - 127)).float()


def _encode_experts(tensors: dict[str, torch.Tensor], fused: bool) -> None:
    """Replace the saved per-expert fp32 ``w1``/``w2``/``w3`` with FP4 ones (release names), or fuse them.

    Fused: transformers' ``mlp.experts.gate_up_proj``/``down_proj`` with ``*_scale_inv``, per layer.
    """
    per_expert = sorted(n for n in tensors if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", n))
    if fused:
        layers = sorted({int(n.split(".")[2]) for n in per_expert})
        for layer in layers:
            prefix = f"model.layers.{layer}.ffn.experts"
            stacked = {
                w: torch.stack([tensors.pop(f"{prefix}.{e}.{w}.weight") for e in range(NUM_EXPERTS)])
                for w in ("w1", "w2", "w3")
            }
            fused_parts = {"gate_up_proj": torch.cat([stacked["w1"], stacked["w3"]], dim=1), "down_proj": stacked["w2"]}
            for part, weight in fused_parts.items():
                packed, exponents = encode_fp4(weight)
                name = f"model.layers.{layer}.mlp.experts.{part}"
                tensors[name] = packed.view(torch.int8)
                tensors[f"{name}_scale_inv"] = exponents.view(torch.float8_e8m0fnu)
        return
    for name in per_expert:
        packed, exponents = encode_fp4(tensors[name])
        tensors[name] = packed.view(torch.int8)
        tensors[f"{name.removesuffix('.weight')}.scale"] = _scale_as(exponents, int(name.split(".")[5]))


def _write(src, dst, fused: bool = False, config_update: dict | None = None) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    _encode_experts(tensors, fused)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.update(config_update if config_update is not None else {})
    (dst / "config.json").write_text(json.dumps(config))


FP4_CONFIG = {"expert_dtype": "fp4", "quantization_config": RELEASE_QUANT_CONFIG}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the fp32 checkpoint, its FP4-expert release-like copy)."""
    root = tmp_path_factory.mktemp("fp4_experts")
    save_tiny_v4(root / "plain", torch.float32)
    _write(root / "plain", root / "fp4", config_update=FP4_CONFIG)
    return root / "plain", root / "fp4"


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))


def _load(path, dtype, expert_format, **kwargs):
    return load_model(path, ModelLoadConfig(dtype=dtype, expert_format=expert_format), progress=False, **kwargs)


def _fp4_weights(seed: int = 0) -> ExpertWeights:
    """One random fp4 expert block, as the loader would fill it."""
    layout = ExpertLayout((0,), num_experts=1, hidden_size=HIDDEN, intermediate_size=INTER, top_k=1, quant=FP4)
    weights = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
    generator = torch.Generator().manual_seed(seed)
    for part in ("gate", "up", "down"):
        q, scale = getattr(weights, f"{part}_q"), getattr(weights, f"{part}_scale")
        q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=generator))
        scale.copy_(2.0 ** torch.randint(-6, 2, scale.shape, generator=generator).float())
    return weights


def test_layout_sizes_and_views():
    layout = ExpertLayout((1,), num_experts=4, hidden_size=HIDDEN, intermediate_size=INTER, top_k=2, quant=FP4)
    parts = {p.name: p for p in layout.quant_parts()}
    assert [parts[n].shape for n in ("gate", "up", "down")] == [(32, 32), (32, 32), (64, 16)]
    assert [parts[f"{n}_scale"].shape for n in ("gate", "up", "down")] == [(32, 2), (32, 2), (64, 1)]
    assert all(p.offset % 64 == 0 for p in parts.values())
    # packed bytes 3 * I * H / 2, float32 scales 3 * I * H / 32 * 4 (each a multiple of 64 bytes here)
    assert layout.block_numel == layout.block_bytes(torch.bfloat16) == 3 * 1024 + 3 * 256
    weights = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
    assert weights.quantized and weights.quant_kind == "fp4-block" and weights.gate_up is None
    assert weights.gate_q.dtype == torch.uint8 and weights.down_scale.dtype == torch.float32
    assert weights.dequantized(torch.bfloat16).down.shape == (HIDDEN, INTER)
    with pytest.raises(ConfigError, match="columns must be even"):
        ExpertQuant(kind="fp4-block", tile=(1, 31))
    with pytest.raises(ConfigError, match="does not divide"):
        ExpertLayout((1,), num_experts=4, hidden_size=48, intermediate_size=INTER, top_k=2, quant=FP4)
    with pytest.raises(ConfigError, match="fp8-block, fp4-block"):
        ExpertQuant(kind="int4")


def test_grouped_kernel_refuses_fp4_experts_and_the_cpu_tier_runs_them():
    weights = _fp4_weights()
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    with pytest.MonkeyPatch.context() as env:  # grouped (Triton) kernel: fp4 unless MOETIER_FP4_GROUPED=0
        env.delenv("MOETIER_FP4_GROUPED", raising=False)
        assert _layout_fits(weights, hidden.dtype)  # on by default since its GPU test passed
        env.setenv("MOETIER_FP4_GROUPED", "0")
        assert not _layout_fits(weights, hidden.dtype)
    rows, gates = torch.arange(5), torch.ones(5)
    job = CpuJob(hidden=hidden, groups=[CpuGroup(weights, rows, gates)])
    torch_tier = CpuExpertTier(swiglu_limit=10.0, threads=1, use_kernel=False)
    reference = torch_tier.run(job)
    torch_tier.close()
    assert reference.kernel == "torch"
    assert torch.equal(reference.out, swiglu_expert(hidden, weights, 10.0).float())
    # The C kernel (where it is built) takes fp4 jobs: its bf16 path's result on the dequantised expert, exactly.
    tier = CpuExpertTier(swiglu_limit=10.0, threads=1)
    assert tier._kernel_fits(job, torch.empty(hidden.shape, dtype=torch.float32)) == tier.use_kernel
    ours = tier.run(job)
    dense = tier.run(CpuJob(hidden=hidden, groups=[CpuGroup(weights.dequantized(torch.bfloat16), rows, gates)]))
    tier.close()
    if tier.use_kernel:
        assert ours.kernel == f"c-{cpu_experts.kernel_isa()}-fp4" and dense.kernel == f"c-{cpu_experts.kernel_isa()}"
    assert torch.equal(ours.out, dense.out)
    assert relative_error(ours.out, reference.out) < 0.005  # the C kernel's bf16 bar against torch


def test_tiered_bf16_fp4_experts_run_the_c_kernel_bit_for_bit(checkpoints, prompt):
    """bf16 fp4 experts missed to the CPU tier run the C kernel, and decode exactly as the same experts
    dequantised at load do (there the kernel's bf16 path runs them)."""
    if not cpu_experts.available():
        pytest.skip("the C kernel is not built here (no compiler, or a build the tier does not use)")
    runs, kernels = {}, {}
    for expert_format in ("dense", "fp4"):
        arena = HostExpertArena.for_checkpoint(checkpoints[1], torch.bfloat16, expert_format, progress=False)
        options = dict(cache_slots=2, miss_route="cpu", cpu_threads=1)
        loaded = _load(
            checkpoints[1], torch.bfloat16, expert_format, dispatcher="tiered", expert_allocator=arena,
            dispatcher_options=options,
        )  # fmt: skip
        dispatcher = loaded.model.dispatcher
        runs[expert_format] = moetier_run(loaded, prompt, STEPS)
        kernels[expert_format] = dispatcher.cpu_tier.last_kernel
        assert dispatcher.metrics.snapshot()["totals"]["cpu_pairs"] > 0
        dispatcher.close()
    isa = cpu_experts.kernel_isa()
    assert kernels == {"dense": f"c-{isa}", "fp4": f"c-{isa}-fp4_e8m0"}  # ue8m0: the scales kept as bytes
    (ref_prefill, ref_steps, ref_tokens), (prefill, steps, tokens) = runs["dense"], runs["fp4"]
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_fp4_experts_equal_dequantised_at_load(checkpoints, prompt, dtype):
    dense = _load(checkpoints[1], dtype, "dense")
    fp4 = _load(checkpoints[1], dtype, "fp4")
    # The release's config declares ue8m0 scales: the layout promises powers of two (the loader checked them) and
    # keeps them as exponent bytes (MOETIER_FP4_SCALES unset).
    assert fp4.store.layout.quant == replace(FP4, pow2_scales=True, scale_format="e8m0")
    assert fp4.store.block_dtype == torch.uint8
    for expert in (0, 1, 2):  # ue8m0, uint8 and float32 scales
        kept = fp4.store.expert(2, expert)
        assert kept.quantized and kept.gate_q.dtype == torch.uint8
        assert torch.equal(kept.dequantized(dtype).gate_up, dense.store.expert(2, expert).gate_up)
        assert torch.equal(kept.dequantized(dtype).down, dense.store.expert(2, expert).down)
    ref_prefill, ref_steps, ref_tokens = moetier_run(dense, prompt, STEPS)
    prefill, steps, tokens = moetier_run(fp4, prompt, STEPS)
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


@pytest.mark.parametrize("route", ["cpu", "copy", "auto"])
def test_tiered_fp4_experts_match_resident_dense(checkpoints, prompt, route):
    ref_prefill, ref_steps, ref_tokens = moetier_run(_load(checkpoints[1], torch.float32, "dense"), prompt, STEPS)
    arena = HostExpertArena.for_checkpoint(checkpoints[1], torch.float32, "fp4", progress=False)
    options = dict(cache_slots=2, miss_route=route, cpu_threads=1)
    loaded = _load(
        checkpoints[1], torch.float32, "fp4", dispatcher="tiered", expert_allocator=arena, dispatcher_options=options
    )
    dispatcher = loaded.model.dispatcher
    prefill, steps, tokens = moetier_run(loaded, prompt, STEPS)
    dispatcher.close()
    assert_same_run((prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens))
    snap = dispatcher.metrics.snapshot()
    assert snap["hit_rate"] < 0.5  # 2 slots of 40 experts: most uses miss
    assert dispatcher.block_bytes == loaded.store.layout.block_numel  # fp4 cache slots
    assert arena.used_bytes == loaded.store.total_bytes()  # the arena was sized for fp4 blocks
    if route != "auto":
        assert snap["totals"]["cpu_pairs" if route == "cpu" else "copy_bytes"] > 0


def test_home_copy_bytes_and_the_plan(checkpoints, capsys):
    dense = _load(checkpoints[1], torch.bfloat16, "dense").store
    fp4 = _load(checkpoints[1], torch.bfloat16, "fp4").store
    assert dense.total_bytes() == 5 * NUM_EXPERTS * 3 * INTER * HIDDEN * 2
    # half a byte a value plus an e8m0 scale byte per 32 values (ue8m0), against bf16's two bytes: 0.266x
    assert fp4.total_bytes() / dense.total_bytes() == pytest.approx(0.2656, abs=0.01)
    plan = make_plan(checkpoints[1], PlanBudget("1GiB", context=128, expert_format="fp4"), torch.bfloat16)
    assert plan.expert_block_bytes == fp4.layout.block_numel and plan.host_expert_bytes == fp4.total_bytes()
    assert "home copy (fp4 + scales)" in plan.table()
    base = ["plan", "--model", str(checkpoints[1]), "--gpu-memory", "1GiB", "--device", "cpu", "--dtype", "bf16"]
    assert cli.main([*base, "--context", "128", "--expert-format", "fp4"]) == 0
    assert "home copy (fp4 + scales)" in capsys.readouterr().out
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--expert-format", "fp4"]).expert_format == "fp4"


def test_errors_are_one_line_and_name_the_fix(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="it has no expert_dtype; load it with --expert-format dense") as info:
        _load(checkpoints[0], torch.float32, "fp4")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--expert-format dense"):
        HostExpertArena.for_checkpoint(checkpoints[0], torch.float32, "fp4", progress=False)
    with pytest.raises(ConfigError, match="are FP4.*--expert-format fp4 or dense"):
        _load(checkpoints[1], torch.float32, "fp8")
    # A config claiming fp4 over experts stored plain: the loader names the tensor.
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / "model.safetensors").symlink_to(checkpoints[0] / "model.safetensors")
    config = json.loads((checkpoints[0] / "config.json").read_text())
    (claimed / "config.json").write_text(json.dumps({**config, **FP4_CONFIG}))
    with pytest.raises(
        CheckpointError, match=r"experts\.\d+\.w\d\.weight is stored plain.*--expert-format dense"
    ) as info:
        _load(claimed, torch.float32, "fp4")
    assert "\n" not in str(info.value)
    fused = tmp_path / "fused"  # transformers' fused FP4 experts: dense only
    _write(checkpoints[0], fused, fused=True, config_update=FP4_CONFIG)
    with pytest.raises(CheckpointError, match="holds all experts fused; expert_format 'fp4'.*--expert-format dense"):
        _load(fused, torch.float32, "fp4")


def test_ue8m0_layouts_refuse_scales_that_are_not_powers_of_two():
    """``pow2_scales`` lets the GPU kernels scale sums, not weights: the loader must not let a wrong config
    through, and says which fix applies."""
    layout = ExpertLayout((0,), 1, HIDDEN, INTER, 1, quant=replace(FP4, pow2_scales=True))
    weights = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
    packed = torch.randint(0, 256, weights.gate_q.shape, dtype=torch.uint8)
    pow2 = torch.exp2(torch.randint(-12, 3, weights.gate_scale.shape).float())
    copy_quant_expert(weights, "gate", packed, pow2.to(torch.float8_e8m0fnu))
    assert torch.equal(weights.gate_scale, pow2) and torch.equal(weights.gate_q, packed)
    with pytest.raises(ValueError, match="not powers of two.*scale_fmt"):
        copy_quant_expert(weights, "up", packed, pow2 * 1.5)
    assert all_powers_of_two(torch.tensor([0.0, 2.0**-126, 0.5, 1.0, 2.0**100]))
    assert not any(all_powers_of_two(torch.tensor([v])) for v in (0.75, 3.0, 2.0**-127, float("inf"), float("nan")))


@pytest.mark.parametrize("route", ["cpu", "copy"])
def test_e8m0_scale_bytes_in_the_home_copy_decode_as_float32_scales_do(checkpoints, prompt, route, monkeypatch):
    """MOETIER_FP4_SCALES=e8m0 keeps each scale as its exponent byte (blocks a quarter of the scale bytes
    smaller); the tiered engine's steps are bit for bit those of the same experts with float32 scales."""
    runs, blocks = {}, {}
    for scales in ("float32", "e8m0"):
        monkeypatch.setenv("MOETIER_FP4_SCALES", scales)
        arena = HostExpertArena.for_checkpoint(checkpoints[1], torch.bfloat16, "fp4", progress=False)
        options = dict(cache_slots=2, miss_route=route, cpu_threads=1)
        loaded = _load(
            checkpoints[1], torch.bfloat16, "fp4", dispatcher="tiered", expert_allocator=arena,
            dispatcher_options=options,
        )  # fmt: skip
        assert loaded.store.layout.quant.scale_format == scales
        assert loaded.store.expert(2, 0).gate_scale.dtype == (torch.uint8 if scales == "e8m0" else torch.float32)
        blocks[scales] = loaded.store.layout.block_numel
        runs[scales] = moetier_run(loaded, prompt, STEPS)
        totals = loaded.model.dispatcher.metrics.snapshot()["totals"]
        assert totals["cpu_pairs" if route == "cpu" else "copy_bytes"] > 0
        loaded.model.dispatcher.close()
    assert blocks["e8m0"] < blocks["float32"]
    (ref_prefill, ref_steps, ref_tokens), (prefill, steps, tokens) = runs["float32"], runs["e8m0"]
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


def test_ue8m0_checkpoints_keep_e8m0_scale_bytes_by_default(checkpoints, tmp_path, monkeypatch):
    """Unset (or auto), MOETIER_FP4_SCALES gives e8m0 bytes where the config declares ue8m0 scales, float32 scales
    where it does not; float32 opts out."""
    monkeypatch.delenv("MOETIER_FP4_SCALES", raising=False)
    assert checkpoint_expert_layout(Checkpoint(checkpoints[1]), "fp4").quant.scale_format == "e8m0"
    no_ue8m0 = tmp_path / "no-ue8m0"
    _write(checkpoints[0], no_ue8m0, config_update={**FP4_CONFIG, "quantization_config": {}})
    assert checkpoint_expert_layout(Checkpoint(no_ue8m0), "fp4").quant.scale_format == "float32"
    for value, expected in (("auto", "e8m0"), ("float32", "float32"), (" E8M0 ", "e8m0")):
        monkeypatch.setenv("MOETIER_FP4_SCALES", value)
        assert checkpoint_expert_layout(Checkpoint(checkpoints[1]), "fp4").quant.scale_format == expected


def test_e8m0_scale_bytes_are_refused_where_they_cannot_hold_the_scales(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETIER_FP4_SCALES", "e8m1")
    with pytest.raises(ConfigError, match="MOETIER_FP4_SCALES must be one of auto, float32, e8m0"):
        _load(checkpoints[1], torch.bfloat16, "fp4")
    monkeypatch.setenv("MOETIER_FP4_SCALES", "e8m0")
    no_ue8m0 = tmp_path / "no-ue8m0"
    _write(checkpoints[0], no_ue8m0, config_update={**FP4_CONFIG, "quantization_config": {}})
    with pytest.raises(ConfigError, match="needs ue8m0 scales .* unset MOETIER_FP4_SCALES"):
        _load(no_ue8m0, torch.bfloat16, "fp4")
    layout = ExpertLayout((0,), 1, HIDDEN, INTER, 1, quant=replace(FP4, pow2_scales=True, scale_format="e8m0"))
    weights = ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=torch.uint8), layout)
    packed = torch.zeros(INTER, HIDDEN // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zero, negative or not normal powers of two"):
        copy_quant_expert(weights, "gate", packed, torch.zeros(INTER, HIDDEN // 32))
    with pytest.raises(ConfigError, match="e8m0 scale bytes need fp4-block experts with power-of-two"):
        ExpertQuant(kind="fp4-block", tile=(1, 32), scale_format="e8m0")
