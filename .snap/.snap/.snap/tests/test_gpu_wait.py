"""The compute stream, not the host, waits for the CPU tier (CUDA stream memory operations)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from reference import relative_error
from test_tiers_fidelity import _random_store, _routing

from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator
from moetier.tiers.gpu_wait import HostFlag
from moetier.tiers.host_store import HostExpertArena
from moetier.tiers.tiered_dispatcher import TieredDispatcher


def test_no_flag_off_cuda():
    assert HostFlag.create(torch.device("cpu")) is None


@pytest.mark.gpu
def test_stream_waits_for_the_host_flag():
    flag = HostFlag.create(torch.device("cuda"))
    if flag is None:
        pytest.skip("this driver/device has no stream memory operations")
    stream = torch.cuda.current_stream()
    x = torch.zeros(4, device="cuda")
    # Load the add kernel first: with CUDA's lazy loading, the first launch of a kernel may wait for the
    # device, which this test's wait holds until the timer below (started after the launch) releases it.
    x.add_(1)
    torch.cuda.synchronize()
    value = flag.next_value()
    assert flag.wait_on(stream, value)
    x.add_(1)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(0.05)
    assert not done.query()  # the add is held back by the wait
    threading.Timer(0.05, flag.release, args=(value,)).start()
    done.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cpu", "auto"])
def test_gpu_waited_cpu_tier_matches_resident(route):
    """Decode-sized calls over three MoE layers: all but the last layer's CPU jobs are awaited by the GPU."""
    layout = ExpertLayout((0, 1, 2), num_experts=16, hidden_size=1024, intermediate_size=512, top_k=4)
    cpu_store = _random_store(layout, torch.float32)
    arena = HostExpertArena(chunk_bytes=64 << 20, progress=False)
    store = ExpertStore(layout, torch.float32, arena)
    device_store = ExpertStore(layout, torch.float32, device_allocator("cuda"))
    for key, weights in cpu_store.items():
        store.block_for_loading(*key).block.copy_(weights.block)
        device_store.block_for_loading(*key).block.copy_(weights.block)
    resident = ResidentDispatcher(device_store)
    tiered = TieredDispatcher(
        store, cache_slots=4, miss_route=route, cpu_share=0.5 if route == "auto" else None, gpu_waits_for_cpu=True
    )
    generator = torch.Generator().manual_seed(12)
    worst = 0.0
    for tokens in (1, 2, 4, 1, 3, 1, 1, 2):
        hidden = None
        for layer in layout.moe_layers:
            routed = _routing(tokens, layout, generator, torch.float32, skew=1.0)
            x, ids, weights = (t.cuda() for t in routed)
            if hidden is not None:  # chain the layers as a model does: the next input depends on this output
                x = x + 0.01 * hidden
            hidden = tiered.dispatch(layer, x, ids, weights)
            worst = max(worst, relative_error(hidden, resident.dispatch(layer, x, ids, weights)))
    torch.cuda.synchronize()
    tiered.close()
    totals = tiered.metrics.snapshot()["totals"]
    if tiered._flag is None:
        pytest.skip("this driver/device has no stream memory operations")
    assert totals["cpu_jobs_gpu_waited"] > 0 and totals["cpu_pairs"] > 0
    assert worst < 1e-5
