"""Repeat launches of a Triton kernel straight to its compiled binary, past the JIT's per-call binding.

``kernel[grid](*args, **kwargs)`` binds and specialises every argument on each call (Triton's
``JITFunction.run``: the type and 16-byte alignment of each tensor, the value class of each int, the
constants, a cache key of them all) before it launches. An expert call of decode launches three kernels
of ~20 arguments each per MoE layer; the binding was about half of that call's host time, measured in
``moetier bench gpu-experts``. :class:`KernelLaunches` keeps the compiled kernel the JIT returned under a
key at least as fine as the JIT's own — each tensor's dtype, device and whether its address is 16-byte
aligned, every other argument's exact value (Triton specialises an int only on being 1 or a multiple
of 16, so equal keys always mean the same compiled kernel) — and launches later calls of that key with
the compiled kernel's own launcher, on the current stream, with the launch hooks the JIT would pass.

Where the JIT returns no compiled kernel (the interpreter, ``TRITON_INTERPRET=1``), every call goes
through the JIT; so does every call after a direct launch failed (logged once: a Triton whose compiled
kernels launch differently), or with ``MOETIER_TRITON_FAST_LAUNCH=0`` (read when the launcher is made) or
``enabled`` set False.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

try:
    import triton
    from triton.runtime.driver import driver
except ImportError:  # pragma: no cover - depends on the installation
    triton = driver = None

log = logging.getLogger(__name__)


def _hooks() -> tuple[Any, Any]:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    return getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None)


def _arg_key(value: Any) -> Any:
    """What of one argument decides the compiled kernel (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.data_ptr() % 16 == 0)
    return (type(value), value)


class KernelLaunches:
    """Launch Triton kernels by keyword-and-position arguments, through the JIT the first time per key.

    Contract: ``launch(kernel, grid, *args, **kwargs)`` runs ``kernel[grid](*args, **kwargs)``; the
    arguments must be what the JIT accepts (tensors, ints, floats, bools, None, constants by keyword).
    """

    def __init__(self) -> None:
        self.enabled = os.environ.get("MOETIER_TRITON_FAST_LAUNCH") != "0"
        self._compiled: dict[tuple, Any] = {}
        self._params: dict[Any, tuple[tuple[str, ...], dict[str, Any]]] = {}

    def launch(self, kernel: Any, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            kernel[tuple(grid)](*args, **kwargs)
            return
        values = self._ordered(kernel, args, kwargs)
        key = (kernel, len(grid), *map(_arg_key, values))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = kernel[tuple(grid)](*args, **kwargs)
            if getattr(compiled, "run", None) is not None and hasattr(compiled, "packed_metadata"):
                self._compiled[key] = compiled
            return
        try:
            self._run(compiled, grid, values)
        except Exception as exc:  # noqa: BLE001 - the JIT still launches it; only the shortcut is given up
            log.warning("direct Triton launches failed (%s); launching through the JIT from now on", exc)
            self.enabled = False
            self._compiled.clear()
            kernel[tuple(grid)](*args, **kwargs)

    @staticmethod
    def _run(compiled: Any, grid: Sequence[int], values: list[Any]) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        enter, exit_ = _hooks()
        metadata = None if enter is None else compiled.launch_metadata(grid, stream, *values)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter, exit_,
            *values,
        )  # fmt: skip

    def _ordered(self, kernel: Any, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """Every parameter's value in the kernel's order (defaults where not given), as the JIT binds them."""
        params = self._params.get(kernel)
        if params is None:
            names = tuple(kernel.arg_names)
            parameters = inspect.signature(kernel.fn).parameters.items()
            defaults = {n: p.default for n, p in parameters if p.default is not inspect.Parameter.empty}
            params = self._params[kernel] = (names, defaults)
        names, defaults = params
        if len(args) > len(names):
            raise TypeError(f"{len(args)} positional arguments for a kernel of {len(names)} parameters")
        given = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name in given or name not in names:
                raise TypeError(f"unexpected or repeated kernel argument {name!r}")
            given[name] = value
        missing = [n for n in names if n not in given and n not in defaults]
        if missing:
            raise TypeError(f"kernel arguments missing: {missing}")
        return [given[n] if n in given else defaults[n] for n in names]
