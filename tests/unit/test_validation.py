"""Request validation without a server: every malformed GenerateRequest is a ValueError naming the field.

Property-based (hypothesis) over the request message: conversion either yields values that satisfy every
documented limit or raises ValueError; it never raises anything else.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppserve.config import ServerConfig, load_config
from ppserve.request import MAX_STOP_STRINGS, SamplingParams
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb

VOCAB = 256


def convert_all(req: pb.GenerateRequest):
    return (convert.prompt_from_proto(req, VOCAB), convert.sampling_from_proto(req.sampling),
            convert.request_id_from_proto(req))


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (pb.GenerateRequest(), "prompt is empty"),
        (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), "prompt, prompt_token_ids"),
        (pb.GenerateRequest(prompt_token_ids=[1, VOCAB]),
         f"prompt_token_ids[1]={VOCAB} is out of range [0, {VOCAB})"),
        (pb.GenerateRequest(prompt_token_ids=[-1]), "prompt_token_ids[0]=-1"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=math.nan)), "temperature"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=math.inf)), "temperature"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=0.0)), "top_p must be in (0, 1]"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=math.nan)), "top_p"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_k=-2)), "top_k"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))),
         f"the limit is {MAX_STOP_STRINGS}"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(stop=[""])),
         "stop strings must be non-empty"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]),
         "messages[0].role 'wizard' is unknown"),
        (pb.GenerateRequest(prompt="a", request_id="r" * 300),
         "request_id has 300 characters; the limit is 256"),
        (pb.GenerateRequest(prompt="a", request_id="a\nb"), "request_id"),
    ],
)
def test_malformed_requests_name_the_field(req, needle):
    with pytest.raises(ValueError) as e:
        convert_all(req)
    assert needle in str(e.value)


def test_invalid_utf8_and_oversized_bytes_are_named_not_raised():
    parse = convert.generate_request_deserializer(max_bytes=4096)
    for req, field in [
        (pb.GenerateRequest(prompt="ab"), "prompt"),
        (pb.GenerateRequest(request_id="ab", prompt="x"), "request_id"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x"),
                                      pb.ChatMessage(role="user", content="ab")]), "messages[1].content"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=["ab"])), "sampling.stop"),
    ]:
        data = req.SerializeToString().replace(b"ab", b"\xc3\x28")  # an invalid 2-byte sequence
        got = parse(data)
        assert isinstance(got, convert.MalformedRequest) and got.reason == f"{field} is not valid UTF-8"
    big = parse(pb.GenerateRequest(prompt="x" * 5000).SerializeToString())
    assert (isinstance(big, convert.MalformedRequest)
            and "the limit is 4096 (server.max_message_bytes)" in big.reason)
    assert isinstance(parse(b"\xff\xff\xff"), convert.MalformedRequest)
    ok = parse(pb.GenerateRequest(prompt="fine").SerializeToString())
    assert isinstance(ok, pb.GenerateRequest) and ok.prompt == "fine"


def test_server_config_security_fields():
    cfg = load_config(None, ["server.max_concurrent_streams=8", "server.auth_token=s3cret",
                             "scheduler.max_tokens_limit=100", "parallel.max_restarts=2"])
    assert cfg.server.host == "127.0.0.1"  # loopback unless told otherwise
    assert cfg.server.max_concurrent_streams == 8 and cfg.server.auth_token == "s3cret"
    assert cfg.scheduler.max_tokens_limit == 100 and cfg.parallel.max_restarts == 2
    with pytest.raises(ValueError, match="tls_cert and server.tls_key"):
        ServerConfig(tls_cert="c.pem")
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(auth_token="a", auth_token_file="f")
    with pytest.raises(ValueError, match="max_concurrent_streams"):
        ServerConfig(max_concurrent_streams=0)
    with pytest.raises(ValueError, match="max_restarts"):
        load_config(None, ["parallel.max_restarts=-1"])


def test_stage_timeout_is_configurable_and_positive():
    assert load_config(None, ["parallel.stage_timeout_s=2.5"]).parallel.stage_timeout_s == 2.5
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="parallel.stage_timeout_s must be a finite number > 0"):
            load_config(None, [f"parallel.stage_timeout_s={bad}"])


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, -1.0, 0.5]))
_ints32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def generate_requests(draw):
    req = pb.GenerateRequest(request_id=draw(st.text(max_size=300)))
    which = draw(st.sets(st.sampled_from(["prompt", "ids", "messages"]), max_size=3))
    if "prompt" in which:
        req.prompt = draw(st.text(max_size=50))
    if "ids" in which:
        req.prompt_token_ids.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)))
    if "messages" in which:
        for role, content in draw(st.lists(st.tuples(st.one_of(st.sampled_from(convert.CHAT_ROLES),
                                                               st.text()),
                                                     st.text(max_size=20)), max_size=4)):
            req.messages.add(role=role, content=content)
    sp = req.sampling
    for name, strat in (("temperature", _floats), ("top_p", _floats), ("top_k", _ints32),
                        ("max_tokens", _ints32), ("seed", st.integers(-(2**63), 2**63 - 1))):
        if draw(st.booleans()):
            setattr(sp, name, draw(strat))
    sp.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    sp.stop_token_ids.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70)))
    sp.ignore_eos = draw(st.booleans())
    return req


@settings(max_examples=400, deadline=None)
@given(generate_requests())
def test_conversion_accepts_only_valid_requests(req):
    try:
        prompt, sampling, rid = convert_all(req)
    except ValueError as e:
        assert str(e)  # a message, always
        return
    assert sum(x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)) == 1
    if prompt.token_ids is not None:
        assert prompt.token_ids and all(0 <= t < VOCAB for t in prompt.token_ids)
    if prompt.messages is not None:
        assert all(role in convert.CHAT_ROLES for role, _ in prompt.messages)
    if prompt.text is not None:
        assert prompt.text
    assert isinstance(sampling, SamplingParams) and sampling.max_tokens >= 1
    assert math.isfinite(sampling.temperature) and sampling.temperature >= 0
    assert 0 < sampling.top_p <= 1 and (sampling.top_k == -1 or sampling.top_k >= 1)
    assert len(sampling.stop) <= MAX_STOP_STRINGS and all(sampling.stop)
    assert all(t >= 0 for t in sampling.stop_token_ids)
    assert len(rid) <= convert.MAX_REQUEST_ID_CHARS
