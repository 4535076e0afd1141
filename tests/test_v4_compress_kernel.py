"""The V4 compressor step kernel (moetier.kernels.v4_compress) against the torch ops of the fixed-shape decode step,
over consecutive steps of real compressor states (HCA and CSA windows, a store shorter than the steps, none, plain
and fp8 entries, bf16 and float32).

The open rows and the CSA predecessor are copies and must be bit for bit; the entries may differ by the order of
the sums, measured as ``|kernel - torch| / max |torch row|``. Triton's interpreter truncates float32 to bf16 (CUDA
rounds to nearest even), so the CPU check gives it torch's rounding for that conversion: the bf16 entries (plain,
fp8, bf16 rows of a float32 model) then come out bit for bit (measured), float32 within 3.2e-7 of the row's
largest value (8.5e-7 of an element of at least 1/16 of it; other draws 1.6e-7 and 6.6e-7). Allowed: float32
2^-20, bf16 2^-6 (two ulps of the row's largest value), fp8 entries one e4m3 step (2^-3) with their scales within
the row's tolerance. Without the rounding fix (an interpreter changed under it) bf16 truncates: measured 0.014, fp8
0.071, allowed 2^-5 and 2^-3.
"""

from __future__ import annotations

import pytest
import torch
from reference import run_kernel_check

_CHECK = """
import json, sys
import torch
from moetier.kernels import v4_compress as k
from moetier.kernels.rope_rotate import angles_reference
from moetier.models.deepseek_v4_cache import CompressorState

device = sys.argv[1]
rtne = device == "cuda"
if device == "cpu":  # the interpreter truncates float32 to bf16: round to nearest even, as CUDA does
    from interpreted import nearest_bf16, quicker_device_calls

    rtne = nearest_bf16()
    quicker_device_calls()
g = torch.Generator().manual_seed(0)
results = []


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def states(rate, dim, overlap, capacity, dtype, kv_dtype):
    ours = CompressorState(rate, 2 * dim if overlap else dim, dim, capacity, dtype, device, kv_dtype)
    ours.open.fill_(float("nan"))  # rows not yet written in the window: masked, never used
    if overlap:  # a predecessor as if a window had closed
        ours.prev_kv.copy_(randn(1, rate, dim, dtype=dtype))
        ours.prev_gate.copy_(randn(1, rate, dim))
    data = ours.entries.data
    if ours.entries.scales is None:  # unwritten entries hold anything: random rows, kept byte for byte
        data.copy_(torch.randn(data.shape, generator=g).to(data.dtype))
    else:
        data.view(torch.uint8).copy_(torch.randint(0, 256, data.shape, generator=g, dtype=torch.uint8) & 0x77)
        ours.entries.scales.copy_(torch.rand(ours.entries.scales.shape, generator=g))
    ref = ours.copy(capacity)
    ref.entries.data.copy_(data)  # every row, written or not
    if ours.entries.scales is not None:
        ref.entries.scales.copy_(ours.entries.scales)
    return ours, ref


def stored(entries):  # each entry's bytes (data, then its scale)
    rows = entries.data.view(torch.uint8)
    return rows if entries.scales is None else torch.cat([rows, entries.scales.view(torch.uint8)], dim=1)


def values(entries):
    data = entries.data.float()
    return data if entries.scales is None else data * entries.scales


def same(a, b):
    return a is None or bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def run(name, rate, dim, overlap, capacity, rope, dtype, kv_dtype, block, steps):
    k.BLOCK_ELEMENTS = block  # small blocks: the loops over the window's rows run several times
    width = 2 * dim if overlap else dim
    ours, ref = states(rate, dim, overlap, capacity, dtype, kv_dtype)
    ape = randn(rate, width, dtype=dtype)
    weight = (1 + 0.1 * randn(dim)).to(dtype)
    eps = 1e-6
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope)
    table = torch.stack(angles_reference(torch.arange(0, (capacity + 2) * rate, rate), inv_freq, 1.0, dtype), 1)
    table = table.to(device)
    rows = randn(steps, 4 * width, dtype=dtype)[:, 2 * width :]  # row views of a bigger projection
    first = torch.zeros(1, dtype=torch.int64, device=device)
    fits = k._fits(k.CompressorStep(ours.open, ours.prev_kv, ours.prev_gate, ape, weight, eps, rows[:1], first, table,
                                    ours.entries, overlap, rate, width, dim))
    found = {"open": True, "prev": True, "kept": True, "within": True, "equal": True}
    worst, worst_rel = 0.0, 0.0
    stored_dtype = dtype if ours.entries.scales is not None else ours.entries.data.dtype  # fp8: its scales' rows
    plain_tol = 2.0 ** -20 if stored_dtype in (torch.float32, torch.float64) else 2.0 ** -6 if rtne else 2.0 ** -5
    tol = plain_tol if ours.entries.scales is None else 2.0 ** -3
    for p in range(steps):
        position = torch.tensor([p], device=device)
        before = stored(ours.entries).clone()
        for state, step in ((ours, k.compress_decode), (ref, k.compress_decode_reference)):
            step(k.CompressorStep(state.open, state.prev_kv, state.prev_gate, ape, weight, eps, rows[p : p + 1],
                                  position, table, state.entries, overlap, rate, width, dim))
        found["open"] &= same(ours.open, ref.open)
        found["prev"] &= same(ours.prev_kv, ref.prev_kv) and same(ours.prev_gate, ref.prev_gate)
        changed = (stored(ours.entries) != before).any(dim=1).nonzero().flatten().tolist()
        closing = capacity > 0 and p % rate == rate - 1
        found["kept"] &= changed == [] or (closing and changed == [min(p // rate, capacity - 1)])
        found["equal"] &= same(ours.entries.data, ref.entries.data) and same(ours.entries.scales, ref.entries.scales)
        if capacity:
            a, b = values(ours.entries), values(ref.entries)
            top = b.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
            diff = (a - b).abs()
            found["within"] &= bool((diff <= tol * top).all())
            if ours.entries.scales is not None:
                scales = (ours.entries.scales - ref.entries.scales).abs()
                found["within"] &= bool((scales <= plain_tol * ref.entries.scales).all())
            worst = max(worst, float((diff / top).max()))
            worst_rel = max(worst_rel, float((diff / b.abs().clamp(min=1e-30))[b.abs() >= top / 16].max()))
    results.append({"case": name, "dtype": str(dtype), "kv": kv_dtype, "fits": fits, "broken": list(k._BROKEN),
                    "rtne": rtne, "row": worst, "rel": worst_rel, **found})


cases = [  # name, rate, dim, overlap, capacity, rotated channels, elements a program's block of rows x channels
    ("hca", 8, 64, False, 3, 16, 4096),  # one program, the rows in one block
    ("hca-programs", 8, 64, False, 3, 16, 256),  # 2 programs of 32 channels
    # 2 programs of 2 channels, the rows in 2 blocks of 4, every channel rotated (16 channels were 8 such programs:
    # the same code, 4x the interpreter's time, which goes by programs)
    ("hca-blocks", 8, 4, False, 3, 4, 8),
    ("csa", 4, 64, True, 4, 32, 256),
    ("short", 4, 64, True, 1, 16, 256),  # one entry: the second window's close rewrites it (at capacity - 1)
    ("none", 4, 64, True, 0, 16, 256),
    ("ragged", 6, 32, True, 2, 32, 256),  # 12 rows in a block of 16, 2 programs; every channel rotated
]
for dtype in (torch.bfloat16, torch.float32):
    for kv_dtype in (None, "fp8") if dtype == torch.bfloat16 else (None, "fp8", "bf16"):
        for name, rate, dim, overlap, capacity, rope, block in cases:
            run(name, rate, dim, overlap, capacity, rope, dtype, kv_dtype, block, 2 * rate + 2)
# Inputs the kernel does not take run the torch ops: the same bytes.
run("float64", 4, 64, True, 2, 16, torch.float64, None, 256, 10)
run("rope-12", 4, 64, True, 2, 12, torch.bfloat16, None, 256, 10)
print(json.dumps(results))
"""


def run_check(device: str) -> list[dict]:
    return run_kernel_check(_CHECK, device)


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 7 * 5 + 2
    for r in results:
        assert r["open"] and r["prev"] and r["kept"] and r["within"] and not r["broken"], r
        assert r["fits"] == (r["case"] not in ("float64", "rope-12")), r
        assert r["equal"] or r["fits"], r  # the torch ops where the kernel does not fit
    assert any(r["row"] > 0 for r in results)  # float32 sums in another order: the kernel's own, not the torch ops


def test_the_compressor_kernel_matches_the_torch_ops_interpreted():
    _assert_results(run_check("cpu"))


@pytest.mark.gpu
def test_the_compressor_kernel_matches_the_torch_ops_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_check("cuda"))


def _steps(step, dtype: torch.dtype, kv_dtype: str | None, overlap: bool, table_rope: int = 16):
    """Ten steps of ``step`` over a fresh seeded state; the state after them."""
    from moetier.kernels.v4_compress import CompressorStep
    from moetier.models.deepseek_v4_cache import CompressorState

    g = torch.Generator().manual_seed(3)
    rate, dim = 4, 32
    width = 2 * dim if overlap else dim
    state = CompressorState(rate, width, dim, 2, dtype, "cpu", kv_dtype)
    state.open.zero_()
    state.entries.data.zero_()
    if state.entries.scales is not None:
        state.entries.scales.fill_(1)
    ape = torch.randn(rate, width, generator=g).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    table = torch.randn(4, 3, table_rope, generator=g)
    rows = torch.randn(10, 2 * width, generator=g).to(dtype)
    for p in range(10):
        step(CompressorStep(state.open, state.prev_kv, state.prev_gate, ape, weight, 1e-6, rows[p : p + 1],
                            torch.tensor([p]), table, state.entries, overlap, rate, width, dim))  # fmt: skip
    return state, (ape, weight, table, rows)


def test_the_compressor_step_is_the_torch_ops_off_cuda(monkeypatch):
    from moetier.kernels import v4_compress as k

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for dtype, kv_dtype, overlap in ((torch.bfloat16, None, True), (torch.bfloat16, "fp8", False),
                                     (torch.float32, None, False)):  # fmt: skip
        ours, _ = _steps(k.compress_decode, dtype, kv_dtype, overlap)
        ref, _ = _steps(k.compress_decode_reference, dtype, kv_dtype, overlap)
        assert torch.equal(ours.open, ref.open)
        assert torch.equal(ours.entries.data.view(torch.uint8), ref.entries.data.view(torch.uint8))
        assert ours.entries.scales is None or torch.equal(ours.entries.scales, ref.entries.scales)
        if overlap:
            assert torch.equal(ours.prev_kv, ref.prev_kv) and torch.equal(ours.prev_gate, ref.prev_gate)
        assert ours.entries.data.float().abs().sum() > 0  # two windows closed: entries 0 and 1 written


def test_the_compressor_step_stays_in_torch_where_the_kernel_does_not_fit():
    from moetier.kernels import v4_compress as k
    from moetier.models.deepseek_v4_cache import CompressorState

    def fits(dtype=torch.bfloat16, rope=16, overlap=True, dim=32, capacity=2):
        width = 2 * dim if overlap else dim
        state = CompressorState(4, width, dim, capacity, dtype, "cpu")
        ape, weight = torch.zeros(4, width, dtype=dtype), torch.ones(dim, dtype=dtype)
        row, table = torch.zeros(1, 2 * width, dtype=dtype), torch.zeros(4, 3, rope)
        position = torch.zeros(1, dtype=torch.int64)
        return k._fits(k.CompressorStep(state.open, state.prev_kv, state.prev_gate, ape, weight, 1e-6, row, position,
                                        table, state.entries, overlap, 4, width, dim))  # fmt: skip

    assert fits() and fits(torch.float32, overlap=False) and fits(rope=32) and fits(capacity=0)
    assert not fits(torch.float64)
    assert not fits(rope=12)  # not a power of two
    assert not fits(rope=64)  # more than the entry's channels
    assert not fits(dim=48)  # not a power of two
    assert not fits(dim=2048)  # more channels than one program holds
    assert not fits(capacity=5)  # the rotation table has 4 rows
