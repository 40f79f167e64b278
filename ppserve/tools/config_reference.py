"""Write docs/configuration.md, the configuration reference, from ppserve/config.py.

    python -m ppserve.tools.config_reference            # rewrite docs/configuration.md in place
    python -m ppserve.tools.config_reference --check    # exit 1 if the committed file is stale

Fields, types and defaults come from the dataclasses themselves; each field's meaning is the comment
that documents it in config.py: the comment at the end of its line, the comment lines just above it
(joined with the first when both exist), or both. A field without one is an error, so the reference
cannot silently miss a setting. The output depends on config.py (and the `LLM(...)` keyword table in
engine/llm.py) only, so the committed file must equal a fresh run byte for byte
(tests/unit/test_config_reference.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_PY = REPO_ROOT / "ppserve" / "config.py"
LLM_PY = REPO_ROOT / "ppserve" / "engine" / "llm.py"
OUTPUT = REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m ppserve.tools.config_reference"

HEADER = f"""# Configuration reference

<!-- Generated from ppserve/config.py by `{COMMAND}`: do not edit by hand. -->

Every setting of ppserve is a field of a frozen dataclass in
[ppserve/config.py](../ppserve/config.py), one dataclass per section. This page is generated from that
file, so it lists every field with its type, its default and the comment that documents it there.

## How to set a field

- **A YAML file** (`--config FILE` on `serve`, `demo`, `offline` and `simulate`): one mapping per
  section, for example

  ```yaml
  scheduler:
    policy: sarathi
    token_budget: 512
  parallel:
    pipeline_parallel_size: 2
  ```

  [configs/default.yaml](../configs/default.yaml) holds the main defaults; copy it to start a config
  of your own. A key a section does not have is an error naming the known ones.
- **The command line**: `--set section.key=value`, repeatable, applied after the file. Values are
  read as YAML scalars (`null`, `true`, `8`, `[14, 16]`), for example
  `--set scheduler.policy=vllm --set parallel.pipeline_parallel_size=3`.
- **The offline API**: `LLM(config=FILE_OR_ENGINECONFIG, overrides=["section.key=value"])`, and the
  keyword shortcuts listed at the end of this page (`LLM(token_budget=256)`).

Values are converted to the field's type (`true`/`false`, `on`/`off` and `yes`/`no` for booleans;
`null` or `none` for an unset optional) and validated when the config is built: a bad value raises
`ValueError` naming the field and the value.
"""


def _comments(src: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text without '#', whether the comment is the whole line)."""
    out: dict[int, tuple[str, bool]] = {}
    lines = src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            whole = not lines[row - 1][:col].strip()
            out[row] = (tok.string.lstrip("#").strip(), whole)
    return out


def _field_docs(src: str) -> dict[str, dict[str, str]]:
    """class name -> field name -> the comment documenting the field, for every dataclass in `src`."""
    comments = _comments(src)
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(src).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            row = stmt.lineno - 1
            while row in comments and comments[row][1]:
                above.insert(0, comments[row][0])
                row -= 1
            end = comments.get(stmt.end_lineno or stmt.lineno)
            parts = [" ".join(above)] if above else []
            if end is not None and not end[1]:
                parts.append(end[0])
            fields[stmt.target.id] = " ".join(p for p in parts if p)
        docs[node.name] = fields
    return docs


def _shortcuts(src: str) -> dict[str, tuple[str, str]]:
    """`LLM(...)`'s keyword -> (section, field): engine/llm.py's `_SHORTCUTS`, read without importing it."""
    for node in ast.parse(src).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "_SHORTCUTS" for t in targets) and node.value is not None:
            value: dict[str, tuple[str, str]] = ast.literal_eval(node.value)
            return value
    return {}


def _yaml(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{f.name} has no default")


def render(config_src: str | None = None, llm_src: str | None = None) -> str:
    """The whole reference page as text (reads config.py and engine/llm.py unless given their sources)."""
    import ppserve.config as config

    config_src = CONFIG_PY.read_text() if config_src is None else config_src
    llm_src = LLM_PY.read_text() if llm_src is None else llm_src
    docs = _field_docs(config_src)
    missing: list[str] = []
    out = [HEADER]
    for section in dataclasses.fields(config.EngineConfig):
        cls = type(_default(section))
        out.append(f"\n## `{section.name}`\n")
        class_doc = (cls.__doc__ or "").strip()
        if class_doc and not class_doc.startswith(f"{cls.__name__}("):  # not the dataclass's generated one
            out.append(class_doc.split("\n\n")[0].replace("\n", " ") + "\n")
        out.append(f"`{cls.__name__}` in ppserve/config.py; in YAML under `{section.name}:`, on the command "
                   f"line `--set {section.name}.FIELD=VALUE`.\n")
        out.append("| field | type | default | meaning |")
        out.append("|---|---|---|---|")
        for f in dataclasses.fields(cls):
            meaning = docs.get(cls.__name__, {}).get(f.name, "")
            if not meaning:
                missing.append(f"{cls.__name__}.{f.name}")
            out.append(f"| `{f.name}` | `{_cell(str(f.type))}` | `{_cell(_yaml(_default(f)))}` | "
                       f"{_cell(meaning)} |")
    if missing:
        raise ValueError("config fields without a comment documenting them in ppserve/config.py: "
                         + ", ".join(missing))
    shortcuts = _shortcuts(llm_src)
    if shortcuts:
        out.append("\n## Keyword shortcuts of `LLM(...)`\n")
        out.append("Each keyword of the offline API sets one field (ppserve/engine/llm.py):\n")
        out.append("| keyword | field |")
        out.append("|---|---|")
        out.extend(f"| `{kw}` | `{sec}.{name}` |" for kw, (sec, name) in shortcuts.items())
    text = "\n".join(out) + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)  # one blank line between blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help="where to write (docs/configuration.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not args.out.is_file() or args.out.read_text() != text
        if stale:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
