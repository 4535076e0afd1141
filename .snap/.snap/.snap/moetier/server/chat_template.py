"""Chat prompts: validate OpenAI-style messages and render them with the checkpoint's Jinja template.

Templates come from ``chat_template.jinja`` (newer checkpoints), ``additional_chat_templates/*.jinja``
or ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates), and are
rendered the way transformers renders them, so a prompt here is byte-identical to
``apply_chat_template(..., tokenize=False)``: jinja2's ImmutableSandboxedEnvironment with
``trim_blocks``/``lstrip_blocks``, loop controls, a no-op ``{% generation %}`` block, and the globals
and filters HF templates use (``raise_exception``, ``strftime_now``, ``tojson`` without HTML escaping
or key sorting). Templates are data from the checkpoint, so they run sandboxed: attribute escapes such
as ``''.__class__.__mro__`` fail with a :class:`ChatTemplateError`.

Checkpoints without a template get :func:`render_deepseek`, a DeepSeek-V3/V4-style prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moetier.errors import ChatTemplateError, CheckpointError

ROLES = ("system", "developer", "user", "assistant", "tool")

# DeepSeek's chat markers (fullwidth bars ｜ and lower-one-eighth blocks ▁ are part of the tokens).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------- validation


def _content_text(content: Any, where: str) -> str | None:
    """``content`` as a string: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type", "text") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        # vLLM and llama-server join text parts with newlines; do the same so prompts agree.
        return "\n".join(texts)
    raise ChatTemplateError(
        f"{where}.content must be a string, a list of text parts or null, not {type(content).__name__}"
    )


def _check_tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{where}.tool_calls[{j}] needs function.name (a string)")
        if not isinstance(function.get("arguments", ""), str | dict | None):
            raise ChatTemplateError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string or an object")
    return calls


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated shallow copies of ``messages`` in the shape chat templates expect.

    Content becomes a string (text parts joined) or stays None; ``developer`` is treated as
    ``system``; reasoning given as ``reasoning_content`` or ``reasoning`` is exposed under both
    names, because templates read one or the other. Raises ChatTemplateError naming the bad field.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if hasattr(message, "model_dump"):  # pydantic request models
            message = message.model_dump(exclude_none=True)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        msg = dict(message)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(message.get("content"), where)
        reasoning = next((message[k] for k in ("reasoning_content", "reasoning") if message.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatTemplateError(f"{where}.reasoning_content must be a string")
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ChatTemplateError(f"{where}: only assistant messages may carry tool_calls")
            msg["tool_calls"] = _check_tool_calls(message["tool_calls"], where)
        out.append(msg)
    return out


def _check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ChatTemplateError("tools must be a list of tool definitions (JSON objects)")
    return tools


# ------------------------------------------------------------------------------ Jinja templates


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF replaces jinja's tojson, which HTML-escapes and sorts keys: prompts must carry plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_MAX_REPEAT = 1_000_000  # items a template may build with `*` (a prompt is far smaller)
_MAX_EXPONENT = 1_000


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, hardened for a server: an unsafe attribute raises at once instead
    of rendering as empty text (a template that probes ``__globals__`` is hostile and should fail
    loudly), and ``'x' * 10**10``-style expressions cannot exhaust memory."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, int) and abs(right) > _MAX_EXPONENT:
                raise jinja2.exceptions.SecurityError(f"exponent {right} is too large")
            return left**right
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(count, int) and len(seq) * count > _MAX_REPEAT:
                raise jinja2.exceptions.SecurityError(f"repetition to {len(seq) * count} items is too large")
        return left * right


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a Jinja chat template; ChatTemplateError on a syntax error."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template has a syntax error at line {exc.lineno}: {_one_line(exc.message)}"
        ) from None


class JsonArguments(dict):
    """Tool-call arguments that arrived as a JSON string, shown to templates as both forms.

    OpenAI history carries arguments as a JSON string. Templates written to HF's convention expect an
    object (``arguments | tojson``, ``arguments.items()``); DeepSeek-V3's official template
    concatenates the string (``'```json\\n' + arguments``). This dict holds the parsed object and
    renders as the client's original string wherever it is used as text, so both kinds of template
    produce what their authors intended.
    """

    def __init__(self, source: str, parsed: dict) -> None:
        super().__init__(parsed)
        # Name-mangled: templates cannot reach it, and ``arguments.source`` still finds a "source" key.
        self.__source = source

    def __str__(self) -> str:
        return self.__source

    def __add__(self, other: Any) -> Any:
        return self.__source + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self.__source if isinstance(other, str) else NotImplemented


def _with_json_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose JSON-object argument strings became :class:`JsonArguments`."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_with_json_arguments(call) for call in calls]}
        out.append(message)
    return out


def _call_with_json_arguments(call: dict) -> dict:
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call  # not JSON: templates get the string as sent
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": JsonArguments(arguments, parsed)}}


def render_jinja(
    source: str,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render an HF chat template; the same variables transformers passes, plus ``variables``."""
    template = compile_template(source)
    context = {"documents": None, **variables}
    try:
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(exc)}") from None
    except jinja2.TemplateError as exc:  # raise_exception(...) and undefined-variable errors
        raise ChatTemplateError(f"chat template rejected the messages: {_one_line(exc)}") from None
    except Exception as exc:  # the template is checkpoint data: any failure inside it is its failure
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None


# --------------------------------------------------------------------- built-in DeepSeek template


def _tool_function(tool: dict) -> dict:
    """OpenAI ``{"type": "function", "function": {...}}`` or a bare ``{"name", ...}`` definition."""
    function = tool.get("function", tool)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatTemplateError("each tool needs function.name (a string)")
    return function


def deepseek_tools_prompt(tools: list[dict]) -> str:
    """The tool section appended to the system prompt: one entry per tool, then the call format."""
    lines = ["## Tools", "You have access to the following tools:"]
    for tool in tools:
        function = _tool_function(tool)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        lines += [
            "",
            f"### {function['name']}",
            f"Description: {function.get('description') or ''}",
            "",
            f"Parameters: {json.dumps(parameters, ensure_ascii=False)}",
        ]
    lines += [
        "",
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}tool_call_name",
        "```json",
        "tool_call_arguments",
        f"```{CALL_END}{CALLS_END}",
        "",
        "Where:",
        "- `tool_call_name` must be an exact match to one of the available tools",
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema",
        f"- For multiple tool calls, put one {CALL_BEGIN}…{CALL_END} block per call on its own line, "
        f"all inside a single {CALLS_BEGIN}…{CALLS_END}",
    ]
    return "\n".join(lines)


def _tool_call_text(call: dict) -> str:
    function = call["function"]
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):  # history from some clients carries parsed objects
        arguments = json.dumps(arguments, ensure_ascii=False)
    kind = call.get("type") or "function"
    return f"{CALL_BEGIN}{kind}{TOOL_SEP}{function['name']}\n```json\n{arguments}\n```{CALL_END}"


def _answer_text(content: str | None) -> str:
    # Clients sometimes echo "<think>…</think>answer" in content: keep only the answer, as R1 does.
    text = content or ""
    return text.rsplit(THINK_CLOSE, 1)[-1] if THINK_CLOSE in text else text


def _assistant_text(message: dict, after_tool: bool, current_turn: bool, thinking: bool | None) -> str:
    """One assistant message. It opens with ``<｜Assistant｜>`` unless it continues a turn right after
    tool outputs (DeepSeek keeps the turn open across tool round trips).

    Reasoning: in thinking mode, past turns keep only ``</think>`` (their reasoning is dropped, as
    DeepSeek-V3.1+ do); the current turn (after the last user message: a tool-calling loop) keeps it,
    since the model is still working on that request.
    """
    parts = [] if after_tool else [ASSISTANT]
    reasoning = message.get("reasoning_content")
    if thinking and current_turn and reasoning:
        parts.append(f"{THINK_OPEN}{reasoning}{THINK_CLOSE}")
    elif thinking is not None and not after_tool:
        parts.append(THINK_CLOSE)
    parts.append(_answer_text(message.get("content")))
    calls = message.get("tool_calls")
    if calls:
        parts.append(CALLS_BEGIN + "\n".join(_tool_call_text(call) for call in calls) + CALLS_END)
    parts.append(EOS)
    return "".join(parts)


def _generation_prompt(last_role: str, thinking: bool | None) -> str:
    opener = {None: "", True: THINK_OPEN, False: THINK_CLOSE}[thinking]
    if last_role == "user":
        return ASSISTANT + opener
    if last_role == "tool":  # the model continues its open turn after the tool outputs
        return THINK_OPEN if thinking else ""
    return ""


def render_deepseek(
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = BOS,
    thinking: bool | None = None,
) -> str:
    """DeepSeek-V3/V4-style prompt for normalised ``messages`` (see :func:`normalize_messages`).

    ``BOS + system`` (all system messages joined by blank lines, then the tool section), then
    ``<｜User｜>…`` and ``<｜Assistant｜>…<｜end▁of▁sentence｜>`` turns; tool calls in DeepSeek-V3's
    special-token format (one call per line), consecutive tool results grouped in one
    ``<｜tool▁outputs▁begin｜>…<｜tool▁outputs▁end｜>`` block (one result per line). ``thinking``:
    None renders no reasoning markers (plain V3); True opens ``<think>`` for the model; False
    closes it at once (``</think>``) so the model answers directly.
    """
    system = "\n\n".join(m["content"] or "" for m in messages if m["role"] == "system")
    if tools:
        system = f"{system}\n\n{deepseek_tools_prompt(tools)}" if system else deepseek_tools_prompt(tools)
    turns = [m for m in messages if m["role"] != "system"]
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    out = [bos_token, system]
    for i, message in enumerate(turns):
        role = message["role"]
        prev_role = turns[i - 1]["role"] if i else None
        next_role = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role == "user":
            out.append(USER + (message["content"] or ""))
        elif role == "assistant":
            out.append(_assistant_text(message, prev_role == "tool", i > last_user, thinking))
        else:  # tool
            out.append(OUTPUTS_BEGIN if prev_role != "tool" else "\n")
            out.append(OUTPUT_BEGIN + (message["content"] or "") + OUTPUT_END)
            if next_role != "tool":
                out.append(OUTPUTS_END)
    if add_generation_prompt and turns:
        out.append(_generation_prompt(turns[-1]["role"], thinking))
    return "".join(out)


def _thinking_flag(variables: dict[str, Any]) -> bool | None:
    """``thinking`` (DeepSeek's name) or ``enable_thinking`` (Qwen's); None when neither is given."""
    for key in ("thinking", "enable_thinking"):
        value = variables.get(key)
        if value is not None:
            return bool(value)
    return None


# ----------------------------------------------------------------------------- template choice


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None


def _templates_from_config(value: Any, where: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


@dataclass
class ChatTemplates:
    """A checkpoint's chat templates by name (``default``, ``tool_use`` ...); empty means built-in."""

    templates: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: Path, tokenizer_config: dict[str, Any]) -> ChatTemplates:
        """Templates files override tokenizer_config.json, as in transformers."""
        templates = _templates_from_config(tokenizer_config.get("chat_template"), folder / "tokenizer_config.json")
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.stem] = _read_text(path)
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = _read_text(folder / "chat_template.jinja")
        return cls(templates)

    @property
    def builtin(self) -> bool:
        return not self.templates

    def select(self, tools: list[dict] | None) -> str | None:
        """The template source to use (None: the built-in one); ``tool_use`` when tools are given."""
        if not self.templates:
            return None
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(
            f"the checkpoint has several chat templates and none named 'default': {sorted(self.templates)}"
        )

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        **variables: Any,
    ) -> str:
        """Validate ``messages``/``tools`` and render the prompt; ChatTemplateError (one line) on failure."""
        normalized = normalize_messages(messages)
        tools = _check_tools(tools)
        special_tokens = special_tokens or {}
        source = self.select(tools)
        if source is None:
            return render_deepseek(
                normalized,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=special_tokens.get("bos_token", BOS),
                thinking=_thinking_flag(variables),
            )
        # Caller's variables override the special tokens, as in transformers.
        return render_jinja(
            source,
            _with_json_arguments(normalized),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **variables},
        )
