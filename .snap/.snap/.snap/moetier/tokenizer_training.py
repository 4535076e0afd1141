"""Train small DeepSeek-shaped byte-level BPE tokenizers (the demo model's and the tests').

A tokenizer trained here looks like a DeepSeek release's: byte-level BPE, ``<｜begin▁of▁sentence｜>``
(id 0) and ``<｜end▁of▁sentence｜>`` (id 1) first and *special* (dropped by ``skip_special_tokens``),
the chat, reasoning and tool-call markers as added tokens that are *not* special (one id each,
never split, but kept by decoding so the reasoning and tool-call parsers can see them), a
post-processor that prepends BOS, and ``add_bos_token: true`` in ``tokenizer_config.json``.
Training is deterministic: the same texts and vocabulary size give the same ``tokenizer.json``.

:func:`full_vocabulary_tokenizer` builds the same kind of tokenizer with *exactly* a model's vocabulary
size (merges from a built-in word list, printable filler tokens for the rest) for benchmark checkpoints.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
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


# ----------------------------------------------------------------------------------------------
# Full-vocabulary tokenizers for benchmark checkpoints (``moetier make-bench-model``)

# Common English words: the bench tokenizer learns each as one token (with and without a leading
# space, lower case and capitalised), so a prompt of N plain words is about N tokens, as with a real
# tokenizer. Covers every word ``moetier bench serve`` builds prompts from.
_BENCH_WORD_TEXT = """
    the of and to in is that for it as with was on be by at this have from or one had not but what all
    were when we there can an your which their said if do will each about how up out them then she many
    some so these would other into has more her two like him see time could no make than first been its
    who now people my made over did down only way find use may water long little very after words called
    just where most know get through back much go good new write our me man too any day same right look
    think also around another came come work three word must because does part even place well such here
    take why things help put years different away again off went old number great tell men say small
    every found still between name should home big give air line set own under read last never us left
    end along while might next sound below saw something thought both few those always looked show large
    often together asked house don world going want school important until form food keep children feet
    land side without boy once animals life enough took four head above kind began almost live page got
    earth need far hand high year mother light country father let night picture being study second soon
    story since white ever paper hard near sentence better best across during today however sure knew try
    told young sun thing whole hear example heard several change answer room sea against top turned learn
    point city play toward five himself usually money seen car morning body upon family later turn move
    face door cut done group true half red fish plants living black eat short united run book gave order
    open ground cold really table remember tree course front american space inside ago sleep explain
    model expert experts token tokens layer layers memory server request requests cache stream streams
    prompt output input batch speed fast slow data value values system test result results engine weights
    router routing decode prefill context window length text chat user assistant reply question
    zero six seven eight nine ten hundred thousand million
"""
BENCH_WORDS: tuple[str, ...] = tuple(_BENCH_WORD_TEXT.split())
_FILLER_CONSONANTS = "bdfghklmnprstvz"
_FILLER_VOWELS = "aeiou"
_SPACE = "\u0120"  # byte-level BPE's printable stand-in for the space byte


def bench_corpus(words: Iterable[str] = BENCH_WORDS) -> list[str]:
    """Training texts for the bench tokenizer: every word alone and after a space, lower and capitalised,
    plus digits and punctuation."""
    words = list(words)
    texts = ["".join(" " + w for w in words), "".join(" " + w.capitalize() for w in words)]
    texts += words + [w.capitalize() for w in words]
    texts += [" ".join(str(n) for n in range(101)), "Hello, world! It is 12:30. Really? Yes; (no) [x] {y} \"q\" 'a'"]
    return texts


def _filler_words() -> Iterator[str]:
    """Pseudo-words (``kalo``, ``mitu`` ...), shortest first, in a fixed order, without end."""
    syllables = [c + v for c in _FILLER_CONSONANTS for v in _FILLER_VOWELS]
    for length in itertools.count(1):
        for parts in itertools.product(syllables, repeat=length):
            yield "".join(parts)


def _id_layout(vocab_size: int, bos_id: int, eos_id: int, markers: list[str]) -> dict[int, str]:
    """The reserved ids: BOS and EOS where the model config puts them, the markers on the last free ids."""
    if not (0 <= bos_id < vocab_size and 0 <= eos_id < vocab_size) or bos_id == eos_id:
        raise ValueError(f"BOS id {bos_id} and EOS id {eos_id} must be distinct ids below vocab_size {vocab_size}")
    reserved = {bos_id: BOS, eos_id: EOS}
    free_tail = [i for i in range(vocab_size - 1, -1, -1) if i not in reserved][: len(markers)]
    reserved.update(zip(sorted(free_tail), markers, strict=True))
    return reserved


def full_vocabulary_tokenizer(
    vocab_size: int,
    bos_id: int = 0,
    eos_id: int = 1,
    texts: Iterable[str] | None = None,
    markers: list[str] | None = None,
) -> tuple[Tokenizer, dict[str, int]]:
    """A DeepSeek-shaped byte-level BPE with exactly the ids ``0 .. vocab_size-1``, every one decodable.

    BOS and EOS (special) sit at ``bos_id`` / ``eos_id``; ``markers`` (default :data:`CHAT_SPECIALS`,
    added tokens, not special) on the last ids. The 256 byte tokens and the merges learned from
    ``texts`` (default :func:`bench_corpus`) take the lowest free ids; the remaining ids are *filler*
    tokens, a space plus a pseudo-word each, that encoding never produces but decoding turns into
    printable text (a random model samples any id). Deterministic, and a second or two at 129k ids.
    Returns the tokenizer and the counts ``{"trained": ..., "filler": ..., "reserved": ...}``.
    Raises ValueError when ``vocab_size`` cannot hold the byte tokens plus the reserved ids.
    """
    markers = list(CHAT_SPECIALS if markers is None else markers)
    minimum = _BYTE_TOKENS + 2 + len(markers)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs at least {minimum})")
    reserved = _id_layout(vocab_size, bos_id, eos_id, markers)
    trained, merges = _train_merges(bench_corpus() if texts is None else list(texts), vocab_size - len(reserved))

    vocab = {token: token_id for token_id, token in reserved.items()}
    free = (i for i in range(vocab_size) if i not in reserved)
    for token in trained:  # bytes first, then merge results in merge order
        if token not in vocab:
            vocab[token] = next(free)
    trained_count = len(vocab) - len(reserved)
    fillers = (_SPACE + word for word in _filler_words())
    for token_id in free:
        token = next(fillers)
        while token in vocab:
            token = next(fillers)
        vocab[token] = token_id

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # The reserved strings are already in the model's vocabulary, so the added tokens keep those ids.
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in (BOS, EOS)])
    tok.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in markers])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or vocabulary_size(tok) != vocab_size:
        raise AssertionError("full-vocabulary tokenizer does not have exactly vocab_size ids")
    counts = {"trained": trained_count, "filler": vocab_size - trained_count - len(reserved), "reserved": len(reserved)}
    return tok, counts


def _train_merges(texts: list[str], limit: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE training on ``texts``: (tokens in id order, merges), at most ``limit`` tokens."""
    trainer = trainers.BpeTrainer(
        vocab_size=limit,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ", 1)) for pair in model["merges"]]
    return tokens, merges
