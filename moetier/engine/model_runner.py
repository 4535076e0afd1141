"""Executes a :class:`StepPlan` on the model.

Today each scheduled chunk is one ``model.forward`` over that sequence's own contiguous cache
(sized at admission); the batched runner (one forward over every chunk, paged KV) replaces this
class behind the same ``execute``/``free`` contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.engine.scheduler import ScheduledChunk, Sequence, StepPlan
from moetier.models.base import CausalLM, SequenceCache


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


class ModelRunner:
    """Runs plans chunk by chunk, one contiguous cache per sequence."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.device = model.device
        self._caches: dict[str, SequenceCache] = {}

    def execute(self, plan: StepPlan) -> RunnerOutput:
        out = RunnerOutput()
        rows = []
        for chunk in plan.chunks:
            request_id = chunk.seq.request_id
            try:
                last = self._run_chunk(chunk, out)
            except Exception as exc:  # noqa: BLE001 - the engine fails this request only
                out.failures[request_id] = exc
                self.free(request_id)  # a half-written cache is unusable
                continue
            if last is not None:
                out.sampled.append(chunk.seq)
                rows.append(last)
        if rows:
            out.logits = torch.cat(rows)
        return out

    def _run_chunk(self, chunk: ScheduledChunk, out: RunnerOutput) -> torch.Tensor | None:
        seq = chunk.seq
        cache = self._caches.get(seq.request_id)
        if cache is None:
            cache = self._caches[seq.request_id] = self.model.new_cache(seq.kv_tokens)
        if cache.length != chunk.start:
            raise RuntimeError(f"cache holds {cache.length} tokens but the chunk starts at {chunk.start}")
        hidden = self.model(torch.tensor(chunk.token_ids(), device=self.device), cache)
        if rows := chunk.prompt_logit_rows:
            out.prompt_logits[seq.request_id] = self.model.compute_logits(hidden[:rows])
        # The sampling row is always computed alone, so the tokens do not depend on whether
        # prompt logprobs were requested (a [T, H] GEMM may round differently from a [1, H] one).
        return self.model.compute_logits(hidden[-1:]) if chunk.samples else None

    def free(self, request_id: str) -> None:
        """Drop a sequence's cache (finished, aborted or failed)."""
        self._caches.pop(request_id, None)

    @property
    def num_caches(self) -> int:
        return len(self._caches)
