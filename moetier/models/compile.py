"""Fusing long chains of tiny tensor ops on CUDA with ``torch.compile``, eager everywhere else.

At decode a MoE model runs a handful of tokens per step, so the step time is set by how many
kernels are launched, not by arithmetic: DeepSeek-V4's mHC Sinkhorn projection alone is ~150
tiny ops per sublayer. Pure tensor functions (no cache writes, no host syncs) wrapped with
:func:`fused_on_cuda` run as a few compiled kernels on CUDA. On CPU, when ``MOETIER_COMPILE=0``,
or if compilation fails, the eager function runs: same math, more launches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)


def compile_enabled() -> bool:
    return os.environ.get("MOETIER_COMPILE", "1") != "0"


def fused_on_cuda(fn: F) -> F:
    """``fn`` compiled (dynamic shapes) when its first tensor argument is on CUDA; eager otherwise."""
    state: dict[str, Callable | None] = {"compiled": None}

    def run(*args, **kwargs):
        first = args[0]
        if not (compile_enabled() and isinstance(first, torch.Tensor) and first.is_cuda):
            return fn(*args, **kwargs)
        if state["compiled"] is None:
            state["compiled"] = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return state["compiled"](*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must never take serving down
            log.warning("torch.compile of %s failed (%s); running it eagerly from now on", fn.__name__, exc)
            state["compiled"] = fn
            return fn(*args, **kwargs)

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    run.eager = fn  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]
