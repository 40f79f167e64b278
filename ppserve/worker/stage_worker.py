"""One pipeline stage on one TP rank: its model shard, its KV cache, and one microbatch step.

Plain Python class: the in-process executor calls it directly, the Ray executor wraps it in an actor.
It never talks to other stages itself; the caller hands it the incoming hidden states and ships
the outgoing ones. Its memory (KV sizing, the profiling forward, the per-phase figures) is
`worker.memory` (memory.py); its device and dtypes come from devices.py.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ppserve.metrics.spans import SpanRecorder
from ppserve.model.arch import ModelArch
from ppserve.model.attention import allocate_kv_cache
from ppserve.model.backend_select import select_backend
from ppserve.model.loader import iter_weights
from ppserve.model.ops.settings import KernelSettings
from ppserve.model.ops.settings import configure as configure_kernels
from ppserve.model.parallel import TPContext
from ppserve.model.registry import build_stage_model
from ppserve.request import TokenLogprob
from ppserve.sched.cost import StepCost
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.structured.grammars import shared_cache
from ppserve.worker.decode_graphs import DecodeGraphRunner
from ppserve.worker.devices import current_device, kernel_settings_for, resolve_dtype, resolve_kv_dtype
from ppserve.worker.grammar_masks import GrammarMasks
from ppserve.worker.input_batch import InputBatch, ModelInput
from ppserve.worker.memory import GiB, StageMemory
from ppserve.worker.rejection import speculative_sample
from ppserve.worker.sampler import sample
from ppserve.worker.stage_times import StageTimes
from ppserve.worker.startup_cost import measure_startup_cost
from ppserve.worker.step_timer import step_timer_for

logger = logging.getLogger(__name__)

class StageOutput(NamedTuple):
    """One stage's part of one microbatch: hidden states for the next stage, or the last stage's
    sampled tokens. Its seconds come later, from the stage's timer (`StageWorker.times`)."""

    hidden: Tensor | None
    result: StepResult | None


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker needs to build its shard; plain values so it pickles across Ray."""

    model_dir: str
    arch: ModelArch  # the model's description, parsed once by the engine
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    tp_rank: int = 0
    tp_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype
    block_size: int | None = None  # None: the attention backend's preferred_block_size
    attention_backend: str = "auto"
    num_threads: int | None = None
    trace: bool = True
    cuda_graphs: str = "auto"  # auto (capture on CUDA) | off | capture | eager (padded inputs, no capture)
    cuda_graph_max_batch: int = 64
    max_model_len: int | None = None  # sizes the graphs' block tables; None = max_position_embeddings
    kernels: KernelSettings = KernelSettings()  # which CPU kernels this process may use
    profile_tokens: int = 512  # the largest microbatch (scheduler.token_budget): what the memory profile runs
    profile_seqs: int = 256  # sequences it may hold (scheduler.max_num_seqs): rows of logits and sampling
    gpus: float = 0.0  # GPUs Ray gave this actor (its device comes from that assignment: worker/devices.py)
    stage_link: str = "auto"  # parallel.stage_link: how hidden states reach the next stage (comm/)
    token_ring: bool = False  # scheduler.token_ring at pp > 1: sampled tokens go straight back to stage 0


class StageWorker:
    def __init__(self, spec: StageSpec, tp: TPContext | None = None) -> None:
        self.spec = spec
        self.device = current_device()
        configure_kernels(kernel_settings_for(spec.kernels, self.device))  # before anything asks for a kernel
        self.init_threads()
        self.arch = spec.arch
        self.dtype = resolve_dtype(spec.dtype, spec.arch, self.device)  # worker/devices.py
        self.kv_dtype = resolve_kv_dtype(spec.kv_cache_dtype, self.dtype)
        self.tp = tp if tp is not None else TPContext()
        self.recorder = SpanRecorder(stage=spec.stage, tp_rank=spec.tp_rank, enabled=spec.trace)
        self.init_model()
        # Its steps' seconds and compute spans (CUDA events read a step late on a GPU), relayed down the
        # pipeline.
        self.timer = step_timer_for(self.device.type, self.recorder)
        self.times = StageTimes(self.timer, first=spec.stage == 0, relays=spec.tp_rank == 0)
        # The KV block size: cache.block_size, else the one the attention backend reads in place.
        self.block_size = spec.block_size or self.model.attn_backend.preferred_block_size
        self.batch = InputBatch(self.block_size, self.device)
        # Structured outputs: the sampling rank of the last stage masks the logits (grammar_masks.py).
        self.grammar = None
        if self.model.is_last and spec.tp_rank == 0:
            cache = shared_cache(spec.model_dir, self.arch.vocab_size, self.arch.eos_token_ids)
            self.grammar = GrammarMasks(cache, self.recorder)
        self.kv_caches: list[Tensor] = []
        self.startup_cost: StepCost | None = None  # timed once the KV cache exists (init_cache)
        self.graphs: DecodeGraphRunner | None = None
        # KV sizing, the memory profile and the per-phase memory figures (worker/memory.py).
        self.memory = StageMemory(self.model, self.arch, block_size=self.block_size, dtype=self.dtype,
                                  kv_dtype=self.kv_dtype, device=self.device,
                                  profile_tokens=spec.profile_tokens, profile_seqs=spec.profile_seqs,
                                  stage=spec.stage, tp_rank=spec.tp_rank, max_model_len=spec.max_model_len)
        self.memory_log = self.memory.log  # the same list: the GPU check reads it from the worker
        self.memory.note("weights loaded")

    def init_threads(self) -> None:
        """torch intra-op threads = the cores given to this worker: `num_threads` when set (Ray actors get
        their CPU share), else every core this process may run on (its affinity mask, not the machine's)."""
        threads = self.spec.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        logger.info("stage %d tp %d: %d torch threads", self.spec.stage, self.spec.tp_rank, threads)

    def init_model(self) -> None:
        spec = self.spec
        backend = select_backend(self.device, spec.attention_backend)
        self.model = build_stage_model(self.arch, spec.layer_start, spec.layer_end, self.tp, self.dtype,
                                       self.device, backend)
        self.model.load_weights(
            iter_weights(
                Path(spec.model_dir),
                spec.layer_start,
                spec.layer_end,
                self.arch.num_layers,
                need_embed=self.model.is_first or (self.model.is_last and self.arch.tie_word_embeddings),
                need_head=self.model.is_last,
            )
        )
        self.model.eval()
        logger.info(
            "stage %d/%d tp %d/%d: layers [%d, %d) dtype %s on %s (pid %d)",
            spec.stage, spec.num_stages, spec.tp_rank, spec.tp_size, spec.layer_start, spec.layer_end,
            self.dtype, self.device, os.getpid(),
        )

    # ---- KV cache ------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def graphs_mode(self) -> str:
        """'capture', 'eager' or 'off' for decode-only microbatches (see decode_graphs.py)."""
        mode = self.spec.cuda_graphs
        if mode == "auto":
            # A model that syncs with the host in its forward (MoE layers without the Triton kernel) opts out.
            return "capture" if self.device.type == "cuda" and self.model.capturable else "off"
        if mode == "capture" and self.device.type != "cuda":
            raise ValueError("model.cuda_graphs=capture needs a CUDA device")
        if mode != "off" and not self.model.capturable:
            raise ValueError(f"model.cuda_graphs={mode}: this model's MoE layers run the grouped expert path "
                             "here, which reads per-expert token counts back to the host; graphs need the "
                             "Triton MoE kernel (CUDA with triton), or set model.cuda_graphs=off")
        return mode

    def init_cache(self, num_blocks: int) -> None:
        """`num_blocks` for the block manager, plus one pad block (the last) when decode graphs are on;
        then the warm-up and the timing of this stage's step cost (`startup_cost`, worker/startup_cost.py)."""
        mode = self.graphs_mode()
        pad = 0 if mode == "off" else 1
        self.kv_caches = allocate_kv_cache(
            self.model.num_local_layers, num_blocks + pad, self.block_size, self.model.num_kv_heads_local,
            self.arch.head_dim, self.kv_dtype, self.device,
        )
        self.graphs = None
        if pad:
            max_len = self.spec.max_model_len or self.arch.max_position_embeddings
            self.graphs = DecodeGraphRunner(
                self.model, self.kv_caches, block_size=self.block_size,
                max_batch=self.spec.cuda_graph_max_batch, max_blocks=-(-max_len // self.block_size),
                pad_block=num_blocks, dtype=self.dtype, device=self.device, capture=mode == "capture",
                paged_in_place=self.model.attn_backend.reads_cache_in_place(self.block_size),
            )
        logger.info("stage %d tp %d: KV cache of %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
                    self.spec.stage, self.spec.tp_rank, num_blocks, self.block_size,
                    num_blocks * self.block_size, num_blocks * self.memory.kv_bytes_per_block() / GiB,
                    self.kv_dtype)
        self.memory.note("KV cache allocated", kv_blocks=num_blocks, kv_tokens=num_blocks * self.block_size,
                         kv_gib=num_blocks * self.memory.kv_bytes_per_block() / GiB)
        if not self.memory.decode_warm:  # after a GPU profile too: its decode and chunk paths are still cold
            self.memory.note("warmed up", warm_up_s=self.memory.warm_up(self.kv_caches))
        t0 = time.perf_counter()
        self.startup_cost = measure_startup_cost(self.memory, self.kv_caches)  # the scheduler's prior
        self.memory.note("step cost timed", timing_s=time.perf_counter() - t0,
                         floor_ms=self.startup_cost.floor_s * 1e3, token_us=self.startup_cost.token_s * 1e6)
        if self.graphs is not None and mode == "capture":
            # before serving: a capture while serving would stall the pipeline
            seconds = self.graphs.capture_all()
            self.memory.note("decode graphs captured", capture_s=seconds, graphs=len(self.graphs.graphs))

    # ---- one microbatch ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, out: SchedulerOutput, ring_tokens: Tensor | None = None) -> ModelInput:
        """Apply the microbatch's diff and build its input tensors (a `prepare` span). It needs nothing
        from the previous stage, so the actor runs it before waiting for the hidden states: the host
        work of step k overlaps the previous stage's compute of step k instead of following it.
        `ring_tokens`: stage 0's input tokens for the microbatch's ring decodes (the token ring), on the
        device, in `out.ring_request_ids` order."""
        start = time.perf_counter_ns()
        try:
            self.batch.apply(out, ring_tokens)
            inp = self.batch.prepare(out)
            if self.grammar is not None:
                self.grammar.track(out)
                inp.mask = self.grammar.fill(inp.sample_request_ids, inp.sample_states, out.step_id)
        finally:
            end = time.perf_counter_ns()
            self.recorder.record("prepare", start, end, out.step_id)
        inp.prepare_s = (end - start) * 1e-9
        return inp

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hidden_in: Tensor | None = None,
                inp: ModelInput | None = None) -> StageOutput:
        """Run this stage's layers for one microbatch (`inp` from `prepare`, or prepared now). The last
        stage samples (a StepResult of tokens); other stages hand back the hidden states [T, H] for the
        next stage. The stage's timer measures the step for the scheduler's cost model: its prepare span
        (host work the bubble math counts as busy, ARCHITECTURE.md#measuring-bubbles) plus its layers'
        compute (CUDA events on a GPU, read a step or more later without waiting: worker/step_timer.py), the
        last stage's LM head included: it is the stage's compute as its layers are, and the step-cost model
        prices it per sampled token (left out, a calibration would misprice the last stage). Sampling is
        outside that figure: it follows the logits and is not the stage's compute."""
        if inp is None:
            inp = self.prepare(out)
        timer = self.timer
        timer.begin(out.step_id)
        try:
            hidden = self._forward(inp, hidden_in)
            logits = self._logits(inp, hidden) if self.model.is_last else None
            timer.end_compute()
            result = self._sample(out, inp, logits) if self.model.is_last else None
        finally:
            timer.finish(inp.prepare_s, num_prefill_tokens=out.num_prefill_tokens,
                         num_decode_tokens=out.num_decode_tokens, request_ids=out.order,
                         num_draft_tokens=out.num_draft_tokens)
        return StageOutput(None if self.model.is_last else hidden, result)

    def _forward(self, inp: ModelInput, hidden_in: Tensor | None) -> Tensor:
        if self.graphs is not None and self.graphs.applies(inp.meta):
            return self.graphs.run(inp.input_ids, hidden_in, inp.positions, inp.meta)
        hidden: Tensor = self.model(
            inp.input_ids if self.model.is_first else None,
            None if self.model.is_first else hidden_in,
            inp.positions, self.kv_caches, inp.meta,
        )
        return hidden

    def _logits(self, inp: ModelInput, hidden: Tensor) -> Tensor | None:
        """The LM head over the rows that get a token (None where none does, or on a TP rank that does
        not sample)."""
        if not inp.sample_request_ids:
            return None
        logits: Tensor | None = self.model.logits_for_sampling(hidden.index_select(0, inp.logits_indices))
        return logits

    def _sample(self, out: SchedulerOutput, inp: ModelInput, logits: Tensor | None) -> StepResult:
        if inp.sample_drafts and logits is not None:
            return self._verify(out, inp, logits)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        mask_s = 0.0
        if logits is not None:  # TP rank 0 samples for the stage; the scheduler tells every rank the tokens
            states = inp.sample_states
            params = [st.sampling for st in states]
            shortcut: list[int] | None = None
            if inp.mask is not None:
                assert self.grammar is not None
                shortcut = self.grammar.greedy_tokens(logits, inp.mask, params)
                if shortcut is None:
                    # Before penalties and sampling: log-probabilities are those of the constrained
                    # distribution.
                    self.grammar.apply(logits, inp.mask)
            lps: list[TokenLogprob | None]
            if shortcut is not None:
                tokens, lps = shortcut, [None] * len(states)
            else:
                tokens, lps = sample(logits, params,
                                     [len(st.token_ids) - st.num_prompt_tokens for st in states],
                                     histories=[(st.token_ids, st.num_prompt_tokens) for st in states],
                                     stop_ids=self.arch.eos_token_ids)
            sampled = dict(zip(inp.sample_request_ids, tokens, strict=True))
            for st, token in zip(states, tokens, strict=True):
                # the token ring: this stage's input token for the request's next decode
                st.last_sampled = token
            if self.grammar is not None:
                if inp.mask is not None:
                    self.grammar.accept(inp.sample_request_ids, tokens)
                mask_s, self.grammar.mask_s = self.grammar.mask_s, 0.0
            logprobs = {rid: lp for rid, lp in zip(inp.sample_request_ids, lps, strict=True)
                        if lp is not None}
        return StepResult(out.step_id, sampled, logprobs=logprobs, grammar_mask_s=mask_s)

    def _verify(self, out: SchedulerOutput, inp: ModelInput, logits: Tensor) -> StepResult:
        """A step with drafts (speculative decoding): each speculating request has 1 + drafts rows of
        logits, verified so its output keeps the target distribution exactly (worker/rejection.py); a
        request under a grammar has one row, masked as without drafts."""
        states, rids, drafts = inp.sample_states, inp.sample_request_ids, inp.sample_drafts
        mask_s = 0.0
        if inp.mask is not None:
            assert self.grammar is not None
            self.grammar.apply(logits, inp.mask.expanded([len(d) + 1 for d in drafts]))
        emitted, lps = speculative_sample(
            logits, [st.sampling for st in states], drafts,
            [len(st.token_ids) - st.num_prompt_tokens for st in states],
            histories=[(st.token_ids, st.num_prompt_tokens) for st in states],
            stop_ids=self.arch.eos_token_ids)
        sampled: dict[str, int] = {}
        accepted: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        draft_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        for rid, st, d, toks, lp in zip(rids, states, drafts, emitted, lps, strict=True):
            sampled[rid] = st.last_sampled = toks[-1]
            if d:
                accepted[rid] = len(toks) - 1
            if lp is not None:
                logprobs[rid] = lp[-1]
                if d:
                    draft_logprobs[rid] = tuple(lp[:-1])
        if self.grammar is not None:
            if inp.mask is not None:
                self.grammar.accept(rids, [toks[-1] for toks in emitted])
            mask_s, self.grammar.mask_s = self.grammar.mask_s, 0.0
        return StepResult(out.step_id, sampled, logprobs=logprobs, grammar_mask_s=mask_s,
                          num_accepted=accepted, draft_logprobs=draft_logprobs)

    def drain_spans(self) -> list[dict[str, Any]]:
        self.timer.poll()  # the compute spans of steps the device has finished since the last step (no wait)
        return [s.to_dict() for s in self.recorder.drain()]

    def release(self) -> None:
        """Drop the KV cache, the decode graphs and the input batch's records (shutdown): what this stage
        holds beyond its weights, given back even while something still refers to the worker."""
        self.kv_caches = []
        self.graphs = None
        self.batch = InputBatch(self.block_size, self.device)

