"""``moetier bench plot``: decode (the committed H200 receipt), prefill and serve receipts (small synthetic ones
shaped like the H200 receipts of eed3c45), several prefill receipts at once, and the one-line errors."""

import json
import math
from pathlib import Path

import pytest

from moetier.bench import plots
from moetier.cli import main
from moetier.errors import ConfigError

pytest.importorskip("matplotlib")
RECEIPT = Path(__file__).parents[1] / "results" / "h200-20261130-2bcecb4" / "decode-20261130-034741.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def prefill_receipt(chunk: int, lengths: list[int], modes: list[str], profile: bool, model: str = "/m/v4-3l") -> dict:
    """A prefill receipt with the fields the plots read; tok/s differ per mode, length and chunk (never flat)."""
    results = []
    for m, mode in enumerate(modes):
        for n in lengths:
            median = 1000.0 * (m + 1) + n / 64 + chunk / 16
            results.append(
                {
                    "mode": mode,
                    "prompt_len": n,
                    "chunk_tokens": min(chunk, n),
                    "tok_s": {"min": 0.9 * median, "median": median, "max": 1.05 * median},
                    "bound_tok_s": 1500.0 + n / 32 + (7.0 if mode == "tiered" else 0.0),
                }
            )
    prof = {
        mode: {"copy_busy_s": 1.4, "kernel_busy_s": 0.3 + i, "overlap_s": 0.2 * i, "window_s": 3.4 - i}
        | {"copy_hidden_share": 0.15 * i, "tokens": 2 * chunk, "chunk_tokens": chunk}
        for i, mode in enumerate(["sync", "tiered"])
    }
    return {
        "kind": "prefill",
        "config": {"model": model, "chunk_tokens": chunk, "prompt_lens": lengths, "modes": modes},
        "bounds": {"h2d_pinned_gbps": 52.4, "host_read_gbps": 30.0, "streaming_bound_uses": "h2d_pinned_gbps"},
        "plan": {
            "moe_layers": 3,
            "experts_per_layer": 256,
            "expert_block_bytes": 50331648,
            "cache_slots": 38,
            "cache_share_of_experts": 38 / 768,
        },
        "results": results[::-1],  # the plots must not rely on the receipt's order
        "skipped": [],
        "profile": prof if profile else {},
        "notes": [],
    }


def serve_receipt() -> dict:
    """Three concurrency levels; the last failed every request (no percentiles, no tok/s)."""
    levels = []
    for c, tok_s, ttft, itl in ((1, 21.9, 0.53, 0.029), (2, 32.9, 0.59, 0.043), (4, None, None, None)):
        pct = {"p50": ttft, "p90": None if ttft is None else 1.1 * ttft, "p99": None}
        gaps = {"p50": itl, "p90": None if itl is None else 1.2 * itl, "p99": None}
        levels.append({"concurrency": c, "errors": 4 if tok_s is None else 0, "output_tok_s": tok_s, "ttft_s": pct})
        levels[-1] |= {"itl_s": gaps, "tpot_s": gaps, "latency_s": pct}
    return {
        "kind": "serve",
        "config": {"concurrency": [1, 2, 4], "requests": 4, "prompt_tokens": 512, "max_tokens": 32},
        "server": {"model": "/tmp/moetier-bench/v4flash-3l", "url": "http://127.0.0.1:1/v1"},
        "results": levels,
        "notes": [],
    }


def write(tmp_path: Path, name: str, receipt: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(receipt))
    return path


def assert_pngs(folder: Path, names: list[str]) -> None:
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(names)
    for name in names:
        data = (folder / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000


@pytest.fixture
def figures(monkeypatch):
    """Every figure the plots save, by file name, left open for inspection (closed at teardown)."""
    saved = {}

    def keep(plt, fig, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        saved[path.name] = fig
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield saved
    import matplotlib.pyplot as plt

    for fig in saved.values():
        plt.close(fig)


def test_decode_plots_from_a_real_receipt(tmp_path):
    assert main(["bench", "plot", str(RECEIPT), "--out", str(tmp_path)]) == 0
    assert_pngs(tmp_path, [f"{RECEIPT.stem}-hit-rate.png", f"{RECEIPT.stem}-streams.png"])


def test_prefill_receipt_with_a_profile(tmp_path, capsys):
    path = write(
        tmp_path, "prefill-1.json", prefill_receipt(512, [512, 2048, 8192], ["resident", "sync", "tiered"], True)
    )
    assert main(["bench", "plot", str(path), "--out", str(tmp_path / "png")]) == 0
    assert_pngs(tmp_path / "png", ["prefill-1-tok-s.png", "prefill-1-profile.png"])
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "png" / n) for n in ("prefill-1-tok-s.png", "prefill-1-profile.png")
    ]


def test_prefill_without_a_profile_is_one_chart_beside_the_receipt(tmp_path):
    path = write(
        tmp_path, "prefill-2.json", prefill_receipt(2048, [512, 2048], ["sync", "copy", "cpu", "tiered"], False)
    )
    assert main(["bench", "plot", str(path)]) == 0
    assert_pngs(tmp_path, ["prefill-2-tok-s.png"])


def test_prefill_chart_draws_each_mode_and_the_bound(tmp_path, figures):
    receipt = prefill_receipt(512, [512, 2048, 8192], ["resident", "tiered", "sync"], True)  # sync's rows first
    plots.plot_prefill(receipt, tmp_path, "p")
    ax = figures["p-tok-s.png"].axes[0]
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["512", "2k", "8k"]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}  # error-bar plots carry their label on the container
    lines |= {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"resident", "sync", "tiered", "streaming bound (52 GB/s)"}
    for mode in ("resident", "sync", "tiered"):
        expected = sorted((r["prompt_len"], r["tok_s"]["median"]) for r in receipt["results"] if r["mode"] == mode)
        assert list(zip(lines[mode].get_xdata(), lines[mode].get_ydata(), strict=True)) == expected
    bound = lines["streaming bound (52 GB/s)"]
    assert bound.get_linestyle() == "--"
    assert list(bound.get_ydata()) == [1500.0 + n / 32 + 7.0 for n in (512, 2048, 8192)]  # tiered's coverage
    assert "chunk 512 tokens" in ax.get_title() and "cache 4.9% of experts" in ax.get_title()
    profile = figures["p-profile.png"].axes[0]
    heights = [round(bar.get_height(), 6) for bar in profile.patches]
    assert heights == [1.4, 1.4, 0.3, 1.3, 0.0, 0.2, 3.4, 2.4]  # per quantity: sync, tiered


def test_serve_receipt_is_one_chart_against_concurrency(tmp_path, figures):
    path = write(tmp_path, "serve-1.json", serve_receipt())
    assert main(["bench", "plot", str(path)]) == 0
    assert list(figures) == ["serve-1-concurrency.png"]
    fig = figures["serve-1-concurrency.png"]
    tok_s, ttft, itl = fig.axes
    assert list(tok_s.get_lines()[0].get_xdata()) == [1, 2, 4]
    assert list(tok_s.get_lines()[0].get_ydata())[:2] == [21.9, 32.9]
    assert math.isnan(tok_s.get_lines()[0].get_ydata()[2])  # the failed level is a gap
    assert [line.get_label() for line in ttft.get_lines()] == ["p50", "p90"]
    assert list(itl.get_lines()[0].get_ydata())[:2] == pytest.approx([29.0, 43.0])  # milliseconds
    assert "4 failed" in fig._suptitle.get_text()
    assert_pngs(tmp_path, ["serve-1-concurrency.png"])


def test_several_prefill_receipts_get_a_chunk_chart_per_setup(tmp_path):
    small = write(
        tmp_path, "prefill-a.json", prefill_receipt(8192, [8192, 32768], ["resident", "sync", "tiered"], True)
    )
    large = write(tmp_path, "prefill-b.json", prefill_receipt(16384, [8192, 32768], ["sync", "tiered"], False))
    other = write(tmp_path, "prefill-c.json", prefill_receipt(512, [512], ["tiered"], False, model="/m/other"))
    serve = write(tmp_path, "serve-1.json", serve_receipt())
    out = tmp_path / "png"
    assert main(["bench", "plot", str(large), str(small), str(other), str(serve), "--out", str(out)]) == 0
    assert_pngs(
        out,
        ["prefill-a-tok-s.png", "prefill-a-profile.png", "prefill-b-tok-s.png", "prefill-c-tok-s.png"]
        + ["serve-1-concurrency.png", "prefill-b-chunks.png"],  # one chunk chart, named after its first receipt
    )


def test_chunk_series_is_sync_and_tiered_per_chunk():
    receipts = [
        prefill_receipt(16384, [8192, 32768], ["resident", "sync", "tiered"], False),
        prefill_receipt(2048, [512, 2048], ["sync", "copy", "cpu", "tiered"], False),
        prefill_receipt(2048, [2048], ["tiered"], False),
    ]
    series = plots.chunk_series(receipts)
    assert [s["label"] for s in series] == [
        "tiered, chunk 2048 #1",
        "sync, chunk 2048 #1",
        "tiered, chunk 2048 #2",
        "tiered, chunk 16384",
        "sync, chunk 16384",
    ]
    assert [s["receipt"] for s in series] == [0, 0, 1, 2, 2]
    assert series[3]["lengths"] == [8192, 32768]
    assert [r["tok_s"]["median"] for r in series[3]["rows"]] == [3000.0 + 128 + 1024, 3000.0 + 512 + 1024]


def test_an_unknown_kind_is_a_one_line_error_and_nothing_is_drawn(tmp_path, capsys):
    good = write(tmp_path, "prefill-1.json", prefill_receipt(512, [512], ["tiered"], False))
    bogus = write(tmp_path, "x.json", {"kind": "bogus"})
    assert main(["bench", "plot", str(good), str(bogus)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a decode, prefill or serve receipt (kind='bogus')" in err
    assert not list(tmp_path.glob("*.png"))
    write(tmp_path, "list.json", [1, 2])
    with pytest.raises(ConfigError, match="kind=None"):
        plots._load(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="not a readable receipt"):
        plots._load(tmp_path / "missing.json")
