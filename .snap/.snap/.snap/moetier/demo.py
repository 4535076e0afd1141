"""The built-in demo model: a tiny DeepSeek-V4-family checkpoint that ``moetier serve`` uses without ``--model``.

It is made on first use, deterministically (seeded random weights, a byte-level BPE tokenizer
trained on :data:`DEMO_CORPUS`, DeepSeek's special tokens and the built-in DeepSeek chat template),
and cached under ``$XDG_CACHE_HOME/moetier/`` (default ``~/.cache/moetier/``) in a folder whose
name carries :data:`DEMO_VERSION`, so a change to the recipe builds a fresh one. It is built in a
temporary folder next to the final one and renamed into place, so an interrupted build never
leaves a half-written model behind and two processes racing to build it both end with a good one.

The weights are random: the demo answers with fluent-looking nonsense. It exists so a newcomer's
first ``moetier serve`` works with nothing downloaded, and so the whole serving stack (chat
template, reasoning and tool-call parsers, every attention type and MoE routing of the V4 family)
runs end to end on a laptop CPU at interactive speed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

DEMO_VERSION = 1
DEMO_NAME = "moetier-demo-v4"  # the served model name
DEMO_SEED = 20240601
DEMO_VOCAB_TARGET = 1024  # a ceiling: the small corpus stops training a little below it
DEMO_WINDOW = 2048
_MARKER = "demo.json"
logger = logging.getLogger("moetier.demo")

# A few paragraphs for the tokenizer to learn merges from: English prose, Python and some CJK, so
# byte-level BPE learns whole words, code indentation and multi-byte characters.
DEMO_CORPUS = [
    "moetier serves giant Mixture-of-Experts language models from one GPU plus host memory. Every "
    "token visits only a few experts of each layer, so the hottest experts live in GPU memory while "
    "the home copy of every expert stays in pinned host memory, and cold experts run on CPU cores.",
    "This is the demo model. Its weights are random, so its answers are nonsense, but the server, "
    "the chat template, the reasoning parser and the tool-call parser all work exactly as they do "
    "with a real DeepSeek model. Try streaming, tool calls, logprobs and the metrics endpoint.",
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, "
    "thank you. What is the weather like? It is sunny and warm, with a light breeze from the sea.",
    "A request arrives at the server, the chat template renders the messages into a prompt, the "
    "tokenizer turns the prompt into token ids, and the engine schedules it with other requests. "
    "Each step decodes one token per running request and streams the new text back to the client.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536. Dates: 2024-06-01. "
    "Units: 19.3 tokens per second, 55 GB/s, 4.2 TB/s, 128 GiB, 24 GB, 3.5 ms.",
    "def add(a, b):\n    return a + b\n\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    'import json\n\ndata = json.loads(\'{"name": "moetier", "value": 42}\')\nprint(data["name"])\n',
    "class Cache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n        self.items = {}\n",
    '{"location": "Paris", "unit": "celsius", "temperature": 21, "forecast": ["sunny", "windy"]}',
    "<think>\nThe user asks about the weather. I should call the weather tool.\n</think>\n\n"
    "Let me check the weather for you.",
    "你好，世界！今天天气很好。我们正在测试分词器。中文文本需要多字节字符。模型和专家在一起工作。",
    "日本語のテキストも少しあります。こんにちは。ありがとうございます。",
]

# The V4-Flash layout scaled down: 4 layers cover sliding, CSA and HCA attention and hash- and
# score-routed MoE; 16 experts of width 96, top-2, plus one shared expert. About 25 MB in fp32.
_DEMO_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "moe_intermediate_size": 96,
    "experts": 16,
    "layers": 4,
    "overrides": {
        "num_attention_heads": 4,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 64,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 16,
        "sliding_window": 64,
        "num_experts_per_tok": 2,
        "max_position_embeddings": DEMO_WINDOW,
        "initializer_range": 0.05,
    },
}


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/moetier`` when set (and absolute), else ``~/.cache/moetier``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "moetier"


def demo_folder(root: str | Path | None = None) -> Path:
    """Where the demo model of this version lives (whether or not it is built yet)."""
    return Path(root).expanduser() if root is not None else cache_root() / f"demo-deepseek-v4-v{DEMO_VERSION}"


def is_built(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == DEMO_VERSION


def ensure_demo_model(folder: str | Path | None = None) -> Path:
    """The demo checkpoint folder, built first if missing (a few seconds on a CPU).

    ``folder`` overrides the cache location (tests). Raises ConfigError when the cache folder
    cannot be written.
    """
    target = demo_folder(folder)
    if is_built(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    except OSError as exc:
        raise ConfigError(f"cannot create the demo model under {target.parent}: {exc.strerror or exc}") from None
    logger.info("building the demo model (first use, a few seconds) in %s", target)
    try:
        build_demo_model(staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished build into place; a stale or concurrent copy is handled."""
    if target.exists() and not is_built(target):
        shutil.rmtree(target, ignore_errors=True)  # an older version or a broken folder
    try:
        os.rename(staging, target)
    except OSError:
        if not is_built(target):  # lost a race only if the winner's copy is good
            raise


def demo_config(vocab_size: int) -> dict[str, Any]:
    """The demo's ``config.json``: V4-Flash's layout scaled down, with ``vocab_size`` embedding rows."""
    from moetier.bench.shapes import build_config

    shape = _DEMO_SHAPE
    return build_config(
        "deepseek-v4-flash",
        shape["layers"],
        vocab_size=vocab_size,
        experts=shape["experts"],
        hidden_size=shape["hidden_size"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        overrides=dict(shape["overrides"]),
    )


def build_demo_model(folder: str | Path) -> Path:
    """Write the demo checkpoint (config, fp32 safetensors, tokenizer, marker) into the empty ``folder``."""
    from moetier.bench.make_model import WriteOptions, write_bench_model
    from moetier.tokenizer_training import train_byte_level_bpe, vocabulary_size, write_tokenizer_folder

    folder = Path(folder)
    tokenizer = train_byte_level_bpe(DEMO_CORPUS, DEMO_VOCAB_TARGET)
    vocab = vocabulary_size(tokenizer)
    cfg = demo_config(vocab)  # every embedding row is a token the tokenizer can produce and decode
    options = WriteOptions(dtype="fp32", seed=DEMO_SEED, device="cpu", progress=False, force=True, sync=False)
    summary = write_bench_model(cfg, folder, options)
    (folder / "bench_model.json").unlink(missing_ok=True)  # it records timings: not deterministic
    write_tokenizer_folder(folder, tokenizer, model_max_length=DEMO_WINDOW)
    marker = {
        "version": DEMO_VERSION,
        "served_model_name": DEMO_NAME,
        "seed": DEMO_SEED,
        "vocab_size": vocab,
        "bytes": summary.total_bytes,
        "note": "random weights: the moetier demo model answers with nonsense",
    }
    # The marker is written last: its presence means the folder is complete.
    (folder / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return folder
