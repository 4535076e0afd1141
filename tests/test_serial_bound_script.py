"""``bench/serial_bound.py``: tiered decode against its DRAM and serial bounds and the x naive ceilings, from a
committed H200 receipt (resident, naive and tiered at 1, 2 and 4 streams), and a file that is no decode receipt."""

import importlib.util
import json
from pathlib import Path

import pytest

from moetier.bench.decode import serial_bound

ROOT = Path(__file__).parents[1]
RECEIPT = ROOT / "results" / "h200-20261206-d3e60bf-health" / "decode-20261206-203553.json"


def _script():
    spec = importlib.util.spec_from_file_location("serial_bound_script", ROOT / "bench" / "serial_bound.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_rows_give_each_stream_count_its_bounds_and_naive_ceilings():
    rows = _script().rows(RECEIPT)
    receipt = json.loads(RECEIPT.read_text())
    by_key = {(r["mode"], r["streams"]): r["tok_s"]["median"] for r in receipt["results"]}
    assert [int(_cells(r)[1]) for r in rows] == [1, 2, 4]
    for row in rows:
        cells = _cells(row)
        streams = int(cells[1])
        tiered, naive = by_key["tiered", streams], by_key["naive", streams]
        dram = next(r for r in receipt["results"] if (r["mode"], r["streams"]) == ("tiered", streams))
        serial = serial_bound(by_key["resident", streams], dram["bound_dram_tok_s"])
        assert float(cells[6]) == pytest.approx(serial, abs=0.05)
        assert float(cells[10]) == pytest.approx(tiered / naive, abs=0.005)
        at_dram, at_serial = (float(x) for x in cells[11].split("/"))
        assert at_dram == pytest.approx(dram["bound_dram_tok_s"] / naive, abs=0.005)
        assert at_serial == pytest.approx(serial / naive, abs=0.005) and at_serial < at_dram


def test_main_names_a_file_that_is_no_decode_receipt_and_fails_without_rows(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert _script().main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.json: skipped, not a decode receipt" in err and "no receipt holds both" in err
