"""What chat and text completions share: the loaded model, sampling parameters, running engine
requests (fan-out of ``n``, abort on early exit, client disconnects), logprobs and SSE framing
(with keep-alive comments while a streamed request waits for its first token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from moetier.engine.sampling import SamplingParams, TokenLogprob
from moetier.errors import ConfigError
from moetier.server.metrics import RequestTimer, ServerMetrics
from moetier.server.openai_errors import (
    SERVER_ERROR,
    UNAVAILABLE,
    OpenAIError,
    context_length_exceeded,
    internal_error,
    invalid,
    model_not_found,
    sse_error,
)
from moetier.server.protocol import _SamplingFields

logger = logging.getLogger("moetier.server")

T = TypeVar("T")
# JSON has no -inf: vLLM's stand-in for the logprob of an impossible token.
NEG_INF_LOGPROB = -9999.0
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServingModel:
    """A loaded model as the server sees it.

    ``engine``: the :class:`moetier.engine.async_engine.AsyncEngine` (``generate``, ``abort``,
    ``stats``, ``shutdown``), or anything with that interface (tests wrap it). ``validate``: the
    engine's thread-safe request check (raises ConfigError), or None.
    """

    engine: Any
    tokenizer: Any
    max_model_len: int
    served_names: list[str]
    model_type: str = ""
    vocab_size: int | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    root: str = ""
    validate: Callable[[list[int], SamplingParams], Any] | None = None
    reasoning_parser: type | None = None
    tool_call_parser: type | None = None
    builtin_template: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.served_names[0]

    def check_model(self, requested: str | None) -> None:
        """404 unless ``requested`` is one of the served names (None picks the default, as vLLM)."""
        if requested is not None and requested not in self.served_names:
            raise model_not_found(requested, self.served_names)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def log_unknown_fields(request: Any, endpoint: str) -> None:
    extras = request.unknown_fields()
    if extras:
        logger.debug("%s: ignoring unknown request fields %s", endpoint, extras)


# --- sampling ---------------------------------------------------------------------------------------


def sampling_params(
    model: ServingModel,
    request: _SamplingFields,
    max_tokens: int,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's :class:`SamplingParams`; fields the request leaves out take the checkpoint's
    generation_config defaults (temperature, top_p, ...), then SamplingParams' own."""
    if request.logit_bias:
        raise invalid("logit_bias is not supported by this server", param="logit_bias")
    chosen: dict[str, Any] = {
        key: model.generation_config[key] for key in _SAMPLING_DEFAULTS if model.generation_config.get(key) is not None
    }
    if model.generation_config.get("do_sample") is False:
        chosen["temperature"] = 0.0
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
    ):
        value = getattr(request, key)
        if value is not None:
            chosen[key] = value
    chosen.update(
        max_tokens=max_tokens,
        n=request.n,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    if isinstance(chosen.get("stop"), list) and any(s == "" for s in chosen["stop"]):
        raise invalid("stop strings must not be empty", param="stop")
    try:
        return SamplingParams(**chosen)
    except ConfigError as exc:
        raise invalid(str(exc)) from None


def generation_budget(model: ServingModel, prompt_len: int, requested: int | None, param: str) -> int:
    """Tokens this request may generate: ``requested`` (default: the rest of the window), capped at the
    window. A prompt that alone fills the window is a 400 ``context_length_exceeded``; a longer
    ``requested`` is accepted and generation stops at the window with ``finish_reason "length"``."""
    room = model.max_model_len - prompt_len
    if room < 1:
        raise context_length_exceeded(prompt_len, model.max_model_len, param)
    return room if requested is None else min(requested, room)


def check_prompt_ids(model: ServingModel, ids: list[int], param: str) -> None:
    if not ids:
        raise invalid("the prompt is empty", param=param)
    vocab = model.vocab_size
    for token in ids:
        if token < 0 or (vocab is not None and token >= vocab):
            raise invalid(f"prompt token id {token} is not in the vocabulary [0, {vocab})", param=param)


def validate_with_engine(model: ServingModel, ids: list[int], params: SamplingParams, param: str) -> None:
    """The engine's own checks (vocabulary, window, KV budget) as a 400 before anything is streamed."""
    if model.validate is None:
        return
    try:
        model.validate(ids, params)
    except ConfigError as exc:
        raise invalid(str(exc), param=param) from None


# --- running engine requests ----------------------------------------------------------------------


async def generate(model: ServingModel, request_id: str, prompt_ids: list[int], params: SamplingParams):
    """The engine's updates for one request. Leaving early (client gone, error, cancelled) closes the
    engine's generator, which aborts the request: its cache is freed within one step."""
    stream = model.engine.generate(request_id, prompt_ids, params)
    try:
        async for update in stream:
            yield update
            if update.finished:
                return
    except Exception as exc:
        raise engine_error(exc) from exc
    finally:
        # Closing the engine's generator before it finished is what aborts the request (its contract).
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await stream.aclose()


def engine_error(exc: Exception) -> OpenAIError:
    """An exception from the engine as an API error (busy: 503; invalid request: 400; else 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    if type(exc).__name__ == "EngineBusyError":
        return OpenAIError(f"The server is overloaded: {exc}", status=503, type=UNAVAILABLE, code="engine_busy")
    if isinstance(exc, ConfigError | ValueError):
        return invalid(str(exc))
    logger.exception("engine failure", exc_info=exc)
    return internal_error(exc)


def check_update(update: Any) -> None:
    """An update the engine gave up on (``abort`` with an error) becomes a 500."""
    if update.finish_reason == "abort":
        reason = getattr(update, "error", None) or "the request was aborted by the engine"
        raise OpenAIError(f"Generation failed: {reason}", status=500, type=SERVER_ERROR)


_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as ``(stream index, item)`` in arrival order.

    One stream is iterated directly; several run as tasks. Leaving early cancels the tasks, which
    closes (and so aborts) every stream still running.
    """
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it (aborting its engine requests)
    and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def timer(metrics: ServerMetrics | None, arrival: float) -> RequestTimer:
    return RequestTimer(metrics, arrival)


# --- logprobs -------------------------------------------------------------------------------------


def finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class TokenText:
    """Each token's own text (``decode([id])`` with special tokens kept), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else ""
            self._cache[token_id] = text
        return text


def chat_logprob_entries(entries: list[TokenLogprob], text_of: TokenText, top: int) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` entries: token, logprob, bytes and the ``top`` alternatives."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    out = []
    for entry in entries:
        item = one(entry.token_id, entry.logprob)
        item["top_logprobs"] = [one(tid, lp) for tid, lp in entry.top[:top]]
        out.append(item)
    return out


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset),
    built incrementally.

    ``tokens`` are each token's own text; ``text_offset`` is where each token's text starts in the
    returned text, found by decoding the tokens incrementally (so a special token that decodes to
    nothing, or the first byte of a multi-byte character, takes the offset of what follows).
    """

    def __init__(self, tokenizer: Any, text_of: TokenText, top: int, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.text_of, self.top, self.skip = tokenizer, text_of, top, skip_special_tokens
        self.offset = 0
        self.decoder = self._new_decoder()
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def _new_decoder(self) -> Any:
        return None if self.tokenizer is None else self.tokenizer.stream_decoder(skip_special_tokens=self.skip)

    def add(self, entries: list[TokenLogprob | None], token_ids: list[int] | None = None) -> dict[str, Any]:
        """Append ``entries`` (None: a token without a logprob, the first prompt token, whose id is
        ``token_ids[i]``); returns the object for just these tokens (a stream chunk's)."""
        start = len(self.tokens)
        for i, entry in enumerate(entries):
            token_id = entry.token_id if entry is not None else (token_ids or [])[i]
            text = self.text_of(token_id)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            if self.decoder is not None:
                self.offset += len(self.decoder.push(token_id))
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(finite(entry.logprob))
            alternatives = {self.text_of(tid): finite(lp) for tid, lp in entry.top[: self.top]}
            # Like vLLM, the chosen token is always listed (lm-eval compares it with the best one).
            alternatives.setdefault(text, finite(entry.logprob))
            self.top_logprobs.append(alternatives)
        return self.since(start)

    def since(self, start: int) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def move_to(self, offset: int) -> None:
        """Continue at ``offset`` with a fresh decoder (the generated text starts after the echoed prompt)."""
        self.offset = offset
        self.decoder = self._new_decoder()


# --- server-sent events ---------------------------------------------------------------------------


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# Seconds a stream waits for its first token before it sends SSE comments (``moetier serve --sse-keepalive``).
DEFAULT_KEEPALIVE_SECONDS = 5.0
_END = object()


def keepalive_comment(progress: tuple[int, int] | None) -> str:
    """An SSE comment line (clients and EventSource ignore it): the prefill's progress when known."""
    return ": keep-alive\n\n" if progress is None else f": prefill {progress[0]}/{progress[1]} tokens\n\n"


def progress_of(model: ServingModel, request_id: str) -> Callable[[], tuple[int, int] | None] | None:
    """A reader of the engine request's prefill progress, when the engine offers one (AsyncEngine does)."""
    lookup = getattr(model.engine, "prefill_progress", None)
    return None if lookup is None else (lambda: lookup(request_id))


async def _next_or_end(items: AsyncIterator[T]) -> T | object:
    try:
        return await anext(items)
    except StopAsyncIteration:
        return _END


async def with_keepalives(
    items: AsyncIterator[T], seconds: float, progress: Callable[[], tuple[int, int] | None] | None = None
) -> AsyncIterator[T | str]:
    """``items``, with an SSE comment (:func:`keepalive_comment`) every ``seconds`` while the FIRST item is
    awaited, so proxies and clients see a long prefill alive. ``seconds`` 0 sends none.

    Only the first item is raced against a timer; after it the items pass straight through (no timer
    on the token path). Closing this generator (client gone) cancels a pending first item and closes
    ``items``, which aborts its engine requests.
    """
    try:
        if seconds > 0:
            first = asyncio.ensure_future(_next_or_end(items))
            try:
                while not (await asyncio.wait({first}, timeout=seconds))[0]:
                    yield keepalive_comment(progress() if progress is not None else None)
            finally:
                if not first.done():
                    first.cancel()
                    with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError, Exception):
                        await first
            item = first.result()
            if item is _END:
                return
            yield item  # type: ignore[misc]
        async for item in items:
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await items.aclose()


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """``chunks`` then ``[DONE]``; an error after the stream started becomes an error event first."""
    try:
        async for chunk in chunks:
            yield chunk
    except OpenAIError as exc:
        yield sse_error(exc)
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        logger.exception("error while streaming")
        yield sse_error(internal_error(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()
    yield SSE_DONE


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body iterator when the client disconnects.

    Starlette cancels the sending task on disconnect, which leaves an async generator suspended at
    ``yield`` until garbage collection; closing it here runs its ``finally`` blocks (engine abort)
    at once.
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        # No caching, and no buffering by proxies (nginx honours X-Accel-Buffering): tokens must flow.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_root(path: Path | str | None) -> str:
    return str(path) if path is not None else ""
