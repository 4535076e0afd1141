"""Executes a :class:`StepPlan` on the model.

Every scheduled chunk of a step runs in one ``model.forward`` (rows concatenated, attention per
sequence), each sequence with its own cache of its KV reservation (``Sequence.cache_tokens``); when
the scheduler grows the reservation, the cache moves into a larger one as a chunk needs the room
(``SequenceCache.clone_into``). Contiguous caches copy their rows then (geometric growth keeps the
copies few); with a ``kv_space`` the caches are paged (:mod:`moetier.models.paged_kv`): rows live in
pool blocks allocated as tokens arrive, and a move shares the blocks. Every cache the runner takes on
(allocated, rebuilt or adopted) and every one it drops is reported to ``kv_listener`` (the elastic
expert budget, :mod:`moetier.engine.elastic`) with its ``nbytes``. With ``spares``
(:mod:`moetier.engine.spare_caches`: a family whose decode graphs read caches in place), a dropped cache
waits there for the next sequence, which takes it emptied or filled with its cached prefix, in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from moetier.engine.scheduler import ScheduledChunk, Sequence, StepPlan
from moetier.engine.spare_caches import SpareCaches
from moetier.models.base import CausalLM, SequenceCache
from moetier.models.paged_kv import PagedKVSpace, paged_kv


@dataclass
class RunnerOutput:
    """What a step computed.

    ``logits`` (float32 ``[B, V]``, on the model's device) holds the final-position logits of the
    chunks that sample, in plan order, for the sequences in ``sampled``. ``prompt_logits`` maps a
    request id to the logits of the chunk positions that predict prompt tokens (only for sequences
    that asked for ``prompt_logprobs``). ``failures`` maps a request id to the exception its chunk
    raised: only that sequence is affected.
    """

    sampled: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    failures: dict[str, BaseException] = field(default_factory=dict)


class KvListener(Protocol):
    """Told about every per-sequence cache the runner holds (bytes of device memory)."""

    def allocated(self, key: str, nbytes: int) -> None: ...

    def freed(self, key: str) -> None: ...


class ModelRunner:
    """Runs a whole plan as ONE forward over every chunk's tokens, one contiguous cache per sequence.

    Batching matters most for offloaded experts: each active expert is read once per step for all
    streams instead of once per stream. If that forward raises, the caches it was writing are not
    trustworthy, so every sequence of the batch is rebuilt alone from its token history
    (recompute); a sequence that still fails alone is the culprit and only it is failed.
    """

    def __init__(
        self,
        model: CausalLM,
        mark_every: int | None = None,
        kv_dtype: str | None = None,
        kv_space: PagedKVSpace | None = None,
    ) -> None:
        self.model = model
        self.kv_dtype = kv_dtype  # CausalLM.new_cache's storage choice; None = the model dtype
        self.kv_space = kv_space  # paged KV: the sequences' caches take their rows from these pools
        self.device = model.device
        self._caches: dict[str, SequenceCache] = {}
        self._capacity: dict[str, int] = {}  # tokens each cache was allocated for
        # Prefix caching: after a forward, a cache whose length is a multiple of this records its
        # rolling state (SequenceCache.mark), so a non-truncatable cache can be snapshotted there later.
        self.mark_every = mark_every
        self._listener: KvListener | None = None
        self.spares: SpareCaches | None = None  # finished sequences' caches, for the next ones

    def execute(self, plan: StepPlan) -> RunnerOutput:
        out = RunnerOutput()
        chunks = [chunk for chunk in plan.chunks if self._cache_ready(chunk, out)]
        try:
            hidden = self._forward(chunks) if chunks else []
        except Exception:  # noqa: BLE001 - isolated below, by recomputing each sequence alone
            hidden = self._recompute_alone(chunks, out)
        rows = []
        for chunk, states in zip(chunks, hidden, strict=True):
            if states is None:
                continue
            self._mark(chunk.seq.request_id)
            last = self._outputs(chunk, states, out)
            if last is not None:
                out.sampled.append(chunk.seq)
                rows.append(last)
        if rows:
            out.logits = torch.cat(rows)
        return out

    def _cache_ready(self, chunk: ScheduledChunk, out: RunnerOutput) -> bool:
        request_id = chunk.seq.request_id
        try:
            cache = self._caches.get(request_id)
            if cache is None:
                cache = self._store(request_id, *self._allocate(chunk.seq.cache_tokens))
            elif self._capacity[request_id] < min(chunk.start + chunk.num_tokens, chunk.seq.cache_tokens):
                cache = self._move(request_id, cache, chunk.seq.cache_tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the engine fails this request only
            out.failures[request_id] = exc
            self.free(request_id)
            return False
        if cache.length == chunk.start:
            return True
        out.failures[request_id] = RuntimeError(
            f"cache holds {cache.length} tokens but the chunk starts at {chunk.start}"
        )
        self.free(request_id)
        return False

    @property
    def kv_listener(self) -> KvListener | None:
        return self._listener

    @kv_listener.setter
    def kv_listener(self, listener: KvListener | None) -> None:
        self._listener = listener
        if self.spares is not None:
            self.spares.listener = listener

    def _allocate(self, max_tokens: int) -> tuple[SequenceCache, int]:
        """A sequence's empty cache and its capacity: a spare emptied in place, else a new one (paged when the
        runner has a KV space, else :meth:`new_cache`)."""
        spare = self._spare(max_tokens)
        if spare is not None and spare[0].reset():
            return spare
        with paged_kv(self.kv_space):
            return self.new_cache(max_tokens), max_tokens

    def _move(self, request_id: str, cache: SequenceCache, capacity: int) -> SequenceCache:
        """The reservation grew and the chunk needs it: the state moves into a cache of ``capacity`` (a spare's, in
        place, where one has room), and the old cache goes to the spares where kept."""
        spare = self._spare(capacity)
        moved = spare if spare is not None and cache.copy_into(spare[0]) else (cache.clone_into(capacity), capacity)
        old_capacity = self._capacity[request_id]
        stored = self._store(request_id, *moved)  # the listener's entry for the sequence now holds the new cache
        self._keep(cache, old_capacity)
        return stored

    def _spare(self, max_tokens: int) -> tuple[SequenceCache, int] | None:
        """A spare with room for ``max_tokens`` (no longer a spare), or None after making room for a new cache."""
        if self.spares is None:
            return None
        spare = self.spares.take(max_tokens)
        if spare is None:
            self.spares.make_room(list(self._capacity.values()), max_tokens)
        return spare

    def new_cache(self, max_tokens: int) -> SequenceCache:
        """An empty contiguous cache of ``max_tokens`` (not tracked until stored; also what sizing measures)."""
        if self.kv_dtype is None:  # the plain call: a family without kv_dtype support still works
            return self.model.new_cache(max_tokens)
        return self.model.new_cache(max_tokens, kv_dtype=self.kv_dtype)

    def _forward(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor]:
        """One forward over the chunks' tokens; returns each chunk's final hidden states."""
        ids = torch.tensor([t for chunk in chunks for t in chunk.token_ids()], device=self.device)
        caches = [self._caches[chunk.seq.request_id] for chunk in chunks]
        lengths = [chunk.num_tokens for chunk in chunks]
        return list(self.model(ids, caches, lengths).split(lengths))

    def _recompute_alone(self, chunks: list[ScheduledChunk], out: RunnerOutput) -> list[torch.Tensor | None]:
        hidden: list[torch.Tensor | None] = []
        for chunk in chunks:
            request_id = chunk.seq.request_id
            try:
                self.free(request_id)  # its state is not trustworthy; its tensors may serve again
                cache = self._store(request_id, *self._allocate(chunk.seq.cache_tokens))
                if chunk.start:
                    history = chunk.seq.token_slice(0, chunk.start)
                    self.model(torch.tensor(history, device=self.device), cache)
                hidden.append(self._forward([chunk])[0])
            except Exception as exc:  # noqa: BLE001 - the engine fails this request only
                out.failures[request_id] = exc
                self.free(request_id)  # a half-written cache is unusable
                hidden.append(None)
        return hidden

    def _outputs(self, chunk: ScheduledChunk, hidden: torch.Tensor, out: RunnerOutput) -> torch.Tensor | None:
        """Prompt logits (when asked for) and the sampling row's logits (when the chunk samples)."""
        if rows := chunk.prompt_logit_rows:
            out.prompt_logits[chunk.seq.request_id] = self.model.compute_logits(hidden[:rows])
        # The sampling row is always computed alone, so the tokens do not depend on whether
        # prompt logprobs were requested (a [T, H] GEMM may round differently from a [1, H] one).
        return self.model.compute_logits(hidden[-1:]) if chunk.samples else None

    def _mark(self, request_id: str) -> None:
        cache = self._caches[request_id]
        if self.mark_every and cache.length % self.mark_every == 0:
            cache.mark()

    def adopt(self, request_id: str, cache: SequenceCache, capacity: int) -> None:
        """Start ``request_id`` from ``cache`` (a copy of a cached prefix, allocated for ``capacity`` tokens)
        instead of an empty cache."""
        self._store(request_id, cache, capacity)

    def adopt_prefix(self, request_id: str, snapshot: SequenceCache, length: int, capacity: int) -> None:
        """Start ``request_id`` from a cached prefix: ``snapshot`` at ``length`` tokens copied in place into a spare
        with room for ``capacity`` tokens (first the one it borrows its state from, where a copy of the rolling state
        alone does), else into a new cache of ``capacity`` (``clone_into``)."""
        lender = getattr(snapshot, "lender", None)
        spare = None if self.spares is None or lender is None else self.spares.take(capacity, lender)
        spare = spare or self._spare(capacity)
        with torch.inference_mode():  # the caches' tensors are inference tensors (made under the engine's step)
            copied = spare is not None and snapshot.copy_into(spare[0], length)
        if copied:
            self._store(request_id, *spare)
            return
        self._store(request_id, snapshot.clone_into(capacity, length), capacity)

    def _store(self, request_id: str, cache: SequenceCache, capacity: int) -> SequenceCache:
        self._caches[request_id] = cache
        self._capacity[request_id] = capacity
        if self.kv_listener is not None:
            self.kv_listener.allocated(request_id, cache.nbytes)
        return cache

    def cache_of(self, request_id: str) -> SequenceCache | None:
        return self._caches.get(request_id)

    def capacity_of(self, request_id: str) -> int:
        """Tokens the sequence's cache was allocated for (0 without a cache)."""
        return self._capacity.get(request_id, 0)

    def free(self, request_id: str) -> None:
        """Drop a sequence's cache (finished, aborted, failed or preempted): to the spares where kept."""
        capacity = self._capacity.pop(request_id, 0)
        cache = self._caches.pop(request_id, None)
        if cache is None:
            return
        if self.kv_listener is not None:
            self.kv_listener.freed(request_id)
        self._keep(cache, capacity)

    def _keep(self, cache: SequenceCache, capacity: int) -> None:
        """A cache no sequence holds now, to the spares where kept (whatever its state: the next sequence empties
        or overwrites it)."""
        if self.spares is not None:
            self.spares.put(cache, capacity, list(self._capacity.values()))

    @property
    def num_caches(self) -> int:
        return len(self._caches)
