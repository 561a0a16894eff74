"""The one reader: the bytes behind a uri, wherever it lives.

A uri is a local path, an fsspec url (`file://`, `s3://`, `gs://`, `https://`), or a member of a tar
shard on any of those: `tar://` + the shard's uri (its `%` and `#` written `%25` and `%23`) + `#` + the
member's name as stored, e.g. `tar:///data/shard-000.tar#s/000.jpg`, `tar://s3://bucket/shard.tar#000.jpg`.
Only a uri that starts with `tar://` names a member, so any local file name (`x::y.jpg`, `a#b.png`) means
itself. Credentials and endpoints come from where each store's
own client looks (AWS_* variables or ~/.aws, `AWS_ENDPOINT_URL` for S3-compatible stores,
GOOGLE_APPLICATION_CREDENTIALS or gcloud's files): nothing here takes them, and no uri carries them.

Reading never hangs and never reads without bound: a local path is opened only when it is a regular file
(a FIFO, socket or device is refused before it is opened, and opened non-blocking in case it was swapped
since), and a reader given `max_bytes` refuses a larger object from its size before reading it.

WebDataset shards hold thousands of members; `tarfile.getmember` scans the whole archive on every
call. Each process therefore indexes a shard once (member -> data offset, size) and then reads a
member with one seek, locally, or one ranged GET, remotely, so reading a shard stays linear in its size.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import BinaryIO, NamedTuple

TAR_SCHEME = "tar://"
CHUNK = 1 << 20  # bytes hashed at a time: a file of any size is hashed in constant memory


def tar_uri(tar_path: str, member: str) -> str:
    return f"{TAR_SCHEME}{tar_path.replace('%', '%25').replace('#', '%23')}#{member}"


def split_uri(uri: str) -> tuple[str, str | None]:
    """`tar://a.tar#b.jpg` -> ("a.tar", "b.jpg"); any other uri -> (uri, None)."""
    if not uri.startswith(TAR_SCHEME):
        return uri, None
    shard, _, member = uri[len(TAR_SCHEME) :].partition("#")
    return re.sub("%(25|23)", lambda m: "%" if m.group(1) == "25" else "#", shard), member


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri.removeprefix("file://")


def within(uri: str, root: str) -> bool:
    """Whether uri lies under root (a folder, an object-store prefix, a shard or one object), judged on the normalised
    path, so `..` cannot climb out of it; a tar member lies where its shard does."""
    uri, root = split_uri(uri)[0], split_uri(root)[0]
    if is_local(uri) != is_local(root):
        return False
    if is_local(uri):
        p, r = os.path.abspath(local_path(uri)), os.path.abspath(local_path(root))
        return p == r or p.startswith(r.rstrip("/") + "/")
    if ".." in uri.split("/"):
        return False
    return uri == root or uri.startswith(root if root.endswith("/") else root + "/")


class NotARegularFile(OSError):
    """A FIFO, socket, device or folder where a file was expected; `kind` says which."""

    def __init__(self, uri: str, kind: str):
        super().__init__(f"{uri}: a {kind}, not a regular file")
        self.kind = kind


class TooLarge(OSError):
    """An object over `max_bytes`; `size` is its size where known before reading, else None."""

    def __init__(self, uri: str, size: int | None, max_bytes: int):
        super().__init__(
            f"{uri}: {size if size is not None else 'more than ' + str(max_bytes)} bytes, over max_bytes={max_bytes}"
        )
        self.size = size


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return kind
    return "regular file" if stat.S_ISREG(mode) else "special file"


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
    except Exception as e:  # botocore, aiohttp, google-auth: each has its own hierarchy
        raise RemoteError(f"{uri}: {type(e).__name__}: {e}") from e


class TarEntry(NamedTuple):
    offset: int  # of the member's data in the shard; -1 in a compressed shard
    size: int
    kind: str  # "file", or what else the member is (symlink, hard link, FIFO, device): never read


def _member_kind(m: tarfile.TarInfo) -> str:
    if m.isfile():
        return "file"
    return (
        "symlink"
        if m.issym()
        else "hard link"
        if m.islnk()
        else "FIFO"
        if m.isfifo()
        else "device"
        if m.isdev()
        else "special member"
    )


def _entries(tf: tarfile.TarFile) -> dict[str, TarEntry]:
    """Every member but folders, in archive order: name -> where its data is, its size and kind."""
    return {m.name: TarEntry(m.offset_data, m.size, _member_kind(m)) for m in tf.getmembers() if not m.isdir()}


@lru_cache(maxsize=16)
def _local_tar_index(tar_path: str, mtime_ns: int, size: int) -> dict[str, TarEntry]:
    """The members of one local tar file, keyed on its mtime and size."""
    with tarfile.open(tar_path, "r:") as tf:  # plain tar only: offsets mean nothing inside a compressed stream
        return _entries(tf)


@lru_cache(maxsize=16)
def _remote_tar_index(tar_path: str) -> dict[str, TarEntry]:
    fs, path = filesystem(tar_path)

    def index() -> dict[str, TarEntry]:
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
            return _entries(tf)

    try:
        return remote_call(tar_path, index)
    except RemoteError as e:
        if isinstance(e.__cause__, tarfile.TarError):
            raise tarfile.ReadError(str(e)) from e
        raise


def _regular_stat(path: str, uri: str) -> os.stat_result:
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFile(uri, file_kind(st.st_mode))
    return st


def tar_index(tar_path: str) -> dict[str, TarEntry]:
    """A plain tar shard's members with their data offsets; tarfile.ReadError for a compressed or broken shard."""
    if is_local(tar_path):
        p = local_path(tar_path)
        st = _regular_stat(p, tar_path)  # a FIFO named .tar would block tarfile forever
        return _local_tar_index(p, st.st_mtime_ns, st.st_size)
    return _remote_tar_index(tar_path)


def _open_tar(tar_path: str) -> tarfile.TarFile:
    if is_local(tar_path):
        _regular_stat(local_path(tar_path), tar_path)
        return tarfile.open(local_path(tar_path))
    fs, path = filesystem(tar_path)
    return tarfile.open(fileobj=fs.open(path, "rb"))


def tar_entries(tar_path: str) -> dict[str, TarEntry]:
    """Every member but folders in archive order (the order WebDataset writes samples); a compressed shard the slow way.

    Raises tarfile.TarError for a file that is no tar (or a broken one), OSError when it cannot be read."""
    try:
        return tar_index(tar_path)
    except tarfile.ReadError:  # compressed shard: list it the slow way
        with _open_tar(tar_path) as tf:
            return {name: e._replace(offset=-1) for name, e in _entries(tf).items()}


def tar_members(tar_path: str) -> list[str]:
    """Regular file members of a tar shard in archive order."""
    return [name for name, e in tar_entries(tar_path).items() if e.kind == "file"]


def _read_compressed_member(uri: str, tar_path: str, member: str, max_bytes: int | None) -> bytes:
    with _open_tar(tar_path) as tf:
        try:
            info = tf.getmember(member)
        except KeyError as e:
            raise OSError(f"{uri}: no such member in the shard") from e
        f = tf.extractfile(info)
        if f is None or not info.isfile():
            raise NotARegularFile(uri, f"tar {_member_kind(info)}")
        if max_bytes is not None and info.size > max_bytes:
            raise TooLarge(uri, info.size, max_bytes)
        return f.read()


def read_range(path: str, offset: int, size: int) -> bytes:
    """`size` bytes from `offset` (fewer at the end of the object): a seek locally, one ranged GET remotely."""
    if is_local(path):
        with open(local_path(path), "rb") as f:
            f.seek(offset)
            return f.read(size)
    fs, p = filesystem(path)
    return remote_call(path, fs.cat_file, p, start=offset, end=offset + size)


def object_size(uri: str) -> int:
    """The object's size in bytes, from the file system or the store (no read); FileNotFoundError when absent."""
    if is_local(uri):
        return os.stat(local_path(uri)).st_size
    fs, path = filesystem(uri)
    return int(remote_call(uri, fs.size, path))


def _read_checked_member(uri: str, tar_path: str, member: str, offset: int, size: int) -> bytes:
    """One ranged GET of the member with its 512-byte header, which must still name this member and size."""
    block = read_range(tar_path, offset - tarfile.BLOCKSIZE, size + tarfile.BLOCKSIZE)
    if len(block) > size + tarfile.BLOCKSIZE:
        raise OSError(f"{uri}: asked for {size} bytes at {offset}, got {len(block)}: the server ignores Range requests")
    try:
        header = tarfile.TarInfo.frombuf(block[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
    except tarfile.TarError as e:
        raise OSError(f"{uri}: the shard changed since it was indexed (no tar header before the member: {e})") from e
    if header.size != size or (len(member) <= 100 and header.name != member):  # longer names live in pax / GNU blocks
        raise OSError(
            f"{uri}: the shard changed since it was indexed (header says {header.name!r}, {header.size} bytes)"
        )
    if len(block) < size + tarfile.BLOCKSIZE:
        raise OSError(f"{uri}: tar member truncated ({len(block) - tarfile.BLOCKSIZE} of {size} bytes)")
    return block[tarfile.BLOCKSIZE :]


def _read_member(uri: str, tar_path: str, member: str, max_bytes: int | None) -> bytes:
    try:
        entry = tar_index(tar_path)[member]
    except tarfile.ReadError:
        return _read_compressed_member(uri, tar_path, member, max_bytes)
    except KeyError as e:
        raise OSError(f"{uri}: no such member in the shard") from e
    except tarfile.TarError as e:
        raise OSError(f"{uri}: not a readable tar shard ({e})") from e
    if entry.kind != "file":
        raise NotARegularFile(uri, f"tar {entry.kind}")
    if max_bytes is not None and entry.size > max_bytes:
        raise TooLarge(uri, entry.size, max_bytes)
    offset, size = entry.offset, entry.size
    if not is_local(tar_path):  # the index is cached per process: check the shard was not replaced since
        return _read_checked_member(uri, tar_path, member, offset, size)
    data = read_range(tar_path, offset, size)
    if len(data) > size:
        raise OSError(f"{uri}: asked for {size} bytes at {offset}, got {len(data)}: the server ignores Range requests")
    if len(data) < size:
        raise OSError(f"{uri}: tar member truncated ({len(data)} of {size} bytes)")
    return data


def _open_local(uri: str, max_bytes: int | None) -> BinaryIO:
    """A regular file opened for reading. Checked before opening (opening a FIFO blocks until a writer comes, a
    device streams forever) and again on the open descriptor, opened non-blocking, in case it was swapped between."""
    path = local_path(uri)
    _regular_stat(path, uri)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(uri, file_kind(st.st_mode))
        if max_bytes is not None and st.st_size > max_bytes:
            raise TooLarge(uri, st.st_size, max_bytes)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_remote(uri: str, max_bytes: int | None) -> bytes:
    fs, path = filesystem(uri)
    if max_bytes is None:
        return remote_call(uri, fs.cat_file, path)

    def bounded() -> tuple[int | None, bytes]:
        with fs.open(path, "rb") as f:  # the store's size first, so a huge object is refused unread
            size = getattr(f, "size", None)
            if size is not None and size > max_bytes:
                return size, b""
            return size, f.read() if size is not None else f.read(max_bytes + 1)

    size, data = remote_call(uri, bounded)
    if size is not None and size > max_bytes:
        raise TooLarge(uri, size, max_bytes)
    if len(data) > max_bytes:
        raise TooLarge(uri, None, max_bytes)
    return data


@contextmanager
def open_uri(uri: str, max_bytes: int | None = None) -> Iterator[BinaryIO]:
    """A seekable binary file of the object's bytes: a local file where it lies (hashed in chunks, never held whole),
    a remote object or a tar member read into memory, at most `max_bytes` of it (TooLarge beyond).

    Any failure is an OSError whose message names the uri: NotARegularFile, TooLarge, or the OS's or store's error."""
    tar_path, member = split_uri(uri)
    try:
        if member is not None:
            f: BinaryIO = io.BytesIO(_read_member(uri, tar_path, member, max_bytes))
        elif is_local(uri):
            f = _open_local(uri, max_bytes)
        else:
            f = io.BytesIO(_read_remote(uri, max_bytes))
    except ValueError as e:  # a NUL byte in a path
        raise OSError(f"{uri}: {e}") from e
    with f:
        yield f


def read_bytes(uri: str, max_bytes: int | None = None) -> bytes:
    """The whole object, or one tar member; any failure is an OSError whose message names the uri."""
    with open_uri(uri, max_bytes) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:  # a local file that grew after it was opened
        raise TooLarge(uri, None, max_bytes)
    return data


def md5_of(f: BinaryIO, uri: str, max_bytes: int | None = None) -> tuple[str, int]:
    """(md5 hex, length) of a file read from its current position in CHUNK-sized pieces, so any size hashes in
    constant memory; TooLarge once more than max_bytes came (a file that grew after it was opened)."""
    h, n = hashlib.md5(), 0
    while chunk := f.read(CHUNK):
        n += len(chunk)
        if max_bytes is not None and n > max_bytes:
            raise TooLarge(uri, None, max_bytes)
        h.update(chunk)
    return h.hexdigest(), n
