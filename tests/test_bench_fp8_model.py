"""Benchmark checkpoints with fp8 experts: written as DeepSeek's fp8 releases are, loaded either way alike."""

import argparse
import json

import pytest
import torch
from test_bench_decode import TINY_V4

from moetier.bench.decode import DecodeBenchConfig, run_decode_bench
from moetier.bench.fp8_model import FP8_MAX
from moetier.bench.make_model import configure_parser, run
from moetier.config import ModelLoadConfig
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.loader import load_model


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "v4-fp8"
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert run(parser.parse_args([*TINY_V4, "--out", str(out), "--device", "cpu", "--fp8-experts"])) == 0
    return out


def test_experts_are_written_fp8_with_tile_scales_and_declared(fp8_model):
    config = json.loads((fp8_model / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    ckpt = Checkpoint(fp8_model)
    name = "model.layers.0.ffn.experts.3.w1.weight"
    assert ckpt.tensors[name].dtype == "F8_E4M3" and ckpt.has(name.replace(".weight", ".weight_scale_inv"))
    values = ckpt.get(name).float()
    assert values.std() > 1 and values.abs().max() <= FP8_MAX  # real spread, within e4m3's range
    assert ckpt.tensors["model.layers.0.attn.wq_a.weight"].dtype == "BF16"  # only routed experts are fp8
    assert ckpt.tensors["model.layers.0.ffn.shared_experts.w1.weight"].dtype == "BF16"


def test_fp8_home_copy_gives_the_logits_of_dequantising_at_load(fp8_model):
    prompt = torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for fmt in ("dense", "fp8"):
        loaded = load_model(fp8_model, ModelLoadConfig(dtype=torch.float32, device="cpu", expert_format=fmt))
        model = loaded.model
        cache = model.new_cache(16)
        logits[fmt] = model.compute_logits(model(prompt, cache))
        assert (loaded.store.layout.quant is None) == (fmt == "dense")
    assert torch.equal(logits["dense"], logits["fp8"])


def test_decode_bench_runs_on_the_fp8_home_copy(fp8_model):
    cfg = DecodeBenchConfig(
        model=fp8_model, modes=["naive", "tiered"], streams=[1], steps=2, repeats=1, warmup=1, prompt_len=8,
        dtype="fp32", device="cpu", quick_bounds=True, cache_fraction=0.1, expert_format="fp8",
    )  # fmt: skip
    receipt = run_decode_bench(cfg)
    assert receipt["config"]["expert_format"] == "fp8"
    assert receipt["plan"]["expert_block_bytes"] < 3 * 64 * 32 * 4  # fp8 bytes + scales, well under fp32
    assert receipt["greedy_tokens_agree"]["tiered@1"] == 1.0


@pytest.fixture(scope="module")
def fp8_backbone_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "v4-fp4-fp8bb"
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = [*TINY_V4, "--out", str(out), "--device", "cpu", "--fp4-experts", "--fp8-backbone"]
    assert run(parser.parse_args(args)) == 0
    return out


def test_fp8_backbone_is_written_as_releases_store_it_and_decodes_either_way(fp8_backbone_model):
    ckpt = Checkpoint(fp8_backbone_model)
    for name in ("model.layers.0.attn.wq_a.weight", "model.layers.0.attn.wo_a.weight", "model.layers.1.attn.wkv.weight",
                 "model.layers.0.ffn.shared_experts.w2.weight"):  # fmt: skip
        assert ckpt.tensors[name].dtype == "F8_E4M3" and ckpt.has(name.replace(".weight", ".weight_scale_inv"))
    for name in ("head.weight", "model.embed_tokens.weight", "model.layers.0.ffn.gate.weight"):
        assert ckpt.tensors[name].dtype != "F8_E4M3", name  # embeddings, LM head and routers stay dense
    receipts = {}
    for backbone_format in ("fp8", "dense"):
        cfg = DecodeBenchConfig(
            model=fp8_backbone_model, modes=["resident", "tiered"], streams=[1], steps=3, repeats=1, warmup=1,
            prompt_len=8, dtype="fp32", device="cpu", quick_bounds=True, cache_fraction=0.1, expert_format="fp4",
            backbone_format=backbone_format,
        )  # fmt: skip
        receipts[backbone_format] = run_decode_bench(cfg)
        assert receipts[backbone_format]["config"]["backbone_format"] == backbone_format
        assert receipts[backbone_format]["greedy_tokens_agree"]["tiered@1"] == 1.0
    fp8, dense = (receipts[f]["plan"]["backbone_bytes"] for f in ("fp8", "dense"))
    assert fp8 < dense
