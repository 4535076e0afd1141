"""A small load test: 32 requests from 8 concurrent clients against the demo model (more clients than
engine streams, so requests queue), mixing streamed and plain chat and completions. None may be lost
or fail, every usage must add up, and the server must be healthy and idle afterwards."""

import asyncio
import time

import httpx
import openai
import pytest
from server_harness import LiveServer, demo_config

CLIENTS, REQUESTS, MAX_TOKENS = 8, 32, 8


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def server(request):
    live = LiveServer(demo_config(max_streams=4, context=512, kv_layout=request.param)).start()
    live.kv_layout = request.param
    yield live
    live.stop()


async def one_request(client: openai.AsyncOpenAI, k: int) -> dict:
    """Request ``k``: kind k % 4 (streamed chat, plain chat, streamed completion, plain completion)."""
    started = time.perf_counter()
    extra = {"ignore_eos": True}
    messages = [{"role": "user", "content": f"Request number {k}: say something."}]
    kind = k % 4
    first_token = None
    if kind == 0:
        stream = await client.chat.completions.create(
            model="demo", messages=messages, max_tokens=MAX_TOKENS, stream=True, extra_body=extra,
            stream_options={"include_usage": True}, logprobs=True,
        )  # fmt: skip
        tokens, usage = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                first_token = first_token or time.perf_counter()
                tokens += len(chunk.choices[0].logprobs.content)
            usage = chunk.usage or usage
        assert usage.completion_tokens == tokens == MAX_TOKENS
    elif kind == 1:
        reply = await client.chat.completions.create(
            model="demo", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
        )
        usage = reply.usage
        assert reply.choices[0].finish_reason == "length"
    elif kind == 2:
        stream = await client.completions.create(
            model="demo", prompt=f"Request {k}:", max_tokens=MAX_TOKENS, stream=True, extra_body=extra,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first_token = first_token or time.perf_counter()
            usage = chunk.usage or usage
    else:
        reply = await client.completions.create(
            model="demo", prompt=f"Request {k}:", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        usage = reply.usage
    assert usage.completion_tokens == MAX_TOKENS and usage.total_tokens == usage.prompt_tokens + MAX_TOKENS
    done = time.perf_counter()
    return {"k": k, "seconds": done - started, "ttft": None if first_token is None else first_token - started,
            "prompt_tokens": usage.prompt_tokens}  # fmt: skip


async def run_load(base: str) -> list:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    queue: asyncio.Queue = asyncio.Queue()
    for k in range(REQUESTS):
        queue.put_nowait(k)
    results, failures = [], []

    async def worker():
        while not queue.empty():
            k = queue.get_nowait()
            try:
                results.append(await one_request(client, k))
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                failures.append((k, repr(exc)))

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    await client.close()
    assert not failures, failures
    return results


def test_load_32_requests_from_8_clients(server):
    before = server.engine_stats()
    started = time.perf_counter()
    results = asyncio.run(run_load(server.base))
    seconds = time.perf_counter() - started
    assert sorted(r["k"] for r in results) == list(range(REQUESTS))  # none lost
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    median_ttft_ms = ttfts[len(ttfts) // 2] * 1e3
    print(
        f"{REQUESTS} requests from {CLIENTS} clients in {seconds:.2f} s "
        f"({REQUESTS * MAX_TOKENS / seconds:.0f} generated tokens/s), median TTFT {median_ttft_ms:.0f} ms, "
        f"slowest request {max(r['seconds'] for r in results):.2f} s"
    )
    assert seconds < 60

    after = server.wait_idle()
    assert after.generation_tokens_total - before.generation_tokens_total == REQUESTS * MAX_TOKENS
    assert after.prompt_tokens_total - before.prompt_tokens_total == sum(r["prompt_tokens"] for r in results)
    assert httpx.get(server.base + "/health").status_code == 200
    metrics = httpx.get(server.base + "/metrics").text
    finished = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("moetier:request_success_total")
    )
    assert finished >= REQUESTS
    pool_lines = [line for line in metrics.splitlines() if line.startswith("moetier:kv_pool_used_bytes")]
    if server.kv_layout == "paged":  # the prefix cache's snapshots hold blocks; the finished requests none
        assert len(pool_lines) == 1 and float(pool_lines[0].rsplit(" ", 1)[1]) > 0
    else:
        assert not pool_lines
    # Still serving normally after the burst.
    reply = server.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)  # fmt: skip
    assert reply.usage.completion_tokens >= 1
