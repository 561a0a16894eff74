"""Reading the bytes behind a manifest uri: a plain path, or a member of a tar shard (`path.tar::member`).

WebDataset shards hold thousands of members; `tarfile.getmember` scans the whole archive on every
call. Each process therefore indexes a shard once (member -> data offset, size) and then reads a
member with one seek, so reading a whole shard stays linear in its size.
"""

from __future__ import annotations

import os
import tarfile
from functools import lru_cache
from pathlib import Path

TAR_SEP = "::"


def tar_uri(tar_path: str, member: str) -> str:
    return f"{tar_path}{TAR_SEP}{member}"


def split_uri(uri: str) -> tuple[str, str | None]:
    """`a.tar::b.jpg` -> ("a.tar", "b.jpg"); a plain path -> (path, None)."""
    if TAR_SEP in uri:
        tar_path, member = uri.split(TAR_SEP, 1)
        return tar_path, member
    return uri, None


@lru_cache(maxsize=16)
def _tar_index(tar_path: str, mtime_ns: int, size: int) -> dict[str, tuple[int, int]]:
    """Regular members of one tar file: name -> (offset of the data, size). Keyed on mtime and size."""
    with tarfile.open(tar_path, "r:") as tf:  # plain tar only: offsets mean nothing inside a compressed stream
        return {m.name: (m.offset_data, m.size) for m in tf.getmembers() if m.isfile()}


def tar_index(tar_path: str) -> dict[str, tuple[int, int]]:
    st = os.stat(tar_path)
    return _tar_index(tar_path, st.st_mtime_ns, st.st_size)


def tar_members(tar_path: str) -> list[str]:
    """Regular file members of a tar shard in archive order (the order WebDataset writes samples)."""
    try:
        return list(tar_index(tar_path))
    except tarfile.ReadError:  # compressed shard: list it the slow way
        with tarfile.open(tar_path) as tf:
            return [m.name for m in tf.getmembers() if m.isfile()]


def _read_compressed_member(tar_path: str, member: str) -> bytes:
    with tarfile.open(tar_path) as tf:
        f = tf.extractfile(member)
        if f is None:
            raise OSError(f"{tar_uri(tar_path, member)}: not a regular tar member")
        return f.read()


def read_bytes(uri: str) -> bytes:
    tar_path, member = split_uri(uri)
    if member is None:
        return Path(uri).read_bytes()
    try:
        offset, size = tar_index(tar_path)[member]
    except tarfile.ReadError:
        return _read_compressed_member(tar_path, member)
    except (KeyError, tarfile.TarError) as e:
        raise OSError(f"{uri}: not a regular tar member ({e})") from e
    with open(tar_path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{uri}: tar member truncated ({len(data)} of {size} bytes)")
    return data
