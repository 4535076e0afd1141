"""One DeepSeek-V4 decode step (one new token per sequence) as segments: a CUDA graph per layer.

Decode of a few streams is bound by launches (issue 4: a 3-layer scaled V4-Flash step took 12.6 ms of wall
time for ~2 ms of GPU work on an H200, ~670 kernels plus their Python). A step runs as

    inputs    graph   embedding, residual streams, the rotations of the step's positions (token ids and
                      positions passed through: every later segment reads them in place)
    per layer, contiguous states (the default):
      layer   graph   the previous layer's MoE output merged into the streams, attn_hc + norm, the fused
                      projections, the rotated queries; the fixed-shape attention
                      (:mod:`deepseek_v4_static_decode`: ring window, compressors, indexer top-k over a
                      power-of-two bucket of entries, masked sink attention; every write in place at rows the
                      device computes from the positions); rotate back, output projection, mHC merge, ffn_hc
                      + norm, router, shared expert; the next layer's predicted experts for a dispatcher that
                      wants hints (:meth:`DeepseekV4DecoderLayer.predict_routing`)
    per layer, paged states:
      pre     graph   the layer's first half above, up to the rotated queries
      core    eager   the eager attention core (:mod:`deepseek_v4_attention_decode`)
      post    graph   the layer's second half above, from rotating back
    then
      experts eager   the dispatcher (its tiers decide on the host from the routing), after the hint; for
                      a dispatcher that is ``graphable`` for the batch (resident experts with device-built
                      launch tables, a tiered dispatcher's mapped step), inside the layer's (or post's) graph
                      instead, with the hint after it where it ``wants_graph_hints``
                      (:func:`~moetier.models.decode_segments.decode_plan`)
    final     graph   the last MoE output merged in, hyper-head, final norm

through :class:`~moetier.models.graph_segments.SegmentGraphs`. A whole layer's graph reads and writes the
sequences' own state tensors (allocated once: fixed addresses), so it is keyed by layer, the sequences (their
caches' serials) and the entry bucket: a sequence's first decode step warms it up, the second captures it,
and a bucket that doubles captures it again (a handful of times over a long session); a finished sequence's
graphs are dropped with it (:meth:`SegmentGraphs.track`). Pre and post are keyed by segment, layer and batch
size. Segments hand their outputs straight to the next one (read in place); only the eager parts' results and
the step's token ids and positions are copied in. The math is the layers' own (``decode_pre``, ``decode_post``,
the attention's ``decode_*`` methods), the same the one-call forward uses; without CUDA, or with graphs off,
the segments run eagerly, so the CPU tests of this path test the graphed math.

A step the dispatcher marks (:meth:`~moetier.tiers.dispatcher.ExpertDispatcher.decode_halves`) runs its layers over
two halves of the batch instead, alternating on two streams (:mod:`moetier.models.deepseek_v4_halves`).

Expert hints, as in :mod:`moetier.models.decode_segments`: every V4 layer is a MoE layer, so each but the last
hands ``dispatcher.hint(L + 1, ids)`` the next layer's predicted experts (exact for a hash-routed next layer)
before its own dispatch (after the post segment holding it, for calls in graphs), and ``await_hint(L)`` comes
before the work holding layer ``L``'s call; the graphs are captured with or without the predictions, never both
(:func:`~moetier.models.decode_segments.decode_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from moetier.kernels.hyper_mix import Merge
from moetier.models import deepseek_v4_static_decode as static_decode
from moetier.models.base import ForwardBatch, SequenceSlice
from moetier.models.decode_segments import DecodePlan, decode_plan
from moetier.models.deepseek_v4_attention import Projections
from moetier.models.deepseek_v4_halves import halves_plan, halves_wanted, run_halves
from moetier.models.deepseek_v4_rope import StepRope, rotations_from
from moetier.models.graph_segments import SegmentGraphs
from moetier.profiling import phase

if TYPE_CHECKING:
    from moetier.models.deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4ForCausalLM

Carry = tuple[torch.Tensor | None, ...]  # the streams, or a layer's (streams, post, comb, routed, shared)


def decode_step(model: DeepseekV4ForCausalLM, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Final hidden states ``[B, H]`` (a fresh tensor) of ``batch``, whose ``B`` sequences bring one token each;
    every layer's state is appended to. The caller advances the caches."""
    graphs, size = model.graphs, len(batch.slices)
    layers = list(model.layers)
    with model.dispatcher.decode_step(size, model.embed.weight.dtype) as experts:
        plan = decode_plan(graphs, model.dispatcher, size, experts)
        halves = halves_wanted(model, batch, plan)
        if halves:  # no hints, experts eagerly, graphs of their own (decode_halves' contract)
            plan = halves_plan(graphs)
        # Each layer predicts the next one's experts (the last none), when the dispatcher wants hints.
        targets = (layers[1:] + [None]) if plan.hints else [None] * len(layers)
        inputs = graphs.run(("inputs", size), model.decode_inputs, input_ids, batch.positions)
        ids, positions, streams, *rope_tensors = inputs
        rope = StepRope(positions, rotations_from(tuple(rope_tensors)), model.rope_tables["compress"])
        serials = tuple(s.cache.serial for s in batch.slices)
        for serial, piece in zip(serials, batch.slices, strict=True):  # a finished sequence's graphs go with it
            graphs.track(serial, piece.cache)
        step = Step(graphs, ids, tuple(rope_tensors), rope, batch.slices, plan, model.embed.weight.dtype, serials)
        if halves:
            carry = run_halves(step, layers, streams, model.dispatcher)
        else:
            carry: Carry = (streams,)
            for layer, ahead in zip(layers, targets, strict=True):
                carry = _layer_step(step, layer, ahead, carry)
        (hidden,) = graphs.run(("final", size), partial(_final, model), *carry)
        return graphs.fresh(hidden)


@dataclass(frozen=True)
class Step:
    """What every layer of one decode step shares: the graphs, the token ids and positions (the inputs
    segment's outputs, read in place), the rotations, the batch, the step's plan and the caches' serials."""

    graphs: SegmentGraphs
    ids: torch.Tensor
    rope_tensors: tuple[torch.Tensor, ...]
    rope: StepRope
    slices: list[SequenceSlice]
    plan: DecodePlan
    dtype: torch.dtype
    serials: tuple[int, ...]  # the sequences' caches (the fixed-shape layers' graph keys and tags)

    @property
    def caches(self) -> list:
        return [s.cache for s in self.slices]

    def states(self, layer: DeepseekV4DecoderLayer) -> list:
        """``layer``'s state in each of the step's sequences."""
        return [cache.layers[layer.layer] for cache in self.caches]


def _layer_step(step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, carry: Carry) -> Carry:
    """One layer (with ``ahead``, the layer it predicts, its hint) -> its carry: its segments, then its experts."""
    return layer_experts(step, layer, ahead, layer_segments(step, layer, ahead, carry))


def layer_segments(
    step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, carry: Carry
) -> tuple:
    """A layer's segments -> their outputs. Contiguous states: the whole layer is one segment, its attention the
    fixed-shape step (:mod:`deepseek_v4_static_decode`); otherwise pre (graph), the attention core (eager), post
    (graph). The routed experts run inside the (last) segment with ``plan.experts_in_graphs``."""
    states = step.states(layer)
    if static_decode.supports(states):
        if step.plan.hints and step.plan.experts_in_graphs:  # reads ahead: the attention runs beside the copies
            return _static_layer_then_post(step, layer, ahead, carry, states)
        return _static_layer(step, layer, ahead, carry, states)
    return _split_layer(step, layer, ahead, carry, states)


def layer_experts(
    step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, outputs: tuple
) -> Carry:
    """:func:`layer_segments`' outputs -> the layer's carry: the routed experts dispatched eagerly (after the hint),
    unless they ran inside the segment."""
    index, experts_in_graph = layer.layer, step.plan.experts_in_graphs
    dispatcher = layer.ffn.dispatcher
    if experts_in_graph:  # the routed experts ran inside the segment: its outputs are the carry (and the hint)
        if ahead is not None:
            dispatcher.hint(ahead.layer, outputs[5])
        return outputs[:5]
    streams, post, comb, x, topk_ids, weights, shared, *predicted = outputs
    if ahead is not None:  # before this layer's dispatch: the next layer's copies can start while it computes
        dispatcher.hint(ahead.layer, predicted[0])
    if step.plan.hints:
        dispatcher.await_hint(index)
    with phase("v4.dispatch"):
        routed = dispatcher.dispatch(index, x, topk_ids, weights)
    return streams, post, comb, routed, shared


def _split_layer(
    step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, carry: Carry, states: list
) -> tuple:
    """Pre (graph), the eager attention core, post (graph) -> post's outputs."""
    index, size, graphs = layer.layer, len(step.slices), step.graphs
    pre = graphs.run(("pre", index, size), partial(_pre, layer, len(carry)), *carry, *step.rope_tensors)
    streams, post, comb, q, index_q = pre[:5]
    with phase("v4.attend"):
        out = layer.attn.decode_attend(q, index_q, Projections(*pre[5:]), step.rope, states)
    if step.plan.hints and step.plan.experts_in_graphs:
        layer.ffn.dispatcher.await_hint(index)
    post_fn = partial(_post, layer, ahead, step.plan.experts_in_graphs)
    return graphs.run(("post", index, size), post_fn, out, streams, post, comb, step.ids, *step.rope_tensors)


def _static_layer(
    step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, carry: Carry, states: list
) -> tuple:
    """The whole layer as one segment, keyed by the sequences (their states' fixed tensors) and the entry bucket
    -> post's outputs; the host's counts follow after."""
    key, bucket = _static_key("layer", step, layer, states)
    fn = partial(_whole_layer, layer, ahead, step.plan.experts_in_graphs, len(carry), states, bucket, step.rope)
    outputs = step.graphs.run(key, fn, *carry, *step.rope_tensors, step.rope.positions, step.ids, tags=step.serials)
    static_decode.advance(states)
    return outputs


def _static_layer_then_post(
    step: Step, layer: DeepseekV4DecoderLayer, ahead: DeepseekV4DecoderLayer | None, carry: Carry, states: list
) -> tuple:
    """The layer as two segments, for a step whose calls run in the graphs and read ahead: up to the attention's
    output (keyed as :func:`_static_layer`), then, once the device has read this layer's predicted experts ahead
    (:meth:`~moetier.tiers.dispatcher.ExpertDispatcher.await_hint`), the post segment with the call. The reads
    ahead start after the previous layer's call, so the attention runs while they copy (one segment would wait for
    them before the attention: an H100 step at 4 streams waited 0.82 ms a joined layer, every copy's whole time,
    results/h100-20261207-e7ce4cc-halves-first)."""
    key, bucket = _static_key("layer attention", step, layer, states)
    fn = partial(_attention, layer, len(carry), states, bucket, step.rope)
    tensors = (*carry, *step.rope_tensors, step.rope.positions)
    out, streams, post, comb = step.graphs.run(key, fn, *tensors, tags=step.serials)
    static_decode.advance(states)
    layer.ffn.dispatcher.await_hint(layer.layer)
    post_fn = partial(_post, layer, ahead, True)
    post_key = ("static post", layer.layer, len(states))
    return step.graphs.run(post_key, post_fn, out, streams, post, comb, step.ids, *step.rope_tensors)


def _static_key(name: str, step: Step, layer: DeepseekV4DecoderLayer, states: list) -> tuple[tuple, int]:
    """A fixed-shape segment's graph key (the sequences, their entry bucket and rotation table) and the bucket."""
    bucket = static_decode.entry_bucket(states)
    return (name, layer.layer, len(states), bucket, step.serials, entry_table(step, layer, states)), bucket


def entry_table(step: Step, layer: DeepseekV4DecoderLayer, states: list) -> int:
    """The compressed entries' rotation table grown now to the largest store's capacity (a graph must not grow it), and
    its address (part of the key: a table grown for a longer sequence is a new tensor); 0 without a compressor."""
    compressor = layer.attn.compressor
    if compressor is None:
        return 0
    capacity = static_decode.entry_capacity(states)
    return step.rope.compress.entry_table(capacity, compressor.rate, step.dtype).data_ptr()


def _whole_layer(
    layer: DeepseekV4DecoderLayer,
    ahead: DeepseekV4DecoderLayer | None,
    experts_in_graph: bool,
    carried: int,
    states: list,
    bucket: int,
    rope: StepRope,
    *tensors: torch.Tensor | None,
) -> tuple:
    """Segment: ``carried`` carry tensors, the rotations' tensors, the positions and the token ids -> what
    :func:`_post` returns, through :func:`_attention`."""
    out, streams, post, comb = _attention(layer, carried, states, bucket, rope, *tensors[:-1])
    return _post(layer, ahead, experts_in_graph, out, streams, post, comb, tensors[-1], *tensors[carried:-2])


def _attention(
    layer: DeepseekV4DecoderLayer, carried: int, states: list, bucket: int, rope: StepRope, *tensors: torch.Tensor
) -> tuple:
    """Segment: ``carried`` carry tensors, the rotations' tensors and the positions -> the attention's output and
    the streams, post and comb :func:`_post` takes, through :func:`_pre` and the fixed-shape attention."""
    positions = tensors[-1]
    pre = _pre(layer, carried, *tensors[:-1])
    streams, post, comb, q, index_q = pre[:5]
    inputs = Projections(*pre[5:])
    out = static_decode.attend(layer.attn, q, index_q, inputs, positions, rope.compress, states, bucket)
    return out, streams, post, comb


def carry_merge(carry: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, Merge | None]:
    """A decode carry as streams and what is still to merge into them: ``(streams,)`` is complete; a layer's
    ``(streams, post, comb, routed, shared)`` still needs its MoE output (routed + shared) merged in
    (:meth:`DeepseekV4DecoderLayer.finish_ffn`), which the next hyper-connection's kernels do."""
    if len(carry) == 1:
        return carry[0], None
    streams, post, comb, routed, shared = carry
    return streams, Merge(post, comb, routed, shared)


def _pre(layer: DeepseekV4DecoderLayer, carried: int, *tensors: torch.Tensor | None) -> tuple:
    """Segment: ``carried`` carry tensors then the rotations' -> streams, post, comb, q, index_q, projections."""
    streams, post, comb, q, index_q, inputs = layer.decode_pre(tensors[:carried], rotations_from(tensors[carried:]))
    inputs = layer.attn.decode_projections(inputs)
    projected = (inputs.q_residual, inputs.kv, inputs.kv_gate, inputs.index_kv_gate, inputs.index_weights)
    return streams, post, comb, q, index_q, *projected


def _post(
    layer: DeepseekV4DecoderLayer,
    ahead: DeepseekV4DecoderLayer | None,
    experts_in_graph: bool,
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    ids: torch.Tensor,
    *rope_tensors: torch.Tensor,
) -> tuple:
    """Segment: :meth:`DeepseekV4DecoderLayer.decode_post` with the rotations passed as tensors and the shared
    expert's output, then (with ``ahead``) ``ahead``'s predicted expert ids; with ``experts_in_graph`` the routed
    experts too, the shared expert beside them (:meth:`ExpertDispatcher.dispatch_beside`; the layer's carry,
    ``(streams, post, comb, routed, shared)``, then the prediction)."""
    outputs = layer.decode_post(out, rotations_from(rope_tensors), streams, post, comb, ids)
    streams, post, comb, x, topk_ids, weights = outputs
    if experts_in_graph:
        dispatcher = layer.ffn.dispatcher
        routed, shared = dispatcher.dispatch_beside(layer.layer, x, topk_ids, weights, partial(layer.ffn.shared, x))
        carry = streams, post, comb, routed, shared
        return carry if ahead is None else (*carry, ahead.predict_routing(streams, post, comb, shared, ids))
    shared = layer.ffn.shared(x)
    if ahead is None:
        return *outputs, shared
    return *outputs, shared, ahead.predict_routing(streams, post, comb, shared, ids)


def _final(model: DeepseekV4ForCausalLM, *carry: torch.Tensor | None) -> torch.Tensor:
    """Segment: the last layer's carry (its MoE output merged in here) -> the final hidden states."""
    streams, merge = carry_merge(carry)
    return model.hc_head.mix(streams, model.norm, merge)
