"""Sequences and the FCFS scheduler: which sequences run this step, and how many tokens each computes.

The scheduler only plans; a model runner executes the plan. Each step:

1. every running sequence that is decoding computes one token (its last sampled one);
2. prefill work shares a budget of ``prefill_chunk_tokens``: sequences already admitted but not yet
   fully prefilled continue first (oldest first), then waiting sequences are admitted in arrival
   order while a stream is free, the budget is not spent and their KV tokens fit.

A long prompt is thus prefilled a chunk per step while the running streams keep decoding. KV tokens
are reserved at admission (prompt + the most it may generate, within the window) and released the
moment a sequence finishes or is aborted. Admission is strictly FCFS: when the oldest waiting
sequence does not fit, nothing behind it jumps the queue (no starvation of long requests).

Prefix caching hooks in twice: ``on_admit`` lets the engine start an admitted sequence from a cached
prefix (it raises ``num_computed`` before the first chunk is planned), and a sequence's
``prefill_stop`` makes a chunk end exactly there (so a cache that cannot be rewound is snapshotted
at the prompt's last block boundary).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moetier.engine.sampling import SamplingParams, TokenLogprob
from moetier.errors import ConfigError


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

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_tokens(self) -> int:
        """KV tokens reserved for the sequence's whole life."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

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
        """How many leading positions of the chunk predict a prompt token (for ``prompt_logprobs``)."""
        if self.seq.params.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + self.num_tokens, self.seq.num_prompt - 1) - self.start)

    def token_ids(self) -> list[int]:
        return self.seq.token_slice(self.start, self.num_tokens)


@dataclass
class StepPlan:
    """What one step computes: decode chunks (one token each) first, then prefill chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """FCFS admission under a stream limit and a KV-token budget, with chunked prefill."""

    def __init__(self, max_streams: int, prefill_chunk_tokens: int, kv_token_budget: int) -> None:
        if min(max_streams, prefill_chunk_tokens, kv_token_budget) < 1:
            raise ConfigError("max_streams, prefill_chunk_tokens and kv_token_budget must be >= 1")
        self.max_streams = max_streams
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_token_budget = kv_token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_tokens_used = 0
        self._arrivals = 0
        # Called with each sequence as it is admitted, before its first chunk is planned: the engine
        # starts it from a cached prefix there (raising ``num_computed``).
        self.on_admit: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence) -> None:
        if seq.kv_tokens > self.kv_token_budget:
            raise ConfigError(
                f"the request needs {seq.kv_tokens} KV tokens (prompt + max_tokens) but kv_token_budget is "
                f"{self.kv_token_budget}; lower max_tokens or raise kv_token_budget"
            )
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """Plan the next step (admits waiting sequences as a side effect)."""
        plan = StepPlan([ScheduledChunk(s, s.num_computed, 1) for s in self.running if not s.prefilling])
        budget = self.prefill_chunk_tokens
        for seq in self.running:
            if seq.prefilling and budget > 0:
                budget -= self._prefill_chunk(plan, seq, budget)
        while budget > 0 and self.waiting and len(self.running) < self.max_streams:
            seq = self.waiting[0]
            if self.kv_tokens_used + seq.kv_tokens > self.kv_token_budget:
                break
            self.waiting.popleft()
            self.kv_tokens_used += seq.kv_tokens
            seq.state = SequenceState.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            budget -= self._prefill_chunk(plan, seq, budget)
        return plan

    @staticmethod
    def _prefill_chunk(plan: StepPlan, seq: Sequence, budget: int) -> int:
        # A prefill covers every pending token (the prompt, or prompt + output when recomputing).
        count = min(seq.num_pending, budget)
        if seq.num_computed < seq.prefill_stop < seq.num_computed + count:
            count = seq.prefill_stop - seq.num_computed
        plan.chunks.append(ScheduledChunk(seq, seq.num_computed, count))
        return count

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` (finished or aborted) wherever it is and release its KV tokens at once."""
        if seq.state is SequenceState.RUNNING:
            self.running.remove(seq)
            self.kv_tokens_used -= seq.kv_tokens
        elif seq.state is SequenceState.WAITING:
            self.waiting.remove(seq)
        seq.state = SequenceState.FINISHED
