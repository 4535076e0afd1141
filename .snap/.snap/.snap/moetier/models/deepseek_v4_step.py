"""One DeepSeek-V4 decode step (one new token per sequence) as segments: CUDA graphs around the eager parts.

Decode of a few streams is bound by launches (issue 4: a 3-layer scaled V4-Flash step took 12.6 ms of wall
time for ~2 ms of GPU work on an H200, ~670 kernels plus their Python). A step runs as

    inputs    graph   embedding, residual streams, the rotations of the step's positions
    per layer:
      pre     graph   the previous layer's MoE output merged into the streams, attn_hc + norm, the fused
                      projections of x, the rotated queries (the attention's and the indexer's), the
                      indexer's head weights as it scores with them
      core    eager   each sequence's window and compressors' rows, then batched over the sequences: the
                      windows that close, the indexer's scores, the padded sink attention
      post    graph   rotate back, output projection, mHC merge, ffn_hc + norm, router, shared expert; for a
                      dispatcher that wants hints, the next layer's predicted experts
                      (:meth:`DeepseekV4DecoderLayer.predict_routing`)
      experts eager   the dispatcher (its tiers decide on the host from the routing), after the hint; for
                      a dispatcher that is ``graphable`` for the batch (resident experts with device-built
                      launch tables, a tiered dispatcher's mapped step), inside post instead, with the
                      hint after post where it ``wants_graph_hints``
                      (:func:`~moetier.models.decode_segments.decode_plan`)
    final     graph   the last MoE output merged in, hyper-head, final norm

through :class:`~moetier.models.graph_segments.SegmentGraphs`, keyed by segment, layer and batch size: at
most one capture per (segment, layer, batch size). Segments hand their outputs straight to the next one
(read in place); only the eager parts' results and the step's token ids and positions are copied in. The
math is the layers' own (:meth:`DeepseekV4DecoderLayer.decode_pre` and ``decode_post``, the attention's
``decode_*`` methods), the same the one-call forward uses; without CUDA, or with graphs off, the segments
run eagerly, so the CPU tests of this path test the graphed math.

Expert hints, as in :mod:`moetier.models.decode_segments`: every V4 layer is a MoE layer, so each but the last
hands ``dispatcher.hint(L + 1, ids)`` the next layer's predicted experts (exact for a hash-routed next layer)
before its own dispatch (after the post segment holding it, for calls in graphs), and ``await_hint(L)`` comes
before the work holding layer ``L``'s call; the graphs are captured with or without the predictions, never both
(:func:`~moetier.models.decode_segments.decode_plan`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from moetier.models.base import ForwardBatch
from moetier.models.decode_segments import DecodePlan, decode_plan
from moetier.models.deepseek_v4_attention import Projections
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
        # Each layer predicts the next one's experts (the last none), when the dispatcher wants hints.
        targets = (layers[1:] + [None]) if plan.hints else [None] * len(layers)
        ids, streams, *rope_tensors = graphs.run(("inputs", size), model.decode_inputs, input_ids, batch.positions)
        rope = StepRope(batch.positions, rotations_from(tuple(rope_tensors)), model.rope_tables["compress"])
        carry: Carry = (streams,)
        for layer, ahead in zip(layers, targets, strict=True):
            carry = _layer_step(graphs, layer, ahead, carry, ids, tuple(rope_tensors), rope, batch, plan)
        (hidden,) = graphs.run(("final", size), partial(_final, model), *carry)
        return graphs.fresh(hidden)


def _layer_step(
    graphs: SegmentGraphs,
    layer: DeepseekV4DecoderLayer,
    ahead: DeepseekV4DecoderLayer | None,
    carry: Carry,
    ids: torch.Tensor,
    rope_tensors: tuple[torch.Tensor, ...],
    rope: StepRope,
    batch: ForwardBatch,
    plan: DecodePlan,
) -> Carry:
    """One layer: pre (graph), attention core (eager), post (graph; with ``ahead``, the layer it predicts, its
    hint), routed experts (eager, or with ``plan.experts_in_graphs`` inside post) -> its carry."""
    index, size, experts_in_graph = layer.layer, len(batch.slices), plan.experts_in_graphs
    dispatcher = layer.ffn.dispatcher
    pre = graphs.run(("pre", index, size), partial(_pre, layer, len(carry)), *carry, *rope_tensors)
    streams, post, comb, q, index_q = pre[:5]
    states = [s.cache.layers[index] for s in batch.slices]
    with phase("v4.attend"):
        out = layer.attn.decode_attend(q, index_q, Projections(*pre[5:]), rope, states)
    post_fn = partial(_post, layer, ahead, experts_in_graph)
    if plan.hints and experts_in_graph:  # what a hint for this layer started, before the segment holding its call
        dispatcher.await_hint(index)
    outputs = graphs.run(("post", index, size), post_fn, out, streams, post, comb, ids, *rope_tensors)
    if experts_in_graph:  # the routed experts ran inside post: its outputs are the carry (and the hint)
        if ahead is not None:
            dispatcher.hint(ahead.layer, outputs[5])
        return outputs[:5]
    streams, post, comb, x, topk_ids, weights, shared, *predicted = outputs
    if ahead is not None:  # before this layer's dispatch: the next layer's copies can start while it computes
        dispatcher.hint(ahead.layer, predicted[0])
    if plan.hints:
        dispatcher.await_hint(index)
    with phase("v4.dispatch"):
        routed = dispatcher.dispatch(index, x, topk_ids, weights)
    return streams, post, comb, routed, shared


def _settle(layer: DeepseekV4DecoderLayer, carry: Carry) -> torch.Tensor:
    """The residual streams a carry stands for (merging a layer's MoE output in)."""
    return carry[0] if len(carry) == 1 else layer.finish_ffn(*carry)


def _pre(layer: DeepseekV4DecoderLayer, carried: int, *tensors: torch.Tensor | None) -> tuple:
    """Segment: ``carried`` carry tensors then the rotations' -> streams, post, comb, q, index_q, projections."""
    streams = _settle(layer, tensors[:carried])
    post, comb, q, index_q, inputs = layer.decode_pre(streams, rotations_from(tensors[carried:]))
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
    """Segment: :meth:`DeepseekV4DecoderLayer.decode_post` with the rotations passed as tensors, then (with
    ``ahead``) ``ahead``'s predicted expert ids; with ``experts_in_graph`` the routed experts too (the layer's
    carry, ``(streams, post, comb, routed, shared)``, then the prediction)."""
    outputs = layer.decode_post(out, rotations_from(rope_tensors), streams, post, comb, ids)
    if experts_in_graph:
        streams, post, comb, x, topk_ids, weights, shared = outputs
        carry = streams, post, comb, layer.ffn.dispatcher.dispatch(layer.layer, x, topk_ids, weights), shared
        return carry if ahead is None else (*carry, ahead.predict_routing(streams, post, comb, shared, ids))
    if ahead is None:
        return outputs
    streams, post, comb, *_, shared = outputs
    return *outputs, ahead.predict_routing(streams, post, comb, shared, ids)


def _final(model: DeepseekV4ForCausalLM, *carry: torch.Tensor | None) -> torch.Tensor:
    """Segment: the last layer's output streams -> the final hidden states."""
    return model.final_hidden(_settle(model.layers[-1], carry))
