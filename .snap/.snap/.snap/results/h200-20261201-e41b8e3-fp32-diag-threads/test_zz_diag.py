"""Diagnostic (run once on the H200, copied into tests/ for the call): where the fp32 device-table run of the tiny
V4 departs from the host-table run. Direct dispatch calls of 1-4 tokens, then the model with graphs off and on."""

import pytest
import torch
from reference import greedy_groups, relative_error
from test_v4_graph_segments import CUDA_GROUPS, checkpoint  # noqa: F401

from moetier.config import ModelLoadConfig
from moetier.models.graph_segments import SegmentGraphs
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.weights.loader import load_model


@pytest.mark.gpu
def test_diag_fp32(checkpoint):  # noqa: F811
    model = load_model(checkpoint, ModelLoadConfig(dtype=torch.float32, device="cuda"), progress=False).model
    store = model.dispatcher.store
    layout = store.layout
    print("\nlayout", layout)
    host, dev = ResidentDispatcher(store, device_routing=False), ResidentDispatcher(store, device_routing=True)
    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 4):
        for layer in layout.moe_layers:
            x = torch.randn(T, layout.hidden_size, generator=g).cuda()
            ids = torch.stack(
                [torch.randperm(layout.num_experts, generator=g)[: layout.top_k] for _ in range(T)]
            ).cuda()
            w = torch.rand(T, layout.top_k, generator=g).cuda()
            a, b = host.dispatch(layer, x, ids, w), dev.dispatch(layer, x, ids, w)
            print("direct", T, layer, (a - b).abs().max().item(), torch.equal(a, b), ids.tolist())
    for graphs_on in (False, True):
        model.use_dispatcher(host)
        model.graphs = SegmentGraphs(enabled=graphs_on)
        ht, hl = greedy_groups(model, CUDA_GROUPS)
        model.use_dispatcher(dev)
        model.graphs = SegmentGraphs(enabled=graphs_on)
        dt, dl = greedy_groups(model, CUDA_GROUPS)
        errs = [relative_error(a, b) for a, b in zip(dl, hl, strict=True)]
        print("model graphs", graphs_on, "tokens equal", dt == ht, "errors", [f"{e:.1e}" for e in errs])
