"""The one reader: the bytes behind a uri, wherever it lives.

A uri is a local path, an fsspec url (`file://`, `s3://`, `gs://`, `https://`), or a member of a tar
shard on any of those (`shard.tar::member`). Credentials and endpoints come from where each store's
own client looks (AWS_* variables or ~/.aws, `AWS_ENDPOINT_URL` for S3-compatible stores,
GOOGLE_APPLICATION_CREDENTIALS or gcloud's files): nothing here takes them, and no uri carries them.

WebDataset shards hold thousands of members; `tarfile.getmember` scans the whole archive on every
call. Each process therefore indexes a shard once (member -> data offset, size) and then reads a
member with one seek, locally, or one ranged GET, remotely, so reading a shard stays linear in its size.
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


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


class RemoteError(OSError):
    """A store answered with an error (or did not answer); the message names the uri."""


def filesystem(uri: str):
    """(fsspec filesystem, path inside it) for a remote url; fsspec caches the instances per process."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as e:  # a scheme whose fsspec driver is not installed
        raise RemoteError(f"{uri}: no reader for this scheme ({e})") from e


def remote_call(uri: str, fn, *args, **kwargs):
    """Run one filesystem call, turning whatever the store's client raises into an OSError naming the uri."""
    try:
        return fn(*args, **kwargs)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{uri}: not found ({e})") from e
    except PermissionError as e:
        raise PermissionError(f"{uri}: access denied ({e})") from e
    except Exception as e:  # noqa: BLE001 - botocore, aiohttp, google-auth: each has its own hierarchy
        raise RemoteError(f"{uri}: {type(e).__name__}: {e}") from e


@lru_cache(maxsize=16)
def _local_tar_index(tar_path: str, mtime_ns: int, size: int) -> dict[str, tuple[int, int]]:
    """Regular members of one local tar file: name -> (offset of the data, size). Keyed on mtime and size."""
    with tarfile.open(tar_path, "r:") as tf:  # plain tar only: offsets mean nothing inside a compressed stream
        return {m.name: (m.offset_data, m.size) for m in tf.getmembers() if m.isfile()}


@lru_cache(maxsize=16)
def _remote_tar_index(tar_path: str) -> dict[str, tuple[int, int]]:
    fs, path = filesystem(tar_path)

    def index() -> dict[str, tuple[int, int]]:
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
            return {m.name: (m.offset_data, m.size) for m in tf.getmembers() if m.isfile()}

    try:
        return remote_call(tar_path, index)
    except RemoteError as e:
        if isinstance(e.__cause__, tarfile.TarError):
            raise tarfile.ReadError(str(e)) from e
        raise


def tar_index(tar_path: str) -> dict[str, tuple[int, int]]:
    if is_local(tar_path):
        p = local_path(tar_path)
        st = os.stat(p)
        return _local_tar_index(p, st.st_mtime_ns, st.st_size)
    return _remote_tar_index(tar_path)


def _open_tar(tar_path: str) -> tarfile.TarFile:
    if is_local(tar_path):
        return tarfile.open(local_path(tar_path))
    fs, path = filesystem(tar_path)
    return tarfile.open(fileobj=fs.open(path, "rb"))


def tar_members(tar_path: str) -> list[str]:
    """Regular file members of a tar shard in archive order (the order WebDataset writes samples)."""
    try:
        return list(tar_index(tar_path))
    except tarfile.ReadError:  # compressed shard: list it the slow way
        with _open_tar(tar_path) as tf:
            return [m.name for m in tf.getmembers() if m.isfile()]


def _read_compressed_member(tar_path: str, member: str) -> bytes:
    with _open_tar(tar_path) as tf:
        f = tf.extractfile(member)
        if f is None:
            raise OSError(f"{tar_uri(tar_path, member)}: not a regular tar member")
        return f.read()


def _read_range(path: str, offset: int, size: int) -> bytes:
    if is_local(path):
        with open(local_path(path), "rb") as f:
            f.seek(offset)
            return f.read(size)
    fs, p = filesystem(path)
    return remote_call(path, fs.cat_file, p, start=offset, end=offset + size)


def _read_checked_member(uri: str, tar_path: str, member: str, offset: int, size: int) -> bytes:
    """One ranged GET of the member with its 512-byte header, which must still name this member and size."""
    block = _read_range(tar_path, offset - tarfile.BLOCKSIZE, size + tarfile.BLOCKSIZE)
    if len(block) > size + tarfile.BLOCKSIZE:
        raise OSError(f"{uri}: asked for {size} bytes at {offset}, got {len(block)}: the server ignores Range requests")
    try:
        header = tarfile.TarInfo.frombuf(block[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
    except tarfile.TarError as e:
        raise OSError(f"{uri}: the shard changed since it was indexed (no tar header before the member: {e})") from e
    if header.size != size or (len(member) <= 100 and header.name != member):  # longer names live in pax / GNU blocks
        raise OSError(f"{uri}: the shard changed since it was indexed (header says {header.name!r}, {header.size} bytes)")
    if len(block) < size + tarfile.BLOCKSIZE:
        raise OSError(f"{uri}: tar member truncated ({len(block) - tarfile.BLOCKSIZE} of {size} bytes)")
    return block[tarfile.BLOCKSIZE :]


def read_bytes(uri: str) -> bytes:
    """The whole object, or one tar member; any failure is an OSError whose message names the uri."""
    tar_path, member = split_uri(uri)
    if member is None:
        if is_local(uri):
            return Path(local_path(uri)).read_bytes()
        fs, path = filesystem(uri)
        return remote_call(uri, fs.cat_file, path)
    try:
        offset, size = tar_index(tar_path)[member]
    except tarfile.ReadError:
        return _read_compressed_member(tar_path, member)
    except (KeyError, tarfile.TarError) as e:
        raise OSError(f"{uri}: not a regular tar member ({e})") from e
    if not is_local(tar_path):  # the index is cached per process: check the shard was not replaced since
        return _read_checked_member(uri, tar_path, member, offset, size)
    data = _read_range(tar_path, offset, size)
    if len(data) > size:
        raise OSError(f"{uri}: asked for {size} bytes at {offset}, got {len(data)}: the server ignores Range requests")
    if len(data) < size:
        raise OSError(f"{uri}: tar member truncated ({len(data)} of {size} bytes)")
    return data
