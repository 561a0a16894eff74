"""Comments and docstrings say what the code does: none points at an issue number (the tracker is not the
code's documentation), and every doc a source file points readers at is in the repo."""

import re
from pathlib import Path

from kiln.paths import PACKAGES, REPO_ROOT

SOURCES = (*PACKAGES, "scripts", "benchmarks", "tests", "conf")
ISSUE = re.compile(r"\bissues? ?#?\d+|\(#\d+\)|#\d+ item", re.IGNORECASE)
DOC = re.compile(r"\b(?:docs/[\w.\-/]+\.md|[A-Z]+\.md)\b")
THIS = Path(__file__).resolve()


def source_files(root: Path) -> list[Path]:
    return sorted(
        p
        for d in SOURCES
        for p in (root / d).rglob("*")
        if p.suffix in (".py", ".sh", ".yaml") and p.is_file() and p.resolve() != THIS
    )


def _lines(root: Path):
    for path in source_files(root):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(root)}:{i}", line


def issue_references(root: Path) -> list[str]:
    return [f"{where}: {line.strip()}" for where, line in _lines(root) if ISSUE.search(line)]


def missing_docs(root: Path) -> list[str]:
    return [f"{where}: {doc}" for where, line in _lines(root) for doc in DOC.findall(line) if not (root / doc).exists()]


def test_no_comment_refers_to_an_issue_number():
    assert issue_references(REPO_ROOT) == []


def test_every_doc_the_code_points_at_exists():
    assert missing_docs(REPO_ROOT) == []


def test_both_checks_name_the_file_and_line(tmp_path):
    (tmp_path / "kiln").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "training.md").write_text("# training\n")
    line = 'raise ValueError("wrong gradients (ARCHITECTURE.md 6), see docs/training.md")  # issue #20'
    (tmp_path / "kiln" / "x.py").write_text(f"import os\n{line}\n")
    assert issue_references(tmp_path) == [f"kiln/x.py:2: {line}"]
    assert missing_docs(tmp_path) == ["kiln/x.py:2: ARCHITECTURE.md"]
