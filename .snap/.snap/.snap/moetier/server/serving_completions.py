"""``POST /v1/completions``: the legacy text-completion API, as lm-evaluation-harness uses it.

``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists; text
prompts are tokenized with BOS as the checkpoint configures it. Each prompt gets ``n`` choices,
numbered ``prompt_index * n + j``. ``echo`` puts the prompt in front of the text and, with
``logprobs``, the prompt tokens' logprobs (the first token has none: ``null``) in front of the
generated ones, in the OpenAI completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``). ``max_tokens=0`` generates nothing: with ``echo`` and ``logprobs`` that scores
the prompt (the engine runs the prompt and one step whose token is dropped).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moetier.server.metrics import ServerMetrics
from moetier.server.openai_errors import invalid
from moetier.server.protocol import CompletionRequest
from moetier.server.serving_common import (
    DEFAULT_KEEPALIVE_SECONDS,
    ClientDisconnected,
    ClosingStreamingResponse,
    CompletionLogprobs,
    ServingModel,
    TokenText,
    check_prompt_ids,
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


@dataclass
class TextPrompt:
    """One prompt: the text echoed back and its token ids."""

    text: str
    ids: list[int]


class CompletionChoice:
    """One choice's text, logprobs and finish state."""

    def __init__(
        self,
        index: int,
        prompt: TextPrompt,
        request: CompletionRequest,
        tokenizer: Any,
        text_of: TokenText,
        scoring: bool,
    ) -> None:
        self.index, self.prompt, self.scoring = index, prompt, scoring
        self.echo = request.echo
        self.logprobs = None
        if request.logprobs is not None:
            self.logprobs = CompletionLogprobs(tokenizer, text_of, request.logprobs, request.skip_special_tokens)
        self.text = prompt.text if request.echo else ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.completion_tokens = 0
        self.started = False

    def add(self, update: Any) -> tuple[str, dict[str, Any] | None]:
        """Record an update; returns the text and logprobs this update adds to the response."""
        text = ""
        start = 0 if self.logprobs is None else len(self.logprobs.tokens)
        if not self.started:
            self.started = True
            if self.echo:
                text = self.prompt.text
                if self.logprobs is not None and update.prompt_logprobs is not None:
                    self.logprobs.add(update.prompt_logprobs, self.prompt.ids)
                    self.logprobs.move_to(len(self.prompt.text))
        if not self.scoring:
            text += update.new_text
            self.text += update.new_text
            self.completion_tokens = update.completion_tokens
            if self.logprobs is not None and update.logprobs:
                self.logprobs.add(update.logprobs)
        if update.finished:
            self.finish_reason = "length" if self.scoring else update.finish_reason
            self.stop_reason = None if self.scoring else update.stop_reason
        return text, None if self.logprobs is None else self.logprobs.since(start)

    def finish_without_engine(self) -> None:
        """``max_tokens=0`` without prompt logprobs: nothing to run."""
        self.started, self.finish_reason = True, "length"

    def to_openai(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": None if self.logprobs is None else self.logprobs.since(0),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


class CompletionServing:
    """The handler of ``/v1/completions`` for one loaded model (``keepalive_seconds``: see
    :func:`~moetier.server.serving_common.with_keepalives`)."""

    def __init__(
        self,
        model: ServingModel,
        metrics: ServerMetrics | None = None,
        keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS,
    ) -> None:
        self.model, self.metrics, self.keepalive_seconds = model, metrics, keepalive_seconds
        self.text_of = TokenText(model.tokenizer)

    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        log_unknown_fields(request, "completions")
        self.model.check_model(request.model)
        if request.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise invalid(
                "best_of must equal n (or be left out): this server returns every completion", param="best_of"
            )
        prompts = self._prompts(request)
        run = _CompletionRun(self, request, prompts, arrival)
        if request.stream:
            return ClosingStreamingResponse(sse_stream(run.stream()))
        try:
            body = await unless_disconnected(raw, run.complete())
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    def _prompts(self, request: CompletionRequest) -> list[TextPrompt]:
        prompt = request.prompt
        if isinstance(prompt, list) and not prompt:
            raise invalid("prompt must not be empty", param="prompt")
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif isinstance(prompt[0], int):
            items = [prompt]  # one prompt of token ids
        else:
            items = list(prompt)
        out = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if tokenizer is None:
                    raise invalid("this server has no tokenizer: send token ids", param=param)
                ids = tokenizer.encode(item)
                text = item
            else:
                ids = list(item)
                check_prompt_ids(self.model, ids, param)
                text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens) if tokenizer else ""
            if not ids:
                raise invalid("the prompt is empty", param=param)
            out.append(TextPrompt(text, ids))
        return out


class _CompletionRun:
    """One accepted request: its choices, the engine requests behind them and the response."""

    def __init__(
        self, serving: CompletionServing, request: CompletionRequest, prompts: list[TextPrompt], arrival: float
    ) -> None:
        self.serving, self.request, self.prompts = serving, request, prompts
        self.model = serving.model
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.arrival = arrival
        self.choices: list[CompletionChoice] = []
        self.jobs: list[tuple[CompletionChoice, str, list[int], Any]] = []
        self._plan()

    def _plan(self) -> None:
        """Validate every prompt and build its choices before any work starts."""
        request, n = self.request, self.request.n
        scoring = request.max_tokens == 0
        needs_engine = not scoring or (request.echo and request.logprobs is not None)
        for p, prompt in enumerate(self.prompts):
            param = "prompt" if len(self.prompts) == 1 else f"prompt[{p}]"
            budget = generation_budget(self.model, len(prompt.ids), None if scoring else request.max_tokens, param)
            params = None
            if needs_engine:
                echo_logprobs = request.logprobs if request.echo else None
                params = sampling_params(
                    self.model,
                    request,
                    1 if scoring else budget,
                    logprobs=request.logprobs,
                    prompt_logprobs=echo_logprobs,
                )
                validate_with_engine(self.model, prompt.ids, params, param)
            for j in range(n):
                choice = CompletionChoice(
                    p * n + j, prompt, request, self.model.tokenizer, self.serving.text_of, scoring
                )
                self.choices.append(choice)
                if params is None:
                    choice.finish_without_engine()
                else:
                    self.jobs.append((choice, f"{self.id}-{p}-{j}", prompt.ids, params.child(j)))

    def _updates(self) -> AsyncIterator[tuple[int, Any]]:
        return merge([generate(self.model, rid, ids, params) for _, rid, ids, params in self.jobs])

    def usage(self) -> dict[str, int]:
        return usage(sum(len(p.ids) for p in self.prompts), sum(c.completion_tokens for c in self.choices))

    async def complete(self) -> dict[str, Any]:
        if self.jobs:
            timers = [timer(self.serving.metrics, self.arrival) for _ in self.jobs]
            async for k, update in self._updates():
                check_update(update)
                choice = self.jobs[k][0]
                now = time.monotonic()
                if update.new_token_ids and not choice.scoring:
                    timers[k].tokens(now)
                choice.add(update)
                if update.finished:
                    timers[k].finished(choice.finish_reason or "stop", now)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [c.to_openai() for c in self.choices],
            "usage": self.usage(),
        }

    def _chunk(self, choice: CompletionChoice, text: str, logprobs: dict[str, Any] | None) -> str:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            ],
        }
        options = self.request.stream_options
        if options is not None and (options.include_usage or options.continuous_usage_stats):
            payload["usage"] = self.usage() if options.continuous_usage_stats else None
        return sse(payload)

    async def stream(self) -> AsyncIterator[str]:
        for choice in self.choices:
            if not any(job[0] is choice for job in self.jobs):  # max_tokens=0: nothing to generate
                yield self._chunk(choice, choice.text, None if choice.logprobs is None else choice.logprobs.since(0))
        if self.jobs:
            timers = [timer(self.serving.metrics, self.arrival) for _ in self.jobs]
            progress = progress_of(self.model, self.jobs[0][1])
            async for item in with_keepalives(self._updates(), self.serving.keepalive_seconds, progress):
                if isinstance(item, str):  # an SSE comment while the prompt is prefilled
                    yield item
                    continue
                k, update = item
                check_update(update)
                choice = self.jobs[k][0]
                now = time.monotonic()
                if update.new_token_ids and not choice.scoring:
                    timers[k].tokens(now)
                text, logprobs = choice.add(update)
                if update.finished:
                    timers[k].finished(choice.finish_reason or "stop", now)
                if text or update.finished or (logprobs and logprobs["tokens"]):
                    yield self._chunk(choice, text, logprobs)
        options = self.request.stream_options
        if options is not None and options.include_usage:
            yield sse(
                {
                    "id": self.id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model.name,
                    "choices": [],
                    "usage": self.usage(),
                }
            )
