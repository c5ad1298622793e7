"""The docs point at files that exist, and neither code nor docs cite the tracker's issue numbers
(a reader of the tree has no tracker; say what the thing is instead)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path in backticks: `ftmem/launch/agent.py`, `smp/store.py`, `tests/unit/`.
_PATH = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]*|[A-Za-z0-9_-]+\.py)`")
_ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")
# Paths that name something outside the repository or made at run time.
_ELSEWHERE = ("/", "~", "$", "<", "shared/", "docs/img/", "../")


def _exists(text: str) -> bool:
    rel = text.split(":")[0].rstrip("/")
    if not rel or rel.startswith(_ELSEWHERE) or "*" in rel:
        return True
    if not (rel.endswith(".py") or rel.startswith(("ftmem/", "tests/", "bench/", "examples/"))):
        return True  # e.g. a run directory's `smp-events.jsonl`, a `step_N/` name
    return any((base / rel).exists() for base in (ROOT, ROOT / "ftmem", ROOT / "bench"))


def test_every_path_in_the_docs_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {m.group(1)}"
        for doc in DOCS
        for m in _PATH.finditer(doc.read_text())
        if not _exists(m.group(1))
    ]
    assert missing == []


def test_no_issue_numbers_in_code_or_docs() -> None:
    files = [*DOCS, ROOT / "pyproject.toml"]
    for top in ("ftmem", "tests", "bench", "examples"):
        files += sorted((ROOT / top).rglob("*.py"))
    found = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if _ISSUE.search(line) and f.name != "test_docs.py"
    ]
    assert found == []
