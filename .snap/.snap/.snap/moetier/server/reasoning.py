"""Reasoning parsers: split generated text into reasoning (``<think>…</think>``) and content.

The server runs a reasoning parser over the detokenized stream first and hands its ``content``
pieces to the tool-call parser (:mod:`moetier.server.tool_calls`). Parsers are picked per model
family by name from :data:`REASONING_PARSERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from moetier.registry import Registry


@dataclass(frozen=True)
class ReasoningDelta:
    """What one ``feed``/``finish`` call releases: new reasoning text and new content text."""

    reasoning: str = ""
    content: str = ""

    @property
    def empty(self) -> bool:
        return not self.reasoning and not self.content


def partial_token_len(text: str, *tokens: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper, non-empty prefix of a token.

    A delta may end in the middle of a tag: that suffix must be held back until the next delta.
    """
    firsts = {tok[0] for tok in tokens}
    for i in range(max(0, len(text) - max(map(len, tokens)) + 1), len(text)):
        if text[i] in firsts:
            tail = text[i:]
            if any(len(tok) > len(tail) and tok.startswith(tail) for tok in tokens):
                return len(text) - i
    return 0


def rstrip_index(text: str, end: int) -> int:
    """Where the whitespace run that ends at ``end`` starts (``end`` when there is none)."""
    return len(text[:end].rstrip())


def hold_start(text: str, *tokens: str, whitespace: bool = True) -> int:
    """Where the suffix to hold back starts: a partial token, preceded by whitespace if
    ``whitespace`` (it may be trimmed once the token completes); ``len(text)`` when none.

    Callers make sure no complete token is in ``text``. Streaming parsers keep only the held
    suffix in their buffer, so ``text`` stays short and this stays cheap.
    """
    start = len(text) - partial_token_len(text, *tokens)
    return rstrip_index(text, start) if whitespace else start


class ReasoningParser(ABC):
    """Streaming splitter of model output into reasoning and content.

    Contract:
    - ``feed(delta)`` accepts the output in arbitrary pieces and returns what can be released now;
      text that may be part of a tag is held back until the next ``feed`` decides it.
    - ``finish()`` releases what is still held; the parser is then spent.
    - Concatenating every released ``reasoning`` (and ``content``) gives exactly ``parse(text)``,
      whatever the split; ``has_reasoning`` tells ``None`` reasoning from empty reasoning.
    - ``parse(text)`` is the one-shot form; it does not touch the streaming state.

    ``starts_in_reasoning`` says the prompt already opened the reasoning block (e.g. a chat template
    that ends the prompt with ``<think>``), so the generation begins inside it.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...

    @property
    @abstractmethod
    def has_reasoning(self) -> bool:
        """True once the stream is known to carry a reasoning block (possibly empty)."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, str]:
        """One-shot: ``(reasoning or None when there is no reasoning block, content)``."""


REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning parser")
register_reasoning_parser = REASONING_PARSERS.register
reasoning_parser_class = REASONING_PARSERS.lookup


# States of ThinkTagParser.
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@register_reasoning_parser("deepseek_r1", "deepseek_v3", "deepseek_v4", "qwen3")
class ThinkTagParser(ReasoningParser):
    """``<think>reasoning</think>content`` as DeepSeek-R1/V3.1/V4 and Qwen3 write it.

    - The opening tag counts only at the very start of the output (after optional whitespace);
      elsewhere it is ordinary text. When the prompt opened the block, a repeated opening tag at
      the start is dropped.
    - Only the first closing tag ends reasoning; later tags are content.
    - Whitespace around the reasoning and at the start of the content after ``</think>`` is dropped
      (the templates put newlines there); output without a reasoning block is returned untouched.
    - Unterminated reasoning is returned as reasoning (only its leading whitespace is dropped).
    """

    open_tag = "<think>"
    close_tag = "</think>"

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
        self._state = _START
        self._buf = ""
        self._skip_ws = False  # drop leading whitespace of the section just entered
        self._has_reasoning = starts_in_reasoning

    @classmethod
    def for_prompt(cls, prompt: str) -> ThinkTagParser:
        """A parser for a generation that continues ``prompt`` (rendered chat template text)."""
        return cls(starts_in_reasoning=prompt.rstrip().endswith(cls.open_tag))

    @property
    def has_reasoning(self) -> bool:
        return self._has_reasoning

    def parse(self, text: str) -> tuple[str | None, str]:
        stripped = text.lstrip()
        if stripped.startswith(self.open_tag):
            body = stripped[len(self.open_tag) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text
        end = body.find(self.close_tag)
        if end < 0:
            return body.lstrip(), ""
        return body[:end].strip(), body[end + len(self.close_tag) :].lstrip()

    def feed(self, delta: str) -> ReasoningDelta:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._advance(reasoning, content):
            pass
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        out = self.feed("")
        held, self._buf = self._buf, ""
        if self._state == _START:
            # Never saw a full opening tag: the held text is all there is.
            if self.starts_in_reasoning:
                return ReasoningDelta(out.reasoning + held.lstrip(), out.content)
            return ReasoningDelta(out.reasoning, out.content + held)
        if self._state == _REASONING:
            return ReasoningDelta(out.reasoning + held, out.content)
        return ReasoningDelta(out.reasoning, out.content + held)

    def _advance(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer decides; True when the state changed and there may be more."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        if self._state == _START:
            return self._advance_start()
        if self._state == _REASONING:
            return self._advance_reasoning(reasoning)
        content.append(self._buf)
        self._buf = ""
        return False

    def _advance_start(self) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(self.open_tag):
            self._buf = stripped[len(self.open_tag) :]
            self._enter(_REASONING)
            return True
        if self.open_tag.startswith(stripped):
            return False  # still undecided: whitespace and/or a partial opening tag
        # No opening tag: the prompt's block (if any) continues, or the output is plain content.
        self._enter(_REASONING if self.starts_in_reasoning else _CONTENT, skip_ws=self.starts_in_reasoning)
        return True

    def _advance_reasoning(self, reasoning: list[str]) -> bool:
        end = self._buf.find(self.close_tag)
        if end >= 0:
            reasoning.append(self._buf[:end].rstrip())
            self._buf = self._buf[end + len(self.close_tag) :]
            self._enter(_CONTENT)
            return True
        # Hold back a partial closing tag and the whitespace before it (trimmed if the tag completes).
        cut = hold_start(self._buf, self.close_tag)
        reasoning.append(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _enter(self, state: str, *, skip_ws: bool = True) -> None:
        self._state = state
        self._skip_ws = skip_ws
        if state == _REASONING:
            self._has_reasoning = True
