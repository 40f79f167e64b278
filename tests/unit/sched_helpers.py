"""Small builders for torch-free scheduler tests: make_scheduler, make_request, fake_result, drive,
random_scheduler."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

from ppserve.config import SchedulerConfig
from ppserve.request import Request, SamplingParams
from ppserve.sched import Scheduler, SchedulerOutput, StepResult

EOS = 2


def make_scheduler(
    policy: str = "sarathi",
    token_budget: int = 100,
    num_blocks: int = 1000,
    block_size: int = 4,
    max_model_len: int = 4096,
    pp: int = 1,
    prefix_caching: bool = True,
    **cfg: object,
) -> Scheduler:
    config = SchedulerConfig(policy=policy, token_budget=token_budget, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, block_size, max_model_len, num_stages=pp,
                     enable_prefix_caching=prefix_caching)


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, ignore_eos: bool = True,
                 prefix: list[int] | None = None, cache_salt: str | None = None) -> Request:
    """A request whose prompt is `prefix` (if given) followed by tokens no other request id has, so the
    prefix cache shares only what a test shares on purpose."""
    head = list(prefix or [])
    base = 10 + (zlib.crc32(rid.encode()) % 1_000_000) * 10_000
    return Request(
        request_id=rid,
        prompt_token_ids=head + list(range(base, base + prompt_len - len(head))),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        eos_token_ids=(EOS,),
        cache_salt=cache_salt,
    )


def fake_result(out: SchedulerOutput, token: int | dict[str, int] = 7) -> StepResult:
    """Pretend the last stage sampled `token` for every request that was due one."""
    if isinstance(token, dict):
        return StepResult(out.step_id, {rid: token[rid] for rid in out.sample_request_ids})
    return StepResult(out.step_id, {rid: token for rid in out.sample_request_ids})


def step(s: Scheduler, token: int = 7) -> SchedulerOutput | None:
    """Schedule one microbatch and complete it at once (pp=1 style)."""
    out = s.schedule()
    if out is not None:
        s.update_from_output(out, fake_result(out, token))
        s.check_invariants()
    return out


def drive(s: Scheduler, rng: random.Random, max_steps: int = 100_000, eos_prob: float = 0.0,
          cancel_prob: float = 0.0,
          complete: Callable[[SchedulerOutput, StepResult], object] | None = None) -> list[SchedulerOutput]:
    """Run a pipeline of depth s.num_stages to completion, completing microbatches oldest first.

    Each sampled token is EOS with probability `eos_prob`; with probability `cancel_prob` a newly formed
    microbatch has one of its requests cancelled. `complete(done, result)` hands a finished microbatch
    back (default: s.update_from_output). Invariants are checked after every change.
    """
    outs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return outs
        while (out := s.schedule()) is not None:
            outs.append(out)
            s.check_invariants()
            if cancel_prob and rng.random() < cancel_prob and out.order:
                s.cancel(rng.choice(out.order))
                s.check_invariants()
        assert s.in_flight, "work is left but nothing could be scheduled and nothing is in flight"
        done = s.in_flight[0]
        tokens = {rid: (EOS if rng.random() < eos_prob else 7) for rid in done.sample_request_ids}
        (complete or s.update_from_output)(done, StepResult(done.step_id, tokens))
        s.check_invariants()
    raise AssertionError("did not finish")


def random_scheduler(rng: random.Random, policy: str = "sarathi", pp: int = 1, **cfg: object) -> Scheduler:
    """A scheduler of random budget, cache size, block size and sequence cap, with 5-40 random requests
    (prompts of 1-120 tokens, 1-40 new tokens, eos honoured) added."""
    s = make_scheduler(policy, token_budget=rng.choice([1, 7, 32, 128]), num_blocks=rng.randint(170, 300),
                       block_size=rng.choice([1, 4, 16]), pp=pp, max_num_seqs=rng.randint(2, 16), **cfg)
    for i in range(rng.randint(5, 40)):
        s.add_request(make_request(f"r{i}", rng.randint(1, 120), max_tokens=rng.randint(1, 40),
                                   ignore_eos=False))
    return s


def assert_drained(s: Scheduler) -> None:
    """Nothing left: no request known, every KV block free."""
    assert not s.has_unfinished and not s.requests
    assert s.blocks.num_free == s.blocks.num_blocks
