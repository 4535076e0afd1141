"""The CPU tier beside the mapped route, fed by the device (moetier.tiers.mapped_cpu, cpu_worker.c's fed jobs).

Off CUDA the host plays the device (it fills the inbox and stores the start word), so these run the worker's C
code, the device table's CPU picks and the combination of both shares against the resident results."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import pytest
import torch
from reference import relative_error
from test_mapped import _pinned_and_device_stores
from test_tiers_fidelity import _random_store, _routing

from moetier.errors import ConfigError
from moetier.kernels import cpu_experts
from moetier.kernels.cpu_worker import FedInbox, NativeWorker, fed_ids
from moetier.tiers import mapped_cpu
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertStore, device_allocator, swiglu_expert
from moetier.tiers.mapped_cpu import balanced_share, cpu_fixed_seconds, cpu_picks, default_share
from moetier.tiers.route_costs import RouteCosts
from moetier.tiers.tiered_dispatcher import TieredDispatcher
from moetier.weights.fp4 import scale_to_float

LAYOUT = ExpertLayout((0, 1), num_experts=12, hidden_size=64, intermediate_size=32, top_k=3, swiglu_limit=2.0)
needs_kernel = pytest.mark.skipif(not cpu_experts.available(), reason="no C compiler for the CPU tier's kernel")


def _check_bf16_noise(errors: list[float]) -> None:
    """The C kernel's bf16 roundings against torch's: the CPU tier's tolerance (relative RMS < 0.005) typically;
    a single 1-token call of these tiny experts reaches ~0.007 (measured: median 0.0016 at half the misses on the
    CPU, 0.0032 with all of them; the same worst call either way). The device's pairs counted again by the CPU: 0.8."""
    assert sorted(errors)[len(errors) // 2] < 5e-3 and max(errors) < 1e-2


def _layer(store, layer: int) -> list:
    return [store.expert(layer, e) for e in range(store.layout.num_experts)]


@needs_kernel
def test_a_fed_job_waits_for_its_start_word_and_computes_only_the_pairs_left_to_it():
    store = _random_store(LAYOUT, torch.bfloat16)
    tier = CpuExpertTier(LAYOUT.swiglu_limit, threads=2)
    worker, checked, _ = tier.fed_plan(_layer(store, 0), LAYOUT.hidden_size)
    hidden, ids, weights = _routing(3, LAYOUT, torch.Generator().manual_seed(1), torch.bfloat16)
    inbox = FedInbox.allocate(3, LAYOUT.top_k, LAYOUT.hidden_size, pin=False)
    start, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    job = worker.submit_fed(checked, (start.data_ptr(), 7), inbox, LAYOUT.swiglu_limit, 2, (done.data_ptr(), 7))
    time.sleep(0.02)
    assert not job.done() and done.item() == 0  # its inputs are not there yet
    mine = torch.tensor([[True, False, True], [False, False, False], [False, True, True]])
    inbox.ids.copy_(torch.where(mine, ids, -1))
    inbox.weights.copy_(weights.float())
    inbox.hidden.copy_(hidden)
    start[0] = 7
    assert job.wait()[0] == 0 and done.item() == 7 and start.item() == 0  # the worker stores 0 back
    # The same pairs as an ordinary job of the same kernel: the same bits (rows the CPU has no pair of are zeros).
    groups = {}
    for t, k in mine.nonzero().tolist():
        groups.setdefault(int(ids[t, k]), ([], []))
        groups[int(ids[t, k])][0].append(t)
        groups[int(ids[t, k])][1].append(float(weights[t, k]))
    job_groups = [CpuGroup(store.expert(0, e), rows, gates) for e, (rows, gates) in sorted(groups.items())]
    expected = tier.run(CpuJob(hidden, job_groups)).out
    assert torch.equal(inbox.out, expected) and inbox.out[1].abs().max() == 0
    assert job.experts == len(groups)  # the distinct experts it computed, as the share's fit reads them
    tier.close()


@needs_kernel
def test_a_fed_job_whose_start_never_comes_is_abandoned_at_close_and_still_releases_its_stream():
    store = _random_store(LAYOUT, torch.bfloat16)
    tier = CpuExpertTier(LAYOUT.swiglu_limit, threads=1)
    _, checked, _ = tier.fed_plan(_layer(store, 1), LAYOUT.hidden_size)
    worker = NativeWorker(cpu_experts.usable_library())
    inbox = FedInbox.allocate(1, LAYOUT.top_k, LAYOUT.hidden_size, pin=False)
    start, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    job = worker.submit_fed(checked, (start.data_ptr(), 1), inbox, None, 1, (done.data_ptr(), 3))
    worker.close()
    assert job.wait()[0] == -3 and done.item() == 3
    with pytest.raises(ValueError, match="fed job's hidden"):
        bad = FedInbox(inbox.ids, inbox.weights, inbox.hidden.float(), inbox.out)
        NativeWorker(cpu_experts.usable_library()).submit_fed(checked, (start.data_ptr(), 1), bad, None, 1)
    tier.close()


def test_cpu_picks_take_the_share_of_every_layer_spread_over_the_ids():
    picks = cpu_picks(3, 256, 0.4)
    rows = [picks[i * 256 : (i + 1) * 256] for i in range(3)]
    assert all(sum(row) == round(0.4 * 256) for row in rows)
    assert rows[0] != rows[1]  # each layer its own experts
    assert 0.25 < sum(rows[0][:128]) / sum(rows[0]) < 0.75  # not the low ids
    assert cpu_picks(1, 8, 0.0) == [False] * 8 and cpu_picks(1, 8, 1.0) == [True] * 8
    # Balanced by rate: a CPU tier as fast per expert as the kernels' PCIe reads takes half.
    assert default_share(RouteCosts(cpu_fixed=1.0, copy_fixed=0.75), quantised=True) == pytest.approx(0.5)


@needs_kernel
@pytest.mark.parametrize("split", ["static", "balanced"])
@pytest.mark.parametrize("tokens", [(1, 1, 2, 1, 4, 1, 3, 1, 1, 2)])
def test_mapped_with_a_fed_cpu_share_matches_resident_in_bf16(tokens, split, monkeypatch):
    monkeypatch.setenv("MOETIER_FED_SPLIT", split)
    store = _random_store(LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(
        store, cache_slots=4, miss_route="mapped", mapped_cpu_share=0.5, mapped_admissions=1, policy="lfu"
    )
    alone = TieredDispatcher(store, cache_slots=4, miss_route="mapped", mapped_cpu_share=0.0, policy="lfu")
    generator = torch.Generator().manual_seed(3)
    errors, moved = [], 0
    for step, n in enumerate(tokens):
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(n, LAYOUT, generator, torch.bfloat16, skew=1.0)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            errors.append(relative_error(ours, resident.dispatch(layer, hidden, ids, weights)))
            moved += not torch.equal(ours, alone.dispatch(layer, hidden, ids, weights))
        if step == 5:
            tiered.resize_cache(2)  # entries pointed home again become the CPU's where picked
    tiered.flush_metrics()
    totals = tiered.metrics.snapshot()["totals"]
    tiered.close()
    alone.close()
    _check_bf16_noise(errors)
    assert moved > 0  # the CPU's sums are not the device path's bits: the CPU really computed its pairs
    assert totals["cpu_pairs"] > 0 and totals["mapped_pairs"] > 0 and totals["cpu_seconds"] > 0
    assert totals["uses_miss"] == totals["cpu_pairs"] + totals["mapped_pairs"]
    # The fed jobs' marks: the ones that ran the kernel (some layers leave the CPU nothing) joined 1..threads
    assert 0 < totals["cpu_jobs_marked"] <= len(tokens) * len(LAYOUT.moe_layers)
    threads = tiered.mapped.cpu.tier.threads
    assert totals["cpu_jobs_marked"] <= totals["cpu_threads_joined"] <= threads * totals["cpu_jobs_marked"]
    assert totals["cpu_team_start_seconds"] <= totals["cpu_seconds"]
    assert tiered.mapped.cpu is not None and alone.mapped.cpu is None
    assert tiered.mapped.cpu.sums == "copy"  # off CUDA the host adds the sums, whatever MOETIER_FED_SUMS says


def test_the_fed_share_is_off_where_the_kernel_cannot_run_it_and_validated():
    fp32 = TieredDispatcher(_random_store(LAYOUT, torch.float32), cache_slots=2, miss_route="mapped")
    hidden, ids, weights = _routing(1, LAYOUT, torch.Generator().manual_seed(0), torch.float32)
    fp32.dispatch(0, hidden, ids, weights)
    assert fp32.mapped.cpu is None  # float32 experts: no C kernel, the kernels read every miss
    fp32.close()
    copy = TieredDispatcher(_random_store(LAYOUT, torch.bfloat16), cache_slots=2, miss_route="copy")
    copy.dispatch(0, hidden.bfloat16(), ids, weights.bfloat16())
    assert copy.mapped.cpu is None  # no step will be mapped: nothing checked, nothing started
    copy.close()
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="mapped_cpu_share"):
            TieredDispatcher(_random_store(LAYOUT, torch.bfloat16), cache_slots=1, mapped_cpu_share=bad)


def test_the_fed_split_mode_is_balanced_by_default_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv("MOETIER_FED_SPLIT", raising=False)
    assert mapped_cpu.fed_split_mode() == "balanced"
    monkeypatch.setenv("MOETIER_FED_SPLIT", " Static ")
    assert mapped_cpu.fed_split_mode() == "static"
    monkeypatch.setenv("MOETIER_FED_SPLIT", "even")
    monkeypatch.setenv("MOETIER_FED_SPLIT", "whole")
    assert mapped_cpu.fed_split_mode() == "whole"
    monkeypatch.setenv("MOETIER_FED_SPLIT", "even")
    with pytest.raises(ConfigError, match="MOETIER_FED_SPLIT must be one of balanced, whole, static, got 'even'"):
        mapped_cpu.fed_split_mode()


def test_a_calls_split_cuts_experts_in_parts_the_cpu_kernel_reads_from():
    """V4-Flash's 2048 rows in 16 parts of 128; fp8's 128-wide scale tiles bound the part from below; rows that no
    power of two of parts cuts (Qwen3-235B's 1536) keep whole experts."""
    assert mapped_cpu.split_unit_rows(2048) == 128 and mapped_cpu.split_unit_rows(2048, 128) == 128
    assert mapped_cpu.split_unit_rows(64) == 32 and mapped_cpu.split_unit_rows(64, 128) == 0
    assert mapped_cpu.split_unit_rows(1536) == 0 and mapped_cpu.split_unit_rows(32) == 0


# --- CUDA: the device stores the start words and waits for the done words -----------------------------------


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize(
    ("queued", "split", "sums"),
    [(q, s, "copy") for q in (False, True) for s in ("static", "whole", "balanced")]
    + [(False, "balanced", "kernel"), (True, "balanced", "kernel")],
)
def test_fed_steps_enqueued_ahead_of_the_host_match_resident_on_cuda(queued, split, sums, monkeypatch):
    """Steps launched back to back with no host read in between: the worker holds several fed jobs queued before
    their inputs exist, each starts when the device stores its word, and the stream waits for each one's sums.
    ``balanced`` cuts an expert of most calls in two (512 rows: parts of 128), ``whole`` never does. ``queued``:
    each step inside the dispatcher's ``decode_step``, every layer's job queued before its calls (as
    for calls replayed from CUDA graphs), batch sizes alternating. ``sums``: how the device adds the CPU's sums
    (``MOETIER_FED_SUMS``; ``kernel`` reads the inbox every layer rewrites, so a stale read would show)."""
    monkeypatch.setenv("MOETIER_FED_SPLIT", split)
    monkeypatch.setenv("MOETIER_FED_SUMS", sums)
    layout = ExpertLayout((0, 1, 2), num_experts=32, hidden_size=1024, intermediate_size=512, top_k=4, swiglu_limit=7.0)
    home, device_store = _pinned_and_device_stores(layout, torch.bfloat16)
    resident = ResidentDispatcher(device_store)
    tiered = TieredDispatcher(home, cache_slots=6, miss_route="mapped", mapped_cpu_share=0.5, policy="lfu")
    tiered.prepare("cuda")
    generator = torch.Generator().manual_seed(9)
    calls = []
    for step in range(24):
        tokens = (1, 2, 4, 1)[step % 4]
        with tiered.decode_step(tokens, torch.bfloat16) if queued else contextlib.nullcontext(None) as variant:
            assert (variant and variant[:2]) == (("mapped", True) if queued else None)
            for layer in layout.moe_layers:
                hidden, ids, weights = (t.cuda() for t in _routing(tokens, layout, generator, torch.bfloat16, skew=2.0))
                calls.append((layer, hidden, ids, weights, tiered.dispatch(layer, hidden, ids, weights)))
    torch.cuda.synchronize()
    worst = max(relative_error(ours, resident.dispatch(layer, h, i, w)) for layer, h, i, w, ours in calls)
    tiered.flush_metrics()
    totals = tiered.metrics.snapshot()["totals"]
    tiered.close()
    assert tiered.mapped.cpu is not None and tiered.mapped.cpu._start is not None  # the device stored the words
    assert tiered.mapped.cpu.sums == sums  # the kernel's probe passed where it was asked for
    assert worst < 5e-3
    assert totals["cpu_pairs"] > 0 and totals["mapped_pairs"] > 0 and totals["uses_hit"] > 0
    assert totals["uses_miss"] == totals["cpu_pairs"] + totals["mapped_pairs"]  # the device counted the CPU's
    assert totals["cpu_seconds"] > 0


def test_the_balance_moves_half_way_to_the_share_that_evens_both_sides():
    # At share 0.5 the CPU took 2 s and the device 1 s: the CPU is half as fast, so a third evens them.
    assert balanced_share(0.5, 2.0, 1.0) == pytest.approx((0.5 + 1 / 3) / 2)
    assert balanced_share(0.5, 1.0, 1.0) == pytest.approx(0.5)
    assert balanced_share(0.5, 100.0, 0.001) == pytest.approx(0.4)  # at most 0.1 a move
    assert balanced_share(0.08, 100.0, 0.001) == 0.05 and balanced_share(0.92, 0.001, 100.0) == 0.95


def test_a_fixed_cost_of_the_cpu_jobs_keeps_the_share_from_shrinking_away():
    # At share 0.3 the CPU took 2 s and the device 1 s, but 1.5 s of the CPU's would be there at any share: the
    # variable 0.5 s for 0.3 and the device's 1 s for 0.7 even out above 0.3, where without the fixed part it falls.
    assert balanced_share(0.3, 2.0, 1.0) < 0.3
    fixed = balanced_share(0.3, 2.0, 1.0, cpu_fixed=1.5)
    per_share_cpu, per_share_device = 0.5 / 0.3, 1.0 / 0.7
    target = (per_share_device - 1.5) / (per_share_cpu + per_share_device)
    assert fixed == pytest.approx(0.3 + max(min(0.5 * (target - 0.3), 0.1), -0.1))
    assert balanced_share(0.5, 1.0, 1.0, cpu_fixed=0.0) == pytest.approx(0.5)  # no fixed part: as before
    # The fixed part is never more than 0.9 of the CPU's time (some of it always follows the share).
    assert balanced_share(0.5, 1.0, 1.0, cpu_fixed=5.0) == balanced_share(0.5, 1.0, 1.0, cpu_fixed=0.9)


def test_the_fixed_part_of_a_cpu_job_is_fitted_from_jobs_of_different_sizes():
    jobs = [(n, 0.4e-3 + n * 0.3e-3) for n in (1, 2, 3, 1, 2, 4, 1, 3, 2)]
    assert cpu_fixed_seconds(jobs) == pytest.approx(0.4e-3)
    assert cpu_fixed_seconds(jobs + [(0, 0.0)] * 20) == pytest.approx(0.4e-3)  # empty jobs cost nothing: left out
    assert cpu_fixed_seconds(jobs[:5]) == 0.0  # too few jobs to fit
    assert cpu_fixed_seconds([(2, 1e-3)] * 10) == 0.0  # one size: no slope to tell fixed from per-expert time
    falling = [(n, 2e-3 - n * 1e-4) for n in (1, 2, 3, 4) * 3]  # time not following the experts: mostly fixed
    mean = sum(t for _, t in falling) / len(falling)
    assert cpu_fixed_seconds(falling) == pytest.approx(0.9 * mean)
    assert cpu_fixed_seconds([(n, n * 1e-3) for n in (1, 2, 3) * 3]) == pytest.approx(0.0, abs=1e-12)


@needs_kernel
@pytest.mark.parametrize("split", ["static", "balanced"])
def test_an_adaptive_share_rebalances_from_sampled_calls_and_the_picks_follow(monkeypatch, split):
    """Sampled calls' CPU and device times move the share; the device's pick vector then marks the new share's
    experts wherever the table points home (static split) or the device's share follows it (balanced: every
    uncached expert stays eligible), and results stay the resident's."""
    monkeypatch.setenv("MOETIER_FED_SPLIT", split)
    moves = []

    def toward_fewer(share: float, cpu_seconds: float, device_seconds: float, cpu_fixed: float = 0.0) -> float:
        assert cpu_seconds > 0 and device_seconds > 0  # both sides were timed
        moves.append(share)
        return max(share - 0.25, 0.05)

    monkeypatch.setattr(mapped_cpu, "balanced_share", toward_fewer)
    store = _random_store(LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=3, miss_route="mapped", policy="lfu")  # share None: adaptive
    fed = tiered.mapped.cpu if tiered.prepare("cpu") is None else None
    generator = torch.Generator().manual_seed(4)
    errors = []
    for _ in range(60):  # 120 calls, 30 sampled: two rebalances
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(1, LAYOUT, generator, torch.bfloat16, skew=1.0)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            errors.append(relative_error(ours, resident.dispatch(layer, hidden, ids, weights)))
        mapped = tiered.mapped
        pointed = {mapped._index(key) for key in mapped._pointed}
        want = [int(p and i not in pointed) for i, p in enumerate(fed.picks)]
        if mapped._share_version == fed.picks_version:  # followed at the next step's start
            assert mapped.pick.tolist() == want
    tiered.close()
    assert fed.adaptive and len(moves) >= 2 and fed.balanced == (split == "balanced")
    # Each rebalance is in the history with the fixed part of a job fitted over the finished ones.
    assert len(fed.history) == 1 + len(moves) and fed._jobs_done and all(n >= 0 for n, _ in fed._jobs_done)
    assert all(fixed >= 0.0 for _, _, fixed in fed.history)
    if split == "static":
        assert fed.picks_version >= 2 and fed.call_split(0) is None
        assert sum(fed.picks) == round(fed.share * LAYOUT.num_experts) * len(LAYOUT.moe_layers)
    else:
        assert fed.picks_version == 0 and all(fed.picks)
        assert fed.call_split(1).share.item() == pytest.approx(fed.share)  # the calls read the moved share
    _check_bf16_noise(errors)


@needs_kernel
def test_calls_right_after_another_route_are_not_timed():
    tiered = TieredDispatcher(_random_store(LAYOUT, torch.bfloat16), cache_slots=2, miss_route="mapped")
    tiered.prepare("cpu")
    fed = tiered.mapped.cpu
    fed.settle()
    calls = [mapped_cpu.FedCall(0, None, None) for _ in range(4 * mapped_cpu.SETTLE_STEPS * 2)]
    for call in calls:
        fed.mark_start(call, None)
    settling = mapped_cpu.SETTLE_STEPS * len(LAYOUT.moe_layers)
    assert all(call.timing is None for call in calls[:settling])
    timed = [call.timing is not None for call in calls[settling:]]
    assert sum(timed) == len(timed) // mapped_cpu.SAMPLE_EVERY  # then every SAMPLE_EVERY-th call
    tiered.close()


def _quantised_store(layout: ExpertLayout, quant: ExpertQuant, seed: int, fill) -> ExpertStore:
    """``layout``'s experts as ``quant`` blocks, each matrix's codes and scales set by ``fill(q, scale, generator)``."""
    store = ExpertStore(replace(layout, quant=quant), torch.bfloat16, device_allocator("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            weights = store.block_for_loading(layer, expert)
            for name in ("gate", "up", "down"):
                fill(getattr(weights, f"{name}_q"), getattr(weights, f"{name}_scale"), generator)
    return store


def _fp4_store(scale_format: str) -> ExpertStore:
    """LAYOUT's experts as fp4 blocks, their power-of-two scales kept as ``scale_format`` (the same values)."""

    def fill(q, scale, generator):
        q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=generator))
        exponents = torch.randint(121, 125, scale.shape, dtype=torch.uint8, generator=generator)
        scale.copy_(exponents if scale_format == "e8m0" else scale_to_float(exponents))

    quant = ExpertQuant(kind="fp4-block", tile=(1, 32), pow2_scales=True, scale_format=scale_format)
    return _quantised_store(LAYOUT, quant, 4, fill)


@needs_kernel
def test_fed_jobs_on_e8m0_scale_bytes_give_the_float32_scales_bits():
    """A decode layer's fed job over fp4 blocks keeping e8m0 scale bytes computes what the same experts with
    float32 scales do, through the worker's fed path (its static table of the layer's experts)."""
    hidden, ids, weights = _routing(3, LAYOUT, torch.Generator().manual_seed(2), torch.bfloat16)
    outs = []
    for scales in ("e8m0", "float32"):
        store = _fp4_store(scales)
        tier = CpuExpertTier(LAYOUT.swiglu_limit, threads=2)
        worker, checked, kernel = tier.fed_plan(_layer(store, 1), LAYOUT.hidden_size)
        assert kernel.endswith("-fp4_e8m0" if scales == "e8m0" else "-fp4")
        inbox = FedInbox.allocate(3, LAYOUT.top_k, LAYOUT.hidden_size, pin=False)
        start = torch.zeros(1, dtype=torch.int32)
        job = worker.submit_fed(checked, (start.data_ptr(), 1), inbox, LAYOUT.swiglu_limit, 2)
        inbox.ids.copy_(ids)
        inbox.weights.copy_(weights.float())
        inbox.hidden.copy_(hidden)
        start[0] = 1
        assert job.wait()[0] == 0 and job.experts > 0
        outs.append(inbox.out.clone())
        tier.close()
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


SPLIT_LAYOUT = replace(LAYOUT, intermediate_size=256)


def _split_store(fmt: str) -> ExpertStore:
    """SPLIT_LAYOUT's experts in ``fmt``: bf16 values, fp8 blocks (128 x 128 tiles) or fp4 (32-column tiles)."""
    if fmt == "bf16":
        return _random_store(SPLIT_LAYOUT, torch.bfloat16, seed=6)

    def fill(q, scale, generator):
        if fmt == "fp8":
            values = torch.randn(q.shape, generator=generator).clamp(-3, 3)
            q.copy_(values.to(torch.float8_e4m3fn).view(q.dtype))
            scale.copy_(torch.rand(scale.shape, generator=generator) * 0.02 + 0.01)
        else:
            q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=generator))
            scale.copy_(scale_to_float(torch.randint(121, 125, scale.shape, dtype=torch.uint8)))

    fp8 = ExpertQuant(kind="fp8-block", tile=(128, 128))
    return _quantised_store(
        SPLIT_LAYOUT, fp8 if fmt == "fp8" else ExpertQuant(kind="fp4-block", tile=(1, 32), pow2_scales=True), 6, fill
    )


def _split_job(worker, checked, inbox_ids, weights, hidden, threads: int) -> tuple[int, torch.Tensor]:
    """One fed job of SPLIT_LAYOUT's experts over ``inbox_ids`` (as the inbox holds them) -> its status and sums
    (the inbox's out starts non-zero: a failed job must not leave stale sums)."""
    inbox = FedInbox.allocate(hidden.shape[0], SPLIT_LAYOUT.top_k, SPLIT_LAYOUT.hidden_size, pin=False)
    inbox.out.fill_(7.0)
    start = torch.zeros(1, dtype=torch.int32)
    job = worker.submit_fed(checked, (start.data_ptr(), 1), inbox, SPLIT_LAYOUT.swiglu_limit, threads)
    inbox.ids.copy_(inbox_ids)
    inbox.weights.copy_(weights.float())
    inbox.hidden.copy_(hidden)
    start[0] = 1
    return job.wait()[0], inbox.out.clone()


@needs_kernel
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_a_fed_job_computes_a_split_experts_rows_from_the_row_its_id_carries(fmt):
    """Pairs whose inbox id carries a first row (a split expert: the device computes the rows below) get only the
    part through rows ``from .. I`` (gate/up rows, down columns); whole pairs beside them as before. Against torch's
    reference for the same rows, and the two parts of an expert together against the whole."""
    store = _split_store(fmt)
    tier = CpuExpertTier(SPLIT_LAYOUT.swiglu_limit, threads=2)
    worker, checked, _ = tier.fed_plan(_layer(store, 0), SPLIT_LAYOUT.hidden_size)
    hidden, ids, weights = _routing(2, SPLIT_LAYOUT, torch.Generator().manual_seed(3), torch.bfloat16)
    inter, split = SPLIT_LAYOUT.intermediate_size, 128
    split_expert = int(ids[0, 1])
    from_rows = torch.where(ids == split_expert, split, 0)

    def run(from_of: torch.Tensor) -> torch.Tensor:
        status, out = _split_job(worker, checked, fed_ids(ids, from_of), weights, hidden, threads=2)
        assert status == 0
        return out

    got = run(from_rows)
    expected = torch.zeros_like(got)
    for t, k in torch.cartesian_prod(torch.arange(2), torch.arange(SPLIT_LAYOUT.top_k)).tolist():
        expert, lo = int(ids[t, k]), int(from_rows[t, k])
        part = swiglu_expert(hidden[t : t + 1], store.expert(0, expert), SPLIT_LAYOUT.swiglu_limit, (lo, inter))
        expected[t] += part[0].float() * float(weights[t, k])
    assert relative_error(got, expected) < 5e-3
    # The device's rows of the split expert added to the CPU's part: the whole expert, as the unsplit job has it.
    device = torch.zeros_like(got)
    for t, k in (ids == split_expert).nonzero().tolist():
        part = swiglu_expert(hidden[t : t + 1], store.expert(0, split_expert), SPLIT_LAYOUT.swiglu_limit, (0, split))
        device[t] += part[0].float() * float(weights[t, k])
    whole = run(torch.zeros_like(from_rows))
    assert relative_error(got + device, whole) < 5e-3 and relative_error(got, whole) > 1e-2
    tier.close()


@needs_kernel
def test_a_fed_row_off_the_tiles_is_refused_with_zero_sums():
    """A first row that is not a multiple of 32 (or not below the width) fails the job (no stale sums)."""
    store = _split_store("bf16")
    tier = CpuExpertTier(SPLIT_LAYOUT.swiglu_limit, threads=1)
    worker, checked, _ = tier.fed_plan(_layer(store, 0), SPLIT_LAYOUT.hidden_size)
    hidden, ids, weights = _routing(1, SPLIT_LAYOUT, torch.Generator().manual_seed(3), torch.bfloat16)
    for bad in (48, SPLIT_LAYOUT.intermediate_size):
        status, out = _split_job(worker, checked, fed_ids(ids, bad), weights, hidden, threads=1)
        assert status != 0 and out.abs().max() == 0
    tier.close()


@needs_kernel
def test_mapped_calls_that_cut_an_expert_between_host_and_cpu_tier_match_resident_in_bf16(monkeypatch):
    """Off CUDA the host plays the device for the cut too: the cut expert's first rows by the host's per-expert path,
    the rest by the fed worker (its inbox ids carrying the row), whole experts on either side as before."""
    monkeypatch.setenv("MOETIER_FED_SPLIT", "balanced")
    store = _random_store(SPLIT_LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=4, miss_route="mapped", mapped_cpu_share=0.5, policy="lfu")
    cuts, fill = [], mapped_cpu.FedCpuShare.fill

    def counting_fill(self, inbox, *args):
        fill(self, inbox, *args)
        cuts.append(bool(((inbox.ids >= 0) & (inbox.ids >> 32 > 0)).any()))  # an id carrying a first row

    monkeypatch.setattr(mapped_cpu.FedCpuShare, "fill", counting_fill)
    generator = torch.Generator().manual_seed(5)
    errors = []
    for tokens in (1, 1, 2, 1, 3, 1, 2, 1):
        for layer in SPLIT_LAYOUT.moe_layers:
            hidden, ids, weights = _routing(tokens, SPLIT_LAYOUT, generator, torch.bfloat16, skew=1.0)
            ours = tiered.dispatch(layer, hidden, ids, weights)
            errors.append(relative_error(ours, resident.dispatch(layer, hidden, ids, weights)))
    split = tiered.mapped.cpu.call_split(SPLIT_LAYOUT.moe_layers[0])
    tiered.close()
    assert split.unit_rows == 128 and split.units == 2
    assert any(cuts) and not all(cuts)  # an odd count of uncached experts at share 0.5 cuts one in two
    _check_bf16_noise(errors)


@needs_kernel
def test_timed_steps_queue_their_jobs_up_front_and_time_the_wait_for_the_cpu(monkeypatch):
    """Steps inside ``decode_step``: the timed ones (eager: ``decode_step`` yields None) take the jobs queued for the
    step, as graphed ones do, and time each call's device share and the wait after it until the CPU's sums were in
    (``fed_late_seconds``); the others are untimed."""
    monkeypatch.setattr(mapped_cpu, "TIMED_STEP_EVERY", 4)
    monkeypatch.setattr(mapped_cpu, "FAST_TIMED_STEP_EVERY", 4)
    store = _random_store(LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    tiered = TieredDispatcher(store, cache_slots=3, miss_route="mapped", policy="lfu")  # share None: adaptive
    tiered.prepare("cpu")
    fed = tiered.mapped.cpu
    submitted, submit = [], fed._submit
    monkeypatch.setattr(fed, "_submit", lambda layer, inbox: submitted.append(layer) or submit(layer, inbox))
    generator = torch.Generator().manual_seed(6)
    variants, errors = [], []
    for _ in range(12):
        with tiered.decode_step(1, torch.bfloat16) as variant:
            variants.append(variant)
            queued = len(submitted)
            for layer in LAYOUT.moe_layers:
                hidden, ids, weights = _routing(1, LAYOUT, generator, torch.bfloat16, skew=1.0)
                ours = tiered.dispatch(layer, hidden, ids, weights)
                errors.append(relative_error(ours, resident.dispatch(layer, hidden, ids, weights)))
            assert len(submitted) == queued  # every call took the job queued at the step's start
    tiered.flush_metrics()
    totals = tiered.metrics.snapshot()["totals"]
    tiered.close()
    timed = [v is None for v in variants]
    assert sum(timed) == 3 and len(submitted) == 12 * len(LAYOUT.moe_layers)
    assert totals["fed_timed"] == sum(timed) * len(LAYOUT.moe_layers)
    assert totals["fed_device_seconds"] > 0 and totals["fed_late_seconds"] >= 0
    _check_bf16_noise(errors)


@needs_kernel
@pytest.mark.parametrize("order", ["kernel", "beside", "torch"])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_work_beside_a_mapped_call_runs_once_where_the_order_says_and_changes_no_result(share, order, monkeypatch):
    """``dispatch_beside``: with ``MOETIER_MAPPED_ORDER=beside`` the shared expert's slot in a mapped call comes after
    the call's kernels and counts (the counts already hold the call when it runs) and before the CPU's sums; in the
    other orders it runs first (the counts do not hold the call yet); the routed result is dispatch's own."""
    monkeypatch.setenv("MOETIER_MAPPED_ORDER", order)
    store = _random_store(LAYOUT, torch.float32)
    options = {"cache_slots": 4, "miss_route": "mapped", "mapped_cpu_share": share, "policy": "lfu"}
    beside_first, plain = TieredDispatcher(store, **options), TieredDispatcher(store, **options)
    generator = torch.Generator().manual_seed(4)
    seen = []

    def beside() -> torch.Tensor:
        mapped = beside_first.mapped  # None before the first call prepares the dispatcher
        seen.append(0 if mapped is None else int(mapped.counts[0].sum()))
        return torch.ones(1)

    pairs = 0
    for n in (1, 2, 1, 4):
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(n, LAYOUT, generator, torch.float32, skew=1.0)
            routed, done = beside_first.dispatch_beside(layer, hidden, ids, weights, beside)
            assert torch.equal(done, torch.ones(1)) and seen[-1] == pairs + (ids.numel() if order == "beside" else 0)
            pairs += ids.numel()
            assert int(beside_first.mapped.counts[0].sum()) == pairs
            assert torch.equal(routed, plain.dispatch(layer, hidden, ids, weights))
    assert len(seen) == 4 * len(LAYOUT.moe_layers)
    beside_first.close()
    plain.close()


def test_the_default_dispatch_beside_runs_the_work_once_with_dispatchs_result():
    store = _random_store(LAYOUT, torch.float32)
    resident = ResidentDispatcher(store)
    hidden, ids, weights = _routing(3, LAYOUT, torch.Generator().manual_seed(5), torch.float32, skew=1.0)
    calls = []
    routed, done = resident.dispatch_beside(0, hidden, ids, weights, lambda: calls.append(1) or "shared")
    assert done == "shared" and calls == [1]
    assert torch.equal(routed, resident.dispatch(0, hidden, ids, weights))


@needs_kernel
def test_work_beside_a_cpu_routed_call_runs_once_before_the_cpu_sums_and_changes_no_result(monkeypatch):
    """``MOETIER_MAPPED_ORDER=beside`` on the CPU route (not mapped): the work beside runs once per call, before the
    CPU tier's sums are added (or after the call where it started no job); the routed result is dispatch's own."""
    monkeypatch.setenv("MOETIER_MAPPED_ORDER", "beside")
    store = _random_store(LAYOUT, torch.float32)
    options = {"cache_slots": 2, "miss_route": "cpu", "policy": "lfu"}
    beside_first, plain = TieredDispatcher(store, **options), TieredDispatcher(store, **options)
    generator = torch.Generator().manual_seed(6)
    runs = []
    for n in (1, 3, 1):
        for layer in LAYOUT.moe_layers:
            hidden, ids, weights = _routing(n, LAYOUT, generator, torch.float32, skew=1.0)
            routed, done = beside_first.dispatch_beside(layer, hidden, ids, weights, lambda: runs.append(1) or 7)
            assert done == 7 and torch.equal(routed, plain.dispatch(layer, hidden, ids, weights))
    assert len(runs) == 3 * len(LAYOUT.moe_layers)
    assert beside_first.metrics.snapshot()["totals"]["cpu_pairs"] > 0
    beside_first.close()
    plain.close()


def test_a_misspelt_mapped_order_warns_once_and_takes_the_default(monkeypatch, caplog):
    from moetier.tiers.mapped import mapped_order

    monkeypatch.setenv("MOETIER_MAPPED_ORDER", "besides")
    with caplog.at_level("WARNING"):
        assert mapped_order() == mapped_order() == "kernel"
    assert sum("MOETIER_MAPPED_ORDER='besides'" in r.message for r in caplog.records) == 1
