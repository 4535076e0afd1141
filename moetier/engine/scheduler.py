"""Sequences and the FCFS scheduler: which sequences run this step, and how many tokens each computes.

The scheduler only plans; a model runner executes the plan. Each step:

1. (optimistic admission) every decoding sequence's next token must fit its KV reservation: the
   reservation grows, or the most recently arrived running sequence is preempted to make room;
2. every running sequence that is decoding computes one token (its last sampled one);
3. prefill work shares a budget of ``prefill_chunk_tokens``: sequences already admitted but not yet
   fully prefilled (or recomputing after a preemption) continue first, then waiting sequences are
   admitted in arrival order while a stream is free, the budget is not spent and their KV tokens fit.

A long prompt is thus prefilled a chunk per step while the running streams keep decoding. KV tokens are
released the moment a sequence finishes, is aborted or is preempted. Admission is strictly FCFS: when
the oldest waiting sequence does not fit, nothing behind it jumps the queue (no starvation of long
requests). Two admission modes (``kv_admission``):

- ``"reserve"``: a sequence reserves at admission the most it may ever hold (prompt + ``max_new_tokens``)
  and never needs more; nothing is ever preempted. Agents asking for ``max_tokens`` near the window
  leave the budget mostly idle.
- ``"optimistic"`` (vLLM's way): admission reserves the tokens to compute plus ``headroom`` (capped
  at the sequence's whole life and at the budget); before each step's decodes are planned, a decoding
  sequence whose next token does not fit grows its reservation by ``max(headroom, reservation / 8)``
  (geometric, so a contiguous cache is copied O(log) times; at least the one token needed, at most what
  is free). With ``power_of_two`` (contiguous caches that decode graphs read in place,
  ``CausalLM.decode_graphs_read_caches``, V4: a cache that moves, or a new one, captures them again)
  reservations are powers of two, at admission (past the sequence's own life if need be, up to one
  stream's share of the budget) and as they double, so that a finished sequence's cache fits the next,
  longer turn of an agent (:mod:`moetier.engine.spare_caches`), unless the power of two does not fit
  (admission) or would take over half of the free budget (growth): then as above. When the
  budget is spent, the running
  sequence that arrived last is preempted (LIFO, so the oldest always progress and none starves): the
  engine frees its cache, it goes back to the FRONT of the waiting queue with its output kept, and when
  re-admitted it recomputes prompt + output as a prefill whose last position alone samples (no token is
  sampled or sent twice). A sequence that is
  alone and still cannot grow (its prompt + ``max_tokens`` exceed the whole budget) is finished with
  ``"length"`` (``StepPlan.exhausted``) rather than preempted in favour of nothing.

Prefix caching hooks in twice: ``on_admit`` lets the engine start an admitted sequence from a cached
prefix (it raises ``num_computed`` before the first chunk is planned), and a sequence's
``prefill_stop`` makes a chunk end exactly there (so a cache that cannot be rewound is snapshotted
at the prompt's last block boundary). ``on_preempt`` lets the engine drop a victim's cache (and keep
a snapshot of it) before its progress is reset.

Same-step prefix sharing (:mod:`moetier.engine.prefix_sharing`) adds a third hook, ``defer``: asked
about each waiting sequence in turn, it may hold one back while a running sequence prefills a long
prefix they share (and add that prefix's end to the running one's ``share_stops``, where its chunks end so
the engine snapshots it there). Admission rule with deferrals: a deferred sequence keeps its place and
*claims* a stream and its admission KV tokens; a sequence behind it is admitted only into what is
left after every claim ahead of it, and the first one that does not fit stops admission as before. So
a later arrival never takes capacity an earlier (deferred) one will need when its prefix is ready, and
among the sequences that are not deferred the order stays strictly FCFS; the deferral itself is bounded
in time by the hook.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moetier.engine.sampling import SamplingParams, TokenLogprob
from moetier.errors import ConfigError

logger = logging.getLogger(__name__)

KV_ADMISSION_MODES = ("reserve", "optimistic")


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress.

    ``num_computed`` tokens (of prompt + output) are in the runner's cache; the tokens after them
    are what the next chunk computes. In decode exactly one is pending: the last sampled token.
    ``max_new_tokens`` is ``max_tokens`` capped by the window.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: SequenceState = SequenceState.WAITING
    # Filled as prefill chunks run when params.prompt_logprobs is set; the first prompt token has none.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Prefix caching: chain hashes of the full blocks computed so far (extended lazily), and a position
    # no prefill chunk crosses (where a cache that cannot be rewound must be snapshotted; 0 = none).
    block_hashes: list[bytes] = field(default_factory=list)
    prefill_stop: int = 0
    # KV tokens the scheduler holds for the sequence now (0 while waiting): the capacity its cache may use.
    kv_reserved: int = 0
    preemptions: int = 0
    # Same-step prefix sharing: positions where this sequence's prefill chunks end so that the engine
    # snapshots a prefix a waiting sequence shares; when this (waiting) sequence was first deferred for a
    # running one's prefix (None: never), and the prefix length it was deferred for / served from.
    share_stops: list[int] = field(default_factory=list)
    deferred_since: float | None = None
    shared_prefix: int = 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_tokens(self) -> int:
        """KV tokens of the sequence's whole life (prompt + the most it may generate)."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def cache_tokens(self) -> int:
        """The capacity a cache for the sequence is allocated with: its reservation (whole life if none)."""
        return self.kv_reserved or self.kv_tokens

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def needs_prefill(self) -> bool:
        """Whether the next chunk is a prefill: the prompt is unfinished, or output tokens are to be
        recomputed after a preemption (a decoding sequence has exactly one token pending)."""
        return self.prefilling or self.num_pending > 1

    def token_slice(self, start: int, count: int) -> list[int]:
        """Tokens ``start .. start + count - 1`` of prompt + output, without concatenating the whole history."""
        prompt = self.prompt_ids
        if start >= len(prompt):
            return self.output_ids[start - len(prompt) : start - len(prompt) + count]
        head = prompt[start : start + count]
        return head + self.output_ids[: count - len(head)]


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start`` (= ``seq.num_computed``)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the last known token, so its final logits pick the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def prompt_logit_rows(self) -> int:
        """How many leading positions of the chunk predict a prompt token (for ``prompt_logprobs``); none
        when every prompt token is scored already (a recompute after a preemption)."""
        if self.seq.params.prompt_logprobs is None or len(self.seq.prompt_logprobs) >= self.seq.num_prompt:
            return 0
        return max(0, min(self.start + self.num_tokens, self.seq.num_prompt - 1) - self.start)

    def token_ids(self) -> list[int]:
        return self.seq.token_slice(self.start, self.num_tokens)


@dataclass
class StepPlan:
    """What one step computes: decode chunks (one token each) first, then prefill chunks.

    ``exhausted``: sequences the scheduler removed because they cannot grow even alone (optimistic
    admission); the engine finishes them with ``"length"``.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    exhausted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """FCFS admission under a stream limit and a KV-token budget, with chunked prefill and (optimistic
    admission) preemption by recompute; see the module docstring."""

    def __init__(
        self,
        max_streams: int,
        prefill_chunk_tokens: int,
        kv_token_budget: int,
        admission: str = "reserve",
        headroom: int = 256,
        power_of_two: bool = False,
    ) -> None:
        if min(max_streams, prefill_chunk_tokens, kv_token_budget, headroom) < 1:
            raise ConfigError("max_streams, prefill_chunk_tokens, kv_token_budget and headroom must be >= 1")
        if admission not in KV_ADMISSION_MODES:
            raise ConfigError(f"kv_admission must be one of {', '.join(KV_ADMISSION_MODES)}, got {admission!r}")
        self.max_streams = max_streams
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_token_budget = kv_token_budget
        self.admission = admission
        self.headroom = headroom
        self.power_of_two = power_of_two
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_tokens_used = 0
        self.preemptions = 0
        self._arrivals = 0
        # Called with each sequence as it is admitted, before its first chunk is planned: the engine
        # starts it from a cached prefix there (raising ``num_computed``).
        self.on_admit: Callable[[Sequence], None] | None = None
        # Called with a victim just before its KV is released and its progress reset: the engine frees
        # (and may snapshot) its cache.
        self.on_preempt: Callable[[Sequence], None] | None = None
        # Asked about each waiting sequence before it is admitted: True holds it back this step (prefix
        # sharing; see the module docstring for how the queue order is kept).
        self.defer: Callable[[Sequence], bool] | None = None

    @property
    def optimistic(self) -> bool:
        return self.admission == "optimistic"

    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        """Raise :class:`ConfigError` when a request could not run even alone: its prompt + ``max_new_tokens``
        exceed the budget (reserve), or its prompt + one generated token do (optimistic)."""
        if not self.optimistic:
            need, what, fix = num_prompt + max_new_tokens, "prompt + max_tokens", "lower max_tokens"
        else:
            need, what, fix = num_prompt + 1, "prompt + 1 generated token", "shorten the prompt"
        if need > self.kv_token_budget:
            raise ConfigError(
                f"the request needs {need} KV tokens ({what}) but kv_token_budget is "
                f"{self.kv_token_budget}; {fix} or raise kv_token_budget"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt, seq.max_new_tokens)
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """Plan the next step (grows reservations, preempts and admits as side effects)."""
        plan = StepPlan()
        if self.optimistic:
            self._make_room(plan)
        plan.chunks = [ScheduledChunk(s, s.num_computed, 1) for s in self.running if not s.needs_prefill]
        budget = self.prefill_chunk_tokens
        for seq in self.running:
            if seq.needs_prefill and budget > 0:
                budget -= self._prefill_chunk(plan, seq, budget)
        claimed_streams = claimed_tokens = 0  # held for deferred sequences ahead in the queue
        for seq in list(self.waiting):
            if len(self.running) + claimed_streams >= self.max_streams:
                break
            reserve = self._admission_tokens(seq, self.kv_token_budget - self.kv_tokens_used - claimed_tokens)
            # Asked even when the prefill budget is spent, so that a leader learns its share stops before
            # its next chunk is planned.
            if self.defer is not None and self.defer(seq):
                claimed_streams += 1
                claimed_tokens += reserve
                continue
            if budget <= 0 or self.kv_tokens_used + claimed_tokens + reserve > self.kv_token_budget:
                break
            self.waiting.remove(seq)
            self.kv_tokens_used += reserve
            seq.kv_reserved = reserve
            seq.state = SequenceState.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            budget -= self._prefill_chunk(plan, seq, budget)
        if self.defer is not None:  # a deferral may have added a share stop inside a chunk planned above
            for chunk in plan.chunks:
                chunk.num_tokens = self._clip(chunk.seq, chunk.start, chunk.num_tokens)
        return plan

    def _admission_tokens(self, seq: Sequence, room: int) -> int:
        """KV tokens reserved when ``seq`` is admitted with ``room`` tokens free (see the module docstring)."""
        if not self.optimistic:
            return seq.kv_tokens
        # The budget cap keeps a re-admitted long sequence admissible (it recomputes, then grows or is
        # exhausted); never below its tokens, which it must hold to recompute them.
        want = seq.num_tokens + self.headroom
        exact = max(seq.num_tokens, min(seq.kv_tokens, want, self.kv_token_budget))
        if not self.power_of_two:
            return exact
        # Past its own life too (the next turn's longer prompt fits its cache), but within one stream's share.
        rounded = max(exact, min(_power_of_two(want), self.kv_token_budget // self.max_streams))
        return rounded if rounded <= room else exact

    @staticmethod
    def _prefill_chunk(plan: StepPlan, seq: Sequence, budget: int) -> int:
        # A prefill covers every pending token (the prompt, or prompt + output when recomputing).
        count = Scheduler._clip(seq, seq.num_computed, min(seq.num_pending, budget))
        plan.chunks.append(ScheduledChunk(seq, seq.num_computed, count))
        return count

    @staticmethod
    def _clip(seq: Sequence, start: int, count: int) -> int:
        """``count`` shortened so that a chunk from ``start`` crosses none of ``seq``'s stops."""
        for stop in (seq.prefill_stop, *seq.share_stops):
            if start < stop < start + count:
                count = stop - start
        return count

    # --- optimistic admission: growth and preemption ----------------------------------------------

    def _make_room(self, plan: StepPlan) -> None:
        """Make every decoding sequence's pending token fit its reservation, oldest first (they claim the
        free budget before newer ones), preempting the newest running sequences when it is spent."""
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.state is not SequenceState.RUNNING or seq.needs_prefill:
                continue  # preempted by an older sequence in this loop, or within its admission reservation
            # The pending token is written at position num_tokens - 1: the cache must hold num_tokens.
            while seq.kv_reserved < seq.num_tokens and not self._grow(seq):
                victim = max(self.running, key=lambda s: s.arrival)
                if victim is seq and len(self.running) == 1:
                    self._exhaust(seq, plan)
                    break
                self._preempt(victim, seq)
                if victim is seq:
                    break

    def _grow(self, seq: Sequence) -> bool:
        """Grow ``seq``'s reservation to hold its pending token, if the budget has room; returns success."""
        need = seq.num_tokens - seq.kv_reserved
        room = self.kv_token_budget - self.kv_tokens_used
        if need > room:
            return False
        step = max(self.headroom, seq.kv_reserved // 8)
        doubled = _power_of_two(seq.num_tokens) - seq.kv_reserved
        # A large grant while the budget is short would preempt a newer stream sooner (a recompute of all its
        # tokens, dearer than what the larger step saves): then it grows as little as usual.
        if self.power_of_two and doubled <= room // 2:
            step = doubled
        grant = max(need, min(step, room, seq.kv_tokens - seq.kv_reserved))
        seq.kv_reserved += grant
        self.kv_tokens_used += grant
        return True

    def _preempt(self, victim: Sequence, beneficiary: Sequence) -> None:
        """Release ``victim``'s KV and queue it first, to recompute its tokens when re-admitted."""
        if self.on_preempt is not None:
            self.on_preempt(victim)
        self.running.remove(victim)
        self.kv_tokens_used -= victim.kv_reserved
        self.preemptions += 1
        victim.preemptions += 1
        logger.info(
            "preempted request %s (%d tokens, %d KV tokens freed) so that request %s can grow; "
            "it waits first in the queue and will recompute its tokens (preemption #%d)",
            victim.request_id,
            victim.num_tokens,
            victim.kv_reserved,
            beneficiary.request_id,
            self.preemptions,
        )
        victim.kv_reserved = victim.num_computed = victim.prefill_stop = 0
        victim.share_stops = []
        victim.state = SequenceState.WAITING
        # Victims go newest-first, each to the front, so the queue stays in arrival order.
        self.waiting.appendleft(victim)

    def _exhaust(self, seq: Sequence, plan: StepPlan) -> None:
        logger.warning(
            "request %s cannot grow past %d tokens: alone it fills the KV-token budget (%d); finishing it "
            "with 'length' (raise kv_token_budget or lower max_tokens)",
            seq.request_id,
            seq.num_tokens,
            self.kv_token_budget,
        )
        self.finish(seq)
        plan.exhausted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` (finished or aborted) wherever it is and release its KV tokens at once."""
        if seq.state is SequenceState.RUNNING:
            self.running.remove(seq)
            self.kv_tokens_used -= seq.kv_reserved
        elif seq.state is SequenceState.WAITING:
            self.waiting.remove(seq)
        seq.kv_reserved = 0
        seq.state = SequenceState.FINISHED


def _power_of_two(tokens: int) -> int:
    """The least power of two >= ``tokens`` (>= 1)."""
    return 1 << max(0, tokens - 1).bit_length()
