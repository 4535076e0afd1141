"""Piecewise CUDA graphs of the DeepSeek-V4 decode step (issue 4: decode is launch-bound).

CPU: :class:`SegmentGraphs` is a passthrough; its bookkeeping (keys, warm-up, capture, outputs read in place
by the next segment, the eager fallback after a failed capture) runs with :class:`FakeGraph` standing in for
``torch.cuda.CUDAGraph``. The segmented decode equals the layers' one-call forward exactly, eagerly and
through fake graphs, at 1 and 3 sequences. ``python tests/test_v4_graph_segments.py`` prints how a step's
ops split between graphs and eager code (the launch estimate).

GPU (``gpu`` marker, run on the H200): graphs on vs off give the same greedy tokens and logits at 1, 2 and 4
sequences in fp32 and bf16; the tiered dispatcher with a small cache still matches the resident run with
graphs on; a segment that cannot be captured (a host sync) falls back to eager.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from reference import greedy_groups, moetier_run, relative_error
from test_v4_decode_ops import _VIEWS, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import moetier.models.deepseek_v4 as v4
import moetier.models.deepseek_v4_attention as v4_attention
from moetier.config import ModelLoadConfig
from moetier.errors import ConfigError
from moetier.models.graph_segments import SegmentGraphs
from moetier.weights.loader import load_model


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class FakeGraph:
    """A CUDA graph's stand-in on the CPU: a replay reruns ``fn`` on the static inputs into the static outputs."""

    def __init__(self, fn, inputs: tuple, outputs: tuple) -> None:
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        self.store(self.compute())

    def compute(self) -> tuple:
        """The work a real graph replays."""
        return as_tuple(self.fn(*self.inputs))

    def store(self, outputs: tuple) -> None:
        """Into the static outputs (a real graph writes them directly)."""
        for static, new in zip(self.outputs, outputs, strict=True):
            if static is not None and static is not new:
                static.copy_(new)


class FakeGraphs(SegmentGraphs):
    """:class:`SegmentGraphs` whose CPU tensors take the graph path, captured as :class:`FakeGraph`."""

    def __init__(self, warmup: int = 1) -> None:
        super().__init__(enabled=True, warmup=warmup)
        self.warm_ups = self.attempts = 0
        self.capturing = False  # a segment function may raise while True, as an uncapturable op would

    def _active(self, tensors) -> bool:
        return self.enabled and not torch.is_grad_enabled()

    def _warm_up(self, fn, tensors):
        self.warm_ups += 1
        return fn(*tensors)

    def _capture(self, fn, inputs):
        self.attempts += 1
        # A capture records the work without doing it: undo every write ``fn`` makes (to its inputs, and to
        # state it closes over, e.g. a static decode step's caches).
        self.capturing = True
        undo = UndoWrites()
        try:
            with undo:
                outputs = fn(*inputs)
        finally:
            self.capturing = False
            undo.restore()
        return FakeGraph(fn, inputs, as_tuple(outputs)), outputs


class UndoWrites(TorchDispatchMode):
    """Records the value of every tensor an op writes in place (by its schema) before the first write;
    :meth:`restore` puts them back, newest first."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, torch.Tensor):
                    self.saved.append((tensor, tensor.clone()))
        return func(*args, **kwargs)

    def restore(self) -> None:
        for tensor, value in reversed(self.saved):
            tensor.copy_(value)


# --- SegmentGraphs on its own -------------------------------------------------------------------------


def affine(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2 + 1, x.sum(-1)


@torch.no_grad()
def test_cpu_is_a_passthrough():
    graphs = SegmentGraphs(enabled=True)
    x = torch.randn(3, 4)
    first, second = graphs.run("a", affine, x), graphs.run("a", affine, x)
    assert torch.equal(first[0], x * 2 + 1) and torch.equal(first[1], x.sum(-1))
    assert first[0] is not second[0]  # computed anew, nothing static
    assert graphs.fresh(first[0]) is first[0]
    assert (graphs.captures, graphs.replays) == (0, 0)


def test_environment_turns_graphs_off(monkeypatch):
    monkeypatch.setenv("MOETIER_CUDA_GRAPHS", "0")
    assert not SegmentGraphs().enabled
    monkeypatch.setenv("MOETIER_CUDA_GRAPHS", "1")
    assert SegmentGraphs().enabled
    assert not SegmentGraphs(enabled=False).enabled


@torch.no_grad()
def test_warm_up_then_one_capture_per_key_and_shape():
    graphs = FakeGraphs(warmup=2)
    outs = []
    for i in range(5):
        x = torch.full((2, 3), float(i))
        outs.append(graphs.run(("seg", 0, 2), affine, x))
        assert torch.equal(outs[-1][0], x * 2 + 1) and torch.equal(outs[-1][1], x.sum(-1))
    assert (graphs.warm_ups, graphs.captures, graphs.replays) == (2, 1, 3)
    assert outs[2][0] is outs[4][0]  # replays hand back the same static outputs...
    assert outs[1][0] is not outs[2][0]  # ...warm-up calls fresh ones
    assert torch.equal(outs[2][0], torch.full((2, 3), 9.0))  # overwritten by the last replay
    graphs.run(("seg", 0, 2), affine, torch.ones(3, 3))  # another shape: its own warm-up
    graphs.run(("seg", 1, 2), affine, torch.ones(2, 3))  # another key: its own warm-up
    assert (graphs.warm_ups, graphs.captures) == (4, 1)
    with torch.inference_mode():  # inference tensors cannot take no-grad copies: its own entry
        graphs.run(("seg", 0, 2), affine, torch.ones(2, 3))
    assert (graphs.warm_ups, graphs.captures) == (5, 1)
    with torch.enable_grad():  # autograd: always eager
        x = torch.ones(2, 3, requires_grad=True)
        assert graphs.run(("seg", 0, 2), affine, x)[0].requires_grad
    assert (graphs.warm_ups, graphs.captures, graphs.replays) == (5, 1, 3)


@torch.no_grad()
def test_past_max_graphs_the_least_recently_run_are_dropped(monkeypatch):
    graphs = FakeGraphs(warmup=1)
    graphs.max_graphs = 4
    x = torch.ones(2, 3)
    for key in range(6):  # keys 0-5 captured in turn (a warm-up, then a capture each); key 0 kept in use
        for k in (key, 0):
            graphs.run(k, affine, x)
            graphs.run(k, affine, x)
    # The 5th graph is one too many: down to 3 (a quarter of 4 below the cap), the least recently run first (keys 1
    # and 2; key 0, run after every key, stays); the 6th makes 4 again.
    assert graphs.captures == 6 and graphs.evictions == 2
    assert sorted(k[1] for k, e in graphs._entries.items() if e.graph is not None) == [0, 3, 4, 5]
    before = graphs.warm_ups
    out = graphs.run(1, affine, torch.full((2, 3), 2.0))  # an evicted key warms up again, computing the right thing
    assert graphs.warm_ups == before + 1 and torch.equal(out[0], torch.full((2, 3), 5.0))
    graphs.run(0, affine, x)
    assert graphs.warm_ups == before + 1  # key 0 still replays
    monkeypatch.setenv("MOETIER_MAX_GRAPHS", "many")
    with pytest.raises(ConfigError, match="MOETIER_MAX_GRAPHS must be an integer >= 1"):
        SegmentGraphs()
    monkeypatch.setenv("MOETIER_MAX_GRAPHS", "64")
    assert SegmentGraphs().max_graphs == 64


class CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func.overloadpacket.__name__ == "copy_"
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_segments_output_is_read_in_place_by_the_next():
    graphs = FakeGraphs(warmup=1)
    scale = lambda y, bias: y * 3 + bias
    for _ in range(3):
        x, bias = torch.randn(2, 3), torch.randn(2, 3)
        y, _ = graphs.run("producer", affine, x)
        with CopyCounter() as counter:
            (z,) = graphs.run("consumer", scale, y, bias)
        assert torch.allclose(z, (x * 2 + 1) * 3 + bias)
    # The producer's output is the consumer's static input: only ``bias`` is copied in (the fake
    # replay itself copies its one output back).
    assert counter.copies == 2
    other = torch.randn(2, 3)
    (z,) = graphs.run("consumer", scale, other, bias)  # a different tensor there: copied in, still right
    assert torch.allclose(z, other * 3 + bias)


@torch.no_grad()
def test_fresh_copies_static_outputs_only():
    graphs = FakeGraphs(warmup=0)
    out, _ = graphs.run("a", affine, torch.ones(2, 2))
    copy = graphs.fresh(out)
    assert copy is not out and torch.equal(copy, out)
    graphs.run("a", affine, torch.zeros(2, 2))
    assert torch.equal(copy, torch.full((2, 2), 3.0)) and torch.equal(out, torch.ones(2, 2))


@torch.no_grad()
def test_each_variant_keeps_its_own_graphs_across_switches():
    """Steps switching between variants (a tiered dispatcher's routes) capture each variant once, never replay
    one variant's graph for another, and a dispatcher swap (reset) drops them all."""
    graphs = FakeGraphs(warmup=0)
    doubled, tripled = (lambda x: x * 2), (lambda x: x * 3)
    for i in range(6):
        variant, fn, factor = ("a", doubled, 2) if i % 2 == 0 else ("b", tripled, 3)
        graphs.use_variant(variant)
        (out,) = graphs.run("seg", fn, torch.full((2,), float(i)))
        assert torch.equal(out, torch.full((2,), float(i * factor)))
    assert graphs.captures == 2 and graphs.replays == 6  # one capture per variant, then replays only
    graphs.reset()
    graphs.use_variant("a")
    graphs.run("seg", doubled, torch.ones(2))
    assert graphs.captures == 3


class PooledFakeGraphs(FakeGraphs):
    """:class:`FakeGraphs` that take their variant's pool as a real capture does, noting which pool each used."""

    def __init__(self) -> None:
        super().__init__(warmup=0)
        self.used_pools: list[object] = []

    def _new_pool(self):
        return object()

    def _capture(self, fn, inputs):
        self.used_pools.append(self._variant_pool())
        return super()._capture(fn, inputs)


@torch.no_grad()
def test_a_pool_whose_graphs_are_all_dropped_is_replaced():
    """torch's allocator asserts on a capture into a pool whose graphs are all gone while its memory is held (the
    H100 run of V4's halves steps, whose graphs all go with their sequences): that variant's next capture opens a
    new pool, while a pool that still holds a graph is kept."""
    graphs = PooledFakeGraphs()
    x = torch.ones(2)
    graphs.use_variant("halves")
    graphs.run(("layer", 0), lambda t: t * 2, x, tags=("first",))
    graphs.run(("layer", 1), lambda t: t * 3, x, tags=("second",))
    graphs.use_variant("whole")
    graphs.run("inputs", lambda t: t + 1, x)  # untagged: stays
    first_halves, whole = graphs.used_pools[0], graphs.used_pools[2]
    assert graphs.used_pools[1] is first_halves
    graphs.drop_tag("first")  # one of the pool's two graphs: the pool stays
    graphs.use_variant("halves")
    graphs.run(("layer", 2), lambda t: t * 4, x, tags=("third",))
    assert graphs.used_pools[3] is first_halves
    graphs.use_variant("whole")  # the last graphs of "halves" go while another variant is current
    graphs.drop_tag("second")
    graphs.drop_tag("third")
    graphs.run("final", lambda t: t - 1, x)
    assert graphs.used_pools[4] is whole
    graphs.use_variant("halves")
    graphs.run(("layer", 0), lambda t: t * 2, x, tags=("fourth",))
    assert graphs.used_pools[5] is not first_halves


@torch.no_grad()
def test_failed_capture_warns_once_and_runs_eagerly(caplog):
    graphs = FakeGraphs(warmup=1)

    def syncs(x: torch.Tensor) -> torch.Tensor:
        if graphs.capturing:  # as ``.item()`` inside a CUDA graph capture
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 1

    with caplog.at_level(logging.WARNING, logger="moetier.models.graph_segments"):
        for i in range(4):
            (out,) = graphs.run(("sync", 3), syncs, torch.full((2,), float(i)))
            assert torch.equal(out, torch.full((2,), i + 1.0))
            graphs.run("fine", affine, torch.ones(2))
    warnings = [r.getMessage() for r in caplog.records if r.name == "moetier.models.graph_segments"]
    assert len(warnings) == 1 and "('sync', 3)" in warnings[0] and "not permitted" in warnings[0]
    assert list(graphs.failures) == [("sync", 3)]
    assert graphs.attempts == 2 and graphs.captures == 1  # never retried; other keys still captured


# --- the segmented DeepSeek-V4 decode step --------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_graph_segments")
    tiny_model(path)
    return path


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, checkpoint):
    return tiny_model(checkpoint, request.param)


GROUPS = (1, 3)  # sequences decoded together; the groups take turns, so batch sizes alternate
PROMPTS = (5, 11, 18, 23)  # one per sequence: windows and compressed entries at different fills


@torch.no_grad()
def decode_run(model, steps: int = 10, seed: int = 4) -> list[torch.Tensor]:
    """Prefill every sequence, then ``steps`` decode steps of each group in turn (fixed random tokens).

    Returns each step's logits, computed from hidden states kept until the end: a hidden state that a
    later step overwrote (a static graph output handed out) would show."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.embed.num_embeddings
    caches = [model.new_cache(64) for _ in PROMPTS]
    for n, cache in zip(PROMPTS, caches, strict=True):
        model(torch.randint(0, vocab, (n,), generator=generator), cache)
    hidden = []
    for _ in range(steps):
        start = 0
        for size in GROUPS:
            group = caches[start : start + size]
            tokens = torch.randint(0, vocab, (size,), generator=generator)
            hidden.append(model(tokens, group[0]) if size == 1 else model(tokens, group, [1] * size))
            start += size
    return [model.compute_logits(h) for h in hidden]


def test_segmented_decode_equals_the_one_call_forward(model, monkeypatch):
    monkeypatch.setattr(model, "segmented_decode", False)
    reference = decode_run(model)
    monkeypatch.setattr(model, "segmented_decode", True)
    calls = Counter()
    real = v4.decode_step

    def counted(m, ids, batch):
        calls[len(ids)] += 1
        return real(m, ids, batch)

    monkeypatch.setattr(v4, "decode_step", counted)
    segmented = decode_run(model)
    assert calls == {1: 10, 3: 10}  # every decode step took the segmented path, no prefill did
    assert model.graphs.captures == model.graphs.replays == 0  # on the CPU the segments simply run
    assert all(torch.equal(a, b) for a, b in zip(segmented, reference, strict=True))
    assert not torch.equal(reference[0], reference[2])  # the steps differ: the comparison can fail


def test_fake_graphs_decode_equals_the_one_call_forward(model, monkeypatch):
    """Static buffers, outputs read in place and copied-in inputs (FakeGraph replays) change nothing."""
    monkeypatch.setattr(model, "segmented_decode", False)
    reference = decode_run(model)
    monkeypatch.setattr(model, "segmented_decode", True)
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(model, "graphs", graphs)
    graphed = decode_run(model)
    assert all(torch.equal(a, b) for a, b in zip(graphed, reference, strict=True))
    per_step = len(model.layers) + 2  # inputs, every layer whole (contiguous states: the fixed-shape attention), final
    assert graphs.failures == {}
    assert graphs.warm_ups == graphs.captures == per_step * len(GROUPS)  # once per segment, layer and batch size
    assert graphs.replays == per_step * len(GROUPS) * (10 - 1)  # all but the warm-up step


def experts_in_graphs(model, monkeypatch, run_decode) -> Counter:
    """``run_decode(model)`` with the one-call forward, then segmented on fake graphs with the dispatcher made
    graphable: asserts the same bits and no capture failure; returns the dispatcher's calls inside / outside a
    segment run."""
    monkeypatch.setattr(model, "segmented_decode", False)
    reference = run_decode(model)
    monkeypatch.setattr(model, "segmented_decode", True)
    graphs = FakeGraphs(warmup=1)
    where, inside = Counter(), []
    dispatch, run = model.dispatcher.dispatch, graphs.run

    def counted_dispatch(*args, **kwargs):
        where["in segments" if inside else "eager"] += 1
        return dispatch(*args, **kwargs)

    def counted_run(*args, **kwargs):
        inside.append(True)
        try:
            return run(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(model.dispatcher, "graphable", lambda tokens: True)
    monkeypatch.setattr(model.dispatcher, "dispatch", counted_dispatch)
    monkeypatch.setattr(graphs, "run", counted_run)
    monkeypatch.setattr(model, "graphs", graphs)
    graphed = run_decode(model)
    assert all(torch.equal(a, b) for a, b in zip(graphed, reference, strict=True))
    assert graphs.failures == {}
    return where


def test_experts_inside_the_post_graphs_change_nothing(model, monkeypatch):
    """A graphable dispatcher's routed experts run inside the post segments (captured with them): same bits."""
    where = experts_in_graphs(model, monkeypatch, decode_run)
    # No decode step dispatched outside a segment, only the prompts did (a capture also runs the segment once).
    layers = len(model.layers)
    assert where["eager"] == len(PROMPTS) * layers and where["in segments"] >= layers * 10 * len(GROUPS)


# --- where a step's ops run: graphs vs eager ------------------------------------------------------------


class PhaseCounter(TorchDispatchMode):
    """Counts ops (view/non-view) per phase: ``graph`` (inside a replay), ``copy`` (graph inputs copied
    in), ``experts`` (the dispatcher) or ``eager`` (everything else). Fused Triton kernels count once."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.paused, self.replays = "eager", 0, 0
        self.ops: Counter[tuple[str, bool]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.tally(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def tally(self, name: str) -> None:
        phase = "copy" if self.phase == "run" and name == "copy_" else self.phase
        self.ops[(phase, name.removesuffix("_") in _VIEWS)] += 1

    @contextmanager
    def within(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


@contextmanager
def phases(model, monkeypatch):
    counter = PhaseCounter()

    def in_phase(phase, fn):
        def run(*args, **kwargs):
            with counter.within(phase):
                return fn(*args, **kwargs)

        return run

    def fused(fn, launches: int = 1):
        def run(*args, **kwargs):
            for _ in range(launches):
                counter.tally("fused_kernel")
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1

        return run

    def replay(graph: FakeGraph) -> None:
        counter.replays += 1
        with counter.within("graph"):
            outputs = graph.compute()
        counter.paused += 1  # a real graph writes its outputs in place: no copies
        try:
            graph.store(outputs)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(FakeGraph, "replay", replay)
    monkeypatch.setattr(model.dispatcher, "dispatch", in_phase("experts", model.dispatcher.dispatch))
    monkeypatch.setattr(model.graphs, "run", in_phase("run", model.graphs.run))
    monkeypatch.setattr(v4, "hyper_mix", fused(v4.hyper_mix, 2))  # two kernels on CUDA
    monkeypatch.setattr(v4_attention, "rms_norm", fused(v4_attention.rms_norm))
    with counter:
        yield counter


@torch.no_grad()
def step_phases(model, monkeypatch, streams: int, counting=None) -> PhaseCounter:
    """Ops of the decode step :func:`test_v4_decode_ops.decode_step_ops` counts (same prompts and tokens),
    with graphs captured beforehand (two steps of the same sequences warm up and capture the segments).
    ``counting`` is the family's :func:`phases` (default: this module's, for V4)."""
    monkeypatch.setattr(model, "graphs", FakeGraphs(warmup=1))
    vocab = model.config.vocab_size

    def prefill(seed: int) -> tuple[list, torch.Generator]:
        generator = torch.Generator().manual_seed(seed)
        caches = [model.new_cache(64) for _ in range(streams)]
        for i, cache in enumerate(caches):
            model(torch.randint(0, vocab, (21 + i,), generator=generator), cache)
        return caches, generator

    # Graphs of whole layers read the sequences' own states: the same sequences warm up and capture them.
    caches, generator = prefill(5)
    for _ in range(2):
        model(torch.randint(0, vocab, (streams,), generator=generator), caches, [1] * streams)
    tokens = torch.randint(0, vocab, (streams,), generator=generator)
    with (counting or phases)(model, monkeypatch) as counter:
        model(tokens, caches, [1] * streams)
    return counter


def describe(counter: PhaseCounter) -> str:
    ops = counter.ops
    eager, copies = ops[("eager", False)], ops[("copy", False)]
    return (
        f"graphs {ops[('graph', False)]} ops (+{ops[('graph', True)]} views) in {counter.replays} replays; "
        f"eager {eager} ops (+{ops[('eager', True)]} views); {copies} input copies; "
        f"experts {ops[('experts', False)]}; launches ~{eager + copies + counter.replays} "
        f"(without graphs ~{eager + ops[('graph', False)]})"
    )


@pytest.mark.parametrize("streams", [1, 4])
def test_graphs_take_most_ops_and_copy_only_eager_results(model, monkeypatch, streams):
    counter = step_phases(model, monkeypatch, streams)
    print(f"\n{model.dtype}, {streams} stream(s): {describe(counter)}")
    layers = len(model.layers)
    assert counter.replays == layers + 2  # inputs, each layer whole (fixed-shape attention inside), final
    # Copied in: token ids and positions, each MoE output. Everything else is a segment's output read in
    # place by the next segment.
    assert counter.ops[("copy", False)] == 2 + layers
    # The captured segments hold more of the step's ops than what stays eager (attention core).
    assert counter.ops[("graph", False)] > counter.ops[("eager", False)]


# --- CUDA (run on the GPU machine) -----------------------------------------------------------------------

CUDA_GROUPS = (1, 2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["equal-capacities", "mixed-capacities"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_match_eager_decode(checkpoint, dtype, mixed):
    model = load_model(checkpoint, ModelLoadConfig(dtype=dtype, device="cuda"), progress=False).model
    model.graphs = SegmentGraphs(enabled=False)
    eager_tokens, eager_logits = greedy_groups(model, CUDA_GROUPS, mixed_capacities=mixed)
    model.graphs = graphs = SegmentGraphs(enabled=True)
    graph_tokens, graph_logits = greedy_groups(model, CUDA_GROUPS, mixed_capacities=mixed)
    errors = [relative_error(a, b) for a, b in zip(graph_logits, eager_logits, strict=True)]
    print(f"\n{dtype} mixed={mixed}: worst relative error vs eager {max(errors):.2e}; {graphs.captures} captures")
    assert graphs.failures == {}
    # inputs, each layer whole, final; a layer's graph is its sequences' (warm-up on their first step, capture on
    # the second), and an entry bucket that doubles captures it again
    per_step = len(model.layers) + 2
    assert graphs.captures >= per_step * len(CUDA_GROUPS)
    assert graphs.replays >= per_step * len(CUDA_GROUPS) * (8 - 2 * graphs.warmup)
    assert graph_tokens == eager_tokens
    assert max(errors) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cpu", "copy", "auto"])
def test_cuda_graphs_with_tiered_dispatcher_match_resident(checkpoint, route):
    from test_tiers_fidelity import FP32_REL, load_tiered, small_cache

    prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3))
    resident = load_model(checkpoint, ModelLoadConfig(dtype=torch.float32, device="cuda"), progress=False)
    resident.model.graphs = SegmentGraphs(enabled=False)
    ref_prefill, ref_steps, ref_tokens = moetier_run(resident, prompt, 32)
    options = {"cache_slots": small_cache(resident), "miss_route": route, "policy": "lru"}
    loaded, _ = load_tiered(checkpoint, torch.float32, device="cuda", **options)
    graphs = loaded.model.graphs
    assert graphs.enabled
    prefill, steps, tokens = moetier_run(loaded, prompt, 32)
    loaded.model.dispatcher.close()
    snap = loaded.model.dispatcher.metrics.snapshot()
    errors = [relative_error(a, b) for a, b in zip(steps, ref_steps, strict=True)]
    print(f"\n{route}: miss rate {1 - snap['hit_rate']:.2f}, worst step error {max(errors):.2e}")
    assert 1 - snap["hit_rate"] > 0.7
    assert graphs.failures == {} and graphs.replays > 0
    assert tokens == ref_tokens
    assert max(errors) < FP32_REL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_with_device_routing_match_host_routing(checkpoint, dtype):
    """Resident experts with device-built tables run inside the post graphs: the host-table run's tokens and
    bits, no capture failure."""
    from moetier.tiers.dispatcher import ResidentDispatcher

    model = load_model(checkpoint, ModelLoadConfig(dtype=dtype, device="cuda"), progress=False).model
    assert model.dispatcher.graphable(1)  # the default resident dispatcher on CUDA
    model.use_dispatcher(ResidentDispatcher(model.dispatcher.store, device_routing=False))
    model.graphs = SegmentGraphs(enabled=True)
    host_tokens, host_logits = greedy_groups(model, CUDA_GROUPS)
    routed = ResidentDispatcher(model.dispatcher.store, device_routing=True)
    assert routed.graphable(1) and routed.graphable(4)
    model.use_dispatcher(routed)
    model.graphs = graphs = SegmentGraphs(enabled=True)
    tokens, logits = greedy_groups(model, CUDA_GROUPS)
    errors = [relative_error(a, b) for a, b in zip(logits, host_logits, strict=True)]
    print(f"\n{dtype}: worst relative error device vs host tables {max(errors):.2e}; {graphs.captures} captures")
    assert graphs.failures == {} and graphs.replays > 0
    assert tokens == host_tokens and max(errors) == 0.0


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_capture_replay_and_fallback(caplog):
    graphs = SegmentGraphs(enabled=True)
    x = torch.randn(4, 8, device="cuda")
    for i in range(3):
        out, total = graphs.run("affine", affine, x + i)
        assert torch.allclose(out, (x + i) * 2 + 1) and torch.allclose(total, (x + i).sum(-1))
    (chained,) = graphs.run("chained", lambda y: y * 3, out)
    (chained,) = graphs.run("chained", lambda y: y * 3, out)
    assert torch.allclose(chained, ((x + 2) * 2 + 1) * 3)
    assert (graphs.captures, graphs.replays) == (2, 3)
    with caplog.at_level(logging.WARNING, logger="moetier.models.graph_segments"):
        for _ in range(3):  # a host sync cannot be captured
            (synced,) = graphs.run("sync", lambda y: y * y.sum().item(), x)
            assert torch.allclose(synced, x * x.sum())
    warnings = [r for r in caplog.records if r.name == "moetier.models.graph_segments"]
    assert list(graphs.failures) == ["sync"] and len(warnings) == 1
    for i in range(2):  # captures still work after a failed one
        out, _ = graphs.run("after", affine, x - i)
        assert torch.allclose(out, (x - i) * 2 + 1)
    assert graphs.captures == 3


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            tiny = tiny_model(Path(tmp), dtype)
            for n in (1, 4):
                with pytest.MonkeyPatch.context() as patch:
                    print(f"{dtype}, {n} stream(s): {describe(step_phases(tiny, patch, n))}")
