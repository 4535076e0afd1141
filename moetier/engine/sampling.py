"""Sampling parameters and the next-token sampler.

Filters run in this order (the order of vLLM's V0 sampler and of transformers' warpers):

1. temperature: ``logits / T``, first, so every later filter sees the distribution the user asked
   for (a high temperature widens the nucleus, a low one narrows it);
2. top_k: keep the ``k`` highest logits (ties with the k-th are kept);
3. top_p: keep the smallest set of most likely tokens whose mass reaches ``p``, measured on the
   distribution left by top_k;
4. min_p: keep tokens whose probability is at least ``min_p`` times the most likely one's. It is
   relative to the maximum, and renormalising scales every probability alike, so applying it
   last is the same as intersecting its set with the others' (vLLM's V1 applies it before
   top-k/top-p, which changes only how top_p's mass is measured).

Temperature 0 means greedy: the argmax of the logits, no filter, no randomness.

Penalties (:func:`apply_penalties`) come before all of these, on the model's logits, with vLLM's and
OpenAI's semantics: ``repetition_penalty`` divides the positive logits (multiplies the negative
ones) of every token seen in the prompt or the output; ``frequency_penalty`` subtracts
``penalty * count`` and ``presence_penalty`` subtracts ``penalty`` once, both over generated tokens
only. Greedy decoding takes the argmax of the penalised logits.

Logprobs (:func:`token_logprobs`) are those of the *raw* model distribution, ``log_softmax`` of the
logits before penalties, temperature and filters: vLLM's default (``logprobs_mode="raw_logprobs"``),
so they describe the model, not the sampler's reshaped distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from moetier.errors import ConfigError

MAX_N = 16
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops; validated on construction.

    - ``temperature`` >= 0 (0 = greedy); ``top_p`` in (0, 1]; ``top_k`` 0 or -1 = off, else >= 1;
      ``min_p`` in [0, 1].
    - ``max_tokens`` >= 1 generated tokens at most (the model's window may stop it earlier).
    - ``stop``: strings that end generation; the returned text excludes them. Normalised to a list.
    - ``stop_token_ids``: token ids that end generation like EOS (kept in ``token_ids``, not in text).
    - ``seed``: seeds this request's own generator, so its samples are reproducible and do not
      depend on other requests; ``None`` draws a fresh seed.
    - ``ignore_eos``: keep generating past EOS (benchmarks).
    - ``n``: completions wanted (1..16). The engine runs one sequence per request; callers fan out
      with :meth:`child`.
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2]; ``repetition_penalty`` > 0 (1 = off).
    - ``logprobs``: with each generated token, its logprob and the ``logprobs`` (0..20) most likely
      alternatives; ``prompt_logprobs``: the same for every prompt token (the first has none).
    - ``skip_special_tokens``: leave special tokens out of the text.
    - ``include_stop_str_in_output``: keep the stop string (or stop token's text) in the text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be 0 or -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_ids(self.stop_token_ids)
        self.ignore_eos = bool(self.ignore_eos)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        self.skip_special_tokens = bool(self.skip_special_tokens)
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (``__post_init__`` normalises it; this keeps the type checker informed)."""
        return list(self.stop or [])

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def child(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of ``n``: ``n=1``, and ``seed + index`` when seeded (as vLLM),
        so the fanned-out completions differ yet stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in items):
        raise ConfigError("stop strings must not be empty")
    return list(items)


def _stop_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple | set) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
    return list(ids)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own random generator on ``device`` (``None`` for greedy, which needs none)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()  # a fresh non-deterministic seed
    else:
        generator.manual_seed(params.seed)
    return generator


def _as_batch(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]):
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [B, V], got shape {tuple(logits.shape)}")
    batch = logits.reshape(-1, logits.shape[-1]).float()
    rows = [params] * batch.shape[0] if isinstance(params, SamplingParams) else list(params)
    if len(rows) != batch.shape[0]:
        raise ValueError(f"{len(rows)} sampling params for {batch.shape[0]} rows of logits")
    return batch, rows


def _row_tensor(rows: list[SamplingParams], attr: str, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(p, attr) for p in rows], dtype=dtype, device=like.device)[:, None]


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution sampling draws from: float32 ``[B, V]`` (or ``[V]``), rows summing to 1.

    Applies temperature, top_k, top_p and min_p (see the module docstring for the order). Greedy
    rows (temperature 0) get a one-hot distribution on the argmax.
    """
    batch, rows = _as_batch(logits, params)
    vocab = batch.shape[-1]
    # Greedy rows are filtered at temperature 1 (no division by zero) and replaced at the end.
    temperature = _row_tensor([p if not p.greedy else SamplingParams() for p in rows], "temperature", batch)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in rows], device=batch.device)
    top_k = top_k.clamp(max=vocab)[:, None]
    top_p, min_p = _row_tensor(rows, "top_p", batch), _row_tensor(rows, "min_p", batch)

    # Work in descending order: every filter keeps a prefix of it.
    sorted_logits, order = (batch / temperature).sort(dim=-1, descending=True, stable=True)
    kth = sorted_logits.gather(-1, top_k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)

    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Only rows with top_p < 1 filter: float rounding may push the cumulative mass past 1.0.
    drop = (mass_before >= top_p) & (top_p < 1)
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)

    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p * probs[:, :1], -math.inf)

    result = torch.zeros_like(batch).scatter_(-1, order, sorted_logits.softmax(dim=-1))
    greedy = torch.tensor([p.greedy for p in rows], device=batch.device)
    if greedy.any():
        one_hot = torch.zeros_like(batch).scatter_(-1, batch.argmax(dim=-1, keepdim=True), 1.0)
        result = torch.where(greedy[:, None], one_hot, result)
    return result.reshape(logits.shape)


# A long row's argmax in two reductions: torch's reduction of one [1, V] row runs in few blocks (27 us on the H200
# for a 129,280-token vocabulary, every decode step); chunks of the row reduce in parallel first.
ARGMAX_CHUNKS = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[B, V]`` logits (int64 ``[B]``), the first index among equal maxima as torch's,
    through each chunk's maximum first where ``V`` splits into :data:`ARGMAX_CHUNKS` chunks of at least 512."""
    rows, vocab = logits.shape
    if vocab % ARGMAX_CHUNKS or vocab < 512 * ARGMAX_CHUNKS or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    size = vocab // ARGMAX_CHUNKS
    best, at = logits.view(rows, ARGMAX_CHUNKS, size).max(dim=-1)  # each chunk's first maximum
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * size + at.gather(-1, chunk)).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    generators: torch.Generator | None | Sequence[torch.Generator | None] = None,
) -> torch.Tensor:
    """Pick the next token of each row: int64 ``[B]`` for ``[B, V]`` logits, a 0-d tensor for ``[V]``.

    ``generators`` holds one generator per row (from :func:`make_generator`); each row draws only
    from its own, so a request's samples do not depend on what else is in the batch. A row without
    a generator that is not greedy falls back to torch's global generator.
    """
    batch, rows = _as_batch(logits, params)
    if generators is None or isinstance(generators, torch.Generator):
        generators = [generators] * batch.shape[0]
    if len(generators) != batch.shape[0]:
        raise ValueError(f"{len(generators)} generators for {batch.shape[0]} rows of logits")
    tokens = greedy_tokens(batch)
    if not all(p.greedy for p in rows):
        probs = filtered_probabilities(batch, rows)
        for i, (row, generator) in enumerate(zip(rows, generators, strict=True)):
            if not row.greedy:
                tokens[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
    return tokens.reshape(logits.shape[:-1])


# --- penalties ------------------------------------------------------------------------------


class PenaltyState:
    """One sequence's token history on the device, as penalties need it.

    ``seen`` marks every token of the prompt and the output (repetition penalty); ``counts`` counts
    the generated tokens (presence and frequency penalties). Kept incrementally, one scatter per
    generated token, so a long sequence never rebuilds them from lists.
    """

    def __init__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int, device) -> None:
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        history = [i for i in list(prompt_ids) + list(output_ids) if 0 <= i < vocab]
        if history:
            self.seen[torch.tensor(history, device=device)] = True
        for token in output_ids:
            self.add(token)

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.shape[0]:
            self.seen[token] = True
            self.counts[token] += 1


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    seen: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 logits ``[B, V]``: repetition, then frequency and presence (vLLM's order).

    ``seen`` (bool ``[B, V]``) marks tokens of the prompt or output; ``counts`` (``[B, V]``) counts
    generated tokens. Neutral values (1, 0, 0) leave a row bit-for-bit unchanged.
    """
    batch, rows = _as_batch(logits, params)
    repetition = _row_tensor(rows, "repetition_penalty", batch)
    penalised = torch.where(batch > 0, batch / repetition, batch * repetition)
    batch = torch.where(seen.reshape(batch.shape), penalised, batch)
    counts = counts.reshape(batch.shape).to(batch.dtype)
    batch = batch - _row_tensor(rows, "frequency_penalty", batch) * counts
    batch = batch - _row_tensor(rows, "presence_penalty", batch) * (counts > 0).to(batch.dtype)
    return batch.reshape(logits.shape)


# --- logprobs -------------------------------------------------------------------------------


@dataclass
class TokenLogprob:
    """A token's logprob and the ``top`` most likely alternatives ``(token_id, logprob)``, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprob]:
    """Logprobs of ``token_ids`` (``[B]``) under ``log_softmax(logits)`` (``[B, V]``), with row i's top ``num_top[i]``.

    Computed on the logits' device; one transfer brings every row back.
    """
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1] or len(num_top) != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)}, token_ids {tuple(token_ids.shape)}, {len(num_top)} top counts")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.to(logprobs.device).long()[:, None])[:, 0]
    k = min(max(num_top, default=0), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen_list, values, ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(int(token), chosen_list[i], list(zip(ids[i][: num_top[i]], values[i][: num_top[i]], strict=True)))
        for i, token in enumerate(token_ids.tolist())
    ]
