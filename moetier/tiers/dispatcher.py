"""The one door between a model's MoE layers and wherever the routed experts live."""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import torch

from moetier.kernels.device_routing import LayerBlocks, device_routing_fits, run_routed
from moetier.kernels.grouped_experts import mark_broken, run_experts
from moetier.tiers.call_routing import sort_pairs_for_device
from moetier.tiers.experts import ExpertStore, ExpertWeights

T = TypeVar("T")


class ExpertDispatcher(ABC):
    """Computes the routed-expert part of one MoE layer.

    Contract: ``dispatch(layer, hidden, topk_ids, topk_weights)`` with ``hidden`` ``[T, H]``,
    ``topk_ids`` ``[T, K]`` (int64 expert indices of that layer) and ``topk_weights`` ``[T, K]``
    returns ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])`` as ``[T, H]`` in
    ``hidden.dtype`` on ``hidden.device``, the sum taken in float32 (:func:`expert_accumulator`).
    Implementations may place and run experts anywhere (VRAM, CPU, streamed) but must agree with
    :func:`~moetier.tiers.experts.swiglu_expert` to the tolerance their tests state. Models call only this; they never
    learn where an expert lives.
    """

    def __init__(self, store: ExpertStore) -> None:
        self.store = store

    def prepare(self, device: torch.device | str) -> None:  # noqa: B027 - an optional hook, not abstract
        """Called once the store is loaded, with the compute device: allocate caches, measure. Default: nothing."""

    @abstractmethod
    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...

    def dispatch_beside(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        beside: Callable[[], T],
    ) -> tuple[torch.Tensor, T]:
        """:meth:`dispatch`'s result and ``beside()``'s: the model's work that does not depend on this call's
        routed experts (its shared expert), run once, wherever the dispatcher overlaps it best (the same results
        as calling both; only the order of independent work may change). Default: ``beside`` first."""
        done = beside()
        return self.dispatch(layer, hidden, topk_ids, topk_weights), done

    def graphable(self, tokens: int) -> bool:
        """Whether :meth:`dispatch` of a decode call of ``tokens`` rows may run inside a CUDA graph: no host sync,
        no host decision that differs between calls, shapes fixed by ``tokens``. A model then runs it inside
        its post-attention segment. Default: False."""
        return False

    @contextlib.contextmanager
    def decode_step(self, tokens: int, dtype: torch.dtype) -> Iterator[Hashable | None]:
        """Around one decode step of a model's segmented decode: ``tokens`` sequences of one token each, activations
        of ``dtype``, entered before the step's first :meth:`dispatch`. Yields what the step's dispatch calls do
        inside CUDA graphs (a hashable the model keys its graphs by: a change means other work) or None where they
        must run eagerly; an exception raised in the step passes through it. Default: ``"graphable"`` where
        :meth:`graphable`, else None."""
        yield "graphable" if self.graphable(tokens) else None

    def decode_halves(self, tokens: int) -> bool:
        """Whether the step in progress (read after :meth:`decode_step` yielded) gains from running its ``tokens``
        sequences as two halves alternating layers: each half's calls inside :meth:`decode_lane` (0, 1), half 1's
        backbone on the device while half 0's experts wait on the host's links (CPU tier, copies), and in turn.
        Such a step hints nothing. Default: False (a dispatcher whose calls keep the device busy loses by it)."""
        return False

    def decode_lane(self, lane: int) -> contextlib.AbstractContextManager[None]:
        """Around the calls of half ``lane`` of a :meth:`decode_halves` step, on that half's stream: a dispatcher
        whose calls keep host state until the device is past them (pinned buffers, jobs) keeps it per lane, since
        the other half's calls come before this one's are done. Default: nothing."""
        return contextlib.nullcontext()

    @property
    def wants_hints(self) -> bool:
        """Whether :meth:`hint` does anything: models skip computing predictions for a dispatcher that
        ignores them. Default: False."""
        return False

    def hint(self, layer: int, topk_ids: torch.Tensor) -> None:  # noqa: B027 - an optional hook, not abstract
        """Advice for the next dispatch of MoE layer ``layer``: ``topk_ids`` ``[T, K]`` (int64, on the compute
        device, one row per token of that coming call) are the experts a prediction expects. A model makes
        it one layer early, before dispatching the current layer, so a tiered dispatcher can start copying
        them while this layer and the next attention run. With CUDA graphs ``topk_ids`` is a graph output the next
        replay overwrites: copy it (on its stream) before returning, never keep it. Results never depend on
        hints. Default: ignored.

        Where the current layer's calls run inside the model's graphs (:meth:`decode_step`), a dispatcher that
        :attr:`wants_graph_hints` gets the hint after the segment holding the current layer's call instead; and
        a model that hints calls :meth:`await_hint` for ``layer`` before the work holding that layer's call."""

    @property
    def wants_graph_hints(self) -> bool:
        """Whether this step's calls, run inside the model's graphs, still want :meth:`hint` (the graphs then
        compute the predictions too). Read per step, after :meth:`decode_step` yielded. Default: False."""
        return False

    def await_hint(self, layer: int) -> None:  # noqa: B027 - an optional hook, not abstract
        """Before the segment (or the eager call) that runs MoE layer ``layer``'s experts, in a step whose model
        hinted ``layer``: device work a hint started is ordered before it here (on the current stream; no host
        wait). Default: nothing."""


class Beside(Generic[T]):
    """The work beside one dispatch call (:meth:`ExpertDispatcher.dispatch_beside`): :meth:`run` at the point a
    route chooses (again: nothing), :meth:`result` runs it if no route did."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._work, self._done, self._result = work, False, None

    def run(self) -> None:
        if not self._done:
            self._result, self._done = self._work(), True

    def result(self) -> T:
        self.run()
        return self._result


def expert_accumulator(hidden: torch.Tensor) -> torch.Tensor:
    """The float32 ``[T, H]`` buffer the experts' weighted outputs are summed into.

    Summing in float32 makes the result independent (to the final rounding) of the order in which
    experts are added, so placements that visit experts in different orders (hits first, then
    misses) give the same ``hidden.dtype`` output.
    """
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)


def run_host_sorted(
    out: torch.Tensor,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_of: Callable[[int], ExpertWeights],
    swiglu_limit: float | None,
    num_experts: int,
) -> None:
    """Add every pair's ``weight * expert(hidden[token])`` into ``out``, each expert read from ``block_of(expert)``.

    Sorting the (token, k) pairs by expert gives each expert one contiguous run of tokens. The groups must be on
    the host: one wait for the ids (a prefill call sorts on the device and reads the order back, a decode call
    sorts on the host; :func:`~moetier.tiers.call_routing.sort_pairs_for_device`).
    """
    order_host, experts, counts, token_of_pair, weight_of_pair = sort_pairs_for_device(
        topk_ids, topk_weights, num_experts
    )
    groups, start = [], 0
    for expert, count in zip(experts, counts, strict=True):
        groups.append((block_of(expert), start, count))
        start += count
    top_k = topk_ids.shape[1]
    run_experts(out, hidden, token_of_pair, weight_of_pair, groups, swiglu_limit, order_host // top_k, top_k)


class ResidentDispatcher(ExpertDispatcher):
    """All experts live on the compute device; each active expert runs once over its tokens.

    With ``device_routing`` (on unless ``MOETIER_DEVICE_ROUTING=0``), a decode-sized call builds its launch
    table on the device (:mod:`moetier.kernels.device_routing`): no wait for the router's ids, the same bits,
    and the decode steps run the experts inside their CUDA graphs (measured on the H200, fp4 V4-Flash
    widths: 2.66x the host-table path's tok/s at 1 stream, 1.77x at 4).
    """

    def __init__(self, store: ExpertStore, device_routing: bool | None = None) -> None:
        super().__init__(store)
        self.device_routing = (
            os.environ.get("MOETIER_DEVICE_ROUTING", "1") != "0" if device_routing is None else device_routing
        )
        self._blocks: dict[tuple[int, torch.dtype], LayerBlocks | None] = {}

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.device_routing and device_routing_fits(hidden, topk_ids.shape[0], topk_ids.numel()):
            blocks = self._layer_blocks(layer, hidden.dtype)
            if blocks is not None and (routed := self._routed(hidden, topk_ids, topk_weights, blocks)) is not None:
                return routed
        out = expert_accumulator(hidden)
        block_of, limit = (lambda expert: self.store.expert(layer, expert)), self.store.layout.swiglu_limit
        run_host_sorted(out, hidden, topk_ids, topk_weights, block_of, limit, self.store.layout.num_experts)
        return out.to(hidden.dtype)

    def graphable(self, tokens: int) -> bool:
        """With ``device_routing``, decode-sized calls on CUDA (every MoE layer's blocks in one layout the
        kernels take: a layer that is not falls back to the host path, and its capture fails over to eager)."""
        if not self.device_routing:
            return False
        layout = self.store.layout
        first = self.store.expert(layout.moe_layers[0], 0).block
        return first.is_cuda and device_routing_fits(first, tokens, tokens * layout.top_k)

    def _routed(self, hidden, topk_ids, topk_weights, blocks: LayerBlocks) -> torch.Tensor | None:
        """The call on the device table, or None after a kernel failure (recorded: the host path from then on)."""
        out = expert_accumulator(hidden)
        try:
            run_routed(out, hidden, topk_ids, topk_weights, blocks, self.store.layout.swiglu_limit)
        except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
            mark_broken(exc)
            return None
        return out.to(hidden.dtype)

    def _layer_blocks(self, layer: int, dtype: torch.dtype) -> LayerBlocks | None:
        """The layer's blocks for the device table, judged once per (layer, activation dtype)."""
        key = (layer, dtype)
        if key not in self._blocks:
            experts = [self.store.expert(layer, e) for e in range(self.store.layout.num_experts)]
            self._blocks[key] = LayerBlocks.of(experts, dtype)
        return self._blocks[key]


def _tiered(store: ExpertStore, **options) -> ExpertDispatcher:
    # Imported here: the tiered dispatcher builds on this module.
    from moetier.tiers.tiered_dispatcher import TieredDispatcher

    return TieredDispatcher(store, **options)


DISPATCHERS: dict[str, Callable[..., ExpertDispatcher]] = {"resident": ResidentDispatcher, "tiered": _tiered}


def make_dispatcher(name: str, store: ExpertStore, **options) -> ExpertDispatcher:
    """Build the dispatcher registered as ``name``; ``options`` go to its constructor (resident: ``device_routing``)."""
    try:
        factory = DISPATCHERS[name]
    except KeyError:
        raise ValueError(f"unknown dispatcher {name!r}; known: {sorted(DISPATCHERS)}") from None
    return factory(store, **options)
