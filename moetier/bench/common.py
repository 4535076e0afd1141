"""Helpers every ``moetier bench`` kind shares: statistics, device sync, loading, receipts on disk."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetier.config import BACKBONE_FORMATS, EXPERT_FORMATS, ModelLoadConfig, default_device, parse_dtype
from moetier.errors import ConfigError
from moetier.tiers.experts import ExpertStore, device_allocator
from moetier.tiers.host_store import HostExpertArena
from moetier.weights.loader import LoadedModel, load_model


def stats(values: list[float]) -> dict[str, float]:
    """min / median / max of a non-empty list."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` by linear interpolation (None for an empty list)."""
    if not values:
        return {f"p{p}": None for p in points}
    ordered = sorted(values)
    out = {}
    for p in points:
        rank = (len(ordered) - 1) * p / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{p}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


def sync_device(device: torch.device) -> None:
    """Wait for queued device work (a no-op off CUDA), so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_names(text: str) -> list[str]:
    """``"bf16, fp4"`` -> ``["bf16", "fp4"]`` (blanks dropped; the caller's config validates the names)."""
    return [item.strip() for item in str(text).split(",") if item.strip()]


def add_expert_shape_arguments(parser: argparse.ArgumentParser, top_k_help: str) -> None:
    """The random experts' shape, as the expert-kernel benches share it (DeepSeek-V4-Flash by default)."""
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6, help=top_k_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")


def expert_shape_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of :func:`add_expert_shape_arguments` plus the ``--experts`` and ``--tokens`` each
    expert-kernel bench adds (its own defaults)."""
    return {
        "experts": args.experts,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "top_k": args.top_k,
        "tokens": parse_int_list(args.tokens, "--tokens"),
        "seed": args.seed,
    }


def key_json_value(text: str) -> tuple[str, Any]:
    """An argparse type for ``KEY=JSON`` options (a value that is not JSON is taken as a bare string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"1,2,4"`` or ``"8k,32k"`` (k = 1024) -> ints; one-line ConfigError otherwise."""
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            out.append(int(item.removesuffix("k")) * scale)
        except ValueError:
            raise ConfigError(f"{flag} must be comma-separated integers (8k = 8192), got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"{flag} must list positive integers, got {text!r}")
    return out


def load_checkpoint(
    model: Path, dtype: str, device: str | None, expert_format: str = "dense", backbone_format: str = "fp8"
) -> tuple[LoadedModel, torch.device, HostExpertArena]:
    """Backbone on the compute device (its fp8-block linears kept so with ``backbone_format`` "fp8"), experts'
    home copy in a (pinned) host arena (fp8 / fp4 with ``expert_format``)."""
    target = torch.device(device) if device else default_device()
    torch_dtype = parse_dtype(dtype)
    arena = HostExpertArena.for_checkpoint(model, torch_dtype, expert_format=expert_format)
    config = ModelLoadConfig(
        dtype=torch_dtype, device=target, expert_format=expert_format, backbone_format=backbone_format
    )
    loaded = load_model(model, config, expert_allocator=arena)
    return loaded, target, arena


def resident_store(store: ExpertStore, device: torch.device) -> ExpertStore | None:
    """A copy of every expert on ``device`` (None when they would not fit in its free memory)."""
    if device.type != "cuda":
        return store
    free, _ = torch.cuda.mem_get_info(device)
    if store.total_bytes() > 0.9 * free:
        return None
    resident = ExpertStore(store.layout, store.dtype, device_allocator(device))
    for (layer, expert), weights in store.items():
        resident.block_for_loading(layer, expert).block.copy_(weights.block, non_blocking=True)
    sync_device(device)
    return resident


def write_receipt_files(
    receipt: dict[str, Any], out_dir: Path, markdown: Callable[[dict[str, Any]], str], omit: tuple[str, ...] = ()
) -> Path:
    """``<kind>-<stamp>.json`` (without the ``omit`` keys) and the same name ``.md``; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{receipt['kind']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({k: v for k, v in receipt.items() if k not in omit}, indent=2, default=str))
    path.with_suffix(".md").write_text(markdown(receipt))
    return path


def add_placement_arguments(
    parser: argparse.ArgumentParser,
    modes: tuple[str, ...],
    policy_help: str,
    default_modes: tuple[str, ...] | None = None,
) -> None:
    """Arguments every placement benchmark shares: the checkpoint, the modes, the cache and the run."""
    parser.add_argument("--model", required=True, type=Path, help="checkpoint folder (e.g. from make-bench-model)")
    parser.add_argument(
        "--modes", default=",".join(default_modes or modes), help=f"comma-separated subset of {','.join(modes)}"
    )
    parser.add_argument("--cache-fraction", type=float, default=0.05, help="VRAM expert cache, share of all experts")
    parser.add_argument("--policy", default="lfu", help=policy_help)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.add_argument(
        "--routing-trace", type=Path, default=None, metavar="PATH", help="route from this recorded trace of expert ids"
    )
    parser.add_argument(
        "--expert-format", default="dense", choices=list(EXPERT_FORMATS), help="experts' home copy (fp8/fp4: as stored)"
    )
    parser.add_argument(
        "--backbone-format",
        default="fp8",
        choices=list(BACKBONE_FORMATS),
        help="backbone linears: fp8 (those stored fp8-block stay so, default) or dense (dequantised at load)",
    )


def placement_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields :func:`add_placement_arguments` parsed."""
    return {
        "model": args.model,
        "modes": [m for m in args.modes.split(",") if m],
        "cache_fraction": args.cache_fraction,
        "policy": args.policy,
        "dtype": args.dtype,
        "device": args.device,
        "cpu_threads": args.cpu_threads,
        "seed": args.seed,
        "routing_trace": args.routing_trace,
        "expert_format": args.expert_format,
        "backbone_format": args.backbone_format,
    }
