"""What a package drags in when imported: checked in a fresh interpreter, where nothing else was imported
first."""

from __future__ import annotations

import subprocess
import sys


def assert_imports_without(modules: str, heavy: tuple[str, ...]) -> None:
    """`import <modules>` (a comma-separated list) in a new interpreter loads none of the `heavy` modules."""
    code = (f"import sys, {modules}\nbad = [m for m in {heavy!r} if m in sys.modules]\nprint(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"import {modules} loads {proc.stdout.strip()}\n{proc.stderr[-2000:]}"
