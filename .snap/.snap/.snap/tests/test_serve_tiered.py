"""Serving with tiered experts: ``gpu_memory`` small enough that most expert uses miss must not change the
greedy completion (server, LLM and CLI), ``/metrics`` exports the tier counters, and the plan's prefill
chunk is the one the engine runs."""

import asyncio
import logging
import re

import httpx
import pytest
import torch
from reference import save_tiny
from server_harness import LiveServer
from test_qwen3_moe import tiny_qwen3_config
from tiny_tokenizer import write_test_tokenizer

from moetier import cli
from moetier.errors import ConfigError
from moetier.server.app import ServeConfig, load_serving_model
from moetier.tiers.plan import PlanBudget, TierOptions, make_plan

CONTEXT, STREAMS, SLOTS = 256, 2, 1
PROMPT = "Mixture-of-Experts models route each token to the top experts of every layer."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-serve-tiered")
    save_tiny(tiny_qwen3_config(), path)
    write_test_tokenizer(path, vocab_size=320)
    return path


def budget_for(checkpoint, slots: int, streams: int) -> int:
    """A GPU budget that leaves room for exactly ``slots`` cached experts of 24 (the engine also reserves
    its default prefix-cache memory, so that is part of the budget) with 512-token prefill chunks."""
    from moetier.engine.engine import EngineConfig

    prefix = EngineConfig().prefix_cache_bytes
    budget = PlanBudget("3GiB", context=CONTEXT, max_streams=streams, prefill_chunk_tokens=512)
    roomy = make_plan(checkpoint, budget, torch.float32)
    fixed = roomy.backbone_bytes + roomy.kv_bytes + roomy.workspace_bytes + roomy.staging_bytes
    return fixed + prefix + slots * roomy.expert_block_bytes


@pytest.fixture(scope="module")
def budget(checkpoint) -> int:
    return budget_for(checkpoint, SLOTS, STREAMS)  # ~4% of the experts


def _serve(checkpoint, tiers=None) -> LiveServer:
    config = ServeConfig(
        model=str(checkpoint), device="cpu", dtype="fp32", max_streams=STREAMS, context=CONTEXT, tiers=tiers
    )
    return LiveServer(config).start()


def _complete(server: LiveServer) -> dict:
    body = {"model": str(server.config.model), "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    response = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_tiered_server_matches_resident_and_exports_tier_metrics(checkpoint, budget):
    resident = _serve(checkpoint)
    try:
        expected = _complete(resident)
        resident_metrics = httpx.get(resident.base + "/metrics").text
    finally:
        resident.stop()
    assert "moetier:tier_hit_rate" not in resident_metrics  # all resident: no tier series

    tiered = _serve(checkpoint, TierOptions(budget, policy="lfu", miss_route="auto", cpu_threads=1))
    try:
        engine = tiered.state.model.engine.engine
        assert engine.plan.cache_slots == SLOTS and engine.model.dispatcher.cache.n_slots == SLOTS
        got = _complete(tiered)
        metrics = engine.model.dispatcher.metrics
        text = httpx.get(tiered.base + "/metrics").text
    finally:
        tiered.stop()
    completion = expected["choices"][0]["text"]
    assert completion.strip() and got["choices"][0]["text"] == completion
    assert got["usage"] == expected["usage"]
    total = metrics.total()
    miss_rate = total.uses_miss / (total.uses_hit + total.uses_miss)
    print(f"\ntiered server: miss rate {miss_rate:.3f}, {metrics.tokens} tokens, cpu pairs {total.cpu_pairs}")
    assert miss_rate > 0.7
    assert total.cpu_pairs > 0 and total.copy_bytes > 0  # auto split both routes (fixed costs on CPU)
    assert _metric(text, "moetier:tier_hit_rate") == pytest.approx(1 - miss_rate)
    assert _metric(text, "moetier:tier_expert_uses_miss_total") == total.uses_miss
    assert _metric(text, "moetier:tier_copy_bytes_total") == total.copy_bytes
    assert _metric(text, "moetier:tier_cpu_jobs_marked_total") == total.cpu_jobs_marked
    assert _metric(text, "moetier:tier_cpu_threads_joined_total") == total.cpu_threads_joined
    assert _metric(text, "moetier:tier_misses_per_token") == pytest.approx(total.uses_miss / metrics.tokens)
    layer_rates = {layer: c["hit_rate"] for layer, c in metrics.snapshot()["per_layer"].items()}
    assert sorted(layer_rates) == ["0", "2", "3"]  # layer 1 is dense
    for layer, rate in layer_rates.items():
        assert _metric(text, "moetier:tier_layer_hit_rate", layer=layer) == pytest.approx(rate)
    assert len(re.findall(r"^moetier:tier_layer_cpu_seconds_total\{", text, re.M)) == 3


def test_llm_and_cli_generate_with_gpu_memory(checkpoint, budget, capsys):
    from moetier import LLM, SamplingParams
    from moetier.engine.engine import EngineConfig

    params = SamplingParams(max_tokens=16, temperature=0)
    resident = LLM(checkpoint, device="cpu", dtype="fp32", max_model_len=CONTEXT, load_progress=False)
    expected = resident.generate(PROMPT, params)[0].outputs[0].text
    tiered = LLM(
        checkpoint,
        device="cpu",
        dtype="fp32",
        max_model_len=CONTEXT,
        load_progress=False,
        engine_config=EngineConfig(max_streams=STREAMS),
        gpu_memory=budget,
        miss_route="cpu",
    )
    assert tiered.plan.cache_slots == SLOTS
    assert tiered.generate(PROMPT, params)[0].outputs[0].text == expected
    args = ["generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0"]
    args += ["--device", "cpu", "--dtype", "fp32", "--max-model-len", str(CONTEXT)]
    args += ["--gpu-memory", str(budget_for(checkpoint, 3, streams=4))]  # generate decodes 4 streams by default
    args += ["--prefill-chunk", "512"]  # the budget's chunk (auto would trade those 3 slots for a bigger one)
    assert cli.main([*args, "--miss-route", "copy", "--expert-policy", "lru"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert cli.main([*args[:-3], "12XB"]) == 2
    assert "unknown unit 'XB'" in capsys.readouterr().err


def _engine_of(config: ServeConfig):
    """The engine ``moetier serve`` would run for ``config`` (loaded, then its thread stopped)."""
    model = load_serving_model(config)
    asyncio.run(model.engine.shutdown())
    return model.engine.engine


def test_serve_runs_the_plans_prefill_chunk(checkpoint, caplog):
    base = {"model": str(checkpoint), "device": "cpu", "dtype": "fp32", "context": CONTEXT, "max_streams": 4}
    tiers = TierOptions("3GiB", miss_route="cpu", cpu_threads=1)  # every expert fits: spare room is free
    with caplog.at_level(logging.INFO, logger="moetier.server"):
        engine = _engine_of(ServeConfig(**base, tiers=tiers))
    # 4 streams x 256 tokens: at most 1024 prompt tokens in flight, so the plan stops there.
    assert engine.plan.prefill_chunk_tokens == 1024
    assert engine.config.prefill_chunk_tokens == engine.scheduler.prefill_chunk_tokens == 1024
    assert "prefill chunk: 1024 tokens (placement plan, auto: workspace" in caplog.text
    assert "prefill chunk: 1024 tokens (auto: workspace" in engine.plan.table()  # the table the engine logs

    given = _engine_of(ServeConfig(**base, tiers=tiers, prefill_chunk_tokens=96))
    assert given.plan.prefill_chunk_tokens == given.scheduler.prefill_chunk_tokens == 96
    assert given.plan.workspace_bytes < engine.plan.workspace_bytes  # sized for the given chunk
    resident = _engine_of(ServeConfig(**base))
    assert resident.plan is None and resident.scheduler.prefill_chunk_tokens == 512
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        ServeConfig(**base, prefill_chunk_tokens=0)


def test_llm_runs_the_plans_prefill_chunk_unless_given(checkpoint):
    from moetier import LLM
    from moetier.engine.engine import EngineConfig

    common = {"device": "cpu", "dtype": "fp32", "max_model_len": CONTEXT, "load_progress": False}
    common |= {"engine_config": EngineConfig(max_streams=4), "gpu_memory": "3GiB", "skip_tokenizer_init": True}
    auto = LLM(checkpoint, **common)
    assert auto.plan.prefill_chunk_tokens == auto.engine.scheduler.prefill_chunk_tokens == 1024
    given = LLM(checkpoint, **common, prefill_chunk_tokens=200)
    assert given.plan.prefill_chunk_tokens == given.engine.scheduler.prefill_chunk_tokens == 200


def test_cli_passes_prefill_chunk_to_serve_and_generate(monkeypatch):
    import moetier.llm
    import moetier.server.app

    seen = {}

    def fake_serve(config: ServeConfig) -> int:
        seen["serve"] = config
        return 0

    def fake_llm(*args, **kwargs):
        seen["generate"] = kwargs
        raise ConfigError("stop before loading")

    monkeypatch.setattr(moetier.server.app, "serve", fake_serve)
    monkeypatch.setattr(moetier.llm, "LLM", fake_llm)
    assert cli.main(["serve", "--gpu-memory", "1GiB", "--prefill-chunk", "4096"]) == 0
    assert seen.pop("serve").prefill_chunk_tokens == 4096
    assert cli.main(["serve", "--gpu-memory", "1GiB"]) == 0
    assert seen.pop("serve").prefill_chunk_tokens is None  # auto: the plan decides
    assert cli.main(["generate", "--model", "m", "--prompt", "p", "--prefill-chunk", "2048"]) == 2
    assert seen["generate"]["prefill_chunk_tokens"] == 2048


def test_engine_streams_long_prompts_and_gives_the_cache_back(checkpoint):
    """Prompts long enough for streaming calls, chunked by the engine and decoded together: the same greedy
    tokens as all-resident, the ring (with lent cache slots) and prefetch used, the cache back after."""
    from moetier import LLM, SamplingParams
    from moetier.engine.engine import EngineConfig

    generator = torch.Generator().manual_seed(21)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=generator).tolist()} for n in (150, 97)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    resident = LLM(checkpoint, device="cpu", dtype="fp32", max_model_len=CONTEXT, load_progress=False)
    expected = [o.outputs[0].token_ids for o in resident.generate(prompts, params)]
    tiered = LLM(
        checkpoint,
        device="cpu",
        dtype="fp32",
        max_model_len=CONTEXT,
        load_progress=False,
        engine_config=EngineConfig(max_streams=STREAMS, prefill_chunk_tokens=64),
        gpu_memory=budget_for(checkpoint, 4, STREAMS) - _workspace_saved(checkpoint, 64),
        prefill_chunk_tokens=64,
    )
    assert tiered.plan.cache_slots == 4
    dispatcher = tiered.model.dispatcher
    assert [o.outputs[0].token_ids for o in tiered.generate(prompts, params)] == expected
    totals = dispatcher.metrics.snapshot()["totals"]
    assert totals["prefetch_used"] > 0 and totals["copy_pairs"] > 0  # streaming calls ran
    assert dispatcher.cache.lent == 0 and dispatcher.cache.n_slots == 4  # decode took the lent slots back


def _workspace_saved(checkpoint, chunk: int) -> int:
    """Workspace bytes a ``chunk``-token prefill needs less than the 512-token one ``budget_for`` assumes."""
    plans = [
        make_plan(checkpoint, PlanBudget("3GiB", context=CONTEXT, max_streams=STREAMS, prefill_chunk_tokens=n))
        for n in (512, chunk)
    ]
    return plans[0].workspace_bytes - plans[1].workspace_bytes
