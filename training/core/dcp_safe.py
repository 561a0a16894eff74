"""Reading DCP checkpoints without running code from them.

torch 2.13's FileSystemReader reads `.metadata` with plain `pickle.load`, and its DefaultLoadPlanner
reads non-tensor values (optimiser hyper-parameters) with `torch.load(weights_only=False)`: a crafted
checkpoint folder runs whatever it names. Here `.metadata` goes through an unpickler that admits only
the classes DCP itself pickles there (its metadata dataclasses, torch dtypes / sizes / layouts, paths),
and non-tensor values are read with `torch.load(weights_only=True)`. Tensor shards already are.

This narrows what an untrusted folder can do; it does not make one trustworthy: training/core/manifest.py
decides whether a folder is loaded at all.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's metadata names something other than DCP's own classes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return getattr(pathlib, name) if module == "pathlib" else super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if (
                isinstance(obj, type) and obj.__module__ == module
            ):  # a class DCP defines there, not a re-export (os, pickle...)
                return obj
        raise UnsafeCheckpoint(
            f"checkpoint metadata names {module}.{name}, which is not one of DCP's metadata classes: refusing to load it"
        )


def load_metadata(path) -> Any:
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            metadata = load_metadata(path)
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{path}: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), "not plain data")
            raise UnsafeCheckpoint(
                f"the pickled value {read_item.dest_index.fqn} is refused by weights_only loading ({why})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path, **kwargs) -> None:
    """dcp.load with the restricted reader and planner. The metadata is checked here first, so a refusal
    is an UnsafeCheckpoint naming the file (inside dcp.load it would come wrapped in DCP's own error)."""
    import torch.distributed.checkpoint as dcp

    try:
        load_metadata(Path(path) / ".metadata")
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{Path(path) / '.metadata'}: {e}") from None
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:  # DCP wraps each rank's error; a refusal is reported as itself
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpoint)]
        if refused:
            raise UnsafeCheckpoint(f"{path}: {refused[0]}") from None
        raise
