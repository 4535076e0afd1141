"""FP8 experts kept fp8-block in the home copy (``expert_format="fp8"``) compute what dequantised ones do.

One tiny DeepSeek-V3 checkpoint in the release's FP8 layout (every linear weight float8 with 128 x 128
tile scales; expert matrices 160 x 192, so partial edge tiles and gate/up scales that do not share a
tile row) is loaded with its experts dequantised at load (today's path) and kept fp8.
"""

from __future__ import annotations

import json

import pytest
import torch
from reference import assert_same_run, moetier_run, save_tiny
from test_deepseek_v3 import tiny_v3_config
from test_fp8 import RAGGED, quantize_checkpoint

from moetier import cli
from moetier.config import ModelLoadConfig
from moetier.errors import CheckpointError, ConfigError
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.plan import PlanBudget, checkpoint_sizes, make_plan
from moetier.weights.loader import load_model

PROMPT_LEN, STEPS = 24, 16
LAYERS = 3  # layer 0 dense, layers 1-2 with 8 routed experts each


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 checkpoint, its fp8-block release-layout copy)."""
    root = tmp_path_factory.mktemp("fp8_experts")
    config = tiny_v3_config(
        **RAGGED,
        num_hidden_layers=LAYERS,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    save_tiny(config, root / "plain", dtype=torch.bfloat16)
    quantize_checkpoint(root / "plain", root / "fp8", LAYERS)
    return root / "plain", root / "fp8"


@pytest.fixture(scope="module")
def prompt(checkpoints):
    vocab = json.loads((checkpoints[1] / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))


def _load(path, dtype, expert_format, **kwargs):
    return load_model(path, ModelLoadConfig(dtype=dtype, expert_format=expert_format), progress=False, **kwargs)


def _tiered(path, dtype, expert_format, **options):
    arena = HostExpertArena.for_checkpoint(path, dtype, expert_format, progress=False)
    loaded = _load(path, dtype, expert_format, dispatcher="tiered", expert_allocator=arena, dispatcher_options=options)
    return loaded, arena


def test_layout_sizes_and_views():
    dense = ExpertLayout((1,), num_experts=4, hidden_size=192, intermediate_size=160, top_k=2)
    quant = ExpertLayout((1,), num_experts=4, hidden_size=192, intermediate_size=160, top_k=2, quant=ExpertQuant())
    assert (dense.block_numel, dense.block_bytes(torch.bfloat16)) == (3 * 160 * 192, 6 * 160 * 192)  # unchanged
    # float8 gate/up/down (each a multiple of 64 bytes here), then three 2x2 float32 grids on 64-byte lines
    assert quant.block_numel == quant.block_bytes(torch.bfloat16) == 3 * 160 * 192 + 3 * 64
    assert quant.block_dtype(torch.bfloat16) == torch.uint8 and quant.gate_up_numel == dense.gate_up_numel
    weights = ExpertWeights.from_block(torch.zeros(quant.block_numel, dtype=torch.uint8), quant)
    assert weights.quantized and weights.gate_up is None
    assert weights.gate_q.dtype == torch.float8_e4m3fn and weights.down_q.shape == (192, 160)
    assert weights.gate_scale.shape == weights.up_scale.shape == weights.down_scale.shape == (2, 2)
    assert not ExpertWeights.from_block(torch.zeros(dense.block_numel), dense).quantized
    with pytest.raises(ConfigError, match="tile"):
        ExpertQuant(tile=(128, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_fp8_experts_equal_dequantised_at_load(checkpoints, prompt, dtype):
    dense = _load(checkpoints[1], dtype, "dense")
    fp8 = _load(checkpoints[1], dtype, "fp8")
    kept = fp8.store.expert(1, 3)
    assert kept.quantized and fp8.store.block_dtype == torch.uint8 and fp8.store.dtype == dtype
    assert torch.equal(kept.dequantized(dtype).gate_up, dense.store.expert(1, 3).gate_up)
    assert torch.equal(kept.dequantized(dtype).down, dense.store.expert(1, 3).down)
    ref_prefill, ref_steps, ref_tokens = moetier_run(dense, prompt, STEPS)
    prefill, steps, tokens = moetier_run(fp8, prompt, STEPS)
    assert torch.equal(prefill, ref_prefill) and tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))


@pytest.mark.parametrize("route", ["cpu", "copy", "auto"])
def test_tiered_fp8_experts_match_resident_dense(checkpoints, prompt, route):
    ref_prefill, ref_steps, ref_tokens = moetier_run(_load(checkpoints[1], torch.float32, "dense"), prompt, STEPS)
    loaded, arena = _tiered(checkpoints[1], torch.float32, "fp8", cache_slots=2, miss_route=route, cpu_threads=1)
    dispatcher = loaded.model.dispatcher
    prefill, steps, tokens = moetier_run(loaded, prompt, STEPS)
    dispatcher.close()
    assert_same_run((prefill, steps, tokens), (ref_prefill, ref_steps, ref_tokens))
    snap = dispatcher.metrics.snapshot()
    assert snap["hit_rate"] < 0.5  # 2 slots of 16 experts: most uses miss
    assert dispatcher.block_bytes == dispatcher.cache.block_bytes == loaded.store.layout.block_numel  # fp8 slots
    assert arena.used_bytes == loaded.store.total_bytes()  # the arena was sized for fp8 blocks
    if route != "auto":
        totals = snap["totals"]
        assert totals["cpu_pairs" if route == "cpu" else "copy_bytes"] > 0


def test_home_copy_is_half_the_bytes_and_the_plan_follows(checkpoints):
    dense = _load(checkpoints[1], torch.bfloat16, "dense").store
    fp8 = _load(checkpoints[1], torch.bfloat16, "fp8").store
    experts = 2 * 8
    assert dense.total_bytes() == experts * 3 * 160 * 192 * 2
    assert fp8.total_bytes() == experts * fp8.layout.block_numel
    assert 0.5 < fp8.total_bytes() / dense.total_bytes() < 0.51
    # The stored experts are the same fp8 + scales; only the home copy differs.
    sizes = {f: checkpoint_sizes(checkpoints[1], torch.bfloat16, f) for f in ("dense", "fp8")}
    assert sizes["dense"].stored_experts == sizes["fp8"].stored_experts
    assert sizes["fp8"].layout == fp8.layout
    plans = {
        f: make_plan(checkpoints[1], PlanBudget("1GiB", context=128, expert_format=f), torch.bfloat16)
        for f in ("dense", "fp8")
    }
    assert plans["dense"].expert_block_bytes == dense.layout.block_bytes(torch.bfloat16)
    assert plans["fp8"].expert_block_bytes == fp8.layout.block_numel
    assert plans["fp8"].host_expert_bytes == fp8.total_bytes()
    assert "home copy (fp8 + scales)" in plans["fp8"].table()


def test_fp8_on_a_bf16_checkpoint_fails_in_one_line_naming_the_fix(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="no quantization_config; load it with --expert-format dense") as info:
        _load(checkpoints[0], torch.float32, "fp8")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--expert-format dense"):
        HostExpertArena.for_checkpoint(checkpoints[0], torch.float32, "fp8", progress=False)
    # A config claiming fp8 over experts stored in bf16: the loader names the tensor.
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    for item in checkpoints[0].iterdir():
        (claimed / item.name).symlink_to(item)
    (claimed / "config.json").unlink()
    config = json.loads((checkpoints[1] / "config.json").read_text())
    (claimed / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.\w+_proj\.weight is stored plain.*--expert-format dense"):
        _load(claimed, torch.float32, "fp8")
    with pytest.raises(ConfigError, match="expert_format must be one of dense, fp8"):
        ModelLoadConfig(expert_format="int4")


def test_cli_flag_parses_and_plan_reports_fp8_bytes(checkpoints, capsys):
    parser = cli.build_parser()
    for command in (
        ["serve"],
        ["generate", "--model", "m", "--prompt", "p"],
        ["plan", "--model", "m", "--gpu-memory", "1GiB"],
    ):
        assert parser.parse_args(command).expert_format == "dense"
        assert parser.parse_args([*command, "--expert-format", "fp8"]).expert_format == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--expert-format", "int4"])
    base = ["plan", "--model", str(checkpoints[1]), "--gpu-memory", "1GiB", "--device", "cpu", "--dtype", "bf16"]
    base += ["--prefix-cache", "0"]  # 1GiB of VRAM for tiny models: the default 1GiB prefix cache would not fit
    assert cli.main([*base, "--context", "128", "--expert-format", "fp8"]) == 0
    assert "home copy (fp8 + scales)" in capsys.readouterr().out


def test_llm_loads_tiered_fp8_experts(checkpoints, prompt):
    from moetier import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    common = dict(device="cpu", dtype="fp32", max_model_len=128, load_progress=False, skip_tokenizer_init=True)
    expected = (
        LLM(checkpoints[1], **common).generate({"prompt_token_ids": prompt.tolist()}, params)[0].outputs[0].token_ids
    )
    llm = LLM(
        checkpoints[1], **common, gpu_memory="2GiB", prefill_chunk_tokens=64, miss_route="cpu", expert_format="fp8"
    )
    assert llm.loaded.store.layout.quant is not None and llm.plan.budget.expert_format == "fp8"
    assert llm.generate({"prompt_token_ids": prompt.tolist()}, params)[0].outputs[0].token_ids == expected
