"""Let a CUDA stream, not the host thread, wait for the CPU tier.

A decode step is launch-bound: the host thread that waits for the CPU tier's partial sums cannot
launch the next layer meanwhile, while the copy path's host thread runs ahead and hides the copies
under launch time. :class:`HostFlag` is a pinned 32-bit counter the GPU can wait on with the
driver's stream memory operations (``cuStreamWaitValue32``): the dispatcher enqueues "wait until
the flag reaches n", then the copy of the partial sums and their addition, and goes on launching;
the CPU worker bumps the flag to n when the sums are in the pinned buffer (also when it failed, so
the GPU never waits forever; the failure surfaces at the next MoE layer).

Availability is probed once (driver symbol, device attribute, mapped pinned memory); where any of
it is missing :meth:`HostFlag.create` returns None and the host waits as before. On the lent H200
(driver 580, V2 entry points) ``tests/test_gpu_wait.py`` passes, and in five decode benchmarks the
GPU wait beat the host wait in 8 of 10 (stream count, run) pairs (``results/README.md``), so it is
on by default (``TieredConfig.gpu_waits_for_cpu``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_CAN_USE_STREAM_MEM_OPS = 92  # CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a system-scope fence orders the stream's earlier writes first
_driver: ctypes.CDLL | None = None
_probe_lock = threading.Lock()
_probed: dict[int, bool] = {}


def _load_driver() -> ctypes.CDLL | None:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
    return _driver


def _symbol(lib: ctypes.CDLL, *names: str):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def _supported(device: torch.device) -> bool:
    """Whether ``device`` can run stream wait-value operations (probed once per device).

    The V2 entry points (``cuStreamWaitValue32_v2``, CUDA 11.7+ drivers) are available on every
    platform; older drivers need the V1 API enabled in the kernel module, which the device attribute
    reports (on the lent H200 the V1 attribute reads 0 while the V2 symbol exists).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _probe_lock:
        if index not in _probed:
            lib = _load_driver()
            ok = False
            if lib is not None:
                if getattr(lib, "cuStreamWaitValue32_v2", None) is not None:
                    ok = True
                else:
                    value = ctypes.c_int(0)
                    status = lib.cuDeviceGetAttribute(ctypes.byref(value), _CAN_USE_STREAM_MEM_OPS, index)
                    ok = status == 0 and bool(value.value)
            _probed[index] = ok
            if not ok:
                log.info("no CUDA stream memory operations on device %d: the host waits for the CPU tier", index)
        return _probed[index]


class HostFlag:
    """A pinned int32 counter (or ``count`` of them, ``index`` picks one): :meth:`wait_on` makes a stream wait for
    a value, :meth:`release` sets it from the host, :meth:`write_on` from a stream (after the stream's earlier
    work, its copies' bytes visible first). Both stream operations can be captured into CUDA graphs.

    The split route's values only grow (:meth:`next_value` hands out the next one), so a stale wait never blocks.
    """

    def __init__(self, tensor: torch.Tensor, device_pointer: int, wait_fn, write_fn=None) -> None:
        self.tensor = tensor
        self._cell = tensor.numpy()  # written through numpy: no autograd/inference-mode rules in the worker
        self._device_pointer = device_pointer
        self._wait_fn = wait_fn
        self._write_fn = write_fn
        self._issued = 0

    @classmethod
    def create(cls, device: torch.device, count: int = 1) -> HostFlag | None:
        """``count`` words for ``device``'s streams, or None where the driver cannot do it."""
        if device.type != "cuda" or not _supported(device):
            return None
        lib = _load_driver()
        wait_fn = _symbol(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        get_pointer = _symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        if wait_fn is None or get_pointer is None:
            return None
        write_fn = _symbol(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        for fn in (wait_fn, write_fn):
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
        tensor = torch.zeros(count, dtype=torch.int32, pin_memory=True)
        pointer = ctypes.c_uint64(0)
        if get_pointer(ctypes.byref(pointer), ctypes.c_void_p(tensor.data_ptr()), 0) != 0:
            return None
        return cls(tensor, pointer.value, wait_fn, write_fn)

    def next_value(self) -> int:
        self._issued += 1
        return self._issued

    def wait_on(self, stream: torch.cuda.Stream, value: int, index: int = 0) -> bool:
        """Enqueue on ``stream``: wait until the word is >= ``value``. False if the driver refused."""
        pointer = self._device_pointer + 4 * index
        status = self._wait_fn(ctypes.c_void_p(stream.cuda_stream), pointer, value, _WAIT_GEQ)
        return status == 0

    @property
    def writable(self) -> bool:
        """Whether :meth:`write_on` can enqueue (the driver has the stream write)."""
        return self._write_fn is not None

    def write_on(self, stream: torch.cuda.Stream, value: int, index: int = 0) -> bool:
        """Enqueue on ``stream``: store ``value`` once the stream's earlier work is done. False if refused."""
        if self._write_fn is None:
            return False
        pointer = self._device_pointer + 4 * index
        status = self._write_fn(ctypes.c_void_p(stream.cuda_stream), pointer, value, _WRITE_DEFAULT)
        return status == 0

    def release(self, value: int) -> None:
        """Set the flag to ``value`` (any host thread); streams waiting for it go on."""
        self._cell[0] = value

    def releaser(self, value: int) -> FlagRelease:
        """A callable that sets the flag to ``value``, which also names the flag's host address (for C code)."""
        return FlagRelease(self, value)


@dataclass(frozen=True)
class FlagRelease:
    """``release()`` of a :class:`HostFlag` to ``value``, as a callable; :attr:`address` is the pinned int32 that
    code outside Python (the CPU tier's native worker) stores ``value`` into instead of calling it."""

    flag: HostFlag
    value: int

    @property
    def address(self) -> int:
        return self.flag.tensor.data_ptr()

    def __call__(self) -> None:
        self.flag.release(self.value)
