"""The V4 router kernels (moetier.kernels.v4_router) against the torch ops of ``Router`` they replace.

Cases: bf16 and float32 models (and bf16 activations with a float32 weight), E=256 H=512 k=6 (one block of the
hidden dim), E=16 H=64 k=3 (4 blocks of 16) and E=62 H=96 k=16 (2 blocks of 64, the second half masked, and the
last program's 2 last experts), 1, 3 and 16 tokens, learned (with a bias) and hashed routers, both score
functions. The inputs are drawn so that the k-th and (k+1)-th largest ``score + bias`` of every token are at least
1e-3 apart: the logits differ by the order of their float32 sums, so a near tie could pick another expert.
Checked: the id sets per token equal the torch ops', the kernel's ids in descending ``score + bias``, the weights
at the same ids, the logits against ``F.linear(x.float(), w.float())`` relative to ``sum |x * w|``, and ``Router``
taking the kernels for these inputs. Triton's interpreter truncates float32 to bf16 (CUDA rounds to nearest
even), so the CPU check gives it torch's rounding for that conversion. Measured interpreted: logits within 1.7e-7
(allowed 1e-5); bf16 weights bit for bit (allowed one rounding, 2^-7); float32 weights within 9.1e-7 relative (up
to 2.1e-6 over other seeds: a logit's error is relative to ``sum |x * w|``, and a small score's relative error is
its derivative's times that over the score), allowed 4e-6.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from reference import run_kernel_check

_CHECK = """
import json, sys
from types import SimpleNamespace
import torch
import torch.nn.functional as F
from moetier.kernels import v4_router as k
from moetier.models.deepseek_v4 import Router

device = sys.argv[1]
if device == "cpu":  # the interpreter truncates float32 to bf16: round to nearest even, as CUDA does
    from interpreted import nearest_bf16, quicker_device_calls

    nearest_bf16()
    quicker_device_calls()
g = torch.Generator().manual_seed(0)
results = []
VOCAB = 50


def router(experts, hidden, top_k, hashed, score, dtype):
    cfg = SimpleNamespace(num_experts_per_tok=top_k, scoring_func=score, routed_scaling_factor=2.5,
                          n_routed_experts=experts, hidden_size=hidden, vocab_size=VOCAB)
    r = Router(cfg, hashed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(experts, hidden, generator=g) * 1.5 / hidden**0.5)
        if hashed:
            r.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(VOCAB)]))
        else:
            r.bias.copy_(torch.randn(experts, generator=g) * 0.1)
    r.to(device)
    r.weight.data = r.weight.data.to(dtype)  # the bias stays float32, as the loader keeps it
    return r


def keys(r, x):  # score + bias, the torch ops'
    return r._scores(x) + r.bias.float()


def draw(r, tokens, hidden, dtype):  # x whose k-th and (k+1)-th keys are apart
    for _ in range(100):
        x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
        if r.hashed:
            return x
        top = keys(r, x).topk(r.top_k + 1, dim=-1).values
        if bool(((top[:, -2] - top[:, -1]) > 1e-3).all()):
            return x
    raise AssertionError("no untied inputs")


def by_id(ids, weights):
    order = ids.argsort(dim=1)
    return ids.gather(1, order), weights.gather(1, order)


shapes = [(256, 512, 6, 1024), (16, 64, 3, 16), (62, 96, 16, 64)]  # experts, hidden, k, hidden block
models = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
with torch.no_grad():
    for x_dtype, w_dtype in models:
        for experts, hidden, top_k, block in shapes:
            if (x_dtype, w_dtype) == (torch.bfloat16, torch.float32) and experts != 62:
                continue
            k.HIDDEN_BLOCK = block
            for hashed in (False, True):
                for score in ("sqrtsoftplus", "sigmoid"):
                    r = router(experts, hidden, top_k, hashed, score, w_dtype)
                    for tokens in (1, 3, 16):
                        # The interpreter's time is per program: 64 experts a program there past one token (E=256
                        # still 4 programs a token, E=62 its 2 last masked; one token keeps CUDA's 4).
                        k.EXPERTS_PER_PROGRAM = 4 if device == "cuda" or tokens == 1 else 64
                        x = draw(r, tokens, hidden, x_dtype)
                        input_ids = torch.randint(0, VOCAB, (tokens,), generator=g).to(device)
                        bias, table = (None, r.tid2eid) if hashed else (r.bias, None)
                        fits = k.fits(x, r.weight, bias, table, input_ids, top_k, score)
                        ids, weights = k.route_triton(x, r.weight, bias, table, input_ids, top_k, r.scaling, score)
                        ref_ids, ref_weights = r._forward_torch(x, input_ids)
                        ours_sorted, ours_w = by_id(ids, weights)
                        ref_sorted, ref_w = by_id(ref_ids, ref_weights)
                        a, b = ours_w.float(), ref_w.float()
                        rel = float(((a - b).abs() / b.abs()).max())
                        bound = 2.0 ** -7 if x_dtype == torch.bfloat16 else 4e-6
                        if hashed:
                            descending = True
                        else:
                            picked = keys(r, x).gather(1, ids)
                            descending = bool((picked[:, :-1] > picked[:, 1:]).all())
                        result = {
                            "case": f"{str(x_dtype)[6:]}/{str(w_dtype)[6:]} E{experts} H{hidden} k{top_k} T{tokens} "
                                    f"{'hashed' if hashed else 'learned'} {score}",
                            "fits": fits, "broken": list(k._BROKEN),
                            "ids": bool(torch.equal(ours_sorted, ref_sorted)), "descending": descending,
                            "dtypes": ids.dtype == torch.int64 and weights.dtype == x_dtype
                                      and ids.shape == weights.shape == (tokens, top_k),
                            "weights_rel": rel, "weights_equal": bool(torch.equal(a, b)), "within": rel <= bound,
                            "logits_rel": 0.0, "router_kernel": True, "select_kernel": True,
                        }
                        if not hashed and score == "sqrtsoftplus":  # the logits don't depend on the router kind
                            logits = k.logits_triton(x, r.weight)
                            ref_logits = F.linear(x.float(), r.weight.float())
                            scale = F.linear(x.float().abs(), r.weight.float().abs())
                            result["logits_rel"] = float(((logits - ref_logits).abs() / scale).max())
                        if tokens == 3:  # the Router takes the kernels (a fresh run: the same bits)
                            routed = r(x, input_ids)
                            same = torch.equal(routed[0], ids) and torch.equal(routed[1], weights)
                            result["router_kernel"] = bool(same)
                            selected = r.select(x, input_ids)
                            result["select_kernel"] = bool(torch.equal(selected, ref_ids if hashed else ids))
                        results.append(result)
    # Inputs the kernels do not take run the reference (a marker here): 17 tokens, softmax, 17 picks.
    r = router(64, 32, 4, False, "sqrtsoftplus", torch.float32)
    x = torch.randn(17, 32, generator=g).to(device)
    marker = (torch.zeros(1), torch.ones(1))

    def taken(x, top_k, score):
        return k.route(x, r.weight, r.bias, None, None, top_k, 1.0, score, lambda: marker) is marker

    results.append({"case": "fallback", "fits": False, "broken": list(k._BROKEN),
                    "taken": [taken(x, 4, "sqrtsoftplus"), taken(x[:3], 4, "softmax"), taken(x[:3], 17, "sigmoid"),
                              k.select(x, r.weight, r.bias, 4, "sigmoid", lambda: marker) is marker,
                              not taken(x[:3], 4, "sigmoid")]})  # this one fits: the kernels
print(json.dumps(results))
"""


def run_check(device: str) -> list[dict]:
    return run_kernel_check(_CHECK, device)


def _assert_results(results: list[dict]) -> None:
    assert len(results) == 2 * 3 * 12 + 12 + 1
    print("\n".join(f"{r['case']}: weights {r['weights_rel']:.1e} logits {r['logits_rel']:.1e}" for r in results[:-1]))
    for r in results[:-1]:
        assert r["fits"] and not r["broken"] and r["ids"] and r["descending"] and r["dtypes"], r
        assert r["within"] and r["logits_rel"] <= 1e-5 and r["router_kernel"] and r["select_kernel"], r
    assert all(results[-1]["taken"]) and not results[-1]["broken"], results[-1]


def test_the_router_kernels_match_the_torch_ops_interpreted():
    _assert_results(run_check("cpu"))


@pytest.mark.gpu
def test_the_router_kernels_match_the_torch_ops_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _assert_results(run_check("cuda"))


def _router(hashed: bool, score: str, dtype: torch.dtype, experts: int = 16, hidden: int = 32, top_k: int = 4):
    from moetier.models.deepseek_v4 import Router

    g = torch.Generator().manual_seed(1)
    cfg = SimpleNamespace(num_experts_per_tok=top_k, scoring_func=score, routed_scaling_factor=2.5,
                          n_routed_experts=experts, hidden_size=hidden, vocab_size=40)  # fmt: skip
    r = Router(cfg, hashed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(experts, hidden, generator=g) / hidden**0.5)
        if hashed:
            r.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(40)]))
        else:
            r.bias.copy_(torch.randn(experts, generator=g) * 0.1)
    r.weight.data = r.weight.data.to(dtype)
    return r, torch.randn(5, hidden, generator=g).to(dtype), torch.randint(0, 40, (5,), generator=g)


_SCORES = {"sqrtsoftplus": lambda v: F.softplus(v).sqrt(), "sigmoid": torch.sigmoid, "softmax": lambda v: v.softmax(-1)}


@torch.no_grad()
def test_the_router_is_the_torch_ops_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for hashed in (False, True):
        for score in _SCORES:
            for dtype in (torch.float32, torch.bfloat16):
                r, x, input_ids = _router(hashed, score, dtype)
                scores = _SCORES[score](F.linear(x.float(), r.weight.float()))  # the torch ops, as before
                if hashed:
                    ids = r.tid2eid[input_ids].long()
                else:
                    ids = torch.topk(scores + r.bias.float(), r.top_k, dim=-1, sorted=False).indices
                weights = scores.gather(1, ids)
                weights = (weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * r.scaling).to(dtype)
                got_ids, got_weights = r(x, input_ids)
                assert torch.equal(got_ids, ids) and got_weights.dtype == dtype
                assert torch.equal(got_weights.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   weights.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
                assert torch.equal(r.select(None if hashed else x, input_ids), ids)


@torch.no_grad()
def test_inputs_the_kernels_do_not_take_run_the_torch_ops(monkeypatch):
    from moetier.kernels import v4_router as k

    r, x, input_ids = _router(False, "sigmoid", torch.bfloat16)
    assert k.fits(x, r.weight, r.bias, None, None, 4, "sigmoid")
    big = torch.randn(17, 32).to(torch.bfloat16)
    assert not k.fits(big, r.weight, r.bias, None, None, 4, "sigmoid")  # a prefill chunk
    assert not k.fits(x, r.weight, r.bias, None, None, 4, "softmax")
    assert not k.fits(x, r.weight, r.bias, None, None, 17, "sigmoid")
    assert not k.fits(x, r.weight, r.bias, None, None, 32, "sigmoid")  # more picks than experts
    assert not k.fits(torch.randn(3, 64)[:, ::2], r.weight, r.bias, None, None, 4, "sigmoid")  # strided
    assert not k.fits(x.double(), r.weight, r.bias, None, None, 4, "sigmoid")
    assert not k.fits(x, torch.randn(1025, 32), torch.zeros(1025), None, None, 4, "sigmoid")
    assert not k.fits(x, r.weight, None, None, None, 4, "sigmoid")  # neither learned nor hashed
    table = torch.zeros(40, 4, dtype=torch.long)
    assert k.fits(x, r.weight, None, table, input_ids, 4, "sigmoid")
    assert not k.fits(x, r.weight, None, table, input_ids[:3], 4, "sigmoid")  # ids for other tokens
    # With Triton taken as usable, what does not fit still runs the reference, and nothing is marked broken.
    monkeypatch.setattr(k, "triton_usable", lambda _: True)
    marker = (torch.zeros(1), torch.ones(1))
    assert k.route(big, r.weight, r.bias, None, None, 4, 1.0, "sigmoid", lambda: marker) is marker
    assert k.route(x, r.weight, r.bias, None, None, 4, 1.0, "softmax", lambda: marker) is marker
    assert k.select(big, r.weight, r.bias, 4, "sigmoid", lambda: marker) is marker
    assert not k._BROKEN
    for score in ("softmax",):  # the Router itself: an unknown score function is its torch ops
        r, x, input_ids = _router(False, score, torch.float32)
        assert torch.equal(r(x, input_ids)[0], r._forward_torch(x, input_ids)[0])
