"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from ppserve.config import EngineConfig, load_config
from ppserve.engine.llm_engine import LLMEngine
from ppserve.engine.messages import ChatTurn, PromptInput
from ppserve.metrics.bubbles import BubbleReport, bubble_report
from ppserve.metrics.spans import Span
from ppserve.metrics.trace import save_chrome_trace
from ppserve.request import RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Prompt: TypeAlias = "str | list[int] | PromptInput"  # one prompt: text, token ids, or chat messages
# Chat messages, each {"role", "content"} (an assistant turn may add tool_calls, a tool turn tool_call_id)
Conversation: TypeAlias = "list[dict[str, Any]]"

# Keyword arguments of LLM(...) and the config field each sets.
_SHORTCUTS = {
    "model": ("model", "model"),
    "dtype": ("model", "dtype"),
    "quantization": ("model", "quantization"),
    "attention_backend": ("model", "attention_backend"),
    "cuda_graphs": ("model", "cuda_graphs"),
    "cuda_graph_max_batch": ("model", "cuda_graph_max_batch"),
    "cache_dir": ("model", "cache_dir"),
    "max_model_len": ("model", "max_model_len"),
    "token_budget": ("scheduler", "token_budget"),
    "policy": ("scheduler", "policy"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "layer_partition": ("parallel", "layer_partition"),
    "partition_mode": ("parallel", "partition_mode"),
    "ray_address": ("parallel", "ray_address"),
    "executor": ("parallel", "executor"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "kv_cache_dtype": ("cache", "dtype"),
    "kv_cache_memory": ("cache", "kv_cache_memory"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "trace": ("trace", "enabled"),
}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | str | Path | None = None,
        overrides: list[str] | tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        kwargs["model"] = model
        extra: dict[str, dict[str, Any]] = {}
        for key, value in kwargs.items():
            if key == "speculative_config":  # vLLM's spelling: the whole `speculative` section as a dict
                if value is not None:
                    if not isinstance(value, dict):
                        raise TypeError(f"speculative_config must be a dict, got {value!r}")
                    extra["speculative"] = dict(value)
                continue
            if key not in _SHORTCUTS:
                raise TypeError(f"LLM() got an unexpected keyword {key!r}; known: "
                                f"{sorted([*_SHORTCUTS, 'speculative_config'])}")
            if value is None and key == "model":
                continue
            section, name = _SHORTCUTS[key]
            extra.setdefault(section, {})[name] = value
        if isinstance(config, EngineConfig):
            if extra or overrides:
                raise ValueError("pass either a built EngineConfig or keyword overrides, not both")
            self.config = config
        else:
            self.config = load_config(config, overrides, extra)
        self.engine = LLMEngine(self.config)
        self._spans: list[Span] = []

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.engine.tokenizer

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, then `overrides`."""
        return self.engine.default_sampling_params(**overrides)

    def generate(
        self,
        prompts: Prompt | list[str] | list[list[int]] | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order, a prompt's n choices
        (SamplingParams.n) one after another with their `index`. Without sampling_params, the model's
        generation_config.json defaults apply (default_sampling_params())."""
        # One prompt or a list of them. A list of prompts is told from one prompt of token ids by its first
        # item, which narrows `prompts` in the first branch but not in the second: hence the cast there.
        plist: list[Prompt]
        if isinstance(prompts, (str, PromptInput)) or (isinstance(prompts, list) and prompts
                                                        and isinstance(prompts[0], int)):
            plist = [prompts]
        else:
            plist = list(cast("list[Prompt]", prompts))
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(plist):
                raise ValueError(f"{len(sampling_params)} SamplingParams for {len(plist)} prompts")
            sps = sampling_params
        else:
            sps = [sampling_params or self.default_sampling_params()] * len(plist)
        eng = self.engine
        ids: list[str] = []
        index: dict[str, int] = {}  # a request's place among its prompt's choices
        try:
            for p, sp in zip(plist, sps, strict=True):
                choices = eng.add_choices(p, sp)
                ids.extend(choices)
                index.update((rid, i) for i, rid in enumerate(choices))
        except Exception:
            for rid in ids:  # bad input loses nothing else: withdraw what this call queued
                eng.cancel(rid)
            raise
        states = {rid: eng.request_state(rid) for rid in ids}
        text = dict.fromkeys(ids, "")
        reason: dict[str, str | None] = dict.fromkeys(ids)
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for d in eng.step():
                if d.request_id in text:
                    text[d.request_id] += d.text
                    logprobs[d.request_id].extend(d.logprobs)
                    if d.finished:
                        reason[d.request_id] = d.finish_reason
                        pending.discard(d.request_id)
            if not eng.has_unfinished and pending:
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        outs = []
        for rid in ids:
            tr = states[rid]
            assert tr is not None
            req = tr.request
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=list(req.prompt_token_ids),
                    token_ids=list(req.output_token_ids),
                    text=text[rid],
                    finish_reason=reason[rid],
                    arrival_time=req.arrival_time,
                    first_scheduled_time=req.first_scheduled_time,
                    token_times=list(tr.token_times),
                    index=index[rid],
                    logprobs=(logprobs[rid][: len(req.output_token_ids)]
                              if req.sampling.logprobs is not None else None),
                    num_cached_tokens=req.num_cached_tokens or 0,
                )
            )
        return outs

    def chat(
        self,
        conversations: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Complete chat conversations (lists of OpenAI-style messages), rendered by the model's chat
        template. `tools` and `tool_choice` are OpenAI's: the tools go into the prompt and, unless the
        choice is "none", calls are constrained to the Hermes format, which
        ppserve.structured.tool_parser.parse_tool_calls reads back from each output's text."""
        from ppserve.structured.tools import plan_tools

        # One conversation or a list of them, told apart by the first item (which narrows only the first
        # branch: hence the cast in the second).
        convs = ([conversations] if conversations and isinstance(conversations[0], dict)
                 else cast("list[Conversation]", conversations))
        plan = plan_tools(tools, tool_choice, parallel_tool_calls)
        if plan.constraint is not None:  # the tool call's constraint rides on each request's sampling
            if isinstance(sampling_params, list):
                sampling_params = [dataclasses.replace(sp, structured_outputs=plan.constraint)
                                   for sp in sampling_params]
            else:
                sampling_params = dataclasses.replace(sampling_params or self.default_sampling_params(),
                                                      structured_outputs=plan.constraint)
        prompts = [PromptInput(messages=tuple(ChatTurn.from_dict(m) for m in conv), tools=plan.tools)
                   for conv in convs]
        return self.generate(prompts, sampling_params)

    # ---- bubbles and traces ------------------------------------------------------------------
    def spans(self) -> list[Span]:
        self._spans.extend(self.engine.collect_spans())
        return list(self._spans)

    def work_intervals(self) -> list[tuple[int, int]]:
        import time

        return self.engine.work.intervals(time.perf_counter_ns())

    def bubble_stats(self, window: str | tuple[int, int] = "active") -> BubbleReport:
        return bubble_report(self.spans(), self.work_intervals(), window=window)

    def save_trace(self, path: str | Path) -> Path:
        path = Path(path)
        save_chrome_trace(path, self.spans(), work_intervals=self.work_intervals(),
                          counters=self.engine.cache_counters)
        return path

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (between generate calls; see LLMEngine.reset_prefix_cache)."""
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
