"""Mapped decode steps whose calls run inside the model's CUDA graphs (TieredDispatcher.decode_step).

A graphed step runs no host code per call, so the fed CPU tier's jobs are queued before the step (every layer's,
in order), the words the device stores and waits for hold constants, and a step that fails midway cancels what
it queued. Off CUDA the model's segments run eagerly, but through the same protocol: these tests check it
against the per-call (eager) protocol and the resident results; the GPU tests replay real graphs."""

from __future__ import annotations

import json

import pytest
import torch
from reference import relative_error
from test_mapped_cpu import LAYOUT, _check_bf16_noise, needs_kernel
from test_tiers_fidelity import BF16_STEP_MEDIAN, _random_store, _routing, forced_logits, load_tiered, small_cache

from moetier.config import ModelLoadConfig
from moetier.kernels.cpu_worker import ABANDONED
from moetier.models.graph_segments import SegmentGraphs
from moetier.tiers import mapped_cpu
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.tiered_dispatcher import TieredDispatcher
from moetier.weights.loader import load_model


def _tiered(store, graphs: bool, share: float | None = 0.5) -> TieredDispatcher:
    tiered = TieredDispatcher(
        store, cache_slots=4, miss_route="mapped", mapped_cpu_share=share, mapped_admissions=1, policy="lfu",
        mapped_graphs=graphs,
    )  # fmt: skip
    tiered.prepare("cpu")
    return tiered


def _step(tiered: TieredDispatcher, calls: list[tuple], fail_after: int | None = None) -> tuple[object, list]:
    """One decode step as a model's segmented decode runs it: the dispatcher's step around every layer's call."""
    outs = []
    with tiered.decode_step(calls[0][0].shape[0], torch.bfloat16) as variant:
        for layer, (hidden, ids, weights) in zip(LAYOUT.moe_layers, calls, strict=True):
            if fail_after is not None and len(outs) == fail_after:
                raise RuntimeError("the step failed")
            outs.append(tiered.dispatch(layer, hidden, ids, weights))
    return variant, outs


def _errors(resident: ResidentDispatcher, outs: list, calls: list[tuple]) -> list[float]:
    pairs = zip(LAYOUT.moe_layers, outs, calls, strict=True)
    return [relative_error(out, resident.dispatch(layer, *call)) for layer, out, call in pairs]


@needs_kernel
def test_a_queued_step_gives_the_per_call_protocols_bits_and_the_resident_results():
    store = _random_store(LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    graphed, eager = _tiered(store, graphs=True), _tiered(store, graphs=False)
    generator = torch.Generator().manual_seed(5)
    errors, queued = [], []
    real_dispatch = graphed.dispatch

    def watching(layer, *args):
        fed = graphed.mapped.cpu
        queued.append((sorted(fed._queued), len(fed._jobs)))  # the step's jobs, and every job not yet harvested
        return real_dispatch(layer, *args)

    graphed.dispatch = watching
    for n in (1, 2, 1, 4, 1, 3, 1, 1):
        calls = [_routing(n, LAYOUT, generator, torch.bfloat16, skew=1.0) for _ in LAYOUT.moe_layers]
        queued.clear()
        variant, ours = _step(graphed, calls)
        eager_variant, theirs = _step(eager, calls)
        assert variant[:2] == ("mapped", True) and eager_variant is None
        # Both layers' jobs queued before the first call, and no call queued one of its own.
        assert [layers for layers, _ in queued] == [list(LAYOUT.moe_layers)] * 2 and queued[0][1] == queued[1][1]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        errors += _errors(resident, ours, calls)
    graphed.flush_metrics()
    totals = graphed.metrics.snapshot()["totals"]
    graphed.close()
    eager.close()
    _check_bf16_noise(errors)
    assert totals["cpu_pairs"] > 0 and totals["mapped_pairs"] > 0 and totals["cpu_seconds"] > 0
    assert totals["uses_miss"] == totals["cpu_pairs"] + totals["mapped_pairs"]


@needs_kernel
def test_a_step_that_fails_midway_cancels_its_queued_jobs_and_the_next_steps_are_right():
    store = _random_store(LAYOUT, torch.bfloat16)
    resident = ResidentDispatcher(store)
    tiered = _tiered(store, graphs=True)
    generator = torch.Generator().manual_seed(6)
    calls = [_routing(2, LAYOUT, generator, torch.bfloat16, skew=1.0) for _ in LAYOUT.moe_layers]
    with pytest.raises(RuntimeError, match="the step failed"):
        _step(tiered, calls, fail_after=1)
    fed = tiered.mapped.cpu
    cancelled = fed._jobs[-1]  # layer 1's job: its start never came
    assert cancelled.layer == 1 and cancelled.job.wait()[0] == ABANDONED
    assert fed._queued is None and all(int(w.abs().sum()) == 0 for w in fed._words)
    errors = []
    for n in (1, 3, 1):
        calls = [_routing(n, LAYOUT, generator, torch.bfloat16, skew=1.0) for _ in LAYOUT.moe_layers]
        variant, ours = _step(tiered, calls)
        assert variant[:2] == ("mapped", True)
        errors += _errors(resident, ours, calls)
    tiered.flush_metrics()  # every job harvested: the cancelled one does not break the tier
    assert not fed.broken
    tiered.close()
    _check_bf16_noise(errors)


@needs_kernel
def test_an_adaptive_share_keeps_every_few_mapped_steps_eager_to_time_them():
    tiered = _tiered(_random_store(LAYOUT, torch.bfloat16), graphs=True, share=None)
    generator = torch.Generator().manual_seed(7)
    variants, timed = [], 0
    for _ in range(4 * mapped_cpu.FAST_TIMED_STEP_EVERY):
        calls = [_routing(1, LAYOUT, generator, torch.bfloat16) for _ in LAYOUT.moe_layers]
        variant, _ = _step(tiered, calls)
        variants.append(variant)
        timed += sum(call.timing is not None for call in tiered.mapped.cpu._jobs)
        tiered.mapped.cpu.harvest(wait=True)
    tiered.close()
    every = mapped_cpu.FAST_TIMED_STEP_EVERY  # no rebalance has run yet: the share still counts as moving
    assert [v is None for v in variants] == [(i + 1) % every == 0 for i in range(len(variants))]
    assert timed > 0


def test_only_a_mapped_step_of_a_prepared_dispatcher_runs_in_graphs():
    store = _random_store(LAYOUT, torch.float32)
    copy = TieredDispatcher(store, cache_slots=2, miss_route="copy")
    with copy.decode_step(1, torch.float32) as variant:
        assert variant is None  # not prepared yet: its first call prepares it and starts the step
    copy.prepare("cpu")
    with copy.decode_step(1, torch.float32) as variant:
        assert variant is None and copy._step_open
    assert not copy._step_open
    mapped = TieredDispatcher(store, cache_slots=2, miss_route="mapped")
    mapped.prepare("cpu")
    with mapped.decode_step(1, torch.float32) as variant:
        assert variant[:2] == ("mapped", False)  # float32 experts: no fed CPU share
    with mapped.decode_step(mapped.config.stream_min_tokens, torch.float32) as variant:
        assert variant is None  # a prefill-sized call is no decode step
    with ResidentDispatcher(store).decode_step(1, torch.float32) as variant:
        assert variant is None  # the host path on the CPU: not graphable


# --- a model's segmented decode ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    from test_deepseek_v4 import save_tiny_v4

    path = tmp_path_factory.mktemp("v4_mapped_graphs")
    save_tiny_v4(path, torch.float32)
    return path


def _greedy(loaded, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    model = loaded.model
    cache = model.new_cache(prompt.shape[0] + steps + 1)
    with torch.inference_mode():
        token = int(model.compute_logits(model(prompt.to(model.device), cache))[-1].argmax())
        tokens, logits = [], []
        for _ in range(steps):
            tokens.append(token)
            logits.append(model.compute_logits(model(torch.tensor([token], device=model.device), cache))[-1].cpu())
            token = int(logits[-1].argmax())
    return tokens, logits


@needs_kernel
def test_a_models_decode_runs_mapped_steps_through_the_queued_protocol(v4_checkpoint):
    """The tiny V4 in bf16: decode steps with the fed CPU tier queued ahead give the per-call protocol's logits."""
    config = json.loads((v4_checkpoint / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    runs, queued = {}, []
    for graphs in (True, False):
        loaded, _ = load_tiered(v4_checkpoint, torch.bfloat16, cache_slots=2, miss_route="mapped",
                                mapped_cpu_share=0.5, policy="lfu", mapped_graphs=graphs)  # fmt: skip
        fed = loaded.model.dispatcher.mapped.cpu
        real_queue = fed.queue_step
        fed.queue_step = lambda tokens, real=real_queue: (queued.append(tokens), real(tokens))[1]
        runs[graphs] = _greedy(loaded, prompt, 12)
        loaded.model.dispatcher.close()
    assert queued == [1] * 12  # every decode step of the graphed run, none of the other
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))
    resident = load_model(v4_checkpoint, ModelLoadConfig(dtype=torch.bfloat16, device="cpu"), progress=False)
    ref_tokens, ref_logits = _greedy(resident, prompt, 12)
    loaded, _ = load_tiered(v4_checkpoint, torch.bfloat16, cache_slots=2, miss_route="mapped", mapped_cpu_share=0.5,
                            policy="lfu")  # fmt: skip
    _, forced = forced_logits(loaded, prompt, ref_tokens)  # the resident's tokens: a bf16 near-tie flips greedy runs
    loaded.model.dispatcher.close()
    errors = [relative_error(a, b) for a, b in zip(forced, ref_logits, strict=True)]
    assert sorted(errors)[len(errors) // 2] < BF16_STEP_MEDIAN


# --- CUDA: the calls replay real graphs ---------------------------------------------------------------------


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_graphed_mapped_decode_on_cuda_matches_eager_and_resident(v4_checkpoint, share):
    """The tiny V4 in bf16 on CUDA: mapped steps (kernels alone, or with the fed CPU tier) replayed from CUDA graphs
    give the eager mapped steps' tokens and logits, and stay within bf16 noise of the resident model."""
    config = json.loads((v4_checkpoint / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    resident = load_model(v4_checkpoint, ModelLoadConfig(dtype=torch.bfloat16, device="cuda"), progress=False)
    ref_tokens, ref_logits = _greedy(resident, prompt, 24)
    runs, graphs_used = {}, None
    for graphed in (True, False):
        loaded, _ = load_tiered(v4_checkpoint, torch.bfloat16, "cuda", cache_slots=small_cache(resident),
                                miss_route="mapped", mapped_cpu_share=share, policy="lfu")  # fmt: skip
        loaded.model.graphs = SegmentGraphs(enabled=graphed)
        runs[graphed] = _greedy(loaded, prompt, 24)
        if graphed:  # on the resident's tokens (greedy runs part at a bf16 near-tie): within bf16's noise
            _, forced = forced_logits(loaded, prompt, ref_tokens)
            errors = [relative_error(a.cpu(), b) for a, b in zip(forced, ref_logits, strict=True)]
        dispatcher = loaded.model.dispatcher
        dispatcher.flush_metrics()
        totals = dispatcher.metrics.snapshot()["totals"]
        dispatcher.close()
        assert (totals["cpu_pairs"] > 0) == (share > 0) and totals["mapped_pairs"] > 0
        if graphed:
            graphs_used = loaded.model.graphs
    assert graphs_used.failures == {} and graphs_used.captures > 0 and graphs_used.replays > 0
    assert runs[True][0] == runs[False][0]
    assert max(relative_error(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True)) < 1e-6
    assert sorted(errors)[len(errors) // 2] < BF16_STEP_MEDIAN


@pytest.mark.gpu
@needs_kernel
def test_an_adaptive_share_times_graphed_calls_by_the_device_clock_with_no_eager_step(v4_checkpoint):
    """The tiny V4 in bf16 on CUDA, the fed share adaptive: every mapped step replays graphs (none is kept eager to be
    timed), the sampled steps' stamps give each call's device share and wait for the CPU, the share rebalances from
    them, and the tokens stay the resident's within bf16 noise."""
    config = json.loads((v4_checkpoint / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    resident = load_model(v4_checkpoint, ModelLoadConfig(dtype=torch.bfloat16, device="cuda"), progress=False)
    ref_tokens, ref_logits = _greedy(resident, prompt, 40)
    loaded, _ = load_tiered(v4_checkpoint, torch.bfloat16, "cuda", cache_slots=small_cache(resident),
                            miss_route="mapped", mapped_cpu_share=None, policy="lfu")  # fmt: skip
    dispatcher = loaded.model.dispatcher
    fed, timed = dispatcher.mapped.cpu, []
    real_timed = fed.timed_step
    fed.timed_step = lambda real=real_timed: (lambda t: timed.append(t) or t)(real())
    _greedy(loaded, prompt, 40)
    _, forced = forced_logits(loaded, prompt, ref_tokens)
    dispatcher.flush_metrics()
    totals = dispatcher.metrics.snapshot()["totals"]
    dispatcher.close()
    assert fed.timing == "stamps" and timed and not any(timed)
    assert loaded.model.graphs.replays > 0 and loaded.model.graphs.failures == {}
    assert totals["fed_timed"] > 0 and totals["fed_device_seconds"] > 0 and totals["fed_late_seconds"] >= 0
    assert len(fed.history) > 1 and fed.handoff.seconds >= 0.0  # rebalanced from the stamped samples
    errors = [relative_error(a.cpu(), b) for a, b in zip(forced, ref_logits, strict=True)]
    assert sorted(errors)[len(errors) // 2] < BF16_STEP_MEDIAN


# The segment keys of the second MoE layer's call: V4's whole layer (contiguous caches), the post segment after its
# attention's (contiguous caches in a step that reads ahead), or a post segment (paged).
_SECOND_CALL = (("layer", 1), ("static post", 1), ("post", 1))


@pytest.mark.gpu
@needs_kernel
def test_a_graphed_mapped_step_whose_capture_fails_runs_that_segment_eagerly_with_the_same_results(
    v4_checkpoint, monkeypatch
):
    """A segment with a layer's call (its queued fed job and its reads ahead: V4's whole-layer segment, a post segment
    elsewhere) that cannot be captured runs eagerly in its step and every later one: the eager rerun reuses the job
    queued for it (a second job would wait for the next step's start word) and restores what it read ahead, so the
    decode gives the fully graphed run's results."""
    config = json.loads((v4_checkpoint / "config.json").read_text())
    prompt = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    runs, graphs_used = {}, {}
    for failing in (False, True):
        loaded, _ = load_tiered(v4_checkpoint, torch.bfloat16, "cuda", cache_slots=2, miss_route="mapped",
                                mapped_cpu_share=0.5, mapped_prefetch=2, mapped_prefetch_min_tokens=1,
                                policy="lfu")  # fmt: skip
        graphs = loaded.model.graphs
        if failing:
            real_entry = SegmentGraphs._capture_entry

            def refuse_posts(self, key, entry, fn, tensors, real=real_entry):
                if key[:2] in _SECOND_CALL:  # the second layer's call: after a read ahead for it
                    real_capture = self._capture
                    self._capture = lambda *_: (_ for _ in ()).throw(RuntimeError("capture refused"))
                    try:
                        return real(self, key, entry, fn, tensors)
                    finally:
                        self._capture = real_capture
                return real(self, key, entry, fn, tensors)

            monkeypatch.setattr(SegmentGraphs, "_capture_entry", refuse_posts)
        runs[failing] = _greedy(loaded, prompt, 24)
        dispatcher = loaded.model.dispatcher
        dispatcher.flush_metrics()
        totals = dispatcher.metrics.snapshot()["totals"]
        dispatcher.close()
        assert totals["cpu_pairs"] > 0 and totals["prefetch_used"] > 0
        graphs_used[failing] = (dict(graphs.failures), graphs.replays)
    failures, replays = graphs_used[True]
    assert [key[:2] for key in failures] in ([k] for k in _SECOND_CALL) and replays > 0
    assert graphs_used[False][0] == {}
    assert runs[True][0] == runs[False][0]
    assert max(relative_error(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True)) < 1e-6


@needs_kernel
def test_the_timed_steps_thin_out_once_a_rebalance_barely_moves_the_share(monkeypatch):
    tiered = _tiered(_random_store(LAYOUT, torch.bfloat16), graphs=True, share=None)
    fed = tiered.mapped.cpu
    for move, every in ((0.005, mapped_cpu.TIMED_STEP_EVERY), (0.05, mapped_cpu.FAST_TIMED_STEP_EVERY)):
        monkeypatch.setattr(mapped_cpu, "balanced_share", lambda share, cpu, device, move=move, **_: share + move)
        fed._samples = [(1e-3, 1e-3, 1, 0.0)] * mapped_cpu.BALANCE_SAMPLES
        fed.harvest()  # a rebalance from the samples
        fed._mapped_steps = 0
        assert [fed.timed_step() for _ in range(48)] == [(i + 1) % every == 0 for i in range(48)]
    tiered.close()
