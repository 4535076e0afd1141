"""The synchronous serving engine: requests in, per-step :class:`RequestUpdate` out.

One thread drives it (:class:`moetier.engine.async_engine.AsyncEngine` from a background thread,
:class:`moetier.llm.LLM` inline). A step is: the scheduler plans (decodes + prefill chunks), the
model runner computes, the sampler picks every sampling sequence's next token on the device in one
batch, then each sequence's text, stop conditions and logprobs become its update. A failure in
one request's forward, sampling or text handling finishes that request with ``finish_reason
"abort"`` and ``error`` set; the others carry on.

With prefix caching (:mod:`moetier.engine.prefix_cache`), an admitted request starts from a copy of
the longest cached prefix of its prompt; a request publishes snapshots when its prompt reaches its
last block boundary and when it finishes (``stop``/``length``: prompt + output, for the next turn of
a conversation). Aborted and failed requests publish nothing further.

With tiered experts the VRAM expert cache is elastic (:mod:`moetier.engine.elastic`): it shrinks by
whole slots between steps when the running sequences' KV outgrows the plan's reservation, and grows
back when they finish; the KV-token budget is lowered so that the cache's floor is never crossed.

With optimistic KV admission (``EngineConfig.kv_admission``, :mod:`moetier.engine.scheduler`) a
request reserves only its prompt plus some headroom and grows; when the budget is spent the newest
running request is preempted: its cache is dropped (a snapshot of it goes to the prefix cache when it
can), and on re-admission its prompt + output are recomputed as a prefill. Its sampler state (seeded
generator, penalty counts) lives on the engine's ``_Request``, which preemption never touches, and only
the recompute's last position samples, so the tokens are those an uninterrupted run would give and
nothing is sent twice. ``stats().preemptions_total`` counts preemptions.

Prefill is metered (:mod:`moetier.engine.prefill_meter`): a completed prefill logs one INFO line
(tokens, prefix-cache hit, seconds, tok/s), a long one logs its progress every ``log_interval``
seconds, and ``stats()`` carries the prefill counters and each prefilling request's progress.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetier.config import ModelLoadConfig, default_device
from moetier.engine.detokenizer import IncrementalText
from moetier.engine.elastic import ElasticExpertBudget
from moetier.engine.kv_sizing import resolve_kv_layout, size_kv
from moetier.engine.model_runner import ModelRunner
from moetier.engine.prefill_meter import PrefillMeter
from moetier.engine.prefix_cache import PrefixCache
from moetier.engine.prefix_hooks import PrefixHooks
from moetier.engine.prefix_sharing import PrefixSharing
from moetier.engine.sampling import (
    PenaltyState,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    make_generator,
    sample_tokens,
    token_logprobs,
)
from moetier.engine.scheduler import Scheduler, Sequence
from moetier.engine.spare_caches import SpareCaches, borrowed_prefix_snapshots, graphs_read_caches
from moetier.engine.types import (
    EngineBusyError,
    EngineConfig,
    EngineStats,
    RequestUpdate,
    checkpoint_config,
    load_tokenizer,
    prefill_stats,
    resolve_dtype,
    resolve_window,
    token_id_set,
)
from moetier.errors import ConfigError
from moetier.models.paged_kv import PagedKVSpace
from moetier.weights.loader import LoadedModel, load_model

__all__ = ["Engine", "EngineBusyError", "EngineConfig", "EngineStats", "RequestUpdate", "TokenLogprob"]

logger = logging.getLogger(__name__)

# Sampling defaults a checkpoint's generation_config.json may carry (vLLM applies them too).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(eq=False)
class _Request:
    """Engine-side state of one request beyond the scheduler's view."""

    seq: Sequence
    text: IncrementalText
    # Sampler state: kept here for the request's whole life, so a preemption (which only resets the
    # sequence's cache progress) cannot change what is drawn next.
    generator: torch.Generator | None
    penalties: PenaltyState | None = None
    updates_sent: int = 0
    prompt_counted: int = 0  # prompt tokens already counted in prompt_tokens_total (recomputes add none)


class Engine:
    """Continuous generation over many requests; see the module docstring.

    ``model``: a checkpoint folder (loaded here) or a :class:`LoadedModel`. ``tokenizer``: ``"auto"``
    (the checkpoint folder's), a tokenizer object, or ``None`` (token ids only, empty text).
    Attributes the server uses: ``tokenizer``, ``eos_token_ids``, ``max_model_len``, ``model_name``.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel,
        config: EngineConfig | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        tokenizer: Any = "auto",
        load_progress: bool = True,
        dispatcher: str = "resident",
        dispatcher_options: dict[str, Any] | None = None,
        model_name: str | None = None,
        tiers: Any = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.plan: Any = None  # the PlacementPlan when loaded with ``tiers`` (moetier.tiers.plan.TierOptions)
        if isinstance(model, LoadedModel):
            self.loaded = model
            self.path = model.checkpoint.path
            self.max_model_len = resolve_window(model.hf_config, self.config.max_model_len)
        else:
            self.path = Path(model).expanduser()
            hf_config = checkpoint_config(self.path)
            self.max_model_len = resolve_window(hf_config, self.config.max_model_len)
            target = torch.device(device) if device is not None else default_device()
            load_config = self.config.load_config(resolve_dtype(dtype, hf_config, target), target, self.max_model_len)
            if tiers is not None:
                self.plan, self.loaded = self._load_tiered(hf_config, load_config, tiers, load_progress)
            else:
                self.loaded = load_model(
                    self.path, load_config, dispatcher, progress=load_progress, dispatcher_options=dispatcher_options
                )
        self.model = self.loaded.model
        self.device = self.model.device
        self.hf_config = self.loaded.hf_config
        self.vocab_size: int | None = self.hf_config.get("vocab_size")
        self.model_name = model_name or str(model if not isinstance(model, LoadedModel) else self.path)
        self.tokenizer = load_tokenizer(self.path) if isinstance(tokenizer, str) and tokenizer == "auto" else tokenizer
        self.generation_config: dict[str, Any] = self.loaded.checkpoint.read_json("generation_config.json") or {}
        self.eos_token_ids = self._eos_ids()

        self.config = self.config.with_plan(self.plan)  # auto chunk: the plan's, or the default; the prefix VRAM
        capacity = self.config.kv_token_budget or self.config.max_streams * self.max_model_len
        self.kv_layout = resolve_kv_layout(self.config.kv_layout, self.model, self.device)
        paged = self.kv_layout == "paged"
        self.scheduler = Scheduler(
            self.config.max_streams,
            self.config.prefill_chunk_tokens,
            capacity,
            admission=self.config.kv_admission,
            headroom=self.config.kv_headroom_tokens,
            # A new or moved cache that decode graphs read in place captures them again: fewer moves, and room
            # for the next, longer turn (spare caches).
            power_of_two=self._graphs_read_caches(paged),
        )
        self.scheduler.on_preempt = self._preempted
        space = PagedKVSpace(self.device, self.config.kv_block_tokens) if paged else None
        self.runner = ModelRunner(self.model, kv_dtype=self.config.cache_kv_dtype, kv_space=space)
        if self._graphs_read_caches(paged) and self.config.spare_cache_seconds > 0:
            # A finished sequence's cache serves the next one: its decode graphs replay.
            self.runner.spares = SpareCaches(
                self.config.max_streams, capacity, self.config.spare_cache_seconds, reclaimable=self._kv_borrows
            )
        # Prefix caching (moetier.engine.prefix_hooks): admission from cached prefixes, snapshots as chunks finish.
        self.prefix = PrefixHooks(
            self.config, self.model, self.runner, self.scheduler, self._fit_experts,
            lambda seq, tokens: self._count_prompt(self._requests[seq.request_id], tokens),
        )  # fmt: skip
        self.elastic: ElasticExpertBudget | None = None
        if self.plan is not None:
            self._setup_elastic(getattr(tiers, "min_cache_slots", None))
        self._size_kv()
        self._requests: dict[str, _Request] = {}
        self._notices: list[RequestUpdate] = []  # abort updates, delivered by the next step
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.prefill_meter = PrefillMeter()  # prefill progress lines and counters (log_interval: seconds)

    @classmethod
    def from_path(cls, path: str | Path, **kwargs: Any) -> Engine:
        """Load ``path`` and build an engine (keywords as :meth:`__init__`: dtype, device, config, ...).

        ``tiers`` (a :class:`moetier.tiers.plan.TierOptions`) loads with tiered experts: a placement
        plan for its ``gpu_memory`` (logged), the experts' home copy in a pinned host arena and the
        tiered dispatcher with the plan's cache; without it every expert is resident.
        """
        return cls(path, **kwargs)

    def _load_tiered(
        self, hf_config: dict, load_config: ModelLoadConfig, tiers: Any, progress: bool
    ) -> tuple[Any, LoadedModel]:
        from moetier.tiers.plan import load_planned, plan_for

        capacity = self.config.kv_token_budget or self.config.max_streams * self.max_model_len
        streams = max(1, capacity // self.max_model_len)
        plan = plan_for(
            self.path,
            tiers,
            load_config,
            self.max_model_len,
            streams,
            self.config.prefill_chunk_tokens,
            self.config.prefix_cache_bytes if self.config.enable_prefix_caching else 0,
            kv_dtype=self.config.kv_dtype,
            prefix_snapshots=borrowed_prefix_snapshots(hf_config, self.config, load_config.device),
        )
        logger.info("%s", plan.table())
        return plan, load_planned(self.path, load_config, plan, tiers, progress)

    def _setup_elastic(self, min_slots: int | None) -> None:
        """Make the plan's expert cache elastic against the KV caches; cap the KV-token budget at its floor."""
        dispatcher = self.model.dispatcher
        if getattr(dispatcher, "cache", None) is None:
            return  # not a prepared tiered dispatcher: nothing to resize
        self.elastic = ElasticExpertBudget.for_plan(self.plan, dispatcher, self.runner.new_cache, min_slots)
        self.runner.kv_listener = self.elastic
        budget, config = self.plan.budget, self.elastic.config
        if budget.reserved_streams < budget.max_streams:  # by default every stream is reserved: no change
            cap = self.elastic.kv_token_cap(self.config.max_streams)
            if cap is not None and cap < self.scheduler.kv_token_budget:
                self.scheduler.kv_token_budget = cap
            logger.info(
                "elastic expert cache: KV reserved for %d of %d streams; cache %d..%d slots; KV-token budget %d",
                budget.reserved_streams,
                budget.max_streams,
                config.min_slots,
                config.max_slots,
                self.scheduler.kv_token_budget,
            )

    def expire_spares(self) -> float | None:
        """Drop the finished sequences' caches that waited ``spare_cache_seconds`` for a new sequence while the expert
        cache lends them its memory (it takes it back); returns the seconds until the next one would be dropped
        (None: none would). The async engine calls it while idle, at that time."""
        spares = self.runner.spares
        if spares is None or not len(spares):
            return None
        held = len(spares)
        wait = spares.expire()
        if len(spares) < held:
            self._fit_experts()
        return wait

    def _kv_borrows(self) -> bool:
        """Whether the KV held now borrows the expert cache's memory (spare caches then give it back in time)."""
        return self.elastic is not None and self.elastic.borrowing

    def _graphs_read_caches(self, paged: bool) -> bool:
        """Whether decode graphs read the sequences' caches in place (contiguous caches of such a family): their
        moves and new caches capture the graphs again, so reservations double and caches are reused."""
        return graphs_read_caches(self.model, paged)

    def _size_kv(self) -> None:
        """Allocate the paged KV pools for the KV-token budget (once, before any cache) and log the KV cache."""
        # With an elastic expert cache the pools hold the plan's reserved streams (the rest borrow slots).
        streams = self.plan.budget.reserved_streams if self.elastic is not None else None
        reserve = 0 if self.prefix_cache is None else self.config.prefix_cache_reserve_bytes
        budget, window = self.scheduler.kv_token_budget, self.max_model_len
        logger.info("%s", size_kv(self.config, self.model, self.runner, budget, window, streams, reserve))

    def _fit_experts(self) -> None:
        """Between steps: size the expert cache for the KV in use plus the caches about to be allocated."""
        if self.elastic is None:
            return
        # Sequences without a cache get one of their reservation; a grown reservation copies the cache
        # into a new one of that size (the old one is freed right after).
        runner = self.runner
        pending = [s.cache_tokens for s in self.scheduler.running if runner.capacity_of(s.request_id) < s.cache_tokens]
        if runner.spares is not None:  # a spare's memory is counted already: only the others need room
            pending = runner.spares.unserved(pending)
        self.elastic.rebalance(self.elastic.pending_bytes(pending))

    def _eos_ids(self) -> set[int]:
        ids = token_id_set(self.generation_config.get("eos_token_id"))
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids or token_id_set(self.hf_config.get("eos_token_id"))

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the sampling defaults of the checkpoint's generation_config.json."""
        overrides = {k: self.generation_config[k] for k in _GENERATION_DEFAULTS if k in self.generation_config}
        if self.generation_config.get("do_sample") is False:
            overrides["temperature"] = 0.0
        return SamplingParams(**overrides)

    # --- requests -------------------------------------------------------------------------------

    def validate_request(self, prompt_ids: Any, params: SamplingParams) -> list[int]:
        """Check a request without touching engine state (safe from any thread); returns the prompt ids.

        Raises :class:`ConfigError` (one line) for an empty prompt, an id outside the vocabulary, a
        prompt that leaves no room to generate, or one that could not run even alone in the KV-token
        budget (reserve admission: prompt + max_tokens; optimistic: prompt + 1).
        """
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_ids, list | tuple) or not prompt_ids:
            raise ConfigError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.vocab_size or 0
        for token in prompt_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (vocab and token >= vocab):
                raise ConfigError(f"prompt token id {token!r} is not in the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}, "
                "which leaves no room to generate; shorten the prompt"
            )
        self.scheduler.check_fits(len(prompt_ids), self._max_new_tokens(len(prompt_ids), params))
        return list(prompt_ids)

    def _max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        return min(params.max_tokens, self.max_model_len - prompt_len)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (one sequence, whatever ``params.n`` says: callers fan out with ``params.child``).

        Raises ``ValueError`` for an id already in flight, :class:`ConfigError` for an invalid request
        (see :meth:`validate_request`) and :class:`EngineBusyError` when the waiting queue is full.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = self.validate_request(prompt_ids, params)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineBusyError(f"{len(self.scheduler.waiting)} requests are already waiting; retry later")
        seq = Sequence(request_id, ids, params, self._max_new_tokens(len(ids), params))
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        text = IncrementalText(params, self.eos_token_ids, self.tokenizer)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq, text, make_generator(params, self.device))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache and KV tokens now; its final update (``"abort"``) comes with the
        next step. Unknown or finished ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        request.text.abort()
        self._release(request)
        self._notices.append(self._update(request, [], None))

    def request_ids(self) -> list[str]:
        """Ids of the requests in flight (waiting or running)."""
        return list(self._requests)

    def has_work(self) -> bool:
        return bool(self._requests or self._notices)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_tokens_used=self.scheduler.kv_tokens_used,
            kv_tokens_capacity=self.scheduler.kv_token_budget,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            preemptions_total=self.scheduler.preemptions,
            **prefill_stats(self.prefill_meter, self.scheduler.running),
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
            **(self.sharing.stats() if self.sharing is not None else {}),
            **(self.elastic.stats() if self.elastic is not None else {}),
            **(self.runner.kv_space.engine_stats() if self.runner.kv_space is not None else {}),
            **self._graph_stats(),
        )

    def _graph_stats(self) -> dict[str, int]:
        """The decode graphs captured so far and the spare caches (None where the model has neither)."""
        stats = {}
        graphs = getattr(self.model, "graphs", None)
        if graphs is not None and hasattr(graphs, "captures"):
            stats["decode_graph_captures_total"] = graphs.captures
        if (spares := self.runner.spares) is not None:
            stats["spare_caches"], stats["spare_cache_reuses_total"] = len(spares), spares.taken
        return stats

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """Run one step; returns an update for every request that produced a token, finished or failed."""
        updates, self._notices = self._notices, []
        self.expire_spares()
        plan = self.scheduler.schedule()
        for seq in plan.exhausted:  # alone and out of KV budget: finished with "length"
            updates.append(self._finish_exhausted(self._requests[seq.request_id]))
        self._fit_experts()  # before the runner allocates the newly admitted sequences' caches
        if not plan:
            return updates
        started = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.start < chunk.seq.num_prompt:
                self.prefill_meter.begin(chunk.seq.request_id, chunk.start, chunk.seq.num_prompt, started)
        prefilled = 0
        with torch.inference_mode():
            out = self.runner.execute(plan)
            computed = time.perf_counter()
            for chunk in plan.chunks:
                request = self._requests[chunk.seq.request_id]
                error = out.failures.get(chunk.seq.request_id)
                if error is None:
                    try:
                        prompt_tokens = self._account_chunk(request, chunk.start, chunk.num_tokens, out.prompt_logits)
                        prefilled += prompt_tokens
                        if prompt_tokens:
                            self.prefill_meter.advance(chunk.seq.request_id, prompt_tokens, computed)
                        self.prefix.publish_prompt(chunk)
                    except Exception as exc:  # noqa: BLE001 - fails this request only
                        error = exc
                if error is not None:
                    updates.append(self._fail(request, error))
            live = [i for i, seq in enumerate(out.sampled) if seq.request_id in self._requests]
            if live and out.logits is not None:
                requests = [self._requests[out.sampled[i].request_id] for i in live]
                self._sample_and_emit(requests, out.logits[live], updates)
        if prefilled:
            self.prefill_meter.step(time.perf_counter() - started, prefilled)
        return updates

    def _account_chunk(self, request: _Request, start: int, count: int, prompt_logits: dict) -> int:
        """Record a computed chunk; returns how many prompt tokens it computed."""
        seq = request.seq
        seq.num_computed += count
        end = min(start + count, seq.num_prompt)
        prompt_tokens = max(0, end - start)
        self._count_prompt(request, end)
        rows = prompt_logits.get(seq.request_id)
        if rows is not None:
            targets = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + rows.shape[0]], device=rows.device)
            top = [seq.params.prompt_logprobs or 0] * rows.shape[0]
            seq.prompt_logprobs.extend(token_logprobs(rows, targets, top))
        return prompt_tokens

    def _count_prompt(self, request: _Request, end: int) -> None:
        """Count the prompt tokens up to ``end`` in prompt_tokens_total, each once (recomputes add none)."""
        if end > request.prompt_counted:
            self._prompt_tokens_total += end - request.prompt_counted
            request.prompt_counted = end

    def _sample_and_emit(self, requests: list[_Request], logits: torch.Tensor, updates: list[RequestUpdate]) -> None:
        generators = [r.generator for r in requests]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            picked: list[tuple[int, TokenLogprob | None] | None] = list(self._sample(requests, logits))
        except Exception:  # noqa: BLE001 - find the request(s) at fault, row by row
            # Rewind the generators so the healthy rows draw exactly what they would have.
            for generator, state in zip(generators, states, strict=True):
                if generator is not None:
                    generator.set_state(state)
            picked = []
            for i, request in enumerate(requests):
                try:
                    picked.extend(self._sample([request], logits[i : i + 1]))
                except Exception as exc:  # noqa: BLE001
                    updates.append(self._fail(request, exc))
                    picked.append(None)
        for request, choice in zip(requests, picked, strict=True):
            if choice is None:
                continue
            try:
                updates.append(self._emit(request, *choice))
            except Exception as exc:  # noqa: BLE001 - fails this request only
                updates.append(self._fail(request, exc))

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """Every row's next token (and its logprob entry), computed as one batch on the device."""
        params = [r.seq.params for r in requests]
        processed = logits
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            states = [self._penalty_state(requests[i], logits.shape[-1]) for i in penalised]
            processed = logits.clone()
            processed[penalised] = apply_penalties(
                logits[penalised],
                [params[i] for i in penalised],
                torch.stack([s.seen for s in states]),
                torch.stack([s.counts for s in states]),
            )
        tokens = sample_tokens(processed, params, [r.generator for r in requests])
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            # Raw model logprobs (vLLM's default): the distribution before penalties and filters.
            rows = token_logprobs(logits[wanted], tokens[wanted], [params[i].logprobs or 0 for i in wanted])
            for i, row in zip(wanted, rows, strict=True):
                logprobs[i] = row
        return list(zip(tokens.tolist(), logprobs, strict=True))

    def _penalty_state(self, request: _Request, vocab: int) -> PenaltyState:
        if request.penalties is None:
            seq = request.seq
            request.penalties = PenaltyState(seq.prompt_ids, seq.output_ids, vocab, self.device)
        return request.penalties

    def _emit(self, request: _Request, token: int, logprob: TokenLogprob | None) -> RequestUpdate:
        seq, text = request.seq, request.text
        seq.output_ids.append(token)
        self._generation_tokens_total += 1
        if request.penalties is not None:
            request.penalties.add(token)
        if not text.add(token) and len(seq.output_ids) >= seq.max_new_tokens:
            text.finish_length()
        update = self._update(request, [token], None if logprob is None else [logprob])
        if text.finished:
            if text.finish_reason in ("stop", "length"):
                self.prefix.publish(seq, seq.num_computed)  # prompt + output, for the conversation's next turn
            self._release(request)
        return update

    def _update(self, request: _Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestUpdate:
        seq, text = request.seq, request.text
        first = request.updates_sent == 0
        request.updates_sent += 1
        return RequestUpdate(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text.take_delta(),
            finished=text.finished,
            finish_reason=text.finish_reason,
            stop_reason=text.stop_reason,
            prompt_tokens=seq.num_prompt,
            completion_tokens=len(seq.output_ids),
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
        )

    def _finish_exhausted(self, request: _Request) -> RequestUpdate:
        """Finish a request the scheduler could not grow even alone (the scheduler logged why)."""
        request.text.finish_length()
        self.prefix.publish(request.seq, request.seq.num_computed)
        self._release(request)
        return self._update(request, [], None)

    def _preempted(self, seq: Sequence) -> None:
        """Scheduler hook: ``seq`` is preempted. Keep a snapshot of its cache for its re-admission (when the
        prefix cache can hold it), then drop the cache; its progress is reset by the scheduler."""
        request = self._requests[seq.request_id]
        self.prefix.publish(seq, seq.num_computed)
        self.prefill_meter.drop(seq.request_id)
        self._free_cache(seq.request_id)
        if seq.params.prompt_logprobs is not None and request.updates_sent == 0:
            seq.prompt_logprobs = [None]  # the recompute scores the prompt again; nothing was sent yet

    def _fail(self, request: _Request, error: BaseException) -> RequestUpdate:
        """Finish a request whose processing raised: ``"abort"`` with the error, logged, resources freed."""
        seq = request.seq
        logger.error("request %s failed: %s", seq.request_id, error, exc_info=error)
        request.text.abort()
        if seq.request_id in self._requests:
            self._release(request)
        update = self._update(request, [], None)
        update.error = f"{type(error).__name__}: {error}"
        return update

    # --- prefix caching ---------------------------------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.prefix.cache

    @property
    def sharing(self) -> PrefixSharing | None:
        return self.prefix.sharing

    def _release(self, request: _Request) -> None:
        self.scheduler.finish(request.seq)
        self.prefill_meter.drop(request.seq.request_id)
        self._free_cache(request.seq.request_id)
        self._requests.pop(request.seq.request_id, None)
        if not self.scheduler.waiting:  # nobody to hand the freed KV to: the experts take it back now
            self._fit_experts()

    def _free_cache(self, request_id: str) -> None:
        """Drop a sequence's cache. Paged KV: snapshots that shared its blocks now hold them alone and
        cost them, so the prefix cache evicts down to its budget again."""
        self.runner.free(request_id)
        if self.prefix_cache is not None:
            self.prefix_cache.trim()
