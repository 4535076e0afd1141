"""Tokenizer for a Hugging Face model folder, built on the ``tokenizers`` library (no ``transformers``).

Reads ``tokenizer.json`` (the fast-tokenizer pipeline), ``tokenizer_config.json`` (special tokens,
``add_bos_token``, chat template) and the EOS ids of ``generation_config.json`` / ``config.json``.
Decoding follows ``tokenizers`` exactly; legacy ``clean_up_tokenization_spaces`` rewriting is not
applied (it alters text and cannot be streamed consistently).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from moetier.errors import CheckpointError
from moetier.server.chat_template import ChatTemplates

# The named special tokens transformers exposes to chat templates (``bos_token`` and so on).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _eos_ids_from(config: dict[str, Any]) -> set[int]:
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class StreamDecoder:
    """Turns token ids, pushed one at a time, into text deltas whose concatenation equals ``decode``.

    It re-decodes a short window of ids (the last emitted chunk plus what came after it) and emits the
    text beyond what the window's emitted part decodes to. Text ending in U+FFFD is held back: it is
    a UTF-8 character whose remaining bytes are still to come (byte-level BPE splits characters
    across tokens). Decoding a window rather than single tokens keeps decoders whose output depends on
    the previous token (SentencePiece's leading space) right. ``flush`` emits whatever is held back.
    """

    def __init__(self, backend: _Backend, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the window; ids before it are emitted and dropped
        self._read = 0  # self._ids[:_read] are emitted
        self._read_text = ""  # decode(self._ids[:_read])

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly empty)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if len(text) <= len(self._read_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit everything held back (an unfinished character becomes U+FFFD, as ``decode`` gives)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._read_text) :]
        # The next window starts at the old read boundary, a complete-character boundary: the chunk
        # just emitted is the context, and the window stays a few tokens long.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        return delta


class Tokenizer:
    """Encode/decode text and render chat prompts for one model folder."""

    def __init__(
        self,
        backend: _Backend,
        config: dict[str, Any],
        eos_token_ids: set[int],
        chat_templates: ChatTemplates,
    ) -> None:
        self._backend = backend
        self.config = config
        self.special_tokens: dict[str, str] = {
            key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None
        }
        self.bos_token_id: int | None = self._id_of(self.special_tokens.get("bos_token"))
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_token_ids: set[int] = set(eos_token_ids) | ({eos_id} if eos_id is not None else set())
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        self.chat_templates = chat_templates
        self._post_processor_bos = self._post_processor_adds_bos()
        self._add_bos = self._resolve_add_bos()

    # ----------------------------------------------------------------------------------- loading

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and friends from a model folder; one-line CheckpointError if unusable."""
        folder = Path(path).expanduser()
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{folder}: tokenizer.json is missing (only fast-tokenizer checkpoints are supported)"
            )
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception for any parse error
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"{tokenizer_file}: cannot be read as a tokenizer ({reason})") from None
        config = _read_optional_json(folder / "tokenizer_config.json")
        eos_ids = _eos_ids_from(_read_optional_json(folder / "generation_config.json"))
        eos_ids |= _eos_ids_from(_read_optional_json(folder / "config.json"))
        return cls(backend, config, eos_ids, ChatTemplates.from_folder(folder, config))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _resolve_add_bos(self) -> bool:
        """Whether ``encode(add_special_tokens=True)`` starts with BOS.

        ``add_bos_token`` in tokenizer_config wins (transformers rebuilds the post-processor from it
        for Llama-style tokenizers); without it, whatever tokenizer.json's post-processor does.
        """
        if self.bos_token_id is None:
            return False
        flag = self.config.get("add_bos_token")
        if isinstance(flag, bool):
            return flag
        return self._post_processor_bos

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self._backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    # ------------------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS as the checkpoint configures it.

        Special-token strings inside ``text`` (``<｜User｜>``) become their single ids, as in a
        rendered chat prompt. A prompt that already starts with BOS (chat templates emit it) does
        not get a second one.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        bos = self.bos_token_id
        if self._add_bos and not (ids and ids[0] == bos):
            ids.insert(0, bos)
        elif not self._add_bos and self._post_processor_bos and ids and ids[0] == bos:
            del ids[0]  # the post-processor added BOS that the config turned off
        # Templates that write BOS themselves plus a post-processor that adds it give two: keep one.
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos and text.startswith(self.special_tokens["bos_token"]):
            del ids[0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder, one per generated sequence."""
        return StreamDecoder(self._backend, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    # -------------------------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt string (checkpoint template, else the built-in DeepSeek one).

        Raises :class:`moetier.errors.ChatTemplateError` (one line) for invalid messages or a
        template that fails. Extra keyword arguments (``thinking``, ``enable_thinking`` ...) reach the
        template as variables.
        """
        return self.chat_templates.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )
