"""The fused KV read (gather + fp8 dequantisation) against the eager read, contiguous and paged.

On CPU the kernel runs under Triton's interpreter, chosen before Triton is imported: in a subprocess.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_CHECK = """
import json, torch
import moetier.kernels.kv_read as k
from moetier.models.cache import KVRows, kv_rows
from moetier.models.paged_kv import PagedKVSpace, paged_kv

DEVICE = {device!r}
results = []
g = torch.Generator().manual_seed(0)
for lead, width, kv_dtype, groups in [((), 12, "fp8", (4, 8)), ((3,), 8, "fp8", None), ((2,), 16, "fp8", (16,))]:
    for layout in ("contiguous", "paged"):
        space = PagedKVSpace(DEVICE, block_tokens=4) if layout == "paged" else None
        with paged_kv(space):
            store = kv_rows(lead, 64, width, torch.bfloat16, DEVICE, kv_dtype, groups)
        end = 0
        for n in (5, 1, 9):
            store.write(end, (torch.randn(*lead, n, width, generator=g) * 3).to(torch.bfloat16).to(DEVICE))
            end += n
        calls = []
        original = k.read_rows
        some = torch.tensor([end - 1, 0, 3], device=DEVICE)
        k.read_rows = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        fused, fused_some = store.read(end), store.read_at(some)
        k.read_rows = original
        k._BROKEN.append("eager reference")
        eager, eager_some = store.read(end), store.read_at(some)
        k._BROKEN.clear()
        fused, eager = torch.cat([fused, fused_some], dim=-2), torch.cat([eager, eager_some], dim=-2)
        results.append({{"layout": layout, "lead": list(lead), "fused_calls": len(calls),
                         "shape_ok": list(fused.shape) == list(eager.shape), "dtype": str(fused.dtype),
                         "max_abs": (fused.float() - eager.float()).abs().max().item(),
                         "max_ulps": ((fused.float() - eager.float()).abs() / eager.float().abs().clamp_min(1e-30)
                                      ).max().item() * 128}})
print(json.dumps(results))
"""


def _run(device: str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    code = _CHECK.format(device=device)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(results: list[dict], exact: bool) -> None:
    assert len(results) == 6
    for r in results:
        assert r["fused_calls"] == 2 and r["shape_ok"] and r["dtype"] == "torch.bfloat16", r
        if exact:  # the same float32 product, rounded once
            assert r["max_abs"] == 0.0, r
        else:  # the interpreter truncates float32 -> bf16 where CUDA rounds: within one bf16 step
            assert r["max_ulps"] <= 1.0001, r


def test_fused_kv_read_equals_the_eager_read_under_the_interpreter():
    _check(_run("cpu"), exact=False)


@pytest.mark.gpu
def test_fused_kv_read_equals_the_eager_read_on_cuda():
    _check(_run("cuda"), exact=True)
