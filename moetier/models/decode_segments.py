"""Pre-norm MoE decoders (Qwen3-MoE, DeepSeek-V3): the layer cut into pieces, and the decode step as segments.

A decode step of a few streams is bound by kernel launches (the V4 step, :mod:`deepseek_v4_step`, went from
303 to 79 launches per step under CUDA graphs). Here the layers of the Llama-style families are cut where
per-sequence cache work or host decisions start, and a step where every sequence brings one token runs as

    inputs    graph   embedding, rope cos/sin of the step's positions
    per layer:
      pre     graph   the previous layer's MoE output added to the residual, input norm, the attention's
                      projections (q/k norms, rope of the new token)
      attend  eager   each sequence's cache write, then one attention over all sequences' (padded) keys
      post    graph   output projection, residual, post-attention norm, then the router and shared expert
                      (a MoE layer) or the whole dense MLP and its residual (a dense layer); for a dispatcher
                      that wants hints, also the next MoE layer's predicted experts (below)
      experts eager   the dispatcher (its tiers decide on the host from the routing), after the hint; where
                      the dispatcher's ``decode_step`` says the step's calls may run in graphs (resident
                      experts, a tiered dispatcher's mapped step), inside post instead, with hints only
                      where it ``wants_graph_hints`` (handed over after post; :func:`decode_plan`: no host
                      wait anywhere in the layer but the attention's)
    final     graph   the last MoE output added in, final norm

through the model's :class:`~moetier.models.graph_segments.SegmentGraphs`, keyed by segment, layer and batch
size. Segments hand their outputs straight on (read in place); only the token ids, positions, attention
outputs and routed-expert outputs are copied in.

One implementation of the math: when every sequence brings one token, :class:`SegmentedDecoderLayer`'s
one-call ``forward`` is the composition of the very methods the segments call, on the same shapes, so both
paths give identical numbers (other batches run :class:`PreNormDecoderLayer`'s forward, per sequence, as
before). Without CUDA, or with graphs off, the segments run eagerly: the CPU tests of this path test the
graphed math.

Expert hints (``ExpertDispatcher.wants_hints``): a MoE layer ``L`` followed by a MoE layer ``L'`` predicts
``L'``'s experts with the standard next-layer predictor, ``L'``'s own post-attention norm and router applied to
the residual at ``L``'s MoE input (``L'``'s attention and ``L``'s MoE output are not known yet), inside ``L``'s
post segment (an extra output: no host sync), and hands them to ``dispatcher.hint(L', ids)`` before
dispatching ``L``, so a tiered dispatcher can copy ``L'``'s missing experts while ``L`` and ``L'``'s attention
run. Where ``L``'s call runs inside post (``wants_graph_hints``: a mapped step's reads ahead on the device), the
hint follows post instead, and before the segment or call that runs ``L'``'s experts the model calls
``dispatcher.await_hint(L')``. Without hints the segments compute nothing extra; the graphs are captured for one
choice at a time (:func:`decode_plan`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from moetier.models.base import ForwardBatch, SequenceCache, SequenceSlice
from moetier.models.layers import PreNormDecoderLayer, apply_rope, prenorm_stack_forward, rope_cos_sin

if TYPE_CHECKING:
    from moetier.models.graph_segments import SegmentGraphs
    from moetier.tiers.dispatcher import ExpertDispatcher

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, rot_dim] each
MaybeTensor = torch.Tensor | None
# A layer's output as the next segment receives it: (residual,) or, after a MoE layer, (residual before the
# MoE, routed experts' output, shared experts' output or None) (the sum is left to the next segment).
Carry = tuple[MaybeTensor, ...]


def apply_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate token-major ``x`` (``[T, heads, D]``) with ``cos``/``sin`` of shape ``[T, D]``."""
    return apply_rope(x, cos[:, None], sin[:, None])


def padding_mask(positions: torch.Tensor, lengths: list[int]) -> torch.Tensor | None:
    """``[B, max(lengths)]`` bool, True past each sequence's keys (the padding of :func:`stack_padded`), for one
    token per sequence at ``positions`` ``[B]`` with ``lengths[b]`` keys each (``positions + 1``); None when
    nothing is padded (one sequence, or equal lengths)."""
    if min(lengths) == max(lengths):
        return None
    # From the device's positions: no host-to-device copy of the lengths.
    return torch.arange(max(lengths), device=positions.device)[None, :] > positions[:, None]


def is_decode(slices: list[SequenceSlice]) -> bool:
    """Whether every sequence brings exactly one token (a decode step)."""
    return all(s.length == 1 for s in slices)


def combine_experts(routed: torch.Tensor, shared: MaybeTensor) -> torch.Tensor:
    """A MoE block's output: the routed experts' plus the shared experts' (when the block has them)."""
    return routed if shared is None else routed + shared


class SplitAttention(Protocol):
    """An attention module's decode path (one token per sequence, ``B`` sequences), cut for segments.

    ``forward(x, rope, cache)`` runs one sequence's rows (any number; prefill). For decode,
    ``decode_project(x, rope)`` maps the normed rows ``[B, H]`` to tensors with the sequences on dim 0 (rope
    applied) and ``decode_output(out)`` maps the attention output back to ``[B, H]``: both are capturable.
    ``decode_attend(*projected, caches, positions)`` appends each sequence's row to its cache and attends
    (eagerly: it depends on the caches' lengths and storage).
    """

    def decode_project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]: ...

    def decode_attend(self, *args: torch.Tensor | list[SequenceCache]) -> torch.Tensor: ...

    def decode_output(self, out: torch.Tensor) -> torch.Tensor: ...


class RoutedMoE(nn.Module):
    """A MoE block: a router (and optional shared experts) on the device, routed experts through the dispatcher.

    Subclasses set ``layer``, ``dispatcher`` (a plain attribute, as :meth:`CausalLM.use_dispatcher` expects) and
    the router ``gate`` (``gate(x) -> (ids, weights)``), and with shared experts override :meth:`shared`.
    """

    layer: int
    dispatcher: ExpertDispatcher
    gate: nn.Module

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The expert ids ``[T, k]`` :meth:`route` picks for ``x``, without the shared experts (a hint's
        prediction): the router's own selection, its correction bias included; capturable."""
        return self.gate(x)[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, MaybeTensor]:
        """``x`` ``[T, H]`` -> expert ids ``[T, k]``, their weights ``[T, k]``, shared experts' output (or None).
        Capturable: it runs inside the decode step's post segment."""
        return *self.gate(x), self.shared(x)

    def shared(self, x: torch.Tensor) -> MaybeTensor:
        """The shared experts' output for ``x`` (None without them). Default: None."""
        return None

    def experts_beside_shared(self, x: torch.Tensor) -> tuple[torch.Tensor, MaybeTensor]:
        """The routed experts' sum and the shared experts' output, the shared ones run wherever the dispatcher
        overlaps them best (:meth:`ExpertDispatcher.dispatch_beside`)."""
        ids, weights = self.gate(x)
        return self.dispatcher.dispatch_beside(self.layer, x, ids, weights, partial(self.shared, x))

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for ``x`` (the dispatcher decides where each expert runs)."""
        return self.dispatcher.dispatch(self.layer, x, ids, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights, shared = self.route(x)
        return combine_experts(self.experts(x, ids, weights), shared)


class SegmentedDecoderLayer(PreNormDecoderLayer):
    """:class:`PreNormDecoderLayer` (same parameter names) over a :class:`SplitAttention`. A decode batch runs
    the pieces a decode step's segments run (``forward`` is their composition); any other batch runs the
    parent's forward (each sequence's attention on its own)."""

    def __init__(self, layer: int, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__(hidden, eps, attention, mlp)
        self.layer = layer

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        """``rope`` covers every row of ``batch``; each sequence's attention runs against its own cache."""
        if not is_decode(batch.slices):
            return super().forward(x, rope, batch)
        h, y = self.decode_post_attention(x, self.decode_attend(self.decode_pre_attention(x, rope), batch))
        return h + self.mlp(y)

    def decode_pre_attention(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """The attention's decode projections of the residual ``x`` ``[B, H]`` (normed, roped)."""
        return self.self_attn.decode_project(self.input_layernorm(x), rope)

    def decode_attend(self, projected: tuple[torch.Tensor, ...], batch: ForwardBatch) -> torch.Tensor:
        """Each sequence's token appended to its cache, then attention over every sequence's keys."""
        return self.self_attn.decode_attend(*projected, [s.cache for s in batch.slices], batch.positions)

    def decode_post_attention(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual with the attention output ``out`` added, and its post-attention norm (the MLP's input)."""
        h = x + self.self_attn.decode_output(out)
        return h, self.post_attention_layernorm(h)

    def decode_mlp(self, h: torch.Tensor, y: torch.Tensor) -> tuple[MaybeTensor, ...]:
        """The capturable part of the MLP: ``(h + mlp(y),)`` for a dense MLP; for a MoE block ``(h, y, ids,
        weights, shared)``, whose routed experts run next (eagerly, :meth:`RoutedMoE.experts`)."""
        if isinstance(self.mlp, RoutedMoE):
            return h, y, *self.mlp.route(y)
        return (h + self.mlp(y),)

    def predict_experts(self, h: torch.Tensor) -> torch.Tensor:
        """This MoE layer's expert ids ``[B, k]`` predicted from ``h``, the residual at an earlier MoE layer's MoE
        input: this layer's post-attention norm and router selection applied to it (capturable)."""
        return self.mlp.select(self.post_attention_layernorm(h))


class PreNormModel(Protocol):
    """What :func:`prenorm_forward` needs of a family's model."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList  # of SegmentedDecoderLayer
    norm: nn.Module
    inv_freq: torch.Tensor  # on the model's device (a capture cannot copy it in)
    rope_factor: float
    graphs: SegmentGraphs
    segmented_decode: bool
    dispatcher: ExpertDispatcher


@dataclass(frozen=True)
class DecodePlan:
    """What this decode step's segments compute beyond their keys: next-layer hints, or the routed experts
    inside the post segments (what the dispatcher's :meth:`~ExpertDispatcher.decode_step` yielded for the step)."""

    hints: bool
    experts_in_graphs: bool


def decode_plan(
    graphs: SegmentGraphs, dispatcher: ExpertDispatcher, tokens: int, experts: Hashable | None
) -> DecodePlan:
    """This step's :class:`DecodePlan` for ``tokens`` sequences, ``experts`` being what the dispatcher's
    ``decode_step`` yielded (None: its calls run eagerly, with hints where it ``wants_hints``; read per step:
    a tiered dispatcher's route changes from step to step). Graphs are captured per plan
    (:meth:`SegmentGraphs.use_variant`), so no graph computes, or skips, predictions or experts stale."""
    in_graphs = tokens > 0 and experts is not None
    plan = DecodePlan(dispatcher.wants_graph_hints if in_graphs else dispatcher.wants_hints, in_graphs)
    graphs.use_variant(("expert hints", plan.hints, "experts in graphs", experts if in_graphs else None))
    return plan


def hint_targets(layers: nn.ModuleList, enabled: bool) -> list[SegmentedDecoderLayer | None]:
    """Per layer, the MoE layer whose experts it predicts: the next MoE layer after a MoE layer, None for dense
    layers, the last MoE layer, and every layer when hints are off."""
    targets: list[SegmentedDecoderLayer | None] = [None] * len(layers)
    if not enabled:
        return targets
    ahead = None
    for i in reversed(range(len(layers))):
        if isinstance(layers[i].mlp, RoutedMoE):
            targets[i], ahead = ahead, layers[i]
    return targets


def prenorm_forward(model: PreNormModel, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The model's forward: final hidden states ``[T, H]`` of ``batch``, whose caches are appended to and advanced.

    A step where every sequence brings one token runs as segments (:func:`decode_step`); anything else runs
    the layers' one-call forward."""
    if not (model.segmented_decode and is_decode(batch.slices)):
        return prenorm_stack_forward(model, input_ids, batch)
    hidden = decode_step(model, input_ids, batch)
    batch.advance()
    return hidden


def decode_step(model: PreNormModel, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Final hidden states ``[B, H]`` (a fresh tensor) of ``B`` sequences bringing one token each; every layer's
    cache is appended to. The caller advances the caches."""
    graphs, size = model.graphs, len(batch.slices)
    with model.dispatcher.decode_step(size, model.embed_tokens.weight.dtype) as experts:
        plan = decode_plan(graphs, model.dispatcher, size, experts)
        targets = hint_targets(model.layers, plan.hints)
        x, cos, sin = graphs.run(("inputs", size), partial(_inputs, model), input_ids, batch.positions)
        carry: Carry = (x,)
        for layer, ahead in zip(model.layers, targets, strict=True):
            carry = _layer_step(graphs, layer, ahead, carry, (cos, sin), batch, plan)
        (hidden,) = graphs.run(("final", size), partial(_final, model), *carry)
        return graphs.fresh(hidden)


def _layer_step(
    graphs: SegmentGraphs,
    layer: SegmentedDecoderLayer,
    ahead: SegmentedDecoderLayer | None,
    carry: Carry,
    rope: Rope,
    batch: ForwardBatch,
    plan: DecodePlan,
) -> Carry:
    """One layer: pre (graph), attention over the caches (eager), post (graph; with ``ahead``, the MoE layer it
    predicts, its hint), routed experts (eager, or with ``plan.experts_in_graphs`` inside post)."""
    size, in_graph, moe = len(batch.slices), plan.experts_in_graphs, isinstance(layer.mlp, RoutedMoE)
    x, *projected = graphs.run(("pre", layer.layer, size), partial(_pre, layer, len(carry)), *carry, *rope)
    out = layer.decode_attend(tuple(projected), batch)
    if plan.hints and moe and in_graph:  # what a hint for this layer started, before the segment holding its call
        layer.mlp.dispatcher.await_hint(layer.layer)
    post = graphs.run(("post", layer.layer, size), partial(_post, layer, ahead, in_graph), x, out)
    if len(post) == 1:  # a dense layer: the carry is complete
        return post
    if in_graph:  # the experts already ran: the carry (and the hint)
        if ahead is not None:
            layer.mlp.dispatcher.hint(ahead.layer, post[3])
        return post[:3]
    h, y, ids, weights, shared, *predicted = post
    if ahead is not None:  # before this layer's dispatch: its copies can start while it computes
        layer.mlp.dispatcher.hint(ahead.layer, predicted[0])
    if plan.hints:
        layer.mlp.dispatcher.await_hint(layer.layer)
    return h, layer.mlp.experts(y, ids, weights), shared


def _settle(carry: Carry) -> torch.Tensor:
    """The residual a carry stands for (adding a MoE layer's output in, as :meth:`SegmentedDecoderLayer.forward`)."""
    if len(carry) == 1:
        return carry[0]
    h, routed, shared = carry
    return h + combine_experts(routed, shared)


def _inputs(model: PreNormModel, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Segment: the embedded tokens and the rope tables of their positions (as ``prenorm_stack_forward``)."""
    x = model.embed_tokens(input_ids)
    return x, *rope_cos_sin(positions, model.inv_freq, model.rope_factor, x.dtype)


def _pre(layer: SegmentedDecoderLayer, carried: int, *tensors: MaybeTensor) -> tuple[torch.Tensor, ...]:
    """Segment: ``carried`` carry tensors, then cos and sin -> the residual and the attention's projections."""
    x = _settle(tensors[:carried])
    return x, *layer.decode_pre_attention(x, (tensors[carried], tensors[carried + 1]))


def _post(
    layer: SegmentedDecoderLayer,
    ahead: SegmentedDecoderLayer | None,
    experts_in_graph: bool,
    x: torch.Tensor,
    out: torch.Tensor,
) -> tuple[MaybeTensor, ...]:
    """Segment: the attention output merged into the residual, then the MLP's capturable part, then (with
    ``ahead``) ``ahead``'s predicted expert ids; with ``experts_in_graph`` a MoE layer's routed experts too
    (its carry, ``(h, routed, shared)``)."""
    h, y = layer.decode_post_attention(x, out)
    if experts_in_graph and isinstance(layer.mlp, RoutedMoE):
        carry = h, *layer.mlp.experts_beside_shared(y)
        return carry if ahead is None else (*carry, ahead.predict_experts(h))
    outputs = layer.decode_mlp(h, y)
    return outputs if ahead is None else (*outputs, ahead.predict_experts(h))


def _final(model: PreNormModel, *carry: MaybeTensor) -> torch.Tensor:
    """Segment: the last layer's carry -> the final hidden states."""
    return model.norm(_settle(carry))
