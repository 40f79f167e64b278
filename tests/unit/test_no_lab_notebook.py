"""Code states the rule and the reason; measurements and history live in docs/decisions.md.

Fails, naming file:line, on a comment or docstring under ppserve/ (generated code aside) that quotes a
before -> after figure or an ISO date, and on a docstring of 20 lines or more."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ppserve"
DECISIONS = ROOT / "docs" / "decisions.md"
CITATION = re.compile(r"docs/decisions\.md#([\w-]+)")
ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
MAX_DOCSTRING_LINES = 19

PATTERNS = {
    "before -> after figure": re.compile(r"\d+(\.\d+)? ?%? ?(->|→) ?\d"),
    "date": re.compile(r"20\d\d-\d\d-\d\d"),
}

# (path relative to the repository root, reason): kept short on purpose.
EXCEPTIONS: dict[str, str] = {}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[:2] != ("server", "gen"))


def _docstrings(tree: ast.AST) -> list[tuple[int, int]]:
    """(first line, last line) of every module, class and function docstring."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                spans.append((first.lineno, first.end_lineno or first.lineno))
    return spans


def _prose_lines(src: str, tree: ast.AST) -> set[int]:
    """Line numbers holding a comment or part of a docstring: code and its string literals are not prose."""
    lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.COMMENT}
    for first, last in _docstrings(tree):
        lines.update(range(first, last + 1))
    return lines


def _scan() -> tuple[list[str], list[str]]:
    figures, long_docs = [], []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel in EXCEPTIONS:
            continue
        src = path.read_text()
        tree = ast.parse(src)
        text = src.splitlines()
        for n in sorted(_prose_lines(src, tree)):
            for what, pattern in PATTERNS.items():
                if pattern.search(text[n - 1]):
                    figures.append(f"{rel}:{n}: {what}: {text[n - 1].strip()[:100]}")
        for first, last in _docstrings(tree):
            if last - first + 1 > MAX_DOCSTRING_LINES:
                long_docs.append(f"{rel}:{first}: docstring of {last - first + 1} lines")
    return figures, long_docs


def test_no_measured_history_in_comments() -> None:
    figures, _ = _scan()
    assert not figures, ("measurements and dates belong in docs/decisions.md (state the rule, cite the "
                         "entry):\n" + "\n".join(figures))


def test_the_architecture_holds_no_measured_history() -> None:
    arch = PACKAGE / "ARCHITECTURE.md"
    hits = [f"ppserve/ARCHITECTURE.md:{n}: {what}: {line.strip()[:100]}"
            for n, line in enumerate(arch.read_text().splitlines(), 1)
            for what, pattern in PATTERNS.items() if pattern.search(line)]
    anchors = set(ANCHOR.findall(DECISIONS.read_text()))
    hits += [f"ppserve/ARCHITECTURE.md: cites #{a}, not in docs/decisions.md"
             for a in CITATION.findall(arch.read_text()) if a not in anchors]
    assert not hits, ("the architecture states the rules; the evidence is in docs/decisions.md:\n"
                      + "\n".join(hits))


def test_no_docstring_of_twenty_lines_or_more() -> None:
    _, long_docs = _scan()
    assert not long_docs, ("cut these docstrings to the rule in a few lines (evidence: docs/decisions.md):\n"
                           + "\n".join(long_docs))


def test_exceptions_name_files_that_exist() -> None:
    assert len(EXCEPTIONS) <= 3, "the exception list is for a few files, each with its reason"
    missing = [p for p in EXCEPTIONS if not (ROOT / p).is_file()]
    assert not missing, f"exceptions for files that do not exist: {missing}"


def test_every_cited_decision_has_an_entry() -> None:
    anchors = set(ANCHOR.findall(DECISIONS.read_text()))
    dangling = [f"{p.relative_to(ROOT)}: #{slug}" for p in _sources()
                for slug in CITATION.findall(p.read_text()) if slug not in anchors]
    assert not dangling, "cited but not in docs/decisions.md:\n" + "\n".join(sorted(set(dangling)))


def test_the_patterns_catch_what_they_are_for() -> None:
    assert PATTERNS["before -> after figure"].search("bubble 5.84 -> 5.28 %")
    assert PATTERNS["before -> after figure"].search("a step 17 % → 12 %")
    assert not PATTERNS["before -> after figure"].search("[T, H] -> [T, 2I]")
    assert PATTERNS["date"].search("on 2026-12-04")
