"""moetier.kernels.host_sums: the fed CPU tier's sums added from pinned host memory by one kernel.

Run by Triton's interpreter on CPU (in a subprocess: the interpreter is chosen before Triton is imported) and on
CUDA in the GPU suite, where the sums lie in pinned memory, are rewritten between adds at the same address (as
the worker rewrites them every layer) and the adds run inside a CUDA graph too.
"""

import pytest
from reference import run_kernel_check

from moetier.errors import ConfigError
from moetier.kernels.host_sums import fed_sums_mode

_CHECK = """
import json, sys, torch
import moetier.kernels.host_sums as k
device = sys.argv[1]
cuda = device == "cuda"
results = []
for tokens, hidden in ((1, 4096), (3, 1000), (4, 2500)):
    g = torch.Generator().manual_seed(tokens)
    sums = torch.empty(tokens, hidden, pin_memory=cuda)
    out = torch.randn(tokens, hidden, generator=g).to(device)
    expect = out.clone()
    usable = k.host_sums_usable(out, sums)
    for round in range(3):  # the same buffer rewritten between adds: each add must read the new values
        sums.copy_(torch.randn(tokens, hidden, generator=g))
        expect += sums.to(device)
        k.add_host_sums(out, sums)
    if cuda:  # replayed from a graph, the buffer rewritten by the host between replays
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            k.add_host_sums(out, sums)  # a warm-up outside the capture
        torch.cuda.synchronize()
        expect += sums.to(device)
        with torch.cuda.graph(graph):
            k.add_host_sums(out, sums)
        for round in range(3):
            torch.cuda.synchronize()
            sums.copy_(torch.randn(tokens, hidden, generator=g))
            expect += sums.to(device)
            graph.replay()
        torch.cuda.synchronize()
    results.append({"shape": [tokens, hidden], "usable": usable, "max_err": (out - expect).abs().max().item()})
wrong = [k.host_sums_usable(torch.zeros(2, 3, device=device), torch.zeros(3, 2, pin_memory=cuda)),
         k.host_sums_usable(torch.zeros(2, 3, device=device), torch.zeros(2, 3, dtype=torch.float64, pin_memory=cuda)),
         k.host_sums_usable(torch.zeros(2, 6, device=device)[:, ::2], torch.zeros(2, 3, pin_memory=cuda))]
if cuda:
    wrong.append(k.host_sums_usable(torch.zeros(2, 3, device=device), torch.zeros(2, 3)))  # pageable: not addressable
ready = k.host_sums_ready(torch.device(device))  # CUDA only: off it the fed share copies and adds
print(json.dumps([{"results": results, "wrong": wrong, "ready": ready}]))
"""


def _check(device: str) -> None:
    (report,) = run_kernel_check(_CHECK, device)
    assert all(r["usable"] for r in report["results"]), report
    assert all(r["max_err"] < 1e-5 for r in report["results"]), report  # float32 adds, the same order
    assert not any(report["wrong"]), report
    assert report["ready"] is (device == "cuda"), report


def test_host_sums_add_interpreted():
    pytest.importorskip("triton")
    _check("cpu")


@pytest.mark.gpu
def test_host_sums_add_on_cuda_from_pinned_memory_and_a_graph():
    _check("cuda")


def test_the_sums_mode_is_read_and_refused_when_unknown(monkeypatch):
    monkeypatch.delenv("MOETIER_FED_SUMS", raising=False)
    assert fed_sums_mode() == "kernel"
    monkeypatch.setenv("MOETIER_FED_SUMS", " Copy ")
    assert fed_sums_mode() == "copy"
    monkeypatch.setenv("MOETIER_FED_SUMS", "dma")
    with pytest.raises(ConfigError, match="MOETIER_FED_SUMS='dma': use one of kernel, copy"):
        fed_sums_mode()
