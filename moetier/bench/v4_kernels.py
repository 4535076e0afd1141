"""``moetier bench v4-kernels``: DeepSeek-V4's decode kernels alone against the torch ops they replace, per call.

Each case runs one call of the kernel path and one of its torch reference on the same random inputs of
DeepSeek-V4-Flash's shapes (64 heads of 512, window 128, CSA rate 4 with a 512 top-k, HCA rate 128, 256 experts of
top-6 over a 4096 hidden, a 129k vocabulary). On CUDA each side is captured ``--calls`` times into one CUDA graph,
as a decode step replays them, and the graph's replays are timed with events: the device time per call including
the gaps between a graph's kernels, what a step pays. Off CUDA both sides run eagerly and the timings only smoke-test
the bench (the kernels run on CUDA only). The attention runs at several entry-slot counts (``--slots``), the
long-context question, through each of its kernels: one program a head (to 256 entries: its serial blocks per head
fall behind the torch ops' products past ~128), the split kernels and the tile kernels (the default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from moetier.bench.common import parse_names, write_receipt_files
from moetier.bench.environment import environment
from moetier.config import default_device
from moetier.engine.sampling import greedy_tokens
from moetier.errors import ConfigError
from moetier.kernels import fp8_linear, swiglu, v4_attention, v4_compress, v4_router
from moetier.models.cache import KVRows
from moetier.weights.checkpoint import one_line

CASES = ("attention", "compressor", "router", "swiglu", "greedy", "fp8-linear", "fp8-sweep")
DEFAULT_CASES = CASES[:-2]
# DeepSeek-V4-Flash's backbone linears as a decode step calls them (out features, in features, groups): the fused
# x projections of an HCA layer (wq_a + wkv + the compressor's two), wq_b, the grouped wo_a, wo_b, the shared
# expert's fused gate/up and its down.
FP8_LINEARS = {
    "x_proj": (2560, 4096, 1),
    "wq_b": (32768, 1024, 1),
    "wo_a": (8192, 4096, 8),
    "wo_b": (4096, 8192, 1),
    "shared gate_up": (4096, 4096, 1),
    "shared down": (4096, 2048, 1),
}
# Bytes of fp8 weights each fp8-linear case cycles through on CUDA: several times an H100's / H200's 50 MB of L2.
FP8_LINEAR_BYTES = 256 << 20
# Launch shapes the sweep tries at one token, beside the default (moetier.kernels.fp8_linear.LaunchShape).
FP8_SWEEP = [
    fp8_linear.LaunchShape(block_n=n, programs_wanted=p, stages=st)
    for n in (32, 64, 128) for p in (1, 2, 4) for st in (3, 4)
]  # fmt: skip
Side = Callable[[], Any]


def time_calls(fn: Side, device: torch.device, calls: int, rounds: int = 5) -> float:
    """Microseconds per call of ``fn``: the median of ``rounds`` replays of a CUDA graph of ``calls`` calls on CUDA
    (after an eager warm-up that compiles), of eager loops elsewhere."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def attention_sides(
    slots: int, picked: bool, kernel: str, device: torch.device, g: torch.Generator
) -> tuple[Side, Side]:
    """One sequence's attention past its window's fill, ``slots`` entries complete (CSA's ``picked`` top-k rows),
    through ``kernel`` (one of :data:`moetier.kernels.v4_attention.KERNELS`)."""
    heads, dim, window, rate = 64, 512, 128, 4 if picked else 128
    capacity = 4 * slots if picked else slots
    q, ring = _randn(heads, dim, device=device, g=g), _randn(window, dim, device=device, g=g)
    new, entries = _randn(dim, device=device, g=g), _randn(capacity, dim, device=device, g=g)
    position = torch.tensor([capacity * rate], device=device)
    ids = torch.randperm(capacity, generator=g)[:slots].to(device) if picked else None
    sinks = torch.randn(heads, generator=g).to(device)
    step = v4_attention.AttentionStep(q, ring, new, position, entries, ids, slots, rate, sinks, dim**-0.5)
    # On CUDA the kernel asked for, whatever the key count: where each should run is what this case measures.
    if device.type == "cuda":
        return lambda: v4_attention.attend_triton(step, kernel), lambda: v4_attention.attend_reference(step)
    return lambda: v4_attention.attend(step), lambda: v4_attention.attend_reference(step)


def compressor_sides(rate: int, dim: int, overlap: bool, device: torch.device, g: torch.Generator) -> tuple[Side, Side]:
    """One sequence's compressor step with 64 entries of capacity (the kernel pools every step, closing or not)."""
    width = 2 * dim if overlap else dim
    states = []
    for _ in range(2):  # the kernel's and the reference's own states
        open_rows = _randn(rate, 2 * width, device=device, g=g)
        prev_kv = _randn(1, rate, dim, device=device, g=g) if overlap else None
        prev_gate = _randn(1, rate, dim, device=device, dtype=torch.float32, g=g) if overlap else None
        states.append((open_rows, prev_kv, prev_gate, KVRows((), 64, dim, torch.bfloat16, device)))
    ape, weight = _randn(rate, width, device=device, dtype=torch.float32, g=g), torch.ones(dim, device=device)
    row, position = _randn(1, 2 * width, device=device, g=g), torch.tensor([5 * rate + rate // 2], device=device)
    table = torch.randn(64, 3, 64, generator=g).to(device)

    def step(state: tuple) -> v4_compress.CompressorStep:
        open_rows, prev_kv, prev_gate, entries = state
        return v4_compress.CompressorStep(
            open_rows, prev_kv, prev_gate, ape, weight, 1e-6, row, position, table, entries, overlap, rate, width, dim
        )

    ours, ref = step(states[0]), step(states[1])
    return lambda: v4_compress.compress_decode(ours), lambda: v4_compress.compress_decode_reference(ref)


def router_sides(tokens: int, hashed: bool, device: torch.device, g: torch.Generator) -> tuple[Side, Side]:
    """V4's decode router (the model's own :class:`Router`) of 256 experts over a 4096 hidden, top-6, learned (with
    its bias) or hashed: its forward (the kernels where they run) against its torch ops."""
    from moetier.models.deepseek_v4 import Router  # the bench's only model import

    cfg = SimpleNamespace(num_experts_per_tok=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                          n_routed_experts=256, hidden_size=4096, vocab_size=1024)  # fmt: skip
    router = Router(cfg, hashed).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hashed:
            router.tid2eid.copy_(torch.randint(0, 256, router.tid2eid.shape, generator=g))
        else:
            router.bias.copy_(torch.randn(256, generator=g))
    x, ids = _randn(tokens, 4096, device=device, g=g), torch.randint(0, 1024, (tokens,), generator=g).to(device)
    return lambda: router(x, ids), lambda: router._forward_torch(x, ids)


def swiglu_sides(tokens: int, device: torch.device, g: torch.Generator) -> tuple[Side, Side]:
    """The shared expert's clamped SwiGLU (2048 wide) on the halves of one fused projection's output."""
    both = _randn(tokens, 4096, device=device, g=g) * 6
    gate, up = both[:, :2048], both[:, 2048:]
    return lambda: swiglu.swiglu(gate, up, 10.0), lambda: swiglu.swiglu_reference(gate, up, 10.0)


def greedy_sides(rows: int, device: torch.device, g: torch.Generator) -> tuple[Side, Side]:
    """Greedy tokens of ``rows`` rows of V4's 129,280 logits (float32)."""
    logits = torch.randn(rows, 129_280, generator=g).to(device)
    return lambda: greedy_tokens(logits), lambda: logits.argmax(dim=-1)


Fp8Weights = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def fp8_weight_copies(shape: tuple[int, int, int], device: torch.device, g: torch.Generator) -> Fp8Weights:
    """(fp8 values, float32 tile scales, the bf16 weight dequantised at load) copies of a random ``[out, in]``
    weight: on CUDA enough that together they outgrow the device's L2 cache (``FP8_LINEAR_BYTES``), else one."""
    n, k, _ = shape
    copies = max(1, -(-FP8_LINEAR_BYTES // (n * k))) if device.type == "cuda" else 1
    weights = []
    for _ in range(copies):
        values, scale = random_fp8_weight(n, k, device, g)
        weights.append((values, scale, fp8_linear.dequantized(values, scale, (128, 128), torch.bfloat16)))
    return weights


def random_fp8_weight(n: int, k: int, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``[n, k]`` fp8 (e4m3) weight over the format's range and its float32 scale per 128 x 128 tile."""
    values = (torch.randn(n, k, generator=g) * 16).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    scale = (torch.rand(-(-n // 128), -(-k // 128), generator=g) / 256).to(device)
    return values, scale


def fp8_linear_sides(
    shape: tuple[int, int, int],
    tokens: int,
    device: torch.device,
    g: torch.Generator,
    launch=None,
    weights: Fp8Weights | None = None,
) -> tuple[Side, Side]:
    """The fp8 linear (kernel at ``launch``, ``"dequantise"``: the dequantising path, or as
    :func:`fp8_linear.fp8_linear` picks) against ``F.linear`` on the
    weight dequantised at load (bf16): what keeping the backbone fp8 replaces. Each side cycles through the copies of
    ``weights`` (default: :func:`fp8_weight_copies`): a step's weights come from HBM, and a graph of calls on one
    small matrix would read it from L2."""
    _, k, groups = shape
    weights = weights or fp8_weight_copies(shape, device, g)
    copies = len(weights)
    x = _randn(tokens, groups * k, device=device, g=g)
    turn = {"kernel": 0, "torch": 0}

    def next_weights(side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        turn[side] = (turn[side] + 1) % copies
        return weights[turn[side]]

    def kernel() -> torch.Tensor:
        values, scale, _ = next_weights("kernel")
        if launch == "dequantise":  # the path past the kernel's rows: dequantise into a temporary, then the GEMM
            return torch.nn.functional.linear(x, fp8_linear.dequantized(values, scale, (128, 128), x.dtype))
        if launch is not None:
            return fp8_linear.rows_triton(x, values, scale, (128, 128), groups, launch)
        return fp8_linear.fp8_linear(x, values, scale, (128, 128), groups=groups)

    def reference() -> torch.Tensor:
        values, _, dense = next_weights("torch")
        if groups == 1:
            return torch.nn.functional.linear(x, dense)
        return fp8_linear.grouped_reference(x, dense, groups)

    return kernel, reference


def _fp8_linear_cases(device: torch.device, g: torch.Generator, sweep: bool) -> list[tuple[str, Side, Side]]:
    found = []
    for name, shape in FP8_LINEARS.items():
        weights = fp8_weight_copies(shape, device, g)  # one set a shape: every case of it cycles through them
        for tokens in (1, 4, 32, 128) if device.type == "cuda" else (1, 4):
            sides = fp8_linear_sides(shape, tokens, device, g, weights=weights)
            found.append((f"fp8 linear {name} {shape[:2]}, {tokens} tokens", *sides))
            if tokens >= 32 and shape[2] == 1:  # where the kernel meets the dequantising path
                sides = fp8_linear_sides(shape, tokens, device, g, "dequantise", weights)
                found.append((f"fp8 linear {name}, {tokens} tokens, dequantised + GEMM", *sides))
        if sweep and device.type == "cuda":  # the sweep needs the kernel (off CUDA only the default smoke-tests)
            for launch in FP8_SWEEP:
                how = f"block_n {launch.block_n} x{launch.programs_wanted} s{launch.stages}"
                label = f"fp8 linear {name}, 1 token, {how}"
                found.append((label, *fp8_linear_sides(shape, 1, device, g, launch, weights)))
    return found


def cases(names: list[str], slots: list[int], device: torch.device) -> list[tuple[str, Side, Side]]:
    """The (name, kernel side, torch side) of each case asked for."""
    g = torch.Generator().manual_seed(0)
    found: list[tuple[str, Side, Side]] = []
    if "attention" in names:
        # One program a head is timed to 256 entries only (its A/B's range; past it ~0.3 ms and more a call).
        for kernel in ("per-head", "split", "tiles"):
            counts = [n for n in slots if kernel != "per-head" or n <= 256]
            found += [
                (f"attention {kernel}, {n} entries", *attention_sides(n, False, kernel, device, g)) for n in counts
            ]
            found.append((f"attention {kernel}, CSA top-512 picks", *attention_sides(512, True, kernel, device, g)))
    if "compressor" in names:
        for name, rate, dim, overlap in (("HCA", 128, 512, False), ("CSA", 4, 512, True), ("indexer", 4, 128, True)):
            found.append(
                (f"compressor {name} (rate {rate}, dim {dim})", *compressor_sides(rate, dim, overlap, device, g))
            )
    if "router" in names:
        found += [(f"router {kind}, {t} tokens", *router_sides(t, kind == "hashed", device, g))
                  for kind in ("learned", "hashed") for t in (1, 4)]  # fmt: skip
    if "swiglu" in names:
        found += [(f"swiglu, {t} tokens", *swiglu_sides(t, device, g)) for t in (1, 4)]
    if "greedy" in names:
        found += [(f"greedy tokens, {b} rows", *greedy_sides(b, device, g)) for b in (1, 4)]
    if "fp8-linear" in names or "fp8-sweep" in names:
        found += _fp8_linear_cases(device, g, sweep="fp8-sweep" in names)
    return found


def run_bench(names: list[str], slots: list[int], calls: int, device: torch.device) -> dict[str, Any]:
    """Every case's kernel and torch microseconds per call -> the receipt."""
    results = []
    for name, kernel, reference in cases(names, slots, device):
        try:
            ours, theirs = time_calls(kernel, device, calls), time_calls(reference, device, calls)
        except Exception as exc:  # noqa: BLE001 - one case that fails (e.g. a launch shape too big) is recorded
            results.append({"case": name, "error": one_line(exc)})
            print(f"{name}: failed ({one_line(exc)})", flush=True)
            continue
        results.append({"case": name, "kernel_us": ours, "torch_us": theirs, "speedup": theirs / ours})
        print(f"{name}: kernel {ours:.1f} us, torch {theirs:.1f} us ({theirs / ours:.2f}x)", flush=True)
    modules = (v4_attention, v4_compress, v4_router, swiglu, fp8_linear)
    broken = {m.__name__: list(m._BROKEN) for m in modules if m._BROKEN}
    return {"kind": "v4-kernels", "environment": environment(), "device": str(device), "calls": calls,
            "results": results, "broken": broken}  # fmt: skip


def markdown_table(receipt: dict[str, Any]) -> str:
    timing = "a CUDA graph, median of 5 replays" if receipt["device"].startswith("cuda") else "an eager loop: no kernel"
    lines = [
        f"V4 decode kernels against their torch ops on {receipt['device']}, us a call ({receipt['calls']} calls"
        f" {timing}), git {receipt['environment']['git_sha']}",
        "",
        "| case | kernel us | torch us | x |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['kernel_us']:.1f} | {r['torch_us']:.1f} | {r['speedup']:.2f} |"
        if "error" not in r
        else f"| {r['case']} | failed: {r['error'][:80]} | - | - |"
        for r in receipt["results"]
    ]
    if receipt["broken"]:
        lines += ["", f"Kernels that failed (their calls ran the torch ops): {receipt['broken']}"]
    return "\n".join(lines) + "\n"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated: {', '.join(CASES)} (default: all but fp8-linear and fp8-sweep, the latter its launch "
        "shapes at one token)",
    )
    parser.add_argument("--slots", default="16,64,256,512,1024,4096,16384", help="the attention's entry-slot counts")
    parser.add_argument("--calls", type=int, default=20, help="calls a CUDA graph (or eager loop)")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.set_defaults(handler=run)


def _device(name: str | None) -> torch.device:
    """``--device`` as a torch device (default: cuda when available); ConfigError naming the fix otherwise."""
    try:
        device = torch.device(name) if name else default_device()
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a torch device: use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device here; use cpu (a smoke test: the kernels run on CUDA)")
    return device


def run(args: argparse.Namespace) -> int:
    names = parse_names(args.cases)
    if unknown := set(names) - set(CASES):
        raise ConfigError(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    try:
        slots = [int(n) for n in parse_names(args.slots)]
    except ValueError:
        raise ConfigError(f"--slots {args.slots!r}: comma-separated entry counts, e.g. 16,64,256") from None
    if args.calls < 1 or not slots or min(slots) < 1:
        raise ConfigError("--calls and every --slots count must be >= 1")
    receipt = run_bench(names, slots, args.calls, _device(args.device))
    path = write_receipt_files(receipt, args.out, markdown_table)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 0
