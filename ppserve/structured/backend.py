"""The grammar backend: compiles a request's constraint against the tokenizer's vocabulary and gives
the per-request matcher whose token bitmask the last stage applies to the logits.

The default and only backend today is xgrammar (docs/decisions.md#grammar-backend says why it was
chosen over llguidance); `GrammarBackend` is the seam another would fill. A backend object is built
once per process and tokenizer (its vocabulary index is the costly part) and is safe to compile from
several threads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from ppserve.structured.spec import GrammarError, StructuredOutputs, unenforced_keyword


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token: int) -> bool: ...
    def fill(self, bitmask: Tensor, row: int) -> None: ...
    def reset(self) -> None: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredOutputs) -> object: ...
    def matcher(self, compiled: object) -> Matcher: ...
    def allocate_bitmask(self, rows: int) -> Tensor: ...
    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Sequence[int]) -> None: ...


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill(self, bitmask: Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def reset(self) -> None:
        self._m.reset()

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    """xgrammar over a Hugging Face tokenizer. JSON is compiled compact (no free whitespace between
    tokens): a model cannot spend its tokens on spaces, and the output is what `json.dumps` writes."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # The ppserve cache (structured/grammars.py) keys compiled grammars; xgrammar's own cache is off.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, spec: StructuredOutputs) -> object:
        """The compiled grammar; GrammarError with the compiler's message when it does not compile."""
        c = self._compiler
        kind = spec.kind
        if spec.json is not None:
            unenforced = unenforced_keyword(json.loads(spec.json))
            if unenforced:
                raise GrammarError(f"structured_outputs.json uses {unenforced}, which xgrammar accepts but "
                                   "does not enforce: the output could break the schema, so it is refused")
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            if spec.grammar is not None:
                return c.compile_grammar(spec.grammar)
            assert spec.structural_tag is not None
            return c.compile_structural_tag(spec.structural_tag)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with the reason
            first = str(e).strip().splitlines()
            raise GrammarError(f"structured_outputs.{kind} does not compile: "
                               f"{first[0] if first else type(e).__name__}") from None

    def matcher(self, compiled: object) -> Matcher:
        if not isinstance(compiled, self._xgr.CompiledGrammar):
            raise TypeError(f"an xgrammar matcher needs an xgrammar CompiledGrammar, got {type(compiled)}")
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
        return XGrammarMatcher(m)

    def allocate_bitmask(self, rows: int) -> Tensor:
        bitmask: Tensor = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return bitmask

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Sequence[int]) -> None:
        """Set the logits of disallowed tokens to -inf, in place, in `rows` (the bitmask has a row per
        logits row). The mask reaches a GPU by an asynchronous copy from pinned memory: no host sync."""
        if logits.device.type != "cpu":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=None if len(rows) == logits.shape[0] else list(rows))


def build_backend(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarBackend:
    """The process's grammar backend for this tokenizer."""
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
