"""SamplingParams.structured_outputs to and from the wire (ppserve.server.convert): every kind round-trips,
a malformed constraint is the spec's GrammarError (INVALID_ARGUMENT), and a non-UTF-8 constraint string
is named by the malformed-message walker."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from ppserve.request import SamplingParams
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.structured.spec import GrammarError, StructuredOutputs


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}},
        {"json": True},
        {"json_object": True},
        {"regex": r"[a-z]+\d"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a" | "b"'},
        {"structural_tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}},
    ],
    ids=lambda s: next(iter(s)),
)
def test_every_kind_round_trips(spec: dict[str, Any]) -> None:
    sp = SamplingParams(max_tokens=5, structured_outputs=spec)
    msg = convert.sampling_to_proto(sp)
    assert msg.HasField("structured_outputs")
    back = convert.sampling_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == sp
    assert back.structured_outputs is not None and back.structured_outputs.to_dict() == spec


def test_wire_names() -> None:
    """The oneof names: json_schema carries the schema as JSON text (key order kept), choice a list."""
    so = convert.structured_to_proto(StructuredOutputs(json={"type": "object", "z": 1, "a": 2}))
    assert so.WhichOneof("kind") == "json_schema" and so.json_schema == '{"type":"object","z":1,"a":2}'
    so = convert.structured_to_proto(StructuredOutputs(choice=("a", "b")))
    assert so.WhichOneof("kind") == "choice" and list(so.choice.choices) == ["a", "b"]
    got = convert.structured_from_proto(pb.StructuredOutputs(json_schema='{"type": "string"}'))
    assert got == StructuredOutputs(json={"type": "string"})


def test_unset_means_unconstrained() -> None:
    assert convert.sampling_from_proto(pb.SamplingParams()).structured_outputs is None
    assert not convert.sampling_to_proto(SamplingParams()).HasField("structured_outputs")


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (pb.StructuredOutputs(), "takes exactly one of"),
        (pb.StructuredOutputs(json_object=False), "takes exactly one of"),
        (pb.StructuredOutputs(choice=pb.ChoiceList()), "structured_outputs.choice is empty"),
        (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["a", ""])), "holds non-empty strings"),
        (pb.StructuredOutputs(json_schema="{not json"), "structured_outputs.json is not valid JSON"),
        (pb.StructuredOutputs(json_schema="[1]"), "a JSON schema is an object"),
        (pb.StructuredOutputs(json_schema=""), "structured_outputs.json is not valid JSON"),
        (pb.StructuredOutputs(regex=""), "structured_outputs.regex must be a non-empty string"),
        (pb.StructuredOutputs(structural_tag="nope"), "structured_outputs.structural_tag is not valid JSON"),
    ],
    ids=["none", "json-object-false", "empty-choice", "empty-choice-string", "schema-not-json",
         "schema-not-object", "schema-empty", "regex-empty", "tag-not-json"],
)
def test_bad_constraint_is_the_specs_error(so: pb.StructuredOutputs, message: str) -> None:
    with pytest.raises(GrammarError, match=message) as err:
        convert.sampling_from_proto(pb.SamplingParams(structured_outputs=so))
    assert convert.error_to_status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, str(err.value))
    # The same message as the dict form the HTTP API hands StructuredOutputs.from_dict.
    kind = so.WhichOneof("kind")
    if kind is not None:
        value: Any = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
        with pytest.raises(GrammarError) as http:
            StructuredOutputs.from_dict({"json" if kind == "json_schema" else kind: value})
        assert str(http.value) == str(err.value)


def test_constraint_conflicts_are_sampling_errors() -> None:
    so = pb.StructuredOutputs(regex="a+")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        convert.sampling_from_proto(pb.SamplingParams(ignore_eos=True, structured_outputs=so))
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        convert.sampling_from_proto(pb.SamplingParams(min_tokens=2, structured_outputs=so))


def test_client_request_carries_the_constraint() -> None:
    req = convert.generate_request_to_proto("hi", SamplingParams(structured_outputs={"choice": ["x"]}))
    assert list(req.sampling.structured_outputs.choice.choices) == ["x"]


@pytest.mark.parametrize(
    ("so", "named"),
    [
        (pb.StructuredOutputs(regex="QQ"), "sampling.structured_outputs.regex"),
        (pb.StructuredOutputs(json_schema='"QQ"'), "sampling.structured_outputs.json_schema"),
        (pb.StructuredOutputs(grammar="QQ"), "sampling.structured_outputs.grammar"),
        (pb.StructuredOutputs(structural_tag='"QQ"'), "sampling.structured_outputs.structural_tag"),
        (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["ok", "QQ"])),
         "sampling.structured_outputs.choice.choices"),
    ],
    ids=["regex", "json_schema", "grammar", "structural_tag", "choice"],
)
def test_non_utf8_constraint_is_named(so: pb.StructuredOutputs, named: str) -> None:
    req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(structured_outputs=so))
    data = req.SerializeToString().replace(b"QQ", b"\xff\xfe")  # same length: the framing stays valid
    got = convert.generate_request_deserializer(1 << 20)(data)
    assert got == convert.MalformedRequest(f"{named} is not valid UTF-8")


def test_python_client_takes_the_constraint_as_a_keyword() -> None:
    from ppserve.server.client import _request

    req = _request("hi", None, None, "", max_tokens=4, structured_outputs={"regex": "a+"})
    assert req.sampling.structured_outputs.regex == "a+" and req.sampling.max_tokens == 4
    # Over a given SamplingParams: its other fields kept, the keyword's added.
    req = _request("hi", None, SamplingParams(max_tokens=7), "",
                   structured_outputs=StructuredOutputs(choice=("x", "y")))
    assert list(req.sampling.structured_outputs.choice.choices) == ["x", "y"] and req.sampling.max_tokens == 7
    with pytest.raises(GrammarError, match="choice is empty"):
        _request("hi", None, None, "", structured_outputs={"choice": []})
