"""Test helpers for the HTTP server: a real uvicorn server on a free loopback port, the demo model,
and an engine wrapper that plays scripted outputs.

``ScriptedEngine`` forces a request's output: a prompt containing ``[[script:NAME]]`` gets the
tokens of ``scripts[NAME]`` (the text, tokenized, one token per update, then EOS) instead of the
model's, and the server's own reasoning and tool-call parsers process them exactly as they would a
model's output. A script may end in :data:`FAIL` to make the engine raise mid-stream. Every
other request goes to the real engine.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from moetier.engine.engine import RequestUpdate
from moetier.server.app import ServeConfig, create_app, load_serving_model

FAIL = "<<fail>>"
_DEMO: Path | None = None
_DEMO_LOCK = threading.Lock()


def demo_path() -> Path:
    """The demo model, built once per test session in a temporary folder (about a second)."""
    global _DEMO
    with _DEMO_LOCK:
        if _DEMO is None:
            from moetier.demo import ensure_demo_model

            root = Path(tempfile.mkdtemp(prefix="moetier-demo-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            _DEMO = ensure_demo_model(root / "demo")
        return _DEMO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ScriptedEngine:
    """The AsyncEngine interface over a real engine, with scripted outputs for marked prompts."""

    def __init__(self, inner: Any, tokenizer: Any, scripts: dict[str, str]) -> None:
        self.inner, self.tokenizer, self.scripts = inner, tokenizer, scripts
        self.eos = min(tokenizer.eos_token_ids)

    def generate(self, request_id: str, prompt_ids: list[int], params: Any):
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        for name, output in self.scripts.items():
            if f"[[script:{name}]]" in prompt:
                return self._play(request_id, prompt_ids, params, output)
        return self.inner.generate(request_id, prompt_ids, params)

    async def _play(self, request_id: str, prompt_ids: list[int], params: Any, output: str):
        fail = output.endswith(FAIL)
        ids = self.tokenizer.encode(output.removesuffix(FAIL), add_special_tokens=False)
        ids = ids if fail else [*ids, self.eos]
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=params.skip_special_tokens)
        for count, token in enumerate(ids[: params.max_tokens], start=1):
            await asyncio.sleep(0)
            last = count == min(len(ids), params.max_tokens)
            is_eos = token == self.eos
            text = "" if is_eos else decoder.push(token)
            if last and not is_eos:
                text += decoder.flush()
            finished = last and not fail
            reason = ("stop" if is_eos else "length") if finished else None
            yield RequestUpdate(request_id, [token], text, finished, reason, None, len(prompt_ids), count)
        if fail:
            raise RuntimeError("scripted failure")

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def stats(self) -> Any:
        return self.inner.stats()

    async def shutdown(self) -> None:
        await self.inner.shutdown()


class LiveServer:
    """uvicorn serving ``create_app(config, loader)`` in a background thread on a free port."""

    def __init__(self, config: ServeConfig, loader=None) -> None:
        self.port = free_port()
        self.config = dataclasses.replace(config, port=self.port)
        self.app = create_app(self.config, loader)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.server

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        if wait_ready:
            self.wait_healthy(deadline - time.monotonic())
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.base + "/health").status_code != 200:
            if time.monotonic() > deadline or self.state.error is not None:
                raise RuntimeError(f"the model did not load: {self.state.error}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs: Any):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=kwargs.pop("api_key", "unused"), **kwargs)

    def engine_stats(self) -> Any:
        return self.state.model.engine.stats()

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Engine stats once nothing runs or waits and no KV is held (raises after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if stats.running == 0 and stats.waiting == 0 and stats.kv_tokens_used == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy: {stats}")
            time.sleep(0.02)


def scripted_loader(config: ServeConfig, scripts: dict[str, str]):
    """A loader for :class:`LiveServer`: the real model, its engine wrapped in :class:`ScriptedEngine`."""

    def load():
        model = load_serving_model(config)
        model.engine = ScriptedEngine(model.engine, model.tokenizer, scripts)
        return model

    return load


def demo_config(**overrides: Any) -> ServeConfig:
    return ServeConfig(model=str(demo_path()), served_model_name="demo", device="cpu", **overrides)
