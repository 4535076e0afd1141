"""The contract every model family implements, and the registry keyed by Hugging Face ``architectures``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from moetier.tiers.dispatcher import ExpertDispatcher
from moetier.tiers.experts import ExpertLayout

ExpertPart = Literal["gate", "up", "down", "gate_up"]


@dataclass(frozen=True)
class ParamTarget:
    """A checkpoint tensor that becomes (or is copied into) the model parameter/buffer ``name``."""

    name: str


@dataclass(frozen=True)
class ExpertTarget:
    """A checkpoint tensor holding routed-expert weights.

    ``expert`` is an index for per-expert tensors (``[I, H]`` gate/up, ``[H, I]`` down, ``[2I, H]``
    gate_up) or ``None`` for a fused tensor over all experts (``[E, 2I, H]`` gate_up, ``[E, H, I]``
    down, as transformers keeps them in memory).
    """

    layer: int
    expert: int | None
    part: ExpertPart


@dataclass(frozen=True)
class IgnoreTarget:
    """A checkpoint tensor the runtime does not need (e.g. multi-token-prediction layers)."""

    reason: str


WeightTarget = ParamTarget | ExpertTarget | IgnoreTarget


class SequenceCache:
    """Per-sequence attention state (contiguous; the paged engine replaces it).

    ``length`` is the number of tokens already written; the next forward's first token sits at
    position ``length``. Each family defines what else it keeps (KV, compressed KV, windows).
    """

    length: int = 0


class CausalLM(nn.Module, ABC):
    """A decoder-only MoE language model.

    Contract:
    - ``__init__(config, dispatcher)`` builds every non-expert parameter; routed experts are NOT
      parameters: MoE layers call ``self.dispatcher.dispatch(layer, hidden, ids, weights)``.
    - ``config_from_hf(dict)`` validates a ``config.json`` into the family's config dataclass.
    - ``map_checkpoint_name(name)`` says where a checkpoint tensor goes (or raises ``KeyError``
      for a name the family does not know).
    - ``forward(input_ids, cache)`` runs ``input_ids`` (``[T]``) at positions
      ``cache.length .. cache.length + T - 1``, appends to ``cache`` and returns the final
      hidden states ``[T, H]``; ``compute_logits`` maps them to float32 logits ``[T, V]``.
    - ``post_load()`` builds derived state (e.g. RoPE tables) after weights are in place.
    """

    dispatcher: ExpertDispatcher
    # Parameters whose names contain one of these stay float32 whatever the load dtype
    # (the references keep router biases, mHC mixers and some norms in float32).
    keep_fp32: tuple[str, ...] = ()

    def __init__(self, config: Any, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.config = config
        # A plain attribute: the dispatcher is not a submodule and owns no model parameters.
        object.__setattr__(self, "dispatcher", dispatcher)

    @classmethod
    @abstractmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> Any: ...

    @classmethod
    @abstractmethod
    def expert_layout(cls, config: Any) -> ExpertLayout: ...

    @abstractmethod
    def map_checkpoint_name(self, name: str) -> WeightTarget: ...

    @abstractmethod
    def new_cache(self, max_tokens: int) -> SequenceCache: ...

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, cache: SequenceCache) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def tied_parameters(self) -> dict[str, str]:
        """``{target: source}`` parameters the checkpoint may omit and that share ``source``'s data."""
        return {}

    def post_load(self) -> None:
        """Build derived (non-checkpoint) state once weights are loaded. Default: nothing."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register_model(*architectures: str):
    """Class decorator: register a family under its Hugging Face ``architectures`` names."""

    def wrap(cls: type[CausalLM]) -> type[CausalLM]:
        for arch in architectures:
            MODEL_REGISTRY[arch] = cls
        return cls

    return wrap
