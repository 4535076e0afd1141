"""A wrong or unsupported checkpoint fails with ONE line naming the file or tensor at fault."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reference import save_tiny
from safetensors.torch import load_file, save_file
from test_qwen3_moe import tiny_qwen3_config

from moetier.config import ModelLoadConfig
from moetier.errors import CheckpointError
from moetier.weights.checkpoint import INDEX_FILE
from moetier.weights.loader import load_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """One tiny Qwen3-MoE checkpoint saved whole and sharded (never modified; tests copy it)."""
    from transformers import AutoModelForCausalLM

    single = tmp_path_factory.mktemp("single")
    save_tiny(tiny_qwen3_config(), single)
    sharded = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="300KB")
    return {"single": single, "sharded": sharded}


@pytest.fixture
def ckpt(pristine, tmp_path) -> Callable[[str], Path]:
    """A fresh, writable copy of the pristine ``single`` or ``sharded`` checkpoint."""

    def copy(kind: str = "single") -> Path:
        return Path(shutil.copytree(pristine[kind], tmp_path / kind))

    return copy


def load_error(path: Path) -> str:
    """The one-line message ``load_model`` fails with."""
    with pytest.raises(CheckpointError) as info:
        load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None], shard: str = WEIGHTS) -> None:
    tensors = load_file(str(path / shard))
    edit(tensors)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def shards_of(path: Path) -> list[str]:
    return sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))


def test_pristine_checkpoints_load(pristine):
    assert len(shards_of(pristine["sharded"])) >= 3
    for path in pristine.values():
        load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)


def test_missing_shard(ckpt):
    path = ckpt("sharded")
    gone = shards_of(path)[1]
    (path / gone).unlink()
    message = load_error(path)
    assert gone in message and "missing" in message and INDEX_FILE in message


def test_index_promises_a_tensor_no_shard_holds(ckpt):
    path = ckpt("sharded")
    index = json.loads((path / INDEX_FILE).read_text())
    shard = shards_of(path)[0]
    index["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight"] = shard
    (path / INDEX_FILE).write_text(json.dumps(index))
    message = load_error(path)
    assert "model.layers.0.mlp.experts.9.up_proj.weight" in message and shard in message


def test_unknown_architecture(ckpt):
    path = ckpt()
    edit_config(path, lambda c: c.update(architectures=["MysteryMoeForCausalLM"]))
    message = load_error(path)
    assert "MysteryMoeForCausalLM" in message and "unsupported architecture" in message
    assert "config.json" in message and "Qwen3MoeForCausalLM" in message  # says what is supported


def test_config_without_architectures(ckpt):
    path = ckpt()
    edit_config(path, lambda c: c.pop("architectures"))
    assert "has no 'architectures'" in load_error(path)


def test_missing_config(ckpt):
    path = ckpt()
    (path / "config.json").unlink()
    message = load_error(path)
    assert str(path / "config.json") in message and "missing" in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"architectures": ["Qwen3MoeForCausalLM"],\n "hidden_size": 6', "not valid JSON"),
        ("[1, 2, 3]", "must hold a JSON object, not list"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
    ids=["truncated-json", "json-list", "not-utf8"],
)
def test_invalid_config_json(ckpt, content, expected):
    path = ckpt()
    if isinstance(content, bytes):
        (path / "config.json").write_bytes(content)
    else:
        (path / "config.json").write_text(content)
    message = load_error(path)
    assert expected in message and "config.json" in message


def test_config_missing_a_field(ckpt):
    path = ckpt()
    edit_config(path, lambda c: c.pop("moe_intermediate_size"))
    message = load_error(path)
    assert "config.json" in message and "missing field 'moe_intermediate_size'" in message


def test_config_with_inconsistent_values(ckpt):
    path = ckpt()
    edit_config(path, lambda c: c.update(num_attention_heads=3))  # not a multiple of 2 KV heads
    message = load_error(path)
    assert "invalid Qwen3MoeForCausalLM config" in message and "num_key_value_heads" in message


def test_not_a_directory(ckpt, tmp_path):
    path = ckpt()
    message = load_error(path / WEIGHTS)
    assert str(path / WEIGHTS) in message and "not a model folder" in message
    assert "no such model folder" in load_error(tmp_path / "nowhere")


def test_folder_without_weights(ckpt):
    path = ckpt()
    (path / WEIGHTS).unlink()
    assert "no *.safetensors files" in load_error(path)


def test_mismatched_parameter_shape(ckpt):
    path = ckpt()
    name = "model.layers.2.self_attn.q_proj.weight"
    edit_tensors(path, lambda t: t.update({name: torch.randn(60, 64)}))
    message = load_error(path)
    assert name in message and "[60, 64]" in message and "[64, 64]" in message


def test_mismatched_expert_shape(ckpt):
    path = ckpt()
    name = "model.layers.3.mlp.experts.4.down_proj.weight"
    edit_tensors(path, lambda t: t.update({name: torch.randn(64, 48)}))
    message = load_error(path)
    assert name in message and "[64, 48]" in message and "[64, 32]" in message


def test_truncated_safetensors(ckpt):
    path = ckpt()
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) * 2 // 3])
    message = load_error(path)
    assert str(path / WEIGHTS) in message and "truncated" in message


@pytest.mark.parametrize(
    ("garble", "expected"),
    [
        (lambda d: d[:8] + b"\x00\xff" * 20 + d[48:], "corrupt safetensors header"),
        (lambda d: (10**12).to_bytes(8, "little") + d[8:], "header length 1000000000000 exceeds file size"),
        (lambda d: d[:5], "only 5 bytes"),
        (lambda d: d.replace(b'"F32"', b'"F33"', 1), "unsupported dtype 'F33'"),
        (lambda d: d.replace(b'"shape":[320,64]', b'"shape":[320,65]', 1), "does not fit data_offsets"),
    ],
    ids=["garbled-json", "huge-header-length", "five-bytes", "unknown-dtype", "shape-vs-offsets"],
)
def test_corrupt_safetensors(ckpt, garble, expected):
    path = ckpt()
    data = (path / WEIGHTS).read_bytes()
    garbled = garble(data)
    assert garbled != data
    (path / WEIGHTS).write_bytes(garbled)
    message = load_error(path)
    assert str(path / WEIGHTS) in message and expected in message


def test_corrupt_shard_of_a_sharded_checkpoint(ckpt):
    path = ckpt("sharded")
    shard = shards_of(path)[-1]
    (path / shard).write_bytes(b"<html>rate limited</html>")
    message = load_error(path)
    assert str(path / shard) in message and "corrupt safetensors" in message


def test_missing_parameter_tensor(ckpt):
    path = ckpt()
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    message = load_error(path)
    assert "checkpoint has no tensor for layers.1.mlp.up_proj.weight" in message


def test_missing_expert_tensor(ckpt):
    path = ckpt()
    edit_tensors(path, lambda t: t.pop("model.layers.2.mlp.experts.6.down_proj.weight"))
    message = load_error(path)
    assert "no down weights for routed expert 6 of layer 2" in message and "(1 experts affected)" in message


def test_missing_whole_expert(ckpt):
    path = ckpt()

    def drop(tensors):
        for part in ("gate", "up", "down"):
            tensors.pop(f"model.layers.3.mlp.experts.7.{part}_proj.weight")

    edit_tensors(path, drop)
    assert "no down/gate/up weights for routed expert 7 of layer 3" in load_error(path)


def test_tensor_stored_twice(ckpt):
    path = ckpt("sharded")
    first, second = shards_of(path)[:2]
    stray = load_file(str(path / first))
    name = next(iter(stray))
    edit_tensors(path, lambda t: t.update({name: stray[name]}), shard=second)
    message = load_error(path)
    assert name in message and "also stored" in message


@pytest.mark.parametrize(
    "name",
    ["vision_tower.patch_embed.weight", "model.layers.0.self_attn.rotary_emb.inv_freq_extra"],
    ids=["foreign-prefix", "unknown-parameter"],
)
def test_unexpected_tensor(ckpt, name):
    path = ckpt()
    edit_tensors(path, lambda t: t.update({name: torch.randn(4, 4)}))
    message = load_error(path)
    assert name in message


def test_expert_index_outside_the_config(ckpt):
    path = ckpt()
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"  # the config has 8 experts: 0..7
    edit_tensors(path, lambda t: t.update({name: torch.randn(32, 64)}))
    message = load_error(path)
    assert name in message and "outside [0, 8)" in message


def test_experts_in_a_dense_layer(ckpt):
    path = ckpt()
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"  # layer 1 is in mlp_only_layers
    edit_tensors(path, lambda t: t.update({name: torch.randn(32, 64)}))
    message = load_error(path)
    assert name in message and "layer 1 has no routed experts" in message
