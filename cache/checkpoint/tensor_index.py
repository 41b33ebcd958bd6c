"""Index of a checkpoint's safetensors files, read from their headers alone.

Reading the headers ourselves (8-byte length, JSON) lets validation catch truncated
or malformed files before any tensor is touched, and gives the cache key the exact
bytes that identify a checkpoint.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from cache.errors import CorruptCheckpoint

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # [begin, end) within the file's data section


@dataclass(frozen=True)
class FileInfo:
    path: Path
    size: int
    header: bytes  # raw JSON header: part of the checkpoint's identity


def safetensors_files(ckpt: Path) -> list[Path]:
    """The checkpoint's safetensors files, from model.safetensors.index.json when present."""
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"unreadable shard index: {exc}", path=str(index)) from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (ckpt / n).is_file()]
        if missing:
            raise CorruptCheckpoint(f"shard index names missing files {missing}", path=str(index))
        return [ckpt / n for n in names]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CorruptCheckpoint("no *.safetensors files", path=str(ckpt))
    return files


def read_raw_header(path: Path) -> FileInfo:
    """One safetensors file's size and header bytes, unparsed (enough for the cache key)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CorruptCheckpoint("file shorter than a safetensors header", path=str(path))
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpoint(f"header length {header_len} exceeds the file", path=str(path))
        header = f.read(header_len)
    return FileInfo(path, size, header)


def read_header(path: Path) -> tuple[FileInfo, list[TensorInfo]]:
    """Parse one safetensors header and check every tensor's bytes lie inside the file."""
    info = read_raw_header(path)
    size, header, header_len = info.size, info.header, len(info.header)
    try:
        meta = json.loads(header)
        if not isinstance(meta, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as exc:
        raise CorruptCheckpoint(f"malformed safetensors header: {exc}", path=str(path)) from None

    data_size = size - 8 - header_len
    tensors = []
    for name, entry in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"malformed header entry for {name!r}", path=str(path)) from None
        if dtype not in DTYPE_BYTES:
            raise CorruptCheckpoint(f"tensor {name!r} has unknown dtype {dtype!r}", path=str(path))
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * DTYPE_BYTES[dtype] or begin < 0:
            raise CorruptCheckpoint(f"tensor {name!r}: offsets disagree with dtype and shape", path=str(path))
        if end > data_size:
            raise CorruptCheckpoint(
                f"truncated: tensor {name!r} ends at byte {end} but the data section has {data_size}",
                path=str(path),
            )
        tensors.append(TensorInfo(name, path, dtype, shape, (begin, end)))
    return info, tensors


def index_tensors(ckpt: Path) -> tuple[list[FileInfo], dict[str, TensorInfo]]:
    """All tensors of a checkpoint directory, by name; a name in two files is an error."""
    files, tensors = [], {}
    for path in safetensors_files(ckpt):
        info, entries = read_header(path)
        files.append(info)
        for t in entries:
            if t.name in tensors:
                raise CorruptCheckpoint(f"tensor {t.name!r} appears in two files", path=str(path))
            tensors[t.name] = t
    return files, tensors
