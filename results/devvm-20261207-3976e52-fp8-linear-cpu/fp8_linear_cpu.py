import json, platform, statistics, subprocess, sys, time
import torch
from moetier.kernels import fp8_linear as k
torch.manual_seed(0)
w = torch.randn(4096, 4096) * 0.02
values = w.to(torch.float8_e4m3fn)
scale = torch.rand(32, 32) + 0.5
x = torch.randn(1, 4096, dtype=torch.bfloat16)
dense = k.dequantized(values, scale, (128, 128), torch.bfloat16)
def times(f, n=20):
    f(); out = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); out.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(out), "min_ms": min(out), "max_ms": max(out), "repeats": n}
fp8 = times(lambda: k.fp8_linear(x, values, scale, (128, 128)))
dense_t = times(lambda: torch.nn.functional.linear(x, dense))
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(json.dumps({"git_sha": sys.argv[1], "what": "a 4096x4096 backbone linear at one bf16 token on the CPU: fp8-block "
                  "(dequantised each call, moetier.kernels.fp8_linear) against the weight dequantised once (F.linear)",
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": model, "python": platform.python_version(),
                  "fp8_per_call": fp8, "dense": dense_t, "ratio": fp8["median_ms"] / dense_t["median_ms"]}, indent=1))
