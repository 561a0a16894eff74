"""Checksum manifests for checkpoints: what was written, verified before anything is read back.

A manifest (JSON) lists files of a checkpoint folder with their size and sha256, and carries an HMAC
of its own body under this user's checkpoint key. The checksums catch a truncated or bit-flipped file
(naming it) before torch reads it; the HMAC says that *this* kiln wrote the manifest. That matters for
DCP step checkpoints: DCP's `.metadata` is a pickle, so a checkpoint folder from elsewhere (a DVC
remote, a colleague's disk) is only loaded when its manifest is signed with the local key or the user
marks it trusted (`train.dcp.trust_unsigned`). Safetensors exports cannot run code: for them only the
checksums count.

The key is 32 random bytes in `$KILN_CHECKPOINT_KEY_FILE`, default `~/.config/kiln/checkpoint.key`
(`$XDG_CONFIG_HOME` honoured), created on first use with mode 0600. A multi-rank job uses rank 0's key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

KEY_ENV = "KILN_CHECKPOINT_KEY_FILE"
FORMAT = "kiln-checksums/1"


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, truncated or changed since kiln wrote it."""


class CheckpointUntrusted(ValueError):
    """A checkpoint's manifest is missing or not signed with this user's key."""


def key_path() -> Path:
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "kiln" / "checkpoint.key"


def signing_key() -> bytes:
    """This user's checkpoint key, created (atomically, 0600) when there is none yet."""
    path = key_path()
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # fails if another process made the key first: then theirs is the key
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        except OSError as e:
            raise OSError(
                f"cannot create the checkpoint signing key {path} ({e}): set {KEY_ENV} to a writable file path"
            ) from e
    key = bytes.fromhex(path.read_text().strip())
    if len(key) < 16:
        raise ValueError(f"checkpoint signing key {path} is too short: delete it to make a new one")
    return key


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _body_bytes(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(
    folder: Path,
    name: str,
    files: list[str],
    key: bytes,
    facts: dict | None = None,
    pending: dict[str, bytes] | None = None,
) -> Path:
    """Hash `files` (names inside `folder`) into the signed manifest `folder/name`, written atomically.
    `pending`: {name: bytes} of files written after the manifest (a completion mark that must come last)."""
    folder = Path(folder)
    listed = {f: {"bytes": (folder / f).stat().st_size, "sha256": file_digest(folder / f)} for f in files}
    listed |= {f: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for f, b in (pending or {}).items()}
    body = {"format": FORMAT, "files": dict(sorted(listed.items()))} | (facts or {})
    text = (
        json.dumps(body | {"hmac": hmac.new(key, _body_bytes(body), "sha256").hexdigest()}, indent=2, sort_keys=True)
        + "\n"
    )
    tmp = folder / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / name)
    return folder / name


def read_manifest(path: Path, key: bytes | None, trust_unsigned: bool = False) -> dict:
    """The manifest's body. With `key`, its HMAC must match (unless `trust_unsigned`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointUntrusted(
            f"{path.parent} has no checksum manifest {path.name}: kiln did not write it (or it predates checksums)"
        )
    try:
        doc = json.loads(path.read_text())
        body = {k: v for k, v in doc.items() if k != "hmac"}
        if body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
    except ValueError as e:
        raise CheckpointCorrupt(f"{path}: unreadable checksum manifest ({e})") from None
    if key is not None and not trust_unsigned:
        expected = hmac.new(key, _body_bytes(body), "sha256").hexdigest()
        if not hmac.compare_digest(str(doc.get("hmac", "")), expected):
            raise CheckpointUntrusted(
                f"{path} is not signed with this user's checkpoint key ({key_path()}): a checkpoint from elsewhere, or edited"
            )
    return body


def verify_files(folder: Path, body: dict) -> None:
    """Every file the manifest lists has its recorded size and sha256; the first that does not is named."""
    folder = Path(folder)
    for name, want in sorted(body["files"].items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointCorrupt(f"{path} is missing (listed in the checksum manifest)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointCorrupt(f"{path} is {size} bytes, {want['bytes']} were written: truncated or replaced")
        if file_digest(path) != want["sha256"]:
            raise CheckpointCorrupt(f"{path} does not match its sha256 checksum: the file changed since kiln wrote it")
