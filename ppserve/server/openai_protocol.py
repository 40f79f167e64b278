"""The OpenAI-compatible request bodies ppserve accepts, and how they become SamplingParams.

Only the fields ppserve implements are modelled; a known OpenAI field it does not implement (echo,
best_of, logit_bias, suffix) is refused with 400 rather than silently ignored, and unknown
fields are ignored as OpenAI's own server does. Structured output is asked for one way per request:
`response_format`, vLLM's `structured_outputs`, one of its older `guided_*` fields, or (chat) a tool
choice that constrains the answer to tool calls. Sampling fields a client leaves unset take the model's
defaults (its generation_config.json), then OpenAI's. Values are checked by SamplingParams.validate,
so a bad value gets the same message here as over gRPC.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from ppserve.engine.messages import ChatTurn, ToolCall, chat_turn
from ppserve.request import SamplingParams
from ppserve.structured.spec import GrammarError, StructuredOutputs
from ppserve.structured.tools import ToolPlan, check_json_schema, plan_tools

if TYPE_CHECKING:
    from typing_extensions import TypeIs


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: vLLM's extension, kept for the same clients
    min_p: float | None = None  # vLLM's extension too
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share cached prefixes
    # Known OpenAI fields ppserve does not implement: refused, not ignored.
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output, one way at a time: OpenAI's response_format, vLLM's structured_outputs, or one of
    # vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def refuse_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; use n")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, or None. GrammarError (a 400) for a malformed one, for a
        JSON schema that is not one (checked against its metaschema: the compiler would take an unknown
        type as no constraint), and for two ways or kinds at once, which cannot both hold."""
        ways: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None:
            spec = response_format_spec(rf)
            if spec is not None:
                ways.append(("response_format", spec))
        if self.structured_outputs is not None:
            ways.append(("structured_outputs", StructuredOutputs.from_dict(self.structured_outputs)))
        guided = {"guided_json": ("json", self.guided_json), "guided_regex": ("regex", self.guided_regex),
                  "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        for field_name, (kind, value) in guided.items():
            if value is not None:
                ways.append((field_name, StructuredOutputs.from_dict({kind: value}, where=field_name)))
        if len(ways) > 1:
            raise GrammarError(f"{' and '.join(w for w, _ in ways)} ask for two kinds at once of "
                               "structured output; give one")
        if not ways:
            return None
        where, spec = ways[0]
        if spec.json is not None:
            check_json_schema(json.loads(spec.json), f"{where} schema")
        return spec

    def sampling(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                 structured: StructuredOutputs | None = None) -> SamplingParams:
        """SamplingParams: the fields the client set, else the model's defaults (generation_config.json),
        else OpenAI's (temperature 1, top_p 1). `max_tokens` is the request's own limit (None: the
        model's default, else what the context leaves). Raises ValueError naming a bad field."""
        chosen: dict[str, Any] = {"temperature": 1.0, **defaults}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is not None:
                chosen[name] = value
        if max_tokens is not None:
            chosen["max_tokens"] = max_tokens
        chosen.setdefault("max_tokens", None)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sp = SamplingParams(stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
                            ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n,
                            structured_outputs=structured, **chosen)
        sp.validate()
        return sp


def response_format_spec(rf: dict[str, Any]) -> StructuredOutputs | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with its
    `json_schema.schema`."""
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or js.get("schema") is None:
            raise GrammarError("response_format json_schema needs json_schema.schema (a JSON Schema object)")
        return StructuredOutputs(json=js["schema"])
    raise GrammarError(f"response_format.type {kind!r} is unknown; expected text, json_object or json_schema")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # alternatives per token (OpenAI allows 5; ppserve up to 20)
    echo: bool = False
    suffix: str | None = None
    tools: list[Any] | None = None  # chat's field: refused here

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise ValueError("tools are supported on /v1/chat/completions only")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch of them: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if _is_token_ids(p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


def _is_token_ids(p: list[str] | list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether a prompt list is one prompt's token ids rather than a batch of prompts."""
    return all(isinstance(x, int) for x in p)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text in OpenAI's messages; an object is taken too


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls (its content may be null)
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def turn(self) -> ChatTurn:
        """The message as the engine's chat turn. OpenAI's "developer" role is the system prompt of
        newer models: chat templates know "system"."""
        calls = tuple(ToolCall(id=c.id, name=c.function.name,
                               arguments=(c.function.arguments if isinstance(c.function.arguments, str)
                                          else json.dumps(c.function.arguments, ensure_ascii=False)))
                      for c in self.tool_calls or ())
        content = None if self.content is None and self.role == "assistant" else self.text()
        return chat_turn("system" if self.role == "developer" else self.role, content, calls,
                         self.tool_call_id, self.name)

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list (other parts refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise ValueError("messages is empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")

    def conversation(self) -> tuple[ChatTurn, ...]:
        return tuple(m.turn() for m in self.messages)

    def tool_plan(self) -> ToolPlan:
        """The tools, the tool choice and the structural tag that constrains calls (see plan_tools)."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self, plan: ToolPlan) -> StructuredOutputs | None:
        """The one constraint on the answer: the plan's, or the request's own structured output (see
        ToolPlan.combine for when both are given)."""
        return plan.combine(self.structured())

    def logprob_count(self) -> int | None:
        """None: no logprobs; else how many alternatives per token besides the sampled one."""
        return (self.top_logprobs or 0) if self.logprobs else None
