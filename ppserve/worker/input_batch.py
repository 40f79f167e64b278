"""The one place where a SchedulerOutput becomes tensors.

Each stage keeps a small per-request record (tokens, block table, sampling) built from the first
full message and updated by diffs, so later microbatches carry only new block ids and new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ppserve.model.attention import AttentionMetadata, decode_indices
from ppserve.request import SamplingParams
from ppserve.sched.output import SchedulerOutput
from ppserve.worker.staging import StepStaging


@dataclass
class CachedRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    last_sampled: int | None = None  # the last stage's latest token for it (its input on the token ring)


# A ring decode's input token on a stage that neither embeds it (stage 0 gets it from the ring) nor
# sampled it (the last stage's TP rank 0 did): never read there, and an invalid id if it ever were.
UNKNOWN_TOKEN = -1


@dataclass
class ModelInput:
    input_ids: Tensor  # [T] int64 (used by the first stage only)
    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: Tensor  # [N] int64: flat token index of each request whose next token is due
    sample_request_ids: list[str] = field(default_factory=list)
    sample_states: list[CachedRequestState] = field(default_factory=list)
    # aligned with sample_request_ids: each one's draft tokens (speculative decoding; its logits rows are
    # 1 + drafts, consecutive), all empty when the step has none
    sample_drafts: list[tuple[int, ...]] = field(default_factory=list)
    prepare_s: float = 0.0  # host seconds building this input (the stage's `prepare` span)
    mask: Any = None  # the last stage's grammar masks for the sampled rows (worker/grammar_masks.py StepMask)


class DeviceBlockTables:
    """Every live request's block table as a row of one persistent device tensor, changed only by the
    entries a step adds (`diff`), never rebuilt from Python lists. Rows and columns grow on demand."""

    def __init__(self, device: torch.device | str, rows: int = 64, width: int = 16) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def assign(self, rid: str) -> int:
        if rid in self.row_of:
            return self.row_of[rid]
        if not self._free:
            rows = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        self.row_of[rid] = row = self._free.pop()
        return row

    def release(self, rid: str) -> None:
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.table[row].zero_()  # padding reads as block 0, as in a table built from lists (no sync)
            self._free.append(row)

    def fit_width(self, width: int) -> None:
        if width > self.table.shape[1]:
            grown = torch.zeros(self.table.shape[0], max(width, 2 * self.table.shape[1]), dtype=torch.int64,
                                device=self.table.device)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def apply(self, flat_index: Tensor, values: Tensor) -> None:
        """Write `values` at `flat_index` (row * width + column), on the device."""
        if flat_index.numel():
            self.table.view(-1).index_copy_(0, flat_index, values)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.tables = DeviceBlockTables(device)
        self.staging = StepStaging(torch.device(device))
        # Block-table entries not yet on the device: (request id, first new column), per apply().
        self._table_diff: list[tuple[str, int]] = []
        # Tables cut since the last step (rejected drafts' tail): request id -> its width before, whose
        # columns past the table's end are zeroed, as padding reads.
        self._table_cut: dict[str, int] = {}
        self._ring_tokens: Tensor | None = None  # stage 0: this step's ring decodes' input ids, on the device

    def apply(self, out: SchedulerOutput, ring_tokens: Tensor | None = None) -> None:
        """Bring the per-request records up to date with one SchedulerOutput (releases first). A ring
        decode's input token is in no diff. On stage 0 it came over the ring and stays on the device
        (`ring_tokens`, one per `out.ring_request_ids`, written into the step's input ids by `prepare`:
        reading it to the host would wait for the last stage); the last stage sampled it itself; the
        stages between read only positions and block tables. Both of the others record it as unknown."""
        for rid in out.released_request_ids:
            self.requests.pop(rid, None)
            self.tables.release(rid)
        for new in out.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
            )
            self.tables.assign(new.request_id)
            self._table_diff.append((new.request_id, 0))  # a new (or recomputed) request: its whole table
        for diff in out.cached_requests:
            st = self.requests[diff.request_id]
            st.token_ids.extend(diff.new_token_ids)
            if diff.num_blocks_kept >= 0:  # a tail only rejected drafts wrote, given back
                self._table_cut[diff.request_id] = max(len(st.block_ids),
                                                       self._table_cut.get(diff.request_id, 0))
                del st.block_ids[diff.num_blocks_kept:]
            if diff.new_block_ids:
                self._table_diff.append((diff.request_id, len(st.block_ids)))
            st.block_ids.extend(diff.new_block_ids)
            st.num_computed_tokens = diff.num_computed_tokens
        for rid in out.ring_request_ids:
            st = self.requests[rid]
            token = None if ring_tokens is not None else st.last_sampled
            st.token_ids.append(UNKNOWN_TOKEN if token is None else token)
        self._ring_tokens = ring_tokens

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the microbatch: token ids, positions, attention metadata, where logits are due; every
        integer the device needs goes over in one copy (staging.py), the block tables by their diff."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        rows: list[int] = []
        due = set(out.sample_request_ids)
        ring = set(out.ring_request_ids) if self._ring_tokens is not None else set()
        ring_at: dict[str, int] = {}  # a ring decode's flat index in the step's input ids
        logits_idx: list[int] = []
        sample_ids: list[str] = []
        drafts = out.draft_token_ids
        width = 0
        for rid, n, start in zip(out.order, out.num_scheduled_tokens, out.num_computed_tokens, strict=True):
            st = self.requests[rid]
            end = start + n
            table = st.block_ids
            if len(table) * bs < end:
                raise ValueError(f"request {rid}: {len(table)} blocks of {bs} cannot hold {end} tokens")
            if n == 1:  # a decode, most rows of a busy microbatch: no generators, no slices
                if rid in ring:
                    ring_at[rid] = len(ids)
                ids.append(st.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            elif drafts and rid in drafts:  # its input token, then its drafts: every position gets logits
                ids.append(st.token_ids[start])
                ids.extend(drafts[rid])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                logits_idx.extend(range(len(ids) - n, len(ids) - 1))
            else:
                ids.extend(st.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            rows.append(self.tables.row_of[rid])
            width = max(width, len(table))
            st.num_computed_tokens = end
            if rid in due:
                logits_idx.append(len(ids) - 1)
                sample_ids.append(rid)
        self.tables.fit_width(width)
        diff_index, diff_values = self._drain_table_diff()
        decodes = decode_indices(query_lens)
        cu, cu_ctx = [0], [0]
        for q, c in zip(query_lens, context_lens, strict=True):
            cu.append(cu[-1] + q)
            cu_ctx.append(cu_ctx[-1] + c)
        ring_index = [ring_at[rid] for rid in out.ring_request_ids] if ring else []
        (ids_t, pos_t, slots_t, logits_t, rows_t, dec_t, dec_tok_t, dec_ctx_t, cu_t, cu_ctx_t, diff_i,
         diff_v, ring_i) = self.staging.upload([ids, positions, slots, logits_idx, rows, decodes,
                                                [cu[i] for i in decodes], [context_lens[i] for i in decodes],
                                                cu, cu_ctx, diff_index, diff_values, ring_index])
        self.tables.apply(diff_i, diff_v)
        if ring_index:
            assert self._ring_tokens is not None
            ids_t.index_copy_(0, ring_i, self._ring_tokens)  # on the device: the host never reads them
        self._ring_tokens = None
        meta = AttentionMetadata.from_device(
            query_lens, context_lens, bs, slot_mapping=slots_t,
            block_tables=self.tables.table.index_select(0, rows_t)[:, :width], decode_index=dec_t,
            decode_token_idx=dec_tok_t, decode_context_lens=dec_ctx_t, cu_query_lens_t=cu_t.to(torch.int32),
            cu_context_lens_t=cu_ctx_t.to(torch.int32),
        )
        return ModelInput(
            input_ids=ids_t, positions=pos_t, meta=meta, logits_indices=logits_t,
            sample_request_ids=sample_ids, sample_states=[self.requests[r] for r in sample_ids],
            sample_drafts=[drafts.get(r, ()) for r in sample_ids] if drafts else [],
        )

    def _drain_table_diff(self) -> tuple[list[int], list[int]]:
        """The flat (row * width + column) positions and block ids of every table entry added since the
        last step, for requests still live."""
        live = [(self.tables.row_of[rid], first, self.requests[rid].block_ids)
                for rid, first in self._table_diff
                if rid in self.requests and rid in self.tables.row_of]
        self._table_diff.clear()
        self.tables.fit_width(max((len(blocks) for _, _, blocks in live), default=0))  # before any index
        width = self.tables.table.shape[1]
        index: list[int] = []
        values: list[int] = []
        for row, first, blocks in live:
            index.extend(range(row * width + first, row * width + len(blocks)))
            values.extend(blocks[first:])
        for rid, before in self._table_cut.items():
            st = self.requests.get(rid)
            if st is not None and rid in self.tables.row_of and before > len(st.block_ids):
                row = self.tables.row_of[rid]
                index.extend(range(row * width + len(st.block_ids), row * width + before))
                values.extend([0] * (before - len(st.block_ids)))
        self._table_cut.clear()
        return index, values
