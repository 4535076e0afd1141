"""Per-job host overhead of CpuExpertTier.run: a decode job of 6 experts x 1 token on tiny experts.

"total": tier.run(job) with the real C call (tiny experts: the C work is a few us).
"python": tier.run(job) with the C entry points replaced by a no-op (the pure Python prelude, no ctypes).
Median over N jobs, best of R repeats. bf16 and fp4 (tile (1, 32)) experts, hidden 64 / intermediate 32.
"""
import statistics, sys, time
import torch
from moetier.kernels import cpu_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertWeights

H, I, E, K, N, R = 64, 32, 12, 6, 4000, 5
if "--v4" in sys.argv:  # DeepSeek-V4 expert shapes (the C call is stubbed out then: prelude only)
    H, I, E, N = 4096, 2048, 8, 2000


def experts(fmt):
    quant = ExpertQuant(kind="fp4-block", tile=(1, 32)) if fmt == "fp4" else None
    layout = ExpertLayout((0,), num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, quant=quant)
    dtype = torch.uint8 if quant else torch.bfloat16
    return [ExpertWeights.from_block(torch.zeros(layout.block_numel, dtype=dtype), layout) for _ in range(E)]


def jobs(ws, n, seed=0):
    """Like the dispatcher's decode jobs: rows/gates are 1-pair slices of the call's int64 tokens / fp32 gates."""
    gen = torch.Generator().manual_seed(seed)
    hidden, out = torch.randn(1, H).bfloat16(), torch.empty(1, H)
    tokens, gates = torch.zeros(K, dtype=torch.int64), torch.rand(K, generator=gen)
    res = []
    for _ in range(n):
        pick = torch.randperm(E, generator=gen)[:K].tolist()
        groups = [CpuGroup(ws[e], tokens[i : i + 1], gates[i : i + 1]) for i, e in enumerate(pick)]
        res.append(CpuJob(hidden=hidden, groups=groups, out=out))
    return res


def measure(tier, js):
    best = []
    for _ in range(R):
        ts = []
        for j in js:
            t0 = time.perf_counter_ns()
            tier.run(j)
            ts.append(time.perf_counter_ns() - t0)
        best.append(statistics.median(ts) / 1e3)
    return min(best)


def main():
    torch.set_num_threads(1)
    tier = CpuExpertTier(None, threads=1)
    lib = cpu_experts.library()
    for fmt in ("bf16", "fp4"):
        js = jobs(experts(fmt), N)
        tier.run(js[0])
        assert tier.last_kernel.startswith("c-"), tier.last_kernel
        total = measure(tier, js) if "--v4" not in sys.argv else float("nan")
        lib._run = lib._run_quantised = lambda *args: 0  # the C call stubbed out: the Python prelude alone
        python = measure(tier, js)
        del lib._run, lib._run_quantised
        lib.__init__(lib.path)
        print(f"{fmt}: total {total:6.1f} us/job   python prelude {python:6.1f} us/job   ({tier.last_kernel})")
    tier.close()


main()
