"""What a request asks its output to match: one JSON schema, JSON object, regex, choice list, grammar or
structural tag (ARCHITECTURE.md#structured-outputs).

Pure Python (no torch, ray or grpc): it rides in SamplingParams to the scheduler, the simulator and the
last stage. Schemas and tags are kept as compact JSON text (keys in the order given: a schema's property
order is the output's), so equal requests share one compiled grammar (the cache key) and the object
stays hashable and picklable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The kinds, in the order a request names them (vLLM's `structured_outputs` fields).
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar larger than 1 MiB is refused before compiling


class GrammarError(ValueError):
    """A structured-output request that cannot be honoured: its spec is malformed or does not compile
    (the compiler's message), or compiling it took too long. A 400 on every front door."""


def canonical_json(value: Any, what: str) -> str:
    """`value` (JSON text or a decoded JSON value) as compact JSON text; GrammarError when it is not
    JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{what} is not JSON-serializable: {e}") from None


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one kind of constraint. `json`: a JSON Schema (an object, or true for any JSON value),
    compact JSON text; `json_object`: any JSON object; `regex`: a regular expression the whole output
    matches; `choice`: the output is exactly one of these strings; `grammar`: an EBNF grammar in the
    backend's dialect (xgrammar's GBNF, root rule `root`); `structural_tag`: a structural tag (JSON text,
    xgrammar's format), which is how tool calls are constrained."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", canonical_json(self.json, "structured_outputs.json"))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag",
                               canonical_json(self.structural_tag, "structured_outputs.structural_tag"))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise GrammarError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    def validate(self) -> None:
        """GrammarError naming the field: exactly one kind, each of the right type and size. Whether a
        schema, regex or grammar compiles is the backend's to say (structured/grammars.py)."""
        kinds = self.kinds
        if len(kinds) != 1:
            raise GrammarError("structured_outputs takes exactly one of " + ", ".join(KINDS)
                               + (f"; got {', '.join(kinds)}" if kinds else "; got none"))
        if self.json is not None:
            schema = json.loads(self.json)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"a JSON schema is an object (or true / false), got "
                                   f"{type(schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise GrammarError("structured_outputs.json_object must be true or false")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise GrammarError(f"structured_outputs.{name} must be a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                raise GrammarError(f"structured_outputs.{name} has {len(value)} characters; the limit is "
                                   f"{MAX_SPEC_CHARS}")
        if self.choice is not None:
            if not self.choice:
                raise GrammarError("structured_outputs.choice is empty: give at least one string")
            if len(self.choice) > MAX_CHOICES:
                raise GrammarError(f"structured_outputs.choice has {len(self.choice)} strings; the limit "
                                   f"is {MAX_CHOICES}")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise GrammarError(f"structured_outputs.choice holds non-empty strings, got {c!r}")

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key (with the tokenizer, which a cache is built for)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            value = json.dumps(list(value))
        return self.kind, "" if value is True else str(value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "structured_outputs") -> StructuredOutputs:
        """vLLM's `structured_outputs` object: one of json, json_object, regex, choice, grammar,
        structural_tag (other keys vLLM reads that change nothing here, such as disable_fallback, are
        ignored; unknown ones refused)."""
        if not isinstance(d, Mapping):
            raise GrammarError(f"{where} must be an object with one of {', '.join(KINDS)}")
        ignored = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                   "whitespace_pattern", "backend"}
        unknown = sorted(set(d) - set(KINDS) - ignored)
        if unknown:
            raise GrammarError(f"{where} has unknown field(s) {', '.join(unknown)}; expected one of "
                               f"{', '.join(KINDS)}")
        given = {k: d[k] for k in KINDS if d.get(k) is not None and d.get(k) is not False}
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        """The inverse of from_dict: the one kind set, decoded."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            value = json.loads(value)
        elif kind == "choice":
            value = list(value)
        return {kind: value}


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword in a schema that xgrammar compiles but does not enforce (uniqueItems, allOf of
    several subschemas), or None. docs/decisions.md#grammar-backend lists how that was found."""
    if isinstance(schema, list):
        return next((k for k in map(unenforced_keyword, schema) if k), None)
    if not isinstance(schema, dict):
        return None
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf with several subschemas"
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
            found = unenforced_keyword(value)
            if found:
                return found
    return None


def coerce(value: StructuredOutputs | Mapping[str, Any] | None) -> StructuredOutputs | None:
    """SamplingParams(structured_outputs=...) takes the dataclass or vLLM's dict."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    return StructuredOutputs.from_dict(value)
