"""DeepSeek-V4's hyper-connection mixing (mHC) at a sublayer boundary in two kernels.

Between two sublayers the eager math is ~17 launches: the previous sublayer's output merged into the
``hc`` residual streams (casts, a product, a batched GEMM), then the next hyper-connection's mixing
weights (an unweighted norm of the flattened streams, a GEMV, the affine, sigmoids, the Sinkhorn
projection), the streams collapsed by the ``pre`` weights and the sublayer's RMSNorm. Decode of a few
tokens is bound by those launches (issue 4: ~150 kernels of 1-3 us a layer). Here it is two:

- :func:`_merge_dots_kernel`, one program per token and block of ``BH`` columns: the merged streams (when
  merging) and, of the block's columns of every stream, the partial sum of squares and the partial
  products with the mixing matrix ``fn`` (a split-K GEMV: many programs, so ``fn`` is read at HBM rate);
- :func:`_mix_finish_kernel`, one program per token: the partial sums reduced, the logits' affine, the
  ``pre`` / ``post`` gates, the Sinkhorn ``comb`` in registers, the collapse and the weighted RMSNorm.

Roundings are the eager reference's (:func:`mix_reference`): products with bf16 operands round where
torch rounds them; sums are taken in float32 (their order differs, as any GEMM's does). Used on CUDA when
Triton is importable and ``hc`` is a power of two (``MOETIER_TRITON=0`` turns it off); everywhere else, or
after the kernels once failed, the eager reference runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.kernels import rmsnorm
from moetier.kernels.guard import kernel_or_reference
from moetier.kernels.sinkhorn import sinkhorn

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


@dataclass(frozen=True)
class Mixing:
    """One hyper-connection's parameters: ``fn`` ``[mix, hc * H]``, ``base`` ``[mix]``, ``scale`` (one per part).

    Full (``iters`` > 0): ``mix = (2 + hc) * hc`` logits, pre | post | comb, scaled by ``scale[0..2]``. Head
    (``iters`` 0, the final collapse): ``mix = hc`` pre logits scaled by ``scale[0]``, no post or comb."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    hc: int
    iters: int
    hc_eps: float
    norm_eps: float  # of the unweighted norm of the flattened streams

    def __post_init__(self) -> None:
        mix = (2 + self.hc) * self.hc if self.iters else self.hc
        if self.fn.shape[0] != mix or self.base.shape != (mix,):
            raise ValueError(f"mixing weights of {self.fn.shape[0]} / {tuple(self.base.shape)} rows, expected {mix}")

    @property
    def full(self) -> bool:
        return self.iters > 0


@dataclass(frozen=True)
class Merge:
    """A sublayer's output merged into the streams before they are mixed: stream ``k`` becomes
    ``post[k] * (out + extra) + sum_j comb[j, k] * streams[j]`` (``extra``: the shared expert's output added to
    the routed one; ``out`` None: ``comb``'s mix alone)."""

    post: torch.Tensor  # [T, hc] float32
    comb: torch.Tensor  # [T, hc, hc] float32
    out: torch.Tensor | None = None  # [T, H]
    extra: torch.Tensor | None = None


@dataclass(frozen=True)
class Mixed:
    """The streams (merged, or the input ones), the sublayer's ``post`` and ``comb`` (None for a head) and its
    normed input ``x`` ``[T, H]``."""

    streams: torch.Tensor
    post: torch.Tensor | None
    comb: torch.Tensor | None
    x: torch.Tensor


def merge_reference(streams: torch.Tensor, merge: Merge) -> torch.Tensor:
    """Eager :class:`Merge` in the streams' dtype (one batched GEMM)."""
    dtype = streams.dtype
    mixed = merge.comb.to(dtype).transpose(-1, -2)
    if merge.out is None:
        return torch.bmm(mixed, streams)
    out = merge.out if merge.extra is None else merge.out + merge.extra
    placed = merge.post.to(dtype)[..., None] * out[:, None, :]
    return torch.baddbmm(placed, mixed, streams)


def weights_reference(
    streams: torch.Tensor, mixing: Mixing, pre_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Float32 ``pre`` ``[T, hc]``, ``post`` ``[T, hc]`` and ``comb`` ``[T, hc, hc]`` of ``streams`` (post and comb
    None for a head or with ``pre_only``)."""
    hc = mixing.hc
    flat = rmsnorm.rms_norm(streams.flatten(1), None, mixing.norm_eps, torch.float32)
    scale = mixing.scale.float()
    if mixing.full:  # one affine for all three parts: logits * (pre | post | comb scale) + base
        scale = torch.cat([scale[0:1].expand(hc), scale[1:2].expand(hc), scale[2:3].expand(hc * hc)])
    logits = torch.addcmul(mixing.base.float(), torch.nn.functional.linear(flat, mixing.fn.float()), scale)
    if not mixing.full or pre_only:
        return torch.sigmoid(logits[:, :hc]) + mixing.hc_eps, None, None
    gates = torch.sigmoid(logits[:, : 2 * hc])
    comb = sinkhorn(logits[:, 2 * hc :].view(-1, hc, hc), mixing.iters, mixing.hc_eps)
    return gates[:, :hc] + mixing.hc_eps, gates[:, hc:] * 2, comb


def collapse_reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The streams summed with the ``pre`` weights (float32), in the streams' dtype ``[T, H]``."""
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def mix_reference(
    streams: torch.Tensor, mixing: Mixing, norm_weight: torch.Tensor, norm_eps: float, merge: Merge | None = None
) -> Mixed:
    """Eager :func:`hyper_mix`: merge, mixing weights, collapse, then the sublayer's RMSNorm."""
    if merge is not None:
        streams = merge_reference(streams, merge)
    pre, post, comb = weights_reference(streams, mixing)
    x = rmsnorm.rms_norm(collapse_reference(streams, pre), norm_weight, norm_eps)
    return Mixed(streams, post, comb, x)


if triton is not None:

    @triton.jit
    def _merge_dots_kernel(
        streams_ptr,
        new_ptr,
        out_ptr,
        extra_ptr,
        post_ptr,
        comb_ptr,
        fn_ptr,
        dots_ptr,
        sq_ptr,
        H: tl.constexpr,
        NB: tl.constexpr,
        MIX: tl.constexpr,
        MIXP: tl.constexpr,
        HC: tl.constexpr,
        BH: tl.constexpr,
        MERGE: tl.constexpr,
        HAS_OUT: tl.constexpr,
        HAS_EXTRA: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        ks = tl.arange(0, HC)
        cols = blk * BH + tl.arange(0, BH)
        keep = cols < H
        offs = row * HC * H + ks[:, None] * H + cols[None, :]  # [HC, BH]
        mask = (ks[:, None] < HC) & keep[None, :]
        x = tl.load(streams_ptr + offs, mask=mask, other=0.0)
        if MERGE:
            dtype = x.dtype
            comb = tl.load(comb_ptr + row * HC * HC + ks[:, None] * HC + ks[None, :]).to(dtype).to(tl.float32)
            acc = tl.sum(comb[:, :, None] * x.to(tl.float32)[:, None, :], axis=0)  # [k, BH]: sum over j
            if HAS_OUT:
                out = tl.load(out_ptr + row * H + cols, mask=keep, other=0.0)
                if HAS_EXTRA:
                    extra = tl.load(extra_ptr + row * H + cols, mask=keep, other=0.0)
                    out = (out.to(tl.float32) + extra.to(tl.float32)).to(dtype)
                post = tl.load(post_ptr + row * HC + ks).to(dtype).to(tl.float32)
                acc += (post[:, None] * out.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
            x = acc.to(dtype)
            tl.store(new_ptr + offs, x, mask=mask)
        xf = x.to(tl.float32)
        tl.store(sq_ptr + row * NB + blk, tl.sum(tl.sum(xf * xf, axis=1), axis=0))
        ms = tl.arange(0, MIXP)
        w_offs = ms[:, None, None] * (HC * H) + ks[None, :, None] * H + cols[None, None, :]
        w = tl.load(fn_ptr + w_offs, mask=(ms[:, None, None] < MIX) & mask[None, :, :], other=0.0)
        dots = tl.sum(tl.sum(w * xf[None, :, :], axis=2), axis=1)  # [MIXP]
        tl.store(dots_ptr + (row * NB + blk) * MIXP + ms, dots)

    @triton.jit
    def _mix_finish_kernel(
        streams_ptr,
        dots_ptr,
        sq_ptr,
        base_ptr,
        scale_ptr,
        norm_ptr,
        post_ptr,
        comb_ptr,
        x_ptr,
        H: tl.constexpr,
        NB: tl.constexpr,
        flat_eps,
        hc_eps,
        norm_eps,
        MIXP: tl.constexpr,
        HC: tl.constexpr,
        NBP: tl.constexpr,
        BH: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        row = tl.program_id(0)
        nbs = tl.arange(0, NBP)
        nkeep = nbs < NB
        sq = tl.sum(tl.load(sq_ptr + row * NB + nbs, mask=nkeep, other=0.0), axis=0)
        flat_scale = 1.0 / tl.sqrt(sq / (HC * H) + flat_eps)  # the unweighted norm's, applied after the GEMV
        part = dots_ptr + (row * NB + nbs[:, None]) * MIXP
        ks = tl.arange(0, HC)
        d_pre = tl.sum(tl.load(part + ks[None, :], mask=nkeep[:, None], other=0.0), axis=0)
        pre = tl.sigmoid(tl.load(base_ptr + ks) + d_pre * flat_scale * tl.load(scale_ptr)) + hc_eps
        if ITERS > 0:
            d_post = tl.sum(tl.load(part + HC + ks[None, :], mask=nkeep[:, None], other=0.0), axis=0)
            post = tl.sigmoid(tl.load(base_ptr + HC + ks) + d_post * flat_scale * tl.load(scale_ptr + 1)) * 2
            tl.store(post_ptr + row * HC + ks, post)
            mc = 2 * HC + ks[:, None] * HC + ks[None, :]  # [j, k]
            part3 = dots_ptr + (row * NB + nbs[:, None, None]) * MIXP
            d_comb = tl.sum(tl.load(part3 + mc[None, :, :], mask=nkeep[:, None, None], other=0.0), axis=0)
            logits = tl.load(base_ptr + mc) + d_comb * flat_scale * tl.load(scale_ptr + 2)
            e = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # Sinkhorn, as moetier.kernels.sinkhorn
            m = e / tl.sum(e, axis=1)[:, None] + hc_eps
            m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
            for _ in range(ITERS - 1):
                m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
                m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + row * HC * HC + mc - 2 * HC, m)
        # The collapse, rounded to the output dtype, then its weighted RMSNorm: in registers when the row is one
        # block (the usual widths), else two passes over the row through the output.
        if H <= BH:
            cols = tl.arange(0, BH)
            keep = cols < H
            s = tl.load(streams_ptr + row * HC * H + ks[:, None] * H + cols[None, :], mask=keep[None, :], other=0.0)
            c = tl.sum(pre[:, None] * s.to(tl.float32), axis=0).to(x_ptr.dtype.element_ty).to(tl.float32)
            scale = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / H + norm_eps)
            normed = (c * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            out = tl.load(norm_ptr + cols, mask=keep, other=0.0).to(tl.float32) * normed
            tl.store(x_ptr + row * H + cols, out.to(x_ptr.dtype.element_ty), mask=keep)
        else:
            sumsq = 0.0
            for start in range(0, H, BH):
                cols = start + tl.arange(0, BH)
                keep = cols < H
                s = tl.load(streams_ptr + row * HC * H + ks[:, None] * H + cols[None, :], mask=keep[None, :], other=0.0)
                c = tl.sum(pre[:, None] * s.to(tl.float32), axis=0).to(x_ptr.dtype.element_ty)
                tl.store(x_ptr + row * H + cols, c, mask=keep)
                cf = c.to(tl.float32)
                sumsq += tl.sum(cf * cf, axis=0)
            tl.debug_barrier()
            scale = 1.0 / tl.sqrt(sumsq / H + norm_eps)
            for start in range(0, H, BH):
                cols = start + tl.arange(0, BH)
                keep = cols < H
                c = tl.load(x_ptr + row * H + cols, mask=keep, other=0.0)
                normed = (c.to(tl.float32) * scale).to(c.dtype).to(tl.float32)
                out = tl.load(norm_ptr + cols, mask=keep, other=0.0).to(tl.float32) * normed
                tl.store(x_ptr + row * H + cols, out.to(x_ptr.dtype.element_ty), mask=keep)


# The hidden size and block count are compile-time constants (one model, one compile), which also keeps the
# interpreter's loops in Python ints.
_DOT_COLUMNS = 64  # columns of every stream per program of the split-K GEMV: H / 64 programs a token
# Columns per pass of the collapse and the norm: a whole row of the usual widths in one block (registers; a loop of
# dependent passes was latency bound, ~10 us a call on the H200 at H = 4096 against ~3 for the merge kernel).
_ROW_COLUMNS = 8192


def triton_usable(streams: torch.Tensor, mixing: Mixing) -> bool:
    hc = mixing.hc
    return rmsnorm.triton_usable(streams) and streams.dim() == 3 and hc & (hc - 1) == 0 and streams.shape[1] == hc


def mix_triton(
    streams: torch.Tensor, mixing: Mixing, norm_weight: torch.Tensor, norm_eps: float, merge: Merge | None = None
) -> Mixed:
    """The two kernels over ``streams`` ``[T, hc, H]`` (contiguous copies made where needed)."""
    tokens, hc, hidden = streams.shape
    streams = streams.contiguous()
    mix, blocks = mixing.fn.shape[0], triton.cdiv(hidden, _DOT_COLUMNS)
    dots = torch.empty(tokens, blocks, triton.next_power_of_2(mix), dtype=torch.float32, device=streams.device)
    squares = torch.empty(tokens, blocks, dtype=torch.float32, device=streams.device)
    merged = streams if merge is None else torch.empty_like(streams)
    post = torch.empty(tokens, hc, dtype=torch.float32, device=streams.device) if mixing.full else None
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=streams.device) if mixing.full else None
    x = torch.empty(tokens, hidden, dtype=streams.dtype, device=streams.device)
    if not tokens:
        return Mixed(merged, post, comb, x)
    out = None if merge is None or merge.out is None else merge.out.contiguous()
    extra = None if merge is None or merge.extra is None else merge.extra.contiguous()
    fn = mixing.fn.float().contiguous()
    _merge_dots_kernel[(tokens, blocks)](
        streams,
        merged,
        streams if out is None else out,
        streams if extra is None else extra,
        streams if merge is None else merge.post.float().contiguous(),
        streams if merge is None else merge.comb.float().contiguous(),
        fn,
        dots,
        squares,
        hidden,
        blocks,
        MIX=mix,
        MIXP=dots.shape[-1],
        HC=hc,
        BH=_DOT_COLUMNS,
        MERGE=merge is not None,
        HAS_OUT=out is not None,
        HAS_EXTRA=extra is not None,
    )
    _mix_finish_kernel[(tokens,)](
        merged,
        dots,
        squares,
        mixing.base.float().contiguous(),
        mixing.scale.float().contiguous(),
        norm_weight,
        x if post is None else post,
        x if comb is None else comb,
        x,
        hidden,
        blocks,
        mixing.norm_eps,
        mixing.hc_eps,
        norm_eps,
        MIXP=dots.shape[-1],
        HC=hc,
        NBP=triton.next_power_of_2(blocks),
        BH=min(_ROW_COLUMNS, triton.next_power_of_2(hidden)),
        ITERS=mixing.iters,
        num_warps=8 if hidden >= 2048 else 4,
    )
    return Mixed(merged, post, comb, x)


_BROKEN: list[str] = []  # set once when the kernels fail, so serving carries on eagerly


def hyper_mix(
    streams: torch.Tensor, mixing: Mixing, norm_weight: torch.Tensor, norm_eps: float, merge: Merge | None = None
) -> Mixed:
    """``streams`` ``[T, hc, H]`` (with ``merge``, first merged with a sublayer's output) -> :class:`Mixed`: the
    streams, the next sublayer's ``post`` and ``comb`` and its input collapsed and RMS-normed by ``norm_weight``."""
    return kernel_or_reference(
        _BROKEN, "mHC kernels", triton_usable(streams, mixing),
        lambda: mix_triton(streams, mixing, norm_weight, norm_eps, merge),
        lambda: mix_reference(streams, mixing, norm_weight, norm_eps, merge),
    )  # fmt: skip
