"""The start-up warm-up: it runs every batch size on throwaway caches and leaves no trace in serving."""

import pytest
import torch
from test_engine import make_engine, random_prompt, run

from moetier.cli import build_parser
from moetier.config import ModelLoadConfig
from moetier.engine.sampling import SamplingParams
from moetier.engine.warmup import warm_up
from moetier.errors import ConfigError
from moetier.server.app import ServeConfig
from moetier.tiers.host_store import HostExpertArena
from moetier.weights.loader import load_model


def _greedy(loaded, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    engine = make_engine(loaded, tokenizer=None, max_streams=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    updates = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return {rid: [t for u in ups for t in u.new_token_ids] for rid, ups in updates.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_warm_up_runs_every_batch_size_and_changes_no_output(families, family):
    loaded, vocab = families(family)
    prompts = [random_prompt(9 + i, seed=i, vocab=vocab) for i in range(3)]
    before = _greedy(loaded, prompts)
    calls = []
    forward = loaded.model.forward

    def counting(ids, caches, seq_lens=None):
        calls.append((len(caches), ids.shape[0]))
        return forward(ids, caches, seq_lens)

    loaded.model.forward = counting
    try:
        report = warm_up(loaded.model, [3, 1, 2, 2], vocab, prompt_tokens=5, decode_steps=2)
    finally:
        del loaded.model.forward
    assert report.batch_sizes == [1, 2, 3] and report.decode_steps == 2 and report.seconds > 0
    # Per size: one prefill of 5 tokens per sequence, then 2 one-token steps per sequence.
    assert calls == [(b, n) for b in (1, 2, 3) for n in (5 * b, b, b)]
    # CPU: decode segments run eagerly, nothing is captured; a family without decode graphs reports None.
    assert report.graphs_captured == (0 if hasattr(loaded.model, "graphs") else None)
    assert "batch sizes 1,2,3" in report.describe()
    assert _greedy(loaded, prompts) == before


def test_warm_up_resets_the_tiered_counters_and_keeps_outputs(families, tmp_path):
    resident, vocab = families("deepseek_v4")
    path = resident.checkpoint.path
    arena = HostExpertArena.for_checkpoint(path, torch.float32, progress=False)
    tiered = load_model(
        path,
        ModelLoadConfig(dtype=torch.float32, device="cpu"),
        dispatcher="tiered",
        expert_allocator=arena,
        dispatcher_options={"cache_slots": 2, "miss_route": "auto"},
        progress=False,
    )
    prompts = [random_prompt(7, seed=5, vocab=vocab), random_prompt(11, seed=6, vocab=vocab)]
    warm_up(tiered.model, [1, 2], vocab, prompt_tokens=4, decode_steps=3)
    metrics = tiered.model.dispatcher.metrics
    assert metrics.tokens == 0 and metrics.total().calls == 0
    assert _greedy(tiered, prompts) == _greedy(resident, prompts)
    tiered.model.dispatcher.close()


def test_warm_up_refuses_nonsense_and_the_server_can_skip_it(families):
    loaded, vocab = families("qwen3_moe")
    for sizes, tokens, steps in (([], 4, 1), ([0], 4, 1), ([1], 0, 1), ([1], 4, 0)):
        with pytest.raises(ConfigError, match="warm-up needs"):
            warm_up(loaded.model, sizes, vocab, prompt_tokens=tokens, decode_steps=steps)
    args = build_parser().parse_args(["serve", "--no-warmup"])
    assert args.warmup is False and build_parser().parse_args(["serve"]).warmup is True
    assert ServeConfig(warmup=False).warmup is False
    with pytest.raises(ConfigError, match="warmup"):
        ServeConfig(warmup="yes")
