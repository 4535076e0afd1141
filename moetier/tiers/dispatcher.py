"""The one door between a model's MoE layers and wherever the routed experts live."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from moetier.kernels.grouped_experts import run_experts
from moetier.tiers.call_routing import sort_pairs, sorted_pairs_on_device
from moetier.tiers.experts import ExpertStore


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
        hints. Default: ignored."""


def expert_accumulator(hidden: torch.Tensor) -> torch.Tensor:
    """The float32 ``[T, H]`` buffer the experts' weighted outputs are summed into.

    Summing in float32 makes the result independent (to the final rounding) of the order in which
    experts are added, so placements that visit experts in different orders (hits first, then
    misses) give the same ``hidden.dtype`` output.
    """
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)


class ResidentDispatcher(ExpertDispatcher):
    """All experts live on the compute device; each active expert runs once over its tokens."""

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        out = expert_accumulator(hidden)
        # Sorting the (token, slot) pairs by expert gives each expert one contiguous run of tokens. The
        # sort runs on the host (the groups must be there anyway): one wait for the ids, one copy back.
        order_host, experts, counts = sort_pairs(topk_ids)
        groups, start = [], 0
        for expert, count in zip(experts, counts, strict=True):
            groups.append((self.store.expert(layer, expert), start, count))
            start += count
        top_k = topk_ids.shape[1]
        tokens_host = order_host // top_k
        token_of_pair, weight_of_pair = sorted_pairs_on_device(order_host, tokens_host, topk_weights, hidden.device)
        limit = self.store.layout.swiglu_limit
        run_experts(out, hidden, token_of_pair, weight_of_pair, groups, limit, tokens_host, top_k)
        return out.to(hidden.dtype)


def _tiered(store: ExpertStore, **options) -> ExpertDispatcher:
    # Imported here: the tiered dispatcher builds on this module.
    from moetier.tiers.tiered_dispatcher import TieredDispatcher

    return TieredDispatcher(store, **options)


DISPATCHERS: dict[str, Callable[..., ExpertDispatcher]] = {"resident": ResidentDispatcher, "tiered": _tiered}


def make_dispatcher(name: str, store: ExpertStore, **options) -> ExpertDispatcher:
    """Build the dispatcher registered as ``name``; ``options`` go to its constructor (none for resident)."""
    try:
        factory = DISPATCHERS[name]
    except KeyError:
        raise ValueError(f"unknown dispatcher {name!r}; known: {sorted(DISPATCHERS)}") from None
    return factory(store, **options)
