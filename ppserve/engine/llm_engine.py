"""The engine step loop: schedule until the pipeline is full, take back the oldest microbatch, stream.

Single-threaded by design. Concurrency comes from the executor (Ray); the engine keeps at most
`pp_size` microbatches in flight so every stage has work while requests exist. One step reads:

    fill the pipeline -> collect the oldest microbatch -> hand it to the scheduler (tokens, stage
    times for its cost model) -> fill the pipeline again -> detokenize and check stop strings

so the stages get their next microbatch before any text work is done: detokenization and stop
strings are off the critical path. A request that hits a stop string may already ride in the
microbatch just sent; it is finished at once (its blocks freed) and that token is dropped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ppserve.config import EngineConfig
from ppserve.engine.core import EngineCore, sleep_until
from ppserve.engine.detokenizer import IncrementalDetokenizer
from ppserve.engine.dispatch import StageFailure
from ppserve.engine.messages import PromptInput, TokenDelta, Turn
from ppserve.engine.output import OutputState
from ppserve.engine.stats import EngineCounts, acceptance_fields
from ppserve.metrics.spans import Span, WorkTracker
from ppserve.request import FinishReason, Request, SamplingParams, choice_params
from ppserve.sched.output import RequestUpdate
from ppserve.sched.scheduler import Scheduler
from ppserve.sched.speculation import SpecCounters

if TYPE_CHECKING:  # the executors and transformers are imported when the engine builds them
    from transformers import PreTrainedTokenizerBase

    from ppserve.engine.executor import Executor
    from ppserve.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)


class PipelineFailed(RuntimeError):
    """A stage died and the pipeline could not be rebuilt within parallel.max_restarts attempts."""


def context_limit(asked: int | None, max_positions: int, sliding_window: int | None) -> int:
    """The context a request may fill: `model.max_model_len`, by default the model's own. Attention that
    looks back only `sliding_window` tokens is not implemented, so such a model's context stops there
    (within the window, full attention is the same thing)."""
    limit = max_positions if sliding_window is None else min(max_positions, sliding_window)
    if asked is None:
        if limit < max_positions:
            logger.warning("the model attends over a sliding window of %d tokens: the context is capped "
                           "there (max_position_embeddings %d)", limit, max_positions)
        return limit
    if asked > max_positions:
        raise ValueError(f"model.max_model_len {asked} exceeds the model's max_position_embeddings "
                         f"{max_positions}")
    if asked > limit:
        raise ValueError(f"model.max_model_len {asked} exceeds the model's sliding window of {limit} tokens "
                         "(sliding-window attention is not implemented; full attention is the same within "
                         "it)")
    return asked


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.clock = clock
        self.init_model_source()
        self.init_tokenizer()
        self.init_executor()
        self.init_scheduler()
        self.tracked: dict[str, OutputState] = {}  # unfinished requests, by id
        self._ids = itertools.count()
        self.init_recovery_state()
        self.init_partition()

    # ---- construction ----------------------------------------------------------------------------
    def init_model_source(self) -> None:
        from ppserve.model.loader import read_generation_defaults, read_hf_config, resolve_model
        from ppserve.model.registry import describe_model

        self.model_dir = resolve_model(self.config.model.model, self.config.model.cache_dir)
        hf_config = read_hf_config(self.model_dir)
        arch = describe_model(hf_config)
        if self.config.model.quantization is not None and "quantization_config" in hf_config:
            raise ValueError(f"model.quantization={self.config.model.quantization} quantizes a "
                             "floating-point checkpoint at load; this one is already quantized (its "
                             "quantization_config is used as it is)")
        # generation_config.json's end-of-sequence ids end a request too (transformers' generate stops
        # on them), and its sampling fields are the defaults the front doors offer.
        self.sampling_defaults, gen_eos = read_generation_defaults(self.model_dir)
        eos = tuple(dict.fromkeys((*arch.eos_token_ids, *gen_eos)))
        self.arch = dataclasses.replace(arch, eos_token_ids=eos)  # parsed once, shipped to every worker
        self.max_model_len = context_limit(self.config.model.max_model_len, self.arch.max_position_embeddings,
                                           self.arch.sliding_window)

    def init_tokenizer(self) -> None:
        from ppserve.engine.prompter import Prompter, load_tokenizer, read_chat_template

        self.tokenizer: PreTrainedTokenizerBase | None = load_tokenizer(self.model_dir)
        self.eos_token_ids = tuple(self.arch.eos_token_ids)
        self.chat_template: str | None = read_chat_template(self.config.model.chat_template)
        self.prompter = Prompter(self.tokenizer, self.chat_template, self.arch.vocab_size)

    @property
    def grammars(self) -> GrammarCache:
        """Structured outputs' compile cache for this model's tokenizer (structured/grammars.py)."""
        from ppserve.structured.grammars import shared_cache

        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model directory has none")
        return shared_cache(str(self.model_dir), self.arch.vocab_size, self.arch.eos_token_ids,
                            tokenizer=self.tokenizer, timeout_s=self.config.structured.compile_timeout_s)

    def init_executor(self) -> None:
        from ppserve.sched.partition import initial_ranges

        par = self.config.parallel
        kind = par.executor
        if kind == "auto":
            kind = "inproc" if par.world_size == 1 else "ray" if importlib.util.find_spec("ray") else "mp"
        ranges = initial_ranges(par, self.arch, self.config.scheduler.token_budget)
        self.executor: Executor
        if kind == "inproc":
            from ppserve.engine.executor import InProcExecutor

            self.executor = InProcExecutor(self.config, str(self.model_dir), self.arch, ranges)
        elif kind == "mp":
            from ppserve.engine.mp_executor import MultiprocExecutor

            self.executor = MultiprocExecutor(self.config, str(self.model_dir), self.arch, ranges)
        else:
            from ppserve.engine.ray_executor import RayExecutor

            self.executor = RayExecutor(self.config, str(self.model_dir), self.arch, ranges)

    def init_scheduler(self) -> None:
        self.scheduler = Scheduler(
            self.config.scheduler,
            num_blocks=self.executor.num_kv_blocks,
            block_size=self.executor.block_size,  # cache.block_size, or what the stages' attention prefers
            max_model_len=self.max_model_len,
            num_stages=self.config.parallel.pipeline_parallel_size,
            clock=self.clock,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            # The stages' step costs timed at start-up: time shares from the first microbatch, as in the
            # simulator, whose scheduler starts from the roofline's (worker/startup_cost.py).
            cost_prior=self.executor.startup_cost,
            speculative=self.config.speculative,
        )
        # With the token ring the engine may wait to form a microbatch until stage 0 needs it
        # (sched/ring_clock.py): only where the stages compute on their own while it waits.
        wait = sleep_until(self.clock) if self.executor.asynchronous else None
        self.core = EngineCore(self.scheduler, self.executor, clock=self.clock, wait_until=wait,
                               dispatch_s=self.executor.dispatch_latency_s)
        # The prefix cache over time, for the trace's counter track: (name, engine ns, values), one
        # sample per step that changed its hit rate or cached blocks.
        self.cache_counters: list[tuple[str, int, dict[str, float]]] = []
        self._cache_seen = (-1, -1)

    @property
    def work(self) -> WorkTracker:
        """When the engine had work (a request waiting or in flight): the bubble math's intervals."""
        return self.core.work

    def init_partition(self) -> None:
        """partition_mode: calibrated: measure the stage costs (or read them) and re-split the layers."""
        par = self.config.parallel
        if par.partition_mode != "calibrated" or par.pipeline_parallel_size < 2 or par.layer_partition:
            return
        from ppserve.engine.calibration import calibrated_ranges

        ranges = calibrated_ranges(self)
        if ranges != self.executor.ranges:
            self.executor.repartition(ranges)
            self.scheduler.reset_prefix_cache()  # the new stages' KV is empty

    def init_recovery_state(self) -> None:
        self.recovering = False  # read by other threads (AsyncEngine): True while the pipeline is rebuilt
        self.num_restarts = 0  # pipeline rebuilds that succeeded
        self.last_recovery_s: float | None = None  # failure detected -> pipeline serving again
        self.recovery_times_s: list[float] = []
        self._consecutive_failures = 0  # reset by a step that succeeds; bounded by parallel.max_restarts

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | PromptInput) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (engine/prompter.py)."""
        return self.prompter.tokenize(prompt)

    def render_chat(self, messages: Sequence[Turn] | Sequence[Mapping[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for chat messages, by the chat template (engine/prompter.py)."""
        return self.prompter.render_chat(messages, tools)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's generation_config.json defaults, then `overrides`."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    def add_request(
        self,
        prompt: str | list[int] | PromptInput,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; ValueError (bad input) or OverflowError (queue full)."""
        rids = self.add_choices(prompt, sampling, request_id, arrival_time)
        if len(rids) != 1:
            raise AssertionError("unreachable: add_choices answers n ids")
        return rids[0]

    def add_choices(
        self,
        prompt: str | list[int] | PromptInput,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> list[str]:
        """Queue `sampling.n` requests for one prompt (each its own sequence; see choice_params) and
        return their ids: `request_id` itself when n is 1, else `request_id/i`. All or none are queued."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        if sampling.structured_outputs is not None:
            # Compiled here once (the async engine awaits it off the loop first, so this finds it cached).
            self.grammars.get(sampling.structured_outputs)
        ids = self.tokenize(prompt)
        salt = (prompt.cache_salt or None) if isinstance(prompt, PromptInput) else None
        sampling = self.resolve_max_tokens(len(ids), sampling)
        base = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        choices = choice_params(sampling)
        rids = [base] if len(choices) == 1 else [f"{base}/{i}" for i in range(len(choices))]
        arrival = self.clock() if arrival_time is None else arrival_time
        added: list[str] = []
        try:
            for rid, sp in zip(rids, choices, strict=True):
                req = Request(request_id=rid, prompt_token_ids=list(ids), sampling=sp, arrival_time=arrival,
                              eos_token_ids=self.eos_token_ids, cache_salt=salt)
                self.scheduler.add_request(req)
                added.append(rid)
                detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
                self.tracked[rid] = OutputState(req, detok)
        except Exception:
            for rid in added:  # a queue that fills half-way through the choices takes none of them
                self.abort(rid, FinishReason.CANCELLED)
            raise
        self.work.update(True, time.perf_counter_ns())
        return rids

    def resolve_max_tokens(self, num_prompt_tokens: int, sampling: SamplingParams) -> SamplingParams:
        """The request's sampling with max_tokens set: an unset one (None) is what the context leaves
        after the prompt (within scheduler.max_tokens_limit). ValueError naming the field and the
        limit when max_tokens, prompt + max_tokens or min_tokens is too long."""
        limit = self.config.scheduler.max_tokens_limit or self.max_model_len
        if sampling.max_tokens is None:
            # a full prompt is refused later
            room = max(1, min(limit, self.max_model_len - num_prompt_tokens))
            sampling = dataclasses.replace(sampling, max_tokens=room)
        assert sampling.max_tokens is not None
        if sampling.max_tokens > limit:
            raise ValueError(f"max_tokens {sampling.max_tokens} is above the limit of {limit} "
                             "(scheduler.max_tokens_limit, or the model's context)")
        total = num_prompt_tokens + sampling.max_tokens
        # A prompt that alone fills the context is refused by the scheduler, with its own message.
        if num_prompt_tokens < self.max_model_len and total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({sampling.max_tokens}) "
                             f"is {total} tokens, above the model's context of {self.max_model_len} tokens")
        if sampling.min_tokens > sampling.max_tokens:
            raise ValueError(f"min_tokens ({sampling.min_tokens}) is above max_tokens "
                             f"({sampling.max_tokens}, or what the context leaves after the prompt)")
        return sampling

    def cancel(self, request_id: str) -> bool:
        """Cancel now: KV blocks are freed at once, no token is streamed afterwards."""
        return self.abort(request_id, FinishReason.CANCELLED) is not None

    def abort(self, request_id: str, reason: FinishReason) -> TokenDelta | None:
        """Finish an unfinished request now (cancel, error); its final delta, or None if it is unknown."""
        st = self.tracked.pop(request_id, None)
        self.scheduler.finish_request(request_id, reason)
        if st is None:
            return None
        return TokenDelta(request_id, (), "", (), True, reason.value, st.times())

    def unfinished_ids(self) -> list[str]:
        return list(self.tracked)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, so the next requests compute their prompts whole (as vLLM's
        `reset_prefix_cache`): between benchmark runs that replay the same prompts. Only while no
        request is in the engine (a running request's blocks are not a cache)."""
        if self.has_unfinished:
            raise RuntimeError("reset_prefix_cache needs an idle engine: requests are still running or "
                               "waiting")
        self.scheduler.reset_prefix_cache()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Fill the pipeline, wait for the oldest microbatch, and return what each request gained.

        A stage that died is survived: the pipeline is rebuilt, every unfinished request is recomputed
        from its prompt and the tokens it already has, and this step returns nothing.
        """
        try:
            deltas = self._step()
        except StageFailure as e:
            self.recover(e)
            return []
        self._consecutive_failures = 0
        return deltas

    def _step(self) -> list[TokenDelta]:
        stepped = self.core.step()
        if stepped is None:
            return []
        now, updates = stepped
        self._sample_cache_counters()
        return [d for u in updates if (d := self._process(u, now))]

    def _sample_cache_counters(self) -> None:
        b = self.scheduler.blocks
        seen = (b.num_query_tokens, b.num_cached)
        if seen != self._cache_seen:
            self._cache_seen = seen
            self.cache_counters.append(("prefix cache", time.perf_counter_ns(),
                                        {"hit_rate": b.hit_rate, "cached_blocks": float(b.num_cached)}))

    def recover(self, cause: BaseException) -> None:
        """Rebuild the pipeline and requeue every unfinished request by recompute; PipelineFailed if it
        cannot."""
        rebuild = getattr(self.executor, "rebuild", None)
        limit = self.config.parallel.max_restarts
        t0 = time.perf_counter()
        logger.error("a pipeline stage failed (%s); rebuilding", cause)
        self.recovering = True
        try:
            while True:
                self._consecutive_failures += 1
                if rebuild is None or self._consecutive_failures > limit:
                    raise PipelineFailed(
                        f"a stage failed and the pipeline was not rebuilt after {limit} attempt(s) "
                        f"(parallel.max_restarts={limit}): {cause}"
                    ) from cause
                try:
                    rebuild()
                    break
                except Exception as e:  # the rebuild itself failed: counts as one more failure
                    logger.error("pipeline rebuild attempt %d failed: %s", self._consecutive_failures, e)
                    cause = e
            requeued = self.scheduler.requeue_all_for_recompute()
            self.core.fill_due = None  # a wait for the old pipeline's stage 0
        finally:
            self.recovering = False
        elapsed = time.perf_counter() - t0
        self.num_restarts += 1
        self.last_recovery_s = elapsed
        self.recovery_times_s.append(elapsed)
        logger.warning("pipeline rebuilt in %.2f s (restart %d); %d request(s) requeued for recompute",
                       elapsed, self.num_restarts, len(requeued))

    def _process(self, u: RequestUpdate, now: float) -> TokenDelta | None:
        rid, token_ids, reason = u.request_id, u.new_token_ids, u.finish_reason
        st = self.tracked.get(rid)
        if st is None:
            return None
        logprobs = u.logprobs
        if len(token_ids) > 1 and st.request.sampling.stop:  # speculative decoding: a step of several
            text, hit_stop, used = st.advance_each(token_ids, reason is not None, now)
            if used < len(token_ids):  # the stop string ended before the step's last token
                del st.request.output_token_ids[used - len(token_ids):]
                token_ids, logprobs = token_ids[:used], logprobs[:used]
        else:
            text, hit_stop = st.advance(token_ids, reason is not None, now)
        if hit_stop:
            if reason is None:
                self.scheduler.finish_request(rid, FinishReason.STOP)
            reason = FinishReason.STOP
        times = (now,) * len(token_ids)
        if reason is None:
            return TokenDelta(rid, token_ids, text, times, False, logprobs=logprobs)
        del self.tracked[rid]
        return TokenDelta(rid, token_ids, text, times, True, reason.value, st.times(), logprobs=logprobs,
                          num_cached_tokens=st.request.num_cached_tokens or 0)

    def request_state(self, rid: str) -> OutputState | None:
        return self.tracked.get(rid)

    # ---- observability -------------------------------------------------------------------------
    def reset_observations(self) -> None:
        """Forget the spans and work intervals recorded so far (warm-up, calibration), so what is
        measured next starts clean."""
        self.executor.drain_spans()
        self.core.reset_observations()
        self.cache_counters.clear()

    def collect_spans(self) -> list[Span]:
        spans = [Span.from_dict(d) for d in self.executor.drain_spans()]
        spans.extend(self.core.drain_engine_spans())
        return spans

    def stats(self) -> EngineCounts:
        s = self.scheduler
        spec = s.spec.counters if s.spec is not None else SpecCounters()
        return EngineCounts(
            running=len(s.running),
            waiting=len(s.waiting),
            in_flight_microbatches=len(s.in_flight),
            kv_blocks_used=s.blocks.num_used,
            kv_blocks_total=s.blocks.num_blocks,
            kv_blocks_cached=s.blocks.num_cached,
            prefix_cache_queries=s.blocks.num_query_tokens,
            prefix_cache_hits=s.blocks.num_hit_tokens,
            prefix_cache_hit_rate=s.blocks.hit_rate,
            num_preemptions=s.num_preemptions,
            num_restarts=self.num_restarts,
            last_recovery_s=self.last_recovery_s or 0.0,  # None before the first rebuild
            total_recovery_s=sum(self.recovery_times_s),
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.accepted_per_pos),
            **acceptance_fields(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens),
        )

    def shutdown(self) -> None:
        ex = getattr(self, "executor", None)
        if ex is not None:
            ex.shutdown()
