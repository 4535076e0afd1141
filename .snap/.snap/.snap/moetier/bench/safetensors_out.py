"""Write safetensors shards by streaming: header first, then each tensor's bytes in chunks.

The safetensors layout is an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`` padded with spaces to a
multiple of 8, then the raw little-endian tensor bytes in header order. Because every tensor's size
is known up front, the header can be written before any data exists, and the data can come from a
generator one chunk at a time: nothing larger than a chunk is ever held in memory.

Disk writes run on a background thread fed from a small pool of reusable buffers, so generating
the next chunk overlaps writing the previous one.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

INDEX_FILE = "model.safetensors.index.json"

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int8: "I8",  # packed FP4 e2m1 codes, as DeepSeek-V4's release stores them
    torch.float8_e8m0fnu: "F8_E8M0",  # their ue8m0 scales
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as the header describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def encode_header(tensors: Sequence[StoredTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix plus the space-padded JSON header for ``tensors`` stored back to back."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data section must start 8-byte aligned
    return len(body).to_bytes(8, "little") + body


def plan_shards(tensors: Sequence[StoredTensor], shard_bytes: int) -> list[list[StoredTensor]]:
    """Greedy split into consecutive groups of at most ``shard_bytes`` (a bigger tensor gets its own shard)."""
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(folder: Path, shards: Sequence[Sequence[StoredTensor]], names: Sequence[str]) -> None:
    """``model.safetensors.index.json``: total size and which shard holds each tensor."""
    weight_map = {t.name: name for group, name in zip(shards, names, strict=True) for t in group}
    total = sum(t.nbytes for group in shards for t in group)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class BufferPool:
    """A fixed set of byte buffers handed out and returned; bounds memory to ``count * nbytes``."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))

    def get(self) -> torch.Tensor:
        return self._free.get()

    def put(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


class AsyncFileWriter:
    """Writes ``(buffer, nbytes)`` items to ``file`` on a thread, returning buffers to ``pool`` once written."""

    def __init__(self, file: BinaryIO, pool: BufferPool) -> None:
        self._file, self._pool = file, pool
        self._items: queue.Queue[tuple[torch.Tensor, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="bench-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            buffer, nbytes = item
            try:
                if self._error is None:
                    self._file.write(buffer[:nbytes].numpy().data)
                    self.written += nbytes
            except BaseException as exc:  # surfaced to the producer on its next call
                self._error = exc
            finally:
                self._pool.put(buffer)

    def submit(self, buffer: torch.Tensor, nbytes: int) -> None:
        self._raise_if_failed()
        self._items.put((buffer, nbytes))

    def close(self) -> None:
        """Wait for every queued write; re-raise a write error (disk full, ...)."""
        self._items.put(None)
        self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def write_shard(
    path: Path,
    tensors: Sequence[StoredTensor],
    chunks: Iterable[tuple[torch.Tensor, int]],
    writer_pool: BufferPool,
    metadata: dict[str, str] | None = None,
    sync: bool = False,
) -> int:
    """Write one shard: header, then the filled buffers ``chunks`` yields, in order.

    ``chunks`` yields ``(buffer, nbytes)`` with buffers taken from ``writer_pool``; the sum of
    ``nbytes`` must equal the header's data size. ``sync`` flushes the file to disk before
    returning. Returns the file size.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this writer only runs on little-endian hosts")
    header = encode_header(tensors, metadata)
    expected = sum(t.nbytes for t in tensors)
    with open(path, "wb") as file:
        file.write(header)
        writer = AsyncFileWriter(file, writer_pool)
        try:
            for buffer, nbytes in chunks:
                writer.submit(buffer, nbytes)
        finally:
            writer.close()
        if writer.written != expected:
            raise RuntimeError(f"{path}: wrote {writer.written} data bytes, header promises {expected}")
        if sync:
            file.flush()
            os.fsync(file.fileno())
    return len(header) + expected
