"""DeepSeek-V4's router for decode-sized batches in two kernels (:func:`route`, :func:`select`).

In torch the router (:class:`moetier.models.deepseek_v4.Router`) is 13 tiny kernels a layer: ``x.float()``
(2.3 us on the H200), ``weight.float()`` (4.3 us: the bf16 ``[256, 4096]`` weight converted every step), the
float32 GEMV (3.3 us), softplus, sqrt, ``+ bias``, ``torch.topk`` (6 us), the gather, the sum, ``+ eps``, the
division, ``* scaling`` and the cast: ~33 us of a 1-token decode step's layer for ~3 us of work. Here
:func:`_logits_kernel` computes the logits ``x.float() @ weight.float().T`` reading both in their own dtypes
(products and sums in float32; a few experts a program and a wide block of the hidden dim an iteration: decode
is latency-bound, so many programs and few serial iterations), and :func:`_route_kernel` does the rest, one
program a token: the scores (``sqrt(softplus(logit))`` with torch's threshold 20, or ``sigmoid``), the top-k of
``score + bias`` (k rounds of the largest, the smallest index among equal values; NaN counts as largest, as in
``torch.topk``) or the hashed ``tid2eid[input_ids[t]]``, and the weights ``w / (sum(w) + 1e-20) * scaling``
rounded twice as torch does, then cast to ``x``'s dtype.

The ids come out in descending order of ``score + bias``; torch's ``topk(sorted=False)`` order is
implementation-defined, and downstream only sums over a token's k experts, so the order changes only that
sum's rounding. The logits differ from cuBLAS's by the order of the float32 sums (~1e-6 relative), the
weights' sum over k by its order; the scores' ``exp``/``log1p`` are CUDA's (libdevice, as torch's kernels),
the square root and division IEEE. Used on CUDA when Triton is importable (``MOETIER_TRITON=0`` turns it off)
for up to :data:`MAX_TOKENS` tokens (prefill chunks keep cuBLAS and torch); everywhere else, for inputs it does
not take, or after a kernel once failed, the caller's torch ops run. Triton's interpreter runs the kernels in the
CPU tests with numpy's ``exp`` (``log1p`` in float64: it has no libdevice) and its own bf16 truncation. The
kernels' own time on the H200 is not measured yet (written on a CPU-only machine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch ops.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# What the kernels take: decode-sized batches, experts in one program's block, k picks a token.
MAX_TOKENS = 16
MAX_EXPERTS = 1024
MAX_K = 16
# The logits kernel's blocks: experts a program, hidden channels an iteration (H=4096: 4 iterations).
EXPERTS_PER_PROGRAM = 4
HIDDEN_BLOCK = 1024

SCORES = ("sqrtsoftplus", "sigmoid")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int64, torch.int32)

# Set once when a kernel fails, so serving carries on with the torch ops.
_BROKEN: list[str] = []


if triton is not None:

    @triton.jit
    def _logits_kernel(x, weight, out, stride_x, stride_w, E, H: tl.constexpr, EB: tl.constexpr, HB: tl.constexpr):
        t = tl.program_id(1)
        e = tl.program_id(0) * EB + tl.arange(0, EB)[:, None]
        expert = e < E
        acc = tl.zeros((EB, HB), tl.float32)
        for first in range(0, H, HB):
            h = first + tl.arange(0, HB)[None, :]
            inside = h < H
            row = tl.load(x + t * stride_x + h, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(weight + e * stride_w + h, mask=expert & inside, other=0.0).to(tl.float32)
            acc += w * row
        e = tl.program_id(0) * EB + tl.arange(0, EB)
        tl.store(out + t * E + e, tl.sum(acc, axis=1), mask=e < E)

    @triton.jit
    def _score(logit, SIGMOID: tl.constexpr, LIBDEVICE: tl.constexpr):
        """torch's ``sigmoid`` (``1 / (1 + exp(-x))``) or ``sqrt(softplus(x))`` (``x`` above 20, else
        ``log1p(exp(x))``) in float32; the interpreter has no libdevice: numpy's ``exp``, ``log1p`` in float64."""
        if SIGMOID:
            e = libdevice.exp(-logit) if LIBDEVICE else tl.exp(-logit)
            return tl.div_rn(tl.full(logit.shape, 1.0, tl.float32), 1.0 + e)
        if LIBDEVICE:
            soft = libdevice.log1p(libdevice.exp(logit))
        else:
            soft = tl.log(1.0 + tl.exp(logit.to(tl.float64))).to(tl.float32)
        return tl.sqrt_rn(tl.where(logit > 20.0, logit, soft))

    @triton.jit
    def _route_kernel(
        logits, bias, tid2eid, input_ids, ids, weights, E, stride_tid, scaling,
        K: tl.constexpr, KB: tl.constexpr, EP: tl.constexpr, HASHED: tl.constexpr, SIGMOID: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        j = tl.arange(0, KB)
        pick = j < K
        if HASHED:
            token = tl.load(input_ids + t).to(tl.int64)
            picked = tl.load(tid2eid + token * stride_tid + j, mask=pick, other=0).to(tl.int64)
        else:
            a = tl.arange(0, EP)
            live = a < E
            key = _score(tl.load(logits + t * E + a, mask=live, other=0.0), SIGMOID, LIBDEVICE)
            key += tl.load(bias + a, mask=live, other=0.0).to(tl.float32)
            key = tl.where(key != key, float("inf"), key)  # NaN is the largest, as torch.topk has it
            picked = tl.zeros((KB,), tl.int64)
            for i in tl.static_range(K):  # the largest left, the smallest index among equal ones
                key = tl.where(live, key, float("-inf"))
                top = tl.max(key, axis=0)
                at = tl.min(tl.where(live & (key == top), a, EP), axis=0)
                picked = tl.where(j == i, at.to(tl.int64), picked)
                live = live & (a != at)
        known = pick & (picked >= 0) & (picked < E)
        w = _score(tl.load(logits + t * E + picked, mask=known, other=0.0), SIGMOID, LIBDEVICE)
        w = tl.where(known, w, 0.0)
        total = tl.sum(w, axis=0) + 1e-20
        w = tl.div_rn(w, tl.broadcast_to(total, (KB,))) * scaling
        tl.store(ids + t * K + j, picked, mask=pick)
        tl.store(weights + t * K + j, w.to(weights.dtype.element_ty), mask=pick)


def fits(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    k: int,
    score: str,
) -> bool:
    """Whether the kernels take these inputs: ``x`` ``[T, H]`` with 1 <= T <= :data:`MAX_TOKENS`, ``weight``
    ``[E, H]`` with k <= E <= :data:`MAX_EXPERTS`, k <= :data:`MAX_K`, float dtypes, unit strides on the last
    dims, one device, a score of :data:`SCORES`; learned (``bias`` ``[E]``) or hashed (``tid2eid`` ``[V, k]`` and
    ``input_ids`` ``[T]``, integers)."""
    if x.dim() != 2 or weight.dim() != 2 or (bias is None) == (tid2eid is None):
        return False
    (tokens, hidden), experts = x.shape, weight.shape[0]
    parts = [x, weight]
    if bias is not None:
        parts.append(bias)
        if not (bias.shape == (experts,) and bias.dtype in _FLOATS):
            return False
    else:
        if input_ids is None:
            return False
        parts += [tid2eid, input_ids]
        if not (
            tid2eid.dim() == 2 and tid2eid.shape[1] == k and tid2eid.dtype in _INTS
            and input_ids.shape == (tokens,) and input_ids.dtype in _INTS
        ):  # fmt: skip
            return False
    return (
        score in SCORES and 1 <= tokens <= MAX_TOKENS and hidden >= 1 and weight.shape[1] == hidden
        and 1 <= k <= min(MAX_K, experts) and experts <= MAX_EXPERTS
        and x.dtype in _FLOATS and weight.dtype in _FLOATS
        and all(t.device == x.device and t.stride(-1) == 1 for t in parts)
    )  # fmt: skip


def logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.float().T`` (float32 ``[T, E]``) by the logits kernel (the caller checked :func:`fits`)."""
    (tokens, hidden), experts = x.shape, weight.shape[0]
    out = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(hidden), HIDDEN_BLOCK)
    _logits_kernel[(triton.cdiv(experts, EXPERTS_PER_PROGRAM), tokens)](
        x, weight, out, x.stride(0), weight.stride(0), experts,
        H=hidden, EB=EXPERTS_PER_PROGRAM, HB=block, num_warps=4,
    )  # fmt: skip
    return out


def route_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    k: int,
    scaling: float,
    score: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels (the caller checked :func:`fits`): ids int64 ``[T, k]``, weights ``[T, k]`` in ``x``'s dtype."""
    logits = logits_triton(x, weight)
    tokens, experts = logits.shape
    ids = torch.empty((tokens, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((tokens, k), dtype=x.dtype, device=x.device)
    hashed = bias is None
    # One warp: the k rounds' max/min reductions stay in shuffles, no shared-memory round trips (not yet timed).
    _route_kernel[(tokens,)](
        logits, logits if hashed else bias, tid2eid if hashed else ids, input_ids if hashed else ids, ids, weights,
        experts, tid2eid.stride(0) if hashed else 0, float(scaling),
        K=k, KB=triton.next_power_of_2(k), EP=triton.next_power_of_2(experts), HASHED=hashed,
        SIGMOID=score == "sigmoid", LIBDEVICE=x.is_cuda, num_warps=1,
    )  # fmt: skip
    return ids, weights


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    k: int,
    scaling: float,
    score: str,
    reference: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token's k experts and their weights (learned: ``bias`` given, ``tid2eid`` None; hashed: the reverse) by
    the two kernels where Triton runs on ``x``'s device and :func:`fits`; else ``reference()`` (the torch ops)."""
    return kernel_or_reference(
        _BROKEN, "V4 router kernels",
        triton_usable(x) and fits(x, weight, bias, tid2eid, input_ids, k, score),
        lambda: route_triton(x, weight, bias, tid2eid, input_ids, k, scaling, score), reference,
    )  # fmt: skip


def select(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    score: str,
    reference: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """A learned router's ids alone (:func:`route`'s), or ``reference()``."""
    return kernel_or_reference(
        _BROKEN, "V4 router kernels",
        triton_usable(x) and fits(x, weight, bias, None, None, k, score),
        lambda: route_triton(x, weight, bias, None, None, k, 1.0, score)[0], reference,
    )  # fmt: skip
