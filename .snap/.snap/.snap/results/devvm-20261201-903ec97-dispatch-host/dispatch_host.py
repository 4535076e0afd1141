"""Host time of TieredDispatcher.dispatch's own bookkeeping on the CPU: expert compute stubbed out.

A V4-Flash-like routing layout (3 MoE layers x 256 experts, top-6, 38 cache slots, LFU, skewed routing),
tiny expert blocks, the CPU tier's job and the device's expert call replaced by no-ops, so what is left is
the dispatcher's Python: routing, split, policy, admissions, copies bookkeeping, metrics.
Usage (from the repository root): .venv/bin/python results/devvm-20261201-903ec97-dispatch-host/dispatch_host.py [prof]
"""
import cProfile, pstats, sys, time
from concurrent.futures import Future
import torch
sys.path.insert(0, "tests")
from test_tiers_fidelity import _random_store, _routing
import moetier.tiers.tiered_dispatcher as td
from moetier.tiers.cpu_tier import CpuResult
from moetier.tiers.experts import ExpertLayout

def stub_cpu(job):
    f = Future()
    out = job.out if job.out is not None else torch.zeros(job.hidden.shape)
    f.set_result(CpuResult(out=out, seconds=1e-4))
    if job.on_done: job.on_done()
    return f

td.run_experts = lambda *a, **k: None
layout = ExpertLayout(moe_layers=(0, 1, 2), num_experts=256, hidden_size=64, intermediate_size=32, top_k=6)
store = _random_store(layout, torch.bfloat16)
results = {}
for tokens in (1, 4):
    d = td.TieredDispatcher(store, cache_slots=38, miss_route="auto", cpu_share=0.5, policy="lfu")
    d.prepare("cpu")
    d.cpu_tier.submit = stub_cpu
    g = torch.Generator().manual_seed(1)
    calls = [_routing(tokens, layout, g, torch.bfloat16, skew=0.9) for _ in range(3000)]
    with torch.inference_mode():
        for i, (h, ids, w) in enumerate(calls[:600]):
            d.dispatch(i % 3, h, ids, w)
        prof = cProfile.Profile() if sys.argv[1:] == ["prof"] else None
        if prof: prof.enable()
        from moetier.profiling import clocking
        with clocking() as clock:
            for i, (h, ids, w) in enumerate(calls[2400:3000]):
                d.dispatch(i % 3, h, ids, w)
        phases = {k: round(1e6 * v / 600, 1) for k, v in sorted(clock.seconds.items())}
        best = []
        for r in range(3):
            t = time.perf_counter()
            for i, (h, ids, w) in enumerate(calls[600 + 600 * r: 1200 + 600 * r]):
                d.dispatch(i % 3, h, ids, w)
            best.append((time.perf_counter() - t) / 600 * 1e6)
        if prof:
            prof.disable(); pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    results[tokens] = (min(best), sorted(best)[len(best)//2], d.metrics.snapshot()["hit_rate"], phases)
    d.close()
for tokens, (best, median, hit, phases) in results.items():
    print(f"tokens {tokens}: {best:.1f} us per call (best of 3 x 600), median {median:.1f}, hit rate {hit:.2f}")
    print("  us per call by phase:", phases)
