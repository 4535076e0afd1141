"""fp8 KV cache (``kv_dtype="fp8"``): storage round trip, logits against model-dtype KV, snapshots, plumbing.

Measured on the tiny fp32 checkpoints (48-token prompt + 16 greedy steps, teacher-forced on the
fp32-KV tokens; 64 predicted positions), fp8 KV vs fp32 KV, relative logit error / top-1 agreement:
Qwen3-MoE 2.4e-2 / 0.97, DeepSeek-V3 1.1e-2 / 0.98, DeepSeek-V4 1.2e-1 / 0.89 (over 5 prompts:
1.4-2.4e-2, 0.9-1.4e-2, 0.6-1.6e-1; top-1 >= 0.95, >= 0.95, >= 0.89). The tiny random V4 amplifies
KV rounding far more than the others (its indexer's top-4 selection flips; finer scale groups do not
help), so its bounds are looser. Round trip of the storage itself: <= 2^-4 relative per element in
e4m3's normal range (half its 3-bit mantissa step).
"""

import pytest
import torch
from reference import relative_error, save_tiny
from test_deepseek_v3 import tiny_v3_config
from test_deepseek_v4 import save_tiny_v4
from test_qwen3_moe import tiny_qwen3_config

from moetier import cli
from moetier.config import ModelLoadConfig
from moetier.engine.engine import Engine, EngineConfig
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError
from moetier.llm import LLM
from moetier.models.cache import FP8_DTYPE, ContiguousKVCache, KVRows, kv_storage_dtype
from moetier.server.app import ServeConfig
from moetier.tiers.plan import PlanBudget, make_plan
from moetier.weights.loader import load_model

PROMPT, STEPS = 48, 16
# family -> (max relative logit error, min top-1 agreement) of fp8 vs fp32 KV; measured values in the docstring.
BOUNDS = {"qwen3_moe": (0.05, 0.9), "deepseek_v3": (0.03, 0.9), "deepseek_v4": (0.25, 0.8)}


def _save(family: str, path) -> None:
    if family == "deepseek_v4":
        save_tiny_v4(path, torch.float32)
    else:
        save_tiny(tiny_v3_config() if family == "deepseek_v3" else tiny_qwen3_config(), path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    built = {}

    def get(family):
        if family not in built:
            built[family] = tmp_path_factory.mktemp(family)
            _save(family, built[family])
        return built[family]

    return get


@pytest.fixture(scope="module", params=list(BOUNDS))
def family_model(request, paths):
    loaded = load_model(paths(request.param), ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    return request.param, loaded.model


def _vocab(model) -> int:
    return (model.embed_tokens if hasattr(model, "embed_tokens") else model.embed).num_embeddings


def _fp8_stores(cache) -> list[KVRows]:
    """Every KVRows of a cache (any family)."""
    if hasattr(cache, "keys"):
        return cache.keys + cache.values
    if hasattr(cache, "latents"):
        return cache.latents
    return [s.entries for layer in cache.layers for s in (layer.compressor, layer.indexer) if s is not None]


@torch.no_grad()
def _decode(model, kv_dtype, prompt, tokens=None) -> tuple[torch.Tensor, list[int]]:
    """Logits of the 64 predicted positions (prefill rows, then one per decode step) and the tokens fed:
    greedy, or ``tokens`` (teacher forcing, so both KV dtypes see the same sequence)."""
    cache = model.new_cache(PROMPT + STEPS + 1, kv_dtype=kv_dtype)
    prefill = model.compute_logits(model(prompt, cache))
    rows, fed = [prefill[-1]], []
    for step in range(STEPS):
        token = int(rows[-1].argmax()) if tokens is None else tokens[step]
        fed.append(token)
        rows.append(model.compute_logits(model(torch.tensor([token]), cache))[-1])
    if kv_dtype == "fp8":
        assert all(store.data.dtype == FP8_DTYPE and store.scales is not None for store in _fp8_stores(cache))
    return torch.cat([prefill[:-1], torch.stack(rows)]), fed


def test_fp8_logits_stay_close_to_model_dtype_kv(family_model):
    family, model = family_model
    prompt = torch.randint(0, _vocab(model), (PROMPT,), generator=torch.Generator().manual_seed(0))
    reference, tokens = _decode(model, None, prompt)
    fp8, _ = _decode(model, "fp8", prompt, tokens)
    error = relative_error(fp8, reference)
    agreement = float((fp8.argmax(-1) == reference.argmax(-1)).float().mean())
    print(f"{family}: fp8 KV relative logit error {error:.3e}, top-1 agreement {agreement:.3f}")
    max_error, min_agreement = BOUNDS[family]
    assert 1e-4 < error < max_error  # the lower bound: the cache really quantised
    assert agreement >= min_agreement


@torch.no_grad()
def test_fp8_snapshot_resumes_exactly_like_the_original(family_model):
    _, model = family_model
    ids = torch.randint(0, _vocab(model), (PROMPT + 4,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(64, kv_dtype="fp8")
    model(ids[:32], cache)
    cache.mark()  # V4 snapshots only where it stands or at a mark; plain KV ignores marks
    original = [model.compute_logits(model(ids[32:PROMPT], cache))]
    original += [model.compute_logits(model(ids[t : t + 1], cache)) for t in range(PROMPT, PROMPT + 4)]

    snapshot = cache.snapshot(32)
    assert all(store.scales is not None for store in _fp8_stores(snapshot))
    resumed = snapshot.clone_into(64)
    again = [model.compute_logits(model(ids[32:PROMPT], resumed))]
    again += [model.compute_logits(model(ids[t : t + 1], resumed)) for t in range(PROMPT, PROMPT + 4)]
    for ours, theirs in zip(again, original, strict=True):
        assert torch.equal(ours, theirs)
    fp32 = model.new_cache(64)
    model(ids[:32], fp32)
    assert snapshot.nbytes < fp32.snapshot(32).nbytes  # fp8 snapshots are smaller than fp32 ones


def test_fp8_round_trip_error_per_element():
    generator = torch.Generator().manual_seed(2)
    # Rows over six decades of magnitude (each token has its own scale), a zero row, and a group
    # 100x larger than its neighbour (MLA's rope key next to its latent): each gets its own scale.
    x = torch.randn(2, 40, 64, generator=generator) * 10 ** torch.empty(2, 40, 1).uniform_(-3, 3, generator=generator)
    x[:, 7] = 0
    x[..., 48:] *= 100
    store = KVRows((2,), 48, 64, torch.float32, "cpu", "fp8", groups=(48, 16))
    store.write(0, x)
    assert store.data.dtype == FP8_DTYPE and store.scales.shape == (2, 48, 2)
    back = store.read(40)
    assert torch.equal(back[:, 7], torch.zeros(2, 64))

    scale = torch.cat([store.scales[:, :40, :1].expand(-1, -1, 48), store.scales[:, :40, 1:].expand(-1, -1, 16)], -1)
    normal = x.abs() / scale >= 2**-6  # e4m3 normal range; below it the step is fixed: 2^-9 * scale
    relative = ((back - x).abs() / x.abs())[normal]
    print(f"round trip: max {relative.max():.4f}, mean {relative.mean():.4f} relative (normal range)")
    assert relative.max() <= 2**-4 * (1 + 1e-6)
    assert ((back - x).abs() <= 2**-10 * scale * (1 + 1e-6))[~normal].all()
    assert relative.mean() > 2**-8  # it was really rounded to 3 mantissa bits

    bf16 = KVRows((2,), 48, 64, torch.float32, "cpu", "bf16")
    bf16.write(0, x)
    assert bf16.data.dtype == torch.bfloat16 and bf16.read(40).dtype == torch.float32
    assert relative_error(bf16.read(40), x) < 2**-8


def test_fp8_cache_memory_and_validation():
    fp8 = ContiguousKVCache(2, 4, 64, 128, 128, torch.bfloat16, torch.device("cpu"), kv_dtype="fp8")
    bf16 = ContiguousKVCache(2, 4, 64, 128, 128, torch.bfloat16, torch.device("cpu"))
    assert fp8.nbytes == 2 * 2 * 4 * 64 * (128 + 4) and bf16.nbytes == 2 * 2 * 4 * 64 * 128 * 2
    assert fp8.kv_dtype == "fp8" and bf16.kv_dtype is None
    assert kv_storage_dtype("auto", torch.float32) == torch.float32
    for bad in ("fp16", "e4m3", ""):
        with pytest.raises(ConfigError, match="kv_dtype"):
            kv_storage_dtype(bad, torch.float32)
        with pytest.raises(ConfigError, match="kv_dtype"):
            EngineConfig(kv_dtype=bad)
        with pytest.raises(ConfigError, match="kv_dtype"):
            ServeConfig(kv_dtype=bad)
        with pytest.raises(ConfigError, match="kv-dtype"):
            PlanBudget("1GiB", kv_dtype=bad)
    assert EngineConfig(kv_dtype="fp8").cache_kv_dtype == "fp8" and EngineConfig().cache_kv_dtype is None


def test_llm_fp8_engine_with_prefix_cache_matches_a_cold_engine(paths):
    path = paths("qwen3_moe")
    config = EngineConfig(prefix_block_tokens=8)
    warm = LLM(path, device="cpu", load_progress=False, skip_tokenizer_init=True, engine_config=config, kv_dtype="fp8")
    assert warm.engine.config.kv_dtype == "fp8" and warm.engine.runner.kv_dtype == "fp8"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = torch.randint(2, 320, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    first = warm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    extended = prompt + first + [5, 6, 7]
    served = warm.generate({"prompt_token_ids": extended}, params)[0].outputs[0].token_ids
    assert warm.engine.stats().prefix_cache_hits > 0

    cold_config = EngineConfig(enable_prefix_caching=False)
    cold = LLM(
        path, device="cpu", load_progress=False, skip_tokenizer_init=True, engine_config=cold_config, kv_dtype="fp8"
    )
    assert cold.generate({"prompt_token_ids": extended}, params)[0].outputs[0].token_ids == served


def test_plan_counts_fp8_bytes_and_scales(paths):
    path = paths("qwen3_moe")
    cfg = tiny_qwen3_config()
    layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    plans = {
        kv: make_plan(path, PlanBudget("1GiB", context=128, max_streams=2, kv_dtype=kv), torch.float32)
        for kv in ("auto", "bf16", "fp8")
    }
    assert plans["auto"].kv_bytes == 2 * 128 * layers * 2 * heads * dim * 4
    assert plans["bf16"].kv_bytes == 2 * 128 * layers * 2 * heads * dim * 2
    assert plans["fp8"].kv_bytes == 2 * 128 * layers * 2 * heads * (dim + 4)
    # The estimate is what the cache really allocates.
    cache = ContiguousKVCache(layers, heads, 128, dim, dim, torch.float32, torch.device("cpu"), kv_dtype="fp8")
    assert plans["fp8"].kv_bytes == 2 * cache.nbytes
    assert plans["fp8"].cache_slots >= plans["auto"].cache_slots


def test_cli_kv_dtype_flag(paths, monkeypatch, capsys):
    import moetier.llm
    import moetier.server.app

    seen = {}

    def fake_serve(config):
        seen["serve"] = config
        return 0

    monkeypatch.setattr(moetier.server.app, "serve", fake_serve)
    assert cli.main(["serve", "--kv-dtype", "fp8"]) == 0 and seen["serve"].kv_dtype == "fp8"
    assert cli.main(["serve"]) == 0 and seen["serve"].kv_dtype == "auto"
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses the choice
        cli.main(["serve", "--kv-dtype", "fp16"])
    assert exit_info.value.code == 2

    class FakeLLM:
        def __init__(self, *args, **kwargs):
            seen["llm"] = kwargs
            raise ConfigError("stop here")

    monkeypatch.setattr(moetier.llm, "LLM", FakeLLM)
    assert cli.main(["generate", "--model", str(paths("qwen3_moe")), "--prompt", "hi", "--kv-dtype", "bf16"]) == 2
    assert seen["llm"]["kv_dtype"] == "bf16"

    # The server hands the flag to the engine's config.
    def fake_from_path(path, **kwargs):
        seen["engine"] = kwargs["config"]
        raise ConfigError("stop here")

    monkeypatch.setattr(Engine, "from_path", staticmethod(fake_from_path))
    with pytest.raises(ConfigError, match="stop here"):
        moetier.server.app.load_serving_model(ServeConfig(model=str(paths("qwen3_moe")), kv_dtype="fp8"))
    assert seen["engine"].kv_dtype == "fp8"
    capsys.readouterr()
