"""Next-layer expert hints (``ExpertDispatcher.hint``) from the decode step of every family.

CPU, the tiny random models of conftest's ``families`` (Qwen3-MoE, DeepSeek-V3 q-LoRA, DeepSeek-V4): a
dispatcher that wants hints gets, every decode step, ``hint(L', ids)`` once per MoE layer but the last, before
``dispatch(L)``, and none in prefill; tokens and logits do not change; a hash-routed next layer's hint is exact;
a learned router's hint is that router on the residual the predictor reads, recomputed here by hand (the
formula pinned; the DeepSeek routers' correction bias is part of it); switching ``wants_hints`` under (fake)
CUDA graphs recaptures every segment rather than replay stale ones. The hints' recall on the tiny models is
printed (random weights: a smoke figure, not a prediction for real checkpoints).

GPU (``gpu`` marker): with CUDA graphs on, the hints and tokens equal those with graphs off, also after a
dispatcher swap between a dispatcher that ignores hints and one that wants them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from conftest import _write_tiny
from reference import relative_error
from test_v4_graph_segments import FakeGraphs

from moetier.config import ModelLoadConfig
from moetier.models.decode_segments import SegmentedDecoderLayer
from moetier.models.deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4ForCausalLM
from moetier.models.graph_segments import SegmentGraphs
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.weights.loader import load_model

FAMILIES = ("qwen3_moe", "deepseek_v3", "deepseek_v4")
PROMPTS = (5, 11, 18, 9)  # one per sequence, prefilled alone
GROUPS = (1, 3)  # sequences decoded together; the groups take turns, so batch sizes alternate
STEPS = 6

Event = tuple[str, int, torch.Tensor]  # ("hint" | "dispatch", layer, ids)


class HintRecorder(ResidentDispatcher):
    """Resident experts that record every hint and dispatch in order (ids cloned: graph outputs are static).

    Host tables: a recorder must see every call, so it is never graphable (its dispatch would run at capture
    only)."""

    def __init__(self, store, wants: bool = True) -> None:
        super().__init__(store, device_routing=False)
        self.wants = wants
        self.events: list[Event] = []

    @property
    def wants_hints(self) -> bool:
        return self.wants

    def hint(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.events.append(("hint", layer, topk_ids.clone()))

    def dispatch(self, layer, hidden, topk_ids, topk_weights):
        self.events.append(("dispatch", layer, topk_ids.clone()))
        return super().dispatch(layer, hidden, topk_ids, topk_weights)

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


@dataclass
class Call:
    """One forward: its token ids, whether it was a decode step, the dispatcher's events, its logits."""

    tokens: torch.Tensor
    decode: bool
    events: list[Event]
    logits: torch.Tensor

    def ids(self, kind: str) -> dict[int, torch.Tensor]:
        return {layer: ids for k, layer, ids in self.events if k == kind}


@torch.no_grad()
def greedy_run(model, dispatcher) -> list[Call]:
    """Through ``dispatcher``: prefill every prompt alone, then ``STEPS`` greedy decode steps of each group."""
    model.use_dispatcher(dispatcher)
    generator = torch.Generator().manual_seed(3)
    caches = [model.new_cache(64) for _ in PROMPTS]
    calls: list[Call] = []

    def call(tokens: torch.Tensor, group: list, decode: bool) -> torch.Tensor:
        tokens = tokens.to(model.device)
        hidden = model(tokens, group[0]) if len(group) == 1 else model(tokens, group, [1] * len(group))
        events = dispatcher.take() if isinstance(dispatcher, HintRecorder) else []
        calls.append(Call(tokens, decode, events, model.compute_logits(hidden)))
        return calls[-1].logits

    nexts = torch.stack(
        [
            call(torch.randint(0, model.config.vocab_size, (n,), generator=generator), [cache], False)[-1].argmax()
            for n, cache in zip(PROMPTS, caches, strict=True)
        ]
    )
    for _ in range(STEPS):
        start = 0
        for size in GROUPS:
            rows = slice(start, start + size)
            nexts[rows] = call(nexts[rows].clone(), caches[rows], True).argmax(-1)
            start += size
    return calls


def moe_layers(model) -> tuple[int, ...]:
    return type(model).expert_layout(model.config).moe_layers


def expected_order(moe: tuple[int, ...]) -> list[tuple[str, int]]:
    """A decode step's events: each MoE layer's dispatch, preceded by the hint for the next MoE layer."""
    order = []
    for layer, ahead in zip(moe, (*moe[1:], None), strict=True):
        if ahead is not None:
            order.append(("hint", ahead))
        order.append(("dispatch", layer))
    return order


def hinted_pairs(calls: list[Call], layers: set[int] | None = None):
    """``(call, layer, hinted ids, dispatched ids)`` of every hint of the decode calls (``layers``: only those)."""
    for c in calls:
        dispatched = c.ids("dispatch")
        for layer, ids in c.ids("hint").items():
            if layers is None or layer in layers:
                yield c, layer, ids, dispatched[layer]


def recall(pairs) -> tuple[float, float, int]:
    """Over hints ``pairs`` (:func:`hinted_pairs`): the mean share of a token's routed experts that were hinted,
    the mean share of a call's distinct routed experts that were hinted, and the number of hints."""
    pairs = list(pairs)
    tokens = [
        len(set(h) & set(a)) / len(a)
        for _, _, hinted, actual in pairs
        for h, a in zip(hinted.tolist(), actual.tolist(), strict=True)
    ]
    calls = [
        len(set(actual.flatten().tolist()) & set(hinted.flatten().tolist())) / len(set(actual.flatten().tolist()))
        for _, _, hinted, actual in pairs
    ]
    return sum(tokens) / len(tokens), sum(calls) / len(calls), len(pairs)


@pytest.fixture(params=FAMILIES)
def model(request, families):
    """A family's tiny fp32 model (shared by the module): its dispatcher and graphs are restored afterwards."""
    model = families(request.param)[0].model
    dispatcher, graphs = model.dispatcher, model.graphs
    yield model
    model.use_dispatcher(dispatcher)
    model.graphs = graphs


def test_every_decode_step_hints_each_next_moe_layer_before_its_dispatch(model):
    calls = greedy_run(model, HintRecorder(model.dispatcher.store))
    moe, top_k = moe_layers(model), model.dispatcher.store.layout.top_k
    assert [c.decode for c in calls].count(True) == STEPS * len(GROUPS)
    for c in calls:
        kinds = [(kind, layer) for kind, layer, _ in c.events]
        if not c.decode:  # prefill: no hints
            assert kinds == [("dispatch", layer) for layer in moe]
            continue
        assert kinds == expected_order(moe)
        for kind, _, ids in c.events:
            if kind == "hint":
                assert ids.shape == (c.tokens.shape[0], top_k)
                assert ids.dtype == torch.int64 and ids.device == model.device


def test_hints_never_change_tokens_or_logits(model):
    store = model.dispatcher.store
    plain = greedy_run(model, ResidentDispatcher(store))
    hinted = greedy_run(model, HintRecorder(store))
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(plain, hinted, strict=True))
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(plain, hinted, strict=True))
    assert not torch.equal(plain[-1].logits, plain[-3].logits)  # the steps differ: the comparison can fail


def test_v4_hash_routed_hints_are_exact(families):
    model = families("deepseek_v4")[0].model
    dispatcher = model.dispatcher
    hashed = {layer.layer for layer in model.layers[1:] if layer.ffn.gate.hashed}
    assert hashed, "the tiny V4 needs a hash-routed layer after the first"
    try:
        pairs = list(hinted_pairs(greedy_run(model, HintRecorder(dispatcher.store)), hashed))
    finally:
        model.use_dispatcher(dispatcher)
    assert len(pairs) == STEPS * len(GROUPS) * len(hashed)
    for c, layer, hinted, dispatched in pairs:
        assert torch.equal(hinted, dispatched)
        assert torch.equal(hinted, model.layers[layer].ffn.gate.tid2eid[c.tokens].long())
    print(f"\nV4 hash-routed next layers {sorted(hashed)}: recall 1.0 ({len(pairs)} hints)")


# --- the learned routers' predictor, recomputed by hand ---------------------------------------------------


@contextmanager
def no_selection_bias(gate):
    """``gate`` with its correction bias (V3 ``e_score_correction_bias``, V4 ``bias``) zeroed, if it has one."""
    name = next((n for n in ("e_score_correction_bias", "bias") if getattr(gate, n, None) is not None), None)
    if name is None:
        yield
        return
    bias = getattr(gate, name)
    saved = bias.detach().clone()
    with torch.no_grad():
        bias.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def prenorm_by_hand(model, monkeypatch) -> Callable:
    """Records each layer's residual at its MoE input, per decode call; returns ``predict(call, layer, ahead,
    tokens)``: ``ahead``'s post-attention norm and router applied to ``layer``'s residual in decode call ``call``."""
    residuals: dict[int, list[torch.Tensor]] = {}
    real = SegmentedDecoderLayer.decode_post_attention

    def recorded(self, x, out):
        h, y = real(self, x, out)
        residuals.setdefault(self.layer, []).append(h.clone())
        return h, y

    monkeypatch.setattr(SegmentedDecoderLayer, "decode_post_attention", recorded)

    def predict(call: int, layer: int, ahead: int, tokens: torch.Tensor) -> torch.Tensor:
        target = model.layers[ahead]
        return target.mlp.gate(target.post_attention_layernorm(residuals[layer][call]))[0]

    return predict


def v4_by_hand(model, monkeypatch) -> Callable:
    """Records each layer's :meth:`decode_post` outputs, per decode call; returns ``predict(call, layer, ahead,
    tokens)``: ``ahead``'s ``ffn_hc`` and ``ffn_norm`` (its MoE input) of ``layer``'s output streams with a zero
    routed output (its shared expert's kept), then ``ahead``'s router."""
    outputs: dict[int, list[tuple]] = {}
    real = DeepseekV4DecoderLayer.decode_post

    def recorded(self, *args):
        out = real(self, *args)
        outputs.setdefault(self.layer, []).append(out)
        return out

    monkeypatch.setattr(DeepseekV4DecoderLayer, "decode_post", recorded)

    def predict(call: int, layer: int, ahead: int, tokens: torch.Tensor) -> torch.Tensor:
        streams, post, comb, x, *_ = outputs[layer][call]
        shared = model.layers[layer].ffn.shared(x)  # decode_post leaves it to the dispatch (beside the experts)
        routed = torch.zeros_like(streams[:, 0])
        estimate = DeepseekV4DecoderLayer.finish_ffn(streams, post, comb, routed, shared)
        target = model.layers[ahead]
        return target.ffn.gate(target.ffn_input(estimate)[2], tokens)[0]

    return predict


def router(model, layer: int):
    return model.layers[layer].ffn.gate if isinstance(model, DeepseekV4ForCausalLM) else model.layers[layer].mlp.gate


@torch.no_grad()
def test_learned_router_hints_follow_the_predictor_formula(model, monkeypatch):
    v4 = isinstance(model, DeepseekV4ForCausalLM)
    predict = (v4_by_hand if v4 else prenorm_by_hand)(model, monkeypatch)
    moe = moe_layers(model)
    previous = dict(zip(moe[1:], moe, strict=False))
    learned = {layer for layer in moe[1:] if not getattr(router(model, layer), "hashed", False)}
    calls = greedy_run(model, HintRecorder(model.dispatcher.store))
    checked, bias_matters = 0, False
    for call, c in enumerate(c for c in calls if c.decode):
        for layer, hinted in c.ids("hint").items():
            if layer in learned:
                by_hand = predict(call, previous[layer], layer, c.tokens)
                assert torch.equal(hinted.sort(-1).values, by_hand.sort(-1).values)
                with no_selection_bias(router(model, layer)):
                    unbiased = predict(call, previous[layer], layer, c.tokens)
                bias_matters |= not torch.equal(hinted.sort(-1).values, unbiased.sort(-1).values)
                checked += 1
    assert checked == STEPS * len(GROUPS) * len(learned)
    # The DeepSeek routers' selection bias is part of the prediction: without it some picks differ.
    assert bias_matters == (type(model).__name__ != "Qwen3MoeForCausalLM")
    token, expert, hints = recall(hinted_pairs(calls, learned))
    layout = model.dispatcher.store.layout
    print(
        f"\n{type(model).__name__} learned next-layer hints (layers {sorted(learned)}, top-{layout.top_k} of "
        f"{layout.num_experts}): token recall {token:.3f}, per-call expert recall {expert:.3f}, {hints} hints"
    )


# --- switching wants_hints under graphs -------------------------------------------------------------------


def count_predictions(model, monkeypatch) -> list[int]:
    """Counts calls of the predictor (each warm-up, capture and fake replay of a predicting segment runs it)."""
    cls, name = (
        (DeepseekV4DecoderLayer, "predict_routing")
        if isinstance(model, DeepseekV4ForCausalLM)
        else (SegmentedDecoderLayer, "predict_experts")
    )
    count = [0]
    real = getattr(cls, name)

    def counted(self, *args):
        count[0] += 1
        return real(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return count


def graphs_per_run(model) -> int:
    """Segments captured by one :func:`greedy_run`: every batch size's inputs and final segments and, per layer, V4's
    one whole-layer graph (contiguous caches) or the others' pre and post."""
    per_layer = 1 if type(model).__name__ == "DeepseekV4ForCausalLM" else 2
    return (per_layer * len(model.layers) + 2) * len(GROUPS)


def test_switching_hints_recaptures_the_graphs(model, monkeypatch):
    """Graphs captured for one choice never replay for the other: each switch drops and recaptures them all."""
    store = model.dispatcher.store
    eager = greedy_run(model, HintRecorder(store))  # on the CPU the segments run eagerly
    eager_hints = [e for c in eager for e in c.events if e[0] == "hint"]
    monkeypatch.setattr(model, "graphs", graphs := FakeGraphs(warmup=1))
    predictions = count_predictions(model, monkeypatch)
    per_switch = graphs_per_run(model)
    for wants in (False, True, False, True):
        captures, predictions[0] = graphs.captures, 0
        calls = greedy_run(model, HintRecorder(store, wants))
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(calls, eager, strict=True))
        hints = [e for c in calls for e in c.events if e[0] == "hint"]
        if wants:
            assert [h[1] for h in hints] == [h[1] for h in eager_hints]
            assert all(torch.equal(a[2], b[2]) for a, b in zip(hints, eager_hints, strict=True))
        else:
            assert hints == [] and predictions[0] == 0  # no graph still computing them
        assert graphs.captures == captures + per_switch and graphs.failures == {}


# --- CUDA (run on the GPU machine) -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def cuda_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"cuda_hints_{request.param}")
    _write_tiny(request.param, path)
    return load_model(path, ModelLoadConfig(dtype=torch.float32, device="cuda"), progress=False).model


def assert_same_run(graphed: list[Call], eager: list[Call]) -> None:
    """Same tokens, hints (order, layers, ids) and dispatched ids; logits within fp32 noise."""
    for a, b in zip(graphed, eager, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert [e[:2] for e in a.events] == [e[:2] for e in b.events]
        assert all(torch.equal(x[2], y[2]) for x, y in zip(a.events, b.events, strict=True))
        assert relative_error(a.logits, b.logits) <= 1e-5


@pytest.mark.gpu
def test_cuda_graph_hints_equal_eager_hints(cuda_model):
    store = cuda_model.dispatcher.store
    cuda_model.graphs = SegmentGraphs(enabled=False)
    eager = greedy_run(cuda_model, HintRecorder(store))
    cuda_model.graphs = graphs = SegmentGraphs(enabled=True)
    graphed = greedy_run(cuda_model, HintRecorder(store))
    assert graphs.failures == {}  # the predictions captured: no host sync in them
    assert graphs.captures == graphs_per_run(cuda_model) and graphs.replays > 0
    hints = [e for c in graphed for e in c.events if e[0] == "hint"]
    assert hints and all(ids.is_cuda and ids.dtype == torch.int64 for _, _, ids in hints)
    assert_same_run(graphed, eager)


@pytest.mark.gpu
def test_cuda_dispatcher_swap_recaptures(cuda_model):
    """Resident (no hints) -> hints -> resident -> hints with graphs on: each run as its eager twin."""
    store = cuda_model.dispatcher.store
    cuda_model.graphs = SegmentGraphs(enabled=False)
    eager = {wants: greedy_run(cuda_model, HintRecorder(store, wants)) for wants in (False, True)}
    cuda_model.graphs = graphs = SegmentGraphs(enabled=True)
    for wants in (False, True, False, True):
        captures = graphs.captures
        assert_same_run(greedy_run(cuda_model, HintRecorder(store, wants)), eager[wants])
        assert graphs.captures == captures + graphs_per_run(cuda_model)
    assert graphs.failures == {}
