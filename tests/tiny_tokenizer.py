"""Test fixture: a tiny DeepSeek-shaped byte-level BPE tokenizer folder, trained in milliseconds.

``write_test_tokenizer(folder)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` the way a
DeepSeek checkpoint ships them: byte-level BPE, ``<｜begin▁of▁sentence｜>`` (id 0) and
``<｜end▁of▁sentence｜>`` (id 1) first, the chat/reasoning/tool markers as added tokens (the last
ids), a post-processor that prepends BOS, and ``add_bos_token: true``. Every id is below ``vocab_size`` so a
tiny test model with that many embedding rows can consume any encoded text. The training text mixes
English, Python and CJK so that merges produce multi-byte characters (and single-byte tokens remain
for rarer characters such as emoji, which split mid-character).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
CHAT_SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]

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


def build_test_tokenizer(vocab_size: int = 320, builtin_specials: bool = True) -> Tokenizer:
    """Train the tiny tokenizer in memory; every id (added tokens included) is below ``vocab_size``.

    As in DeepSeek's releases, BOS/EOS are *special* (dropped by ``skip_special_tokens``) while the
    chat, reasoning and tool markers are added tokens that are not special: each is one id and is
    never split, yet it survives decoding so reasoning and tool-call parsers can see it.
    """
    markers = CHAT_SPECIALS if builtin_specials else []
    if vocab_size < 256 + 2 + len(markers):
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 byte tokens and {2 + len(markers)} added tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(markers),
        special_tokens=[BOS, EOS],  # ids 0 and 1, where DeepSeek puts them
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # CJK weighted up so the few merges a 320-entry vocab allows include whole CJK characters and
    # pieces that straddle character boundaries (as real byte-level BPE vocabularies have).
    tok.train_from_iterator(_ENGLISH_AND_CODE * 4 + _CJK * 24, trainer=trainer)
    tok.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in markers])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    if max(tok.get_vocab(with_added_tokens=True).values()) >= vocab_size:
        raise AssertionError("trained tokenizer has an id beyond the requested vocab_size")
    return tok


def write_test_tokenizer(
    folder: Path, vocab_size: int = 320, chat_template: str | None = None, builtin_specials: bool = True
) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder`` (created if missing).

    ``builtin_specials=False`` keeps only BOS/EOS as added tokens: the chat markers are then plain
    text split into byte-level pieces, like a checkpoint whose template uses ordinary strings.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer(vocab_size, builtin_specials)
    tok.save(str(folder / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
