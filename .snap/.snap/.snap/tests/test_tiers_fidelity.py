"""Tiered experts must not change the math: tiered decoding against the all-resident path.

Each family's tiny checkpoint is loaded twice, resident and tiered with a VRAM cache of ~1/12 of
the experts (the test asserts that > 70% of expert uses miss). In fp32 the greedy tokens must be
identical and every step's logits within 1e-5 relative; in bf16 the tiered logits are compared
step by step on the resident's own tokens (teacher forcing: greedy paths of a random tiny model
fork at near-ties) against a tolerance set by bf16's own error. The CPU tier alone is checked
against the resident kernel in bf16 (relative RMS < 0.005, as the seed's 0.0037).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
from reference import moetier_run, relative_error, save_tiny
from test_qwen3_moe import tiny_qwen3_config

from moetier.config import ModelLoadConfig
from moetier.errors import ConfigError
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator, swiglu_expert
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.policies import save_routing_stats
from moetier.tiers.tiered_dispatcher import TieredDispatcher
from moetier.weights.loader import load_model

PROMPT_LEN, STEPS = 48, 64
FP32_REL = 1e-5
# bf16, tiered vs resident (measured on the tiny models: median step 4.4e-3 to 1.5e-2, prefill 4.6e-3
# to 2.4e-2; bf16 resident vs fp32 on the same tokens: median 6.6e-3 to 4.0e-2).
BF16_STEP_MEDIAN = 3e-2
BF16_PREFILL = 5e-2


def _families() -> list:
    """Savers of each family's tiny checkpoint: Qwen3-MoE, plus DeepSeek-V3/V4 where their tests exist."""
    found = [pytest.param(lambda path: save_tiny(tiny_qwen3_config(), path), id="qwen3_moe")]
    try:
        v3 = importlib.import_module("test_deepseek_v3")
        v3_config = v3.tiny_v3_config(**v3.VARIANTS["q_lora"])  # 16 experts in 3 MoE layers, grouped top-3
        found.append(pytest.param(lambda path: save_tiny(v3_config, path), id="deepseek_v3"))
    except (ImportError, AttributeError, KeyError):
        pass  # family not written yet: nothing to compare
    try:
        v4 = importlib.import_module("test_deepseek_v4")
        found.append(pytest.param(lambda path: v4.save_tiny_v4(path, torch.float32), id="deepseek_v4"))
    except (ImportError, AttributeError):
        pass
    return found


def _record(name: str, payload: dict) -> None:
    print("\n" + name, json.dumps(payload))
    out = os.environ.get("MOETIER_RESULTS")
    if out:
        with open(os.path.join(out, "tiers_fidelity.jsonl"), "a") as fh:
            fh.write(json.dumps({"test": name, **payload}) + "\n")


@pytest.fixture(scope="module", params=_families())
def family(request, tmp_path_factory):
    """(checkpoint path, prompt, resident fp32 greedy run) for one family."""
    path = tmp_path_factory.mktemp("ckpt")
    request.param(path)
    config = json.loads((path / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    resident = load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    return path, prompt, moetier_run(resident, prompt, STEPS), resident


def load_tiered(path, dtype, device="cpu", **options):
    arena = HostExpertArena.for_checkpoint(path, dtype, progress=False)
    loaded = load_model(
        path,
        ModelLoadConfig(dtype=dtype, device=device),
        dispatcher="tiered",
        expert_allocator=arena,
        dispatcher_options=options,
        progress=False,
    )
    return loaded, arena


def small_cache(loaded) -> int:
    """~4% of the experts (the seed's VRAM mirror holds ~4.6%): greedy decoding of a random tiny
    model loops over few tokens, so a larger static set would serve most uses from the cache."""
    layout = loaded.store.layout
    return max(1, len(layout.moe_layers) * layout.num_experts // 24)


@torch.no_grad()
def forced_logits(loaded, prompt: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill logits, then the logits of each decode step fed ``tokens`` (not its own argmax)."""
    model = loaded.model
    cache = model.new_cache(prompt.shape[0] + len(tokens) + 1)
    prefill = model.compute_logits(model(prompt.to(model.device), cache)).cpu()
    steps = [model.compute_logits(model(torch.tensor([t], device=model.device), cache))[-1].cpu() for t in tokens]
    return prefill, steps


@pytest.mark.parametrize(("route", "policy"), [("cpu", "lru"), ("copy", "lfu"), ("auto", "static"), ("mapped", "lfu")])
def test_tiered_fp32_decode_matches_resident(family, tmp_path, route, policy):
    path, prompt, (ref_prefill, ref_steps, ref_tokens), resident = family
    options: dict = {"miss_route": route, "policy": policy}
    if policy == "static":
        # Routing statistics recorded by a tiered prefill pass: the static set is the hottest experts.
        probe, _ = load_tiered(path, torch.float32, cache_slots=0, miss_route="cpu")
        moetier_run(probe, prompt, 0)
        save_routing_stats(probe.model.dispatcher.metrics.routing_counts(), tmp_path / "routing.json")
        probe.model.dispatcher.close()
        options["policy_options"] = {"stats_path": str(tmp_path / "routing.json")}
    layout = resident.store.layout
    slots = small_cache(resident)
    loaded, arena = load_tiered(path, torch.float32, cache_slots=slots, **options)
    dispatcher: TieredDispatcher = loaded.model.dispatcher
    prefill, steps, tokens = moetier_run(loaded, prompt, STEPS)
    dispatcher.close()
    dispatcher.flush_metrics()
    snap = dispatcher.metrics.snapshot()
    errors = [relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)]
    _record(
        f"fp32-{route}-{policy}",
        {
            "slots": slots,
            "experts": len(layout.moe_layers) * layout.num_experts,
            "miss_rate": 1 - snap["hit_rate"],
            "misses_per_token": snap["misses_per_token"],
            "prefill_rel": relative_error(prefill, ref_prefill),
            "step_rel_max": max(errors),
            "cpu_pairs": snap["totals"]["cpu_pairs"],
            "copy_pairs": snap["totals"]["copy_pairs"],
            "admissions": snap["totals"]["admissions"],
        },
    )
    assert 1 - snap["hit_rate"] > 0.7
    assert tokens == ref_tokens
    assert relative_error(prefill, ref_prefill) < FP32_REL
    assert max(errors) < FP32_REL
    # Every route that should have run did, and the home copy really is the arena.
    totals = snap["totals"]
    assert (totals["cpu_pairs"] > 0) == (route in ("cpu", "auto"))
    assert (totals["copy_pairs"] > 0) == (route in ("copy", "auto"))
    assert (totals["mapped_pairs"] > 0) == (route == "mapped")
    assert totals["uses_miss"] == totals["cpu_pairs"] + totals["copy_pairs"] + totals["mapped_pairs"]
    assert arena.used_bytes == loaded.store.total_bytes()
    if policy == "static":
        assert totals["admissions"] == 0 and set(dispatcher.cache.resident()) == set(dispatcher.policy.preferred(slots))
    else:
        assert totals["admissions"] > 0 and len(dispatcher.cache.resident()) == slots


def test_tiered_bf16_stays_within_bf16_noise(family):
    path, prompt, _, _ = family
    check_bf16(path, prompt, "cpu")


def check_bf16(path, prompt: torch.Tensor, device: str) -> None:
    """Tiered bf16 (auto split, LFU) against resident bf16 on the resident's tokens, with fp32 as the yardstick."""
    resident = load_model(path, ModelLoadConfig(dtype=torch.bfloat16, device=device), progress=False)
    ref_prefill, ref_steps, ref_tokens = moetier_run(resident, prompt, STEPS)
    loaded, _ = load_tiered(
        path, torch.bfloat16, device, cache_slots=small_cache(resident), miss_route="auto", policy="lfu"
    )
    prefill, steps = forced_logits(loaded, prompt, ref_tokens)
    loaded.model.dispatcher.close()
    exact = load_model(path, ModelLoadConfig(dtype=torch.float32, device=device), progress=False)
    exact_prefill, exact_steps = forced_logits(exact, prompt, ref_tokens)
    errors = [relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)]
    noise = [relative_error(a, b) for a, b in zip(ref_steps, exact_steps, strict=True)]
    same_top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(steps, ref_steps, strict=True)) / STEPS
    bf16_top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(ref_steps, exact_steps, strict=True)) / STEPS
    snap = loaded.model.dispatcher.metrics.snapshot()
    _record(
        f"{device}-bf16-auto-lfu",
        {
            "miss_rate": 1 - snap["hit_rate"],
            "prefill_rel": relative_error(prefill, ref_prefill),
            "prefill_bf16_vs_fp32": relative_error(ref_prefill, exact_prefill),
            "prefill_tiered_vs_fp32": relative_error(prefill, exact_prefill),
            "step_rel_max": max(errors),
            "step_rel_median": sorted(errors)[STEPS // 2],
            "step_rel_mean": sum(errors) / STEPS,
            "bf16_vs_fp32_median": sorted(noise)[STEPS // 2],
            "bf16_vs_fp32_mean": sum(noise) / STEPS,
            "bf16_vs_fp32_max": max(noise),
            "same_top1": same_top1,
            "bf16_vs_fp32_top1": bf16_top1,
        },
    )
    assert 1 - snap["hit_rate"] > 0.7
    # Offload must cost less than bf16 itself does (per-step logits against fp32), typically and on
    # average. The max is not bounded this tightly: a near-tie in a router flips an expert choice in
    # bf16 whichever path runs (the same step shows it against fp32).
    assert sorted(errors)[STEPS // 2] < min(sorted(noise)[STEPS // 2], BF16_STEP_MEDIAN)
    assert sum(errors) / STEPS < sum(noise) / STEPS
    # The CPU tier's C kernel rounds like the device but sums in another order: two bf16 runs, each its
    # own distance from fp32, may then differ by more than either (on the tiny V4 a router near-tie in the
    # 48-token prompt moves the C-kernel-only run to 0.053 from fp32, the mixed CPU/copy run to 0.106,
    # the resident run sits at 0.059). So the tiered prefill is held to the resident one within
    # BF16_PREFILL, or to bf16's own order of error: at most twice the resident run's distance from fp32.
    near_resident = relative_error(prefill, ref_prefill) < BF16_PREFILL
    assert near_resident or relative_error(prefill, exact_prefill) < 2 * relative_error(ref_prefill, exact_prefill)
    # Top-1 flips: on CUDA the split follows measured timings, so which experts run on the C kernel (its own
    # sum order) varies by run; on the tiny V4 the agreement ranged 0.89-1.0 over nine runs. Offload may flip
    # the argmax no more often than bf16 itself flips it against fp32, or in at most 1 step of 10.
    assert same_top1 >= min(0.9, bf16_top1)


def _random_store(layout: ExpertLayout, dtype: torch.dtype, seed: int = 0) -> ExpertStore:
    store = ExpertStore(layout, dtype, device_allocator("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            block = store.block_for_loading(layer, expert).block
            block.copy_(torch.randn(block.shape, generator=generator) * layout.hidden_size**-0.5)
    return store


def _routing(
    tokens: int, layout: ExpertLayout, generator, dtype, skew: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states and top-k routing; ``skew`` favours low expert ids (so a cache gets hits)."""
    hidden = torch.randn(tokens, layout.hidden_size, generator=generator).to(dtype)
    scores = torch.rand(tokens, layout.num_experts, generator=generator)
    scores += skew * torch.linspace(1.0, 0.0, layout.num_experts)
    weights, ids = scores.topk(layout.top_k, dim=-1)
    return hidden, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("route", ["cpu", "copy", "auto", "mapped"])
def test_dispatch_with_many_misses_per_call_matches_resident(route):
    """Prefill-sized calls: more copied experts than staging slots, evictions within one forward."""
    layout = ExpertLayout((0, 1), num_experts=8, hidden_size=32, intermediate_size=16, top_k=3, swiglu_limit=2.0)
    store = _random_store(layout, torch.float32)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=4, miss_route=route, staging_slots=1, mapped_bookkeeping_every=1)
    generator = torch.Generator().manual_seed(1)
    for tokens in (1, 7, 40, 1, 2, 1, 1):
        for layer in layout.moe_layers:
            hidden, ids, weights = _routing(tokens, layout, generator, torch.float32, skew=0.7)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            assert relative_error(ours, resident.dispatch(layer, hidden, ids, weights)) < 1e-6
    tiered.close()
    tiered.flush_metrics()
    totals, block = tiered.metrics.snapshot()["totals"], tiered.block_bytes
    assert totals["evictions"] > 0 and totals["uses_hit"] > 0
    # Every expert crosses PCIe once per miss on the copy path, once per admission on the CPU path.
    if route == "cpu":
        assert totals["copy_bytes"] == 0 and totals["admit_bytes"] == totals["admissions"] * block
    if route == "copy":
        assert totals["admit_bytes"] == 0 and totals["copy_bytes"] == totals["experts_miss"] * block
    if route == "mapped":  # no copy computes a miss: the kernels read every missed pair's block
        assert totals["copy_bytes"] == 0 and totals["admit_bytes"] == totals["admissions"] * block
        assert totals["mapped_bytes"] == totals["mapped_pairs"] * block
    assert totals["uses_miss"] == totals["cpu_pairs"] + totals["copy_pairs"] + totals["mapped_pairs"]


def test_cpu_tier_matches_resident_kernel_in_bf16():
    layout = ExpertLayout((0,), num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    store = _random_store(layout, torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    hidden, ids, weights = _routing(6, layout, generator, torch.bfloat16)
    groups = []
    for expert in ids.unique().tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        groups.append(CpuGroup(store.expert(0, expert), rows, weights[rows, slots]))
    tier = CpuExpertTier(layout.swiglu_limit, threads=1)
    result = tier.run(CpuJob(hidden=hidden, groups=groups))
    tier.close()
    resident = ResidentDispatcher(store).dispatch(0, hidden, ids, weights)
    exact = torch.zeros(hidden.shape, dtype=torch.float64)
    for expert in ids.unique().tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        block = store.expert(0, expert)
        expert64 = type(block).from_block(block.block.double(), layout)
        y = swiglu_expert(hidden[rows].double(), expert64, layout.swiglu_limit)
        exact.index_add_(0, rows, y * weights[rows, slots].double()[:, None])
    vs_resident = relative_error(result.out, resident)
    _record(
        "cpu-tier-bf16",
        {
            "rel_rms_vs_resident": vs_resident,
            "cpu_tier_vs_fp64": relative_error(result.out, exact),
            "resident_vs_fp64": relative_error(resident, exact),
            "pairs": result.pairs,
        },
    )
    assert result.pairs == ids.numel()
    assert vs_resident < 0.005
    assert relative_error(result.out, exact) <= relative_error(resident, exact) + 1e-3


def test_tiered_options_are_validated(family):
    path = family[0]
    with pytest.raises(ConfigError):
        load_tiered(path, torch.float32, miss_route="cpu")  # no cache size
    with pytest.raises(ConfigError):
        load_tiered(path, torch.float32, cache_slots=2, miss_route="pcie")
    with pytest.raises(ConfigError):
        load_tiered(path, torch.float32, cache_slots=2, cpu_share=1.5)


def test_resize_between_steps_keeps_decoding_exact(family):
    path, prompt, (_, ref_steps, ref_tokens), resident = family
    loaded, _ = load_tiered(path, torch.float32, cache_slots=small_cache(resident), miss_route="auto")
    dispatcher: TieredDispatcher = loaded.model.dispatcher
    model = loaded.model
    cache = model.new_cache(PROMPT_LEN + 9)
    with torch.no_grad():
        model(prompt, cache)
        for i, size in enumerate([0, 4, 1, 6, 2, 3, 0, 5]):
            assert dispatcher.resize_cache(size) == size
            logits = model.compute_logits(model(torch.tensor([ref_tokens[i]]), cache))[-1]
            assert relative_error(logits, ref_steps[i]) < FP32_REL
    dispatcher.close()


# --- CUDA: the real case (copy stream, events, pinned arena, CPU tier on host cores) ----------------


@pytest.mark.gpu
@pytest.mark.parametrize("saver", _families())
@pytest.mark.parametrize("route", ["cpu", "copy", "auto", "mapped"])
def test_tiered_on_cuda_matches_resident(tmp_path, saver, route):
    saver(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    load_config = ModelLoadConfig(dtype=torch.float32, device="cuda")
    resident = load_model(tmp_path, load_config, progress=False)
    ref_prefill, ref_steps, ref_tokens = moetier_run(resident, prompt, STEPS)
    arena = HostExpertArena.for_checkpoint(tmp_path, torch.float32, progress=False)
    options = {"cache_slots": small_cache(resident), "miss_route": route, "policy": "lfu" if route == "copy" else "lru"}
    loaded = load_model(
        tmp_path, load_config, dispatcher="tiered", expert_allocator=arena, dispatcher_options=options, progress=False
    )
    dispatcher: TieredDispatcher = loaded.model.dispatcher
    prefill, steps, tokens = moetier_run(loaded, prompt, STEPS)
    dispatcher.close()
    dispatcher.flush_metrics()
    snap = dispatcher.metrics.snapshot()
    errors = [relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)]
    _record(
        f"cuda-fp32-{route}",
        {
            "miss_rate": 1 - snap["hit_rate"],
            "prefill_rel": relative_error(prefill, ref_prefill),
            "step_rel_max": max(errors),
            "cpu_pairs": snap["totals"]["cpu_pairs"],
            "copy_pairs": snap["totals"]["copy_pairs"],
            "costs": vars(dispatcher.costs),
        },
    )
    assert arena.pinned
    assert 1 - snap["hit_rate"] > 0.7
    assert tokens == ref_tokens
    assert relative_error(prefill, ref_prefill) < FP32_REL
    assert max(errors) < FP32_REL
    assert (snap["totals"]["cpu_pairs"] > 0) == (route in ("cpu", "auto"))
    if route != "auto":  # on CUDA the split's chooser may also try the mapped route
        assert (snap["totals"]["mapped_pairs"] > 0) == (route == "mapped")


@pytest.mark.gpu
@pytest.mark.parametrize("saver", _families())
def test_tiered_bf16_on_cuda_stays_within_bf16_noise(tmp_path, saver):
    saver(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    check_bf16(
        tmp_path,
        torch.randint(0, config["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)),
        "cuda",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cpu", "copy", "auto", "mapped"])
def test_cuda_streams_never_read_a_slot_early(route):
    """Large blocks (copies take time), one staging slot, prefill-sized calls: any missing wait shows up."""
    layout = ExpertLayout((0, 1), num_experts=16, hidden_size=1024, intermediate_size=1024, top_k=4)
    cpu_store = _random_store(layout, torch.float32)
    arena = HostExpertArena(chunk_bytes=64 << 20, progress=False)
    store = ExpertStore(layout, torch.float32, arena)
    device_store = ExpertStore(layout, torch.float32, device_allocator("cuda"))
    for key, weights in cpu_store.items():
        store.block_for_loading(*key).block.copy_(weights.block)
        device_store.block_for_loading(*key).block.copy_(weights.block)
    resident = ResidentDispatcher(device_store)
    tiered = TieredDispatcher(store, cache_slots=8, miss_route=route, staging_slots=1, cpu_share=0.5)
    generator = torch.Generator().manual_seed(4)
    worst = 0.0
    # Prefill-sized calls churn the cache; the decode calls after them hit experts whose copies were
    # enqueued on the copy stream one call earlier (a missing wait would read a half-written slot).
    for step, tokens in enumerate((64, 1, 1, 2, 1, 200, 1, 1, 3, 1, 1, 32, 1, 1, 1, 1)):
        for layer in layout.moe_layers:
            routing = _routing(tokens, layout, generator, torch.float32, skew=2.0)
            hidden, ids, weights = (t.cuda() for t in routing)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            worst = max(worst, relative_error(ours, resident.dispatch(layer, hidden, ids, weights)))
        tiered.resize_cache((8, 12, 3, 6)[step // 4])  # elastic, between steps
    tiered.close()
    totals = tiered.metrics.snapshot()["totals"]
    _record(f"cuda-streams-{route}", {"worst_rel": worst, **totals})
    assert worst < 1e-5
    assert totals["experts_hit"] >= 20 and totals["admissions"] > 0 and totals["evictions"] > 0


@pytest.mark.gpu
def test_cpu_tier_matches_gpu_kernel_in_bf16():
    layout = ExpertLayout((0,), num_experts=16, hidden_size=2048, intermediate_size=1024, top_k=6)
    store = _random_store(layout, torch.bfloat16)
    device_store = ExpertStore(layout, torch.bfloat16, device_allocator("cuda"))
    for key, weights in store.items():
        device_store.block_for_loading(*key).block.copy_(weights.block)
    hidden, ids, weights = _routing(4, layout, torch.Generator().manual_seed(5), torch.bfloat16)
    groups = []
    for expert in ids.unique().tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        groups.append(CpuGroup(store.expert(0, expert), rows, weights[rows, slots]))
    tier = CpuExpertTier(layout.swiglu_limit)
    result = tier.run(CpuJob(hidden=hidden, groups=groups))
    tier.close()
    gpu = ResidentDispatcher(device_store).dispatch(0, hidden.cuda(), ids.cuda(), weights.cuda()).cpu()
    rel = relative_error(result.out, gpu)
    _record("cuda-cpu-tier-bf16", {"rel_rms_vs_gpu_kernel": rel, "pairs": result.pairs})
    assert rel < 0.005
