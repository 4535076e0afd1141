"""PNG plots of bench receipts.

- decode: tok/s against streams per placement, and the expert-cache hit rate by layer;
- prefill: tok/s against prompt length per mode (with the streaming bound), and, when the receipt was
  profiled, copy / kernel / overlapped busy time per profiled mode; several prefill receipts of one
  model (different chunk sizes) also get one chart of sync and tiered tok/s, one line per (mode, chunk);
- serve: output tok/s, TTFT and ITL against concurrency.

matplotlib is an optional dependency (``pip install moetier[bench]``); ``moetier bench plot`` says so
in one line when it is missing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

KINDS = ("decode", "prefill", "serve")
CHUNK_MODES = ("tiered", "sync")  # the modes compared across chunk sizes


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
    kind = receipt.get("kind") if isinstance(receipt, dict) else None
    if kind not in KINDS:
        raise ConfigError(f"{path}: not a {', '.join(KINDS[:-1])} or {KINDS[-1]} receipt (kind={kind!r})")
    return receipt


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _errorbar(ax, xs: list[float], results: list[dict[str, Any]], **style) -> None:
    """Median tok/s of ``results`` at ``xs`` with min-max bars."""
    median = [r["tok_s"]["median"] for r in results]
    low = [m - r["tok_s"]["min"] for m, r in zip(median, results, strict=True)]
    high = [r["tok_s"]["max"] - m for m, r in zip(median, results, strict=True)]
    ax.errorbar(xs, median, yerr=[low, high], capsize=3, **style)


def _by_mode(results: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """Results grouped by mode (in first-seen order), each group sorted by ``key``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(result["mode"], []).append(result)
    return {mode: sorted(rows, key=lambda r: r[key]) for mode, rows in groups.items()}


def _legend_outside(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))


# --- decode ---------------------------------------------------------------------------------------


def plot_decode(receipt: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """``<stem>-streams.png`` (median tok/s with min-max bars, DRAM bound dashed) and ``<stem>-hit-rate.png``."""
    plt = _pyplot()
    by_mode = _by_mode(receipt["results"], "streams")
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for mode, results in by_mode.items():
        _errorbar(ax, [r["streams"] for r in results], results, marker="o", label=mode)
    tiered = by_mode.get("tiered", [])
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
    _legend_outside(ax)
    paths = [_save(plt, fig, out_dir / f"{stem}-streams.png")]
    return paths + _plot_hit_rates(plt, by_mode, out_dir, stem)


def _plot_hit_rates(plt, by_mode: dict[str, list[dict[str, Any]]], out_dir: Path, stem: str) -> list[Path]:
    rows = [r for r in by_mode.get("tiered", []) if r.get("hit_rate_per_layer")]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for i, result in enumerate(rows):
        layers = sorted(result["hit_rate_per_layer"], key=int)
        xs = [int(layer) + i * width for layer in layers]
        ax.bar(xs, [result["hit_rate_per_layer"][layer] for layer in layers], width, label=f"{result['streams']}")
    layers = sorted({int(layer) for r in rows for layer in r["hit_rate_per_layer"]})
    ax.set_xticks([layer + width * (len(rows) - 1) / 2 for layer in layers], [str(layer) for layer in layers])
    ax.set(xlabel="MoE layer", ylabel="expert-cache hit rate (tiered)", ylim=(0, 1))
    ax.legend(title="streams")
    ax.grid(alpha=0.3, axis="y")
    return [_save(plt, fig, out_dir / f"{stem}-hit-rate.png")]


# --- prefill --------------------------------------------------------------------------------------


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _prompt_axis(ax, lengths: set[int]) -> None:
    """Log2 x axis with a tick at every measured prompt length."""
    ax.set_xscale("log", base=2)
    ticks = sorted(lengths)
    ax.set_xticks(ticks, [_tokens_label(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")


def _prefill_title(receipt: dict[str, Any]) -> str:
    plan = receipt["plan"]
    return (
        f"Prefill, {plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts, "
        f"chunk {receipt['config']['chunk_tokens']} tokens, "
        f"cache {100 * plan['cache_share_of_experts']:.1f}% of experts"
    )


def _streaming_bound(results: list[dict[str, Any]]) -> dict[int, float]:
    """Bound tok/s per prompt length; every mode shares the prompt, so prefer tiered's coverage, then any."""
    bound: dict[int, float] = {}
    for result in sorted(results, key=lambda r: r["mode"] != "tiered"):
        if result.get("bound_tok_s"):
            bound.setdefault(result["prompt_len"], result["bound_tok_s"])
    return dict(sorted(bound.items()))


def plot_prefill(receipt: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """``<stem>-tok-s.png`` (median tok/s per mode, min-max bars, streaming bound dashed) and, when the
    receipt was profiled, ``<stem>-profile.png``."""
    plt = _pyplot()
    results = receipt["results"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for mode, rows in _by_mode(results, "prompt_len").items():
        _errorbar(ax, [r["prompt_len"] for r in rows], rows, marker="o", label=mode)
    bound = _streaming_bound(results)
    if bound:
        bounds = receipt["bounds"]
        gbps = bounds[bounds["streaming_bound_uses"]]
        ax.plot(list(bound), list(bound.values()), "k--", label=f"streaming bound ({gbps:.0f} GB/s)")
    _prompt_axis(ax, {r["prompt_len"] for r in results})
    ax.set(ylabel="prefill tokens/s", title=_prefill_title(receipt))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    paths = [_save(plt, fig, out_dir / f"{stem}-tok-s.png")]
    if receipt.get("profile"):
        paths.append(_plot_profile(plt, receipt, out_dir / f"{stem}-profile.png"))
    return paths


def _plot_profile(plt, receipt: dict[str, Any], path: Path) -> Path:
    """Per profiled mode: seconds the copy engine and the kernels were busy, their overlap, and the window."""
    profiles = receipt["profile"]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    bars = (
        ("copy_busy_s", "copy busy"),
        ("kernel_busy_s", "kernels busy"),
        ("overlap_s", "overlapped"),
        ("window_s", "window"),
    )
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        xs = [m + i * width for m in range(len(profiles))]
        drawn = ax.bar(xs, [p[key] for p in profiles.values()], width, label=label)
        ax.bar_label(drawn, fmt="%.2f", fontsize=7)
    names = [
        f"{mode}\n({p['tokens']} tokens, {100 * p['copy_hidden_share']:.0f}% of copy hidden)"
        for mode, p in profiles.items()
    ]
    ax.set_xticks([m + width * (len(bars) - 1) / 2 for m in range(len(profiles))], names)
    ax.set(ylabel="seconds", title=f"Profiled prefill, chunk {receipt['config']['chunk_tokens']} tokens")
    ax.grid(alpha=0.3, axis="y")
    _legend_outside(ax)
    return _save(plt, fig, path)


def _setup_key(receipt: dict[str, Any]) -> tuple:
    """Prefill receipts with equal keys differ at most in chunk size (and prompt lengths): comparable."""
    plan, cfg = receipt["plan"], receipt["config"]
    return cfg["model"], plan["moe_layers"], plan["experts_per_layer"], plan["expert_block_bytes"], plan["cache_slots"]


def chunk_series(receipts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sync and tiered rows of prefill receipts as series ``{"mode", "chunk", "receipt", "label", "lengths",
    "rows"}``, smallest chunk first; ``receipt`` indexes the receipts in that order (receipts that share a chunk
    size get ``#1``, ``#2`` ... in their labels)."""
    ordered = sorted(receipts, key=lambda r: r["config"]["chunk_tokens"])
    chunks = [r["config"]["chunk_tokens"] for r in ordered]
    series = []
    for i, receipt in enumerate(ordered):
        suffix = f" #{chunks[: i + 1].count(chunks[i])}" if chunks.count(chunks[i]) > 1 else ""
        rows = _by_mode([r for r in receipt["results"] if r["mode"] in CHUNK_MODES], "prompt_len")
        for mode in (m for m in CHUNK_MODES if m in rows):
            label = f"{mode}, chunk {chunks[i]}{suffix}"
            lengths = [r["prompt_len"] for r in rows[mode]]
            series.append(
                {"mode": mode, "chunk": chunks[i], "receipt": i, "label": label, "lengths": lengths, "rows": rows[mode]}
            )
    return series


def plot_prefill_chunks(receipts: list[dict[str, Any]], path: Path) -> Path:
    """One chart of sync and tiered tok/s against prompt length: colour per receipt, line style per mode."""
    plt = _pyplot()
    series = chunk_series(receipts)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"tiered": ("-", "o"), "sync": (":", "s")}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for s in series:
        line, marker = styles[s["mode"]]
        colour = colours[s["receipt"] % len(colours)]
        _errorbar(ax, s["lengths"], s["rows"], ls=line, marker=marker, color=colour, label=s["label"])
    _prompt_axis(ax, {n for s in series for n in s["lengths"]})
    plan = receipts[0]["plan"]
    ax.set(
        ylabel="prefill tokens/s",
        title=f"Prefill by chunk size, {plan['moe_layers']} MoE layers x {plan['experts_per_layer']} experts, "
        f"cache {100 * plan['cache_share_of_experts']:.1f}% of experts",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return _save(plt, fig, path)


# --- serve ----------------------------------------------------------------------------------------


def _value(summary: dict[str, Any] | None, key: str, scale: float = 1.0) -> float:
    """A percentile or rate, NaN where the level had no successful request (matplotlib leaves a gap)."""
    value = summary.get(key) if summary else None
    return float("nan") if value is None else value * scale


def plot_serve(receipt: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """``<stem>-concurrency.png``: output tok/s, TTFT p50/p90 (s) and ITL p50/p90 (ms) against concurrency."""
    plt = _pyplot()
    results = sorted(receipt["results"], key=lambda r: r["concurrency"])
    levels = [r["concurrency"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(levels, [_value(r, "output_tok_s") for r in results], marker="o")
    axes[0].set(ylabel="output tokens/s")
    for ax, key, scale, unit in ((axes[1], "ttft_s", 1.0, "s"), (axes[2], "itl_s", 1e3, "ms")):
        for pct, style in (("p50", "-o"), ("p90", "--s")):
            ax.plot(levels, [_value(r[key], pct, scale) for r in results], style, label=pct)
        ax.set(ylabel=f"{key.split('_')[0].upper()} {unit}")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.set(xlabel="concurrent requests")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    cfg, server = receipt["config"], receipt["server"]
    errors = sum(r["errors"] for r in results)
    fig.suptitle(
        f"Serve {Path(server['model']).name}: ~{cfg['prompt_tokens']} prompt words, {cfg['max_tokens']} output "
        f"tokens, {cfg['requests']} requests per level" + (f", {errors} failed" if errors else "")
    )
    return [_save(plt, fig, out_dir / f"{stem}-concurrency.png")]


# --- command line ---------------------------------------------------------------------------------

PLOTTERS = {"decode": plot_decode, "prefill": plot_prefill, "serve": plot_serve}


def plot_receipts(paths: list[Path], out: Path | None = None) -> list[Path]:
    """Every receipt's own charts (beside it, or in ``out``), then one chunk-size chart per setup (model and
    cache size) that has two or more prefill receipts, named after the first of them."""
    loaded = [(path, _load(path)) for path in paths]  # every file is checked before anything is drawn
    pngs: list[Path] = []
    by_setup: dict[tuple, list[tuple[Path, dict[str, Any]]]] = {}
    for path, receipt in loaded:
        pngs += PLOTTERS[receipt["kind"]](receipt, out or path.parent, path.stem)
        if receipt["kind"] == "prefill":
            by_setup.setdefault(_setup_key(receipt), []).append((path, receipt))
    for group in by_setup.values():
        if len(group) > 1:
            first = group[0][0]
            target = (out or first.parent) / f"{first.stem}-chunks.png"
            pngs.append(plot_prefill_chunks([receipt for _, receipt in group], target))
    return pngs


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("receipts", nargs="+", type=Path, help="decode, prefill or serve receipt JSON files")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: beside each receipt)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for png in plot_receipts(args.receipts, args.out):
        print(png)
    return 0
