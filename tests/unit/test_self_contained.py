"""Code, tests and docs stand on their own: no comment or sentence sends a reader to a
file outside the repository or to an issue tracker they cannot open. The fact itself is
written where it is needed instead."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("llmgw_cli", "tests", "scripts", "bench", "templates", "docs", ".ci", "inventories")
SUFFIXES = {".py", ".md", ".j2", ".sh", ".yaml", ".yml", ".toml", ".txt", ""}
# Built from parts so this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            r"\.\./" + "shared",
            r"\b" + "lab-" + r"reference\b",
            r"\b" + "REFERENCE" + r"\.md\b",
            r"\b" + "LOCAL-" + r"ENGINE\b",
            r"\b" + "DESIGN" + r"\.md\b",
            r"\b" + "[Ii]ssue" + r"s? ?#?\d+",
            r"\bthe " + "issue" + r"('s)?\b",
        ]
    )
)

# An issue of a public repository, named with its owner and name, can be opened by anyone.
PUBLIC = re.compile(r"[\w.-]+/[\w.-]+ (issue|PR) #\d+")


def files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in SCANNED:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                found.append(path)
    return found


def test_nothing_points_outside_the_repository() -> None:
    hits = []
    for path in files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(PUBLIC.sub("", line)):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert hits == [], "\n".join(hits)


def test_the_pattern_finds_what_it_is_for() -> None:
    for line in (
        "see ../" + "shared/x",
        "(" + "LOCAL-" + "ENGINE.md)",
        "as issue" + " 18 says",
        "the " + "issue's target",
    ):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("keys issued to a client; a tissue")
    assert not OUTSIDE.search(PUBLIC.sub("", "NVIDIA/nvidia-docker issue #1553"))
