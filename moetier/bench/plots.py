"""PNG plots of decode receipts: tok/s against streams per placement, and the expert-cache hit rate by layer.

matplotlib is an optional dependency (``pip install moetier[bench]``); ``moetier bench plot`` says so
in one line when it is missing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or moetier[bench])") from None
    return plt


def _load(path: Path) -> dict[str, Any]:
    try:
        receipt = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable receipt ({exc})") from None
    if receipt.get("kind") != "decode":
        raise ConfigError(f"{path}: not a decode receipt (kind={receipt.get('kind')!r})")
    return receipt


def plot_decode(receipt: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """``<stem>-streams.png`` (median tok/s with min-max bars, DRAM bound dashed) and ``<stem>-hit-rate.png``."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for result in receipt["results"]:
        by_mode.setdefault(result["mode"], []).append(result)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for mode, results in by_mode.items():
        results.sort(key=lambda r: r["streams"])
        streams = [r["streams"] for r in results]
        median = [r["tok_s"]["median"] for r in results]
        low = [m - r["tok_s"]["min"] for m, r in zip(median, results, strict=True)]
        high = [r["tok_s"]["max"] - m for m, r in zip(median, results, strict=True)]
        ax.errorbar(streams, median, yerr=[low, high], marker="o", capsize=3, label=mode)
    tiered = sorted(by_mode.get("tiered", []), key=lambda r: r["streams"])
    if tiered and all("bound_dram_tok_s" in r for r in tiered):
        ax.plot([r["streams"] for r in tiered], [r["bound_dram_tok_s"] for r in tiered], "k--", label="DRAM bound")
    plan = receipt["plan"]
    ax.set(
        xlabel="concurrent streams",
        ylabel="decode tokens/s",
        title=f"{plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts, "
        f"cache {100 * plan['cache_share_of_experts']:.1f}% of experts",
    )
    ax.set_xticks(sorted({r["streams"] for r in receipt["results"]}))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths = [out_dir / f"{stem}-streams.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    paths += _plot_hit_rates(plt, by_mode, out_dir, stem)
    return paths


def _plot_hit_rates(plt, by_mode: dict[str, list[dict[str, Any]]], out_dir: Path, stem: str) -> list[Path]:
    rows = [r for r in by_mode.get("tiered", []) if r.get("hit_rate_per_layer")]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for i, result in enumerate(sorted(rows, key=lambda r: r["streams"])):
        layers = sorted(result["hit_rate_per_layer"], key=int)
        xs = [int(layer) + i * width for layer in layers]
        ax.bar(xs, [result["hit_rate_per_layer"][layer] for layer in layers], width, label=f"{result['streams']}")
    layers = sorted({int(layer) for r in rows for layer in r["hit_rate_per_layer"]})
    ax.set_xticks([layer + width * (len(rows) - 1) / 2 for layer in layers], [str(layer) for layer in layers])
    ax.set(xlabel="MoE layer", ylabel="expert-cache hit rate (tiered)", ylim=(0, 1))
    ax.legend(title="streams")
    ax.grid(alpha=0.3, axis="y")
    path = out_dir / f"{stem}-hit-rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("receipts", nargs="+", type=Path, help="decode receipt JSON files")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: beside each receipt)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for path in args.receipts:
        for png in plot_decode(_load(path), args.out or path.parent, path.stem):
            print(png)
    return 0
