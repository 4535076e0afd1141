"""The offline API: ``LLM(path).generate(prompts, SamplingParams(...))``, shaped like vLLM's.

One prompt at a time, each with its own contiguous cache: prefill once, then one token per step.
It is the simple, obviously-correct loop the paged continuous-batching engine is checked against.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from moetier.config import ModelLoadConfig, default_device, parse_dtype
from moetier.engine.sampling import SamplingParams, make_generator, sample_tokens
from moetier.errors import CheckpointError, ConfigError
from moetier.weights.loader import load_model

FinishReason = Literal["stop", "length"]
Prompt = str | dict[str, Any]

_CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Sampling defaults a checkpoint's generation_config.json may carry (vLLM applies them too).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


@dataclass
class CompletionOutput:
    """One generated continuation.

    ``token_ids`` holds every generated token, the final EOS/stop token included; ``text`` excludes
    the stop string or stop token that ended it. ``stop_reason`` is the stop string or stop token id
    (``None`` for EOS and for ``finish_reason == "length"``).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """A prompt (``None`` when given as token ids), its token ids and its completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    request_id: str = ""
    finished: bool = True


def _checkpoint_config(path: Path) -> dict[str, Any]:
    """``config.json`` read before loading, to pick the dtype (the loader validates the rest)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model folder (expected config.json and *.safetensors)")
    config_path = path / "config.json"
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: config.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: config.json is not valid JSON ({exc})") from None


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's own float dtype, else bf16 on CUDA and fp32 on CPU."""
    if dtype != "auto":
        return parse_dtype(dtype)
    stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if isinstance(stored, str) and stored in _CHECKPOINT_DTYPES:
        return _CHECKPOINT_DTYPES[stored]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _token_ids(value: Any) -> set[int]:
    """An ``eos_token_id`` field (int, list of ints or absent) as a set."""
    if value is None:
        return set()
    items = value if isinstance(value, list) else [value]
    return {int(i) for i in items if isinstance(i, int) and not isinstance(i, bool)}


class LLM:
    """A loaded model plus its tokenizer, generating offline.

    ``dtype``: ``auto`` (the checkpoint's), ``bf16``, ``fp16`` or ``fp32``. ``device``: default CUDA
    when available. ``max_model_len``: the longest sequence (prompt + generated), default the
    model's ``max_position_embeddings``. ``skip_tokenizer_init``: token-id prompts only, empty text.
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        skip_tokenizer_init: bool = False,
        load_progress: bool = True,
    ) -> None:
        self.path = Path(model).expanduser()
        self.device = torch.device(device) if device is not None else default_device()
        hf_config = _checkpoint_config(self.path)
        self.max_model_len = self._window(hf_config, max_model_len)
        load_config = ModelLoadConfig(resolve_dtype(dtype, hf_config, self.device), self.device, self.max_model_len)
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(self.path)
        self.loaded = load_model(self.path, load_config, progress=load_progress)
        self.model = self.loaded.model
        self.generation_config = self.loaded.checkpoint.read_json("generation_config.json") or {}
        self.eos_token_ids = self._eos_ids(hf_config)
        self.vocab_size = hf_config.get("vocab_size")

    @staticmethod
    def _window(hf_config: dict[str, Any], requested: int | None) -> int:
        limit = hf_config.get("max_position_embeddings")
        if requested is None:
            if limit is None:
                raise ConfigError("config.json has no max_position_embeddings; pass max_model_len")
            return int(limit)
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"max_model_len must be an integer >= 1, got {requested!r}")
        if limit is not None and requested > limit:
            raise ConfigError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
        return requested

    def _eos_ids(self, hf_config: dict[str, Any]) -> set[int]:
        ids = _token_ids(self.generation_config.get("eos_token_id"))
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids or _token_ids(hf_config.get("eos_token_id"))

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the sampling defaults of the checkpoint's generation_config.json."""
        overrides = {k: self.generation_config[k] for k in _GENERATION_DEFAULTS if k in self.generation_config}
        if self.generation_config.get("do_sample") is False:
            overrides["temperature"] = 0.0
        return SamplingParams(**overrides)

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
        requests = [self._prepare(item) for item in items]  # validate every prompt before any work
        outputs = []
        with torch.inference_mode():
            for index, ((text, ids), sp) in enumerate(
                tqdm(list(zip(requests, params, strict=True)), desc="generating", disable=not use_tqdm)
            ):
                completion = self._generate_one(ids, sp)
                outputs.append(RequestOutput(text, ids, [completion], request_id=str(index)))
        return outputs

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
        """(prompt text or None, prompt token ids), checked against the vocabulary and the window."""
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
        ids = self._check_ids(ids)
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, "
                "which leaves no room to generate; shorten the prompt"
            )
        return text, ids

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not ids:
            raise ConfigError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.vocab_size or 0
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (vocab and token >= vocab):
                raise ConfigError(f"prompt token id {token!r} is not in the vocabulary [0, {vocab})")
        return list(ids)

    def _generate_one(self, prompt_ids: list[int], params: SamplingParams) -> CompletionOutput:
        budget = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        run = _Completion(params, self.eos_token_ids, self.tokenizer)
        model, device = self.model, self.device
        cache = model.new_cache(len(prompt_ids) + budget)
        generator = make_generator(params, device)
        hidden = model(torch.tensor(prompt_ids, device=device), cache)
        while True:
            logits = model.compute_logits(hidden[-1:])
            token = int(sample_tokens(logits, params, generator)[0])
            if run.add(token) or len(run.token_ids) >= budget:
                break
            hidden = model(torch.tensor([token], device=device), cache)
        return run.finish()


def _load_tokenizer(path: Path):
    from moetier.tokenizer import Tokenizer

    return Tokenizer.from_folder(path)


class _Completion:
    """One completion in progress: tokens, incremental text and the stop checks."""

    def __init__(self, params: SamplingParams, eos_ids: set[int], tokenizer) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True) if tokenizer is not None else None
        self.longest_stop = max((len(s) for s in params.stop_strings), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    def add(self, token: int) -> bool:
        """Record a generated token; True when it ends the completion."""
        self.token_ids.append(token)
        if token in self.stop_ids:
            # Like vLLM, the stop token stays in token_ids but its text is not appended.
            self.finish_reason = "stop"
            self.stop_reason = None if token not in self.params.stop_token_ids else token
            return True
        return self.decoder is not None and self._append_text(self.decoder.push(token))

    def _append_text(self, piece: str) -> bool:
        if not piece:
            return False
        start = max(0, len(self.text) - self.longest_stop + 1)
        self.text += piece
        found = [(self.text.find(s, start), s) for s in self.params.stop_strings]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, stop = min(found)
        self.text = self.text[:at]  # the returned text excludes the stop string
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def finish(self) -> CompletionOutput:
        if self.decoder is not None and not isinstance(self.stop_reason, str):
            # Text the decoder still holds (an incomplete character) belongs to the output.
            self._append_text(self.decoder.flush())
        if self.finish_reason is None:
            self.finish_reason = "length"
        return CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason)
