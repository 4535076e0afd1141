"""Where the CPU tier's threads run: off the core of the thread that launches the device's work.

Decode of a few streams is bound by one host thread: it launches every kernel, copy and graph of a step,
and the GPU idles while it is late. The CPU tier's job runs meanwhile on ``cores - 2`` threads by default;
left to the scheduler, they share cores (hyper-thread siblings) with that thread, which then runs its
Python at a fraction of its speed (on the lent H200 host, a tiered decode step's attention launches took
1.5x and its graph replays 2.3x their host time in the all-resident run, ``results/README.md``).
:func:`tier_cpus` keeps the first core's hardware threads out of the tier's set, so the scheduler has a
whole core for the launching thread; the tier's threads inherit the set from its worker
(:meth:`moetier.tiers.cpu_tier.CpuExpertTier`), as threads a thread creates inherit its affinity.

``MOETIER_CPU_TIER_PIN=0`` turns it off (read when a tier starts); hosts without ``sched_setaffinity``,
or with fewer than two CPUs left over, are never pinned.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_SYSFS_CPUS = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """Linux's CPU list format (``"0,8"``, ``"0-3,8-11"``) -> the CPUs it names."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def core_siblings(cpu: int, sysfs: Path = _SYSFS_CPUS) -> set[int]:
    """The hardware threads sharing ``cpu``'s core (``cpu`` itself when the topology cannot be read)."""
    try:
        text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        return parse_cpu_list(text) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def pin_enabled() -> bool:
    """``MOETIER_CPU_TIER_PIN``: ``0`` leaves the tier's threads to the scheduler; anything else pins them."""
    return os.environ.get("MOETIER_CPU_TIER_PIN", "1") != "0"


def pin_launcher_enabled() -> bool:
    """``MOETIER_CPU_TIER_PIN=launcher``: also pin the thread that dispatches (launches the device's work) to
    the first core's hardware threads, the ones the tier leaves out."""
    return os.environ.get("MOETIER_CPU_TIER_PIN") == "launcher"


_pinned_launchers: set[int] = set()


def pin_launcher(tier: set[int] | None) -> None:
    """Pin the calling thread to the CPUs this process may use outside ``tier`` (once per thread; nothing
    when ``tier`` is None or nothing is left)."""
    import threading

    ident = threading.get_ident()
    if tier is None or ident in _pinned_launchers or not hasattr(os, "sched_setaffinity"):
        return
    _pinned_launchers.add(ident)
    rest = os.sched_getaffinity(0) - tier
    if rest:
        try:
            os.sched_setaffinity(0, rest)
        except OSError as exc:
            log.info("could not pin the launching thread (%s)", exc)


def tier_cpus(allowed: set[int] | None = None, sysfs: Path = _SYSFS_CPUS) -> set[int] | None:
    """The CPUs for the tier's threads: ``allowed`` (default: this process's) less the first core's hardware
    threads; None when affinity cannot be set here or fewer than two CPUs would be left."""
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        allowed = os.sched_getaffinity(0)
    reserved = core_siblings(min(allowed), sysfs) if allowed else set()
    rest = set(allowed) - reserved
    return rest if len(rest) >= 2 else None


def start_worker(threads: int, cpus: set[int] | None) -> None:
    """A worker thread's start: restrict it to ``cpus`` (threads it creates inherit them), then set torch's
    intra-op thread count (per calling thread)."""
    import torch

    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread, on Linux
        except OSError as exc:  # a container may refuse: run unpinned
            log.info("cpu tier: could not pin its threads (%s)", exc)
    torch.set_num_threads(threads)
