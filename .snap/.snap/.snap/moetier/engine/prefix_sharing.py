"""Same-step prefix sharing: requests that arrive together with a long common prefix prefill it once.

The prefix cache (:mod:`moetier.engine.prefix_cache`) only serves prefixes that some sequence has
already computed and snapshotted. When an agent sends several requests at once with the same long
conversation prefix (parallel tool calls, n > 1 as separate requests, a best-of-k retry), each would
prefill the whole prefix. Instead, the scheduler asks :meth:`PrefixSharing.defer` about each waiting
sequence before admitting it:

- its *leader* is the running sequence whose tokens share the most full blocks with the waiting
  prompt (chain hashes: equal hash at block ``i`` means equal tokens up to there), the shared part
  capped so that at least one prompt token is left to compute (as a prefix-cache hit is);
- the waiting sequence is deferred only while that shared prefix exceeds what the cache already serves
  it by at least ``min_blocks`` blocks and the leader has not computed it yet; the prefix's end goes
  into the leader's ``share_stops``, so a leader chunk ends there and the engine snapshots its cache
  at that block boundary (where a rolling, non-truncatable cache such as DeepSeek-V4's is marked);
- a leader that has computed the prefix already is snapshotted there at once (a truncatable cache
  can be, at any length; a rolling one only where it stands marked) and nobody waits;
- a leader that finishes, is aborted, fails or is preempted leaves ``scheduler.running``, so the next
  step admits its followers normally (the first one may then lead the others);
- no sequence is deferred for more than ``max_wait_s`` seconds in total (``0`` turns sharing off),
  and requests asking for prompt logprobs (never served from the cache) or recomputing after a
  preemption are never deferred.

Once the snapshot is in the cache, the deferred sequence is admitted and the engine's ``on_admit``
starts it from the cached prefix, exactly as for a prefix cached by an earlier request.

Counters: ``deferrals`` (requests deferred at least once) and ``tokens_saved`` (prompt tokens that
requests deferred for, or served by, a running leader's prefix took from the cache at admission).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from moetier.engine.prefix_cache import PrefixCache
from moetier.engine.scheduler import Scheduler, Sequence
from moetier.errors import ConfigError

__all__ = ["PrefixSharing", "common_blocks"]

logger = logging.getLogger(__name__)


def common_blocks(a: Seq[bytes], b: Seq[bytes]) -> int:
    """How many leading chain hashes ``a`` and ``b`` share. A chain hash digests every earlier block,
    so the shared blocks are a prefix of both lists and a binary search finds their end."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixSharing:
    """The scheduler's ``defer`` hook for same-step prefix sharing; see the module docstring.

    ``hashes(seq, num_tokens)``: chain hashes of the full blocks among ``seq``'s first ``num_tokens``
    tokens; ``publish(seq, num_tokens)``: snapshot ``seq``'s cache at that block boundary into ``cache``
    (may silently do nothing). ``clock``: seconds, monotonic (replaceable in tests).
    """

    def __init__(
        self,
        cache: PrefixCache,
        scheduler: Scheduler,
        hashes: Callable[[Sequence, int], list[bytes]],
        publish: Callable[[Sequence, int], None],
        min_blocks: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_blocks < 1 or max_wait_s < 0:
            raise ConfigError(
                f"prefix sharing needs min_blocks >= 1 and max_wait_s >= 0, got {min_blocks}, {max_wait_s}"
            )
        self.cache = cache
        self.scheduler = scheduler
        self.hashes = hashes
        self.publish = publish
        self.min_blocks = min_blocks
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.deferrals = 0
        self.tokens_saved = 0

    def defer(self, seq: Sequence) -> bool:
        """Whether ``seq`` (waiting) should stay queued this step, for a running leader's prefix."""
        if self.max_wait_s <= 0 or seq.params.prompt_logprobs is not None or seq.output_ids or seq.preemptions:
            return False
        if seq.deferred_since is not None and self.clock() - seq.deferred_since > self.max_wait_s:
            if seq.shared_prefix:  # log once, when the bound first lets it through
                logger.info("request %s waited %.1f s for a shared prefix; prefilling it itself", seq.request_id,
                            self.clock() - seq.deferred_since)  # fmt: skip
                seq.shared_prefix = 0
            return False
        block = self.cache.block_tokens
        limit = (seq.num_prompt - 1) // block  # a hit always leaves one prompt token to compute
        if limit < self.min_blocks:
            return False
        mine = self.hashes(seq, limit * block)
        have = self.cache.peek(mine, seq.num_prompt) // block
        leader, shared = None, 0
        for other in self.scheduler.running:
            if other.num_tokens // block <= max(have, shared):
                continue  # too short to beat what is already on offer
            blocks = common_blocks(mine, self.hashes(other, min(other.num_tokens, limit * block)))
            if blocks > shared:
                leader, shared = other, blocks
        if leader is None or shared - have < self.min_blocks:
            return False
        stop = shared * block
        if leader.num_computed >= stop:  # computed already: snapshot it now if the cache allows
            self.publish(leader, stop)
            seq.shared_prefix = stop if self.cache.peek(mine, seq.num_prompt) >= stop else 0
            return False
        if stop not in leader.share_stops:
            leader.share_stops.append(stop)
        seq.shared_prefix = stop
        if seq.deferred_since is None:
            seq.deferred_since = self.clock()
            self.deferrals += 1
            logger.info(
                "request %s waits for request %s to prefill the %d prompt tokens they share (%d computed)",
                seq.request_id,
                leader.request_id,
                stop,
                leader.num_computed,
            )
        return True

    def served(self, seq: Sequence, hit_tokens: int) -> None:
        """Engine hook: ``seq`` was admitted from a cached prefix of ``hit_tokens`` tokens."""
        if seq.shared_prefix and not seq.preemptions:
            self.tokens_saved += min(hit_tokens, seq.shared_prefix)
        seq.shared_prefix = 0

    def stats(self) -> dict[str, int]:
        return {"prefix_shared_deferrals_total": self.deferrals, "prefix_shared_tokens_saved_total": self.tokens_saved}
