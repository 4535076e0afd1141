import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models are dominated by per-op overhead; extra intra-op threads only contend on small CI machines.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny fp32 checkpoints of every family, for engine-level tests (prefix cache, preemption, prefix sharing).
TINY_VOCAB = {"qwen3_moe": 320, "deepseek_v3": 320, "deepseek_v4": 256}


def _write_tiny(name: str, path: Path) -> None:
    from reference import save_tiny

    if name == "qwen3_moe":
        from test_qwen3_moe import tiny_qwen3_config

        save_tiny(tiny_qwen3_config(), path)
    elif name == "deepseek_v3":
        from test_deepseek_v3 import VARIANTS, tiny_v3_config

        save_tiny(tiny_v3_config(**VARIANTS["q_lora"]), path)
    else:
        from test_deepseek_v4 import save_tiny_v4

        save_tiny_v4(path, torch.float32)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family name -> (LoadedModel, vocab size), built on first use (a module may define its own)."""
    from moetier.config import ModelLoadConfig
    from moetier.weights.loader import load_model

    built = {}

    def get(name):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            _write_tiny(name, path)
            config = ModelLoadConfig(dtype=torch.float32, device="cpu")
            built[name] = (load_model(path, config, progress=False), TINY_VOCAB[name])
        return built[name]

    return get


@pytest.fixture(scope="module")
def qwen(families):
    return families("qwen3_moe")[0]
