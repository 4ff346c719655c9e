"""The project's documentation stays true: docs/configuration.md equals what `hfjax.cli.config_reference`
generates from the config dataclasses, every config key is described, every local link of README.md and docs/*.md
resolves (file and heading), every `hfjax` subcommand has a section in docs/cli.md, and no file refers to a path
outside the repository."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hfjax.cli import config_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
SKIPPED_DIRS = {
    ".git",
    "runs",
    "outputs",
    "build",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "__pycache__",
}
# spelled in pieces so that this file does not contain what it looks for
OUTSIDE = ("..".strip() + "/shared", "/" + "work" + "/")


def test_configuration_page_is_generated() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert page == config_reference.render(), (
        "docs/configuration.md is out of date: run `python -m hfjax.cli.config_reference > docs/configuration.md`"
    )


def test_every_config_key_is_described() -> None:
    missing = [
        f"{section.cls.__name__}: {row.key}"
        for page in config_reference.pages()
        for section in [
            *config_reference.sections(page.root),
            *(s for k, c in page.extra for s in config_reference.sections(c, k)),
        ]
        for row in section.rows
        if not row.description and row.type != "section"  # a section row links to its own table
    ]
    assert not missing, f"add a comment beside these fields (or a note in hfjax/cli/config_reference.py): {missing}"


def test_notes_name_fields_without_comments() -> None:
    assert config_reference.stale_notes() == []


def test_type_and_default_text() -> None:
    from typing import Literal

    assert config_reference.type_text(Literal["a", "b"]) == '"a" | "b"'
    assert config_reference.type_text(int | None) == "int | null"
    assert config_reference.type_text(dict[str, float]) == "dict[str, float]"
    assert config_reference.default_text(None) == "null"
    assert config_reference.default_text(True) == "true"
    assert config_reference.default_text([1, 2]) == "[1, 2]"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = config_reference._anchor(match.group(1).strip())
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def local_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page: Path) -> None:
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif ROOT not in file.parents and file != ROOT:
            broken.append(f"{target}: outside the repository")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with this anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_links_every_docs_page() -> None:
    linked = {Path(t.partition("#")[0]).name for t in local_links(ROOT / "README.md")}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_cli_page_covers_every_subcommand() -> None:
    from hfjax.cli.main import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = [name for name in action.choices if f"## `hfjax {name}`" not in page]
    assert not missing, f"docs/cli.md has no section for: {missing}"


def repository_text_files() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info") and not d.startswith(".venv")
        ]
        files += [Path(folder) / name for name in names]
    return files


def test_no_reference_outside_repository() -> None:
    offending = []
    for file in repository_text_files():
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (figures)
        offending += [f"{file.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert not offending, offending
