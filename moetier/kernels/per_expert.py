"""The per-expert path: each routed expert of a call through torch's ops, the reference the kernels are held to.

Its contract: ``out`` gains, per group and in group order, exactly the bits of
:func:`moetier.tiers.experts.swiglu_expert` on the group's token rows, times the pairs' routing weights in float32
(``y.float() * gate.float()``), added with ``index_add_``. :func:`moetier.kernels.grouped_experts.run_experts` sends
here the rest: groups of more than ``MAX_GROUP_TOKENS`` tokens (prefill's busy experts, where cuBLAS's GEMMs
use the tensor cores better) unless the opt-in fat kernels take them, and any group its kernels can't run (off
CUDA, without Triton, a block layout they don't read, after a kernel failure).

Groups run in batches (:func:`_batches`) because prefill's fat experts are host-bound: a batch gathers its rows
and runs the SwiGLU and the gate scaling once, and leaves each expert only its dequantisation, its two GEMMs and
its scatter-add; every op is row-wise or elementwise, so the bits are those of one expert at a time
(``MOETIER_EXPERT_BATCHES=0``, read per call, runs them so, for A/B runs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moetier.kernels.swiglu import swiglu
from moetier.tiers.experts import ExpertWeights

# One (expert block, run of sorted pairs) per group: what the per-expert path loops over.
Group = tuple[ExpertWeights, int, int]  # (weights, first pair, pair count)


def run_per_expert(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_gates: torch.Tensor,
    groups: Sequence[Group],
    swiglu_limit: float | None,
) -> None:
    """The reference path: :func:`swiglu_expert` per group, scaled and added into ``out`` in group order.

    Groups run in batches (:func:`_batches`) to spend fewer host ops an expert (the prefill's fat experts are
    host-bound): a batch gathers its tokens' rows, runs the SwiGLU (:func:`~moetier.kernels.swiglu.swiglu`) and
    the gate scaling once over all its rows, and leaves to each expert only its dequantisation, its two GEMMs
    (each the same ``F.linear`` on the same rows as :func:`swiglu_expert`'s) and its scatter-add, in group order.
    Every op is elementwise or row-wise, so the bits are the loop's. Each output is ``y.float() * gate.float()``:
    the product of ``y`` (in the activations' dtype) with float32 gates is that (torch widens ``y`` exactly, then
    multiplies in float32).
    """
    if not groups:
        return
    gates32 = pair_gates.float()
    batches = _batches(groups, hidden.dtype) if expert_batches_enabled() else [[group] for group in groups]
    for batch in batches:
        _run_batch(out, hidden, pair_tokens, gates32, batch, swiglu_limit)


# A batch's caps: its rows bound the activations it holds (~6 values of the hidden width a row), and the dense
# copies of its quantised experts are held from their gate/up GEMM to their down GEMM (a V4-Flash expert: 48 MiB).
_BATCH_ROWS = 4096
_BATCH_DEQUANT_BYTES = 192 << 20


def expert_batches_enabled() -> bool:
    """``MOETIER_EXPERT_BATCHES=0`` (read per call) runs the per-expert path one group a batch, and a streaming
    prefill call one fat expert (the call shapes before batches, for A/B runs); the bits are the same."""
    return os.environ.get("MOETIER_EXPERT_BATCHES", "1") != "0"


def _batches(groups: Sequence[Group], dtype: torch.dtype) -> list[list[Group]]:
    """Consecutive groups in batches of at most ``_BATCH_ROWS`` pairs and ``_BATCH_DEQUANT_BYTES`` of dense
    copies of quantised experts (a group larger than either is a batch of its own); a change of expert shape
    starts a new batch (the rows are concatenated)."""
    batches: list[list[Group]] = []
    rows = held = 0
    shape = None
    for group in groups:
        weights, _, count = group
        dense, group_shape = _dense_bytes(weights, dtype), _expert_shape(weights)
        if not batches or rows + count > _BATCH_ROWS or held + dense > _BATCH_DEQUANT_BYTES or group_shape != shape:
            batches.append([])
            rows = held = 0
        batches[-1].append(group)
        rows, held, shape = rows + count, held + dense, group_shape
    return batches


def _expert_shape(weights: ExpertWeights) -> tuple[int, int]:
    """(intermediate, hidden) of an expert, quantised or not."""
    if weights.quantized:
        return weights.gate_q.shape[0], weights.down_q.shape[0]
    return weights.down.shape[1], weights.down.shape[0]


def _dense_bytes(weights: ExpertWeights, dtype: torch.dtype) -> int:
    """Bytes of the dense copy a quantised expert is computed from (0: dense weights are used in place)."""
    if not weights.quantized:
        return 0
    inter, size = _expert_shape(weights)
    return 3 * inter * size * dtype.itemsize


def _run_batch(
    out: torch.Tensor,
    hidden: torch.Tensor,
    pair_tokens: torch.Tensor,
    gates32: torch.Tensor,
    batch: Sequence[Group],
    swiglu_limit: float | None,
) -> None:
    tokens, gates = _batch_rows(pair_tokens, batch), _batch_rows(gates32, batch)
    counts = [count for _, _, count in batch]
    dense = [w.dequantized(hidden.dtype) if w.quantized else w for w, _, _ in batch]
    rows = _split(hidden[tokens], counts)
    gate_up = _joined([F.linear(x, w.gate_up) for w, x in zip(dense, rows, strict=True)])
    del rows  # the gathered rows are not read again
    inter = gate_up.shape[1] // 2
    act = swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
    del gate_up
    y = _joined([F.linear(a, w.down) for w, a in zip(dense, _split(act, counts), strict=True)])
    del act, dense
    scaled = torch.mul(y, gates[:, None])
    for rows_of, part in zip(_split(tokens, counts), _split(scaled, counts), strict=True):
        out.index_add_(0, rows_of, part)


def _split(values: torch.Tensor, counts: list[int]) -> Sequence[torch.Tensor]:
    """Each group's rows of a batch's concatenated ``values`` (views; the whole tensor for one group)."""
    return (values,) if len(counts) == 1 else values.split(counts)


def _batch_rows(values: torch.Tensor, batch: Sequence[Group]) -> torch.Tensor:
    """The batch's groups' runs of ``values`` (per sorted pair), concatenated: a view where the runs adjoin."""
    first, last = batch[0], batch[-1]
    adjoining = all(a[1] + a[2] == b[1] for a, b in zip(batch, batch[1:], strict=False))
    if adjoining:
        return values[first[1] : last[1] + last[2]]
    return torch.cat([values[start : start + count] for _, start, count in batch])


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
