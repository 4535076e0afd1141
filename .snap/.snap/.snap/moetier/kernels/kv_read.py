"""Read KV rows back in the compute dtype in one kernel: gather (paged) and fp8 dequantisation fused.

Every decode step reads each layer's cached rows. Eagerly, an fp8 read is a slice, a cast, a
multiply by the scales, a concatenation of the scale groups and a cast back (5+ launches per store
per layer), and a paged read adds a gather of the values and one of the scales; decode of a few
streams is bound by such launches. Here one program per (lead index, token) row loads the row from
wherever it lives (``index``: the pool row of each token, for paged stores), multiplies each column
by its group's scale and writes the compute-dtype row into a fresh ``[*lead, end, width]`` tensor.
Values are those of the eager path (``value.float() * scale``, rounded once to the output dtype).
Used on CUDA when Triton is importable (``MOETIER_TRITON=0`` turns it off) for stores with at most
one lead dim; after one failure the eager path runs from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from moetier.kernels.rmsnorm import triton_usable

log = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

if triton is not None:

    @triton.jit
    def _read_rows_kernel(
        data_ptr,
        scale_ptr,
        group_ptr,
        index_ptr,
        out_ptr,
        end,
        data_lead,
        data_tok,
        scale_lead,
        scale_tok,
        width: tl.constexpr,
        FP8: tl.constexpr,
        PAGED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        lead, token = tl.program_id(0), tl.program_id(1)
        source = tl.load(index_ptr + token) if PAGED else token
        cols = tl.arange(0, BLOCK)
        keep = cols < width
        raw = tl.load(data_ptr + lead * data_lead + source * data_tok + cols, mask=keep, other=0)
        if FP8:
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            group = tl.load(group_ptr + cols, mask=keep, other=0)
            scale = tl.load(scale_ptr + lead * scale_lead + source * scale_tok + group, mask=keep, other=1.0)
            values = values * scale
        else:
            values = raw.to(tl.float32)
        out = values.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (lead * end + token) * width + cols, out, mask=keep)


_BROKEN: list[str] = []
_GROUP_MAPS: dict[tuple, torch.Tensor] = {}


def fused_read_usable(data: torch.Tensor, lead: Sequence[int]) -> bool:
    return not _BROKEN and triton_usable(data) and len(lead) <= 1


def _group_map(groups: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[width]`` int32: the scale group of each column (built once per layout and device)."""
    key = (tuple(groups), device)
    if key not in _GROUP_MAPS:
        ids = [g for g, size in enumerate(groups) for _ in range(size)]
        _GROUP_MAPS[key] = torch.tensor(ids, dtype=torch.int32, device=device)
    return _GROUP_MAPS[key]


def read_rows(
    data: torch.Tensor,
    scales: torch.Tensor | None,
    groups: Sequence[int],
    end: int,
    out_dtype: torch.dtype,
    token_axis: int,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[0, end)`` of a store as a fresh ``[*lead, end, width]`` tensor in ``out_dtype``.

    ``data`` is ``[*lead, tokens, width]`` (``token_axis`` -2, contiguous stores) or ``[rows, *lead,
    width]`` (``token_axis`` 0, pool rows picked by ``index``: ``[end]`` int64); ``scales`` (fp8 data)
    has ``len(groups)`` in its last dim, the same layout otherwise. At most one lead dim.
    """
    lead = data.shape[1:-1] if token_axis == 0 else data.shape[:-2]
    lead_size = lead[0] if lead else 1
    width = data.shape[-1]
    out = torch.empty(*lead, end, width, dtype=out_dtype, device=data.device)
    if end == 0:
        return out
    fp8 = scales is not None
    raw = data.view(torch.uint8) if fp8 else data
    tok_stride = raw.stride(token_axis)
    lead_stride = raw.stride(1 if token_axis == 0 else 0) if lead else 0
    scale_tok = scales.stride(token_axis) if fp8 else 0
    scale_lead = (scales.stride(1 if token_axis == 0 else 0) if lead else 0) if fp8 else 0
    _read_rows_kernel[(lead_size, end)](
        raw,
        scales if fp8 else raw,
        _group_map(groups, data.device) if fp8 else raw,
        index if index is not None else raw,
        out,
        end,
        lead_stride,
        tok_stride,
        scale_lead,
        scale_tok,
        width,
        FP8=fp8,
        PAGED=index is not None,
        BLOCK=triton.next_power_of_2(width),
    )
    return out


def try_read_rows(
    data: torch.Tensor,
    scales: torch.Tensor | None,
    groups: Sequence[int],
    end: int,
    out_dtype: torch.dtype,
    token_axis: int,
    index: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """:func:`read_rows` where it applies (None: the caller reads eagerly)."""
    lead = data.shape[1:-1] if token_axis == 0 else data.shape[:-2]
    if not fused_read_usable(data, lead):
        return None
    try:
        return read_rows(data, scales, groups, end, out_dtype, token_axis, index)
    except Exception as exc:  # noqa: BLE001 - a kernel failure must not take serving down
        _BROKEN.append(str(exc))
        log.warning("fused KV read kernel failed (%s); reading KV eagerly from now on", exc)
        return None
