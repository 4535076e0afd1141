"""Helpers for kernel checks run under Triton's interpreter (imported by the check scripts of ``run_kernel_check``)."""

from __future__ import annotations

import os

import numpy as np
import torch


def nearest_bf16() -> bool:
    """Make the interpreter round float32 to bf16 to nearest even, as CUDA does (it truncates), so a kernel's bf16
    results can be compared as tightly as on the device; False where this interpreter has no such hook (a changed
    Triton): its truncation stays, and the caller's bounds must allow it."""
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False

    def nearest(values, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(values.shape)
        return convert(values, src, dst, rounding)

    interpreter._convert_float = nearest
    return True


def widened_bf16_dots() -> bool:
    """Make the interpreter's ``tl.dot`` take bf16 operands as their float32 values (Triton 3.6's interpreter
    multiplies a bf16 tensor's raw 16-bit patterns: garbage), so tensor-core kernels can be checked on the CPU; a
    bf16 product is exact in float32, as on the device. False where this interpreter has no such builder method."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is None:
        return False

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(wide, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot
    return True


def quicker_device_calls() -> bool:
    """Make the interpreter skip re-patching ``triton.language`` at each call of a ``@triton.jit`` helper inside a
    kernel: Triton 3.6's interpreter patches every builtin again at each such call, in every program, and never
    undoes it (a fifth to a half of the kernel checks' time, measured), though the launch patched the same modules
    with the same builder already and undoes that at its end. A helper whose modules the launch did not patch
    (Triton's own, through ``triton.language.core``) is patched at its first call in the launch, as before. Only the
    time changes. False where this interpreter has no such parts (a changed Triton): it runs as it is."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None:
        return False
    if getattr(patch, "quicker", False):
        return True
    launch = threading.local()  # this thread's launch: whether its own patch is next, the modules patched so far

    def langs_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        patched = getattr(launch, "langs", None)
        if getattr(launch, "pending", False):  # the launch's own patch (its scope undone at its end)
            launch.pending, launch.langs = False, langs_of(fn)
        elif patched is not None:  # a helper called inside the launch
            langs = langs_of(fn)
            if langs <= patched:
                return None  # its modules are patched already (the interpreter drops a helper's scope)
            launch.langs = patched | langs
        return patch(fn)

    patch_lang.quicker = True
    run = executor.__call__

    def call(self, *args, **kwargs):
        launch.pending, launch.langs = True, None
        try:
            return run(self, *args, **kwargs)
        finally:
            launch.pending, launch.langs = False, None

    interpreter._patch_lang = patch_lang
    executor.__call__ = call
    return True


def quicker_prelude() -> str:
    """Source that a check script run in a fresh interpreter under ``TRITON_INTERPRET`` takes first: this directory on
    its path, then :func:`quicker_device_calls`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return f"import sys\nsys.path.insert(0, {here!r})\nimport interpreted\ninterpreted.quicker_device_calls()\n"
