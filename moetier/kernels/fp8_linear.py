"""A linear whose weight stays fp8-block in VRAM: ``x @ dequant(values, scales).T``, each weight the loader's bits.

DeepSeek's releases store every large backbone linear (attention, shared experts) as float8 with one float32
scale per 128 x 128 tile (:mod:`moetier.weights.fp8`). Kept so, the backbone takes half the VRAM of its bf16
copy and a decode step reads half the bytes: at a few tokens these GEMMs only stream their weights.

- **Few rows on CUDA** (decode, short prefills: up to :data:`MAX_KERNEL_ROWS` tokens, where a GEMM still only
  streams its weight): one Triton kernel reads each weight
  tile once, widens it, multiplies by its tile's scale, rounds to the activations' dtype (the bits a
  dequantised-at-load weight holds) and accumulates in float32 on the tensor cores. Wide-K matrices split
  their inputs over several programs (more reads in flight than one program per row block gives), each
  writing float32 partial sums that a second kernel adds in a fixed order: runs repeat bit for bit.
- **Otherwise** (prefill chunks, CPU, shapes the kernel does not take): the weight is dequantised into a
  temporary (one kernel on CUDA, :mod:`moetier.kernels.fp8_dequant`) and ``F.linear`` runs: the bits of the
  dequantised-at-load linear, since both dequantise the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.kernels.fp8_dequant import dequantize_fp8_into
from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.rmsnorm import triton_usable
from moetier.weights.fp8 import scale_grid

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the dequantise-then-GEMM path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# The most rows the kernel takes: one program holds all of them (a token tile of 16 to 128, the next power of two;
# tensor-core dots need 16); more rows dequantise and GEMM. At 128 rows the kernel is at or under dequantise + GEMM
# for V4-Flash's linears (H100: results/h100-20261207-a3a7346-fp8-linear-dequant; 32 rows 1.8-4.4x faster).
MAX_KERNEL_ROWS = 128
BLOCK_K = 128  # inputs a loop step reads: a divisor of the scale tile's columns, so one scale a row a step


@dataclass(frozen=True)
class LaunchShape:
    """How the kernel splits the work: ``block_n`` output features a program, enough programs over the inputs for
    ``programs_wanted`` a multiprocessor (each keeping at least ``min_steps`` steps of ``BLOCK_K``), ``stages`` of
    software pipelining, ``warps`` a program."""

    # 64 x 2: the fastest on V4-Flash's backbone shapes at one token of the first sweep (H100, weights in L2:
    # results/h100-20261207-c3a9708-fp8-linear-sweep; 10% under the first default, 32 x 4)
    block_n: int = 64
    programs_wanted: int = 2
    min_steps: int = 4
    stages: int = 3
    warps: int = 4

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1) or min(self.programs_wanted, self.min_steps) < 1:
            raise ValueError(f"block_n must be a power of two >= 16 and the counts positive: {self}")


LAUNCH = LaunchShape()  # the default (moetier bench v4-kernels --cases fp8-linear sweeps others)
_VALUES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_BROKEN: list[str] = []  # set once when the kernel fails, so serving carries on with the dequantising path
_SM_COUNTS: dict[int, int] = {}


if triton is not None:

    @triton.jit
    def _fp8_rows_kernel(
        x, values, scales, out, rows, n, x_stride, out_stride, scale_cols, group_rows,
        k: tl.constexpr, k_per_split: tl.constexpr, TILE_R: tl.constexpr, E5M2: tl.constexpr, IEEE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TILE_C: tl.constexpr,
    ):  # fmt: skip
        """``out[split, m, f] = sum over this split's inputs of x[m, g * k + i] * w[f, i]``, ``w`` rounded as the
        loader rounds it, ``g = f // group_rows`` (one group: ``group_rows = n``); ``out`` is the result itself
        (one split, ``out_stride`` its row stride) or float32 partials. Programs never straddle a group. ``k`` and
        ``k_per_split`` are compile-time: a model has few linear shapes, and Triton's interpreter needs fixed loop
        bounds."""
        group = tl.program_id(2)
        features = group * group_rows + tl.program_id(0) * BN + tl.arange(0, BN)
        split = tl.program_id(1)
        x += group * k
        tokens = tl.arange(0, BM)
        feature_ok, token_ok = features < (group + 1) * group_rows, tokens < rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        start = split * k_per_split
        for step in range(0, k_per_split, BK):  # the last split may run past k: its steps there load nothing
            k0 = start + step
            cols = k0 + tl.arange(0, BK)
            col_ok = cols < k
            weight_ok = feature_ok[:, None] & col_ok[None, :]
            codes = tl.load(values + features[:, None] * k + cols[None, :], mask=weight_ok, other=0)
            if E5M2:
                w = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
            else:
                w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scale_at = scales + (features // TILE_R) * scale_cols + k0 // TILE_C
            scale = tl.load(scale_at, mask=feature_ok & (k0 < k), other=0.0)
            w = (w * scale[:, None]).to(x.dtype.element_ty)
            input_ok = token_ok[:, None] & col_ok[None, :]
            inputs = tl.load(x + tokens[:, None] * x_stride + cols[None, :], mask=input_ok, other=0.0)
            if IEEE:
                acc += tl.dot(inputs, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(inputs, tl.trans(w))
        at = out + split * rows * out_stride + tokens[:, None] * out_stride + features[None, :]
        tl.store(at, acc.to(out.dtype.element_ty), mask=token_ok[:, None] & feature_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(partials, out, count, splits: tl.constexpr, BLOCK: tl.constexpr):
        """``out[i] = sum_s partials[s, i]`` in split order (a fixed order: the same bits every run)."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = at < count
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(partials + s * count + at, mask=ok, other=0.0)
        tl.store(out + at, total.to(out.dtype.element_ty), mask=ok)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter (the CPU checks): any count exercises the split
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def splits_for(n: int, k: int, multiprocessors: int, launch: LaunchShape = LAUNCH) -> int:
    """How many programs share a row block's inputs: enough programs for ``launch.programs_wanted`` a
    multiprocessor, each keeping at least ``launch.min_steps`` steps (fewer would be mostly loop overhead)."""
    blocks = -(-n // launch.block_n)
    wanted = -(-launch.programs_wanted * multiprocessors // blocks)
    return max(1, min(wanted, k // (launch.min_steps * BLOCK_K)))


def token_tile(rows: int) -> int:
    """The kernel's token tile for ``rows`` rows: the next power of two, at least 16."""
    return max(16, 1 << max(rows - 1, 0).bit_length())


def _kernel_takes(
    x2: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int], groups: int
) -> bool:
    """Whether the kernel takes these: few rows, a float compute dtype, contiguous e4m3/e5m2 values whose scale
    grid is float32 and the tile's, scale tiles whole ``BLOCK_K`` steps wide, ``groups`` dividing the outputs and
    the inputs, all on one device."""
    if x2.shape[0] > MAX_KERNEL_ROWS or x2.dtype not in _DTYPES or values.dtype not in _VALUES or values.dim() != 2:
        return False
    if scale.dtype != torch.float32 or tuple(scale.shape) != scale_grid(tuple(values.shape), tile):
        return False
    if tile[1] % BLOCK_K or values.shape[0] % groups or x2.shape[1] != groups * values.shape[1] or x2.stride(1) != 1:
        return False
    return x2.device == values.device == scale.device and values.is_contiguous() and scale.is_contiguous()


def rows_triton(
    x2: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    tile: tuple[int, int],
    groups: int = 1,
    launch: LaunchShape = LAUNCH,
) -> torch.Tensor:
    """The kernel's result for inputs it takes (:func:`fp8_linear` checks that), launched as ``launch`` says."""
    rows, (n, k) = x2.shape[0], values.shape
    out = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    if rows == 0:
        return out
    group_rows = n // groups
    splits = splits_for(n, k, _sm_count(x2.device), launch)
    per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, per_split)
    target = out if splits == 1 else torch.empty((splits, rows, n), dtype=torch.float32, device=x2.device)
    _fp8_rows_kernel[(triton.cdiv(group_rows, launch.block_n), splits, groups)](
        x2, values.view(torch.uint8), scale, target, rows, n, x2.stride(0), n, scale.shape[1], group_rows,
        k=k, k_per_split=per_split, TILE_R=tile[0], E5M2=values.dtype == torch.float8_e5m2,
        IEEE=x2.dtype == torch.float32,
        BM=token_tile(rows), BN=launch.block_n, BK=BLOCK_K, TILE_C=tile[1],
        num_warps=launch.warps if rows <= 32 else max(launch.warps, 8),
        num_stages=launch.stages,
    )  # fmt: skip
    if splits > 1:
        count = rows * n
        _sum_splits_kernel[(triton.cdiv(count, 1024),)](target, out, count, splits=splits, BLOCK=1024, num_warps=4)
    return out


def dequantized(values: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in ``dtype``, the bits the loader's dequantisation gives (one kernel on CUDA)."""
    return dequantize_fp8_into(torch.empty(values.shape, dtype=dtype, device=values.device), values, scale, tile)


def grouped_reference(x: torch.Tensor, dense: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` ``[T, groups * K]``, each group's inputs times its ``[R, K]`` block of rows of ``dense`` ``[groups * R,
    K]``, side by side: ``[T, groups * R]``, as one batched GEMM (DeepSeek-V4's grouped output projection)."""
    tokens = x.shape[0]
    grouped = x.reshape(tokens, groups, -1).transpose(0, 1)  # [groups, T, K]
    weight = dense.view(groups, dense.shape[0] // groups, -1).transpose(1, 2)  # [groups, K, R]
    return torch.bmm(grouped, weight).transpose(0, 1).reshape(tokens, -1)


def fp8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    tile: tuple[int, int],
    bias: torch.Tensor | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """``x`` ``[..., K]`` times the fp8-block weight ``values`` ``[N, K]`` (float32 ``scale`` per ``tile``),
    transposed, plus ``bias``: ``[..., N]`` in ``x``'s dtype. With ``groups`` > 1, ``x`` is ``[..., groups * K]``
    and group ``g``'s inputs meet only rows ``g * N / groups`` on (:func:`grouped_reference`). The kernel for few
    rows on CUDA, else the weight dequantised into a temporary and the dense ops: the dequantised-at-load bits."""
    x2 = x.reshape(-1, x.shape[-1])

    def dense_ops() -> torch.Tensor:
        dense = dequantized(values, scale, tile, x2.dtype)
        if groups == 1:
            return F.linear(x2, dense, bias)
        out = grouped_reference(x2, dense, groups)
        return out if bias is None else out + bias

    def kernel() -> torch.Tensor:
        out = rows_triton(x2, values, scale, tile, groups)
        return out if bias is None else out + bias

    usable = triton_usable(x2) and _kernel_takes(x2, values, scale, tile, groups)
    out = kernel_or_reference(_BROKEN, "fp8 linear kernel", usable, kernel, dense_ops)
    return out.view(*x.shape[:-1], values.shape[0])
