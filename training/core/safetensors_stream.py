"""Writing a safetensors file one tensor at a time, and joining per-rank parts into one file.

`safetensors.torch.save_file` takes the whole state dict at once; a merge of a model that does not fit in
one process's memory cannot build one. The format is simple enough to stream: an 8-byte little-endian
header length, a JSON header ({name: {dtype, shape, data_offsets}}, "__metadata__"), then the tensors'
bytes back to back. The header is known before any tensor is (names, dtypes and shapes come from the
sources), so a writer emits it first and then each tensor as it is computed. Tensors are laid out in
sorted name order whoever writes them, so the file is the same bytes for one process or many ranks.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

Spec = tuple[torch.dtype, tuple[int, ...]]  # a tensor's dtype and shape


def nbytes(spec: Spec) -> int:
    dtype, shape = spec
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def header_bytes(specs: dict[str, Spec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding `specs`, in sorted name order, padded to 8 bytes."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        if dtype not in DTYPES:
            raise ValueError(f"{name}: safetensors cannot store dtype {dtype}")
        size = nbytes(specs[name])
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(path: Path) -> tuple[dict[str, Spec], dict[str, tuple[int, int]], int]:
    """({name: spec}, {name: absolute byte range}, file size) of a safetensors file, reading only its header."""
    with Path(path).open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    start = 8 + n
    specs = {k: (TORCH_DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in header.items()}
    ranges = {k: (start + v["data_offsets"][0], start + v["data_offsets"][1]) for k, v in header.items()}
    return specs, ranges, Path(path).stat().st_size


class SafetensorsWriter:
    """A safetensors file written tensor by tensor, in sorted name order, to a temporary name that becomes
    `path` on `close()` once every tensor is in (a killed write leaves no half file under `path`)."""

    def __init__(self, path: Path, specs: dict[str, Spec], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian bytes: this writer runs on little-endian hosts only")
        self.path, self.specs = Path(path), dict(specs)
        self._order = sorted(self.specs)
        self._next = 0
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = self._tmp.open("wb")
        self._file.write(header_bytes(self.specs, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing more"
            raise ValueError(f"{self.path}: tensors are written in sorted name order; got {name}, expected {expected}")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path}: {name} is {tensor.dtype} {tuple(tensor.shape)}, the header says {dtype} {shape}"
            )
        self._file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> Path:
        self._file.close()
        if self._next != len(self._order):
            self._tmp.unlink()
            raise ValueError(
                f"{self.path}: {len(self._order) - self._next} tensors were not written (next: {self._order[self._next]})"
            )
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def join_parts(parts: list[Path], path: Path, metadata: dict[str, str] | None = None, chunk: int = 64 << 20) -> Path:
    """One safetensors file at `path` holding every tensor of `parts` (disjoint names), copied range by
    range (at most `chunk` bytes in memory): the same bytes a single writer of all tensors would write."""
    specs: dict[str, Spec] = {}
    where: dict[str, tuple[Path, int, int]] = {}
    for part in parts:
        part_specs, ranges, _ = read_header(part)
        for name in part_specs:
            if name in specs:
                raise ValueError(f"{name} is in two parts ({where[name][0]} and {part})")
            specs[name] = part_specs[name]
            where[name] = (Path(part), *ranges[name])
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
    handles = {}
    try:
        with tmp.open("wb") as out:
            out.write(header_bytes(specs, metadata))
            for name in sorted(specs):
                part, start, end = where[name]
                f = handles.setdefault(part, part.open("rb"))
                f.seek(start)
                _copy_range(f, out, end - start, chunk)
        os.replace(tmp, path)
    finally:
        for f in handles.values():
            f.close()
        tmp.unlink(missing_ok=True)
    return Path(path)


def _copy_range(src, dst, n: int, chunk: int) -> None:
    while n > 0:
        block = src.read(min(chunk, n))
        if not block:
            raise ValueError(f"{src.name} ends {n} bytes before its header says")
        dst.write(block)
        n -= len(block)
