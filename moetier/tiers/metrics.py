"""Counters of the tiered expert path: cache hits and misses, CPU-tier time, bytes over the copy path.

Plain integers and floats updated by the dispatcher's own thread (the CPU worker reports its time
with its result), read through :meth:`TierMetrics.snapshot` by the server's ``/metrics`` and the
benchmark receipts. Nothing here synchronises a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields


@dataclass
class LayerCounters:
    """What happened in one MoE layer since the last reset.

    ``uses_*`` count (token, expert) pairs, ``experts_*`` count distinct experts per dispatch call;
    ``cpu_pairs`` / ``copy_pairs`` split the missed pairs by the route that computed them. Bytes over
    PCIe: ``copy_bytes`` for experts copied in to compute a miss (into a staging slot, or straight
    into the cache slot that admits it), ``admit_bytes`` for copies that only fill the cache (a
    CPU-computed miss being admitted, warm-up). ``prefetch_bytes`` (part of ``copy_bytes``) were
    copied ahead by the previous MoE layer's call (a streaming call's guess, or a decode call's hint);
    ``prefetch_used`` / ``prefetch_wasted`` count the prefetched experts this layer computed / never needed.
    The mapped route's reads ahead (:mod:`moetier.tiers.mapped_ahead`) are timed on the device: ``prefetch_timed``
    of them took ``prefetch_copy_seconds`` from their launch to their end, and the compute stream waited
    ``prefetch_wait_seconds`` for them at the join before the call (work held back beside the copy, e.g. kernels
    that found no free SM, is not in it).
    Hinted decode calls (``ExpertDispatcher.hint``): ``hint_experts`` distinct experts predicted,
    ``hint_correct`` of them used, ``hint_actual`` distinct experts those calls used. The mapped route
    (:mod:`moetier.tiers.mapped`) counts from the device's tallies, so its ``calls`` are steps and a window
    of several steps counts each expert once in ``experts_*``; ``mapped_bytes`` are its reads over PCIe.
    """

    calls: int = 0
    uses_hit: int = 0
    uses_miss: int = 0
    experts_hit: int = 0
    experts_miss: int = 0
    cpu_pairs: int = 0
    copy_pairs: int = 0
    cpu_seconds: float = 0.0
    cpu_wait_seconds: float = 0.0
    copy_bytes: int = 0
    admit_bytes: int = 0
    admissions: int = 0
    evictions: int = 0
    prefetch_bytes: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_timed: int = 0  # the mapped route's reads ahead timed on the device: their copies and the call's wait
    prefetch_copy_seconds: float = 0.0
    prefetch_wait_seconds: float = 0.0
    cpu_jobs_gpu_waited: int = 0  # CPU-tier jobs the compute stream waited for (the host went on)
    # Native CPU-tier jobs with marks (cpu_worker.MARK_NAMES): their team's start (allocated -> the last thread that
    # joined) and the threads that joined, summed: a host whose helpers come late shows here (a VM's vCPUs, say).
    cpu_jobs_marked: int = 0
    cpu_team_start_seconds: float = 0.0
    cpu_threads_joined: int = 0
    # The fed CPU tier's timed calls (mapped route): the device's share, and how long the device then went on until
    # the CPU's sums were added (the CPU's job outlasting it, its start and the hand-off of its sums).
    fed_timed: int = 0
    fed_device_seconds: float = 0.0
    fed_late_seconds: float = 0.0
    mapped_pairs: int = 0  # missed pairs the device's kernels computed from the home copy (mapped route)
    mapped_bytes: int = 0  # what their kernels read over PCIe (each pair reads its expert's block)
    hint_experts: int = 0
    hint_correct: int = 0
    hint_actual: int = 0
    half_calls: int = 0  # calls by a half of a decode step run as two halves (ExpertDispatcher.decode_halves)

    def count_cpu_marks(self, marks: dict[str, float]) -> None:
        """One native job's marks (empty for a Python-worker job, or one that failed before its kernel ran)."""
        if not marks or marks.get("joined", 0) < 1:
            return
        self.cpu_jobs_marked += 1
        self.cpu_team_start_seconds += max(0.0, marks["entered_last"] - marks["allocated"])
        self.cpu_threads_joined += int(marks["joined"])

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hit_rate"] = _ratio(self.uses_hit, self.uses_hit + self.uses_miss)
        out["hint_precision"] = _ratio(self.hint_correct, self.hint_experts)
        out["hint_recall"] = _ratio(self.hint_correct, self.hint_actual)
        return out


class TierMetrics:
    """Per-layer counters plus per-(layer, expert) routing counts.

    ``tokens`` counts tokens once per forward (at the first MoE layer), so ``misses_per_token`` is
    the number of missed (token, expert) pairs summed over all layers, per token.
    ``routing_counts()`` is the input the static cache policy reads (see ``policies.save_routing_stats``).
    """

    def __init__(self) -> None:
        # Measured / start-up cost of each miss route (tiers.route_costs.RouteAdapter): state, not a
        # counter, so reset() keeps it. The dispatcher shares its adapter's dict here.
        self.route_cost_scales: dict[str, float] = {}
        # The decode split's choice per batch size (tiers.split_choice.SplitChooser.report), state as well.
        self.split_choices: Callable[[], dict[int, dict[str, float | str]]] = dict
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.layers: dict[int, LayerCounters] = {}
        self._routing: dict[int, dict[int, int]] = {}

    def layer(self, layer: int) -> LayerCounters:
        counters = self.layers.get(layer)
        if counters is None:
            counters = self.layers[layer] = LayerCounters()
        return counters

    def record_routing(self, layer: int, experts: list[int], counts: list[int]) -> None:
        table = self._routing.setdefault(layer, {})
        for expert, count in zip(experts, counts, strict=True):
            table[expert] = table.get(expert, 0) + count

    def routing_counts(self) -> dict[int, dict[int, int]]:
        """``{layer: {expert: tokens routed}}`` since the last reset."""
        return {layer: dict(table) for layer, table in self._routing.items()}

    def total(self) -> LayerCounters:
        out = LayerCounters()
        for counters in self.layers.values():
            for f in fields(LayerCounters):
                setattr(out, f.name, getattr(out, f.name) + getattr(counters, f.name))
        return out

    def snapshot(self) -> dict:
        """A JSON-ready summary: overall rates, totals, and every layer's counters."""
        total = self.total()
        return {
            "tokens": self.tokens,
            "hit_rate": _ratio(total.uses_hit, total.uses_hit + total.uses_miss),
            "expert_hit_rate": _ratio(total.experts_hit, total.experts_hit + total.experts_miss),
            "misses_per_token": _ratio(total.uses_miss, self.tokens),
            "cpu_seconds": total.cpu_seconds,
            "cpu_wait_seconds": total.cpu_wait_seconds,
            "copy_bytes": total.copy_bytes,
            "admit_bytes": total.admit_bytes,
            "mapped_bytes": total.mapped_bytes,
            "totals": total.as_dict(),
            "per_layer": {str(layer): c.as_dict() for layer, c in sorted(self.layers.items())},
        }


def _ratio(num: float, den: float) -> float:
    return float(num) / den if den else 0.0
