"""The offline API: ``LLM(path).generate(prompts, SamplingParams(...))``, shaped like vLLM's.

A thin synchronous driver of :class:`moetier.engine.engine.Engine`: it adds every request, steps the
engine until all are done and collects the updates, so the offline API and the server share one
generation loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from moetier.engine.engine import (
    Engine,
    EngineBusyError,
    EngineConfig,
    RequestUpdate,
    TokenLogprob,
    resolve_dtype,
)
from moetier.engine.sampling import SamplingParams
from moetier.errors import ConfigError

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "resolve_dtype"]

FinishReason = Literal["stop", "length"]
Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    """One generated continuation.

    ``token_ids`` holds every generated token, the final EOS/stop token included; ``text`` excludes
    the stop string or stop token that ended it. ``stop_reason`` is the stop string or stop token id
    (``None`` for EOS and for ``finish_reason == "length"``). ``logprobs``: one entry per token when
    ``SamplingParams.logprobs`` is set.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A prompt (``None`` when given as token ids), its token ids and its completions (``n`` of them)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    request_id: str = ""
    finished: bool = True
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """A loaded model plus its tokenizer, generating offline.

    ``dtype``: ``auto`` (the checkpoint's), ``bf16``, ``fp16`` or ``fp32``. ``device``: default CUDA
    when available. ``max_model_len``: the longest sequence (prompt + generated), default the
    model's ``max_position_embeddings``. ``skip_tokenizer_init``: token-id prompts only, empty text.
    ``engine_config``: the engine's limits (streams, prefill chunk, KV budget); ``max_model_len``,
    when given, overrides its field. ``gpu_memory`` (``"24GiB"``, ``"80%"``, bytes) loads with tiered
    experts: a placement plan sizes the VRAM expert cache, every expert's home copy sits in pinned
    host RAM (``host_memory`` is checked against it), misses run per ``miss_route`` (``auto``, ``cpu``,
    ``copy``) on ``cpu_threads`` threads and the cache follows ``expert_policy``. ``kv_dtype``
    (``auto``, ``bf16``, ``fp8``), when given, overrides the engine config's KV cache storage, and
    ``prefill_chunk_tokens`` its prefill tokens per step (left as ``None`` in both, the placement plan
    picks the chunk with ``gpu_memory``; ``self.engine.config.prefill_chunk_tokens`` is the one used).
    ``expert_format`` (``dense``, ``fp8``, ``fp4``), when given, overrides the engine config's experts' home copy, and
    ``backbone_format`` (``auto``, ``fp8``, ``dense``) its backbone linears'.
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        skip_tokenizer_init: bool = False,
        load_progress: bool = True,
        engine_config: EngineConfig | None = None,
        gpu_memory: int | str | None = None,
        host_memory: int | str | None = None,
        expert_policy: str = "lfu",
        cpu_threads: int | None = None,
        miss_route: str = "auto",
        kv_dtype: str | None = None,
        prefill_chunk_tokens: int | None = None,
        expert_format: str | None = None,
        backbone_format: str | None = None,
    ) -> None:
        self.path = Path(model).expanduser()
        config = engine_config or EngineConfig()
        if max_model_len is not None:
            config = replace(config, max_model_len=max_model_len)
        if kv_dtype is not None:
            config = replace(config, kv_dtype=kv_dtype)  # validated by EngineConfig
        if prefill_chunk_tokens is not None:
            config = replace(config, prefill_chunk_tokens=prefill_chunk_tokens)
        if expert_format is not None:
            config = replace(config, expert_format=expert_format)  # validated by EngineConfig
        if backbone_format is not None:
            config = replace(config, backbone_format=backbone_format)
        tiers = None
        if gpu_memory is not None:
            from moetier.tiers.plan import TierOptions

            tiers = TierOptions(gpu_memory, host_memory, expert_policy, cpu_threads, miss_route)
        self.engine = Engine(
            self.path,
            config,
            dtype=dtype,
            device=device,
            tokenizer=None if skip_tokenizer_init else "auto",
            load_progress=load_progress,
            tiers=tiers,
        )
        self.plan = self.engine.plan
        self.loaded = self.engine.loaded
        self.model = self.engine.model
        self.device = self.engine.device
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self._batches = 0

    @property
    def generation_config(self) -> dict[str, Any]:
        return self.engine.generation_config

    @generation_config.setter
    def generation_config(self, value: dict[str, Any]) -> None:
        self.engine.generation_config = value

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: set[int]) -> None:
        self.engine.eos_token_ids = set(value)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the sampling defaults of the checkpoint's generation_config.json."""
        return self.engine.default_sampling_params()

    # --- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete each prompt: a string, ``{"prompt_token_ids": [...]}``, ``{"prompt": str}`` or a list.

        ``sampling_params`` is one for all prompts or a list with one per prompt. Outputs come back
        in prompt order. Raises :class:`ConfigError` for a prompt that does not fit ``max_model_len``.
        """
        items = list(prompts) if isinstance(prompts, list | tuple) else [prompts]
        params = self._params_per_prompt(sampling_params, len(items))
        prepared = [self._prepare(item) for item in items]
        # Validate every request before any work, so a bad prompt costs nothing.
        ids = [self.engine.validate_request(p_ids, sp) for (_, p_ids), sp in zip(prepared, params, strict=True)]
        outputs = [
            RequestOutput(text, p_ids, [CompletionOutput(j, "", []) for j in range(sp.n)], request_id=str(index))
            for index, ((text, _), p_ids, sp) in enumerate(zip(prepared, ids, params, strict=True))
        ]
        self._batches += 1
        # One engine request per completion; a parallel-sampling child gets seed + j (see SamplingParams.child).
        jobs = [
            (f"llm-{self._batches}-{i}-{j}", i, j, p_ids, sp.child(j) if sp.n > 1 else sp)
            for i, (p_ids, sp) in enumerate(zip(ids, params, strict=True))
            for j in range(sp.n)
        ]
        self._run(jobs, outputs, use_tqdm)
        return outputs

    def _run(self, jobs: list[tuple[str, int, int, list[int], SamplingParams]], outputs, use_tqdm: bool) -> None:
        """Feed ``jobs`` to the engine (as fast as its queue takes them) and step it until all are done."""
        targets = {job[0]: (outputs[job[1]], job[2]) for job in jobs}
        queued, open_ids = list(reversed(jobs)), set(targets)
        progress = tqdm(total=len(jobs), desc="generating", disable=not use_tqdm)
        try:
            while open_ids:
                while queued:
                    request_id, _, _, p_ids, sp = queued[-1]
                    try:
                        self.engine.add_request(request_id, p_ids, sp)
                    except EngineBusyError:
                        break
                    queued.pop()
                for update in self.engine.step():
                    if update.request_id not in targets:
                        continue  # e.g. the abort notice of an earlier, interrupted call
                    request, index = targets[update.request_id]
                    _collect(request, request.outputs[index], update)
                    if update.finished:
                        open_ids.discard(update.request_id)
                        progress.update(1)
        finally:
            progress.close()
            if open_ids:  # interrupted (an error, Ctrl-C): leave nothing running in the engine
                for request_id in open_ids:
                    self.engine.abort(request_id)
                self.engine.step()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = False,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render one conversation (a list of messages) or several with the chat template, then generate."""
        tokenizer = self._require_tokenizer("chat")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=True, **template_kwargs
            )
            # The template writes BOS and friends itself; adding them again would double them.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # --- internals --------------------------------------------------------------------------

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ConfigError(f"got {len(params)} sampling params for {count} prompts; give one, or one per prompt")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ConfigError("sampling_params must be SamplingParams objects")
        return params

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ConfigError(f"{what} needs a tokenizer, but this LLM was created with skip_tokenizer_init=True")
        return self.tokenizer

    def _prepare(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); the engine checks the ids."""
        if isinstance(prompt, str):
            text, ids = prompt, self._require_tokenizer("a text prompt").encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            ids = self._require_tokenizer("a text prompt").encode(text)
        else:
            raise ConfigError(
                f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
            )
        return text, ids


def _collect(request: RequestOutput, completion: CompletionOutput, update: RequestUpdate) -> None:
    """Fold one engine update into the completion it belongs to."""
    if update.error is not None:
        raise RuntimeError(f"generation failed for request {request.request_id}: {update.error}")
    completion.token_ids.extend(update.new_token_ids)
    completion.text += update.new_text
    if update.logprobs is not None:
        if completion.logprobs is None:
            completion.logprobs = []
        completion.logprobs.extend(update.logprobs)
    if update.prompt_logprobs is not None:
        request.prompt_logprobs = update.prompt_logprobs
    if update.finished:
        completion.finish_reason = update.finish_reason  # type: ignore[assignment]
        completion.stop_reason = update.stop_reason
