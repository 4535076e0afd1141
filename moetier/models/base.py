"""The contract every model family implements, and the registry keyed by Hugging Face ``architectures``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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
    # Whether :meth:`snapshot` accepts any length <= ``length`` (plain KV: a token's entries never
    # depend on later tokens). Rolling state (windows, compressors) only snapshots where it stands
    # or at a length it recorded with :meth:`mark`.
    truncatable: bool = False

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    # --- prefix caching (optional; a family without these simply never hits the prefix cache) ---

    def snapshot(self, length: int) -> SequenceCache:
        """An independent copy of the state after the first ``length`` tokens, sized to exactly ``length``.

        Raises ``ValueError`` for a length the cache cannot reproduce (see ``truncatable``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support prefix snapshots")

    def clone_into(self, max_tokens: int, length: int | None = None) -> SequenceCache:
        """A new cache of capacity ``max_tokens`` holding a copy of this state (its first ``length`` tokens,
        default all); the clone can then be extended like a fresh cache."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefix snapshots")

    def reset(self) -> bool:
        """Empty the cache in place for a new sequence of at most its size: its tensors kept, so decode graphs
        captured over them stay valid. False (the default) where the family cannot."""
        return False

    def copy_into(self, target: SequenceCache, length: int | None = None) -> bool:
        """As :meth:`clone_into`, into ``target`` (an empty cache of this model with room enough) in place: its
        tensors kept. False (the default) where the family cannot."""
        return False

    def borrowed_snapshot(self, length: int) -> SequenceCache | None:
        """As :meth:`snapshot`, sharing this cache's memory instead of copying it: valid while the cache still holds
        that state (:attr:`servable` says so). None (the default) where the family cannot."""
        return None

    @property
    def servable(self) -> bool:
        """Whether this cache (a prefix snapshot) can still start a sequence: True but for a borrowed snapshot
        whose lender moved on."""
        return True

    def mark(self) -> None:
        """Record what :meth:`snapshot` needs to reproduce the current length later (non-truncatable
        caches; called between forwards at block boundaries). Default: nothing to record."""

    @property
    def nbytes(self) -> int:
        """Bytes of tensor memory the cache holds (prefix-cache accounting)."""
        return 0

    def row_stores(self) -> list[Any]:
        """Every row store (:class:`~moetier.models.cache.KVRows`) of the state that grows with the context:
        what a paged layout keeps in pool blocks (a prefix snapshot's blocks are found here). Default: none."""
        return []


@dataclass
class SequenceSlice:
    """One sequence's rows ``[start, start + length)`` of a batched forward, its cache and positions."""

    cache: SequenceCache
    start: int
    length: int
    positions: torch.Tensor
    context: Any = None  # per-sequence data a family derives once per forward (e.g. rotary tables)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


class ForwardBatch:
    """Several sequences run in one forward: token-wise work (projections, norms, routers, experts)
    runs over all rows at once, so each expert is read once per step for every stream; attention
    runs per sequence against that sequence's cache.
    """

    def __init__(
        self,
        caches: SequenceCache | Sequence[SequenceCache],
        total: int,
        lengths: Sequence[int] | None,
        device: torch.device,
    ) -> None:
        if isinstance(caches, SequenceCache):
            caches, lengths = [caches], [total] if lengths is None else lengths
        if lengths is None or len(lengths) != len(caches) or sum(lengths) != total:
            raise ValueError(f"seq_lens {lengths} must give one length per cache and sum to {total} tokens")
        self.slices: list[SequenceSlice] = []
        start = 0
        for cache, length in zip(caches, lengths, strict=True):
            positions = torch.arange(cache.length, cache.length + length, device=device)
            self.slices.append(SequenceSlice(cache, start, length, positions))
            start += length
        self.positions = torch.cat([s.positions for s in self.slices])

    def per_sequence(self, x: torch.Tensor, fn: Callable[[torch.Tensor, SequenceSlice], torch.Tensor]) -> torch.Tensor:
        """``fn`` applied to each sequence's rows of ``x``; results concatenated in row order."""
        if len(self.slices) == 1:
            return fn(x, self.slices[0])
        return torch.cat([fn(x[s.rows], s) for s in self.slices])

    def advance(self) -> None:
        """Mark every sequence's new tokens as cached (after all layers have written them)."""
        for s in self.slices:
            s.cache.advance(s.length)


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
      ``forward(input_ids, [cache_a, cache_b], seq_lens=[Ta, Tb])`` runs several sequences in one
      pass (rows concatenated in that order); results equal running each alone.
    - ``post_load()`` builds derived state (e.g. RoPE tables) after weights are in place.
    """

    dispatcher: ExpertDispatcher
    # Parameters whose names contain one of these stay float32 whatever the load dtype
    # (the references keep router biases, mHC mixers and some norms in float32).
    keep_fp32: tuple[str, ...] = ()
    # Linears whose weight the model reads itself (not through the module's forward): dequantised at load
    # whatever the backbone format (moetier.models.fp8_linear).
    dense_linears: tuple[str, ...] = ()
    # Whether decode attention reads paged KV blocks in place on CUDA (moetier.kernels.paged_attention);
    # the engine's ``kv_layout="auto"`` picks the paged layout for such a model there.
    reads_paged_kv_in_place: bool = False
    # Whether decode graphs read the sequences' contiguous caches in place (keyed by them, so a cache that moves
    # or a new sequence's cache captures them again): the engine then doubles reservations and hands finished
    # sequences' caches to the next ones (moetier.engine.spare_caches).
    decode_graphs_read_caches: bool = False

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
    def new_cache(self, max_tokens: int, kv_dtype: str | None = None) -> SequenceCache:
        """An empty cache for ``max_tokens`` tokens; ``kv_dtype`` (``None`` = the model dtype, ``"bf16"``,
        ``"fp8"``) is the storage of the state that grows with the context (:mod:`moetier.models.cache`)."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: SequenceCache | Sequence[SequenceCache],
        seq_lens: Sequence[int] | None = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def use_dispatcher(self, dispatcher: ExpertDispatcher) -> None:
        """Route every MoE layer through ``dispatcher`` from now on (benchmarks swap tiers this way). The decode
        graphs are dropped: a graph whose experts ran inside it replays the old dispatcher's buffers."""
        for module in self.modules():
            if "dispatcher" in module.__dict__:
                object.__setattr__(module, "dispatcher", dispatcher)
            graphs = module.__dict__.get("graphs")
            if hasattr(graphs, "reset"):
                graphs.reset()

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
        """The compute dtype: the first parameter's that is not an fp8 linear's stored weight."""
        return next(p.dtype for p in self.parameters() if p.element_size() > 1)


MODEL_REGISTRY: dict[str, type[CausalLM]] = {}


def register_model(*architectures: str):
    """Class decorator: register a family under its Hugging Face ``architectures`` names."""

    def wrap(cls: type[CausalLM]) -> type[CausalLM]:
        for arch in architectures:
            MODEL_REGISTRY[arch] = cls
        return cls

    return wrap
