"""Piecewise CUDA graphs: capture the fixed-shape segments of a decode step once, replay them every step.

A decode step of a few tokens is bound by kernel launches and per-op host overhead, not by arithmetic.
A model cuts its step into *segments*, functions of tensors whose shapes depend only on the batch size
(norms, projections, routers: no per-sequence cache work, no host decisions), and runs each through
:meth:`SegmentGraphs.run`:

- off CUDA, when disabled (``MOETIER_CUDA_GRAPHS=0`` or ``enabled=False``), with autograd on, or inside
  someone else's capture, ``run(key, fn, *tensors)`` is ``fn(*tensors)`` and nothing more;
- on CUDA, per key (the caller's key plus the inputs' shapes, dtypes and devices), the first ``warmup``
  calls run ``fn`` eagerly on a side stream (as torch's CUDA-graph docs ask; it also compiles Triton
  kernels and builds lazily cached tensors), the next call captures ``fn`` into a CUDA graph over static
  input buffers and replays it, and later calls copy their inputs into those buffers and replay.

Contract for callers:

- ``fn`` must be capturable: no host syncs (``.item()``, ``.cpu()``, ``.tolist()``), no host-to-device
  copies (tensors built from Python lists), no data-dependent shapes, no Python decision that differs
  between calls of one key (the graph replays what the capture saw), and no parameter reallocated after
  the capture (the graph reads fixed addresses).
- Outputs are static tensors: the key's next replay overwrites them, and so may the replay of a key
  captured before it (all graphs of a variant share one memory pool). Finish with a step's outputs before the next
  step runs its segments, and run a step's keys in the same order every step (the order they were
  captured in). :meth:`fresh` copies an output that must live longer.
- An input that *is* (the same tensor object) another key's output is read in place, without a copy:
  chained segments hand their outputs straight on. Passing a different tensor there later copies it
  into that output's buffer.
- ``fn`` may update its inputs in place; on a replay that updates the static copy, not the caller's tensor.
- A capture that fails logs one warning naming the key and the reason; that key runs eagerly from then
  on (a decode never fails because a segment cannot be captured).
- A choice that changes what segment functions compute without changing their keys (e.g. whether they
  predict the next layer's experts) is declared with :meth:`SegmentGraphs.use_variant` before the step. Each
  variant keeps its own graphs in its own memory pool, so steps may switch between variants (a tiered
  dispatcher's route changes from step to step) without capturing again. A variant whose graphs have all been
  dropped opens a new pool at its next capture (torch refuses a capture into a pool left with no graph while its
  memory is still held), as it does after a failed capture.
- At most ``max_graphs`` graphs are kept (``MOETIER_MAX_GRAPHS``, default :data:`DEFAULT_MAX_GRAPHS`): past it a
  capture drops the least recently run quarter (their outputs' memory returns to the pool; such a key warms up
  and captures again when it comes back). Keys whose caches outlive their sequences (V4's spare caches) would
  otherwise keep a graph for every batch of caches and entry bucket ever run; a step's own keys are its most
  recent, so the cap should hold several steps' keys (a V4-Flash step has 45).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetier.errors import ConfigError
from moetier.profiling import phase

log = logging.getLogger(__name__)

MaybeTensor = torch.Tensor | None
Tensors = tuple[MaybeTensor, ...]
SegmentFn = Callable[..., Any]  # returns a tensor, None, or a tuple of them


DEFAULT_MAX_GRAPHS = 1024  # ~20 (batch of caches, bucket, variant) sets of a 43-layer model's step


def graphs_enabled() -> bool:
    """``MOETIER_CUDA_GRAPHS``: ``0`` turns CUDA graphs off; unset or anything else, on (every family's
    graphed decode has passed its GPU tests on the H200)."""
    return os.environ.get("MOETIER_CUDA_GRAPHS") != "0"


class Replayable(Protocol):
    """A captured graph: :meth:`replay` reruns its work on the current stream."""

    def replay(self) -> None: ...


@dataclass
class _Entry:
    """One key's state: its eager warm-up calls so far, then its graph and static buffers (or a failed capture)."""

    warm_calls: int = 0
    graph: Replayable | None = None
    inputs: Tensors = ()
    outputs: Tensors = ()
    failed: bool = False
    tags: tuple[Hashable, ...] = ()
    last_run: int = 0  # the graphs' run counter at this key's last run
    pool: tuple[Hashable, int] | None = None  # the (variant, generation) of the pool its graph was captured in


class SegmentGraphs:
    """CUDA graphs of a model's decode segments, one per key (see the module doc for the contract).

    ``captures``, ``replays``, ``evictions`` and ``failures`` (caller key -> reason) count what happened, for
    tests and diagnostics.
    """

    def __init__(self, enabled: bool | None = None, warmup: int = 1, max_graphs: int | None = None) -> None:
        self.enabled = graphs_enabled() if enabled is None else enabled
        self.warmup = warmup
        self.max_graphs = max_graphs_setting() if max_graphs is None else max_graphs
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {self.max_graphs}")
        self.evictions = 0
        self._runs = 0
        self._graphs = 0  # entries holding a graph
        self.captures = 0
        self.replays = 0
        self.failures: dict[Hashable, str] = {}
        self._entries: dict[Hashable, _Entry] = {}
        # Every captured output by id (the entries keep them alive, so ids stay unique): inputs found
        # here are read in place.
        self._outputs: dict[int, torch.Tensor] = {}
        self._pools: dict[Hashable, Any] = {}  # per variant: its graphs never share memory with another's
        # The graphs each pool holds, by (variant, generation): a variant's pool is replaced (its generation + 1)
        # after a failed capture and once all of its graphs are gone.
        self._pool_graphs: dict[tuple[Hashable, int], int] = {}
        self._generations: dict[Hashable, int] = {}
        self._capture_stream: Any = None
        self._side_stream: Any = None
        self._variant: Hashable = None
        self._tracked: set[Hashable] = set()

    def run(self, key: Hashable, fn: SegmentFn, *tensors: MaybeTensor, tags: tuple[Hashable, ...] = ()) -> Tensors:
        """``fn(*tensors)`` as a tuple, from the key's CUDA graph where one applies (module doc). ``tags`` name
        what the graph reads besides its inputs (e.g. sequences whose state it writes): :meth:`drop_tag` drops it."""
        with phase("segments"):
            return self._run(key, fn, tensors, tags)

    def _run(self, key: Hashable, fn: SegmentFn, tensors: Tensors, tags: tuple[Hashable, ...] = ()) -> Tensors:
        if not self._active(tensors):
            return _as_tuple(fn(*tensors))
        signature = (self._variant, key, torch.is_inference_mode_enabled(), *map(_signature, tensors))
        entry = self._entries.get(signature)
        if entry is None:
            entry = self._entries[signature] = _Entry(tags=tags)
        self._runs += 1
        entry.last_run = self._runs
        if entry.graph is not None:
            return self._replay(entry, tensors)
        if entry.failed:
            return _as_tuple(fn(*tensors))
        if entry.warm_calls < self.warmup:
            entry.warm_calls += 1
            return _as_tuple(self._warm_up(fn, tensors))
        return self._capture_entry(key, entry, fn, tensors)

    def fresh(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or a copy of it when it is a captured output (which a later replay overwrites)."""
        return tensor.clone() if self._outputs.get(id(tensor)) is tensor else tensor

    def track(self, tag: Hashable, owner: object) -> None:
        """Drop the graphs tagged ``tag`` once ``owner`` is garbage (registered once per tag)."""
        if tag not in self._tracked:
            self._tracked.add(tag)
            weakref.finalize(owner, self.drop_tag, tag)

    def drop_tag(self, tag: Hashable) -> None:
        """Forget every graph tagged ``tag`` (its memory returns to the pool once nothing else holds it)."""
        self._tracked.discard(tag)
        for signature in [s for s, entry in self._entries.items() if tag in entry.tags]:
            self._forget(signature)

    def _forget(self, signature: Hashable) -> None:
        entry = self._entries.pop(signature)
        if entry.graph is not None:
            self._graphs -= 1
            self._release_pool_graph(entry.pool)
        for output in entry.outputs:
            if output is not None:
                self._outputs.pop(id(output), None)

    def _evict(self) -> None:
        """Past ``max_graphs`` graphs: drop the least recently run quarter of them."""
        if self._graphs <= self.max_graphs:
            return
        held = sorted((e.last_run, s) for s, e in self._entries.items() if e.graph is not None)
        for _, signature in held[: len(held) - self.max_graphs + self.max_graphs // 4]:
            self._forget(signature)
            self.evictions += 1

    def _release_pool_graph(self, pool: tuple[Hashable, int]) -> None:
        """One graph of ``pool`` dropped. With none left the variant's pool (if it is still that one) is replaced at
        its next capture: torch's allocator refuses a capture into a pool all of whose graphs are gone while memory of
        it is still held (an internal assert on its use count; V4's halves steps, whose graphs go with their
        sequences, hit it)."""
        left = self._pool_graphs.pop(pool, 0) - 1
        if left > 0:
            self._pool_graphs[pool] = left
            return
        variant, generation = pool
        if self._generations.get(variant, 0) == generation:  # still the variant's pool
            self._replace_pool(variant)

    def _pool_key(self) -> tuple[Hashable, int]:
        """The current variant's pool: ``(variant, generation)``."""
        return self._variant, self._generations.get(self._variant, 0)

    def _replace_pool(self, variant: Hashable) -> None:
        """``variant``'s next capture opens a new pool."""
        self._pools.pop(variant, None)
        self._generations[variant] = self._generations.get(variant, 0) + 1

    def reset(self) -> None:
        """Drop every graph (e.g. after the weights moved): keys warm up and capture again."""
        self._entries.clear()
        self._outputs.clear()
        self._pools.clear()
        self._pool_graphs.clear()
        self._generations.clear()
        self._graphs = 0

    def use_variant(self, variant: Hashable) -> None:
        """Declare what shapes the coming step's segment functions beyond their keys: the step's keys are that
        variant's. Graphs of a variant live in that variant's own pool, so the pool's rule (keys replay in the
        order they were captured) holds within each variant, whatever the order of steps across variants."""
        self._variant = variant

    # --- the CUDA steps (tests substitute these to exercise the bookkeeping on the CPU) ---

    def _active(self, tensors: Tensors) -> bool:
        """Whether these inputs go through graphs: enabled, no autograd, on the current CUDA device, not
        already inside a capture."""
        if not self.enabled or torch.is_grad_enabled():
            return False
        first = next((t for t in tensors if t is not None), None)
        if first is None or not first.is_cuda:
            return False
        return first.device.index == torch.cuda.current_device() and not torch.cuda.is_current_stream_capturing()

    def _warm_up(self, fn: SegmentFn, tensors: Tensors) -> Any:
        """One eager call on a side stream, ordered after the work before it and before the work after it."""
        current = torch.cuda.current_stream()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            out = fn(*tensors)
        # The inputs and outputs cross streams safely: the side stream only ever starts after waiting
        # for the current one, so neither reuses the other's freed blocks early.
        current.wait_stream(self._side_stream)
        return out

    def _new_pool(self) -> Any:
        """A fresh memory pool for a variant's graphs."""
        return torch.cuda.graph_pool_handle()

    def _variant_pool(self) -> Any:
        """The current variant's pool (opened on its first capture)."""
        pool = self._pools.get(self._variant)
        if pool is None:
            pool = self._pools[self._variant] = self._new_pool()
        return pool

    def _capture(self, fn: SegmentFn, inputs: Tensors) -> tuple[Replayable, Any]:
        """Capture ``fn(*inputs)`` into a CUDA graph in the variant's pool; return the graph and ``fn``'s outputs."""
        pool = self._variant_pool()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # the static inputs are written and no earlier work is in flight
        # Other threads (the CPU expert tier's workers) may call CUDA meanwhile: only this thread's
        # calls are checked against the capture.
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*inputs)
            except BaseException:
                _end_capture_quietly(graph)
                raise
            graph.capture_end()
        return graph, outputs

    # --- bookkeeping ---

    def _capture_entry(self, key: Hashable, entry: _Entry, fn: SegmentFn, tensors: Tensors) -> Tensors:
        try:
            inputs = tuple(self._static_input(t) for t in tensors)
            graph, outputs = self._capture(fn, inputs)
        except Exception as exc:  # noqa: BLE001 - a segment that cannot be captured still has to run
            entry.failed = True
            self.failures[key] = f"{type(exc).__name__}: {exc}"
            # A failed capture may leave its pool and stream mid-capture: later captures start afresh.
            self._replace_pool(self._variant)
            self._capture_stream = None
            log.warning("CUDA graph capture of segment %s failed (%s); it runs eagerly from now on", key, exc)
            return _as_tuple(fn(*tensors))
        entry.graph, entry.inputs, entry.outputs = graph, inputs, _as_tuple(outputs)
        self._outputs.update((id(t), t) for t in entry.outputs if t is not None)
        self.captures += 1
        self._graphs += 1
        entry.pool = self._pool_key()
        self._pool_graphs[entry.pool] = self._pool_graphs.get(entry.pool, 0) + 1
        self._evict()
        return self._replay(entry, tensors)

    def _static_input(self, tensor: MaybeTensor) -> MaybeTensor:
        """The buffer the graph reads for ``tensor``: another key's output in place, else a copy of it."""
        if tensor is None or self._outputs.get(id(tensor)) is tensor:
            return tensor
        return tensor.clone()

    def _replay(self, entry: _Entry, tensors: Tensors) -> Tensors:
        for static, tensor in zip(entry.inputs, tensors, strict=True):
            if tensor is not None and tensor is not static:
                static.copy_(tensor)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs


def max_graphs_setting() -> int:
    """``MOETIER_MAX_GRAPHS`` (an integer >= 1), else :data:`DEFAULT_MAX_GRAPHS`; a bad value is a one-line error."""
    raw = os.environ.get("MOETIER_MAX_GRAPHS")
    if raw is None:
        return DEFAULT_MAX_GRAPHS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"MOETIER_MAX_GRAPHS must be an integer >= 1 (graphs kept), got {raw!r}")
    return value


def _signature(tensor: MaybeTensor) -> Hashable:
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


def _as_tuple(out: Any) -> Tensors:
    return out if isinstance(out, tuple) else (out,)


def _end_capture_quietly(graph: Any) -> None:
    """End a capture whose function raised; its own error is the one worth reporting."""
    with contextlib.suppress(Exception):  # the capture is abandoned either way
        graph.capture_end()
