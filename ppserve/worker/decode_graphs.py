"""Decode-only microbatches replayed from CUDA graphs.

A decode step of a small model is dominated by kernel launches, not by the GPU's work: every layer
launches a dozen kernels for a handful of tokens. The runner captures the stage's whole forward pass once
per (padded batch size, block-table width) and replays it with the step's inputs copied into static
buffers, so one launch replaces hundreds.

Padding: a microbatch of n decodes runs as the next captured size b >= n. The b - n padding rows are
decodes of token 0 at position 0 whose K/V go to a pad block: one extra KV block the stage allocates and
the block manager never hands out. Their outputs are dropped. Tables are padded to a power-of-two width
with the pad block (never read: beyond each sequence's context length).

`capture=False` runs the same padded static buffers eagerly. It is what a graph replays, minus the
graph, so the padding and buffer handling are checked on machines without a GPU. Every graph is captured
at start-up (`capture_all`, its time logged), not while serving; the captured region runs under
`no_host_transfers`, and the metadata it reads is built from buffers allocated once.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ppserve.model.attention import AttentionMetadata
from ppserve.model.stage_model import StageModel
from ppserve.worker.capture_guard import no_host_transfers

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch (what decode batches round up to)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def round_up_to(value: int, sizes: list[int]) -> int | None:
    """The smallest size >= value, or None when value exceeds them all."""
    return next((s for s in sizes if s >= value), None)


def table_widths(max_blocks: int) -> list[int]:
    """Block-table widths graphs are captured for: powers of two, capped at max_blocks. Decode attention
    without a paged kernel gathers the whole width, so a width far beyond the longest context costs."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    widths.append(max_blocks)
    return widths


class DecodeGraphRunner:
    """Runs decode-only microbatches of at most `max_batch` sequences through padded static buffers,
    captured as CUDA graphs when `capture` is set."""

    def __init__(self, model: StageModel, kv_caches: list[Tensor], *, block_size: int, max_batch: int,
                 max_blocks: int, pad_block: int, dtype: torch.dtype, device: torch.device, capture: bool,
                 paged_in_place: bool = False) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.pad_block = pad_block
        self.capture = capture
        self.batch_sizes = graph_batch_sizes(max_batch)
        # A backend that reads the paged cache in place costs the same at any table width: one width
        # (the widest) serves every batch. Others gather the whole width, so narrower tables pay off.
        self.widths = [max_blocks] if paged_in_place else table_widths(max_blocks)
        i64 = torch.int64
        # Static inputs. Graphs read these addresses on every replay: never reallocate them.
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.hidden = torch.zeros(max_batch, model.arch.hidden_size, dtype=dtype, device=device)
        self.slot_mapping = torch.full((max_batch,), pad_block * block_size, dtype=i64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=i64, device=device)
        self.block_tables = torch.full((max_batch, max_blocks), pad_block, dtype=i64, device=device)
        # The metadata's derived tensors, fixed by the shape alone: built here once, sliced per graph, so
        # nothing in the captured region copies host data (see capture_guard.py).
        self.cu_query_lens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.token_idx = torch.arange(max_batch, dtype=i64, device=device)
        self.cu_context_lens = {w: torch.arange(0, (max_batch + 1) * w * block_size, w * block_size,
                                                dtype=torch.int32, device=device) for w in self.widths}
        # (batch, width) -> (graph, its output)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_runs = 0  # microbatches run through the static buffers (replays, when capturing)

    def applies(self, meta: AttentionMetadata) -> bool:
        """Decode-only, small enough, and every table fits the static buffer."""
        return (not meta.prefill_seqs and 0 < meta.num_seqs <= self.max_batch
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: Tensor, hidden_in: Tensor | None, positions: Tensor,
            meta: AttentionMetadata) -> Tensor:
        """The stage's output [n, H] for a decode-only microbatch of n sequences (a fresh tensor: the
        graph's output buffer is overwritten by the next replay, while a send may still read this one)."""
        n = meta.num_seqs
        batch = round_up_to(n, self.batch_sizes)
        width = round_up_to(max(1, meta.decode_block_tables.shape[1]), self.widths)
        assert batch is not None and width is not None, "run() called for a batch applies() rejects"
        self._fill(n, batch, width, input_ids, hidden_in, positions, meta)
        self.num_runs += 1
        if not self.capture:
            return self._forward(batch, width)[:n].clone()
        key = (batch, width)
        if key not in self.graphs:  # capture_all() took every shape at start-up; this is a fallback
            logger.warning("decode graph (batch %d, width %d) captured while serving", batch, width)
            self.graphs[key] = self._capture(batch, width)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n].clone()

    def _fill(self, n: int, batch: int, width: int, input_ids: Tensor, hidden_in: Tensor | None,
              positions: Tensor, meta: AttentionMetadata) -> None:
        """Copy the step's inputs into the static buffers; padding rows decode into the pad block."""
        if self.model.is_first:
            self.input_ids[:n].copy_(input_ids)
            self.input_ids[n:batch].zero_()
        else:
            assert hidden_in is not None
            self.hidden[:n].copy_(hidden_in)
            self.hidden[n:batch].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:batch].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch].fill_(self.pad_block * self.block_size)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:batch].fill_(1)
        used = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :used].copy_(meta.decode_block_tables)
        self.block_tables[:n, used:width].fill_(self.pad_block)
        self.block_tables[n:batch, :width].fill_(self.pad_block)

    def capture_all(self) -> float:
        """Capture every (batch size, table width) graph now, before serving; returns the seconds it took."""
        t0 = time.perf_counter()
        for width in self.widths:
            for batch in self.batch_sizes:
                if (batch, width) not in self.graphs:
                    self.graphs[(batch, width)] = self._capture(batch, width)
        elapsed = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %s, table widths %s) in %.1f s",
                    len(self.graphs), self.batch_sizes, self.widths, elapsed)
        return elapsed

    def _forward(self, batch: int, width: int) -> Tensor:
        # Fresh metadata for every trace: backends cache per-step tensors (masks) in meta.scratch, and a
        # cached tensor would be baked into the graph instead of recomputed from the buffers.
        meta = AttentionMetadata.for_static_decodes(
            self.slot_mapping[:batch], self.context_lens[:batch], self.block_tables[:batch, :width],
            self.block_size, self.cu_query_lens[:batch + 1], self.token_idx[:batch],
            self.cu_context_lens[width][:batch + 1])
        first = self.model.is_first
        hidden: Tensor = self.model(self.input_ids[:batch] if first else None,
                                    None if first else self.hidden[:batch], self.positions[:batch],
                                    self.kv_caches, meta)
        return hidden

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up on a side stream (lazy inits, allocator), then capture into the shared memory pool.
        The warm-up writes this step's real K/V into their real slots: the replay writes the same values."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), no_host_transfers(f"the decode graph (batch {batch})"):
            out = self._forward(batch, width)
        logger.debug("captured a decode CUDA graph: batch %d, table width %d blocks", batch, width)
        return graph, out


