"""Reading the bytes behind a manifest uri: a plain path, or a member of a tar shard (`path.tar::member`)."""

from __future__ import annotations

import tarfile
from pathlib import Path

TAR_SEP = "::"


def read_bytes(uri: str) -> bytes:
    if TAR_SEP in uri:
        tar_path, member = uri.split(TAR_SEP, 1)
        with tarfile.open(tar_path) as tf:
            f = tf.extractfile(member)
            if f is None:
                raise OSError(f"{uri}: not a regular tar member")
            return f.read()
    return Path(uri).read_bytes()
