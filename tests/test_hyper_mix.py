"""The two mHC kernels (``moetier.kernels.hyper_mix``) against the eager mixing, by Triton's interpreter on CPU.

The interpreter must be chosen before Triton is imported, so the kernels run in a subprocess; the same
checks run on CUDA in the GPU suite (``-m gpu``). Every case is compared with the eager reference computed
in float64 from the same inputs, and the bf16 kernel is held to the eager bf16 path's own error.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from reference import run_kernel_check

pytest.importorskip("triton")

_CHECK = """
import json, sys, torch
import moetier.kernels.hyper_mix as k
device = sys.argv[1]
results = []
def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
for dtype in (torch.float32, torch.bfloat16):
    for case in ("plain", "merge", "merge_extra", "comb_only", "head", "wide"):
        g = torch.Generator().manual_seed(len(case) + (dtype == torch.bfloat16))
        # "wide": a row wider than one block of the finishing kernel (its two-pass collapse and norm)
        tokens, hc, hidden = {"head": (2, 4, 130), "wide": (1, 4, 8200)}.get(case, (3, 4, 200))
        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)
        iters = 0 if case == "head" else 20
        mix = hc if case == "head" else (2 + hc) * hc
        mixing = k.Mixing(rnd(mix, hc * hidden, scale=0.05), rnd(mix, scale=0.5), rnd(1 if case == "head" else 3),
                          hc, iters, 1e-6, 1e-6)
        streams = rnd(tokens, hc, hidden).to(dtype)
        norm = 1 + rnd(hidden, scale=0.1)
        merge = None
        if case not in ("plain", "head", "wide"):
            comb = torch.softmax(rnd(tokens, hc, hc), -1)
            out = None if case == "comb_only" else rnd(tokens, hidden).to(dtype)
            extra = rnd(tokens, hidden).to(dtype) if case == "merge_extra" else None
            merge = k.Merge(torch.rand(tokens, hc, generator=g).to(device) * 2, comb, out, extra)
        ours = k.mix_triton(streams, mixing, norm, 1e-6, merge)
        same = k.mix_reference(streams, mixing, norm, 1e-6, merge)  # the eager path in this dtype
        d64 = k.Mixing(*(t.double() for t in (mixing.fn, mixing.base, mixing.scale)), hc, iters, 1e-6, 1e-6)
        m64 = merge and k.Merge(*(None if t is None else t.double() for t in
                                  (merge.post, merge.comb, merge.out, merge.extra)))
        ref = k.mix_reference(streams.double(), d64, norm.double(), 1e-6, m64)
        r = {"case": case, "dtype": str(dtype), "dispatched": k.triton_usable(streams, mixing),
             "x": rel(ours.x, ref.x), "x_eager": rel(same.x, ref.x),
             "streams": rel(ours.streams, ref.streams), "streams_eager": rel(same.streams, ref.streams),
             "x_dtype": str(ours.x.dtype), "none": [ours.post is None, ours.comb is None]}
        if ours.post is not None:
            r["post"], r["comb"] = rel(ours.post, ref.post), rel(ours.comb, ref.comb)
            r["comb_col"] = (ours.comb.sum(-2) - 1).abs().max().item()
        results.append(r)
print(json.dumps(results))
"""


def run_check(device: str) -> list[dict]:
    return run_kernel_check(_CHECK, device)


def assert_matches(results: list[dict], interpreted: bool) -> None:
    # Triton's interpreter truncates float32 -> bf16 (numpy has no round-to-nearest bf16): twice a rounding's error.
    slack = 3.5 if interpreted else 1.5
    assert len(results) == 12
    for r in results:
        assert r["dispatched"], r
        head = r["case"] == "head"
        assert r["none"] == [head, head], r
        assert r["x_dtype"] == r["dtype"], r
        if r["dtype"] == "torch.float32":
            assert r["x"] < 1e-5 and r["streams"] < 1e-6, r
            if not head:
                assert r["post"] < 1e-5 and r["comb"] < 1e-5 and r["comb_col"] < 1e-5, r
        else:  # bf16: about as far from float64 as the eager bf16 path is
            assert r["x"] < slack * r["x_eager"] + 2e-3, r
            assert r["streams"] < slack * r["streams_eager"] + 2e-3, r
            if not head:
                assert r["post"] < 2e-3 and r["comb"] < 2e-3, r  # gates of the (rounded) merged streams


def test_mix_kernels_match_the_eager_mixing_interpreted():
    assert_matches(run_check("cpu"), interpreted=True)


@pytest.mark.gpu
def test_mix_kernels_match_the_eager_mixing_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert_matches(run_check("cuda"), interpreted=False)


def test_dispatch_stays_eager_off_cuda():
    import moetier.kernels.hyper_mix as k

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter forced for the whole run")
    mixing = k.Mixing(torch.randn(24, 4 * 8), torch.randn(24), torch.randn(3), 4, 20, 1e-6, 1e-6)
    streams = torch.randn(2, 4, 8)
    assert not k.triton_usable(streams, mixing)
    got, ref = k.hyper_mix(streams, mixing, torch.ones(8), 1e-6), k.mix_reference(streams, mixing, torch.ones(8), 1e-6)
    assert torch.equal(got.x, ref.x) and torch.equal(got.comb, ref.comb)


def test_mixing_refuses_weights_of_the_wrong_size():
    import moetier.kernels.hyper_mix as k

    with pytest.raises(ValueError, match="expected 24"):
        k.Mixing(torch.randn(20, 32), torch.randn(20), torch.randn(3), 4, 20, 1e-6, 1e-6)


_DECODE = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from test_deepseek_v4 import save_tiny_v4
from moetier.config import ModelLoadConfig
from moetier.kernels import grouped_experts, hyper_mix, kv_read, rmsnorm, rope_rotate, sinkhorn, swiglu
from moetier.kernels import v4_attention, v4_compress, v4_router
from moetier.weights.loader import load_model
from interpreted import quicker_device_calls

quicker_device_calls()
# Slow interpreted, tested on their own (and run alike in both decodes: the mix kernels are what differs); the V4
# attention, compressor, router, rotation and SwiGLU kernels were ~80% of this test's time.
for module in (grouped_experts, kv_read, rmsnorm, sinkhorn, v4_attention, v4_compress, v4_router, rope_rotate, swiglu):
    module._BROKEN.append("off in this test")
rope_rotate._ANGLES_BROKEN.append("off in this test")
save_tiny_v4(sys.argv[1], torch.float32)
model = load_model(sys.argv[1], ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False).model
calls = []
original = hyper_mix.mix_triton
hyper_mix.mix_triton = lambda *a, **kw: calls.append(1) or original(*a, **kw)

@torch.no_grad()
def run():
    g = torch.Generator().manual_seed(4)
    caches = [model.new_cache(48) for _ in range(3)]
    for i, cache in enumerate(caches):
        model(torch.randint(0, model.embed.num_embeddings, (9 + 5 * i,), generator=g), cache)
    tokens, logits = torch.randint(0, model.embed.num_embeddings, (3,), generator=g), []
    for _ in range(6):  # three sequences a step: the whole-layer decode with each sublayer's merge fused
        step = model.compute_logits(model(tokens, caches, [1, 1, 1]))
        logits.append(step)
        tokens = step.argmax(-1)
    return torch.stack(logits)

fused = run()
used = len(calls)
hyper_mix._BROKEN.append("eager twin")
eager = run()
same = torch.equal(fused.argmax(-1), eager.argmax(-1))
rel = ((fused - eager).double().norm() / eager.double().norm()).item()
print(json.dumps({"calls": used, "eager_calls": len(calls) - used, "same_tokens": same, "rel": rel}))
"""


def test_v4_decode_with_the_mix_kernels_matches_the_eager_decode(tmp_path):
    """The kernels inside the real decode step (interpreted): every sublayer boundary, the carried MoE merge and
    the final head, against the same model decoding eagerly."""
    tests = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _DECODE, str(tmp_path), tests], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    layers = 5  # tiny V4: two boundaries a layer and the head, every step (prefill stays eager)
    assert result["calls"] == 6 * (2 * layers + 1) and result["eager_calls"] == 0, result
    assert result["same_tokens"] and result["rel"] < 1e-5, result
