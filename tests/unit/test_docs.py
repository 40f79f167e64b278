"""Every section reference in the repository points at a section of ppserve/ARCHITECTURE.md that exists,
and nothing points at design notes a clone does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "ppserve" / "ARCHITECTURE.md"
REF = re.compile(r"ARCHITECTURE\.md §(\d+)(?:-§(\d+))?")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = [ROOT / line for line in out.splitlines() if not line.startswith("ppserve/server/gen/")]
    return [p for p in paths if p.suffix in {".py", ".md", ".yaml", ".json", ".sh", ".toml", ".proto"}
            and p.is_file()]


def test_every_section_reference_names_a_section_that_exists() -> None:
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", ARCH.read_text(), flags=re.M)}
    assert sections == set(range(1, max(sections) + 1)), f"sections are not numbered 1..n: {sorted(sections)}"
    refs: list[tuple[str, int]] = []
    for path in _tracked_text_files():
        for m in REF.finditer(path.read_text(errors="replace")):
            refs.extend((str(path.relative_to(ROOT)), int(n)) for n in m.groups() if n)
    assert refs, "no section references found: the pattern is wrong"
    dangling = [(f, n) for f, n in refs if n not in sections]
    assert not dangling, f"references to sections that do not exist: {dangling}"


def test_nothing_points_at_design_notes_outside_the_repository() -> None:
    hits = [str(p.relative_to(ROOT)) for p in _tracked_text_files()
            if p.name != "test_docs.py" and "DESIGN.md" in p.read_text(errors="replace")]
    assert not hits, f"DESIGN.md is not in this repository (cite ppserve/ARCHITECTURE.md): {hits}"
