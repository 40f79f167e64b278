"""The one place where a SchedulerOutput becomes tensors.

Each stage keeps a small per-request record (tokens, block table, sampling) built from the first
full message and updated by diffs, so later microbatches carry only new block ids and new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ppserve.model.attention import AttentionMetadata
from ppserve.request import SamplingParams
from ppserve.sched.output import SchedulerOutput


@dataclass
class CachedRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams


@dataclass
class ModelInput:
    input_ids: Tensor  # [T] int64 (used by the first stage only)
    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: Tensor  # [N] int64: flat token index of each request whose next token is due
    sample_request_ids: list[str] = field(default_factory=list)
    sample_states: list[CachedRequestState] = field(default_factory=list)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, out: SchedulerOutput) -> None:
        """Bring the per-request records up to date with one SchedulerOutput (releases first)."""
        for rid in out.released_request_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
            )
        for diff in out.cached_requests:
            st = self.requests[diff.request_id]
            st.token_ids.extend(diff.new_token_ids)
            st.block_ids.extend(diff.new_block_ids)
            st.num_computed_tokens = diff.num_computed_tokens

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the microbatch: token ids, positions, attention metadata, where logits are due."""
        ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        due = set(out.sample_request_ids)
        logits_idx: list[int] = []
        sample_ids: list[str] = []
        for rid, n, start in zip(out.order, out.num_scheduled_tokens, out.num_computed_tokens, strict=True):
            st = self.requests[rid]
            ids.extend(st.token_ids[start : start + n])
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(st.block_ids)
            st.num_computed_tokens = start + n
            if rid in due:
                logits_idx.append(len(ids) - 1)
                sample_ids.append(rid)
        positions = [p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)]
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device)
        dev = self.device
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            sample_request_ids=sample_ids,
            sample_states=[self.requests[r] for r in sample_ids],
        )
