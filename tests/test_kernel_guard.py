"""moetier.kernels.guard: a kernel that fails is noted once and its module runs the reference from then on."""

from __future__ import annotations

from moetier.kernels.guard import kernel_or_reference


def test_a_failing_kernel_is_noted_and_the_reference_runs_from_then_on(caplog):
    broken: list[str] = []
    calls = []

    def kernel():
        calls.append("kernel")
        raise RuntimeError("no such PTX")

    assert kernel_or_reference(broken, "test kernel", True, kernel, lambda: "reference") == "reference"
    assert broken == ["no such PTX"] and "test kernel" in caplog.text
    assert kernel_or_reference(broken, "test kernel", True, kernel, lambda: "again") == "again"
    assert calls == ["kernel"]  # not tried a second time
    assert kernel_or_reference([], "k", True, lambda: "kernel", lambda: "reference") == "kernel"
    assert kernel_or_reference([], "k", False, lambda: "kernel", lambda: "reference") == "reference"
