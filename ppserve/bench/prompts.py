"""Prompts of exact token lengths: real text tokenized by the served model's tokenizer, or random ids.

The text is English prose: the licence texts the OS ships (/usr/share/common-licenses), else the
Python standard library's own documentation (module and function docstrings); no download either way. It is
tokenized once; a prompt of n tokens is a slice of n consecutive token ids starting at a seeded offset, so its
length is exact (re-encoding decoded text would not be) and its content is real text. Models without a
tokenizer (tiny test checkpoints) get seeded random ids instead.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["STEP_LICENCES", "corpus_text", "english_text", "PromptBuilder", "text_windows"]

# Modules whose docstrings make the corpus: stable, prose-heavy, always importable.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "decimal", "difflib",
    "email", "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools", "json",
    "logging", "mailbox", "os", "pathlib", "pickle", "random", "re", "shutil", "smtplib", "socket",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "turtle", "typing",
    "unittest", "urllib.parse", "uuid", "zipfile",
)


def corpus_text(min_chars: int = 400_000) -> str:
    """Docstrings of standard-library modules and their public members, in a fixed order."""
    parts: list[str] = []
    seen: set[int] = set()
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional module (turtle without tk) is skipped
            continue
        for obj in [mod, *(getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if hasattr(obj, "__doc__") else None
            if doc and len(doc) > 200 and id(doc) not in seen:
                seen.add(id(doc))
                parts.append(doc.strip())
        if sum(map(len, parts)) >= min_chars:
            break
    return "\n\n".join(parts)


LICENCE_DIR = Path("/usr/share/common-licenses")  # Debian ships these licence texts: real English prose


# The step-efficiency workload's text: long licences in plain English, in this order (whichever exist).
STEP_LICENCES = ("GPL-3", "GFDL-1.3", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "Artistic", "GPL-2", "CC0-1.0")


def english_text(files: Sequence[str] | None = None) -> tuple[str, str]:
    """(text, where it came from): the licence texts the OS ships (`files` of them, in that order, or all),
    else standard-library docstrings."""
    if LICENCE_DIR.is_dir():
        paths = sorted(LICENCE_DIR.iterdir()) if files is None else [LICENCE_DIR / f for f in files]
        parts = [p.read_text(errors="replace") for p in paths if p.is_file()]
        if sum(map(len, parts)) > 100_000:
            return "\n\n".join(parts), str(LICENCE_DIR)
    return corpus_text(), "stdlib docstrings"


def text_windows(tokenizer: Any, lengths: Sequence[int], seed: int = 0,
                 files: Sequence[str] | None = STEP_LICENCES) -> list[list[int]]:
    """One prompt of exactly each length: windows of the tokenized text at seeded random offsets (the
    step-efficiency workload: prompts share no common prefix by construction)."""
    ids: list[int] = list(tokenizer.encode(english_text(files)[0], add_special_tokens=False))
    while len(ids) < max(lengths) + 1:
        ids = ids + ids
    rng = random.Random(seed + 1)
    prompts = []
    for length in lengths:
        start = rng.randint(0, len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


class PromptBuilder:
    """Builds prompts (lists of token ids) of requested lengths, deterministically from a seed."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.seed = seed
        self._ids: list[int] | None = None
        self.text_source = "random token ids (the model has no tokenizer)"
        if tokenizer is not None:
            text, where = english_text()
            self._ids = list(tokenizer.encode(text, add_special_tokens=False))
            self.text_source = f"text from {where}, {len(self._ids)} tokens"

    @property
    def source(self) -> str:
        return self.text_source

    def build(self, lengths: Sequence[int]) -> list[list[int]]:
        """One prompt per length, each exactly that many tokens."""
        rng = random.Random(self.seed)
        out: list[list[int]] = []
        for n in lengths:
            if n < 1:
                raise ValueError(f"prompt length must be >= 1, got {n}")
            if self._ids is None:
                # Avoid the first ids: special tokens (bos/eos/pad) live there in most vocabularies.
                lo = min(3, self.vocab_size - 1)
                out.append([rng.randrange(lo, self.vocab_size) for _ in range(n)])
                continue
            ids = self._ids
            if n > len(ids):
                raise ValueError(f"a {n}-token prompt is longer than the {len(ids)}-token text corpus")
            start = rng.randrange(0, len(ids) - n + 1)
            out.append(ids[start:start + n])
        return out

    def build_for(self, requests: Sequence[Any]) -> list[list[int]]:
        """One prompt per WorkloadRequest: requests with the same prefix_id start with the same
        prefix_len tokens (a longer prefix of one id extends a shorter one: a conversation's history),
        the rest of each prompt its own text."""
        longest: dict[int, int] = {}
        for r in requests:
            if r.prefix_id is not None:
                longest[r.prefix_id] = max(longest.get(r.prefix_id, 0), r.prefix_len, 1)
        ids = sorted(longest)
        # The prefixes from a seed of their own (the tails keep the builder's, so a workload without
        # prefixes gets the prompts build() gives).
        seed, self.seed = self.seed, self.seed + 1_000_003
        try:
            prefixes = dict(zip(ids, self.build([longest[i] for i in ids]), strict=True))
        finally:
            self.seed = seed
        tails = self.build([max(1, r.prompt_len - r.prefix_len) for r in requests])
        return [(prefixes[r.prefix_id][: r.prefix_len] if r.prefix_id is not None else [])
                + (tail if r.prompt_len > r.prefix_len else [])
                for r, tail in zip(requests, tails, strict=True)]

    def decode(self, prompt: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode(list(prompt)))
