"""Repeat Triton launches go to the compiled kernel with the JIT's argument order (moetier.kernels.launch)."""

import pytest
import torch

from moetier.kernels import launch
from moetier.kernels.launch import KernelLaunches


def _kernel_fn(x_ptr, out_ptr, n, scale, WIDTH, EXTRA=3):  # noqa: N803 - Triton's constant naming
    pass


class FakeCompiled:
    """What ``kernel[grid](...)`` returns on CUDA: a launcher and its metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


class FakeKernel:
    """A JIT function: ``arg_names``, ``fn``, and ``kernel[grid](*args, **kwargs)`` that "compiles" per call."""

    def __init__(self, returns_compiled: bool = True) -> None:
        self.fn, self.arg_names = _kernel_fn, ["x_ptr", "out_ptr", "n", "scale", "WIDTH", "EXTRA"]
        self.jit_calls: list[tuple] = []
        self.compiled: list[FakeCompiled] = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            if not self.returns_compiled:
                return None  # the interpreter
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]

        return run


class FakeDriver:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.driver.active
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(launch, "driver", FakeDriver)
    monkeypatch.setattr(launch, "_hooks", lambda: (None, None))


def test_a_repeat_launch_runs_the_compiled_kernel_with_every_argument_in_order(fake_driver):
    kernel, launches = FakeKernel(), KernelLaunches()
    x, out = torch.zeros(8), torch.zeros(8)
    launches.launch(kernel, (4, 2), x, out, 8, scale=0.5, WIDTH=16)
    assert len(kernel.jit_calls) == 1 and kernel.jit_calls[0] == ((4, 2), (x, out, 8), {"scale": 0.5, "WIDTH": 16})
    launches.launch(kernel, (7, 1), x, out, 8, scale=0.5, WIDTH=16)
    assert len(kernel.jit_calls) == 1  # no second trip through the JIT
    (call,) = kernel.compiled[0].calls
    # grid (padded to three), the current stream, the binary and metadata, no hooks, then every parameter
    # in the kernel's order, the default included.
    assert call[:9] == (7, 1, 1, 1234, "fn", "meta", None, None, None)
    assert call[9:] == (x, out, 8, 0.5, 16, 3)


def test_anything_the_jit_specialises_on_takes_the_jit_again(fake_driver):
    kernel, launches = FakeKernel(), KernelLaunches()
    block = torch.zeros(16)
    x, out = block[:8], torch.zeros(8)
    launches.launch(kernel, (1,), x, out, 8, 0.5, 16)
    launches.launch(kernel, (1,), block[1:9], out, 8, 0.5, 16)  # 4 bytes off: not 16-byte aligned
    launches.launch(kernel, (1,), x, out, 16, 0.5, 16)  # another int value
    launches.launch(kernel, (1,), x.double(), out, 8, 0.5, 16)  # another dtype
    launches.launch(kernel, (1,), x, out, 8, 0.5, 32)  # another constant
    assert len(kernel.jit_calls) == 5
    launches.launch(kernel, (2,), block[1:9], out, 8, 0.5, 16)  # the unaligned key again: its compiled kernel
    assert len(kernel.jit_calls) == 5 and len(kernel.compiled[1].calls) == 1


def test_without_a_compiled_kernel_every_launch_goes_through_the_jit(fake_driver):
    kernel, launches = FakeKernel(returns_compiled=False), KernelLaunches()
    x = torch.zeros(4)
    for _ in range(3):
        launches.launch(kernel, (1,), x, x, 4, 1.0, 8)
    assert len(kernel.jit_calls) == 3


def test_bad_arguments_are_refused_before_any_launch(fake_driver):
    kernel, launches = FakeKernel(), KernelLaunches()
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="unexpected or repeated"):
        launches.launch(kernel, (1,), x, x, 4, 1.0, WIDTH=8, num_warps=4)
    with pytest.raises(TypeError, match="missing"):
        launches.launch(kernel, (1,), x, x, 4)
    with pytest.raises(TypeError, match="unexpected or repeated"):
        launches.launch(kernel, (1,), x, x, 4, 1.0, 8, WIDTH=8)
    assert kernel.jit_calls == []


def test_a_failing_direct_launch_falls_back_to_the_jit_for_good(fake_driver, caplog):
    kernel, launches = FakeKernel(), KernelLaunches()
    x = torch.zeros(4)
    launches.launch(kernel, (1,), x, x, 4, 1.0, 8)

    def broken(*args):
        raise TypeError("launcher signature changed")

    kernel.compiled[0].run = broken
    launches.launch(kernel, (1,), x, x, 4, 1.0, 8)  # the shortcut fails: this call goes through the JIT
    assert len(kernel.jit_calls) == 2 and not launches.enabled and "through the JIT" in caplog.text
    launches.launch(kernel, (1,), x, x, 4, 1.0, 8)
    assert len(kernel.jit_calls) == 3


def test_switched_off_every_launch_goes_through_the_jit(fake_driver, monkeypatch):
    monkeypatch.setenv("MOETIER_TRITON_FAST_LAUNCH", "0")
    kernel, launches = FakeKernel(), KernelLaunches()
    x = torch.zeros(4)
    for _ in range(2):
        launches.launch(kernel, (1,), x, x, 4, 1.0, 8)
    assert len(kernel.jit_calls) == 2 and not launches._compiled
