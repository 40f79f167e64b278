"""Every section reference in the repository points at a section of ppserve/ARCHITECTURE.md that exists,
and nothing points at design notes a clone does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.unit.test_docs_links import slug

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "ppserve" / "ARCHITECTURE.md"
# A reference names a section by its anchor: `ARCHITECTURE.md#measuring-bubbles`, more anchors after it
# as `, #serving-metrics` or ` and #serving-metrics`.
REF = re.compile(r"ARCHITECTURE\.md((?:(?:, | and )?#[a-z0-9-]+)+)")
OLD_REF = re.compile(r"ARCHITECTURE\.md §\d")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = [ROOT / line for line in out.splitlines() if not line.startswith("ppserve/server/gen/")]
    return [p for p in paths if p.suffix in {".py", ".md", ".yaml", ".json", ".sh", ".toml", ".proto"}
            and p.is_file()]


def sections() -> set[str]:
    """The anchors of ARCHITECTURE.md's `## ` sections (GitHub's slugs, as test_docs_links computes them)."""
    return {slug(h) for h in re.findall(r"^## (.+?)\s*$", ARCH.read_text(), flags=re.M)}


def test_sections_are_named_not_numbered() -> None:
    numbered = re.findall(r"^## \d", ARCH.read_text(), flags=re.M)
    assert not numbered, "ARCHITECTURE.md's sections are cited by name; a number would move with the order"


def test_every_section_reference_names_a_section_that_exists() -> None:
    known = sections()
    refs: list[tuple[str, str]] = []
    old: list[str] = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        name = str(path.relative_to(ROOT))
        if path == Path(__file__):
            continue  # this file's messages show the forms
        for m in REF.finditer(text):
            refs.extend((name, a) for a in re.findall(r"#([a-z0-9-]+)", m.group(1)))
        if OLD_REF.search(text):
            old.append(name)
    assert refs, "no section references found: the pattern is wrong"
    dangling = [(f, a) for f, a in refs if a not in known]
    assert not dangling, f"references to sections that do not exist: {dangling}"
    assert not old, f"sections are cited by name (ARCHITECTURE.md#anchor), not by number: {old}"


def test_nothing_points_at_design_notes_outside_the_repository() -> None:
    hits = [str(p.relative_to(ROOT)) for p in _tracked_text_files()
            if p.name != "test_docs.py" and "DESIGN.md" in p.read_text(errors="replace")]
    assert not hits, f"DESIGN.md is not in this repository (cite ppserve/ARCHITECTURE.md): {hits}"
