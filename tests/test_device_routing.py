"""Launch tables built on the device from the router's ids (moetier.kernels.device_routing): the host
path's bits without its host sync; under Triton's interpreter on CPU, and (gpu) on CUDA and in a graph."""

import json
import os
import subprocess
import sys

import pytest
import torch
from interpreted import quicker_prelude

from moetier.kernels.device_routing import device_tables, left_to_cpu
from moetier.kernels.routing_table import CallSplit, split_priorities, split_skip


def test_the_table_gives_every_pair_its_own_group_and_sums_each_token_by_expert_id():
    offsets = torch.arange(8, dtype=torch.int64) * 1000
    ids = torch.tensor([[5, 2, 7], [1, 5, 3]])
    table, layout, pair_tokens = device_tables(offsets, ids)
    pairs = 6
    assert (layout.groups, layout.pairs, layout.touched, layout.width) == (pairs, pairs, 2, 4)
    groups = table[: 3 * pairs].view(pairs, 3).tolist()
    assert groups == [[5000, 0, 1], [2000, 1, 1], [7000, 2, 1], [1000, 3, 1], [5000, 4, 1], [3000, 5, 1]]
    by_pair = table[layout.pair_at : layout.token_at].view(pairs, 2).tolist()
    assert by_pair == [[p, offsets[ids.reshape(-1)[p]].item()] for p in range(pairs)]
    # Each token's pairs in increasing expert order (the host table's sorted order), -1 padding to 4.
    assert table[layout.token_at :].view(2, 5).tolist() == [[0, 1, 0, 2, -1], [1, 3, 5, 4, -1]]
    assert pair_tokens.tolist() == [0, 0, 0, 1, 1, 1]


_TABLE_KERNEL = """
import json, torch
from moetier.kernels.device_routing import device_tables
from moetier.kernels.routing_table import FeedTarget, build_table
g = torch.Generator().manual_seed(0)
results = []
for tokens, top_k, experts in ((1, 1, 4), (3, 6, 16), (4, 3, 8), (2, 8, 32)):
    offsets = torch.randint(0, 1 << 30, (experts,), generator=g) * 16
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if top_k > 1:
        ids[-1, -1] = ids[-1, 0]  # a tie: pair order decides
    pick = (torch.rand(experts, generator=g) < 0.4).to(torch.uint8)
    skip = pick[ids].bool()
    base = torch.zeros(16, dtype=torch.uint8)
    inbox = (torch.full((tokens, top_k), 99), torch.zeros(tokens, top_k), torch.zeros(tokens, 40, dtype=torch.bfloat16))
    feed = FeedTarget(base, *(t.data_ptr() - base.data_ptr() for t in inbox))
    gates, hidden = torch.rand(tokens, top_k, generator=g).bfloat16(), torch.randn(tokens, 40, generator=g).bfloat16()
    fed, pair_tokens, _ = build_table(offsets, ids, pick, feed, gates, hidden)
    plain = build_table(offsets, ids)
    results.append({
        "plain": torch.equal(plain[0], device_tables(offsets, ids)[0]) and torch.equal(plain[1], pair_tokens),
        "picked": torch.equal(build_table(offsets, ids, pick)[0], device_tables(offsets, ids, 16, skip)[0]),
        "fed": torch.equal(fed, device_tables(offsets, ids, 16, skip)[0]),
        "tokens": torch.equal(pair_tokens, device_tables(offsets, ids)[2]),
        "inbox": [torch.equal(inbox[0], torch.where(skip, ids, -1)), torch.equal(inbox[1], gates.float()),
                  torch.equal(inbox[2], hidden)],
    })
print(json.dumps(results))
"""


def test_the_table_kernel_writes_the_torch_tables_and_the_cpu_inbox_under_the_interpreter():
    results = _run("cpu", _TABLE_KERNEL)
    assert len(results) == 4
    for r in results:
        assert r["plain"] and r["picked"] and r["fed"] and r["tokens"] and all(r["inbox"]), r


def _split(priority: list[int], share: float) -> CallSplit:
    return CallSplit(torch.tensor(priority, dtype=torch.int32), torch.tensor([share], dtype=torch.float32))


def test_a_call_split_gives_the_cpu_its_share_of_the_calls_uncached_experts_cheapest_first():
    ids = torch.tensor([[5, 2, 7], [1, 5, 3]])
    pick = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1], dtype=torch.uint8)  # 1 is cached: never the CPU's
    priority = [0, 7, 6, 2, 5, 1, 4, 0]  # among one-token experts: 7, then 3, then 2
    # 4 eligible experts (5 twice): a share of 0.5 is 2 of them, the one-token ones by priority, never 5 first.
    assert split_skip(ids, pick, _split(priority, 0.5)).tolist() == [[False, False, True], [False, False, True]]
    assert split_skip(ids, pick, _split(priority, 0.62)).sum() == 2  # floor(0.62 * 4 + 0.5) = 2
    assert split_skip(ids, pick, _split(priority, 0.63)).tolist() == [[False, True, True], [False, False, True]]
    assert split_skip(ids, pick, _split(priority, 1.0)).tolist() == [[True, True, True], [False, True, True]]
    assert not split_skip(ids, pick, _split(priority, 0.0)).any()
    assert not split_skip(ids, torch.zeros(8, dtype=torch.uint8), _split(priority, 1.0)).any()  # all cached
    counts = torch.zeros(8, dtype=torch.int64)
    skip, rows = left_to_cpu(ids, pick, _split(priority, 1.0), counts)
    assert rows is None  # whole experts: no rows cut
    assert counts.tolist() == [0, 0, 1, 1, 0, 2, 0, 1] and skip.sum() == 5  # each pair the CPU takes, once
    static = torch.zeros(8, dtype=torch.int64)
    assert torch.equal(left_to_cpu(ids, pick, None, static)[0], pick[ids].bool()) and static.sum() == 5


def test_a_call_split_is_even_on_every_call_where_fixed_picks_are_even_only_on_average():
    g = torch.Generator().manual_seed(5)
    experts, share = 64, 0.5
    priority = split_priorities(experts, 3)
    assert sorted(priority) == list(range(experts)) and priority != split_priorities(experts, 4)
    fixed = torch.zeros(experts, dtype=torch.uint8)
    fixed[[e for e in range(experts) if priority[e] < experts // 2]] = 1  # the static split of the same order
    worst_split, worst_fixed = 0.0, 0.0
    for _ in range(200):
        ids = torch.randperm(experts, generator=g)[:6].view(1, 6)
        pick = (torch.rand(experts, generator=g) < 0.7).to(torch.uint8)
        n = int(pick[ids].sum())
        ours = int(split_skip(ids, pick, _split(priority, share)).sum())
        assert ours == int(share * n + 0.5)
        worst_split = max(worst_split, abs(ours - share * n))
        worst_fixed = max(worst_fixed, abs(int((pick * fixed)[ids].sum()) - share * n))
    assert worst_split <= 0.5 < worst_fixed  # fixed picks give one side of some calls most of its misses


# One split call's inputs in the scripts below (a loop body over tokens, top_k, experts and share; g the generator).
_SPLIT_CALL = """
    offsets = torch.randint(0, 1 << 30, (experts,), generator=g) * 16
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pick = (torch.rand(experts, generator=g) < 0.8).to(torch.uint8)
    priority = torch.tensor(split_priorities(experts, tokens), dtype=torch.int32)
    gates, hidden = torch.rand(tokens, top_k, generator=g).bfloat16(), torch.randn(tokens, 40, generator=g).bfloat16()
    offsets, ids, pick, priority, gates, hidden = (t.to(DEVICE) for t in (offsets, ids, pick, priority, gates, hidden))
"""

_SPLIT_KERNEL = (
    """
import json, torch
from moetier.kernels.device_routing import device_tables
from moetier.kernels.routing_table import CallSplit, FeedTarget, build_table, split_priorities, split_skip
g = torch.Generator().manual_seed(1)
results = []
for tokens, top_k, experts, share in ((1, 6, 64, 0.5), (3, 6, 16, 0.4), (4, 3, 8, 0.75), (16, 4, 32, 0.3),
                                      (2, 8, 32, 1.0), (1, 1, 4, 0.5)):
"""
    + _SPLIT_CALL
    + """
    split = CallSplit(priority, torch.tensor([share], dtype=torch.float32, device=DEVICE))
    skip = split_skip(ids, pick, split)
    base = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    inbox = (torch.full((tokens, top_k), 99, device=DEVICE), torch.zeros(tokens, top_k, device=DEVICE),
             torch.zeros(tokens, 40, dtype=torch.bfloat16, device=DEVICE))
    feed = FeedTarget(base, *(t.data_ptr() - base.data_ptr() for t in inbox))
    counts = torch.full((experts,), 3, dtype=torch.int64, device=DEVICE)
    fed, pair_tokens, rows = build_table(offsets, ids, pick, feed, gates, hidden, split, counts)
    want_counts = torch.full((experts,), 3, dtype=torch.int64, device=DEVICE)
    want_counts.index_add_(0, ids[skip], torch.ones(int(skip.sum()), dtype=torch.int64, device=DEVICE))
    unsplit = device_tables(offsets, ids, 16, pick[ids].bool())[0]
    results.append({
        "some": bool(skip.any()) or share * int(pick[ids.unique()].sum()) < 0.5,
        "fed": torch.equal(fed, device_tables(offsets, ids, 16, skip)[0]),
        "inbox": torch.equal(inbox[0], torch.where(skip, ids, -1)),
        "counts": torch.equal(counts, want_counts),
        "unsplit": torch.equal(build_table(offsets, ids, pick)[0], unsplit),
        "no rows": rows is None,
    })
print(json.dumps(results))
"""
)

# The same with experts cut in parts of 32 of their 256 rows: the CPU's whole experts, then the last parts of the
# next one (its ids carry the device's rows), the device's rows of every pair as split_rows has them.
_ROW_SPLIT_KERNEL = (
    """
import json, torch
from moetier.kernels.cpu_worker import fed_ids
from moetier.kernels.device_routing import device_tables
from moetier.kernels.routing_table import CallSplit, FeedTarget, build_table, split_priorities, split_rows
g = torch.Generator().manual_seed(2)
results = []
for tokens, top_k, experts, share in ((1, 6, 64, 0.55), (3, 6, 16, 0.4), (4, 3, 8, 0.7), (1, 6, 64, 0.5),
                                      (2, 8, 32, 1.0), (1, 1, 4, 0.3), (1, 6, 64, 0.01)):
"""
    + _SPLIT_CALL
    + """
    split = CallSplit(priority, torch.tensor([share], dtype=torch.float32, device=DEVICE), unit_rows=32, inter=256)
    skip, want_rows = split_rows(ids, pick, split)
    parted = (want_rows > 0) & (want_rows < 256)
    base = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    inbox = (torch.full((tokens, top_k), 99, device=DEVICE), torch.zeros(tokens, top_k, device=DEVICE),
             torch.zeros(tokens, 40, dtype=torch.bfloat16, device=DEVICE))
    feed = FeedTarget(base, *(t.data_ptr() - base.data_ptr() for t in inbox))
    fed, pair_tokens, rows = build_table(offsets, ids, pick, feed, gates, hidden, split)
    cpu_ids = torch.where(skip, ids, torch.where(parted, fed_ids(ids, want_rows), -1))
    n = int(pick[ids.unique()].sum())
    cpu_work = len(set(ids[skip].tolist())) + float((256 - want_rows[parted][:1]).sum()) / 256
    results.append({
        "fed": torch.equal(fed, device_tables(offsets, ids, 16, skip)[0]),
        "rows": torch.equal(rows.view(tokens, top_k), want_rows),
        "inbox": torch.equal(inbox[0], cpu_ids),
        "share": abs(cpu_work - share * n) <= 1 / 16,
        "cut": bool(parted.any()) == (round(share * n * 8) % 8 != 0),
    })
print(json.dumps(results))
"""
)


def test_the_table_kernel_splits_each_call_as_split_skip_does_under_the_interpreter():
    results = _run("cpu", _SPLIT_KERNEL)
    assert len(results) == 6
    for r in results:
        assert all(r.values()), r


@pytest.mark.gpu
def test_the_table_kernel_splits_each_call_as_split_skip_does_on_cuda():
    results = _run("cuda", _SPLIT_KERNEL)
    assert len(results) == 6
    for r in results:
        assert all(r.values()), r


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_table_kernel_cuts_an_expert_to_meet_the_share_as_split_rows_does(device):
    """Interpreted off CUDA: the whole experts the CPU takes, the split expert's rows on each side (the device's
    rows per pair, the CPU's inbox ids carrying them) as split_rows decides, and the CPU's work ``share * n``
    experts to a part (1/8 of an expert here)."""
    results = _run(device, _ROW_SPLIT_KERNEL)
    assert len(results) == 7
    for r in results:
        assert all(r.values()), r


def test_skipped_pairs_get_no_tokens_no_down_row_and_no_place_in_their_tokens_sum():
    offsets = torch.arange(8, dtype=torch.int64) * 1000
    ids = torch.tensor([[5, 2, 7], [1, 5, 3]])
    skip = torch.tensor([[False, True, False], [False, False, True]])
    table, layout, _ = device_tables(offsets, ids, skip=skip)
    groups = table[: 3 * 6].view(6, 3).tolist()
    assert [count for _, _, count in groups] == [1, 0, 1, 1, 1, 0]
    by_pair = table[layout.pair_at : layout.token_at].view(6, 2)[:, 0].tolist()
    assert by_pair == [0, -1, 2, 3, 4, -1]
    assert table[layout.token_at :].view(2, 5).tolist() == [[0, -1, 0, 2, -1], [1, 3, -1, 4, -1]]


_SAME_BITS = """
import json, torch
import moetier.kernels.grouped_experts as k
from moetier.kernels.device_routing import LayerBlocks, device_routing_fits, run_routed
from moetier.tiers.call_routing import sort_pairs, sorted_pairs_on_device
from moetier.tiers.dispatcher import ResidentDispatcher
from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator

def case(seed, dtype, tokens, top_k, limit, device):
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(moe_layers=(0,), num_experts=6, hidden_size=64, intermediate_size=32, top_k=top_k,
                          swiglu_limit=limit)
    store = ExpertStore(layout, dtype, device_allocator(device))
    for e in range(layout.num_experts):
        block = store.block_for_loading(0, e).block
        block.copy_(torch.randn(block.shape, generator=g) * 0.125)
    x = torch.randn(tokens, 64, generator=g).to(dtype).to(device)
    # Tokens share experts (expert 0 and 1 are every token's first two): shared blocks are read per pair.
    ids = torch.stack([torch.cat([torch.tensor([0, 1]), torch.randperm(4, generator=g)[: top_k - 2] + 2])
                       for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, generator=g).to(dtype).to(device)
    host = ResidentDispatcher(store, device_routing=False).dispatch(0, x, ids, weights)
    device_path = ResidentDispatcher(store, device_routing=True)
    ours = device_path.dispatch(0, x, ids, weights)
    again = device_path.dispatch(0, x, ids, weights)
    layer_blocks = device_path._layer_blocks(0, dtype)
    blocks = layer_blocks is not None
    # Pairs of experts left to another tier: the bits of the call with their weights zeroed (each adds +-0).
    pick = torch.zeros(layout.num_experts, dtype=torch.uint8, device=device)
    pick[ids[0, -1]] = pick[ids[-1, -1]] = 1
    skip = pick[ids].bool()
    part, zeroed = (torch.zeros(x.shape, dtype=torch.float32, device=device) for _ in range(2))
    run_routed(part, x, ids, weights, layer_blocks, limit, pick)
    run_routed(zeroed, x, ids, torch.where(skip, torch.zeros_like(weights), weights), layer_blocks, limit)
    return {"fits": device_routing_fits(x, tokens, ids.numel()), "blocks": blocks,
            "skip_same": bool(torch.equal(part, zeroed)), "skip_changes": not bool(torch.equal(part, host.float())),
            "same": bool(torch.equal(host, ours)), "repeat": bool(torch.equal(ours, again)),
            "rel": ((host.double() - ours.double()).norm() / host.double().norm()).item(), "broken": list(k._BROKEN)}

results = [case(i, getattr(torch, dt), t, kk, lim, DEVICE) for i, (dt, t, kk, lim) in enumerate(
    [("float32", 1, 3, None), ("float32", 3, 4, 0.7), ("bfloat16", 4, 3, None), ("bfloat16", 2, 6, 0.5)])]
print(json.dumps(results))
"""


# The grouped kernels over a table whose split expert computes only its first rows: against the reference's same
# rows (swiglu_expert with rows), for dense, fp8 (128-row parts: its scale tiles) and fp4 blocks.
_ROW_KERNELS = """
import json, torch
from dataclasses import replace
import moetier.kernels.grouped_experts as k
from moetier.kernels.device_routing import LayerBlocks, launch_routed, routed_table
from moetier.kernels.routing_table import CallSplit, split_priorities, split_rows
from moetier.tiers.experts import ExpertLayout, ExpertQuant, ExpertStore, device_allocator, swiglu_expert

def store_of(fmt, layout, g):
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    quant = {"fp8": ExpertQuant(kind="fp8-block", tile=(128, 128)),
             "fp4": ExpertQuant(kind="fp4-block", tile=(1, 32), pow2_scales=True)}.get(fmt)
    store = ExpertStore(replace(layout, quant=quant), dtype, device_allocator(DEVICE))
    for e in range(layout.num_experts):
        w = store.block_for_loading(0, e)
        if quant is None:
            w.block.copy_(torch.randn(w.block.shape, generator=g) * 0.1)
            continue
        for name in ("gate", "up", "down"):
            q, scale = getattr(w, name + "_q"), getattr(w, name + "_scale")
            if fmt == "fp8":
                q.copy_(torch.randn(q.shape, generator=g).clamp(-3, 3).to(torch.float8_e4m3fn).view(q.dtype))
                scale.copy_(torch.rand(scale.shape, generator=g) * 0.02 + 0.01)
            else:
                q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=g))
                scale.copy_(2.0 ** -torch.randint(3, 6, scale.shape, generator=g).float())
    return store, dtype

results = []
for fmt, unit, share in (("float32", 32, 0.45), ("bfloat16", 64, 0.3), ("fp8", 128, 0.5), ("fp4", 32, 0.55)):
    g = torch.Generator().manual_seed(5)
    layout = ExpertLayout(moe_layers=(0,), num_experts=8, hidden_size=64, intermediate_size=256, top_k=3,
                          swiglu_limit=0.9)
    store, dtype = store_of(fmt, layout, g)
    experts = [store.expert(0, e) for e in range(8)]
    blocks = LayerBlocks.of(experts, dtype)
    x = torch.randn(2, 64, generator=g).to(dtype).to(DEVICE)
    ids = torch.tensor([[0, 3, 5], [3, 6, 1]], device=DEVICE)
    weights = torch.rand(2, 3, generator=g).to(dtype).to(DEVICE)
    pick = torch.ones(8, dtype=torch.uint8, device=DEVICE)
    priority = torch.tensor(split_priorities(8, 0), dtype=torch.int32, device=DEVICE)
    split = CallSplit(priority, torch.tensor([share], device=DEVICE), unit_rows=unit, inter=256)
    skip, rows = split_rows(ids, pick, split)
    out = torch.zeros(2, 64, dtype=torch.float32, device=DEVICE)
    launch_routed(out, x, weights, blocks, 0.9, routed_table(blocks, ids, pick, split=split))
    want = torch.zeros_like(out)
    for t in range(2):
        for j in range(3):
            if int(rows[t, j]) > 0:
                part = swiglu_expert(x[t : t + 1], experts[int(ids[t, j])], 0.9, (0, int(rows[t, j])))
                want[t] += part[0].float() * weights[t, j].float()
    cut = (rows > 0) & (rows < 256)
    rel = ((out - want).norm() / want.norm()).item()
    # The plain call (the CPU's whole experts' weights zeroed: each adds +-0) over the cut expert with its rows
    # from the cut on zeroed (their activations are 0, so add +-0 too): the split call's bits.
    unzeroed, kept = torch.zeros_like(out), torch.where(skip, 0.0, weights.float()).to(dtype)
    launch_routed(unzeroed, x, kept, blocks, 0.9, routed_table(blocks, ids))
    c, w = int(rows[cut][0]), store.expert(0, int(ids[cut][0]))
    if w.quantized:
        w.gate_q[c:], w.up_q[c:] = 0, 0
        w.down_q[:, (c // 2 if fmt == "fp4" else c):] = 0
    else:
        w.gate_up[c:256], w.gate_up[256 + c :], w.down[:, c:] = 0, 0, 0
    plain = torch.zeros_like(out)
    launch_routed(plain, x, kept, blocks, 0.9, routed_table(blocks, ids))
    results.append({"fmt": fmt, "cut": bool(cut.any()), "rel": rel, "broken": list(k._BROKEN),
                    "same_bits": torch.equal(out, plain), "differs": not torch.equal(out, unzeroed)})
print(json.dumps(results))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_grouped_kernels_compute_only_a_split_experts_first_rows(device):
    """Interpreted off CUDA: a call whose split expert the device computes to its first rows (the rest is the CPU
    tier's) gives the bits of the whole call over that expert with its other rows zeroed, and the reference's same
    rows within the tolerance, for dense, fp8 and fp4 blocks."""
    results = _run(device, _ROW_KERNELS)
    assert len(results) == 4
    for r in results:
        assert r["cut"] and r["differs"] and r["same_bits"] and not r["broken"], r
        # Against torch's same rows: float32 to its rounding, the bf16 formats to bf16's (the interpreter rounds to
        # bf16 by truncation: ~2% there; on the H200 fp4 gave 1.1%).
        assert r["rel"] < (1e-5 if r["fmt"] == "float32" else 5e-2 if device == "cpu" else 2e-2), r


def _run(device: str, script: str = _SAME_BITS) -> list[dict]:
    """``script``'s JSON results, run in a subprocess on ``device`` (``cpu``: under Triton's interpreter, made quicker
    by interpreted.quicker_device_calls: the same results)."""
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    code = f"DEVICE = {device!r}\n" + (quicker_prelude() if device == "cpu" else "") + script
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(results: list[dict]) -> None:
    for r in results:
        # The device table ran (not the host path under its name) and gave the host table's bits.
        assert r["fits"] and r["blocks"] and not r["broken"], r
        assert r["same"] and r["repeat"] and r["rel"] == 0.0, r
        assert r["skip_same"] and r["skip_changes"], r  # skipped pairs are left out, and only those


def test_device_tables_give_the_host_tables_bits_under_the_interpreter():
    _check(_run("cpu"))


@pytest.mark.gpu
def test_device_tables_give_the_host_tables_bits_on_cuda():
    _check(_run("cuda"))


@pytest.mark.gpu
def test_device_routing_runs_inside_a_cuda_graph():
    """No host sync and fixed shapes: captured once, replayed on new ids and weights, the eager result."""
    from moetier.tiers.dispatcher import ResidentDispatcher
    from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator

    layout = ExpertLayout(moe_layers=(0,), num_experts=8, hidden_size=128, intermediate_size=64, top_k=3)
    store = ExpertStore(layout, torch.bfloat16, device_allocator("cuda"))
    g = torch.Generator().manual_seed(3)
    for e in range(layout.num_experts):
        block = store.block_for_loading(0, e).block
        block.copy_(torch.randn(block.shape, generator=g) * 0.1)
    dispatcher = ResidentDispatcher(store, device_routing=True)
    x = torch.randn(2, 128, generator=g).bfloat16().cuda()
    ids = torch.tensor([[0, 3, 5], [5, 1, 7]]).cuda()
    weights = torch.rand(2, 3, generator=g).bfloat16().cuda()
    dispatcher.dispatch(0, x, ids, weights)  # compiled, blocks judged
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dispatcher.dispatch(0, x, ids, weights)
    for _ in range(3):
        x.copy_(torch.randn(2, 128, generator=g).bfloat16())
        ids.copy_(torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(2)]))
        weights.copy_(torch.rand(2, 3, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, ResidentDispatcher(store, device_routing=False).dispatch(0, x, ids, weights))


def _store(num_experts: int = 6, top_k: int = 3):
    from moetier.tiers.experts import ExpertLayout, ExpertStore, device_allocator

    layout = ExpertLayout(moe_layers=(0,), num_experts=num_experts, hidden_size=32, intermediate_size=16, top_k=top_k)
    store = ExpertStore(layout, torch.float32, device_allocator("cpu"))
    g = torch.Generator().manual_seed(0)
    for e in range(num_experts):
        block = store.block_for_loading(0, e).block
        block.copy_(torch.randn(block.shape, generator=g) * 0.2)
    return store


def test_device_routing_is_on_by_default_and_off_cuda_the_host_path_runs(monkeypatch):
    from moetier.tiers.dispatcher import ResidentDispatcher

    store = _store()
    monkeypatch.setenv("MOETIER_DEVICE_ROUTING", "0")
    assert not ResidentDispatcher(store).device_routing
    monkeypatch.delenv("MOETIER_DEVICE_ROUTING")
    on = ResidentDispatcher(store)
    assert on.device_routing
    x, ids, w = torch.randn(2, 32), torch.tensor([[0, 4, 2], [4, 1, 5]]), torch.rand(2, 3)
    # No Triton for CPU tensors here: the device table does not apply, the host path runs.
    assert torch.equal(
        on.dispatch(0, x, ids, w), ResidentDispatcher(store, device_routing=False).dispatch(0, x, ids, w)
    )


def test_a_failing_device_table_falls_back_to_the_host_path_for_good(monkeypatch):
    from moetier.kernels import device_routing, grouped_experts
    from moetier.tiers import dispatcher as dispatcher_module
    from moetier.tiers.dispatcher import ResidentDispatcher

    store = _store()
    monkeypatch.setattr(grouped_experts, "_BROKEN", [])
    monkeypatch.setattr(
        dispatcher_module, "device_routing_fits", lambda hidden, tokens, pairs: not grouped_experts._BROKEN
    )
    monkeypatch.setattr(ResidentDispatcher, "_layer_blocks", lambda self, layer, dtype: object())

    def broken(*args):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(dispatcher_module, "run_routed", broken)
    x, ids, w = torch.randn(3, 32), torch.tensor([[0, 4, 2], [4, 1, 5], [3, 2, 0]]), torch.rand(3, 3)
    ours = ResidentDispatcher(store, device_routing=True).dispatch(0, x, ids, w)
    assert torch.equal(ours, ResidentDispatcher(store, device_routing=False).dispatch(0, x, ids, w))
    assert grouped_experts._BROKEN == ["no kernel for this GPU"]
    assert not device_routing.device_routing_fits(x, 3, ids.numel())  # every later call: the host path


def test_only_thin_decode_calls_take_the_device_table(monkeypatch):
    """More tokens than the grouped kernels' token tile could give an expert a group the host path sends to
    per-expert GEMMs (other float32 sums): such calls, and too many pairs, keep the host path."""
    from moetier.kernels import device_routing
    from moetier.kernels.grouped_experts import MAX_GROUP_TOKENS

    monkeypatch.setattr(device_routing, "triton_usable", lambda hidden: True)
    x = torch.empty(1, 8)
    assert device_routing.device_routing_fits(x, 4, 24)
    assert device_routing.device_routing_fits(x, MAX_GROUP_TOKENS, 2 * MAX_GROUP_TOKENS)
    assert not device_routing.device_routing_fits(x, MAX_GROUP_TOKENS + 1, MAX_GROUP_TOKENS + 1)
    assert not device_routing.device_routing_fits(x, 8, device_routing.DEVICE_ROUTING_MAX_PAIRS + 1)
    assert not device_routing.device_routing_fits(x, 0, 0)
