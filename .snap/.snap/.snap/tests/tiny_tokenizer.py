"""Test fixture: a tiny DeepSeek-shaped byte-level BPE tokenizer folder, trained in milliseconds.

``write_test_tokenizer(folder)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` the way a
DeepSeek checkpoint ships them (see :mod:`moetier.tokenizer_training`, which holds the training
logic; this module only holds the test corpus). Every id is below ``vocab_size`` so a tiny test
model with that many embedding rows can consume any encoded text. The training text mixes English,
Python and CJK so that merges produce multi-byte characters (and single-byte tokens remain for
rarer characters such as emoji, which split mid-character).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from moetier.tokenizer_training import BOS, CHAT_SPECIALS, EOS, train_byte_level_bpe, write_tokenizer_folder

__all__ = ["BOS", "CHAT_SPECIALS", "EOS", "build_test_tokenizer", "write_test_tokenizer"]

_ENGLISH_AND_CODE = [
    "The quick brown fox jumps over the lazy dog. The weather is nice today, isn't it?",
    "Hello, world! This is a small test of the tokenizer: numbers 12345 and 67890.",
    "Mixture-of-Experts models route each token to the top experts of every layer.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    'import json\ndata = json.loads(\'{"name": "moetier", "value": 42}\')\nprint(data["name"])\n',
    "class Cache:\n    def __init__(self):\n        self.items = {}\n",
]
_CJK = [
    "你好，世界！今天天气很好。我们正在测试分词器。",
    "中文文本需要多字节字符。模型和专家在一起工作。",
    "日本語のテキストも少しあります。こんにちは。",
]
# CJK weighted up so the few merges a 320-entry vocab allows include whole CJK characters and
# pieces that straddle character boundaries (as real byte-level BPE vocabularies have).
TEST_CORPUS = _ENGLISH_AND_CODE * 4 + _CJK * 24


def build_test_tokenizer(vocab_size: int = 320, builtin_specials: bool = True) -> Tokenizer:
    """Train the tiny tokenizer in memory; every id (added tokens included) is below ``vocab_size``."""
    return train_byte_level_bpe(TEST_CORPUS, vocab_size, None if builtin_specials else [])


def write_test_tokenizer(
    folder: Path, vocab_size: int = 320, chat_template: str | None = None, builtin_specials: bool = True
) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder`` (created if missing).

    ``builtin_specials=False`` keeps only BOS/EOS as added tokens: the chat markers are then plain
    text split into byte-level pieces, like a checkpoint whose template uses ordinary strings.
    """
    write_tokenizer_folder(folder, build_test_tokenizer(vocab_size, builtin_specials), chat_template)
