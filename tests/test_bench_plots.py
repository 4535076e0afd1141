"""``moetier bench plot`` turns a decode receipt into PNGs (checked on the committed H200 receipt)."""

from pathlib import Path

import pytest

from moetier.cli import main
from moetier.errors import ConfigError

pytest.importorskip("matplotlib")
RECEIPT = Path(__file__).parents[1] / "results" / "h200-20261130-2bcecb4" / "decode-20261130-034741.json"


def test_plots_from_a_real_receipt(tmp_path):
    assert main(["bench", "plot", str(RECEIPT), "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == [f"{RECEIPT.stem}-hit-rate.png", f"{RECEIPT.stem}-streams.png"]
    for name in pngs:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_non_decode_file_is_a_one_line_error(tmp_path, capsys):
    bogus = tmp_path / "x.json"
    bogus.write_text('{"kind": "prefill"}')
    assert main(["bench", "plot", str(bogus)]) == 2
    assert "not a decode receipt" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        from moetier.bench.plots import _load

        _load(tmp_path / "missing.json")
