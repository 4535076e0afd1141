"""A DeepSeek-V4 decode step as two halves of its batch alternating layers (issue 4: overlap at several streams).

A tiered step whose misses go to the CPU tier and the copy path runs each layer's backbone (attention, mHC,
router, shared expert) on the device, then waits while the host's links (the CPU tier, PCIe copies) bring its
experts: the device idles for most of the expert phase, and nothing else can run, since the next layer needs
this one's output. Two halves of the batch have no such dependency between them. So a step the dispatcher
marks (:meth:`~moetier.tiers.dispatcher.ExpertDispatcher.decode_halves`) runs, per layer,

    half 0's segments, half 1's segments, half 0's experts, half 1's experts

each half on a CUDA stream of its own: while half 0's experts wait for the CPU tier, the device runs half 1's
backbone, and half 0's next layer runs while the CPU tier works on half 1's. The costs: each half reads the
backbone's weights (a step's backbone reads them twice), and the halves share fewer experts than the batch.

Every half is a :class:`~moetier.models.deepseek_v4_step.Step` over its rows (views of the step's inputs) with
its own rotations; its calls run inside the dispatcher's :meth:`decode_lane`, which keeps the host buffers a
call holds until the device is past it per half. The graphs of half ``i`` live in the variant
``("decode halves", i)`` (its own memory pool: two pools' graphs may run at once, one pool's must not), the
step's inputs and final segments in ``("decode halves", "whole")``. The halves hint nothing.

Streams: both halves' streams start after the work before the step and the step's stream waits for both at
the end. Before that, the first :data:`SERIAL_STEPS` halves steps of a batch run both halves on the step's own
stream, in the same order: their warm-ups build tensors lazily (cached constants, Triton kernels) that the other
half then reads. The compressed entries' rotation table is grown for the whole batch before the halves start,
so neither half's segments grow it while the other reads it. Off CUDA the halves run one after the other, so
the CPU tests check the same math and order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from moetier.models import deepseek_v4_static_decode as static_decode
from moetier.models.decode_segments import DecodePlan
from moetier.models.deepseek_v4_rope import StepRope, rotations_from
from moetier.models.graph_segments import SegmentGraphs

if TYPE_CHECKING:
    from moetier.models.base import ForwardBatch
    from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM
    from moetier.models.deepseek_v4_step import Carry, Step
    from moetier.tiers.dispatcher import ExpertDispatcher

WHOLE = ("decode halves", "whole")  # the graph variant of a halves step's inputs and final segments
SERIAL_STEPS = 3  # a batch's first halves steps on one stream: warm-up (1), capture (2), one more
_SEEN_LIMIT = 4096  # batches whose halves steps are counted (a long session forgets the oldest)


def halves_wanted(model: DeepseekV4ForCausalLM, batch: ForwardBatch, plan: DecodePlan) -> bool:
    """Whether this step runs as two halves: the dispatcher wants it, its experts run eagerly and every layer's
    states take the fixed-shape step (contiguous entry stores)."""
    size = len(batch.slices)
    if size < 2 or plan.experts_in_graphs or not model.dispatcher.decode_halves(size):
        return False
    caches = [s.cache for s in batch.slices]
    return all(static_decode.supports([cache.layers[layer.layer] for cache in caches]) for layer in model.layers)


def halves_plan(graphs: SegmentGraphs) -> DecodePlan:
    """A halves step's plan (no hints, experts eagerly) and its graph variant for the whole batch's segments."""
    graphs.use_variant(WHOLE)
    return DecodePlan(hints=False, experts_in_graphs=False)


def run_halves(step: Step, layers: list, streams: torch.Tensor, dispatcher: ExpertDispatcher) -> Carry:
    """The layers over two halves of ``step``'s batch (the first ``ceil(B / 2)`` rows, then the rest), from the
    residual ``streams`` ``[B, ...]`` -> the last layer's carry over the whole batch."""
    from moetier.models import deepseek_v4_step as v4_step  # the step module imports this one

    size = len(step.slices)
    cut = (size + 1) // 2
    halves = [half_step(step, slice(0, cut)), half_step(step, slice(cut, size))]
    for layer in layers:  # grown now, on the step's stream: the halves' segments only read it
        v4_step.entry_table(step, layer, step.states(layer))
    lanes = _lane_streams(step)
    carries: list[Carry] = [(streams[:cut],), (streams[cut:],)]
    for layer in layers:
        outputs = []
        for lane, half in enumerate(halves):
            with _on_lane(lanes, lane), _variant(step.graphs, lane):
                outputs.append(v4_step.layer_segments(half, layer, None, carries[lane]))
        for lane, half in enumerate(halves):
            with _on_lane(lanes, lane), dispatcher.decode_lane(lane):
                carries[lane] = v4_step.layer_experts(half, layer, None, outputs[lane])
    if lanes is not None:
        current = torch.cuda.current_stream()
        for lane_stream in lanes:
            current.wait_stream(lane_stream)
    return _joined(carries)


def half_step(step: Step, rows: slice) -> Step:
    """``step`` restricted to ``rows`` of its batch: views of its ids and rotations, its own :class:`StepRope`
    (whose per-step lookups are keyed by the batch it serves)."""
    from moetier.models.deepseek_v4_step import Step

    rope_tensors = tuple(t[rows] for t in step.rope_tensors)
    rope = StepRope(step.rope.positions[rows], rotations_from(rope_tensors), step.rope.compress)
    slices = step.slices[rows]
    return Step(step.graphs, step.ids[rows], rope_tensors, rope, slices, step.plan, step.dtype, step.serials[rows])


def _joined(carries: list[Carry]) -> Carry:
    """The halves' carries as the whole batch's (row-wise concatenations; ``None`` parts stay ``None``)."""
    first, second = carries
    return tuple(None if a is None else torch.cat((a, b)) for a, b in zip(first, second, strict=True))


_serial_counts: dict[tuple[int, ...], int] = {}
_lane_pairs: dict[int, tuple[Any, Any]] = {}


def _lane_streams(step: Step) -> tuple[Any, Any] | None:
    """The halves' two CUDA streams, both started after the work before the step; None off CUDA and for a
    batch's first :data:`SERIAL_STEPS` halves steps (both halves then run on the step's stream)."""
    if not step.ids.is_cuda:
        return None
    seen = _serial_counts.get(step.serials, 0)
    if seen < SERIAL_STEPS:
        if len(_serial_counts) >= _SEEN_LIMIT:
            _serial_counts.clear()
        _serial_counts[step.serials] = seen + 1
        return None
    device = step.ids.device.index if step.ids.device.index is not None else torch.cuda.current_device()
    pair = _lane_pairs.get(device)
    if pair is None:
        pair = _lane_pairs[device] = (torch.cuda.Stream(), torch.cuda.Stream())
    current = torch.cuda.current_stream()
    for lane_stream in pair:
        lane_stream.wait_stream(current)
    return pair


@contextlib.contextmanager
def _on_lane(lanes: tuple[Any, Any] | None, lane: int) -> Iterator[None]:
    """Half ``lane``'s work on its stream (or on the current one)."""
    if lanes is None:
        yield
        return
    with torch.cuda.stream(lanes[lane]):
        yield


@contextlib.contextmanager
def _variant(graphs: SegmentGraphs, lane: int) -> Iterator[None]:
    """Half ``lane``'s segments in its own graph variant (pool), the whole batch's variant after them."""
    graphs.use_variant(("decode halves", lane))
    try:
        yield
    finally:
        graphs.use_variant(WHOLE)
