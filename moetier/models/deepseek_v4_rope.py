"""DeepSeek-V4 rotary embeddings: per-step rotations of interleaved channel pairs.

V4 rotates *interleaved* channel pairs ``(2i, 2i+1)`` of the trailing ``rope_head_dim`` channels of its
queries, keys and compressed entries, with two tables: ``main`` (sliding layers) and ``compress``
(CSA/HCA layers, compressed entries, the indexer). A forward computes each table's rotation of its
rows once (:class:`StepRope`); a decode step passes them into CUDA graphs as flat tensors
(:func:`rotation_tensors`, :func:`rotations_from`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.kernels.rope_rotate import angles, rotate
from moetier.models.deepseek_v4_decode import MaskCache, ZeroRows, host_ints

# The rope tables of a V4 model, in the order their tensors are flattened.
ROPE_KINDS = ("main", "compress")


@dataclass
class Rotation:
    """RoPE angles of ``N`` positions, laid out for :func:`rotate_`: ``cos`` ``[c0, c0, c1, c1, ...]`` and
    ``sin`` ``[-s0, s0, -s1, s1, ...]`` (``[N, rope_head_dim]``, float32); ``sin_inverse`` is ``-sin``."""

    cos: torch.Tensor
    sin: torch.Tensor
    sin_inverse: torch.Tensor

    def rows(self, rows: slice) -> Rotation:
        return Rotation(self.cos[rows], self.sin[rows], self.sin_inverse[rows])


@dataclass
class RotaryTable:
    """Inverse frequencies (``[rope_head_dim / 2]``) and cos/sin factor of one rope kind.

    Compressed entries are rotated at fixed positions (entry ``w`` of a compressor of rate ``r`` at
    ``w * r``), so their rotations are kept, per ``(rate, dtype)``, in one table ``[entries, 3, rope_head_dim]``
    (cos, sin, sin_inverse) grown on demand: a decode step reads its closing windows' rows (one or two
    view ops) instead of computing them (~17 ops). Every operation is element-wise, so a row is bitwise
    what computing its position alone gives. The table spans the longest context seen: at rope_head_dim 64,
    768 bytes per entry (25 MB for 128k tokens at rate 4).
    """

    inv_freq: torch.Tensor
    factor: float
    entry_tables: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    # Entries the table first holds (and its least growth): a decode step's closes mostly read rows.
    MIN_ENTRIES = 256

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation at ``positions``; cos/sin are rounded to ``dtype`` (the model's) as the reference does."""
        return Rotation(*angles(positions, self.inv_freq, self.factor, dtype))

    def entries(self, first: int, count: int, rate: int, dtype: torch.dtype) -> Rotation:
        """The rotation of entries ``first .. first + count - 1`` (positions ``w * rate``): views of the table."""
        return Rotation(*self.entry_table(first + count, rate, dtype)[first : first + count].unbind(1))

    def entries_at(self, ids: torch.Tensor, rate: int, dtype: torch.dtype, end: int) -> Rotation:
        """The rotation of entries ``ids`` (int64 on the table's device, each below ``end``): one gather."""
        return Rotation(*self.entry_table(end, rate, dtype).index_select(0, ids).unbind(1))

    def entry_table(self, end: int, rate: int, dtype: torch.dtype) -> torch.Tensor:
        """``[>= end, 3, rope_head_dim]``: row ``w`` holds cos, sin and sin_inverse at position ``w * rate``."""
        table = self.entry_tables.get((rate, dtype))
        if table is None or table.shape[0] < end:
            rows = max(end, self.MIN_ENTRIES, 0 if table is None else 2 * table.shape[0])  # doubling: amortised
            rotation = self(torch.arange(0, rows * rate, rate, device=self.inv_freq.device), dtype)
            table = torch.stack((rotation.cos, rotation.sin, rotation.sin_inverse), dim=1)
            self.entry_tables[rate, dtype] = table
        return table


def rotate_(x: torch.Tensor, rotation: Rotation, inverse: bool = False) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i+1)`` of the trailing ``rope_head_dim`` channels of ``x`` in place.

    ``x`` is ``[N, D]`` or ``[N, heads, D]`` (``rotation`` of the same ``N``) and must own its storage:
    callers pass fresh projections/outputs. The rotation runs in float32 (``x * cos + pair_swap(x) * sin``,
    the same products as ``(even * cos - odd * sin, odd * cos + even * sin)``) and rounds into ``x``: one kernel
    where Triton runs (:mod:`moetier.kernels.rope_rotate`).
    """
    return rotate(x, rotation.cos, rotation.sin_inverse if inverse else rotation.sin)


@dataclass
class StepRope:
    """Rotary inputs of one forward: token positions, their rotation per rope kind, and the compress table."""

    positions: torch.Tensor
    token: dict[str, Rotation]
    compress: RotaryTable
    # Rotations of compressed entries emitted this step, by (first entry, count, rate, dtype), or by (the
    # entries, rate, dtype) for entries of several sequences: the CSA compressor and its indexer's, and
    # every layer of the same rate, close the same windows in a step.
    emitted: dict[tuple, Rotation] = field(default_factory=dict)
    # Decode's key padding masks and zero rows of this step (see :mod:`deepseek_v4_decode`), shared by the layers.
    key_masks: MaskCache = field(default_factory=dict)
    zero_rows: ZeroRows = field(default_factory=dict)

    def rows(self, rows: slice) -> StepRope:
        token = {k: r.rows(rows) for k, r in self.token.items()}
        return StepRope(self.positions[rows], token, self.compress, self.emitted, self.key_masks, self.zero_rows)

    def entries(self, first: int, count: int, rate: int, dtype: torch.dtype) -> Rotation:
        """The rotation of entries ``first .. first + count - 1`` (at positions ``w * rate``), looked up once a step."""
        key = (first, count, rate, dtype)
        rotation = self.emitted.get(key)
        if rotation is None:
            rotation = self.emitted[key] = self.compress.entries(first, count, rate, dtype)
        return rotation

    def entries_of(self, ids: tuple[int, ...], rate: int, dtype: torch.dtype) -> Rotation:
        """The rotation of entries ``ids`` (any order; several sequences', decode emits one each), looked up
        once a step; a single entry is :meth:`entries`'."""
        if len(ids) == 1:
            return self.entries(ids[0], 1, rate, dtype)
        key = (ids, rate, dtype)
        rotation = self.emitted.get(key)
        if rotation is None:
            index = host_ints(list(ids), self.positions.device)
            rotation = self.emitted[key] = self.compress.entries_at(index, rate, dtype, max(ids) + 1)
        return rotation


def rotation_tensors(token: dict[str, Rotation]) -> tuple[torch.Tensor, ...]:
    """The tensors of every kind's rotation (:data:`ROPE_KINDS` order, then ``cos, sin, sin_inverse``)."""
    return tuple(t for kind in ROPE_KINDS for t in (token[kind].cos, token[kind].sin, token[kind].sin_inverse))


def rotations_from(tensors: tuple[torch.Tensor, ...]) -> dict[str, Rotation]:
    """Inverse of :func:`rotation_tensors` (regroups the same tensors: no tensor op)."""
    return {kind: Rotation(*tensors[3 * i : 3 * i + 3]) for i, kind in enumerate(ROPE_KINDS)}
