"""Stage output folders kiln may replace, and the checksums their readers verify.

A stage output OUT holds kept/, rejected/, summary.json and the marker OUT/.kiln-output: JSON naming the
stage and the sha256 of every file kiln wrote there. The marker is what lets a rerun replace OUT; anything
else in OUT is someone else's, and kiln never deletes what it did not write (docs/safe-outputs.md).

- `check_output` refuses an OUT that is, contains or sits inside the input, and an existing OUT holding
  anything kiln did not write (`overwrite=True` allows the latter, never the former).
- `staged_output` gives a fresh folder beside OUT (with the user's umask) and swaps it in when the writer
  is done: the old OUT is renamed aside, the new one renamed in, then the old one deleted. A writer that
  fails leaves OUT as it was and no temporary folder behind.
- `read_shard` reads a shard and checks it against the sha256 its stage recorded, so a flipped byte is an
  error naming the shard rather than wrong rows downstream.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.progress import log

MARKER = ".kiln-output"
# What an output written before the marker existed holds; such a folder is still kiln's to replace.
LEGACY_FILE = re.compile(r"^(summary\.json|(kept|rejected)/part-\d{5}\.parquet)$")
OUTPUT_DIRS = {"kept", "rejected", "shards"}  # shards: the pack stage's train set (kiln.trainshards)


class OutputError(Exception):
    """An output folder kiln will not write: writing it would delete the input or files kiln did not write."""


class ChecksumError(Exception):
    """A shard whose bytes differ from what its stage recorded, or a shard the stage never wrote."""


# ------------------------------------------------------------------------------------------ marker
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_marker(folder: Path, stage: str) -> None:
    """Mark `folder` as stage output, with the sha256 of each file in it (sorted: same files, same bytes)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
    marker = {"kiln_output": 1, "stage": stage, "sha256": {f: sha256_file(folder / f) for f in files}}
    (folder / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def read_marker(folder: Path) -> dict | None:
    """The marker of a stage output folder; None when there is none. A marker that does not parse is an error."""
    path = Path(folder) / MARKER
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ChecksumError(f"{path}: unreadable kiln output marker ({e})") from e
    if not (
        isinstance(marker, dict) and isinstance(marker.get("stage"), str) and isinstance(marker.get("sha256"), dict)
    ):
        raise ChecksumError(f"{path}: not a kiln output marker (needs 'stage' and 'sha256')")
    return marker


def _is_legacy_output(folder: Path) -> bool:
    """An output of a kiln from before the marker: summary.json names a stage."""
    try:
        return isinstance(json.loads((folder / "summary.json").read_text()).get("stage"), str)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def is_kiln_output(folder: Path) -> bool:
    try:
        return read_marker(folder) is not None or _is_legacy_output(folder)
    except ChecksumError:  # a marker that does not parse marks nothing
        return False


def foreign_entries(folder: Path) -> list[str]:
    """What in an existing folder kiln did not write there (relative paths, sorted; folders end in /):
    everything, when it is no kiln output; [] for a pure kiln output."""
    kiln = is_kiln_output(folder)
    marker = read_marker(folder) if kiln else None
    owned = {*marker["sha256"], MARKER} if marker else set()
    foreign = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        for d in list(dirs):
            if not (kiln and rel_root == Path(".") and d in OUTPUT_DIRS):
                foreign.append((rel_root / d).as_posix() + "/")
                dirs.remove(d)  # a foreign folder is named once, not file by file
        for f in files:
            rel = (rel_root / f).as_posix()
            if not (rel in owned or (kiln and marker is None and LEGACY_FILE.match(rel))):
                foreign.append(rel)
    return sorted(foreign)


# ------------------------------------------------------------------------------------------ checks
def _local_path(path: Path | str) -> Path | None:
    s = str(path)
    if "://" in s and not s.startswith("file://"):
        return None  # an object-store input cannot overlap a local folder
    return Path(s.removeprefix("file://")).resolve()


def check_apart(output: Path | str, input_path: Path | str) -> None:
    """Refuse an output that is, contains or sits inside the input: replacing it would delete what the stage reads."""
    inp, out = _local_path(input_path), Path(output).resolve()
    if inp is None:
        return
    if out == inp:
        raise OutputError(f"the output {output} is the input; choose another --output")
    if inp.is_relative_to(out):
        raise OutputError(f"the output {output} contains the input {input_path}; choose another --output")
    if out.is_relative_to(inp):
        raise OutputError(f"the output {output} is inside the input {input_path}; choose a folder outside it")


def check_output(output: Path | str, input_path: Path | str | None = None, overwrite: bool = False) -> None:
    """Refuse to write `output` when that would delete the input, or (unless `overwrite`) what kiln did not write."""
    output = Path(output)
    if input_path is not None:
        check_apart(output, input_path)
    if overwrite or not (output.exists() or output.is_symlink()):
        return
    if not output.is_dir():
        raise OutputError(f"the output {output} exists and is not a folder; remove it or pass --overwrite")
    foreign = foreign_entries(output)
    if foreign:
        what = (
            "holds files kiln did not write"
            if is_kiln_output(output)
            else f"is not a kiln stage output (it has no {MARKER})"
        )
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(
            f"the output {output} {what} ({shown}); move them away or pass --overwrite to replace the folder"
        )


# ------------------------------------------------------------------------------------------- swap
def _beside(output: Path, what: str) -> Path:
    return output.parent / f".{output.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """A new, empty folder beside `output` to write into; it replaces `output` when the block ends, and is
    removed when the block raises (the old `output` is then untouched)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = _beside(output, "tmp")
    tmp.mkdir()  # mode 0o777 minus the umask (tempfile.mkdtemp would make it 0700)
    try:
        yield tmp
        swap_in(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(new: Path, output: Path) -> None:
    """Put folder `new` where `output` is: the old one is renamed aside, the new one renamed in, then the old
    one deleted, so `output` is never a half-written folder and a failed rename puts the old one back."""
    if not (output.exists() or output.is_symlink()):
        os.rename(new, output)
        return
    old = _beside(output, "old")
    os.rename(output, old)
    try:
        os.rename(new, output)
    except BaseException:
        os.rename(old, output)
        raise
    try:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    except OSError as e:  # the new output is in place; say what is left over rather than fail the stage
        log.warning("%s is in place, but the old folder %s could not be removed: %s", output, old, e)


# ---------------------------------------------------------------------------------------- reading
def recorded_checksums(dataset: Path) -> dict[str, str] | None:
    """sha256 per shard file name of a dataset folder of a stage output (OUT/kept, OUT/rejected), as its stage
    recorded them; None for a folder no stage output marks (a plain dataset, an output of an older kiln)."""
    dataset = Path(dataset)
    marker = read_marker(dataset.parent)
    if marker is None:
        return None
    prefix = dataset.name + "/"
    sums = {
        k[len(prefix) :]: v for k, v in marker["sha256"].items() if k.startswith(prefix) and "/" not in k[len(prefix) :]
    }
    return sums or None


def check_shard_set(dataset: Path, paths: list[Path], sums: dict[str, str] | None) -> None:
    """The shards on disk are the shards the stage wrote: none missing, none added."""
    if sums is None:
        return
    on_disk = {p.name for p in paths}
    if added := sorted(on_disk - set(sums)):
        raise ChecksumError(f"{dataset}: shards its stage did not write: {', '.join(added[:5])}")
    if missing := sorted(set(sums) - on_disk):
        raise ChecksumError(f"{dataset}: shards its stage wrote are missing: {', '.join(missing[:5])}")


def read_shard(path: Path, sha256: str | None) -> pa.Table:
    """One Parquet shard, its bytes checked against the sha256 its stage recorded (None: nothing recorded)."""
    data = Path(path).read_bytes()
    if sha256 is not None and (actual := hashlib.sha256(data).hexdigest()) != sha256:
        raise ChecksumError(
            f"{path}: the shard's sha256 is {actual[:16]}..., its stage recorded {sha256[:16]}... in {Path(path).parent.parent / MARKER}; "
            "it changed after it was written: rerun the stage that wrote it"
        )
    return pq.read_table(pa.BufferReader(data))


VOLATILE_FILES = (
    "metrics.jsonl",
    "throughput.json",
)  # wall-clock records: on disk, outside every content hash (.dvcignore)


def output_hash(folder: Path | str) -> str:
    """The content hash of a step's output folder, computed as DVC computes a directory's (dvc.lock's `md5`):
    md5 over the JSON list of {md5, relpath} of its files, sorted by path, plus `.dir`. The wall-clock
    records (VOLATILE_FILES) are left out, as .dvcignore leaves them out of DVC's, so a rerun of the same
    data and config has the same hash."""
    folder = Path(folder)
    entries = []
    for root, _, files in os.walk(folder):
        for f in files:
            if f in VOLATILE_FILES:
                continue
            p = Path(root) / f
            entries.append(
                {"md5": hashlib.md5(p.read_bytes()).hexdigest(), "relpath": p.relative_to(folder).as_posix()}
            )
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"
