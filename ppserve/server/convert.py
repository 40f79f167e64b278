"""Conversion between ppserve.v1 protobuf messages and ppserve's own types, and errors to status codes.

Pure translation: no engine, no torch. Validation of sampling values is SamplingParams' job (its
ValueError names the field); this module only adds the checks that exist because of the wire format
(which prompt field was used, token ids as int64, the tool choice's string form). Tool lists and choices
go through ppserve.structured.tools as the HTTP API's do, so they mean the same and fail with the same
messages.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ppserve.engine.messages import (
    CHAT_ROLES,
    ChatTurn,
    PipelineUnavailable,
    PromptInput,
    RequestTimes,
    ToolCall,
    Turn,
    chat_turn,
)
from ppserve.engine.stats import EngineStats, ServingConfig, StageBubbles
from ppserve.request import SamplingParams, TokenLogprob
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.structured.spec import GrammarError, StructuredOutputs
from ppserve.structured.tool_parser import parse_tool_calls
from ppserve.structured.tools import TOOL_CHOICES, ToolPlan, plan_tools
from ppserve.worker.info import WorkerInfo

__all__ = ["CHAT_ROLES", "PipelineUnavailable", "PromptInput", "RequestTimes"]  # the engine's, used here

_FINISH_TO_PROTO: dict[str | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_FINISH_FROM_PROTO: dict[int, str | None] = {v: k for k, v in _FINISH_TO_PROTO.items()}

# Largest id a proto int64 may carry that still makes sense as a Python int for the engine.
_INT64_MAX = (1 << 63) - 1
MAX_REQUEST_ID_CHARS = 256


# ---- sampling ------------------------------------------------------------------------------------
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "n", "min_p")


def sampling_from_proto(msg: pb.SamplingParams, defaults: dict[str, Any] | None = None,
                        tools: ToolPlan | None = None) -> SamplingParams:
    """Build SamplingParams; unset optional fields take `defaults` (the model's generation_config.json),
    then ppserve's. `tools`: the request's tool plan, whose constraint joins structured_outputs by the
    HTTP API's rule (ToolPlan.combine). ValueError names the field."""
    kwargs: dict[str, Any] = dict(defaults or {})
    for name in _OPTIONAL_SAMPLING:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(int(t) for t in msg.stop_token_ids)
    kwargs["ignore_eos"] = bool(msg.ignore_eos)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    if tools is not None:
        kwargs["structured_outputs"] = tools.combine(kwargs.get("structured_outputs"))
    sp = SamplingParams(**kwargs)
    sp.validate()
    return sp


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                            ignore_eos=sp.ignore_eos)
    for name in _OPTIONAL_SAMPLING:
        value = getattr(sp, name)
        if value is not None:
            setattr(msg, name, value)
    if sp.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(sp.structured_outputs))
    return msg


# The oneof's wire names and StructuredOutputs' (vLLM's) where they differ: `json` is a JSON Schema.
_STRUCTURED_TO_SPEC = {"json_schema": "json"}
_STRUCTURED_TO_PROTO = {v: k for k, v in _STRUCTURED_TO_SPEC.items()}


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The oneof as vLLM's dict, built by StructuredOutputs.from_dict: the HTTP API's rules and messages
    (GrammarError, a ValueError, naming the field). Whether it compiles is the engine's to say."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return StructuredOutputs.from_dict({})  # refused: names the kinds to choose from
    value: Any = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputs.from_dict({_STRUCTURED_TO_SPEC.get(kind, kind): value})


def structured_to_proto(so: StructuredOutputs) -> pb.StructuredOutputs:
    """The client side: the one kind set; schemas and tags go as the compact JSON text the spec keeps."""
    kind = so.kind
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.ChoiceList(choices=list(so.choice or ())))
    msg = pb.StructuredOutputs()
    setattr(msg, _STRUCTURED_TO_PROTO.get(kind, kind), getattr(so, kind))
    return msg


def logprobs_to_proto(logprobs: Sequence[TokenLogprob], token_ids: Sequence[int]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
        for t, (lp, top) in zip(token_ids, logprobs, strict=True)
    ]


# ---- prompts -------------------------------------------------------------------------------------
def prompt_from_proto(req: pb.GenerateRequest, vocab_size: int | None = None,
                      tools: str | None = None) -> PromptInput:
    """Pick the one prompt field that was set; ValueError naming the field otherwise. `tools`: the checked
    tool list's JSON text (ToolPlan.tools), which only messages may carry."""
    given = [
        name
        for name, present in (
            ("prompt", bool(req.prompt)),
            ("prompt_token_ids", len(req.prompt_token_ids) > 0),
            ("messages", len(req.messages) > 0),
        )
        if present
    ]
    if not given:
        raise ValueError("prompt is empty: set one of prompt, prompt_token_ids or messages")
    if len(given) > 1:
        raise ValueError(f"set only one of prompt, prompt_token_ids or messages; got {', '.join(given)}")
    salt = req.cache_salt or None
    if req.prompt:
        return PromptInput(text=req.prompt, tools=tools, cache_salt=salt)
    if req.messages:
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role {m.role!r} is unknown; "
                                 f"expected one of {', '.join(CHAT_ROLES)}")
        return PromptInput(messages=tuple(_turn_from_proto(m) for m in req.messages), tools=tools,
                           cache_salt=salt)
    ids = tuple(int(t) for t in req.prompt_token_ids)
    upper = vocab_size if vocab_size is not None else _INT64_MAX
    for i, t in enumerate(ids):
        if not 0 <= t < upper:
            raise ValueError(f"prompt_token_ids[{i}]={t} is out of range [0, {upper})")
    return PromptInput(token_ids=ids, tools=tools, cache_salt=salt)


def _turn_from_proto(m: pb.ChatMessage) -> Turn:
    """A plain (role, content) pair, or a ChatTurn where the message has tool fields (or is a tool turn,
    which needs one). An assistant turn with tool_calls and empty content has null content."""
    if not (m.tool_calls or m.tool_call_id or m.name or m.role == "tool"):
        return (m.role, m.content)
    calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments or "{}") for c in m.tool_calls]
    content = None if calls and not m.content and m.role == "assistant" else m.content
    return chat_turn(m.role, content, calls, m.tool_call_id or None, m.name or None)


def _turn_to_proto(turn: ChatTurn) -> pb.ChatMessage:
    return pb.ChatMessage(role=turn.role, content=turn.content or "", tool_call_id=turn.tool_call_id or "",
                          name=turn.name or "",
                          tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                      for c in turn.tool_calls])


# ---- tools ---------------------------------------------------------------------------------------
TOOL_CHOICE_FUNCTION = "function:"  # tool_choice's prefix naming the one function to call


def tool_choice_from_proto(choice: str) -> str | dict[str, Any] | None:
    """The wire's tool_choice as OpenAI's ("" is unset); ValueError for a string of neither form."""
    if not choice:
        return None
    if choice.startswith(TOOL_CHOICE_FUNCTION):
        return {"type": "function", "function": {"name": choice[len(TOOL_CHOICE_FUNCTION):]}}
    if choice not in TOOL_CHOICES:
        raise GrammarError(f"tool_choice {choice!r} is unknown; expected one of {', '.join(TOOL_CHOICES)} "
                           f"or {TOOL_CHOICE_FUNCTION}NAME")
    return choice


def tool_choice_to_proto(choice: str | Mapping[str, Any] | None) -> str:
    """OpenAI's tool_choice (a mode, or {"type": "function", "function": {"name": ...}}) as the wire's."""
    if choice is None:
        return ""
    if isinstance(choice, str):
        return choice
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('tool_choice must be a mode or {"type": "function", "function": {"name": ...}}')
    return TOOL_CHOICE_FUNCTION + name


def tool_from_proto(tool: pb.Tool, index: int) -> dict[str, Any]:
    """A wire Tool as OpenAI's tool dict (normalize_tools checks it); empty fields are unset ones."""
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    if tool.parameters_json:
        try:
            fn["parameters"] = json.loads(tool.parameters_json)
        except json.JSONDecodeError as e:
            raise GrammarError(f"tools[{index}].parameters_json is not valid JSON: {e}") from None
    return {"type": "function", "function": fn}


def tool_to_proto(tool: Mapping[str, Any]) -> pb.Tool:
    """The client side: OpenAI's {"type": "function", "function": {name, description, parameters}}; the
    server checks it."""
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise ValueError("a tool is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    params = fn.get("parameters")
    return pb.Tool(name=str(fn.get("name", "")), description=str(fn.get("description") or ""),
                   parameters_json="" if params is None else json.dumps(params, ensure_ascii=False))


def tool_plan_from_proto(req: pb.GenerateRequest) -> ToolPlan:
    """The request's tools, tool choice and parallel_tool_calls resolved as the HTTP API resolves them;
    GrammarError (INVALID_ARGUMENT) with its messages."""
    tools = [tool_from_proto(t, i) for i, t in enumerate(req.tools)]
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
    return plan_tools(tools, tool_choice_from_proto(req.tool_choice), parallel)


def request_id_from_proto(req: pb.GenerateRequest) -> str:
    """The client's request id ("" = let the server pick one); ValueError naming the limit otherwise."""
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(rid)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if any(not c.isprintable() for c in rid):
        raise ValueError("request_id must hold printable characters only")
    return rid


# ---- malformed wire messages ------------------------------------------------------------------------
@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request that could not be parsed; the servicer answers INVALID_ARGUMENT with
    `reason`."""

    reason: str


# The string fields of a GenerateRequest, by field number, to name the one that is not UTF-8.
_STRING_FIELDS: dict[int, Any] = {
    1: "request_id",
    2: "prompt",
    4: ("messages", {1: "role", 2: "content", 3: ("tool_calls", {1: "id", 2: "name", 3: "arguments"}),
                     4: "tool_call_id", 5: "name"}),
    5: ("sampling", {5: "stop", 16: ("structured_outputs", {1: "json_schema", 3: "regex",
                                                          4: ("choice", {1: "choices"}), 5: "grammar",
                                                          6: "structural_tag"})}),
    7: ("tools", {1: "name", 2: "description", 3: "parameters_json"}),
    8: "tool_choice",
}
_REPEATED_MESSAGES = ("messages", "tool_calls", "tools")  # named with their index


def generate_request_deserializer(max_bytes: int) -> Callable[[bytes], pb.GenerateRequest | MalformedRequest]:
    """Parse a GenerateRequest without ever raising: gRPC would answer a raising deserializer with
    INTERNAL."""

    def parse(data: bytes) -> pb.GenerateRequest | MalformedRequest:
        if len(data) > max_bytes:
            return MalformedRequest(
                f"request message is {len(data)} bytes; the limit is {max_bytes} (server.max_message_bytes)"
            )
        try:
            request: pb.GenerateRequest = pb.GenerateRequest.FromString(data)  # protobuf is untyped here
            return request
        except DecodeError as e:
            try:
                where = _find_bad_utf8(data, _STRING_FIELDS, "")
            except IndexError:  # truncated varint: plain garbage
                where = None
            return MalformedRequest(where or f"request message cannot be parsed: {e}")

    return parse


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _find_bad_utf8(data: bytes, fields: dict[int, Any], prefix: str) -> str | None:
    """Walk the wire format; name the first string field that is not valid UTF-8 (None if none is)."""
    pos, seen = 0, dict.fromkeys(fields, 0)
    while pos < len(data):
        key, pos = _varint(data, pos)
        num, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, pos = _varint(data, pos)
            chunk, pos = data[pos : pos + n], pos + n
            spec = fields.get(num)
            if isinstance(spec, str):
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return f"{prefix}{spec} is not valid UTF-8"
            elif spec is not None:
                name, sub = spec
                label = f"{prefix}{name}[{seen[num]}]." if name in _REPEATED_MESSAGES else f"{prefix}{name}."
                seen[num] += 1
                if (found := _find_bad_utf8(chunk, sub, label)) is not None:
                    return found
        else:
            return None
    return None


def generate_request_to_proto(
    prompt: str | Sequence[int] | None = None,
    sampling: SamplingParams | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    request_id: str = "",
    cache_salt: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> pb.GenerateRequest:
    """The client side: text, token ids or chat messages (OpenAI-style dicts: role and content, and
    tool_calls, tool_call_id or name), and OpenAI's tools, tool_choice and parallel_tool_calls."""
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                             tools=[tool_to_proto(t) for t in tools or ()],
                             tool_choice=tool_choice_to_proto(tool_choice))
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if messages is not None:
        req.messages.extend(_turn_to_proto(ChatTurn.from_dict(m)) for m in messages)
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.extend(int(t) for t in prompt)
    if sampling is not None:
        req.sampling.CopyFrom(sampling_to_proto(sampling))
    return req


# ---- responses -----------------------------------------------------------------------------------
def finish_reason_to_proto(reason: str | None) -> pb.FinishReason:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PROTO.get(value)


def add_tool_calls(msg: pb.GenerateResponse, text: str) -> None:
    """A request read for tool calls, on its last message: the calls parsed from the whole output and the
    content beside them; a stop after one or more calls is FINISH_REASON_TOOL_CALLS (the HTTP API's
    "tool_calls"), a cut by length stays one."""
    content, calls = parse_tool_calls(text)
    msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
    if content is not None:
        msg.content = content
    if calls and msg.finish_reason == pb.FINISH_REASON_STOP:
        msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS


def request_metrics_to_proto(t: RequestTimes) -> pb.RequestMetrics:
    m = pb.RequestMetrics()
    if t.first_scheduled is not None:
        m.queue_time_s = max(0.0, t.first_scheduled - t.arrival)
    if t.token_times:
        m.ttft_s = t.token_times[0] - t.arrival
        m.e2e_s = t.token_times[-1] - t.arrival
        if len(t.token_times) >= 2:
            m.mean_tbt_s = (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
    return m


def to_unix_times(engine_times: Sequence[float], engine_to_unix: float) -> list[float]:
    """Engine clock (monotonic seconds) to Unix seconds, by the offset measured at start-up."""
    return [t + engine_to_unix for t in engine_times]


# ---- errors --------------------------------------------------------------------------------------
def error_to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map ppserve's exceptions to the API's status codes (ARCHITECTURE.md#the-front-doors)."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OverflowError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, PipelineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


# ---- stats ---------------------------------------------------------------------------------------
# EngineStats and its parts carry the wire messages' field names, so both directions go field for field;
# a name on one side only fails loudly here (and in tests/unit/test_proto.py), never drifts.
_NESTED = ("stages", "workers", "config")
_REPEATED = ("spec_decode_num_accepted_tokens_per_pos",)  # repeated scalars: a tuple on the Python side


def _fields(obj: object, cls: type[Any], skip: Sequence[str] = ()) -> dict[str, Any]:
    """`obj`'s values of the dataclass `cls`'s fields (obj: the dataclass itself or its wire message)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


def stats_to_proto(s: EngineStats) -> pb.Stats:
    """From AsyncEngine.stats() to the wire message."""
    msg = pb.Stats(**_fields(s, EngineStats, _NESTED))
    msg.stages.extend(pb.StageBubbles(**_fields(st, StageBubbles)) for st in s.stages)
    msg.workers.extend(pb.Worker(**_fields(w, WorkerInfo)) for w in s.workers)
    msg.config.CopyFrom(pb.ServingConfig(**_fields(s.config, ServingConfig)))
    return msg


def stats_from_proto(msg: pb.Stats) -> EngineStats:
    """The wire message back to EngineStats (the client hands typed stats, not protobuf, to callers)."""
    repeated: dict[str, Any] = {name: tuple(getattr(msg, name)) for name in _REPEATED}
    return EngineStats(
        **_fields(msg, EngineStats, (*_NESTED, *_REPEATED)),
        **repeated,
        stages=tuple(StageBubbles(**_fields(st, StageBubbles)) for st in msg.stages),
        workers=tuple(WorkerInfo(**_fields(w, WorkerInfo)) for w in msg.workers),
        config=ServingConfig(**_fields(msg.config, ServingConfig)),
    )


def chunk_from_proto(msg: pb.GenerateResponse) -> dict[str, Any]:
    """One streamed message as a plain dict; metrics only on the last one."""
    reason = finish_reason_from_proto(msg.finish_reason)
    out: dict[str, Any] = {
        "request_id": msg.request_id,
        "token_ids": list(msg.token_ids),
        "text": msg.text,
        "num_prompt_tokens": msg.num_prompt_tokens,
        "num_cached_tokens": msg.num_cached_tokens,
        "num_output_tokens": msg.num_output_tokens,
        "tool_calls": [{"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}} for c in msg.tool_calls],
        "content": msg.content if msg.HasField("content") else None,
        "token_times": list(msg.token_times),
        "finish_reason": reason,
        "metrics": None,
        "index": msg.index,
        "logprobs": [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [(t.token_id, t.logprob) for t in lp.top]}
            for lp in msg.logprobs
        ],
    }
    if reason is not None:
        out["metrics"] = {f.name: getattr(msg.metrics, f.name) for f in msg.metrics.DESCRIPTOR.fields}
    return out
