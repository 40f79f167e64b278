"""Tool calling's request side: the `tools` list and `tool_choice` checked, and the structural tag that
constrains a tool call to the Hermes format `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`
(the format ppserve's own chat template asks for and tool_parser.py reads back).

`plan_tools` and `chat_turn` are what every front door (HTTP's ChatCompletionRequest, gRPC's convert.py)
calls, so a request means the same and a bad one gets the same message on each.

Pure Python but for xgrammar's tag builder, imported when a tag is built.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppserve.structured.spec import GrammarError, StructuredOutputs, unenforced_keyword

TOOL_CHOICES = ("none", "auto", "required")
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names, with '.' and ':' allowed
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@functools.cache
def hermes_template() -> str:
    """ppserve's tool-aware ChatML chat template (templates/hermes_tools.jinja): the Hermes format the
    tag below constrains, for models whose own template knows no tools."""
    return (Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()


def check_json_schema(schema: Any, where: str) -> None:
    """GrammarError when `schema` is not a JSON Schema by its own dialect's metaschema (draft 2020-12
    when it names none): a type the dialect does not know is the client's mistake, not an empty
    constraint."""
    # Imported by name: jsonschema ships no types (nor are its stubs installed), and only two names are used.
    jsonschema: Any = importlib.import_module("jsonschema")
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{where} is not a valid JSON Schema{f' at {at}' if at else ''}: "
                           f"{e.message}") from None


def normalize_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """OpenAI's `tools` list checked and filled in: each `{"type": "function", "function": {"name",
    "description", "parameters"}}` with a unique name and a JSON Schema for parameters (an empty object
    schema where none is given). GrammarError naming the bad entry."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise GrammarError(f"{where} must be an object {{\"type\": \"function\", \"function\": ...}}")
        if tool.get("type", "function") != "function":
            raise GrammarError(f"{where}.type {tool.get('type')!r} is not supported; only \"function\"")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise GrammarError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise GrammarError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or "
                               f"':', got {name!r}")
        if name in seen:
            raise GrammarError(f"{where}.function.name {name!r} is given twice; tool names are unique")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = EMPTY_PARAMETERS
        check_json_schema(params, f"{where}.function.parameters")
        unenforced = unenforced_keyword(params)
        if unenforced:
            raise GrammarError(f"{where}.function.parameters uses {unenforced}, which the grammar backend "
                               "accepts but does not enforce: a call could break the schema, so it is "
                               "refused")
        entry: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise GrammarError(f"{where}.function.description must be a string")
            entry["description"] = fn["description"]
        entry["parameters"] = params
        out.append({"type": "function", "function": entry})
    return out


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice` resolved: "none" (tools shown, no call constrained or parsed), "auto" (the model
    may call), "required" (at least one call) or "function" (exactly one call of `name`)."""

    mode: str
    name: str | None = None

    @property
    def parses(self) -> bool:
        """Whether the answer is read back for tool calls."""
        return self.mode != "none"


def resolve_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """OpenAI's `tool_choice` against the request's tools: "auto" where tools are given and it is not
    (else "none"); GrammarError for an unknown mode, a function the tools do not name, or "required" or a
    named function without tools."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise GrammarError(f"tool_choice {choice!r} is unknown; expected one of "
                               f"{', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}")
        if choice == "required" and not tools:
            raise GrammarError("tool_choice \"required\" needs tools")
        return ToolChoice(choice if tools or choice == "none" else "none")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise GrammarError("tool_choice.function.name must be a string")
        if not tools:
            raise GrammarError(f"tool_choice names the function {name!r} but the request gives no tools")
        if name not in names:
            raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools "
                               f"({', '.join(names)})")
        return ToolChoice("function", name)
    raise GrammarError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}")


def tool_call_tag(tools: Sequence[Mapping[str, Any]], choice: ToolChoice,
                  parallel_tool_calls: bool = True) -> str | None:
    """The structural tag (JSON text) that constrains tool calls to the Hermes format, the arguments to
    each function's parameters schema: any number of calls amid free text for "auto", one or more calls
    and nothing else for "required", exactly one call of the named function; None for "none" (no
    constraint).
    `parallel_tool_calls` false stops after the first call."""
    if choice.mode == "none" or not tools:
        return None
    import xgrammar as xgr

    tc: Any = choice.mode
    if choice.mode == "function":
        tc = {"type": "function", "function": {"name": choice.name}}
    tag = xgr.get_builtin_structural_tag("qwen_3", tools=[dict(t) for t in tools], tool_choice=tc,
                                         reasoning=False, parallel_tool_calls=parallel_tool_calls)
    built: dict[str, Any] = json.loads(tag.model_dump_json())
    if choice.mode == "required":
        # Only calls, one per line, then the end: the builder's triggered form would let free text follow
        # the calls, and a model that wanders on after them ends by max_tokens instead of its calls.
        built["format"] = {"type": "tags_with_separator", "tags": built["format"]["tags"], "separator": "\n",
                           "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    return json.dumps(built, separators=(",", ":"), ensure_ascii=False)


def tools_json(tools: Sequence[Mapping[str, Any]]) -> str | None:
    """The tool list as the compact JSON text a PromptInput carries (None for no tools)."""
    return json.dumps(list(tools), separators=(",", ":"), ensure_ascii=False) if tools else None


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools resolved: the checked list (JSON text for the prompt, None without tools),
    the tool choice, and the constraint it puts on the answer (None: unconstrained)."""

    tools: str | None
    choice: ToolChoice
    constraint: StructuredOutputs | None

    @property
    def parses(self) -> bool:
        """Whether the answer is read back for tool calls: tools were given and the choice is not "none"."""
        return self.tools is not None and self.choice.parses

    def combine(self, structured: StructuredOutputs | None) -> StructuredOutputs | None:
        """The one constraint on the answer, given the request's own structured output: a forced tool
        call ("required" or a named function) and another structured output cannot both hold
        (GrammarError); under "auto" an explicit one wins, and the answer is still read for calls."""
        if structured is None:
            return self.constraint
        if self.choice.mode in ("required", "function"):
            what = "required" if self.choice.mode == "required" else f"naming {self.choice.name!r}"
            raise GrammarError(f"tool_choice {what} and a structured output ask for two kinds at once; "
                               "give one")
        return structured


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any,
               parallel_tool_calls: bool | None = None) -> ToolPlan:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (None: OpenAI's default, true) checked
    and resolved: "required" and a named function force calls, "auto" constrains a call once the model
    opens one, "none" leaves the answer free (and unparsed)."""
    checked = normalize_tools(tools)
    choice = resolve_tool_choice(tool_choice, checked)
    tag = tool_call_tag(checked, choice, True if parallel_tool_calls is None else parallel_tool_calls)
    constraint = None if tag is None else StructuredOutputs(structural_tag=tag)
    return ToolPlan(tools_json(checked), choice, constraint)
