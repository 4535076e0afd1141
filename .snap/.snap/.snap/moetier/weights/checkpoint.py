"""Read a Hugging Face model folder: config, shard index and safetensors headers, tensor by tensor."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetier.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# A real header is a few MB at most; a larger length field means the file is not safetensors.
_MAX_HEADER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where a stored tensor lives and what its header says.

    ``shape`` is the header's (logical) shape; ``offsets`` are the ``[begin, end)`` byte offsets of
    its data in the shard file (the header's ``data_offsets`` shifted past the header).
    """

    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int] = (0, 0)

    @property
    def numel(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel

    @property
    def nbytes(self) -> int:
        if self.dtype == "F4":  # two 4-bit values per byte
            return (self.numel + 1) // 2
        return self.numel * _SAFETENSORS_ITEMSIZE.get(self.dtype, 1)


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
    "U64": 8,
    "U32": 4,
    "U16": 2,
}

# safetensors dtype names -> torch dtypes (the float8/float4 ones exist only in recent torch).
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "F4": getattr(torch, "float4_e2m1fn_x2", None),
        "U64": getattr(torch, "uint64", None),
        "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
    }.items()
    if dtype is not None
}


def one_line(exc: BaseException) -> str:
    """An exception's text with whitespace collapsed, for embedding in a one-line error."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_safetensors_header(shard: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header without mapping its data.

    Raises a one-line :class:`CheckpointError` naming the file for anything that is not a
    well-formed safetensors file: short file, absurd header length, bad JSON, unknown dtype,
    offsets that disagree with the shape or run past the end of the file (a truncated download).
    """
    try:
        size = shard.stat().st_size
        with shard.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{shard}: corrupt safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{shard}: corrupt safetensors file (header length {header_len} exceeds file size {size})"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{shard}: cannot read ({one_line(exc)})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{shard}: corrupt safetensors header ({one_line(exc)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shard}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - header_len
    return {
        name: _tensor_info(shard, name, entry, data_size, 8 + header_len)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor_info(shard: Path, name: str, entry: Any, data_size: int, data_start: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{shard}: corrupt safetensors header (bad entry for tensor {name})") from None
    if dtype not in _SAFETENSORS_ITEMSIZE:
        raise CheckpointError(f"{shard}: tensor {name} has unsupported dtype {dtype!r}")
    info = TensorInfo(shard, dtype, shape, (data_start + begin, data_start + end))
    if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != info.nbytes:
        raise CheckpointError(
            f"{shard}: corrupt safetensors header (tensor {name}: {dtype} {list(shape)} "
            f"does not fit data_offsets [{begin}, {end}])"
        )
    if end > data_size:
        raise CheckpointError(
            f"{shard}: truncated safetensors file (tensor {name} ends at byte {end} of a {data_size}-byte data section)"
        )
    return info


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """``path`` parsed as a JSON object; ``what`` names the file's role in the messages."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a model folder needs its {what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({one_line(exc)})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({one_line(exc)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


class Checkpoint:
    """A model folder: ``config.json`` plus one or many safetensors shards.

    All headers are read up front (cheap), so a missing shard, a corrupt or truncated file or a
    tensor the index promises but no shard holds fails at once with a one-line
    :class:`CheckpointError`. Tensors are then read one at a time with :meth:`get` by plain file
    reads, not memory maps: pages of a mapped shard stay resident in the process once touched,
    which would make loading peak at model size plus checkpoint size.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: no such model folder")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a model folder (expected config.json and *.safetensors)")
        self.config = _read_json(self.path / "config.json", "config.json")
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shard_paths():
            self._read_header(shard)
        self._check_index_complete()

    def _shard_paths(self) -> list[Path]:
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            weight_map = _read_json(index_path, INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: has no weight_map")
            if not all(isinstance(shard, str) for shard in weight_map.values()):
                raise CheckpointError(f"{index_path}: weight_map values must be shard file names")
            self._index = weight_map
            shards = sorted({self.path / name for name in weight_map.values()})
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing")
            return shards
        self._index = None
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        return shards

    def _read_header(self, shard: Path) -> None:
        for name, info in read_safetensors_header(shard).items():
            if name in self.tensors:
                raise CheckpointError(f"{shard}: tensor {name} is also stored in {self.tensors[name].shard.name}")
            self.tensors[name] = info

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
        """Tensor names ordered by shard, then by position in the shard, so every file is read front to back."""
        return sorted(self.tensors, key=lambda n: (str(self.tensors[n].shard), self.tensors[n].offsets, n))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor ``name`` in its stored dtype, read from its shard (no memory map).

        By default the tensor gets fresh CPU memory. With ``out`` (a contiguous 1-D uint8 CPU
        buffer of at least :attr:`TensorInfo.nbytes`) it is read into the front of ``out`` and the
        result is a view of it, valid until ``out`` is reused: a loader that recycles one staging
        buffer never leaves freed holes between the long-lived blocks it allocates.
        """
        info = self.tensors[name]
        dtype = _TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(f"{info.shard}: tensor {name} has dtype {info.dtype}, which this torch cannot hold")
        if out is None:
            out = torch.empty(info.nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < info.nbytes:
            raise ValueError(f"out must be a contiguous 1-D uint8 buffer of at least {info.nbytes} bytes")
        buffer = out[: info.nbytes]
        self._read_into(name, info, buffer)
        shape = list(info.shape)
        if info.dtype == "F4" and shape:
            shape[-1] //= 2  # torch's float4_e2m1fn_x2 holds two values per element
        return buffer.view(dtype).view(shape)

    def _read_into(self, name: str, info: TensorInfo, buffer: torch.Tensor) -> None:
        try:
            with info.shard.open("rb", buffering=0) as f:
                f.seek(info.offsets[0])
                view, done = memoryview(buffer.numpy()), 0
                while done < info.nbytes:
                    count = f.readinto(view[done:])
                    if not count:
                        raise CheckpointError(f"{info.shard}: truncated while reading tensor {name}")
                    done += count
        except OSError as exc:
            raise CheckpointError(f"{info.shard}: cannot read tensor {name} ({one_line(exc)})") from None

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def read_json(self, filename: str) -> dict[str, Any] | None:
        """An optional side file (generation_config.json, tokenizer_config.json) or None if absent."""
        path = self.path / filename
        return _read_json(path, filename) if path.exists() else None
