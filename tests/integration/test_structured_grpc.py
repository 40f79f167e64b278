"""Structured outputs through gRPC, on the real engine (tiny model with a byte-level tokenizer, in-process
stages): JSON schema, choice and regex outputs match their constraint, and a constraint that is malformed
or does not compile is INVALID_ARGUMENT with the spec's or the compiler's message, after which the server
still serves.

One server serves the whole module; a greedy random model under a grammar emits exactly what the grammar
allows, so the constraints are bounded (enums, fixed-length digits) to finish well inside max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from ppserve.request import SamplingParams
from ppserve.server.client import PPServeClient
from ppserve.structured.spec import StructuredOutputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[0-9]{3}$"},
    },
    "required": ["name", "ok", "code"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-f]{2}-[0-9]{4}"
PROMPT = "Answer: "


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.structured_helpers import add_byte_tokenizer

    return add_byte_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("structured") / "tok")


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[PPServeClient]:
    from tests.structured_helpers import grpc_client

    with grpc_client([f"model.model={model_dir}", "model.dtype=float32", "parallel.executor=inproc"]) as c:
        yield c


def _generate(client: PPServeClient, structured: Any, max_tokens: int = 64) -> str:
    out = client.generate(PROMPT, max_tokens=max_tokens, structured_outputs=structured, timeout=60)
    assert out.finish_reason == "stop", out  # the grammar ended it, not max_tokens
    return out.text


def test_json_schema_output_validates(client: PPServeClient) -> None:
    text = _generate(client, {"json": SCHEMA})
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(client: PPServeClient) -> None:
    """A random model may not close an open object in time: then the text is an object cut short."""
    out = client.generate(PROMPT, max_tokens=64, structured_outputs=StructuredOutputs(json_object=True),
                          timeout=60)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.text.startswith("{") and len(out.token_ids) == 64


def test_choice_output_is_one_of_them(client: PPServeClient) -> None:
    assert _generate(client, StructuredOutputs(choice=tuple(CHOICES))) in CHOICES


def test_regex_output_matches(client: PPServeClient) -> None:
    sp = SamplingParams(max_tokens=64, structured_outputs={"regex": REGEX})
    out = client.generate(PROMPT, sampling=sp, timeout=60)
    assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out


def test_grammar_output_matches(client: PPServeClient) -> None:
    text = _generate(client, {"grammar": 'root ::= "(" [0-9] [0-9] ")"'})
    assert re.fullmatch(r"\([0-9]{2}\)", text), text


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        ({"regex": "[a-"}, "structured_outputs.regex does not compile"),
        ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar does not compile"),
        ({"choice": []}, "structured_outputs.choice is empty"),
        ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
         "structured_outputs.json does not compile"),
        ({"json": [1, 2]}, "a JSON schema is an object"),
    ],
    ids=["bad-regex", "bad-grammar", "empty-choice", "bad-schema-type", "schema-not-an-object"],
)
def test_bad_constraint_is_invalid_argument(client: PPServeClient, structured: dict[str, Any],
                                            message: str) -> None:
    # Built on the wire by hand: the client's own SamplingParams would refuse the spec checks locally.
    from ppserve.server.gen import ppserve_pb2 as pb

    so = pb.StructuredOutputs()
    kind, value = next(iter(structured.items()))
    if kind == "choice":
        so.choice.CopyFrom(pb.ChoiceList(choices=value))
    elif kind == "json":
        so.json_schema = json.dumps(value)
    else:
        setattr(so, kind, value)
    req = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, structured_outputs=so))
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert message in (err.value.details() or ""), err.value.details()
    # The server keeps serving, constrained requests included.
    assert _generate(client, {"choice": CHOICES}) in CHOICES


def test_unset_kind_and_ignore_eos_are_invalid_argument(client: PPServeClient) -> None:
    from ppserve.server.gen import ppserve_pb2 as pb

    cases = [
        (pb.SamplingParams(structured_outputs=pb.StructuredOutputs()), "takes exactly one of"),
        (pb.SamplingParams(ignore_eos=True, structured_outputs=pb.StructuredOutputs(regex="a")),
         "ignore_eos cannot be combined with structured outputs"),
    ]
    for sampling, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or ""), err.value.details()
