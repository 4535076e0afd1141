"""The server end to end on CUDA with the default ``kv_layout="auto"``: Qwen3-MoE decode reads paged blocks
in place there, so the engine serves from paged KV, and concurrent greedy requests get what a contiguous-KV
server gives them (CPU runs pick contiguous: the CPU test suite covers the rest of the server)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from reference import save_tiny
from server_harness import LiveServer
from test_qwen3_moe import tiny_qwen3_config
from tiny_tokenizer import write_test_tokenizer

from moetier.server.app import ServeConfig

PROMPTS = [
    "Mixture-of-Experts models route each token to the top experts of every layer.",
    "Paged attention reads the cache blocks of each sequence where they lie.",
    "A short one.",
]

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-serve-paged")
    save_tiny(tiny_qwen3_config(), path)
    write_test_tokenizer(path, vocab_size=320)
    return path


async def _complete_all(server: LiveServer) -> list[str]:
    async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:

        async def one(prompt: str) -> str:
            body = {"model": str(server.config.model), "prompt": prompt, "max_tokens": 32, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def _serve_and_complete(checkpoint, kv_layout: str) -> tuple[str, list[str], str]:
    config = ServeConfig(
        model=str(checkpoint), device=DEVICE, dtype="fp32", max_streams=4, context=512, kv_layout=kv_layout
    )
    server = LiveServer(config).start()
    try:
        texts = asyncio.run(_complete_all(server))
        metrics = httpx.get(server.base + "/metrics").text
        return server.state.model.engine.engine.kv_layout, texts, metrics
    finally:
        server.stop()


def test_auto_serves_paged_kv_on_cuda_and_matches_contiguous(checkpoint):
    layout, paged_texts, metrics = _serve_and_complete(checkpoint, "auto")
    assert layout == "paged"
    contiguous_layout, contiguous_texts, _ = _serve_and_complete(checkpoint, "contiguous")
    assert contiguous_layout == "contiguous"
    assert paged_texts == contiguous_texts
    assert all(paged_texts)
    assert "kv_cache_usage_perc" in metrics
