"""The engine's prefix caching: requests start from cached prefixes, and chunks that reach a boundary publish one.

:class:`PrefixHooks` wires a :class:`~moetier.engine.prefix_cache.PrefixCache` to the engine's scheduler (its
``on_admit`` hook starts an admitted sequence from the longest cached prefix of its prompt; a non-truncatable
family's chunks end at the prompt's last block boundary) and runner (the hit's snapshot copied into the sequence's
cache; marks at every boundary), plus same-step prefix sharing (:mod:`moetier.engine.prefix_sharing`). The engine
calls :meth:`PrefixHooks.publish_prompt` after each successful chunk and :meth:`PrefixHooks.publish` at a finish or
preemption (prompt + output, for a conversation's next turn).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moetier.engine.prefix_cache import PrefixCache, chain_hashes
from moetier.engine.prefix_sharing import PrefixSharing
from moetier.models.base import SequenceCache

if TYPE_CHECKING:
    from moetier.engine.model_runner import ModelRunner
    from moetier.engine.scheduler import ScheduledChunk, Scheduler, Sequence

logger = logging.getLogger("moetier.engine.engine")  # its messages are the engine's


class PrefixHooks:
    """Prefix caching for one engine (``cache`` and ``sharing`` None when it is off or the family's caches cannot
    be snapshotted). ``fit_experts`` makes the expert cache's room for a copy; ``count_prompt(seq, tokens)`` counts
    served prompt tokens."""

    def __init__(
        self,
        config: Any,
        model: Any,
        runner: ModelRunner,
        scheduler: Scheduler,
        fit_experts: Callable[[], None],
        count_prompt: Callable[[Sequence, int], None],
    ) -> None:
        self.runner, self.scheduler = runner, scheduler
        self._fit_experts, self._count_prompt = fit_experts, count_prompt
        self.cache: PrefixCache | None = None
        self.sharing: PrefixSharing | None = None  # same-step prefix sharing (moetier.engine.prefix_sharing)
        self.truncatable = True
        if not config.enable_prefix_caching:
            return
        probe = model.new_cache(1)
        if type(probe).snapshot is SequenceCache.snapshot:
            logger.info("prefix caching off: %s caches cannot be snapshotted", type(probe).__name__)
            return
        self.truncatable = probe.truncatable
        # Paged KV: snapshots share the pools' blocks, and a pool out of blocks evicts them (reclaim hook).
        self.cache = PrefixCache(config.prefix_block_tokens, config.prefix_cache_bytes, runner.kv_space)
        runner.mark_every = None if probe.truncatable else config.prefix_block_tokens
        scheduler.on_admit = self.admit
        self.sharing = PrefixSharing(self.cache, scheduler, self.hashes, self.publish,
                                     config.prefix_share_min_blocks, config.prefix_share_max_wait_s)  # fmt: skip
        scheduler.defer = self.sharing.defer

    def hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chain hashes of the full blocks among ``seq``'s first ``num_tokens`` tokens (memoised on ``seq``)."""
        assert self.cache is not None
        block = self.cache.block_tokens
        blocks = num_tokens // block
        if len(seq.block_hashes) < blocks:
            seq.block_hashes = chain_hashes(seq.token_slice(0, blocks * block), block, seq.block_hashes)
        return seq.block_hashes[:blocks]

    def admit(self, seq: Sequence) -> None:
        """Scheduler hook: start ``seq`` from the longest cached prefix of its prompt."""
        cache = self.cache
        assert cache is not None
        # Prompt logprobs need every prompt position's logits, which a cached prefix does not have; such
        # (scoring) requests are neither served from the cache nor have their chunking bent for it.
        if seq.params.prompt_logprobs is not None or seq.num_computed:
            return
        if not self.truncatable:  # the prompt's last boundary must be reached by a chunk end
            seq.prefill_stop = seq.num_prompt // cache.block_tokens * cache.block_tokens
        # A preempted sequence looks up prompt + output: its own snapshot may serve most of its recompute.
        hit = cache.lookup(self.hashes(seq, seq.num_tokens), seq.num_tokens)
        if hit is None:
            return
        self._fit_experts()  # the copy below may be a full-size cache: make its room first
        try:
            self.runner.adopt_prefix(seq.request_id, hit.snapshot, hit.length, seq.cache_tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: compute the prompt instead
            logger.warning("request %s: prefix cache copy failed (%s); prefilling in full", seq.request_id, exc)
            return
        seq.num_computed = hit.length
        if self.sharing is not None:
            self.sharing.served(seq, hit.length)
        # Served prompt tokens count as prompt tokens too (once, whatever the re-admissions).
        self._count_prompt(seq, min(hit.length, seq.num_prompt))

    def publish_prompt(self, chunk: ScheduledChunk) -> None:
        """Snapshot the prompt at its last block boundary, and at each prefix a waiting request shares
        (``share_stops``), once a chunk has computed past it."""
        if self.cache is None:
            return
        seq = chunk.seq
        boundary = seq.num_prompt // self.cache.block_tokens * self.cache.block_tokens
        for stop in (*seq.share_stops, boundary):
            if chunk.start < stop <= seq.num_computed:
                self.publish(seq, stop)

    def publish(self, seq: Sequence, num_tokens: int) -> None:
        """Store a snapshot of ``seq``'s cache at the last block boundary within its first ``num_tokens``
        tokens. Only called after successful forwards, so a failed or aborted request never publishes."""
        cache = self.cache
        if cache is None or num_tokens < cache.block_tokens:
            return
        hashes = self.hashes(seq, num_tokens)
        live = self.runner.cache_of(seq.request_id)
        if live is None or cache.contains(hashes):
            return
        try:
            length = len(hashes) * cache.block_tokens
            # Where finished caches are kept (spares), a snapshot may borrow the cache's memory: it stays servable
            # while the cache holds that state, and the next turn may start in that very cache.
            borrowed = live.borrowed_snapshot(length) if self.runner.spares is not None else None
            cache.insert(hashes, borrowed or live.snapshot(length))
        except Exception as exc:  # noqa: BLE001 - caching is an optimisation: never fail the request for it
            logger.debug("request %s: no prefix snapshot at %d tokens (%s)", seq.request_id, num_tokens, exc)
