"""Two builds of the CPU tier's C kernel on the same jobs, their runs interleaved: an A/B that one host's drift
and the order of runs cannot bias (the cpu-tier bench runs one build, and on a VM the second of two runs may move
by 45%).

    python bench/kernel_builds_ab.py --flags-b=-mno-avx512vbmi --threads 1,14 --formats fp4,fp4_e8m0

Build A is the default (-march=native), build B adds ``--flags-b``. For each format, thread count and token count it
times ``--rounds`` rounds, each one job of every build in turn (alternating which goes first), over experts cycled
past the caches, checks both builds give the same bits, and prints the medians; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.bench.cpu_tier import CpuTierBenchConfig, JobMaker, make_experts  # noqa: E402
from moetier.bench.environment import environment  # noqa: E402
from moetier.kernels import cpu_experts  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _run(lib: cpu_experts.CpuExpertsLibrary, job, fmt: str, threads: int) -> torch.Tensor:
    experts = [g.weights for g in job.groups]
    rows, gates = [g.rows for g in job.groups], [g.gates for g in job.groups]
    return lib.run_fp4(job.hidden, experts, experts[0].tile, rows, gates, None, threads)


def measure(fmt: str, threads: int, tokens: int, libs: dict[str, cpu_experts.CpuExpertsLibrary], args) -> dict:
    cfg = CpuTierBenchConfig(experts=args.experts, top_k=args.top_k, formats=[fmt])
    _, experts = make_experts(cfg, fmt)
    maker = JobMaker(cfg, experts, fmt)
    seconds: dict[str, list[float]] = {name: [] for name in libs}
    same = True
    for rnd in range(args.warmup + args.rounds):
        job = maker.job(tokens)
        order = list(libs) if rnd % 2 == 0 else list(reversed(libs))
        outs = {}
        for name in order:
            start = time.perf_counter()
            outs[name] = _run(libs[name], job, fmt, threads)
            if rnd >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
        a, b = outs.values()
        same = same and torch.equal(a.nan_to_num(), b.nan_to_num())
    gbps = {name: maker.job_bytes / statistics.median(s) / 1e9 for name, s in seconds.items()}
    return {
        "format": fmt, "threads": threads, "tokens": tokens, "same_bits": same,
        "ms": {name: 1e3 * statistics.median(s) for name, s in seconds.items()}, "gbps": gbps,
        "b_over_a": gbps["b"] / gbps["a"],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flags-b", required=True, help="extra compiler flags of build B, comma-separated")
    parser.add_argument("--formats", default="fp4", help="fp4 and / or fp4_e8m0")
    parser.add_argument("--threads", type=_ints, default=[1])
    parser.add_argument("--tokens", type=_ints, default=[1, 4])
    parser.add_argument("--experts", type=int, default=48, help="experts cycled over (past the caches)")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    flags_b = tuple(f for f in args.flags_b.split(",") if f)
    if unknown := set(args.formats.split(",")) - {"fp4", "fp4_e8m0"}:
        print(f"error: --formats takes fp4 and fp4_e8m0, not {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    libs = {"a": cpu_experts.library(()), "b": cpu_experts.library(flags_b)}
    if any(lib is None for lib in libs.values()):
        print("error: a build failed (see the warning above); a C compiler is needed", file=sys.stderr)
        return 1
    print(f"A: native ({libs['a'].isa}), B: native + {' '.join(flags_b)} ({libs['b'].isa})")
    results = []
    for fmt in args.formats.split(","):
        for threads in args.threads:
            for tokens in args.tokens:
                r = measure(fmt, threads, tokens, libs, args)
                results.append(r)
                print(f"{fmt} threads {threads} tokens {tokens}: A {r['ms']['a']:.3f} ms {r['gbps']['a']:.1f} GB/s, "
                      f"B {r['ms']['b']:.3f} ms {r['gbps']['b']:.1f} GB/s, B/A {r['b_over_a']:.3f}, "
                      f"same bits {r['same_bits']}", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        receipt = {"flags_b": flags_b, "isa": {k: v.isa for k, v in libs.items()}, "results": results,
                   "environment": environment()}  # fmt: skip
        args.out.write_text(json.dumps(receipt, indent=2))
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
