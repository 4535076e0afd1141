"""The mapped route's reads ahead: the next layer's predicted experts copied into staging slots by the device.

The copy kernel (under Triton's interpreter on the CPU, and on CUDA) must choose what the reference chooses, copy
the right bytes and leave the table and picks exactly as they were once the call restores them. A model's decode
with reads ahead must give the bits of the same decode without them (the same experts, read from a copy), count
what it read ahead, and leave nothing behind at a step's end: no entry pointing at a staging slot, every slot back
in the ring, also when a step fails midway."""

from __future__ import annotations

import json

import pytest
import torch
from reference import moetier_run, relative_error
from test_device_routing import _run as run_script  # a script's JSON, in a subprocess (cpu: Triton's interpreter)
from test_mapped_cpu import LAYOUT, needs_kernel
from test_tiers_fidelity import (  # noqa: F401 - family: the fidelity tests' fixture, one checkpoint per family
    BF16_STEP_MEDIAN,
    FP32_REL,
    _random_store,
    _routing,
    family,
    forced_logits,
    load_tiered,
    small_cache,
)

from moetier.config import ModelLoadConfig
from moetier.errors import ConfigError
from moetier.kernels.ahead_copy import ahead_choice
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.tiered_config import TieredConfig
from moetier.tiers.tiered_dispatcher import TieredDispatcher
from moetier.weights.loader import load_model


def test_the_choice_is_rank_major_distinct_uncached_and_bounded():
    home = torch.arange(8, dtype=torch.int64) * 100
    table = home.clone()
    table[3] = -7  # cached: pointed at a slot
    ids = torch.tensor([[3, 5, 1], [5, 2, 6]])  # two tokens' predictions, best first
    assert ahead_choice(ids, table, home, 1) == [5]  # token 0's first choice is cached: token 1's
    assert ahead_choice(ids, table, home, 3) == [5, 2, 1]  # 5 once; then the second ranks, token by token
    assert ahead_choice(ids, table, home, 9) == [5, 2, 1, 6]
    assert ahead_choice(ids, table, home, 0) == []


def test_mapped_prefetch_is_validated():
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="mapped_prefetch"):
            TieredConfig(cache_slots=1, mapped_prefetch=bad)
    with pytest.raises(ConfigError, match="mapped_prefetch_min_tokens"):
        TieredConfig(cache_slots=1, mapped_prefetch_min_tokens=0)


@pytest.mark.parametrize("min_tokens", [None, 2])
def test_steps_of_fewer_tokens_than_the_threshold_do_not_read_ahead(min_tokens):
    """The measured default reads ahead from 4 tokens a call (at 1 and 2 streams they cost more than they save);
    any ``mapped_prefetch_min_tokens`` leaves smaller steps without."""
    tiered = _tiered(_random_store(LAYOUT, torch.float32), min_tokens=min_tokens)
    threshold = min_tokens or 4
    for tokens in (1, 2, 4):
        with tiered.decode_step(tokens, torch.float32) as variant:
            assert (variant[-1] == "ahead") == (tokens >= threshold) == tiered.wants_graph_hints
    tiered.close()


# --- the kernels ---------------------------------------------------------------------------------------------

_KERNELS = r"""
import json, torch
from moetier.kernels import ahead_copy as ac
torch.manual_seed(0)
experts, slots, block = 16, 3, 4096 + 80  # a block that no chunk divides: the masked tail
ac._STEP_WORDS = 128  # 384-word chunks: three programs a slot, the last one's tail masked
pin = DEVICE == "cuda"
arena = torch.randint(0, 255, ((experts + slots + 1) * block,), dtype=torch.uint8)
arena = arena.pin_memory() if pin else arena
vram = torch.zeros(slots * block, dtype=torch.uint8, device=DEVICE)
# The offsets' origin: on CUDA the slots' memory (as the cache's anchor is a VRAM slot), homes in pinned host memory.
anchor = vram if pin else arena
homes = [(1 + slots + e) * block for e in range(experts)]  # byte offsets into the arena
home_at = [arena.data_ptr() + h - anchor.data_ptr() for h in homes]
slot_at = [s * block for s in range(slots)] if pin else [(1 + s) * block for s in range(slots)]
home = torch.tensor(home_at, device=DEVICE)
slot_offsets = torch.tensor(slot_at, device=DEVICE)
results = []
for batch in (1, 2, 4):
    ids = torch.randint(0, experts, (batch, 6), device=DEVICE)
    table = home.clone()
    cached = torch.randperm(experts)[:4].to(DEVICE)
    table[cached] = -1000 - cached
    pick = torch.randint(0, 2, (experts,), dtype=torch.uint8, device=DEVICE)
    before_table, before_pick = table.clone(), pick.clone()
    chosen = torch.full((slots,), -1, dtype=torch.int64, device=DEVICE)
    saved = torch.zeros(slots, dtype=torch.uint8, device=DEVICE)
    ac.launch_ahead(ids, table, home, pick, slot_offsets, chosen, saved, anchor, block)
    if pin:
        torch.cuda.synchronize()
    want = ac.ahead_choice(ids.cpu(), before_table.cpu(), home.cpu(), slots)
    got = [c for c in chosen.tolist() if c >= 0]
    read = (lambda s: anchor[slot_at[s]:slot_at[s] + block].cpu())
    same_bytes = all(torch.equal(read(s), arena[homes[e]:homes[e] + block]) for s, e in enumerate(got))
    pointed = all(int(table[e]) == slot_at[s] and int(pick[e]) == 0 for s, e in enumerate(got))
    untouched = [e for e in range(experts) if e not in got]
    others = torch.equal(table[untouched].cpu(), before_table[untouched].cpu())
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ac.launch_restore(chosen, saved, table, home, pick, ids[:1], stats)
    used = sum(e in ids[:1].reshape(-1).tolist() for e in got)
    results.append({"want": want, "got": got, "bytes": same_bytes, "pointed": pointed, "others": others,
                    "table": torch.equal(table, before_table), "pick": torch.equal(pick, before_pick),
                    "stats": stats.tolist(), "stats_want": [len(got), used], "cleared": chosen.tolist()})
print(json.dumps(results))
"""


def _check_kernels(results: list[dict]) -> None:
    for r in results:
        assert r["got"] == r["want"] and r["got"], r  # the reference's choice, in slot order
        assert r["bytes"] and r["pointed"] and r["others"], r  # copied, pointed at, nothing else touched
        assert r["table"] and r["pick"] and set(r["cleared"]) == {-1}, r  # restored exactly
        assert r["stats"] == r["stats_want"], r


def test_the_copy_kernel_under_the_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    _check_kernels(run_script("cpu", _KERNELS))


@pytest.mark.gpu
def test_the_copy_kernel_reads_pinned_host_blocks_on_cuda():
    _check_kernels(run_script("cuda", _KERNELS))


# --- a model's decode ----------------------------------------------------------------------------------------


def _host_view_kept(dispatcher: TieredDispatcher) -> None:
    """After a step: every entry is home or its cache slot, the picks the host's, no slot held, nothing chosen."""
    mapped, cache = dispatcher.mapped, dispatcher.cache
    assert not dispatcher._mapped_failed  # a failure there would fall back to copies and still give right numbers
    want = list(mapped._home)
    for key, slot in mapped._pointed.items():
        want[mapped._index(key)] = slot.tensor.data_ptr() - mapped.base
    assert mapped.table.tolist() == want
    assert mapped.pick.tolist() == [int(p) for p in mapped._picks]
    assert cache.free_staging == cache.n_staging
    assert mapped.ahead is None or set(mapped.ahead.chosen.reshape(-1).tolist()) == {-1}


def test_reads_ahead_leave_a_models_decode_exact_and_are_counted(family):  # noqa: F811 - the imported fixture
    """Every family, fp32, the kernels' share alone: with and without reads ahead the same bits; with the fed CPU
    tier beside them, within fp32 noise of resident."""
    path, prompt, (_, ref_steps, ref_tokens), resident = family
    runs, totals = {}, {}
    for ahead in (2, 0):
        loaded, _ = load_tiered(path, torch.float32, cache_slots=small_cache(resident), miss_route="mapped",
                                mapped_prefetch=ahead, mapped_prefetch_min_tokens=1, policy="lfu")  # fmt: skip
        dispatcher = loaded.model.dispatcher
        checked = []
        real_end = dispatcher.mapped.end_step

        def end_step(failed=False, real=real_end, d=dispatcher, seen=checked):
            real(failed)
            _host_view_kept(d)
            seen.append(failed)

        dispatcher.mapped.end_step = end_step
        runs[ahead] = moetier_run(loaded, prompt, 16)
        dispatcher.flush_metrics()
        totals[ahead], block = dispatcher.metrics.snapshot()["totals"], dispatcher.cache.block_bytes
        dispatcher.close()
        assert checked == [False] * 16  # every decode step ended through decode_step, none failed
    assert runs[2][2] == runs[0][2] == ref_tokens[:16]
    assert all(torch.equal(a, b) for a, b in zip(runs[2][1], runs[0][1], strict=True))
    assert max(relative_error(a, b) for a, b in zip(runs[2][1], ref_steps[:16], strict=True)) < FP32_REL
    read = totals[2]["prefetch_used"] + totals[2]["prefetch_wasted"]
    assert totals[2]["prefetch_used"] > 0 and totals[2]["prefetch_bytes"] == read * block
    assert totals[0]["prefetch_used"] == totals[0]["prefetch_wasted"] == 0


@needs_kernel
def test_reads_ahead_beside_the_fed_cpu_tier_stay_within_bf16_noise(tmp_path):
    """The tiny V4 in bf16 with the fed CPU tier: an expert read ahead is the device's, not the CPU's; the decode
    stays within bf16 noise of resident and both tiers ran."""
    from test_deepseek_v4 import save_tiny_v4

    save_tiny_v4(tmp_path, torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    resident = load_model(tmp_path, ModelLoadConfig(dtype=torch.bfloat16, device="cpu"), progress=False)
    _, ref_steps, ref_tokens = moetier_run(resident, prompt, 12)
    loaded, _ = load_tiered(tmp_path, torch.bfloat16, cache_slots=2, miss_route="mapped", mapped_cpu_share=0.5,
                            mapped_prefetch=2, mapped_prefetch_min_tokens=1, policy="lfu")  # fmt: skip
    with torch.inference_mode():  # buffers made in inference mode are written outside it next
        moetier_run(loaded, prompt, 3)
    _, forced = forced_logits(loaded, prompt, ref_tokens)
    dispatcher = loaded.model.dispatcher
    dispatcher.flush_metrics()
    totals = dispatcher.metrics.snapshot()["totals"]
    _host_view_kept(dispatcher)
    dispatcher.close()
    errors = [relative_error(a, b) for a, b in zip(forced, ref_steps, strict=True)]
    assert sorted(errors)[len(errors) // 2] < BF16_STEP_MEDIAN
    assert totals["cpu_pairs"] > 0 and totals["mapped_pairs"] > 0 and totals["prefetch_used"] > 0


def _tiered(store, ahead: int = 2, min_tokens: int | None = 1) -> TieredDispatcher:
    options = {} if min_tokens is None else {"mapped_prefetch_min_tokens": min_tokens}
    tiered = TieredDispatcher(store, cache_slots=3, miss_route="mapped", mapped_cpu_share=0.0, policy="lfu",
                              mapped_admissions=1, mapped_prefetch=ahead, **options)  # fmt: skip
    tiered.prepare("cpu")
    return tiered


def _step(tiered: TieredDispatcher, calls: list[tuple], fail_at: int | None = None) -> list[torch.Tensor]:
    """A decode step as a model's segmented decode runs it, each call hinting the next layer its own ids."""
    outs = []
    layers = list(LAYOUT.moe_layers)
    with tiered.decode_step(calls[0][0].shape[0], torch.float32) as variant:
        assert variant[-1] == "ahead" and tiered.wants_graph_hints
        for i, (layer, (hidden, ids, weights)) in enumerate(zip(layers, calls, strict=True)):
            if i == fail_at:
                raise RuntimeError("the step failed")
            tiered.await_hint(layer)
            outs.append(tiered.dispatch(layer, hidden, ids, weights))
            if i + 1 < len(layers):  # a perfect prediction: every one it reads ahead is used
                tiered.hint(layers[i + 1], calls[i + 1][1])
    return outs


def test_a_step_failing_after_a_read_ahead_restores_the_table_and_the_next_steps_are_right():
    store = _random_store(LAYOUT, torch.float32)
    resident, tiered = ResidentDispatcher(store), _tiered(store)
    generator = torch.Generator().manual_seed(7)
    for step in range(8):
        calls = [_routing(2, LAYOUT, generator, torch.float32, skew=1.0) for _ in LAYOUT.moe_layers]
        if step == 3:
            with pytest.raises(RuntimeError, match="the step failed"):
                _step(tiered, calls, fail_at=1)  # layer 1 was read ahead, its call never ran
            _host_view_kept(tiered)
            continue
        outs = _step(tiered, calls)
        _host_view_kept(tiered)
        for layer, out, call in zip(LAYOUT.moe_layers, outs, calls, strict=True):
            assert relative_error(out, resident.dispatch(layer, *call)) < FP32_REL
    tiered.flush_metrics()
    totals = tiered.metrics.snapshot()["totals"]
    assert totals["prefetch_used"] > 0 and totals["prefetch_wasted"] == 0  # perfect hints: nothing wasted
    tiered.close()


def test_without_reads_ahead_a_mapped_step_asks_for_no_hints():
    tiered = _tiered(_random_store(LAYOUT, torch.float32), ahead=0)
    with tiered.decode_step(1, torch.float32) as variant:
        assert variant == ("mapped", False) and not tiered.wants_graph_hints and not tiered.wants_hints
    tiered.close()


# --- CUDA: graphed steps -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_graphed_reads_ahead_on_cuda_give_the_same_tokens_and_bits(tmp_path):
    """The tiny V4 in bf16 on CUDA, the kernels' share alone: replayed graphs with reads ahead give the bits of the
    same decode without them, and read ahead experts the calls use."""
    from test_deepseek_v4 import save_tiny_v4

    save_tiny_v4(tmp_path, torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    runs, totals = {}, {}
    for ahead in (2, 0):
        loaded, _ = load_tiered(tmp_path, torch.bfloat16, "cuda", cache_slots=2, miss_route="mapped",
                                mapped_cpu_share=0.0, mapped_prefetch=ahead, mapped_prefetch_min_tokens=1,
                                policy="lfu")  # fmt: skip
        runs[ahead] = moetier_run(loaded, prompt, 24)
        dispatcher = loaded.model.dispatcher
        dispatcher.flush_metrics()
        totals[ahead] = dispatcher.metrics.snapshot()["totals"]
        graphs = loaded.model.graphs
        assert graphs.failures == {} and graphs.replays > 0
        if ahead:
            _host_view_kept(dispatcher)
        dispatcher.close()
    assert runs[2][2] == runs[0][2]
    assert all(torch.equal(a, b) for a, b in zip(runs[2][1], runs[0][1], strict=True))
    assert totals[2]["prefetch_used"] > 0 and totals[0]["prefetch_used"] == 0
    # Every read ahead the flush reached was timed on the device: its copy took time, the call's wait none or some.
    timed = totals[2]["prefetch_timed"]
    assert timed > 0 and totals[2]["prefetch_copy_seconds"] > 0 and totals[2]["prefetch_wait_seconds"] >= 0
    slack = 1e-5 * timed  # the events' resolution
    assert totals[2]["prefetch_wait_seconds"] <= totals[2]["prefetch_copy_seconds"] + slack
    assert totals[0]["prefetch_timed"] == 0
