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
