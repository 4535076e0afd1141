"""The OpenAI-compatible HTTP server (FastAPI): ``moetier serve``.

Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (entries carry
``max_model_len``), ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (vLLM's tokenizer endpoints,
which lm-evaluation-harness uses as a remote tokenizer), ``/health`` (503 while the model loads, 200
once it serves), ``/metrics`` (Prometheus, ``moetier:`` names) and FastAPI's ``/openapi.json``.

The socket is up before the model is: the model loads in a background thread after startup, and
until it is ready the API answers 503 (``code: "model_loading"``). Every error is OpenAI-shaped
(:mod:`moetier.server.openai_errors`). With ``api_key`` set, ``/v1/*`` and the tokenizer endpoints
need ``Authorization: Bearer KEY`` (``/health`` and ``/metrics`` stay open, for probes and
scrapers). A client that disconnects aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from moetier import __version__
from moetier.config import check_backbone_format, check_expert_format, check_seconds
from moetier.errors import ChatTemplateError, ConfigError
from moetier.server.metrics import ServerMetrics, dispatcher_metrics
from moetier.server.openai_errors import (
    UNAVAILABLE,
    OpenAIError,
    install_error_handlers,
    invalid,
)
from moetier.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from moetier.server.serving_chat import ChatServing
from moetier.server.serving_common import DEFAULT_KEEPALIVE_SECONDS, ServingModel, log_unknown_fields
from moetier.server.serving_completions import CompletionServing

logger = logging.getLogger("moetier.server")

# Parsers per model family (config.json ``model_type``) when the user leaves them on "auto".
_REASONING_PARSERS = {"deepseek_v4": "deepseek_v4", "deepseek_v3": "deepseek_v3", "qwen3_moe": "qwen3"}
_TOOL_CALL_PARSERS = {"deepseek_v4": "deepseek_v4", "deepseek_v3": "deepseek_v3"}


@dataclass
class ServeConfig:
    """What ``moetier serve`` serves and how; validated on construction.

    ``model`` None serves the built-in demo model (:mod:`moetier.demo`, built on first use under
    ``demo_dir`` or the user's cache). ``context`` caps the window (default: the model's).
    ``reasoning_parser`` / ``tool_call_parser``: ``auto`` (by model family), ``none`` or a name.
    ``tiers``: a :class:`moetier.tiers.plan.TierOptions` (``--gpu-memory`` and friends) to load with
    tiered experts; its plan's table is logged at start-up and its counters appear in ``/metrics``.
    ``kv_dtype``: the KV cache's storage, ``auto`` (the model dtype), ``bf16`` or ``fp8``; ``kv_layout``:
    ``auto``, ``contiguous`` or ``paged`` (:class:`moetier.engine.types.EngineConfig`).
    ``keepalive_seconds``: a streamed request still waiting for its first token (a long prefill) gets an
    SSE comment this often, with the prefill's progress when known; 0 sends none.
    ``prefill_chunk_tokens``: prefill tokens per engine step; ``None`` (auto): the placement plan's choice
    with ``tiers``, else the engine's default. ``warmup``: on CUDA, run a few decode steps per batch size
    up to ``max_streams`` before reporting ready (:mod:`moetier.engine.warmup`). ``expert_format``: the
    routed experts' home copy, ``dense``, ``fp8`` or ``fp4`` (:class:`moetier.config.ModelLoadConfig`).
    ``spare_cache_seconds``: how long a finished request's cache waits for the next request (DeepSeek-V4:
    its decode graphs replay; 0 = off; :class:`moetier.engine.types.EngineConfig`). ``prefix_cache``: the prefix
    cache's VRAM bound (bytes or a size string, ``1GiB``; 0 = no prefix caching), stored as bytes.
    """

    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_streams: int = 4
    context: int | None = None
    dtype: str = "auto"
    device: str | None = None
    api_key: str | None = None
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    demo_dir: str | None = None
    log_level: str = "info"
    tiers: Any = None  # moetier.tiers.plan.TierOptions: serve with tiered experts (None: all resident)
    kv_dtype: str = "auto"
    kv_layout: str = "auto"
    keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS
    prefill_chunk_tokens: int | None = None
    warmup: bool = True
    expert_format: str = "dense"
    backbone_format: str = "auto"
    spare_cache_seconds: float = 30.0
    prefix_cache: int | str = 1 << 30

    def __post_init__(self) -> None:
        from moetier.units import parse_size

        check_expert_format(self.expert_format)
        check_backbone_format(self.backbone_format)
        self.prefix_cache = parse_size(self.prefix_cache, "--prefix-cache")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port!r}")
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise ConfigError(f"max_streams must be an integer >= 1, got {self.max_streams!r}")
        if self.context is not None and (not isinstance(self.context, int) or self.context < 2):
            raise ConfigError(
                f"context must be an integer >= 2 (a prompt token and a generated one), got {self.context!r}"
            )
        if self.api_key == "":
            raise ConfigError("api_key must not be empty (leave it out to serve without a key)")
        if self.kv_dtype not in ("auto", "bf16", "fp8"):
            raise ConfigError(f"kv_dtype must be auto, bf16 or fp8, got {self.kv_dtype!r}")
        if self.kv_layout not in ("auto", "contiguous", "paged"):
            raise ConfigError(f"kv_layout must be auto, contiguous or paged, got {self.kv_layout!r}")
        chunk = self.prefill_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"prefill_chunk_tokens must be an integer >= 1 (None: auto), got {chunk!r}")
        if not isinstance(self.warmup, bool):
            raise ConfigError(f"warmup must be true or false, got {self.warmup!r}")
        check_seconds("keepalive_seconds", self.keepalive_seconds, "0: off")
        check_seconds("spare_cache_seconds", self.spare_cache_seconds, "0: off")


# --- loading ----------------------------------------------------------------------------------------


def _parser(kind: str, choice: str, model_type: str, defaults: dict[str, str], lookup: Callable[[str], type]):
    if choice == "none":
        return None
    if choice == "auto":
        name = defaults.get(model_type)
        return None if name is None else lookup(name)
    try:
        return lookup(choice)
    except ConfigError as exc:
        raise ConfigError(f"--{kind}: {exc}") from None


def resolve_model_path(config: ServeConfig) -> tuple[Path, str]:
    """(checkpoint folder, served model name); builds the demo model when ``config.model`` is None."""
    if config.model is None:
        from moetier.demo import DEMO_NAME, ensure_demo_model

        return ensure_demo_model(config.demo_dir), config.served_model_name or DEMO_NAME
    path = Path(config.model).expanduser()
    return path, config.served_model_name or config.model


def load_serving_model(config: ServeConfig) -> ServingModel:
    """Load the checkpoint into an Engine + AsyncEngine and gather what the server needs (blocking)."""
    from moetier.engine.async_engine import AsyncEngine
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.server.reasoning import reasoning_parser_class
    from moetier.server.tool_calls import tool_call_parser_class

    path, name = resolve_model_path(config)
    engine_config = EngineConfig(
        max_streams=config.max_streams,
        max_model_len=config.context,
        kv_dtype=config.kv_dtype,
        kv_layout=config.kv_layout,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        expert_format=config.expert_format,
        backbone_format=config.backbone_format,
        spare_cache_seconds=config.spare_cache_seconds,
        enable_prefix_caching=config.prefix_cache > 0,
        prefix_cache_bytes=config.prefix_cache,
    )
    tokenizer = "auto" if (path / "tokenizer.json").is_file() else None
    engine = Engine.from_path(
        path,
        config=engine_config,
        dtype=config.dtype,
        device=config.device,
        tokenizer=tokenizer,
        load_progress=False,
        model_name=name,
        tiers=config.tiers,
    )
    logger.info("prefill chunk: %d tokens (%s)", engine.config.prefill_chunk_tokens, _chunk_origin(config, engine))
    if config.warmup and engine.device.type == "cuda":
        from moetier.engine.warmup import warm_up

        warm_up(engine.model, range(1, config.max_streams + 1), engine.model.config.vocab_size)
    model_type = str(engine.hf_config.get("model_type", ""))
    reasoning = _parser(
        "reasoning-parser", config.reasoning_parser, model_type, _REASONING_PARSERS, reasoning_parser_class
    )
    tools = _parser("tool-call-parser", config.tool_call_parser, model_type, _TOOL_CALL_PARSERS, tool_call_parser_class)
    tok = engine.tokenizer
    return ServingModel(
        engine=AsyncEngine(engine),
        tokenizer=tok,
        max_model_len=engine.max_model_len,
        served_names=[name],
        model_type=model_type,
        vocab_size=engine.vocab_size,
        generation_config=dict(engine.generation_config),
        root=str(path),
        validate=engine.validate_request,
        reasoning_parser=reasoning,
        tool_call_parser=tools,
        builtin_template=tok is not None and tok.chat_templates.builtin,
    )


def _chunk_origin(config: ServeConfig, engine: Any) -> str:
    """Why the engine prefills this many tokens per step, for the start-up log."""
    if config.prefill_chunk_tokens is not None:
        return "given"
    if engine.plan is not None:
        return f"placement plan, {engine.plan.chunk_note}"
    return "default: every expert resident, nothing to stream"


class ServerState:
    """The app's model (None while loading), its load error, metrics and handlers."""

    def __init__(self, config: ServeConfig, loader: Callable[[], ServingModel]) -> None:
        self.config = config
        self.loader = loader
        self.model: ServingModel | None = None
        self.error: BaseException | None = None
        self.chat: ChatServing | None = None
        self.completions: CompletionServing | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.metrics = ServerMetrics(
            self._stats, lambda: self.model.name if self.model else "", tier_metrics=self._tier_metrics
        )
        self._task: asyncio.Task | None = None

    def _stats(self) -> Any:
        return None if self.model is None else self.model.engine.stats()

    def _tier_metrics(self) -> Any:
        return None if self.model is None else dispatcher_metrics(self.model.engine)

    def start_loading(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        try:
            model = await asyncio.to_thread(self.loader)
        except Exception as exc:  # noqa: BLE001 - reported by /health and the CLI
            self.error = exc
            if self.on_load_error is not None:
                self.on_load_error(exc)  # the caller reports it (the CLI: one line, exit status 2)
            else:
                logger.error("loading the model failed: %s", exc)
            return
        keepalive = self.config.keepalive_seconds
        self.chat = ChatServing(model, self.metrics, keepalive)
        self.completions = CompletionServing(model, self.metrics, keepalive)
        self.model = model
        logger.info("serving %s (window %d tokens)", model.name, model.max_model_len)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.model is not None:
            await self.model.engine.shutdown()

    def ready(self) -> ServingModel:
        """The model, or a 503 while it loads (or after loading failed)."""
        if self.model is not None:
            return self.model
        if self.error is not None:
            raise OpenAIError(
                f"The model failed to load: {self.error}", status=503, type=UNAVAILABLE, code="model_load_failed"
            )
        raise OpenAIError(
            "The model is still loading; retry shortly (GET /health turns 200 when it is ready).",
            status=503,
            type=UNAVAILABLE,
            code="model_loading",
        )


# --- the app ----------------------------------------------------------------------------------------


def create_app(config: ServeConfig | None = None, loader: Callable[[], ServingModel] | None = None) -> FastAPI:
    """The FastAPI app for ``config``. ``loader`` (tests) replaces :func:`load_serving_model`."""
    config = config or ServeConfig()
    state = ServerState(config, loader or (lambda: load_serving_model(config)))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()  # not awaited: the socket opens while the model loads
        yield
        await state.close()

    app = FastAPI(
        title="moetier",
        version=__version__,
        description="OpenAI-compatible API for Mixture-of-Experts models served by moetier.",
        lifespan=lifespan,
    )
    app.state.server = state
    install_error_handlers(app)

    async def authorized(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise OpenAIError(
                "Incorrect API key provided. Send it as 'Authorization: Bearer KEY'.",
                status=401,
                code="invalid_api_key",
            )

    api = [Depends(authorized)]

    @app.get("/health", tags=["server"])
    async def health() -> JSONResponse:
        if state.model is not None:
            return JSONResponse({"status": "ok", "model": state.model.name})
        if state.error is not None:
            return JSONResponse({"status": "error", "message": str(state.error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics", tags=["server"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=api, tags=["openai"])
    async def list_models() -> JSONResponse:
        model = state.ready()
        return JSONResponse({"object": "list", "data": [_model_card(model, name) for name in model.served_names]})

    @app.get("/v1/models/{model_id:path}", dependencies=api, tags=["openai"])
    async def get_model(model_id: str) -> JSONResponse:
        model = state.ready()
        model.check_model(model_id)
        return JSONResponse(_model_card(model, model_id))

    @app.post("/v1/chat/completions", dependencies=api, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.ready()
        return await state.chat.create(body, request)

    @app.post("/v1/completions", dependencies=api, tags=["openai"])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.ready()
        return await state.completions.create(body, request)

    @app.post("/tokenize", dependencies=api, tags=["tokens"])
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(_tokenize(state.ready(), body))

    @app.get("/tokenizer_info", dependencies=api, tags=["tokens"])
    async def tokenizer_info() -> JSONResponse:
        """The tokenizer's special tokens and chat template (vLLM's endpoint; lm-eval's remote tokenizer)."""
        model = state.ready()
        tokenizer = _require_tokenizer(model)
        try:
            template = tokenizer.chat_templates.select(None)
        except ChatTemplateError:
            template = None
        info: dict[str, Any] = {
            "tokenizer_class": tokenizer.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            **tokenizer.special_tokens,
            "model_max_length": model.max_model_len,
            "vocab_size": model.vocab_size,
            # None: the checkpoint has no Jinja template and the server renders its built-in DeepSeek one.
            "chat_template": template,
        }
        return JSONResponse(info)

    @app.post("/detokenize", dependencies=api, tags=["tokens"])
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        model = state.ready()
        log_unknown_fields(body, "detokenize")
        model.check_model(body.model)
        tokenizer = _require_tokenizer(model)
        vocab = model.vocab_size
        for i, token in enumerate(body.tokens):
            if token < 0 or (vocab is not None and token >= vocab):
                raise invalid(f"token id {token} is not in the vocabulary [0, {vocab})", param=f"tokens[{i}]")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)})

    return app


def _model_card(model: ServingModel, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": model.created,
        "owned_by": "moetier",
        "root": model.root,
        "parent": None,
        "max_model_len": model.max_model_len,
    }


def _require_tokenizer(model: ServingModel) -> Any:
    if model.tokenizer is None:
        raise invalid("this model has no tokenizer (tokenizer.json): send token ids")
    return model.tokenizer


def _tokenize(model: ServingModel, body: TokenizeRequest) -> dict[str, Any]:
    log_unknown_fields(body, "tokenize")
    model.check_model(body.model)
    tokenizer = _require_tokenizer(model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except (ChatTemplateError, TypeError) as exc:
            raise invalid(str(exc), param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    result: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return result


# --- running ----------------------------------------------------------------------------------------


def serve(config: ServeConfig) -> int:
    """Run the server until Ctrl-C (exit 0 after a graceful shutdown); re-raises a model-loading failure."""
    import uvicorn

    if config.model is not None:
        _precheck(Path(config.model).expanduser())
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5)
    )
    state: ServerState = app.state.server

    def stop(exc: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = stop
    if config.model is None:
        logger.info("no --model given: serving the built-in demo model (random weights, built on first use)")
    # uvicorn re-raises Ctrl-C after its graceful shutdown: a normal way to stop a server, so exit 0.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if state.error is not None:
        raise state.error
    return 0


def _precheck(path: Path) -> None:
    """Fail before binding the socket when the folder obviously cannot be served."""
    from moetier.errors import CheckpointError

    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model folder (expected config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'}: config.json is missing")
