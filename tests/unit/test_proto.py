"""Proto <-> Python conversion (no server, no torch) and the freshness of the generated modules."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import grpc
import pytest

from ppserve.engine.messages import PipelineUnavailable, PromptInput, RequestTimes
from ppserve.engine.stats import EngineStats, ServingConfig, StageBubbles
from ppserve.request import SamplingParams
from ppserve.server import convert
from ppserve.server.codegen import GEN_DIR, OUTPUTS, generate
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.worker.info import WorkerInfo
from tests.fake_engine import FakeEngine


def test_sampling_round_trip() -> None:
    sp = SamplingParams(
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=123,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 5),
        ignore_eos=True,
    )
    assert convert.sampling_from_proto(convert.sampling_to_proto(sp)) == sp


def test_unset_sampling_fields_keep_defaults() -> None:
    assert convert.sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    only = convert.sampling_from_proto(pb.SamplingParams(max_tokens=3))
    assert only == SamplingParams(max_tokens=3)
    assert convert.sampling_from_proto(pb.SamplingParams(min_p=0.2)).min_p == 0.2
    # An unset min_p keeps the model's default; an explicit 0 (disabled) overrides it.
    assert convert.sampling_from_proto(pb.SamplingParams(), {"min_p": 0.1}).min_p == 0.1
    assert convert.sampling_from_proto(pb.SamplingParams(min_p=0.0), {"min_p": 0.1}).min_p == 0.0
    # Explicit zero temperature is present (greedy), not "unset".
    assert convert.sampling_from_proto(pb.SamplingParams(temperature=0.0)).temperature == 0.0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
    ],
)
def test_bad_sampling_names_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        convert.sampling_from_proto(pb.SamplingParams(**fields))


def test_prompt_fields() -> None:
    assert convert.prompt_from_proto(pb.GenerateRequest(prompt="hi")).text == "hi"
    assert convert.prompt_from_proto(pb.GenerateRequest(prompt_token_ids=[1, 2]), 10).token_ids == (1, 2)
    msgs = convert.prompt_from_proto(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")]))
    assert msgs.messages == (("user", "x"),)
    with pytest.raises(ValueError, match="prompt"):
        convert.prompt_from_proto(pb.GenerateRequest())
    with pytest.raises(ValueError, match="only one"):
        convert.prompt_from_proto(pb.GenerateRequest(prompt="a", prompt_token_ids=[1]))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]=10"):
        convert.prompt_from_proto(pb.GenerateRequest(prompt_token_ids=[1, 10]), 10)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=-1"):
        convert.prompt_from_proto(pb.GenerateRequest(prompt_token_ids=[-1]))
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        convert.prompt_from_proto(pb.GenerateRequest(messages=[pb.ChatMessage(content="x")]))


def test_client_request_builder() -> None:
    req = convert.generate_request_to_proto([5, 6], SamplingParams(max_tokens=2), request_id="r1")
    assert list(req.prompt_token_ids) == [5, 6] and req.request_id == "r1" and req.sampling.max_tokens == 2
    chat = convert.generate_request_to_proto(messages=[{"role": "user", "content": "hello"}])
    assert chat.messages[0].content == "hello" and not chat.prompt


def test_errors_map_to_status_codes() -> None:
    assert convert.error_to_status(ValueError("temperature bad"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert convert.error_to_status(OverflowError("full"))[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        convert.error_to_status(PipelineUnavailable("rebuilding"))[0] is grpc.StatusCode.UNAVAILABLE
    )
    code, msg = convert.error_to_status(RuntimeError("boom"))
    assert code is grpc.StatusCode.INTERNAL and "boom" in msg


def test_finish_reasons_and_metrics() -> None:
    for reason in (None, "stop", "length", "cancelled", "error"):
        assert convert.finish_reason_from_proto(convert.finish_reason_to_proto(reason)) == reason
    m = convert.request_metrics_to_proto(RequestTimes(10.0, 10.5, [11.0, 11.2, 11.6]))
    assert m.queue_time_s == pytest.approx(0.5)
    assert m.ttft_s == pytest.approx(1.0)
    assert m.mean_tbt_s == pytest.approx(0.3)
    assert m.e2e_s == pytest.approx(1.6)


def test_stats_round_trip() -> None:
    s = EngineStats(
        running=2,
        waiting=1,
        in_flight_microbatches=2,
        kv_blocks_used=7,
        kv_blocks_total=100,
        tokens_per_s=12.5,
        window_s=30.0,
        mean_bubble_fraction=0.25,
        num_preemptions=3,
        requests_finished=9,
        tokens_generated=400,
        uptime_s=60.0,
        num_restarts=2,
        last_recovery_s=1.5,
        total_recovery_s=4.0,
        spec_decode_num_drafts=4,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=6,
        spec_decode_num_accepted_tokens_per_pos=(3, 2, 1),
        spec_decode_acceptance_rate=0.5,
        spec_decode_mean_acceptance_length=2.5,
        stages=(StageBubbles(stage=0, busy_fraction=0.7, bubble_fraction=0.2, starvation_fraction=0.1),),
        workers=(
            WorkerInfo(stage=0, tp_rank=0, layer_start=0, layer_end=15, node_ip="10.0.0.1", node_id="abc",
                       pid=42),
        ),
        config=ServingConfig(
            model="m",
            pipeline_parallel_size=2,
            tensor_parallel_size=1,
            policy="sarathi",
            token_budget=512,
            max_num_seqs=256,
            max_waiting=4096,
            block_size=16,
            max_model_len=8192,
            config_json="{}",
        ),
    )
    back = convert.stats_from_proto(convert.stats_to_proto(s))
    assert back.in_flight_microbatches == 2 and back.tokens_generated == 400
    assert back.workers[0] == WorkerInfo(
        stage=0,
        tp_rank=0,
        layer_start=0,
        layer_end=15,
        node_ip="10.0.0.1",
        node_id="abc",
        pid=42,
    )
    assert back.stages[0].bubble_fraction == pytest.approx(0.2)
    assert back.config.policy == "sarathi"
    assert (back.num_restarts, back.last_recovery_s, back.total_recovery_s) == (2, 1.5, 4.0)
    assert back == s  # field for field, nothing lost either way
    from ppserve.server.cli import format_stats

    assert "2 pipeline restart(s), last took 1.50 s, 4.00 s in all" in format_stats(back)
    assert back.spec_decode_num_accepted_tokens_per_pos == (3, 2, 1)  # a tuple again, not a proto container
    assert ("speculation  4 drafts: 6 of 12 draft tokens accepted (50.0%), mean acceptance length 2.50; "
            "per position 3 / 2 / 1") in format_stats(back)
    assert "speculation" not in format_stats(EngineStats())  # shown only when drafts happened
    # Before any rebuild the engine reports last_recovery_s=0: zero on the wire.
    fresh = convert.stats_from_proto(convert.stats_to_proto(dataclasses.replace(
        s, num_restarts=0, last_recovery_s=0.0, total_recovery_s=0.0)))
    assert (fresh.num_restarts, fresh.last_recovery_s) == (0, 0.0)
    assert "0 pipeline restart(s)\n" in format_stats(fresh)


def test_stats_types_name_the_wire_fields() -> None:
    """EngineStats and its parts are the one definition of the stats: each names exactly its message's
    fields."""
    for cls, msg in ((EngineStats, pb.Stats), (StageBubbles, pb.StageBubbles), (WorkerInfo, pb.Worker),
                     (ServingConfig, pb.ServingConfig)):
        assert {f.name for f in dataclasses.fields(cls)} == {f.name for f in msg.DESCRIPTOR.fields}, cls


def test_server_package_keeps_torch_out() -> None:
    # The protobuf edge is importable by light clients; torch loads only with the engine.
    import subprocess

    code = "import sys, ppserve.server.client, ppserve.server.convert; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """The committed ppserve/server/gen/ equals a fresh `python -m ppserve.server.codegen` run."""
    pytest.importorskip("grpc_tools")
    generate(tmp_path)
    for name in (*OUTPUTS, "__init__.py"):
        fresh = (tmp_path / name).read_text()
        committed = (GEN_DIR / name).read_text()
        assert fresh == committed, (
            f"ppserve/server/gen/{name} is stale: run `python -m ppserve.server.codegen`"
        )


# ---- the servicer and AsyncEngine over a fake engine (no model, no Ray) ------------------------------
def _with_server(fake: FakeEngine, body):  # type: ignore[no-untyped-def]
    import asyncio

    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.server.client import AsyncPPServeClient
    from ppserve.server.server import start_server

    async def main():  # type: ignore[no-untyped-def]
        running = await start_server(AsyncEngine(fake), "127.0.0.1", 0)
        try:
            async with AsyncPPServeClient(running.address) as client:
                return await body(client)
        finally:
            await running.stop(1.0)

    return asyncio.run(main())


def test_queue_full_is_resource_exhausted() -> None:
    import asyncio

    fake = FakeEngine(max_waiting=2)
    fake.paused = True  # nothing finishes, so the queue stays full

    async def body(client):  # type: ignore[no-untyped-def]
        req = convert.generate_request_to_proto([1, 2], SamplingParams(max_tokens=5))
        calls = [client.stub.Generate(req) for _ in range(2)]
        await asyncio.sleep(0.5)  # both are queued
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate([1, 2], max_tokens=5)
        for call in calls:
            call.cancel()
        await asyncio.sleep(0.2)
        return e.value

    err = _with_server(fake, body)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in err.details()
    assert not fake.left  # the cancelled streams took their requests with them


def test_get_stats_over_the_fake_engine_is_typed() -> None:
    """AsyncEngine.stats() -> servicer -> wire -> client: the same EngineStats, the workers' node_ip
    intact."""

    async def body(client):  # type: ignore[no-untyped-def]
        await client.generate([1, 2], max_tokens=3)
        return await client.stats()

    s = _with_server(FakeEngine(), body)
    assert isinstance(s, EngineStats)
    assert (s.kv_blocks_total, s.tokens_generated, s.requests_finished) == (8, 3, 1)
    assert s.workers == (WorkerInfo(stage=0, tp_rank=0, layer_start=0, layer_end=2, node_ip="local", pid=1),)
    assert s.config.block_size == 16 and s.config.max_waiting == 2 and s.window_s > 0


def test_slow_reader_gets_merged_chunks() -> None:
    """The engine thread never waits for a reader: deltas pile up merged into one pending chunk."""
    import asyncio

    from ppserve.engine.async_engine import AsyncEngine

    async def main():  # type: ignore[no-untyped-def]
        eng = AsyncEngine(FakeEngine())
        eng.start()
        try:
            stream = await eng.add_request(
                PromptInput(token_ids=(1, 2, 3)), SamplingParams(max_tokens=60)
            )
            await asyncio.sleep(0.5)  # 60 steps of ~2 ms happen meanwhile
            return [c async for c in stream]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, eng.stop)

    chunks = asyncio.run(main())
    assert sum(len(c.token_ids) for c in chunks) == 60
    assert "".join(c.text for c in chunks) == "a" * 60
    assert len(chunks) <= 2  # merged while nobody was reading
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 60
    assert chunks[-1].times is not None and len(chunks[-1].times.token_times) == 60
