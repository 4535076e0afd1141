"""Probe: can the grouped decode kernels read missed experts straight from the pinned host arena (zero-copy)?

The tiered copy path copies each miss into a VRAM slot and then computes it; the host decides that per MoE
layer after waiting for the router's ids. If the kernels can read a pinned expert over PCIe at close to the
copy engine's rate, a decode call needs no host decision: the device table of block offsets points each
expert at its cache slot or at its home copy, and the whole step can run in CUDA graphs.

Per format and tokens: us per call and GB/s of expert bytes for blocks in VRAM, blocks in pinned host memory
(read by the kernels), and the copy path's H2D copy of the same blocks alone; plus whether host-read results
equal the VRAM ones bit for bit. Run: ``PYTHONPATH=. python results/h200-20261201-zero-copy/zero_copy_probe.py``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moetier.bench.cpu_tier import CpuTierBenchConfig, make_experts
from moetier.kernels.device_routing import LayerBlocks, run_routed
from moetier.tiers.experts import ExpertWeights


def timed(fn, calls: int) -> float:
    """Mean device us per call over ``calls`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def probe(fmt: str, experts_n: int, tokens_list: list[int]) -> list[dict]:
    cfg = CpuTierBenchConfig(experts=experts_n, formats=[fmt], swiglu_limit=10.0)
    layout, host = make_experts(cfg, fmt)
    assert host[0].block.is_pinned()
    dev = [ExpertWeights.from_block(w.block.to("cuda"), layout) for w in host]
    expert_bytes = host[0].block.numel() * host[0].block.element_size()
    base = dev[0].block.data_ptr()
    dev_blocks = LayerBlocks.of(dev, torch.bfloat16)
    assert dev_blocks is not None
    host_offsets = torch.tensor([w.block.data_ptr() - base for w in host], dtype=torch.int64, device="cuda")
    align = 16 if all(int(o) % 16 == 0 for o in host_offsets.tolist()) else 1
    host_blocks = LayerBlocks(dev_blocks.first, host_offsets, align, dev_blocks.placement)
    rows = []
    gen = torch.Generator().manual_seed(1)
    for tokens in tokens_list:
        pairs = tokens * cfg.top_k
        calls = max(1, experts_n // pairs)
        # each call its own distinct experts, cycling: cold (more bytes than L2) in VRAM
        id_sets = [torch.arange(c * pairs, (c + 1) * pairs).view(tokens, cfg.top_k).cuda() for c in range(calls)]
        hidden = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16).cuda()
        weights = torch.rand(tokens, cfg.top_k, generator=gen).cuda()
        outs = {}
        for name, blocks in (("vram", dev_blocks), ("host", host_blocks)):
            out = torch.zeros(tokens, cfg.hidden, device="cuda")
            state = {"i": 0}

            def call(blocks=blocks, out=out, state=state):
                ids = id_sets[state["i"] % calls]
                state["i"] += 1
                run_routed(out, hidden, ids, weights, blocks, cfg.swiglu_limit)

            us = timed(call, 4 * calls)
            check = torch.zeros(tokens, cfg.hidden, device="cuda")
            run_routed(check, hidden, id_sets[0], weights, blocks, cfg.swiglu_limit)
            outs[name] = check
            rows.append(
                {
                    "format": fmt,
                    "tokens": tokens,
                    "placement": name,
                    "us_per_call": round(us, 1),
                    "gbps": round(pairs * expert_bytes / us / 1e3, 1),
                }
            )
        slots = [torch.empty_like(dev[i].block) for i in range(pairs)]

        def copy(state={"i": 0}):
            start = (state["i"] % calls) * pairs
            state["i"] += 1
            for i, slot in enumerate(slots):
                slot.copy_(host[start + i].block, non_blocking=True)

        us = timed(copy, 4 * calls)
        rows.append(
            {
                "format": fmt,
                "tokens": tokens,
                "placement": "h2d-copy-only",
                "us_per_call": round(us, 1),
                "gbps": round(pairs * expert_bytes / us / 1e3, 1),
            }
        )
        rows.append(
            {"format": fmt, "tokens": tokens, "host_equals_vram_bits": bool(torch.equal(outs["vram"], outs["host"]))}
        )
        print(json.dumps(rows[-4:]), flush=True)
    return rows


def main() -> None:
    """``PROBE_SWEEP=1``: fp4 only, over the kernels' column step and row block (module constants, set here)."""
    out_dir = os.environ.get("OUT", ".")
    rows = []
    if os.environ.get("PROBE_SWEEP"):
        from moetier.kernels import grouped_experts

        # The first sweep (f31864b: these names were _FP4_BLOCK_K, _QUANT_BLOCK_N and _BLOCK_H, shared with fp8 and
        # dense) ran (256, 16, 32), (512, 16, 32), (1024, 16, 32), (1024, 8, 16), (512, 8, 32).
        sweep = os.environ.get("PROBE_SWEEP_CONFIGS", "1024:8:16,1024:4:8,1024:8:8,2048:4:16,512:4:8")
        for config in sweep.split(","):
            block_k, block_n, block_h = (int(v) for v in config.split(":"))
            grouped_experts._FP4_BLOCK_K, grouped_experts._FP4_BLOCK_N = block_k, block_n
            grouped_experts._FP4_BLOCK_H = block_h
            for row in probe("fp4", 240, [1, 4]):
                rows.append({"block_k": block_k, "block_n": block_n, "block_h": block_h, **row})
    else:
        for fmt, n in (("fp4", 240), ("bf16", 96)):
            rows += probe(fmt, n, [1, 2, 4])
    with open(os.path.join(out_dir, "zero_copy_probe.json"), "w") as f:
        json.dump({"argv": sys.argv, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
