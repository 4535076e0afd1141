"""Helpers for kernel checks run under Triton's interpreter (imported by the check scripts of ``run_kernel_check``)."""

from __future__ import annotations

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
    """Make the interpreter skip re-patching ``triton.language`` at every call of a ``@triton.jit`` helper inside
    a kernel (Triton 3.6's interpreter patches every builtin again at each such call, a program at a time, and never
    undoes it: ~20% of an interpreted kernel's time): the launch patched the same modules already, with the same
    builder, and undoes that at its end. Only the time changes. False where this interpreter has no such parts (a
    changed Triton): it runs as it is."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or getattr(patch, "quicker", False):
        return patch is not None and executor is not None
    launch = {"pending": False, "langs": None}

    def langs_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        if launch["pending"]:  # the launch's own patch, undone at its end
            launch["pending"] = False
            launch["langs"] = langs_of(fn)
            return patch(fn)
        langs = langs_of(fn)
        if launch["langs"] is None:
            return patch(fn)
        if langs <= launch["langs"]:
            return None  # a helper called inside the launch: its modules are patched already
        launch["langs"] |= langs  # patched from here to the launch's end, as the interpreter leaves them
        return patch(fn)

    patch_lang.quicker = True
    run = executor.__call__

    def call(self, *args, **kwargs):
        launch["pending"], launch["langs"] = True, None
        try:
            return run(self, *args, **kwargs)
        finally:
            launch["pending"], launch["langs"] = False, None

    interpreter._patch_lang = patch_lang
    executor.__call__ = call
    return True
