"""Start-up measurement of the two miss routes' costs (CUDA): the split's first cost model.

A few experts are timed on each route alone, at two token counts, and each route's cost is fitted as
``fixed + per_token * n`` (:class:`~moetier.tiers.route_costs.RouteCosts`). Each timing is the fastest of
``repeats``: one slow outlier (the H200 host once timed a tiny test expert's CPU job at 3.4 ms, 24x its usual 0.14 ms)
would otherwise make a route look so dear that the split never sends it work, and a route that gets no
work is never observed, so its cost is never corrected. While serving, the
:class:`~moetier.tiers.route_costs.RouteAdapter` rescales these to what the routes cost side by side.
"""

from __future__ import annotations

import time

import torch

from moetier.kernels.grouped_experts import run_experts
from moetier.tiers.cpu_tier import CpuExpertTier, CpuGroup, CpuJob
from moetier.tiers.expert_cache import ExpertCache
from moetier.tiers.experts import ExpertStore
from moetier.tiers.route_costs import RouteCosts


def calibrate_routes(
    store: ExpertStore,
    cache: ExpertCache,
    cpu_tier: CpuExpertTier,
    device: torch.device,
    layer: int,
    experts: int = 4,
    tokens: tuple[int, int] = (1, 16),
    repeats: int = 3,
) -> RouteCosts:
    """Time ``experts`` of ``layer`` on each route at two token counts and fit ``fixed + per_token * n``."""
    ids = list(range(min(experts, store.layout.num_experts)))
    samples = {}
    for n in tokens:
        x_dev = torch.randn(n, store.layout.hidden_size, device=device).to(store.dtype)
        x_host = x_dev.cpu()
        gates, rows = torch.ones(n), torch.arange(n)
        _time_cpu(store, cpu_tier, layer, ids[:1], x_host, rows, gates)  # warm-up
        _time_copy(store, cache, layer, ids[:1], x_dev)
        samples[n] = (
            min(_time_cpu(store, cpu_tier, layer, ids, x_host, rows, gates) for _ in range(repeats)),
            min(_time_copy(store, cache, layer, ids, x_dev) for _ in range(repeats)),
        )
    (cpu1, copy1), (cpu2, copy2) = samples[tokens[0]], samples[tokens[1]]
    span = tokens[1] - tokens[0]
    cpu_slope, copy_slope = max(0.0, (cpu2 - cpu1) / span), max(0.0, (copy2 - copy1) / span)
    return RouteCosts(
        cpu_fixed=max(cpu1 - cpu_slope * tokens[0], 1e-9),
        cpu_per_token=cpu_slope,
        copy_fixed=max(copy1 - copy_slope * tokens[0], 1e-9),
        copy_per_token=copy_slope,
    )


def _time_cpu(
    store: ExpertStore,
    cpu_tier: CpuExpertTier,
    layer: int,
    ids: list[int],
    x_host: torch.Tensor,
    rows: torch.Tensor,
    gates: torch.Tensor,
) -> float:
    """Seconds per expert of one CPU-tier job over ``ids``."""
    groups = [CpuGroup(store.expert(layer, e), rows, gates) for e in ids]
    start = time.perf_counter()
    cpu_tier.submit(CpuJob(hidden=x_host, groups=groups)).result()
    return (time.perf_counter() - start) / len(ids)


def _time_copy(store: ExpertStore, cache: ExpertCache, layer: int, ids: list[int], x_dev: torch.Tensor) -> float:
    """Seconds per expert to copy each of ``ids`` into a staging slot and compute it there, as serving does."""
    stream = torch.cuda.current_stream(x_dev.device)
    torch.cuda.synchronize(x_dev.device)
    n = x_dev.shape[0]
    out = torch.zeros(x_dev.shape, dtype=torch.float32, device=x_dev.device)
    rows_host, gates = torch.arange(n), torch.ones(n, dtype=x_dev.dtype, device=x_dev.device)
    rows = rows_host.to(x_dev.device)
    start = time.perf_counter()
    for e in ids:
        slot = cache.staging_slot()
        cache.fill(slot, store.expert(layer, e).block)
        cache.wait_ready(slot, stream)
        # The kernels the dispatcher runs on a copied expert (grouped for decode-sized groups): per-expert
        # GEMMs would price fp4 experts' dequantisation, ~3x the copy, and starve the copy route.
        run_experts(out, x_dev, rows, gates, [(slot.weights, 0, n)], store.layout.swiglu_limit, rows_host, 1)
        cache.mark_released([slot], stream)
    torch.cuda.synchronize(x_dev.device)
    return (time.perf_counter() - start) / len(ids)
