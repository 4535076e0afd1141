"""The V4 decode attention kernel (moetier.kernels.v4_attention) against the torch ops it replaces, and the fixed-shape
decode step taking it (moetier.models.deepseek_v4_static_decode) against the eager attention core.

The kernel check runs under Triton's interpreter on the CPU (made to round to bf16 to nearest, as CUDA does: the
bf16 outputs then equal the torch ops' bit for bit, measured) and on CUDA in the GPU suite. The step's integration
(the compressors, CSA's picks, each sequence's ring, entries and output row) runs on the CPU with the kernels'
torch references in their place.
"""

from __future__ import annotations

import pytest
import torch
from reference import relative_error, run_kernel_check
from test_v4_decode_ops import tiny_model
from test_v4_static_decode import PROMPTS, _decode_both

_CHECK = """
import json, sys, torch
from moetier.kernels import v4_attention as k

device = sys.argv[1]
nearest = device == "cuda"
if device == "cpu":  # the interpreter truncates float32 to bf16: round to nearest even, as CUDA does
    from interpreted import nearest_bf16, quicker_device_calls, widened_bf16_dots

    nearest = nearest_bf16()
    assert widened_bf16_dots()  # the tile kernels' bf16 tl.dot, which this interpreter gets wrong
    quicker_device_calls()
g = torch.Generator().manual_seed(0)
results = []

def case(name, dtype, heads, dim, window, position, capacity, slots, ids, rate, gathered=False):
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)
    q, ring, new = rand(heads, dim) * 2, rand(window, dim), rand(dim)
    ring[position + 1 :] = float("nan")  # unwritten rows of a filling ring hold anything: masked, never read
    entries = None if capacity is None else rand(capacity, dim)
    if entries is not None and capacity > (position + 1) // rate:
        entries[(position + 1) // rate :] = float("nan")  # entries not complete yet: masked too
    pos = torch.tensor([position], device=device)
    sinks = torch.randn(heads, generator=g).to(device)
    picks = None if ids is None else torch.tensor(ids, device=device)
    ring_r = ring.clone()
    if gathered:  # the picked rows read out in their order (an fp8 store's read of them): row j is entry ids[j]
        entries = entries[picks.clamp(max=capacity - 1)]
    step = lambda ring: k.AttentionStep(q, ring, new, pos, entries, picks, slots, rate, sinks, dim ** -0.5,
                                        gathered=gathered)
    fits = k.fits(step(ring))
    ref = k.attend_reference(step(ring_r))
    for kernel in k.KERNELS:  # one program a head, the split kernels, the tile kernels
        ring_k = ring.clone()
        ours = k.attend_triton(step(ring_k), kernel)
        results.append({"case": name, "kernel": kernel, "dtype": str(dtype), "fits": fits,
                        "finite": bool(ours.isfinite().all()), "nearest": nearest,
                        "error": float((ours.double() - ref.double()).norm() / ref.double().norm()),
                        "ring": bool(torch.equal(ring_k.nan_to_num(), ring_r.nan_to_num()))})

for dtype in (torch.float32, torch.bfloat16):
    case("filling ring, no entries", dtype, 4, 32, 8, 3, None, 0, None, 1)
    case("wrapped ring", dtype, 20, 64, 16, 40, None, 0, None, 1)
    case("entries, some complete", dtype, 20, 64, 16, 40, 16, 16, None, 4)
    case("top-k picks, some not complete", dtype, 20, 64, 16, 40, 16, 5, [0, 3, 9, 12, 2], 4)
    case("top-k picks read out", dtype, 20, 64, 16, 40, 16, 5, [0, 3, 9, 12, 2], 4, gathered=True)
    case("store shorter than the slots", dtype, 16, 32, 40, 100, 3, 16, None, 8)
    case("empty store", dtype, 16, 32, 40, 100, 0, 16, None, 8)
    case("no entry complete yet", dtype, 16, 32, 8, 2, 4, 16, None, 8)
    # Several of the split kernels' chunks: a window past one chunk (not a multiple of it), many slots, many picks.
    case("long window, filling", dtype, 4, 32, 130, 100, None, 0, None, 1)
    case("many entries, some complete", dtype, 4, 64, 40, 1000, 300, 290, None, 4)
    case("many top-k picks", dtype, 4, 32, 16, 600, 300, 150, list(range(0, 300, 2)), 4)
    # The tile kernels' groups of keys (partials summed by a third launch), heads not a multiple of a tile's: 580
    # keys, past one group of 512 (the window's 130 and 382 slots, then a second group of 68 slots ending in a
    # partial block); every group past the first runs the same code, so more keys only take the interpreter longer.
    case("groups of keys", dtype, 20, 64, 130, 1799, 500, 450, None, 4)
print(json.dumps(results))
"""


def _assert_results(results: list[dict], bf16_bound: float) -> None:
    assert len(results) == 2 * 3 * 12  # two dtypes, three kernels, twelve cases
    for r in results:
        # bf16 roundings to nearest (CUDA; the interpreter made to round so): measured 0 interpreted, the torch
        # ops' bits; else the interpreter's truncation of the logits twice and the probabilities, measured <= 1.7%.
        bound = 1e-5 if "float32" in r["dtype"] else bf16_bound if r["nearest"] else 3e-2
        assert r["fits"] and r["finite"] and r["ring"], r
        assert r["error"] < bound, r


def test_the_attention_kernel_matches_the_torch_ops_interpreted():
    _assert_results(run_kernel_check(_CHECK, "cpu"), bf16_bound=2.0**-8)


@pytest.mark.gpu
def test_the_attention_kernel_matches_the_torch_ops_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    results = run_kernel_check(_CHECK, "cuda")
    print({r["case"] + " " + r["dtype"]: f"{r['error']:.1e}" for r in results})
    _assert_results(results, bf16_bound=1e-2)


def test_the_attention_falls_back_where_the_kernel_does_not_fit():
    from moetier.kernels import v4_attention as k

    q, ring, new, sinks = torch.randn(4, 24), torch.randn(8, 24), torch.randn(24), torch.randn(4)
    pos = torch.tensor([3])

    def step(q, ring, new, pos):
        return k.AttentionStep(q, ring, new, pos, None, None, 0, 1, sinks, 0.1)

    assert not k.fits(step(q, ring, new, pos))  # 24 channels: not a power of two
    assert not k.fits(step(q.double(), ring.double(), new.double(), pos))
    q, ring, new = torch.randn(4, 32), torch.randn(8, 32), torch.randn(32)
    assert k.fits(step(q, ring, new, pos))
    assert not k.fits(step(q, ring, new, pos.int()))  # int64 positions only
    entries = torch.randn(k.MAX_KEYS, 32)
    many = k.AttentionStep(q, ring, new, pos, entries, None, k.MAX_KEYS - ring.shape[0], 4, sinks, 0.1)
    assert k.fits(many) and not k.fits(k.AttentionStep(*many.parts()[:6], k.MAX_KEYS, *many.parts()[7:]))
    ours, ref = ring.clone(), ring.clone()
    got = k.attend(step(q, ours, new, pos))  # on the CPU: the torch ops
    assert torch.equal(got, k.attend_reference(step(q, ref, new, pos)))
    assert torch.equal(ours, ref) and torch.equal(ours[3], new)


@pytest.mark.parametrize(
    ("choice", "entries", "expected"),
    [("auto", 16, "tiles"), ("auto", 16384, "tiles"), ("auto", 16385, "torch"), ("split", 1024, "split"),
     ("split", 1025, "torch"),
     ("no-split", 64, "per-head"), ("no-split", 200, "torch"), ("nonsense", 200, "tiles")],
)  # fmt: skip
def test_the_kernel_choice_follows_the_key_count_and_the_knob(monkeypatch, caplog, choice, entries, expected):
    """auto: the tile kernels to MAX_KEYS keys, then the torch ops; the knob's A/B values: split (the split kernels to
    SPLIT_KEYS keys), no-split (one program a head to PER_HEAD_KEYS); an unknown value is "auto"."""
    from moetier.kernels import v4_attention as k
    from moetier.kernels import v4_attention_tiles

    ran: list[str] = []
    monkeypatch.setenv("MOETIER_V4_ATTENTION", choice)
    monkeypatch.setattr(k, "triton_usable", lambda q: True)
    monkeypatch.setattr(k, "_WARNED_CHOICES", set())
    for name, fn in (("split", "attend_split"), ("per-head", "attend_per_head"), ("torch", "attend_reference")):
        monkeypatch.setattr(k, fn, lambda step, name=name: ran.append(name))
    monkeypatch.setattr(v4_attention_tiles, "attend_tiles", lambda step: ran.append("tiles"))
    ring = torch.randn(128, 32)
    step = k.AttentionStep(torch.randn(4, 32), ring, torch.randn(32), torch.tensor([3]), torch.randn(entries, 32),
                           None, entries, 4, torch.randn(4), 0.1)  # fmt: skip
    with caplog.at_level("WARNING", logger=k.__name__):
        k.attend(step)
        k.attend(step)
    assert ran == [expected] * 2 and not k._BROKEN
    warned = [r.getMessage() for r in caplog.records if "MOETIER_V4_ATTENTION" in r.getMessage()]
    assert len(warned) == (choice == "nonsense"), warned  # once a value, and only for an unknown one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_attention_kernel")
    tiny_model(path)
    return path


@pytest.mark.parametrize("capacities", [(128, 128, 128), (96, 64, 80)], ids=["equal", "mixed"])
@torch.no_grad()
def test_the_step_through_the_kernels_path_matches_the_eager_core(checkpoint, capacities, monkeypatch):
    """Every sequence's attention through the attention kernel's call and each compressor's step through the compressor
    kernel's per-sequence call (the kernels' torch references standing in for them on the CPU): rings wrap, CSA /
    HCA windows close, CSA picks among more entries than its top-k."""
    from moetier.kernels import v4_attention as k
    from moetier.kernels import v4_compress

    calls, compressed = [], []
    monkeypatch.setattr(k, "usable", lambda q: True)
    monkeypatch.setattr(v4_compress, "usable", lambda x: True)
    monkeypatch.setattr(k, "attend", _counted(k.attend, calls))
    monkeypatch.setattr(v4_compress, "compress_decode", _counted(v4_compress.compress_decode, compressed))
    model = tiny_model(checkpoint)
    generator = torch.Generator().manual_seed(9)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in PROMPTS]
    worst, _, _ = _decode_both(model, prompts, capacities, 40, generator, 1e-5)
    assert len(calls) >= 40 * len(model.layers) * len(prompts)  # each sequence, every layer, every decode step
    assert len(compressed) >= 40 * len(prompts)  # each sequence's compressors, every step
    print(f"worst relative error, the kernel path vs the eager core: {worst:.2e}")


def _counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.gpu
@torch.no_grad()
def test_the_step_on_cuda_with_the_kernel_matches_the_torch_ops(checkpoint, monkeypatch):
    """bf16 on CUDA: the same decode with and without the kernels (attention, compressors), every step's logits
    within bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from moetier.config import ModelLoadConfig
    from moetier.kernels import v4_attention as k
    from moetier.kernels import v4_compress
    from moetier.weights.loader import load_model

    model = load_model(checkpoint, ModelLoadConfig(dtype=torch.bfloat16, device="cuda"), progress=False).model
    generator = torch.Generator().manual_seed(4)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator).cuda() for n in PROMPTS]
    runs = {}
    for name, usable in (("kernel", k.usable), ("torch", lambda q: False)):
        monkeypatch.setattr(k, "usable", usable)
        monkeypatch.setattr(v4_compress, "usable", usable)
        caches = [model.new_cache(128) for _ in prompts]
        for prompt, cache in zip(prompts, caches, strict=True):
            model(prompt, cache)
        step_gen = torch.Generator().manual_seed(7)
        runs[name] = []
        for _ in range(40):
            tokens = torch.randint(0, vocab, (len(prompts),), generator=step_gen).cuda()
            runs[name].append(model.compute_logits(model(tokens, caches, [1] * len(prompts))).float())
    assert not k._BROKEN and not v4_compress._BROKEN
    errors = [relative_error(a, b) for a, b in zip(runs["kernel"], runs["torch"], strict=True)]
    print(f"bf16 logits, kernel vs torch ops: worst relative error {max(errors):.2e}")
    assert max(errors) < 2e-2


@torch.no_grad()
def test_fp8_entry_stores_take_the_kernel_path_with_their_rows_read_out(checkpoint, monkeypatch):
    """fp8 entries: the kernel path reads an fp8 store's bucket, or its CSA picks, out as the torch path does (its
    stand-in reference on the CPU), and attends them: the same logits as the torch path over the same stores."""
    from moetier.kernels import v4_attention as k

    model = tiny_model(checkpoint)
    generator = torch.Generator().manual_seed(5)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in PROMPTS]
    steps = [torch.randint(0, vocab, (len(prompts),), generator=generator) for _ in range(24)]
    calls, runs = [], {}
    for name, usable in (("kernel", lambda q: True), ("torch", lambda q: False)):
        monkeypatch.setattr(k, "usable", usable)
        monkeypatch.setattr(k, "attend", _counted(k.attend, calls))
        caches = [model.new_cache(96, kv_dtype="fp8") for _ in prompts]
        for prompt, cache in zip(prompts, caches, strict=True):
            model(prompt, cache)
        runs[name] = [model.compute_logits(model(t, caches, [1] * len(prompts))) for t in steps]
    assert len(calls) >= 24 * len(model.layers) * len(prompts)  # the kernel run's calls; the torch run makes none
    worst = max(relative_error(a, b) for a, b in zip(runs["kernel"], runs["torch"], strict=True))
    assert worst < 1e-5, worst
