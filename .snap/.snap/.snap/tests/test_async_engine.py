"""AsyncEngine: concurrent consumers, early exits abort and free, failures stay with their request."""

import asyncio

import pytest
import torch
from reference import save_tiny
from test_engine import GREEDY, random_prompt, reference_tokens
from test_qwen3_moe import tiny_qwen3_config

from moetier.config import ModelLoadConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.weights.loader import load_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-async")
    save_tiny(tiny_qwen3_config(), path)
    return load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)


def make_engine(loaded, **config) -> Engine:
    return Engine(loaded, EngineConfig(**config), tokenizer=None)


async def consume(engine: AsyncEngine, request_id: str, prompt, params, stop_after: int | None = None):
    """Collect a request's updates; with ``stop_after``, break out of the loop after that many."""
    updates = []
    async for update in engine.generate(request_id, prompt, params):
        updates.append(update)
        if stop_after is not None and len(updates) == stop_after:
            break
    return updates


async def until_idle(engine: AsyncEngine, timeout: float = 10.0):
    """Wait until the engine holds no request and no KV tokens; returns its stats."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = engine.stats()
        if stats.running == stats.waiting == stats.kv_tokens_used == 0 and not engine.engine.has_work():
            return stats
        assert asyncio.get_running_loop().time() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.01)


def tokens_of(updates):
    return [t for u in updates for t in u.new_token_ids]


def test_four_concurrent_consumers_one_leaves_early(qwen):
    prompts = [random_prompt(6 + 3 * i, seed=70 + i) for i in range(4)]
    max_tokens = [10, 12, 200, 8]

    async def main():
        engine = AsyncEngine(make_engine(qwen, max_streams=4, prefill_chunk_tokens=8))
        try:
            results = await asyncio.gather(
                *(
                    consume(
                        engine, f"c{i}", p, SamplingParams(max_tokens=m, **GREEDY), stop_after=3 if i == 2 else None
                    )
                    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
                )
            )
            stats = await until_idle(engine)
            return results, stats, engine.engine.runner.num_caches
        finally:
            await engine.shutdown()

    results, stats, caches = asyncio.run(main())
    for i in (0, 1, 3):
        assert tokens_of(results[i]) == reference_tokens(qwen, prompts[i], max_tokens[i])[2]
        assert results[i][-1].finished and results[i][-1].finish_reason == "length"
        assert [u.completion_tokens for u in results[i]] == list(range(1, max_tokens[i] + 1))
        assert all(u.request_id == f"c{i}" for u in results[i])
    assert len(results[2]) == 3 and not results[2][-1].finished
    # The early leaver was aborted long before its 200 tokens, and its cache is gone.
    assert stats.generation_tokens_total < 10 + 12 + 8 + 200 and caches == 0
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts)


def test_cancelled_consumer_aborts_its_request(qwen):
    async def main():
        engine = AsyncEngine(make_engine(qwen))
        try:
            first = asyncio.Event()

            async def reader():
                async for _ in engine.generate(
                    "long", random_prompt(9, seed=1), SamplingParams(max_tokens=200, **GREEDY)
                ):
                    first.set()

            task = asyncio.create_task(reader())
            await asyncio.wait_for(first.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await until_idle(engine)
            # The id is free again once the cancelled call is gone.
            again = await consume(engine, "long", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
            return stats, again
        finally:
            await engine.shutdown()

    stats, again = asyncio.run(main())
    assert 0 < stats.generation_tokens_total < 200
    assert len(tokens_of(again)) == 3 and again[-1].finish_reason == "length"


def test_failures_end_only_their_request_and_the_thread_survives(qwen, monkeypatch):
    prompts = {rid: random_prompt(8, seed=80 + i) for i, rid in enumerate(["ok", "bad"])}

    async def main():
        core = make_engine(qwen)
        forward = core.runner._forward

        def flaky(chunks):
            if any(chunk.seq.request_id.startswith("bad") and chunk.seq.output_ids for chunk in chunks):
                raise RuntimeError("simulated kernel fault")
            return forward(chunks)

        monkeypatch.setattr(core.runner, "_forward", flaky)
        engine = AsyncEngine(core)
        try:
            params = SamplingParams(max_tokens=10, **GREEDY)
            ok, bad = await asyncio.gather(
                consume(engine, "ok", prompts["ok"], params), consume(engine, "bad", prompts["bad"], params)
            )
            # A bug that makes a whole step raise fails the requests in flight, not the thread.
            step, calls = core.step, {"n": 0}

            def broken_step():
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("simulated engine bug")
                return step()

            monkeypatch.setattr(core, "step", broken_step)
            crashed = await consume(engine, "victim", prompts["ok"], params)
            monkeypatch.setattr(core, "step", step)
            after = await consume(engine, "after", prompts["ok"], params)
            await until_idle(engine)
            return ok, bad, crashed, after
        finally:
            await engine.shutdown()

    ok, bad, crashed, after = asyncio.run(main())
    expected = reference_tokens(qwen, prompts["ok"], 10)[2]
    assert tokens_of(ok) == expected and ok[-1].error is None
    assert bad[-1].finish_reason == "abort" and "simulated kernel fault" in bad[-1].error
    assert len(tokens_of(bad)) == 1  # the first token came from the prefill; the next forward failed
    assert crashed[-1].finish_reason == "abort" and "simulated engine bug" in crashed[-1].error
    assert tokens_of(crashed) == expected[: len(tokens_of(crashed))]
    assert tokens_of(after) == expected


def test_bad_requests_raise_on_first_iteration_and_shutdown_aborts(qwen):
    async def main():
        engine = AsyncEngine(make_engine(qwen, max_model_len=300))
        params = SamplingParams(max_tokens=5, **GREEDY)
        with pytest.raises(ConfigError, match="prompt has 300 tokens but max_model_len is 300"):
            await anext(engine.generate("too-long", random_prompt(300, seed=0), params))
        running = engine.generate("r", random_prompt(5, seed=0), SamplingParams(max_tokens=250, **GREEDY))
        first = await anext(running)
        with pytest.raises(ValueError, match="already in flight"):
            await anext(engine.generate("r", [1, 2], params))
        await engine.shutdown()
        rest = [u async for u in running]
        with pytest.raises(RuntimeError, match="shut down"):
            await anext(engine.generate("late", [1, 2], params))
        return first, rest, engine

    first, rest, engine = asyncio.run(main())
    assert not first.finished and len(first.new_token_ids) == 1
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and "shut down" in rest[-1].error
    assert len(tokens_of([first, *rest])) < 250
    assert not engine._thread.is_alive() and not engine.engine.has_work()
    assert engine.engine.stats().kv_tokens_used == 0 and engine.engine.runner.num_caches == 0
