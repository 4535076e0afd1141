"""``POST /v1/chat/completions``: render the chat, generate, split reasoning and tool calls, answer.

Output processing per choice: the engine's text goes through the family's reasoning parser first
(``<think>…</think>`` -> ``reasoning_content`` and ``reasoning``, both sent, since clients read one
or the other; whether the prompt already opened ``<think>`` is read from the rendered prompt), and
the content it releases through the tool-call parser (DeepSeek's format -> OpenAI ``tool_calls``,
streamed as deltas, ``finish_reason "tool_calls"``).

Best-effort features (the server instructs or nudges the model; it does not constrain decoding):

- ``tool_choice``: ``none`` renders no tools and parses no calls; ``auto`` parses calls of the
  given tools only. ``required`` and a named function: with the built-in DeepSeek template the
  call's opening markers (and, for a named function, its name) are appended to the prompt, so the
  model can only continue with a call (its arguments are the model's). With other templates the
  output is only checked. A response that still lacks the required call carries a ``warnings``
  entry (top level; on the last chunk when streaming) instead of failing.
- ``response_format`` ``json_object`` / ``json_schema``: an instruction (with the schema) is added
  to the system prompt and the content is validated as JSON afterwards (a fenced block counts);
  invalid output is returned as generated, with a ``warnings`` entry.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moetier.errors import ChatTemplateError
from moetier.server.metrics import ServerMetrics
from moetier.server.openai_errors import invalid
from moetier.server.protocol import ChatCompletionRequest, NamedToolChoice
from moetier.server.serving_common import (
    DEFAULT_KEEPALIVE_SECONDS,
    ClientDisconnected,
    ClosingStreamingResponse,
    ServingModel,
    TokenText,
    chat_logprob_entries,
    check_update,
    generate,
    generation_budget,
    log_unknown_fields,
    merge,
    new_id,
    progress_of,
    sampling_params,
    sse,
    sse_stream,
    timer,
    unless_disconnected,
    usage,
    validate_with_engine,
    with_keepalives,
)
from moetier.server.tool_calls import (
    CALL_BEGIN,
    CALLS_BEGIN,
    SEP,
    DeepSeekToolCallParser,
    ToolCallDelta,
    collect_stream,
)

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt"}
JSON_INSTRUCTION = "Respond with a single valid JSON object and nothing else (no prose, no code fence)."


@dataclass
class ChatPrompt:
    """The rendered prompt, its token ids and the text forced after it (fed to the parsers first)."""

    text: str
    ids: list[int]
    forced: str = ""


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def merge(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(
            self.reasoning + other.reasoning, self.content + other.content, self.tool_calls + other.tool_calls
        )

    def to_openai(self) -> dict[str, Any]:
        """The stream ``delta`` (empty when nothing was released)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return delta


class ChatChoice:
    """One choice's output pipeline: reasoning parser, then tool-call parser, plus what it released."""

    def __init__(
        self,
        index: int,
        model: ServingModel,
        prompt: ChatPrompt,
        tool_names: list[str] | None,
        single_call: bool,
        top_logprobs: int | None,
    ) -> None:
        self.index = index
        parser = model.reasoning_parser
        if parser is None:
            self.reasoning = None
        elif hasattr(parser, "for_prompt"):
            self.reasoning = parser.for_prompt(prompt.text)
        else:
            self.reasoning = parser()
        parse_tools = tool_names is not None and model.tool_call_parser is not None
        self.tools = model.tool_call_parser(allowed_names=tool_names) if parse_tools else None
        self.single_call = single_call
        self.top_logprobs = top_logprobs
        self.items: list[Any] = []  # everything the tool parser released (content strings and deltas)
        self.reasoning_text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            return self._content(text)
        split = self.reasoning.feed(text)
        return ChatDelta(reasoning=self._keep_reasoning(split.reasoning)).merge(self._content(split.content))

    def finish(self) -> ChatDelta:
        delta = ChatDelta()
        if self.reasoning is not None:
            split = self.reasoning.finish()
            delta = ChatDelta(reasoning=self._keep_reasoning(split.reasoning)).merge(self._content(split.content))
        if self.tools is not None:
            delta = delta.merge(self._items(self.tools.finish()))
        return delta

    def _keep_reasoning(self, text: str) -> str:
        if text:
            self.reasoning_text.append(text)
        return text

    def _content(self, text: str) -> ChatDelta:
        if self.tools is None:
            if text:
                self.items.append(text)
            return ChatDelta(content=text)
        return self._items(self.tools.feed(text)) if text else ChatDelta()

    def _items(self, items: list[Any]) -> ChatDelta:
        delta = ChatDelta()
        for item in items:
            if isinstance(item, str):
                delta.content += item
            elif self.single_call and item.index > 0:
                continue  # parallel_tool_calls=false keeps the first call only
            else:
                delta.tool_calls.append(item)
            self.items.append(item)
        return delta

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.has_reasoning

    @property
    def has_tool_calls(self) -> bool:
        return any(isinstance(item, ToolCallDelta) for item in self.items)

    def final_reason(self, engine_reason: str | None) -> str:
        reason = engine_reason or "stop"
        return "tool_calls" if reason == "stop" and self.has_tool_calls else reason

    def message(self) -> dict[str, Any]:
        result = collect_stream(self.items)
        reasoning = "".join(self.reasoning_text) if self.has_reasoning else None
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.tool_calls:
            message["content"] = result.content or None
            message["tool_calls"] = [call.to_openai() for call in result.tool_calls]
        message["reasoning_content"] = message["reasoning"] = reasoning
        return message

    def content_text(self) -> str:
        return collect_stream(self.items).content


class ChatServing:
    """The handler of ``/v1/chat/completions`` for one loaded model (``keepalive_seconds``: see
    :func:`~moetier.server.serving_common.with_keepalives`)."""

    def __init__(
        self,
        model: ServingModel,
        metrics: ServerMetrics | None = None,
        keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS,
    ) -> None:
        self.model, self.metrics, self.keepalive_seconds = model, metrics, keepalive_seconds
        self.text_of = TokenText(model.tokenizer)

    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        log_unknown_fields(request, "chat/completions")
        self.model.check_model(request.model)
        tool_names, forced_name = self._check_tools(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs requires logprobs=true", param="top_logprobs")
        prompt = self._render(request, tool_names)
        if forced_name is not None:
            prompt.forced = self._forced_call(prompt.text, forced_name)
            prompt.ids = self._encode(prompt.text + prompt.forced)
        requested = request.max_completion_tokens or request.max_tokens
        budget = generation_budget(self.model, len(prompt.ids), requested, "messages")
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(self.model, request, budget, logprobs=top)
        validate_with_engine(self.model, prompt.ids, params, "messages")
        run = _ChatRun(self, request, prompt, params, tool_names, forced_name, arrival)
        if request.stream:
            return ClosingStreamingResponse(sse_stream(run.stream()))
        try:
            body = await unless_disconnected(raw, run.complete())
        except ClientDisconnected:
            return Response(status_code=499)
        headers = {"X-Moetier-Warning": "; ".join(body["warnings"])[:1000]} if "warnings" in body else None
        return JSONResponse(body, headers=headers)

    # --- request preparation -----------------------------------------------------------------------

    def _check_tools(self, request: ChatCompletionRequest) -> tuple[list[str] | None, str | None]:
        """(tool names to parse, or None when tools are off; the forced choice: a name, "" = any, None)."""
        choice = request.tool_choice
        names = [tool.function.name for tool in request.tools or []]
        if len(set(names)) != len(names):
            raise invalid("tool names must be unique", param="tools")
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
            raise invalid("tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise invalid(
                    f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
            return [choice.function.name], choice.function.name
        if choice == "none" or not names:
            return None, None
        return names, ("" if choice == "required" else None)

    def _render(self, request: ChatCompletionRequest, tool_names: list[str] | None) -> ChatPrompt:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        if request.response_format is not None and request.response_format.type != "text":
            messages = _with_json_instruction(messages, request.response_format)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if tool_names is not None else None
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KWARGS & kwargs.keys()
        if reserved:
            raise invalid(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
        try:
            text = self.model.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=request.add_generation_prompt, **kwargs
            )
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        return ChatPrompt(text, self._encode(text))

    def _encode(self, text: str) -> list[int]:
        # The template writes BOS itself; adding special tokens again would double it.
        return self.model.tokenizer.encode(text, add_special_tokens=False)

    def _forced_call(self, prompt_text: str, name: str) -> str:
        """The opening of a DeepSeek tool call appended to the prompt (built-in template only)."""
        parser = self.model.tool_call_parser
        if not self.model.builtin_template or parser is None or not issubclass(parser, DeepSeekToolCallParser):
            return ""
        opened = self.model.reasoning_parser is not None and hasattr(self.model.reasoning_parser, "for_prompt")
        close = "</think>" if opened and self.model.reasoning_parser.for_prompt(prompt_text).starts_in_reasoning else ""
        head = f"{close}{CALLS_BEGIN}{CALL_BEGIN}function{SEP}"
        return f"{head}{name}\n```json\n" if name else head


def _with_json_instruction(messages: list[dict[str, Any]], response_format: Any) -> list[dict[str, Any]]:
    instruction = JSON_INSTRUCTION
    if response_format.type == "json_schema":
        schema = (response_format.json_schema or {}).get("schema", response_format.json_schema)
        instruction += f" The object must follow this JSON schema: {json.dumps(schema, ensure_ascii=False)}"
    first = messages[0] if messages else None
    if first is not None and first["role"] in ("system", "developer") and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{instruction}"}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def json_problem(content: str, response_format: Any) -> str | None:
    """Why ``content`` is not what ``response_format`` asked for (None when it is)."""
    if response_format is None or response_format.type == "text":
        return None
    text = content.strip()
    if text.startswith("```") and text.endswith("```") and text.count("```") == 2:
        text = text[3:-3].split("\n", 1)[-1] if "\n" in text[3:-3] else text[3:-3]
    try:
        value = json.loads(text)
    except ValueError:
        return f"response_format {response_format.type}: the output is not valid JSON (decoding is not constrained)"
    if not isinstance(value, dict):
        return f"response_format {response_format.type}: the output is JSON but not an object"
    return None


class _ChatRun:
    """One accepted request: ``n`` engine requests, their choices and the response built from them."""

    def __init__(
        self,
        serving: ChatServing,
        request: ChatCompletionRequest,
        prompt: ChatPrompt,
        params: Any,
        tool_names: list[str] | None,
        forced_name: str | None,
        arrival: float,
    ) -> None:
        self.serving, self.request, self.prompt, self.params = serving, request, prompt, params
        self.model = serving.model
        self.forced_name = forced_name
        self.arrival = arrival
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        single = request.parallel_tool_calls is False
        self.choices = [
            ChatChoice(i, self.model, prompt, tool_names, single, params.logprobs) for i in range(request.n)
        ]
        self.timers = [timer(serving.metrics, arrival) for _ in self.choices]

    def _updates(self) -> AsyncIterator[tuple[int, Any]]:
        streams = [
            generate(self.model, f"{self.id}-{i}", self.prompt.ids, self.params.child(i)) for i in range(self.request.n)
        ]
        return merge(streams)

    def _process(self, index: int, update: Any) -> tuple[ChatDelta, list[dict[str, Any]]]:
        """Feed one update to its choice: the released delta and the logprob entries of its tokens."""
        check_update(update)
        choice = self.choices[index]
        now = time.monotonic()
        if update.new_token_ids:
            self.timers[index].tokens(now)
        delta = choice.feed(update.new_text)
        entries: list[dict[str, Any]] = []
        if update.logprobs:
            entries = chat_logprob_entries(update.logprobs, self.serving.text_of, choice.top_logprobs or 0)
            choice.logprobs.extend(entries)
        choice.completion_tokens = update.completion_tokens
        if update.finished:
            delta = delta.merge(choice.finish())
            choice.finish_reason = choice.final_reason(update.finish_reason)
            self.timers[index].finished(choice.finish_reason, now)
        return delta, entries

    def _start(self, choice: ChatChoice) -> ChatDelta:
        return choice.feed(self.prompt.forced) if self.prompt.forced else ChatDelta()

    def warnings(self) -> list[str]:
        out = []
        for choice in self.choices:
            if self.forced_name is not None and not choice.has_tool_calls:
                wanted = f"a call of {self.forced_name!r}" if self.forced_name else "a tool call"
                out.append(f"choice {choice.index}: tool_choice asked for {wanted} but the model made none")
            problem = json_problem(choice.content_text(), self.request.response_format)
            if problem is not None and not choice.has_tool_calls:
                out.append(f"choice {choice.index}: {problem}")
        return out

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt.ids), sum(c.completion_tokens for c in self.choices))

    # --- non-streaming -------------------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        for choice in self.choices:
            self._start(choice)
        async for index, update in self._updates():
            self._process(index, update)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [
                {
                    "index": c.index,
                    "message": c.message(),
                    "logprobs": {"content": c.logprobs} if self.params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for c in self.choices
            ],
            "usage": self.usage(),
        }
        warnings = self.warnings()
        if warnings:
            body["warnings"] = warnings
        return body

    # --- streaming -----------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], usage_now: dict[str, int] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }
        options = self.request.stream_options
        if options is not None and (options.include_usage or options.continuous_usage_stats):
            payload["usage"] = usage_now if options.continuous_usage_stats else None
        return sse(payload)

    def _choice_chunk(self, choice: ChatChoice, delta: dict[str, Any], entries: list | None) -> dict[str, Any]:
        logprobs = {"content": entries} if entries is not None and self.params.logprobs is not None else None
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    async def stream(self) -> AsyncIterator[str]:
        # The first chunk of each choice carries only the role (clients take TTFT from the first token).
        for choice in self.choices:
            yield self._chunk([self._choice_chunk(choice, {"role": "assistant", "content": ""}, None)])
            forced = self._start(choice).to_openai()
            if forced:
                yield self._chunk([self._choice_chunk(choice, forced, None)])
        pending: dict[int, list[dict[str, Any]]] = {c.index: [] for c in self.choices}
        progress = progress_of(self.model, f"{self.id}-0")
        async for item in with_keepalives(self._updates(), self.serving.keepalive_seconds, progress):
            if isinstance(item, str):  # an SSE comment while the prompt is prefilled
                yield item
                continue
            index, update = item
            delta, entries = self._process(index, update)
            choice = self.choices[index]
            pending[index].extend(entries)
            body = delta.to_openai()
            if not body and not update.finished:
                continue  # text held back by a parser; its logprobs go with the next chunk
            final = update.finished
            if final:
                warnings = [w for w in self.warnings() if w.startswith(f"choice {index}:")]
            logprobs, pending[index] = pending[index], []
            payload_choice = self._choice_chunk(choice, body, logprobs)
            chunk = self._chunk([payload_choice], self.usage())
            if final and warnings:
                data = json.loads(chunk[len("data: ") :])
                data["warnings"] = warnings
                chunk = sse(data)
            yield chunk
        options = self.request.stream_options
        if options is not None and options.include_usage:
            yield sse(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model.name,
                    "choices": [],
                    "usage": self.usage(),
                }
            )
