"""Tiered decode against the serial bound, from decode receipts that hold a resident run beside the tiered one.

    python bench/serial_bound.py results/h100-20261207-*/decode-*.json

The decode bench's DRAM bound (``streams * host_read / missed bytes a step``) leaves the backbone out. A tiered step
runs its backbone (attention, hyper-connections, shared expert, LM head: what a resident step runs) and then each
layer's expert phase, bound by the host's DRAM serving the CPU tier and the mapped route's PCIe reads; nothing
overlaps the two. So its bound is the resident step followed by the misses at the DRAM rate
(:func:`moetier.bench.decode.serial_bound`). Receipts written since the serial bound was added carry it
(``ratio_to_serial_bound``); this computes it for any receipt with both runs, older ones included, and prints one
Markdown row per (receipt, streams): tiered and resident tok/s, both bounds and tiered's ratio to each, and (with
a naive run) x naive and the x naive each bound would give: the ceilings on x naive a split of the misses cannot pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetier.bench.common import fmt
from moetier.bench.decode import add_ratios


def rows(path: Path) -> list[str]:
    """One row per stream count with a tiered and a resident result in the receipt at ``path``."""
    receipt = json.loads(path.read_text())
    if receipt.get("kind") != "decode":
        return []
    add_ratios(receipt["results"])  # the serial bound and x naive's ceilings, for receipts older than them too
    by_key = {(r["mode"], r["streams"]): r for r in receipt["results"]}
    out = []
    for (mode, streams), result in sorted(by_key.items()):
        resident = by_key.get(("resident", streams))
        if mode != "tiered" or resident is None or not result.get("bound_dram_tok_s"):
            continue
        tok_s, dram, serial = result["tok_s"]["median"], result["bound_dram_tok_s"], result["bound_serial_tok_s"]
        out.append(
            f"| {path.parent.name}/{path.name} | {streams} | {tok_s:.1f} | {resident['tok_s']['median']:.1f} "
            f"| {receipt['bounds']['host_read_gbps']:.1f} | {dram:.1f} | {serial:.1f} | {tok_s / dram:.2f} "
            f"| {tok_s / serial:.2f} | {serial / dram:.2f} | {fmt(result.get('ratio_to_naive'))} "
            f"| {fmt(result.get('naive_ratio_at_dram_bound'))} / {fmt(result.get('naive_ratio_at_serial_bound'))} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("receipts", nargs="+", type=Path, help="decode receipts (JSON)")
    args = parser.parse_args(argv)
    table = []
    for path in args.receipts:
        try:
            table += rows(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not a readable decode receipt: name it, go on
            print(f"{path}: skipped, not a decode receipt ({type(exc).__name__}: {exc})", file=sys.stderr)
    if not table:
        print("no receipt holds both a tiered and a resident decode run", file=sys.stderr)
        return 1
    print(
        "| receipt | streams | tiered tok/s | resident tok/s | host read GB/s | DRAM bound | serial bound "
        "| x DRAM bound | x serial bound | serial / DRAM | x naive | x naive at DRAM / serial bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
