"""Every relative link and image in the user-facing Markdown points at a file that exists, and every
`#anchor` at a heading (GitHub's slug) or an explicit `<a id>` of that file. No network: URLs with a
scheme are not followed."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
EXPLICIT = re.compile(r"<a\b[^>]*?\b(?:id|name)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _docs() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ppserve" / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
             ROOT / "launch" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()]


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans (links there are examples, not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("code", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = (c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M"))
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(EXPLICIT.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    return [*INLINE.findall(text), *REFERENCE.findall(text), *HTML_SRC.findall(text)]


def broken_links(path: Path) -> list[str]:
    out = []
    for target in links(path):
        if SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        rel = path.relative_to(ROOT)
        if not dest.exists():
            out.append(f"{rel}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            out.append(f"{rel}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return out


def test_every_relative_link_resolves() -> None:
    files = _docs()
    assert ROOT / "README.md" in files and len(files) > 3
    broken = [b for f in files for b in broken_links(f)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_docs_index_lists_every_page() -> None:
    index = ROOT / "docs" / "index.md"
    listed = {Path(t.partition("#")[0]).name for t in links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert not pages - listed, f"docs/index.md does not list: {sorted(pages - listed)}"


def test_slugs_and_link_patterns(tmp_path: Path) -> None:
    assert slug("5. Measuring bubbles (`metrics/`)") == "5-measuring-bubbles-metrics"
    assert slug("The token ring: one microbatch more") == "the-token-ring-one-microbatch-more"
    assert slug("Add a [model](x.md) family") == "add-a-model-family"
    page = tmp_path / "p.md"
    page.write_text("# Top\n## Top\n<a id=\"here\"></a>\n[a](p.md#top-1) ![b](p.md) [c](#here) "
                    "[d](https://example.com/x) `[e](nowhere.md)`\n```\n[f](nowhere.md)\n```\n"
                    "[g](missing.md) [h](#nothing)\n")
    assert links(page) == ["p.md#top-1", "p.md", "#here", "https://example.com/x", "missing.md", "#nothing"]
    assert anchors(page) == {"top", "top-1", "here"}
