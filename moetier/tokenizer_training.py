"""Train small DeepSeek-shaped byte-level BPE tokenizers (the demo model's and the tests').

A tokenizer trained here looks like a DeepSeek release's: byte-level BPE, ``<｜begin▁of▁sentence｜>``
(id 0) and ``<｜end▁of▁sentence｜>`` (id 1) first and *special* (dropped by ``skip_special_tokens``),
the chat, reasoning and tool-call markers as added tokens that are *not* special (one id each,
never split, but kept by decoding so the reasoning and tool-call parsers can see them), a
post-processor that prepends BOS, and ``add_bos_token: true`` in ``tokenizer_config.json``.
Training is deterministic: the same texts and vocabulary size give the same ``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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
_BYTE_TOKENS = 256


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, markers: list[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; every id (markers included) is below ``vocab_size``.

    ``markers`` defaults to :data:`CHAT_SPECIALS` (pass ``[]`` for BOS/EOS only); they take the
    last ids. A small corpus may stop training before ``vocab_size`` is reached: the tokenizer then
    has fewer ids (``max id + 1`` is its real vocabulary size).
    """
    markers = list(CHAT_SPECIALS if markers is None else markers)
    if vocab_size < _BYTE_TOKENS + 2 + len(markers):
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
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in markers])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    if max(tok.get_vocab(with_added_tokens=True).values()) >= vocab_size:
        raise AssertionError("trained tokenizer has an id beyond the requested vocab_size")
    return tok


def vocabulary_size(tok: Tokenizer) -> int:
    """``max id + 1``: the embedding rows a model needs to consume any id ``tok`` produces."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def write_tokenizer_folder(
    folder: str | Path, tok: Tokenizer, chat_template: str | None = None, model_max_length: int = 4096
) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (DeepSeek's settings) into ``folder``.

    Without ``chat_template`` moetier renders prompts with its built-in DeepSeek template.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
