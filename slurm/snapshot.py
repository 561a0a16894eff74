"""Freeze the code a job runs, so that edits made after `submit` (or before a requeue) do not reach it.

submitit's `RsyncSnapshot` copies only git-tracked files; kiln's working trees often hold new,
uncommitted modules, so this copies the package folders themselves. The snapshot folder is named by a
digest of its contents: resubmitting unchanged code reuses it, and the name says which code ran.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout slurm/ sits in
CODE_DIRS = ("kiln", "assets", "components", "model", "training", "slurm", "dagster_project", "conf")
CODE_FILES = ("pyproject.toml",)
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp")


def code_files(root: Path = REPO_ROOT) -> Iterator[Path]:
    """The files a job needs, relative to `root`, in a stable order."""
    for name in CODE_FILES:
        if (root / name).is_file():
            yield Path(name)
    for top in CODE_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for f in sorted(filenames):
                if not f.endswith(_SKIP_SUFFIXES):
                    yield (Path(dirpath) / f).relative_to(root)


def code_digest(root: Path = REPO_ROOT) -> str:
    h = hashlib.sha256()
    for rel in code_files(root):
        h.update(str(rel).encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def snapshot_code(dest_root: Path, root: Path = REPO_ROOT) -> Path:
    """Copy the code under `dest_root/<digest>` (once) and return that folder."""
    dest_root = Path(dest_root).resolve()
    dest = dest_root / code_digest(root)[:16]
    if dest.is_dir():
        return dest
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest_root))
    for rel in code_files(root):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, tmp / rel)
    try:
        os.replace(tmp, dest)
    except OSError:  # another submitter made the same snapshot first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
