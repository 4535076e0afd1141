"""Piecewise CUDA graphs of the Qwen3-MoE and DeepSeek-V3 decode step (:mod:`moetier.models.decode_segments`).

CPU: the segmented decode equals the layers' one-call forward exactly (fp32 and bf16, 1 and 3 sequences, a
one-token prompt among them, plain, fp8 and paged caches), eagerly and through the fake graphs of
``test_v4_graph_segments`` (static buffers, outputs read in place, inputs copied in). The tiny models cover
dense and MoE layers, q-LoRA and plain queries, interleaved and half-split rope, yarn, zero and two shared
experts. ``python tests/test_prenorm_graph_segments.py`` prints how a step's ops split between graphs and
eager code (the launch estimate).

GPU (``gpu`` marker, run on the H200): graphs on vs off give the same greedy tokens and logits at 1, 2 and 4
sequences, with every segment captured once per batch size; the tiered dispatcher with a small cache
matches the resident run with graphs on.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from reference import greedy_groups, moetier_run, relative_error, save_tiny
from test_deepseek_v3 import VARIANTS, tiny_v3_config
from test_qwen3_moe import tiny_qwen3_config
from test_v4_graph_segments import FakeGraph, FakeGraphs, PhaseCounter, describe, experts_in_graphs, step_phases

import moetier.models.decode_segments as segments
from moetier.config import ModelLoadConfig
from moetier.models.graph_segments import SegmentGraphs
from moetier.models.paged_kv import PagedKVSpace, paged_kv
from moetier.weights.loader import load_model

FAMILIES = {
    "qwen3_moe": tiny_qwen3_config,  # 4 layers, layer 1 dense, no shared expert
    "v3_q_lora": lambda: tiny_v3_config(**VARIANTS["q_lora"]),  # interleaved rope, grouped top-3, 1 dense layer
    "v3_yarn_plain_q": lambda: tiny_v3_config(**VARIANTS["yarn_plain_q"]),  # yarn, 2 shared experts, 2 dense
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save_family(name: str, path: Path) -> Path:
    if not (path / "config.json").exists():
        save_tiny(FAMILIES[name](), path)
    return path


def load(path: Path, dtype: torch.dtype, device: str = "cpu"):
    return load_model(path, ModelLoadConfig(dtype=dtype, device=device), progress=False).model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return save_family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=sorted(DTYPES))
def model(request, checkpoint):
    return load(checkpoint, DTYPES[request.param])


GROUPS = (1, 3)  # sequences decoded together; the groups take turns, so batch sizes alternate
PROMPTS = (5, 11, 18, 1)  # one per sequence; the last is a one-token prompt: a "decode" step on an empty cache
STEPS = 6


@torch.no_grad()
def decode_run(model, kv_dtype: str | None = None, seed: int = 4) -> list[torch.Tensor]:
    """Prefill every sequence alone, then ``STEPS`` decode steps of each group in turn (fixed random tokens).

    Returns each step's logits, computed from hidden states kept until the end: a hidden state that a later
    step overwrote (a static graph output handed out) would show."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.embed_tokens.num_embeddings
    caches = [model.new_cache(64, kv_dtype) for _ in PROMPTS]
    hidden = []
    for n, cache in zip(PROMPTS, caches, strict=True):
        hidden.append(model(torch.randint(0, vocab, (n,), generator=generator), cache))
    for _ in range(STEPS):
        start = 0
        for size in GROUPS:
            group = caches[start : start + size]
            tokens = torch.randint(0, vocab, (size,), generator=generator)
            hidden.append(model(tokens, group[0]) if size == 1 else model(tokens, group, [1] * size))
            start += size
    return [model.compute_logits(h) for h in hidden]


def segments_per_step(model) -> int:
    return 2 * len(model.layers) + 2  # inputs, pre and post of every layer, final


def moe_layers(model) -> int:
    return sum(isinstance(layer.mlp, segments.RoutedMoE) for layer in model.layers)


def test_segmented_decode_equals_the_one_call_forward(model, monkeypatch):
    monkeypatch.setattr(model, "segmented_decode", False)
    reference = decode_run(model)
    monkeypatch.setattr(model, "segmented_decode", True)
    calls = Counter()
    real = segments.decode_step

    def counted(m, ids, batch):
        calls[len(ids)] += 1
        return real(m, ids, batch)

    monkeypatch.setattr(segments, "decode_step", counted)
    segmented = decode_run(model)
    assert calls == {1: STEPS + 1, 3: STEPS}  # every decode step and the one-token prompt, no other prefill
    assert model.graphs.captures == model.graphs.replays == 0  # on the CPU the segments simply run
    assert all(torch.equal(a, b) for a, b in zip(segmented, reference, strict=True))
    assert not torch.equal(reference[-1], reference[-3])  # the steps differ: the comparison can fail


def test_fake_graphs_decode_equals_the_one_call_forward(model, monkeypatch):
    """Static buffers, outputs read in place and copied-in inputs (FakeGraph replays) change nothing."""
    monkeypatch.setattr(model, "segmented_decode", False)
    reference = decode_run(model)
    monkeypatch.setattr(model, "segmented_decode", True)
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(model, "graphs", graphs)
    graphed = decode_run(model)
    assert all(torch.equal(a, b) for a, b in zip(graphed, reference, strict=True))
    per_step = segments_per_step(model)
    assert graphs.failures == {}
    assert graphs.warm_ups == graphs.captures == per_step * len(GROUPS)  # once per segment, layer and batch size
    calls = {1: STEPS + 1, 3: STEPS}
    assert graphs.replays == per_step * sum(n - 1 for n in calls.values())  # all but each key's warm-up call


def test_experts_inside_the_post_graphs_change_nothing(model, monkeypatch):
    """A graphable dispatcher's routed experts run inside the MoE layers' post segments: same bits."""
    where = experts_in_graphs(model, monkeypatch, decode_run)
    # No decode step dispatched outside a segment: only the three multi-token prompts did (a capture also runs
    # the segment once, so segments saw at least every decode step's dispatches).
    assert where["eager"] == 3 * moe_layers(model)
    assert where["in segments"] >= moe_layers(model) * (2 * STEPS + 1)


@pytest.mark.parametrize(("kv_dtype", "layout"), [("fp8", "contiguous"), (None, "paged"), ("fp8", "paged")])
def test_cache_storage_decode_equals_the_one_call_forward(checkpoint, kv_dtype, layout, monkeypatch):
    """fp8 rows and paged blocks (where the family's cache builds its rows through ``kv_rows``) are read and
    written by the eager part alike on both paths."""
    model = load(checkpoint, torch.float32)
    space = PagedKVSpace("cpu", block_tokens=4) if layout == "paged" else None
    with paged_kv(space):
        monkeypatch.setattr(model, "segmented_decode", False)
        reference = decode_run(model, kv_dtype)
        monkeypatch.setattr(model, "segmented_decode", True)
        monkeypatch.setattr(model, "graphs", FakeGraphs(warmup=1))
        assert all(torch.equal(a, b) for a, b in zip(decode_run(model, kv_dtype), reference, strict=True))


@pytest.mark.parametrize("route", ["auto", "mapped"])
def test_fake_graphs_with_tiered_dispatcher_match_resident(checkpoint, route):
    """The tiered dispatcher (a small expert cache, misses on the CPU tier or copied in; mapped: read by the
    device's path, the shared experts beside the call) reads the segments' static outputs and hands back its
    result to be copied in: same logits as the resident one-call forward."""
    from test_tiers_fidelity import FP32_REL, load_tiered, small_cache

    resident = load_model(checkpoint, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False)
    resident.model.segmented_decode = False
    reference = decode_run(resident.model)
    options = {"cache_slots": small_cache(resident), "miss_route": route, "policy": "lru"}
    loaded, _ = load_tiered(checkpoint, torch.float32, **options)
    loaded.model.graphs = graphs = FakeGraphs(warmup=1)
    try:
        tiered = decode_run(loaded.model)
    finally:
        loaded.model.dispatcher.close()
    snap = loaded.model.dispatcher.metrics.snapshot()
    print(f"\nmiss rate {1 - snap['hit_rate']:.2f}")
    assert 1 - snap["hit_rate"] > 0.5 and snap["totals"]["cpu_pairs" if route == "auto" else "mapped_pairs"] > 0
    assert graphs.failures == {} and graphs.replays > 0
    assert max(relative_error(a, b) for a, b in zip(tiered, reference, strict=True)) < FP32_REL


@pytest.mark.parametrize("prompts", [(7, 30, 12), (9, 9, 9)], ids=["unequal", "equal"])
@torch.no_grad()
def test_batched_decode_attention_equals_each_sequence_alone(checkpoint, prompts):
    """Padded keys, the padding mask (skipped for equal lengths) and the grouped query heads of a batched
    decode step give each sequence what it gets decoded alone (unpadded; alone matches transformers)."""
    model = load(checkpoint, torch.float32)
    generator = torch.Generator().manual_seed(2)
    vocab = model.embed_tokens.num_embeddings
    alone, together = ([model.new_cache(48) for _ in prompts] for _ in range(2))
    for n, a, t in zip(prompts, alone, together, strict=True):
        prompt = torch.randint(0, vocab, (n,), generator=generator)
        model(prompt, a), model(prompt, t)
    for _ in range(3):
        tokens = torch.randint(0, vocab, (len(prompts),), generator=generator)
        batched = model.compute_logits(model(tokens, together, [1] * len(prompts)))
        for i, cache in enumerate(alone):
            assert relative_error(batched[i], model.compute_logits(model(tokens[i : i + 1], cache))[0]) < 1e-5


@torch.no_grad()
def test_prefill_and_mixed_batches_take_the_one_call_forward(checkpoint, monkeypatch):
    model = load(checkpoint, torch.float32)
    monkeypatch.setattr(segments, "decode_step", lambda *args: pytest.fail("not a decode step"))
    caches = [model.new_cache(32) for _ in range(2)]
    model(torch.arange(7), caches[0])
    model(torch.arange(4), caches, [1, 3])  # one sequence decodes, the other brings a chunk
    assert [c.length for c in caches] == [8, 3]


# --- where a step's ops run: graphs vs eager ------------------------------------------------------------


@contextmanager
def phases(model, monkeypatch):
    """Count a step's ops by phase (:class:`PhaseCounter`): a fake replay's work is ``graph``, its output
    stores are free (a real graph writes in place), the dispatcher's ops are ``experts``."""
    counter = PhaseCounter()

    def in_phase(phase, fn):
        def run(*args, **kwargs):
            with counter.within(phase):
                return fn(*args, **kwargs)

        return run

    def replay(graph: FakeGraph) -> None:
        counter.replays += 1
        with counter.within("graph"):
            outputs = graph.compute()
        counter.paused += 1
        try:
            graph.store(outputs)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(FakeGraph, "replay", replay)
    monkeypatch.setattr(model.dispatcher, "dispatch", in_phase("experts", model.dispatcher.dispatch))
    monkeypatch.setattr(model.graphs, "run", in_phase("run", model.graphs.run))
    with counter:
        yield counter


@torch.no_grad()
def one_call_ops(model, monkeypatch, streams: int) -> int:
    """Non-view, non-expert ops of the same step through the one-call forward (graphs off: one launch each)."""
    monkeypatch.setattr(model, "segmented_decode", False)
    try:
        counter = step_phases(model, monkeypatch, streams, phases)
    finally:
        monkeypatch.setattr(model, "segmented_decode", True)
    return counter.ops[("eager", False)]


# Ceilings on a step's launches with graphs (eager ops + input copies + replays) of the tiny models, just above
# today's bf16 counts (fp32 runs 8 fewer: no casts); a change that adds launches fails. Before segments the
# one-call decode dispatched, at 1 / 4 streams: Qwen3 bf16 292 / 839, V3 q-LoRA bf16 361 / 944.
LAUNCH_CEILINGS = {"qwen3_moe": (56, 137), "v3_q_lora": (52, 100), "v3_yarn_plain_q": (51, 99)}


@pytest.mark.parametrize("streams", [1, 4])
def test_graphs_take_most_ops_and_copy_only_eager_results(request, model, monkeypatch, streams):
    counter = step_phases(model, monkeypatch, streams, phases)
    print(f"\n{model.dtype}, {streams} stream(s): {describe(counter)}")
    launches = counter.ops[("eager", False)] + counter.ops[("copy", False)] + counter.replays
    ceiling = LAUNCH_CEILINGS[request.node.callspec.params["checkpoint"]][streams > 1]
    assert launches <= ceiling, f"~{launches} launches per decode step, ceiling {ceiling}"
    assert counter.replays == segments_per_step(model)
    # Copied in: token ids and positions, each layer's attention output, each MoE layer's routed output.
    # Everything else is a segment's output read in place by the next segment.
    assert counter.ops[("copy", False)] == 2 + len(model.layers) + moe_layers(model)
    assert counter.ops[("graph", False)] > counter.ops[("eager", False)]
    # The segments run exactly the one-call forward's ops, plus one: the copy of the final hidden states
    # (a static graph output) handed to the caller.
    segmented = counter.ops[("graph", False)] + counter.ops[("eager", False)]
    assert segmented == one_call_ops(model, monkeypatch, streams) + 1


# --- CUDA (run on the GPU machine) -----------------------------------------------------------------------

CUDA_GROUPS = (1, 2, 4)
CUDA_STEPS = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def cuda_checkpoint(request, tmp_path_factory):
    return save_family(request.param, tmp_path_factory.mktemp(f"cuda_{request.param}"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_graphs_match_eager_decode(cuda_checkpoint, dtype):
    model = load(cuda_checkpoint, DTYPES[dtype], "cuda")
    assert model.inv_freq.is_cuda
    model.graphs = SegmentGraphs(enabled=False)
    eager_tokens, eager_logits = greedy_groups(model, CUDA_GROUPS)
    model.graphs = graphs = SegmentGraphs(enabled=True)
    graph_tokens, graph_logits = greedy_groups(model, CUDA_GROUPS)
    errors = [relative_error(a, b) for a, b in zip(graph_logits, eager_logits, strict=True)]
    print(f"\n{dtype}: worst relative error graphs vs eager {max(errors):.2e}; {graphs.captures} captures")
    assert graphs.failures == {}
    per_step = segments_per_step(model)
    assert graphs.captures == per_step * len(CUDA_GROUPS)
    assert graphs.replays == per_step * len(CUDA_GROUPS) * (CUDA_STEPS - graphs.warmup)
    assert graph_tokens == eager_tokens
    assert max(errors) <= (1e-5 if dtype == "fp32" else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cpu", "copy", "auto"])
def test_cuda_graphs_with_tiered_dispatcher_match_resident(cuda_checkpoint, route):
    from test_tiers_fidelity import FP32_REL, load_tiered, small_cache

    prompt = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(3))
    resident = load_model(cuda_checkpoint, ModelLoadConfig(dtype=torch.float32, device="cuda"), progress=False)
    resident.model.graphs = SegmentGraphs(enabled=False)
    _, ref_steps, ref_tokens = moetier_run(resident, prompt, 32)
    options = {"cache_slots": small_cache(resident), "miss_route": route, "policy": "lru"}
    loaded, _ = load_tiered(cuda_checkpoint, torch.float32, device="cuda", **options)
    loaded.model.graphs = graphs = SegmentGraphs(enabled=True)  # on whatever MOETIER_CUDA_GRAPHS says
    _, steps, tokens = moetier_run(loaded, prompt, 32)
    loaded.model.dispatcher.close()
    snap = loaded.model.dispatcher.metrics.snapshot()
    errors = [relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)]
    print(f"\n{route}: miss rate {1 - snap['hit_rate']:.2f}, worst step error {max(errors):.2e}")
    assert 1 - snap["hit_rate"] > 0.5
    assert graphs.failures == {} and graphs.replays > 0
    assert tokens == ref_tokens
    assert max(errors) < FP32_REL


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(FAMILIES):
            path = save_family(name, Path(tmp) / name)
            for dtype in DTYPES.values():
                tiny = load(path, dtype)
                for n in (1, 4):
                    with pytest.MonkeyPatch.context() as patch:
                        phases_ = describe(step_phases(tiny, patch, n, phases))
                        eager = one_call_ops(tiny, patch, n)
                    print(f"{name} {dtype}, {n} stream(s): {phases_}; one-call forward {eager} ops")
