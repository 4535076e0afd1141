"""Tool-call parsers: find function calls in generated text and stream them in OpenAI's shape.

The server feeds these with the *content* stream that the reasoning parser
(:mod:`moetier.server.reasoning`) releases. Streaming output is a list of items, in order:
``str`` pieces of content (text before the calls) and :class:`ToolCallDelta` objects, whose
``to_openai()`` is one entry of ``choices[0].delta.tool_calls``. Parsers are picked per model family
by name from :data:`TOOL_CALL_PARSERS`.
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from moetier.registry import Registry
from moetier.server.reasoning import hold_start, rstrip_index


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One complete call. ``arguments_json`` is the model's text, not validated as JSON."""

    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict[str, Any]:
        """The ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call ``index``.

    The first delta of a call carries ``id``, ``type`` and ``name`` (and empty ``arguments``);
    the later ones carry only a piece of ``arguments``.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    type: str | None = None
    name: str | None = None

    @property
    def is_first(self) -> bool:
        return self.id is not None

    def to_openai(self) -> dict[str, Any]:
        """The ``delta.tool_calls`` entry, exactly as OpenAI streams it."""
        if self.is_first:
            return {
                "index": self.index,
                "id": self.id,
                "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


StreamItem = ToolCallDelta | str


@dataclass
class ToolParseResult:
    """One-shot result: ``content`` is the text before the calls; ``rejected`` holds calls whose
    name is not among the allowed tools (they are not in ``tool_calls`` and take no index)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    rejected: list[ToolCall] = field(default_factory=list)


def collect_stream(items: Iterable[StreamItem], rejected: Iterable[ToolCall] = ()) -> ToolParseResult:
    """Reassemble streamed items into the one-shot result (also the server's non-streaming path)."""
    content: list[str] = []
    calls: dict[int, list[Any]] = {}  # index -> [id, name, argument pieces...]
    for item in items:
        if isinstance(item, str):
            content.append(item)
        elif item.is_first:
            calls[item.index] = [item.id, item.name, item.arguments]
        else:
            calls[item.index].append(item.arguments)
    tool_calls = [ToolCall(c[0], c[1], "".join(c[2:])) for _, c in sorted(calls.items())]
    return ToolParseResult("".join(content), tool_calls, list(rejected))


class ToolCallParser(ABC):
    """Streaming tool-call extractor.

    Contract:
    - ``feed(delta)`` accepts the content stream in arbitrary pieces and returns the items it can
      release now: content before the calls, then per call one first delta (index, id, type,
      name) and argument pieces as they arrive. Special tokens and format markers are held back
      until decided, so the argument pieces of a call concatenate to exactly its arguments text.
    - ``finish()`` releases what is held (an unterminated call keeps the arguments seen so far).
    - Indices count accepted calls from 0; a call with an empty name or (when ``allowed_names`` is
      given) a name not in it is not streamed and lands in ``rejected``.
    - Subclasses take ``allowed_names`` as their only constructor argument (``parse`` relies on it).
    - ``has_tool_calls`` is True once a call was streamed (``finish_reason: "tool_calls"``).
    - ``parse(text)`` is the one-shot form and equals the reassembled stream for any split.
    """

    def __init__(self, allowed_names: Iterable[str] | None = None) -> None:
        self.allowed_names = None if allowed_names is None else frozenset(allowed_names)
        self.rejected: list[ToolCall] = []

    @abstractmethod
    def feed(self, delta: str) -> list[StreamItem]: ...

    @abstractmethod
    def finish(self) -> list[StreamItem]: ...

    @property
    @abstractmethod
    def has_tool_calls(self) -> bool: ...

    def parse(self, text: str) -> ToolParseResult:
        fresh = type(self)(allowed_names=self.allowed_names)
        items = fresh.feed(text) + fresh.finish()
        return collect_stream(items, fresh.rejected)

    def accepts(self, name: str) -> bool:
        """Whether a call of ``name`` is streamed (an empty name never is)."""
        return bool(name) and (self.allowed_names is None or name in self.allowed_names)


TOOL_CALL_PARSERS: Registry[type[ToolCallParser]] = Registry("tool-call parser")
register_tool_call_parser = TOOL_CALL_PARSERS.register
tool_call_parser_class = TOOL_CALL_PARSERS.lookup


CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"

# States of DeepSeekToolCallParser.
_CONTENT = "content"  # text before the calls
_BLOCK = "block"  # between calls
_HEAD = "head"  # after CALL_BEGIN, before SEP: V3 type ("function") or V3.1 name
_PEEK = "peek"  # head was "function": V3 name line, or V3.1 arguments of a tool named "function"?
_NAME = "name"  # V3 name line
_FENCE = "fence"  # V3 opening code fence (```json)
_ARGS = "args"
_DONE = "done"  # after CALLS_END: ignored


@register_tool_call_parser("deepseek_v3", "deepseek_v31", "deepseek_v4")
class DeepSeekToolCallParser(ToolCallParser):
    """DeepSeek tool calls, both styles, inside ``<｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>``:

    - V3: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
    - V3.1/V4: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``

    Arguments are the text between the markers with surrounding whitespace (and V3's code fence)
    removed. A call that opens without the outer ``<｜tool▁calls▁begin｜>`` is accepted; text between
    calls and after ``<｜tool▁calls▁end｜>`` is ignored; a call whose header never completes is dropped.
    A head of ``function`` followed directly by ``{`` is a V3.1 call of a tool named "function".
    """

    _fence_open = re.compile(rf"{FENCE}[A-Za-z0-9_-]*(?=[^A-Za-z0-9_-])")

    def __init__(self, allowed_names: Iterable[str] | None = None) -> None:
        super().__init__(allowed_names)
        self._state = _CONTENT
        self._buf = ""
        self._head = ""
        self._fenced = False
        self._skip_ws = False
        self._next_index = 0  # calls announced so far
        self._current: ToolCall | None = None  # the call whose arguments are being read
        self._index: int | None = None  # its index, None when its name was rejected
        self._args: list[str] = []  # its arguments so far (kept for rejected calls)
        self._out: list[StreamItem] = []
        self._steps = {
            _CONTENT: self._advance_content,
            _BLOCK: self._advance_block,
            _HEAD: self._advance_head,
            _PEEK: self._advance_peek,
            _NAME: self._advance_name,
            _FENCE: self._advance_fence,
            _ARGS: self._advance_args,
        }

    @property
    def has_tool_calls(self) -> bool:
        return self._next_index > 0

    def feed(self, delta: str) -> list[StreamItem]:
        self._buf += delta
        while self._advance():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[StreamItem]:
        out = self.feed("")
        if self._state == _CONTENT and self._buf:
            out.append(self._buf)
        elif self._current is not None:
            # Truncated call: it was already announced, keep the arguments seen (held text dropped).
            self._end_call()
            out += self._out
        self._buf, self._out, self._state = "", [], _DONE
        return out

    # -- state machine ----------------------------------------------------------------------

    def _advance(self) -> bool:
        """Consume what the buffer decides; True when the state changed and there may be more."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        step = self._steps.get(self._state)
        if step is None:  # _DONE
            self._buf = ""
            return False
        return step()

    def _advance_content(self) -> bool:
        starts = [(i, tok) for tok in (CALLS_BEGIN, CALL_BEGIN) if (i := self._buf.find(tok)) >= 0]
        if starts:
            i, tok = min(starts)
            self._emit_content(self._buf[:i])
            self._buf = self._buf[i + len(tok) :]
            self._state = _BLOCK if tok == CALLS_BEGIN else _HEAD
            return True
        cut = hold_start(self._buf, CALLS_BEGIN, CALL_BEGIN, whitespace=False)
        self._emit_content(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _advance_block(self) -> bool:
        starts = [(i, tok) for tok in (CALL_BEGIN, CALLS_END) if (i := self._buf.find(tok)) >= 0]
        if starts:
            i, tok = min(starts)
            self._buf = self._buf[i + len(tok) :]
            self._state = _HEAD if tok == CALL_BEGIN else _DONE
            return True
        self._buf = self._buf[hold_start(self._buf, CALL_BEGIN, CALLS_END, whitespace=False) :]
        return False

    def _advance_head(self) -> bool:
        sep, end = self._buf.find(SEP), self._buf.find(CALL_END)
        if end >= 0 and (sep < 0 or end < sep):
            # A call without a separator: malformed, drop it.
            self._buf = self._buf[end + len(CALL_END) :]
            self._state = _BLOCK
            return True
        if sep < 0:
            return False
        self._head = self._buf[:sep].strip()
        self._buf = self._buf[sep + len(SEP) :]
        if self._head == "function":
            self._state = _PEEK
        else:
            self._start_call(self._head, fenced=False)
        return True

    def _advance_peek(self) -> bool:
        if not self._buf.lstrip():
            return False
        if self._buf.lstrip().startswith("{"):
            self._start_call(self._head, fenced=False)
        else:
            self._state = _NAME
        return True

    def _advance_name(self) -> bool:
        newline, end = self._buf.find("\n"), self._buf.find(CALL_END)
        if newline < 0 and end < 0:
            return False
        if end >= 0 and (newline < 0 or end < newline):
            # ``function<｜tool▁sep｜>NAME<｜tool▁call▁end｜>``: a call without arguments.
            self._start_call(self._buf[:end].strip(), fenced=False)
            self._buf = self._buf[end + len(CALL_END) :]
            self._end_call()
            return True
        name = self._buf[:newline].strip()
        self._buf = self._buf[newline + 1 :]
        self._start_call(name, fenced=True)
        self._state = _FENCE
        self._skip_ws = True
        return True

    def _advance_fence(self) -> bool:
        if FENCE.startswith(self._buf):
            return False  # a partial fence (or nothing yet)
        if self._buf.startswith(FENCE):
            match = self._fence_open.match(self._buf)
            if match is None:
                return False  # the language tag may still be growing
            self._buf = self._buf[match.end() :]
        else:
            self._fenced = False  # arguments without a fence: only CALL_END ends them
        self._state = _ARGS
        self._skip_ws = True
        return True

    def _advance_args(self) -> bool:
        end = self._buf.find(CALL_END)
        if end >= 0:
            self._emit_args(self._trim_tail(self._buf[:end]))
            self._buf = self._buf[end + len(CALL_END) :]
            self._end_call()
            return True
        cut = self._args_hold_start()
        self._emit_args(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _trim_tail(self, args: str) -> str:
        """Arguments without trailing whitespace and, for V3, the closing code fence."""
        args = args.rstrip()
        if self._fenced and args.endswith(FENCE):
            args = args[: -len(FENCE)].rstrip()
        return args

    def _args_hold_start(self) -> int:
        """Start of the buffer's suffix that may still turn out to be trimmed by ``_trim_tail``:
        whitespace, (V3) the closing fence or part of it, and a partial CALL_END."""
        buf = self._buf
        start = hold_start(buf, CALL_END)
        if not self._fenced:
            return start
        if buf.endswith(FENCE, 0, start):
            return rstrip_index(buf, start - len(FENCE))
        if start == len(buf) and buf.endswith("`"):  # a partial fence (a whole one returned above)
            return rstrip_index(buf, start - (2 if buf.endswith("``") else 1))
        return start

    # -- emission ---------------------------------------------------------------------------

    def _start_call(self, name: str, *, fenced: bool) -> None:
        """Announce a call (first delta) unless its name is rejected; arguments follow."""
        self._current = ToolCall(new_call_id(), name, "")
        self._args = []
        self._fenced = fenced
        self._state = _ARGS
        self._skip_ws = True
        self._index = None
        if self.accepts(name):
            self._index, self._next_index = self._next_index, self._next_index + 1
            self._out.append(ToolCallDelta(self._index, "", self._current.id, "function", name))

    def _emit_args(self, piece: str) -> None:
        if not piece:
            return
        self._args.append(piece)
        if self._index is not None:
            self._out.append(ToolCallDelta(self._index, piece))

    def _end_call(self) -> None:
        """Close the current call (``self._current`` is set); a rejected one is recorded."""
        call = self._current
        if call is not None and self._index is None:
            self.rejected.append(ToolCall(call.id, call.name, "".join(self._args)))
        self._current, self._index, self._args = None, None, []
        self._state = _BLOCK
        self._skip_ws = False

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)
