"""How much accelerator memory the KV cache gets, the way vLLM sizes it, and the profile it is sized from.

After the weights are loaded, the communicators warmed up (their buffers allocated) and one forward of
the largest microbatch profiled (logits and sampling included), the cache takes what is left of
`utilization` x total memory:

    kv = utilization * total - in_use - transient_peak

`in_use` is total - free as the driver reports it: weights, the CUDA context, NCCL buffers, the caching
allocator's reserve, and any other process on the GPU. `transient_peak` is how far the profiled forward
rose above what stays allocated (activations, logits), which every later step may need again. Decode
CUDA graphs are captured after the cache exists (they point at it) and live in the 1 - utilization
margin; the start-up log shows what they took.

`kv_budget_bytes` and `split_blocks` are that arithmetic alone (unit-tested without a GPU).
`StageMemory` is one stage worker's side of it: what a KV block costs the stage, the profiling forward,
the budget and block count it leads to, and the memory figures of each start-up phase. It lives
here rather than in the StageWorker so the worker holds the step and nothing else.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from ppserve.model.arch import ModelArch
from ppserve.model.attention import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from ppserve.model.layers import prime_linear_paths
from ppserve.model.stage_model import StageModel
from ppserve.request import SamplingParams
from ppserve.worker.sampler import sample

logger = logging.getLogger(__name__)

GiB = float(1 << 30)
DEFAULT_CPU_KV_BYTES = 1 << 30  # a CPU worker's KV cache when cache.kv_cache_memory is unset


def kv_budget_bytes(total: int, free: int, transient_peak: int, utilization: float) -> int:
    """Bytes for the KV cache; ValueError naming the setting when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"cache.gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    in_use = total - free
    budget = int(utilization * total) - in_use - transient_peak
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:g} x {total / GiB:.1f} GiB "
            f"(cache.gpu_memory_utilization) minus {in_use / GiB:.2f} GiB in use and a "
            f"{transient_peak / GiB:.2f} GiB peak for the largest microbatch; raise "
            "cache.gpu_memory_utilization, lower "
            "scheduler.token_budget, or spread the layers over more stages"
        )
    return budget


def split_blocks(budget: int, bytes_per_block: list[int]) -> int:
    """Blocks every stage sharing one device can have: the same count for each (the scheduler's allocator
    is one), so the budget is divided by the sum of the stages' per-block bytes."""
    per_block = sum(bytes_per_block)
    if per_block <= 0:
        raise ValueError("a KV block must cost some bytes")
    return max(1, budget // per_block)


def usable_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most KV blocks the scheduler can ever hold at once: max_num_seqs sequences, each at most
    max_model_len tokens. A bigger pool only costs memory the GPU could give activations and a longer
    free list (the default model on a 141 GB GPU would otherwise get ~360,000 blocks)."""
    if min(max_num_seqs, max_model_len, block_size) < 1:
        raise ValueError(f"max_num_seqs, max_model_len and block_size must be >= 1, got {max_num_seqs}, "
                         f"{max_model_len}, {block_size}")
    return max_num_seqs * -(-max_model_len // block_size)


def capped_blocks(fitted: int, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """`fitted` (what memory allows), capped at usable_blocks; logged when the cap applies."""
    cap = usable_blocks(max_num_seqs, max_model_len, block_size)
    if fitted > cap:
        logger.info("KV pool capped at %d blocks (%d sequences x %d tokens); memory would allow %d",
                    cap, max_num_seqs, max_model_len, fitted)
    return min(fitted, cap)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell free memory: /proc/meminfo has no MemAvailable")


class StageMemory:
    """One stage worker's memory: what a KV block costs it, the profiled peak of the largest microbatch,
    the KV budget and block count, and the figures of each start-up phase (`log`, which the GPU check
    prints). `stage` and `tp_rank` only label the log lines."""

    def __init__(self, model: StageModel, arch: ModelArch, *, block_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device, profile_tokens: int, profile_seqs: int,
                 stage: int = 0, tp_rank: int = 0, max_model_len: int | None = None) -> None:
        self.model, self.arch = model, arch
        self.block_size, self.dtype, self.kv_dtype, self.device = block_size, dtype, kv_dtype, device
        self.profile_tokens, self.profile_seqs = profile_tokens, profile_seqs
        self.stage, self.tp_rank = stage, tp_rank
        self.max_model_len = max_model_len or getattr(arch, "max_position_embeddings", None)
        self.log: list[dict[str, Any]] = []  # note()'s figures, one per start-up phase
        self.warm = False  # the largest microbatch has run once (profiled or warmed up)
        self.decode_warm = False  # warm_up ran every attention path (chunk after cached tokens, decodes)

    def kv_bytes_per_block(self) -> int:
        per_layer = kv_cache_bytes_per_block(
            self.block_size, self.model.num_kv_heads_local, self.arch.head_dim, self.kv_dtype
        )
        return int(per_layer) * self.model.num_local_layers

    def kv_budget_bytes(self, kv_cache_memory: float | None, gpu_memory_utilization: float,
                        peak: int | None = None) -> int:
        """The bytes this worker's KV cache may take: `kv_cache_memory` when set (bytes when > 1, else a
        fraction of free memory now); unset, on CUDA, what the profiled `peak` (this worker's own when
        None) leaves of `gpu_memory_utilization` x total (kv_budget_bytes above), and on CPU
        DEFAULT_CPU_KV_BYTES."""
        if kv_cache_memory is not None:
            return (int(kv_cache_memory) if kv_cache_memory > 1
                    else int(kv_cache_memory * free_memory_bytes(self.device)))
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        if peak is None:
            peak = self.profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget_bytes(int(total), int(free), peak, gpu_memory_utilization)
        logger.info("stage %d tp %d: KV budget %.2f GiB = %.2f x %.1f GiB - %.2f GiB in use - %.2f GiB peak",
                    self.stage, self.tp_rank, budget / GiB, gpu_memory_utilization, total / GiB,
                    (total - free) / GiB, peak / GiB)
        return budget

    def num_blocks(self, kv_cache_memory: float | None, gpu_memory_utilization: float = 0.9) -> int:
        """Blocks that fit this worker's KV budget (see kv_budget_bytes)."""
        return max(1, self.kv_budget_bytes(kv_cache_memory, gpu_memory_utilization)
                   // self.kv_bytes_per_block())

    @torch.inference_mode()
    def profile_peak_bytes(self, worst_case_sampling: bool = True) -> int:
        """Run the largest microbatch the scheduler may form (scheduler.token_budget tokens over up to
        max_num_seqs sequences, logits and sampling for each) on a scratch KV cache; return how far
        allocated memory rose above what stays allocated (0 on CPU, where only the code path is exercised)."""
        tokens = max(1, self.profile_tokens)
        seqs = max(1, min(self.profile_seqs, tokens))
        lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
        cuda = self.device.type == "cuda"
        base = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        params = (SamplingParams(temperature=1.0, top_p=0.9, logprobs=5) if worst_case_sampling
                  else SamplingParams(temperature=0.0))
        self.scratch_forward(lens, lens, params)
        self.warm = True
        if not cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_allocated(self.device) - base)
        torch.cuda.empty_cache()
        # The profile's sequences are short; a decode step of as many at the longest context gathers far
        # more on a backend that does not read the cache in place. The two steps never coexist: the larger.
        return max(0, peak, self.decode_gather_bytes())

    def decode_gather_bytes(self) -> int:
        """One layer's K/V gather for the widest decode step: the most sequences a microbatch holds,
        each at `max_model_len` (0 when the stage's attention backend reads the cache in place)."""
        backend = getattr(self.model, "attn_backend", None)
        if backend is None or not self.max_model_len:
            return 0
        seqs = max(1, min(self.profile_seqs, self.profile_tokens))
        return int(backend.decode_gather_bytes(seqs, self.max_model_len, self.block_size,
                                               self.model.num_kv_heads_local, self.arch.head_dim,
                                               self.kv_dtype, self.dtype))

    def scratch_forward(self, query_lens: list[int], seq_lens: list[int], params: SamplingParams,
                         kv_cache: list[torch.Tensor] | None = None) -> None:
        """One forward of `query_lens[i]` new tokens after `seq_lens[i] - query_lens[i]` cached ones per
        sequence, then logits and sampling on the sampling rank of the last stage; on a scratch KV cache,
        or on the first blocks of `kv_cache` (zeroed again after: nothing is serving yet)."""
        bs, model, device = self.block_size, self.model, self.device
        tables: list[list[int]] = []
        nxt = 0
        for n in seq_lens:
            need = -(-n // bs)
            tables.append(list(range(nxt, nxt + need)))
            nxt += need
        cache = kv_cache if kv_cache is not None else allocate_kv_cache(
            model.num_local_layers, nxt, bs, model.num_kv_heads_local, self.arch.head_dim, self.kv_dtype,
            device)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, device)
        positions = torch.cat([torch.arange(n - q, n, device=device)
                               for q, n in zip(query_lens, seq_lens, strict=True)])
        tokens = sum(query_lens)
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        hidden_in = None if model.is_first else torch.zeros(tokens, self.arch.hidden_size, dtype=self.dtype,
                                                            device=device)
        hidden = model(ids if model.is_first else None, hidden_in, positions, cache, meta)
        if model.is_last:
            ends = [sum(query_lens[: i + 1]) - 1 for i in range(len(query_lens))]
            logits = model.logits_for_sampling(hidden.index_select(0, torch.tensor(ends, device=device)))
            if logits is not None:  # the sampling rank: its peak is the stage's largest
                sample(logits, [params] * len(query_lens), [0] * len(query_lens))
                del logits
        if kv_cache is not None:  # the blocks a request will own start as zeros (allocate_kv_cache says why)
            for layer in kv_cache:
                layer[:, :nxt].zero_()
        del hidden, cache

    def warm_up(self, kv_cache: list[torch.Tensor] | None = None) -> float:
        """Run, once, the microbatch shapes serving will take, and return their seconds: the largest
        microbatch (unless KV sizing already profiled it, on GPU), a chunk that follows cached tokens,
        and decodes; the last two on the first blocks of `kv_cache`, the stage's own cache, when given
        (after the cache took its share of GPU memory there may be no room for a scratch one). Each
        takes another attention path (prefill from an empty cache, a chunk that reads the cache, the
        paged decode kernel), and a path's first call pays for kernel builds or JIT compiles, primitive
        creation and allocator growth, several times a warm step. The CPU linears' path choice is per
        row bucket (ops/gemm.py), so every bucket up to the budget is timed here too. Paid at start-up,
        none of it stalls the pipeline behind a cold stage once requests come."""
        if self.decode_warm:
            return 0.0
        t0 = time.perf_counter()
        # Greedy: sampling has no first-call cost worth paying here (its torch ops need no tuning), so
        # warming it buys nothing; the worst case matters only to the GPU profile's memory peak.
        greedy = SamplingParams(temperature=0.0)
        # Every row bucket's GEMM path, chosen now: otherwise each new bucket's first microbatch times
        # them (tens of ms on CPU, more with the LM head's) while the other stages wait for it.
        prime_linear_paths(self.model, max(1, self.profile_tokens),
                           max(1, min(self.profile_seqs, self.profile_tokens)))
        if not self.warm:
            self.profile_peak_bytes(worst_case_sampling=False)
        cached, chunk, seqs = self.warm_shapes(kv_cache)
        self.scratch_forward([chunk], [cached + chunk], greedy, kv_cache)
        self.scratch_forward([1] * seqs, [cached + 1] * seqs, greedy, kv_cache)
        self.decode_warm = True
        return time.perf_counter() - t0

    def warm_shapes(self, kv_cache: list[torch.Tensor] | None = None) -> tuple[int, int, int]:
        """(cached tokens, chunk tokens, decoding sequences) of the warm-up's chunk and decode step: a
        context that spans blocks and ends inside one (the general case), a chunk of up to four blocks
        after it, and as many decodes of that context as the scheduler may batch, all within `kv_cache`
        when given."""
        room = self.arch.max_position_embeddings
        cached = min(2 * self.block_size + 1, room // 2)
        chunk = max(2, min(self.profile_tokens, 4 * self.block_size, room - cached))
        blocks = kv_cache[0].shape[1] if kv_cache else None
        if blocks is not None:  # a cache too small for the general case: as long a context as fits
            chunk = max(1, min(chunk, blocks * self.block_size - cached))
            cached = min(cached, blocks * self.block_size - chunk)
        per_seq = -(-(cached + 1) // self.block_size)  # blocks one decode needs
        seqs = max(1, self.profile_seqs if blocks is None else min(self.profile_seqs, blocks // per_seq))
        return cached, chunk, seqs

    def note(self, phase: str, **facts: float) -> dict[str, Any]:
        """Record (and log) the memory figures at a start-up phase, with what else the phase measured
        (`facts`)."""
        entry: dict[str, Any]
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            entry = {"phase": phase, "allocated_gib": torch.cuda.memory_allocated(self.device) / GiB,
                     "reserved_gib": torch.cuda.memory_reserved(self.device) / GiB, "free_gib": free / GiB,
                     "total_gib": total / GiB}
        else:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            entry = {"phase": phase, "rss_gib": rss / GiB, "free_gib": free_memory_bytes(self.device) / GiB}
        entry.update(facts)
        self.log.append(entry)
        logger.info("stage %d tp %d memory after %s: %s", self.stage, self.tp_rank, phase,
                    ", ".join(f"{k} {v:.2f}" for k, v in entry.items() if k != "phase"))
        return entry
