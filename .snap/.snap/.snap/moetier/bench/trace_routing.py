"""Recorded routing: run the benchmarks' tier machinery under expert ids taken from a trace file.

Trace format (version 1): one ``.safetensors`` file (or ``.npz`` with the same array names) holding,
per MoE layer ``i`` (the decoder-layer index the model passes to ``dispatch``, as in
``ExpertLayout.moe_layers``):

- ``layer.{i}.ids``: integer ``[tokens_i, top_k]``, the experts each token was routed to, in the
  order the tokens reached that layer (rows of a multi-sequence forward in sequence order);
- ``layer.{i}.weights`` (optional): float ``[tokens_i, top_k]``, the routing weights the experts'
  outputs were summed with; absent means uniform ``1 / top_k``.

Metadata (safetensors ``__metadata__``; in an ``.npz``, a JSON object in the 0-d string array
``__metadata__``): ``format = "moetier-routing-trace"``, ``version = "1"``, ``num_experts`` and
``top_k`` (required, decimal strings), ``model`` (a name), and free-form keys (``moetier bench
record-trace`` adds the architecture, the prompt, the token count and the dispatcher it ran). Layers
may hold different row counts; each layer's rows are replayed independently.

Replay (:class:`TraceRoutingDispatcher`) wraps a real dispatcher and replaces the ``topk_ids`` /
``topk_weights`` of every call with the next ``T`` rows of that layer's trace (``T`` = the call's
tokens: a decode step of ``S`` streams takes ``S`` rows, a prefill chunk of ``C`` tokens ``C``
rows), wrapping around to the first row when the trace runs out. The backbone still computes its own
routing (so per-step work is unchanged); only what the tiers see is the trace's. Recording
(:class:`RecordingDispatcher`, ``moetier bench record-trace``) wraps any dispatcher and keeps what
each layer routed, so a trace can be made from any checkpoint moetier loads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetier.errors import ConfigError
from moetier.tiers.dispatcher import ExpertDispatcher
from moetier.tiers.experts import ExpertLayout

FORMAT = "moetier-routing-trace"
VERSION = "1"
_TENSOR_NAME = re.compile(r"layer\.(\d+)\.(ids|weights)")


# --- the trace ----------------------------------------------------------------------------------


@dataclass
class RoutingTrace:
    """Per-layer expert ids ``[N_i, top_k]`` (int64) and weights (float32, same shape), validated on construction.

    ``weights`` may leave layers out (uniform ``1 / top_k`` is filled in); ``metadata`` holds the
    free-form string keys besides ``num_experts`` / ``top_k``.
    """

    ids: dict[int, torch.Tensor]
    num_experts: int
    top_k: int
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.top_k < 1:
            raise ConfigError(
                f"routing trace needs num_experts >= 1 and top_k >= 1, got {self.num_experts}, {self.top_k}"
            )
        self.ids, self.weights = dict(self.ids), dict(self.weights)  # the caller's dicts stay as they were
        if not self.ids:
            raise ConfigError("routing trace holds no layer.{i}.ids tensor")
        stray = sorted(set(self.weights) - set(self.ids))
        if stray:
            raise ConfigError(f"routing trace has weights but no ids for layer(s) {stray}")
        for layer, ids in self.ids.items():
            self.ids[layer] = self._checked_ids(layer, ids)
            weights = self.weights.get(layer)
            if weights is None:
                self.weights[layer] = torch.full(ids.shape, 1.0 / self.top_k)
            else:
                self.weights[layer] = self._checked_weights(layer, weights, tuple(ids.shape))

    def _checked_ids(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 2 or ids.shape[0] == 0:
            raise ConfigError(
                f"routing trace layer.{layer}.ids must be a non-empty integer [tokens, top_k] tensor, "
                f"got {ids.dtype} {tuple(ids.shape)}"
            )
        if ids.shape[1] != self.top_k:
            raise ConfigError(f"routing trace layer.{layer}.ids has {ids.shape[1]} columns but top_k is {self.top_k}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_experts:
            raise ConfigError(
                f"routing trace layer.{layer}.ids holds experts {low}..{high}, outside 0..{self.num_experts - 1}"
            )
        return ids.to(torch.int64).contiguous()

    @staticmethod
    def _checked_weights(layer: int, weights: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if not weights.dtype.is_floating_point or tuple(weights.shape) != shape:
            raise ConfigError(
                f"routing trace layer.{layer}.weights must be floating point {shape} like its ids, "
                f"got {weights.dtype} {tuple(weights.shape)}"
            )
        weights = weights.to(torch.float32).contiguous()
        if not torch.isfinite(weights).all():
            raise ConfigError(f"routing trace layer.{layer}.weights holds non-finite values")
        return weights

    @property
    def layers(self) -> list[int]:
        return sorted(self.ids)

    def rows(self, layer: int) -> int:
        return self.ids[layer].shape[0]

    def all_metadata(self) -> dict[str, str]:
        """Every metadata key as written to a file (the fixed keys win over free-form ones)."""
        fixed = {"format": FORMAT, "version": VERSION, "num_experts": str(self.num_experts), "top_k": str(self.top_k)}
        return {**self.metadata, **fixed}

    def check_layout(self, layout: ExpertLayout) -> None:
        """One-line ConfigError unless this trace can drive a model of ``layout`` (experts, top-k, layers)."""
        if self.top_k != layout.top_k or self.num_experts != layout.num_experts:
            raise ConfigError(
                f"routing trace is top_k={self.top_k} over {self.num_experts} experts but the model routes "
                f"top_k={layout.top_k} over {layout.num_experts} experts"
            )
        missing = sorted(set(layout.moe_layers) - set(self.ids))
        if missing:
            raise ConfigError(
                f"routing trace has no ids for MoE layer(s) {missing} (trace layers {self.layers}, "
                f"model MoE layers {list(layout.moe_layers)})"
            )


def save_trace(trace: RoutingTrace, path: str | Path) -> Path:
    """Write ``trace`` as safetensors, or as ``.npz`` when ``path`` ends so; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, torch.Tensor] = {}
    for layer in trace.layers:
        arrays[f"layer.{layer}.ids"] = trace.ids[layer]
        arrays[f"layer.{layer}.weights"] = trace.weights[layer]
    if path.suffix == ".npz":
        numpy_arrays = {name: t.numpy() for name, t in arrays.items()}
        np.savez(path, __metadata__=np.array(json.dumps(trace.all_metadata())), **numpy_arrays)
    else:
        from safetensors.torch import save_file

        save_file(arrays, str(path), metadata=trace.all_metadata())
    return path


def load_trace(path: str | Path) -> RoutingTrace:
    """Read a trace file (format in the module docstring); one-line ConfigError for anything malformed."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"routing trace {path} does not exist")
    try:
        tensors, metadata = _read_npz(path) if path.suffix == ".npz" else _read_safetensors(path)
    except ConfigError:
        raise
    except Exception as exc:  # the readers raise a zoo of types for a corrupt file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"routing trace {path} cannot be read ({reason})") from None
    if metadata.get("format", FORMAT) != FORMAT or metadata.get("version", VERSION) != VERSION:
        raise ConfigError(
            f"routing trace {path} is format {metadata.get('format')!r} version {metadata.get('version')!r}; "
            f"expected {FORMAT!r} version {VERSION}"
        )
    ids: dict[int, torch.Tensor] = {}
    weights: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise ConfigError(f"routing trace {path}: unexpected tensor {name!r} (expected layer.{{i}}.ids/weights)")
        (ids if match.group(2) == "ids" else weights)[int(match.group(1))] = tensor
    numbers = {}
    for key in ("num_experts", "top_k"):
        try:
            numbers[key] = int(metadata[key])
        except (KeyError, ValueError):
            raise ConfigError(
                f"routing trace {path}: metadata {key!r} must be an integer, got {metadata.get(key)!r}"
            ) from None
    free = {k: v for k, v in metadata.items() if k not in ("format", "version", "num_experts", "top_k")}
    return RoutingTrace(ids, numbers["num_experts"], numbers["top_k"], weights, free)


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        return {name: f.get_tensor(name) for name in names}, dict(f.metadata() or {})


def _read_npz(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    raw = arrays.pop("__metadata__", None)
    metadata = json.loads(str(raw)) if raw is not None else {}
    if not isinstance(metadata, dict):
        raise ConfigError(f"routing trace {path}: __metadata__ must be a JSON object")
    return {name: torch.from_numpy(a) for name, a in arrays.items()}, {str(k): str(v) for k, v in metadata.items()}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def trace_summary(path: str | Path, trace: RoutingTrace) -> dict[str, Any]:
    """What a receipt records about the trace it replayed: path, sha256, metadata, rows per layer."""
    return {
        "path": str(path),
        "sha256": file_sha256(path),
        "metadata": trace.all_metadata(),
        "layers": trace.layers,
        "rows_per_layer": {str(layer): trace.rows(layer) for layer in trace.layers},
    }


def checkpoint_layout(model: str | Path) -> ExpertLayout:
    """The expert layout of a checkpoint folder from its ``config.json`` (reads no weights)."""
    from moetier.models import model_class_for
    from moetier.weights.checkpoint import Checkpoint

    ckpt = Checkpoint(model)
    family = model_class_for(ckpt.architectures)
    return family.expert_layout(family.config_from_hf(ckpt.config))


# --- dispatchers --------------------------------------------------------------------------------


class _Wrapper(ExpertDispatcher):
    """An ExpertDispatcher in front of another: anything it does not define is the inner one's
    (``metrics``, ``close``, ``cache``...), so code written against the inner dispatcher keeps working."""

    def __init__(self, inner: ExpertDispatcher) -> None:
        super().__init__(inner.store)
        self.inner = inner

    def prepare(self, device: torch.device | str) -> None:
        self.inner.prepare(device)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; ``inner`` itself missing means a half-built object.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class TraceRoutingDispatcher(_Wrapper):
    """Replays ``trace``: each call's ids/weights become the next rows of that layer's trace (cycling).

    The trace must match the inner store's layout (:meth:`RoutingTrace.check_layout`). ``wraps``
    counts, per layer, how often its trace ran out and restarted; :meth:`rewind` starts every layer
    over (benchmarks rewind before each measured run so all placements see the same routing).
    """

    def __init__(self, inner: ExpertDispatcher, trace: RoutingTrace) -> None:
        super().__init__(inner)
        trace.check_layout(inner.store.layout)
        self.trace = trace
        self._on_device: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rewind()

    def rewind(self) -> None:
        self.cursor = dict.fromkeys(self.trace.layers, 0)
        self.wraps = dict.fromkeys(self.trace.layers, 0)

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if topk_ids.shape[-1] != self.trace.top_k:
            raise ConfigError(
                f"routing trace is top_k={self.trace.top_k} but layer {layer} routed top_k={topk_ids.shape[-1]}"
            )
        ids, weights = self._next_rows(layer, hidden.shape[0], topk_ids, topk_weights)
        return self.inner.dispatch(layer, hidden, ids, weights)

    def _next_rows(
        self, layer: int, count: int, like_ids: torch.Tensor, like_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = self._layer_tensors(layer, like_ids, like_weights)
        total, start = ids.shape[0], self.cursor[layer]
        end = start + count
        self.cursor[layer] = end % total
        self.wraps[layer] += end // total
        if end <= total:  # the common case: a view, no kernel
            return ids[start:end], weights[start:end]
        rows = torch.arange(start, end, device=ids.device) % total
        return ids[rows], weights[rows]

    def _layer_tensors(
        self, layer: int, like_ids: torch.Tensor, like_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Moved to the routing's device and dtypes once, so a replayed step adds no host-to-device copy.
        cached = self._on_device.get(layer)
        if cached is None or cached[0].device != like_ids.device or cached[1].dtype != like_weights.dtype:
            cached = (
                self.trace.ids[layer].to(like_ids.device, like_ids.dtype),
                self.trace.weights[layer].to(like_weights.device, like_weights.dtype),
            )
            self._on_device[layer] = cached
        return cached


class RecordingDispatcher(_Wrapper):
    """Passes every call to the inner dispatcher and keeps (on the host) the ids and weights each layer routed."""

    def __init__(self, inner: ExpertDispatcher) -> None:
        super().__init__(inner)
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.weights: dict[int, list[torch.Tensor]] = {}

    def dispatch(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        self.ids.setdefault(layer, []).append(topk_ids.detach().to("cpu", torch.int64))
        self.weights.setdefault(layer, []).append(topk_weights.detach().to("cpu", torch.float32))
        return self.inner.dispatch(layer, hidden, topk_ids, topk_weights)

    def trace(self, **metadata: str) -> RoutingTrace:
        """Everything recorded so far as a trace of the inner store's layout."""
        layout = self.store.layout
        return RoutingTrace(
            ids={layer: torch.cat(parts) for layer, parts in self.ids.items()},
            num_experts=layout.num_experts,
            top_k=layout.top_k,
            weights={layer: torch.cat(parts) for layer, parts in self.weights.items()},
            metadata=metadata,
        )


# --- ``moetier bench record-trace`` -------------------------------------------------------------


@dataclass
class RecordTraceConfig:
    """What to record; validated on construction."""

    model: Path
    out: Path
    tokens: int = 512
    chunk_tokens: int = 512
    text: Path | None = None  # a text file tokenised with the checkpoint's tokenizer; default random ids
    dtype: str = "bf16"
    device: str | None = None
    seed: int = 0
    cache_fraction: float = 0.05  # tiered dispatcher's cache when the experts do not fit on the device
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        self.model, self.out = Path(self.model), Path(self.out)
        self.text = None if self.text is None else Path(self.text)
        if self.tokens < 1 or self.chunk_tokens < 1:
            raise ConfigError(f"--tokens and --chunk-tokens must be >= 1, got {self.tokens}, {self.chunk_tokens}")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ConfigError(f"--cache-fraction must be in [0, 1], got {self.cache_fraction}")


def _prompt(cfg: RecordTraceConfig, vocab: int) -> tuple[torch.Tensor, str]:
    """The recorded token ids and how they were made."""
    if cfg.text is None:
        generator = torch.Generator().manual_seed(cfg.seed)
        # The same draw as ``bench prefill``'s first prompt length: a trace of N tokens routes its N-token prompt.
        return torch.randint(0, vocab, (cfg.tokens,), generator=generator), f"random token ids, seed {cfg.seed}"
    from moetier.tokenizer import Tokenizer

    ids = Tokenizer.from_folder(cfg.model).encode(cfg.text.read_text())[: cfg.tokens]
    if not ids:
        raise ConfigError(f"--text {cfg.text} holds no tokens")
    return torch.tensor(ids, dtype=torch.int64), f"text {cfg.text.name}"


def _record_dispatcher(store, cfg: RecordTraceConfig, device: torch.device) -> tuple[ExpertDispatcher, str]:
    from moetier.bench.common import resident_store
    from moetier.tiers.dispatcher import ResidentDispatcher
    from moetier.tiers.tiered_dispatcher import TieredDispatcher

    resident = resident_store(store, device)
    if resident is not None:
        return ResidentDispatcher(resident), "resident"
    total = len(store.layout.moe_layers) * store.layout.num_experts
    tiered = TieredDispatcher(store, cache_slots=int(round(cfg.cache_fraction * total)), cpu_threads=cfg.cpu_threads)
    tiered.prepare(device)
    return tiered, "tiered"


@torch.inference_mode()
def record_trace(cfg: RecordTraceConfig) -> RoutingTrace:
    """Load the checkpoint, run its prompt through it in chunks and return what every MoE layer routed."""
    from moetier.bench.common import load_checkpoint

    loaded, device, _arena = load_checkpoint(cfg.model, cfg.dtype, cfg.device)
    model = loaded.model
    inner, placement = _record_dispatcher(loaded.store, cfg, device)
    recorder = RecordingDispatcher(inner)
    model.use_dispatcher(recorder)
    ids, prompt = _prompt(cfg, model.config.vocab_size)
    cache = model.new_cache(ids.shape[0] + 1)
    try:
        for first in range(0, ids.shape[0], cfg.chunk_tokens):
            model(ids[first : first + cfg.chunk_tokens].to(device), cache)
    finally:
        if hasattr(inner, "close"):
            inner.close()
    architectures = loaded.hf_config.get("architectures") or ["?"]
    return recorder.trace(
        model=cfg.model.name,
        architecture=str(architectures[0]),
        source="moetier bench record-trace",
        prompt=prompt,
        tokens=str(ids.shape[0]),
        chunk_tokens=str(cfg.chunk_tokens),
        dtype=cfg.dtype,
        dispatcher=placement,
    )


def configure_record_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="checkpoint folder moetier can load")
    parser.add_argument("--out", required=True, type=Path, help="trace file to write (.safetensors or .npz)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens to route (default 512)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prompt tokens per forward")
    parser.add_argument("--text", type=Path, default=None, help="route this text file's tokens (default: random ids)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    parser.add_argument("--cache-fraction", type=float, default=0.05, help="expert cache when experts do not fit")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.set_defaults(handler=run_record)


def run_record(args: argparse.Namespace) -> int:
    cfg = RecordTraceConfig(
        model=args.model,
        out=args.out,
        tokens=args.tokens,
        chunk_tokens=args.chunk_tokens,
        text=args.text,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cache_fraction=args.cache_fraction,
        cpu_threads=args.cpu_threads,
    )
    trace = record_trace(cfg)
    path = save_trace(trace, cfg.out)
    rows = trace.rows(trace.layers[0])
    print(
        f"routing trace: {path} ({len(trace.layers)} MoE layers x {rows} tokens, top_k={trace.top_k} "
        f"of {trace.num_experts} experts, sha256 {file_sha256(path)[:16]})"
    )
    return 0


# --- bench wiring -------------------------------------------------------------------------------


def load_for_bench(path: str | Path | None, model: str | Path) -> tuple[RoutingTrace | None, dict[str, Any] | None]:
    """The trace a bench replays (checked against the checkpoint before any weight is read) and its summary."""
    if path is None:
        return None, None
    trace = load_trace(path)
    trace.check_layout(checkpoint_layout(model))
    return trace, trace_summary(Path(path).expanduser(), trace)


def summary_note(summary: dict[str, Any]) -> str:
    """One line for a receipt's notes: which trace drove the routing."""
    meta = summary["metadata"]
    rows = sorted(set(summary["rows_per_layer"].values()))
    span = f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}-{rows[-1]}"
    return (
        f"routing replayed from trace {summary['path']} (sha256 {summary['sha256'][:16]}, model "
        f"{meta.get('model', '?')}, {span} rows/layer, cycled when exhausted)"
    )
