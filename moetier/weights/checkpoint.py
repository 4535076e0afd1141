"""Read a Hugging Face model folder: config, shard index and safetensors headers, tensor by tensor."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moetier.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where a stored tensor lives and what its header says."""

    shard: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * _SAFETENSORS_ITEMSIZE.get(self.dtype, 1)


_SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "U32": 4,
    "U16": 2,
}


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None


class Checkpoint:
    """A model folder: ``config.json`` plus one or many safetensors shards.

    All headers are read up front (cheap), so a missing shard, a corrupt header or a tensor the
    index promises but no shard holds fails at once with a one-line :class:`CheckpointError`.
    Tensors are then read one at a time with :meth:`get`, memory-mapped from their shard.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a model folder (expected config.json and *.safetensors)")
        self.config = _read_json(self.path / "config.json", "config.json")
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[Path, Any] = {}
        for shard in self._shard_paths():
            self._read_header(shard)
        self._check_index_complete()

    def _shard_paths(self) -> list[Path]:
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            weight_map = _read_json(index_path, INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: has no weight_map")
            self._index = weight_map
            shards = sorted({self.path / name for name in weight_map.values()})
            for shard in shards:
                if not shard.exists():
                    raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing")
            return shards
        self._index = None
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        return shards

    def _read_header(self, shard: Path) -> None:
        try:
            handle = safe_open(str(shard), framework="pt")
            names = list(handle.keys())
            for name in names:
                piece = handle.get_slice(name)
                self.tensors[name] = TensorInfo(shard, piece.get_dtype(), tuple(piece.get_shape()))
        except Exception as exc:  # safetensors raises several types for a bad file
            raise CheckpointError(f"{shard}: corrupt safetensors file ({exc})") from None
        self._handles[shard] = handle

    def _check_index_complete(self) -> None:
        if self._index is None:
            return
        for name, shard in self._index.items():
            if name not in self.tensors:
                raise CheckpointError(f"{self.path / shard}: does not contain {name} promised by {INDEX_FILE}")

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    def names(self) -> list[str]:
        """Tensor names ordered by shard, then by name, so shards are read sequentially."""
        return sorted(self.tensors, key=lambda n: (str(self.tensors[n].shard), n))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        try:
            return self._handles[info.shard].get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{info.shard}: cannot read tensor {name} ({exc})") from None

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def read_json(self, filename: str) -> dict[str, Any] | None:
        """An optional side file (generation_config.json, tokenizer_config.json) or None if absent."""
        path = self.path / filename
        return _read_json(path, filename) if path.exists() else None
