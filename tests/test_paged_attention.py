"""Decode attention over paged KV read in place (moetier.kernels.paged_attention) against the gather path.

On CPU the kernel runs under Triton's interpreter, chosen before Triton is imported: in a subprocess
(``_run_script``, shared with the grouped-kernel tests). The interpreter's low-precision dot is wrong, so
there the kernel computes in IEEE float32 and its bf16 output is truncated rather than rounded: bf16 is
judged against a float64 reference next to the gather path's own bf16 error. ``gpu`` twins run the same
checks on CUDA, plus a 32k-token sequence and a batch of 4, and a microbenchmark against gather + matmul.
"""

import json
import os

import pytest
import torch
from test_grouped_experts import _run_script

pytest.importorskip("triton")

# Builds paged stores, writes random rows (sequences of different lengths, one copied from another so
# that they share blocks, then grown past the copy: copy-on-write), runs the kernel three ways (the
# model's entry with its own split count, one split, three splits) and compares each with a float64
# softmax over the rows the gather path reads back, and with the gather path itself.
_SETUP = """
import json, math, torch
import moetier.kernels.kv_read as kv_read
import moetier.kernels.paged_attention as pa
from moetier.models.cache import kv_rows
from moetier.models.paged_kv import PagedKVSpace, paged_kv
from moetier.models.qwen3_moe import padded_decode_attention

DEVICE = {device!r}
kv_read._BROKEN.append("eager reads for the reference: the interpreted fused read is slow, and not under test")

def stores(space, lead, width, dtype, kv_dtype, groups, lengths, gen, copy_from=None):
    with paged_kv(space):
        made = [kv_rows(lead, max(lengths) + 8, width, dtype, DEVICE, kv_dtype, groups) for _ in lengths]
    for i, (store, n) in enumerate(zip(made, lengths)):
        rows = lambda t: (torch.randn(*lead, t, width, generator=gen) * 2).to(dtype).to(DEVICE)
        if copy_from is not None and i == copy_from[1]:  # shares the first blocks of another sequence
            shared = copy_from[2]
            made[i] = store = made[copy_from[0]].copy(max(lengths) + 8, shared)
            if n > shared:
                store.write(shared, rows(n - shared))
        else:
            start = 0
            for part in (n // 2, n - n // 2):  # two writes: the second lands mid-block
                if part:
                    store.write(start, rows(part))
                    start += part
    return made

def reference(q, keys, values, lengths, scale, rank=None):
    out = []
    for b, n in enumerate(lengths):
        k = keys[b].read(n).double()
        k = k if k.dim() == 3 else k[None]
        v = k[..., :rank] if values is None else values[b].read(n).double()
        qq = q[b].double().view(k.shape[0], -1, q.shape[-1])
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", qq, k) * scale, dim=-1)
        out.append(torch.einsum("hgn,hnd->hgd", probs, v).reshape(-1))
    return torch.stack(out)

def gathered(q, keys, values, lengths, scale, rank=None):
    positions = torch.tensor(lengths, device=DEVICE) - 1
    if values is None:  # MLA: as DeepseekV3Attention.decode_attend's gather path
        lat = [s.read(n) for s, n in zip(keys, lengths)]
        return padded_decode_attention(q, [l[None] for l in lat], [l[None, :, :rank] for l in lat], positions, scale)
    return padded_decode_attention(q, [s.read(n) for s, n in zip(keys, lengths)],
                                   [s.read(n) for s, n in zip(values, lengths)], positions, scale)

def case(name, dtype, kv_dtype, heads, kv_heads, dim, lengths, block, seed, rank=None, rope=0, copy=True):
    gen = torch.Generator().manual_seed(seed)
    space = PagedKVSpace(DEVICE, block_tokens=block)
    # The last sequence starts as a copy of the first one's first rows (ending mid-block).
    copy_from = (0, len(lengths) - 1, min(lengths[0], lengths[-1]) * 2 // 3) if copy and len(lengths) > 1 else None
    if rank is None:
        keys = stores(space, (kv_heads,), dim, dtype, kv_dtype, None, lengths, gen, copy_from)
        values = stores(space, (kv_heads,), dim, dtype, kv_dtype, None, lengths, gen, copy_from)
        width = dim
    else:  # MLA latents: one row per token, the latent and its rope key in two scale groups
        keys = stores(space, (), rank + rope, dtype, kv_dtype, (rank, rope), lengths, gen, copy_from)
        values, width = None, rank + rope
    q = (torch.randn(len(lengths), heads, width, generator=gen)).to(dtype).to(DEVICE)
    scale = width ** -0.5
    lengths_dev = torch.tensor(lengths, device=DEVICE)
    usable = pa.paged_attention_usable(q, keys, values, d1=rank)
    outs = [pa.try_paged_attention(q, keys, values, lengths, lengths_dev, scale, d1=rank)]
    k_data, k_scales = keys[0].pool_rows()
    k_index = torch.cat([s.token_rows(n) for s, n in zip(keys, lengths)])
    v_args = (None, None, None)
    if values is not None:
        v_data, v_scales = values[0].pool_rows()
        v_args = (v_data, v_scales, torch.cat([s.token_rows(n) for s, n in zip(values, lengths)]))
    for splits in (1, 3):
        outs.append(pa.paged_decode_attention(q, k_data, k_scales, k_index, lengths_dev, max(lengths), scale,
                                              *v_args, d1=rank, splits=splits))
    ref = reference(q, keys, values, lengths, scale, rank).cpu()
    torch_out = gathered(q, keys, values, lengths, scale, rank).double().cpu()
    top = ref.abs().max().item()
    errors = [((o.double().cpu() - ref).abs().max().item() / top) for o in outs]
    return {{"name": name, "usable": usable, "broken": list(pa._BROKEN), "dtype": str(outs[0].dtype),
             "shape": list(outs[0].shape), "want_shape": list(ref.shape), "kernel_vs_ref": max(errors),
             "torch_vs_ref": (torch_out - ref).abs().max().item() / top,
             "shared_blocks": len(set(keys[0].blocks) & set(keys[-1].blocks)) if copy_from else None}}
"""

# name, dtype, kv_dtype, heads, kv_heads, head dim, lengths, block tokens, seed(, rank, rope)
_CASES = [
    ("fp32 gqa4", "float32", "auto", 8, 2, 16, [37, 1, 130], 16, 0),
    ("fp32 gqa1", "float32", "auto", 2, 2, 32, [70, 1, 9, 30], 4, 1),
    ("bf16 gqa4", "bfloat16", "auto", 8, 2, 16, [37, 1, 130], 16, 2),
    ("bf16 gqa1", "bfloat16", "auto", 2, 2, 32, [70, 1, 9, 30], 4, 3),
    ("fp8/bf16 gqa4", "bfloat16", "fp8", 8, 2, 16, [130, 1, 37], 16, 4),
    ("fp8/fp32 gqa1", "float32", "fp8", 2, 2, 32, [9, 1, 70], 4, 5),
    ("mla fp32", "float32", "auto", 4, 1, 0, [29, 1, 70], 8, 6, 32, 8),
    ("mla fp8/bf16", "bfloat16", "fp8", 4, 1, 0, [70, 1, 29], 8, 7, 32, 8),
]

# The same on CUDA at serving sizes: Qwen3-235B attention at 32k tokens (one stream: many splits), a batch of
# four, and DeepSeek-V3's MLA widths.
_GPU_CASES = [
    ("qwen3 bf16 32k", "bfloat16", "auto", 64, 4, 128, [32768], 64, 10),
    ("qwen3 fp8 32k", "bfloat16", "fp8", 64, 4, 128, [32768], 64, 11),
    ("qwen3 bf16 b4", "bfloat16", "auto", 64, 4, 128, [4000, 1, 777, 9000], 64, 12),
    ("qwen3 fp8 b4", "bfloat16", "fp8", 64, 4, 128, [9000, 4000, 1, 777], 64, 13),
    ("qwen3 fp32 b4", "float32", "auto", 32, 4, 128, [2048, 3, 1500, 100], 16, 14),
    ("v3 mla bf16 b4", "bfloat16", "auto", 128, 1, 0, [5000, 1, 300, 2049], 64, 15, 512, 64),
    ("v3 mla fp8 8k", "bfloat16", "fp8", 128, 1, 0, [8192], 64, 16, 512, 64),
]


def _run_cases(device: str, cases: list[tuple]) -> list[dict]:
    body = _SETUP.format(device=device) + (
        "results = []\n"
        f"for name, dt, kv, heads, kvh, dim, lengths, block, seed, *mla in {cases!r}:\n"
        "    rank, rope = mla if mla else (None, 0)\n"
        "    results.append(case(name, getattr(torch, dt), kv, heads, kvh, dim, lengths, block, seed, rank, rope))\n"
        "print(json.dumps(results))\n"
    )
    return _run_script(body, device)


def _check(results: list[dict], on_cuda: bool) -> None:
    for r in results:
        assert r["usable"] and not r["broken"] and r["shape"] == r["want_shape"], r
        assert r["shared_blocks"] is None or r["shared_blocks"] >= 1, r  # the copy still shares its first block
        if "float32" in r["dtype"]:  # IEEE float32 dots: the gather path's own float32 error
            assert r["kernel_vs_ref"] < 1e-5, r
        elif on_cuda:  # rounded once to bf16, from float32 scores: no worse than the gather path
            assert r["kernel_vs_ref"] < 1.5 * r["torch_vs_ref"] + 1e-3 and r["kernel_vs_ref"] < 0.02, r
        else:  # truncating interpreter: within a few times the gather path's error, far from garbage
            assert r["kernel_vs_ref"] < 3 * r["torch_vs_ref"] + 1e-2 and r["kernel_vs_ref"] < 0.03, r


def test_paged_attention_matches_the_gather_path_under_the_interpreter():
    _check(_run_cases("cpu", _CASES), on_cuda=False)


@pytest.mark.gpu
def test_paged_attention_matches_the_gather_path_on_cuda():
    _check(_run_cases("cuda", _CASES + _GPU_CASES), on_cuda=True)


# A tiny engine's greedy tokens on paged KV (the kernel serving every decode attention) against contiguous KV
# (the gather path), Qwen3 and DeepSeek-V3, model-dtype and fp8 KV.
_ENGINE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_engine import make_engine, random_prompt, run
import moetier.kernels.paged_attention as pa
from moetier.kernels import grouped_experts, hyper_mix, kv_read, rmsnorm, sinkhorn
from moetier.config import ModelLoadConfig
from moetier.engine.sampling import SamplingParams
from moetier.weights.loader import load_model

if {device!r} == "cpu":  # the other kernels run eagerly, as on the CPU CI: interpreted they are slow, not tested
    for module in (grouped_experts, hyper_mix, kv_read, rmsnorm, sinkhorn):
        module._BROKEN.append("off in this test")
calls = []
original = pa.paged_decode_attention
pa.paged_decode_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
results = []
loaded = {{}}
for family, kv_dtype in {runs!r}:
    if family not in loaded:
        loaded[family] = load_model({paths!r}[family], ModelLoadConfig(dtype=torch.float32, device={device!r}),
                                    progress=False)
    prompts = [random_prompt(n, seed=n, vocab=320) for n in (9, 21, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {{}}
    for layout in ("contiguous", "paged"):
        calls.clear()
        engine = make_engine(loaded[family], tokenizer=None, max_streams=3, kv_dtype=kv_dtype, kv_layout=layout,
                             kv_block_tokens=4)
        updates = run(engine, [(f"r{{i}}", p, params) for i, p in enumerate(prompts)])
        tokens[layout] = {{r: [t for u in ups for t in u.new_token_ids] for r, ups in updates.items()}}
    results.append({{"family": family, "kv_dtype": kv_dtype, "same": tokens["paged"] == tokens["contiguous"],
                     "kernel_calls": len(calls), "broken": list(pa._BROKEN)}})
print(json.dumps(results))
"""


def _run_engines(device: str, tmp_path, runs: list[tuple[str, str]]) -> list[dict]:
    """(family, kv_dtype) runs of the tiny engine, paged against contiguous."""
    from reference import save_tiny
    from test_deepseek_v3 import VARIANTS, tiny_v3_config
    from test_qwen3_moe import tiny_qwen3_config

    paths = {"qwen3_moe": str(tmp_path / "qwen3"), "deepseek_v3": str(tmp_path / "v3")}
    save_tiny(tiny_qwen3_config(), tmp_path / "qwen3")
    save_tiny(tiny_v3_config(**VARIANTS["q_lora"]), tmp_path / "v3")
    tests = os.path.dirname(__file__)
    return _run_script(_ENGINE.format(tests=tests, paths=paths, device=device, runs=runs), device)


def _check_engines(results: list[dict], runs: int) -> None:
    assert len(results) == runs
    for r in results:  # every layer (4) of every decode step (at least 4) of the paged run took the kernel
        assert r["same"] and r["kernel_calls"] >= 4 * 4 and not r["broken"], r


def test_engine_on_paged_kv_with_the_kernel_generates_what_contiguous_kv_does(tmp_path):
    runs = [("qwen3_moe", "auto"), ("qwen3_moe", "fp8"), ("deepseek_v3", "auto")]  # V3's fp8: the kernel cases
    _check_engines(_run_engines("cpu", tmp_path, runs), len(runs))


@pytest.mark.gpu
def test_engine_on_paged_kv_with_the_kernel_generates_what_contiguous_kv_does_on_cuda(tmp_path):
    runs = [(family, kv) for family in ("qwen3_moe", "deepseek_v3") for kv in ("auto", "fp8")]
    _check_engines(_run_engines("cuda", tmp_path, runs), len(runs))


def test_the_kernel_stays_off_without_cuda_or_the_interpreter(monkeypatch):
    import moetier.kernels.paged_attention as pa
    from moetier.models.cache import kv_rows
    from moetier.models.paged_kv import PagedKVSpace, paged_kv

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter forced for the whole run")
    with paged_kv(PagedKVSpace("cpu", block_tokens=4)):
        paged = [kv_rows((2,), 16, 8, torch.float32, "cpu") for _ in range(2)]
    contiguous = [kv_rows((2,), 16, 8, torch.float32, "cpu") for _ in range(2)]
    q = torch.randn(2, 4, 8)
    assert not pa.paged_attention_usable(q, paged, paged)  # CPU tensors, no interpreter: the gather path
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read per call
    assert pa.paged_attention_usable(q, paged, paged)
    assert not pa.paged_attention_usable(q, contiguous, contiguous)  # not paged
    assert not pa.paged_attention_usable(q[:, :3], paged, paged)  # 3 query heads over 2 KV heads
    assert not pa.paged_attention_usable(torch.randn(2, 4, 6), paged, paged)  # head width differs
    assert not pa.paged_attention_usable(q, paged, None)  # MLA needs the value width
    monkeypatch.setenv("MOETIER_TRITON", "0")
    assert not pa.paged_attention_usable(q, paged, paged)  # the switch that turns every kernel off


def test_one_long_stream_is_split_to_fill_the_gpu_and_a_big_batch_is_not():
    from moetier.kernels.paged_attention import choose_splits

    long_stream = choose_splits(programs=4, max_len=100_000, block_n=64, sm_count=132)  # Qwen3-235B, B=1
    assert 32 <= long_stream <= 128
    assert choose_splits(programs=4, max_len=100, block_n=64, sm_count=132) == 1  # too short to split
    assert choose_splits(programs=512, max_len=100_000, block_n=64, sm_count=132) == 1  # the batch fills it
    for max_len in (1, 63, 64, 65, 1000, 4097):
        splits = choose_splits(4, max_len, 64, 132)
        tiles = -(-max_len // 64)
        assert splits >= 1 and -(-tiles // -(-tiles // splits)) == splits  # no split left empty


# Microbenchmark (H200): gather + padded matmul (today's path) against the kernel, Qwen3-235B attention
# (64 query heads, 4 KV heads, head dim 128), bf16 and fp8 KV, 4k / 32k / 128k tokens, 1 and 4 streams.
# Prints a table; appends JSON lines to $MOETIER_RESULTS/paged_attention.jsonl when that is set.


def _bench_case(kv_dtype: str, tokens: int, batch: int) -> dict:
    import moetier.kernels.paged_attention as pa
    from moetier.models.cache import kv_rows
    from moetier.models.paged_kv import PagedKVSpace, paged_kv
    from moetier.models.qwen3_moe import padded_decode_attention

    heads, kv_heads, dim, dtype = 64, 4, 128, torch.bfloat16
    space = PagedKVSpace("cuda", block_tokens=64)
    with paged_kv(space):
        keys = [kv_rows((kv_heads,), tokens, dim, dtype, "cuda", kv_dtype) for _ in range(batch)]
        values = [kv_rows((kv_heads,), tokens, dim, dtype, "cuda", kv_dtype) for _ in range(batch)]
    for store in keys + values:
        for start in range(0, tokens, 8192):  # chunks: the fp8 quantisation's temporaries stay small
            n = min(8192, tokens - start)
            store.write(start, torch.randn(kv_heads, n, dim, device="cuda", dtype=dtype))
    q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
    lengths = [tokens] * batch
    lengths_dev = torch.tensor(lengths, device="cuda")
    positions = lengths_dev - 1
    scale = dim**-0.5

    def gather():
        ks = [s.read(n) for s, n in zip(keys, lengths, strict=True)]
        vs = [s.read(n) for s, n in zip(values, lengths, strict=True)]
        return padded_decode_attention(q, ks, vs, positions, scale)

    def kernel():
        return pa.try_paged_attention(q, keys, values, lengths, lengths_dev, scale)

    assert kernel() is not None, pa._BROKEN  # the kernel ran (None: it failed and turned itself off)
    timings = {name: _time_cuda(fn) for name, fn in (("gather_ms", gather), ("kernel_ms", kernel))}
    error = (kernel().float() - gather().float()).abs().max().item()
    kv_bytes = 2 * batch * tokens * keys[0].nbytes // tokens
    return {
        "kv_dtype": kv_dtype,
        "tokens": tokens,
        "batch": batch,
        "splits": pa.choose_splits(batch * kv_heads, tokens, 64, pa._sm_count(q.device)),
        **timings,
        "speedup": timings["gather_ms"] / timings["kernel_ms"],
        "kernel_gb_per_s": kv_bytes / timings["kernel_ms"] / 1e6,
        "max_abs_diff": error,
    }


def _time_cuda(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` on the current stream (after a warm-up call: compilation)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.gpu
def test_bench_paged_attention_against_gather_and_matmul():
    rows = []
    for kv_dtype in ("auto", "fp8"):
        for tokens in (4096, 32768, 131072):
            for batch in (1, 4):
                rows.append(_bench_case(kv_dtype, tokens, batch))
                torch.cuda.empty_cache()
    print("\nkv     tokens  B  splits  gather ms  kernel ms  speedup  kernel GB/s  max|diff|")
    for r in rows:
        print(
            f"{r['kv_dtype']:5} {r['tokens']:7d} {r['batch']:2d} {r['splits']:7d} {r['gather_ms']:10.3f} "
            f"{r['kernel_ms']:10.3f} "
            f"{r['speedup']:8.2f} {r['kernel_gb_per_s']:12.0f} {r['max_abs_diff']:10.2e}"
        )
    out = os.environ.get("MOETIER_RESULTS")
    if out:
        with open(os.path.join(out, "paged_attention.jsonl"), "a") as fh:
            for r in rows:
                fh.write(json.dumps({"bench": "paged_attention", **r}) + "\n")
    for r in rows:  # a sanity bar, not a speed bar: the numbers are the point
        assert r["max_abs_diff"] < 0.05, r
