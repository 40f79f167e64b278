"""`ppserve plan`'s inputs turned into the simulator's terms: a model table from a name, a YAML or an HF
config.json; the cluster; the workload's request lengths."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ppserve.metrics.capacity import ProbeSize
from ppserve.model.quant.config import linear_compute, stored_weight_bytes
from ppserve.plan.space import Cluster
from ppserve.sim.conversations import ConversationSpec, conversation_requests
from ppserve.sim.cost_model import ModelSpec, load_hardware, load_model_spec
from ppserve.sim.lengths import LENGTH_DISTRIBUTIONS, SPLITWISE_CONV_LIKE
from ppserve.sim.workload import WorkloadRequest, clip_to_context, default_trace_path, read_trace

__all__ = ["model_spec", "model_spec_from_hf", "cluster", "workload", "conversation_spec", "CONVERSATIONS"]

_GELU = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"}


def model_spec_from_hf(cfg: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json's fields (Llama, Mistral, Qwen, Falcon-style names); a
    quantized checkpoint's linear weights count at their stored bytes, and multiply in FP8 or INT8 where
    its scheme quantizes the activations too."""
    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ValueError(f"{name}: config.json has none of {list(keys)}")
        return default

    hidden = int(get("hidden_size", "n_embd", "d_model"))
    heads = int(get("num_attention_heads", "n_head"))
    act = str(get("hidden_act", "activation", default="silu"))
    return ModelSpec(
        name=name,
        num_layers=int(get("num_hidden_layers", "n_layer")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", "num_kv_heads", default=heads)),
        intermediate_size=int(get("intermediate_size", "ffn_hidden_size", default=4 * hidden)),
        vocab_size=int(get("vocab_size")),
        mlp="gelu" if act in _GELU else "swiglu",
        max_model_len=int(get("max_position_embeddings", "max_seq_len", default=4096)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg.get("head_dim") or 0),
        linear_weight_bytes=stored_weight_bytes(cfg) or 0.0,
        linear_compute=linear_compute(cfg),
    )


def model_spec(name_or_path: str) -> tuple[ModelSpec, str | None]:
    """The model table, and the HF directory `ppserve serve` can load (None for a table name or YAML)."""
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").exists():
        p = p / "config.json"
    if p.name == "config.json":
        if not p.exists():
            raise FileNotFoundError(f"no such file: {p}")
        return model_spec_from_hf(json.loads(p.read_text()), p.parent.name), str(p.parent)
    return load_model_spec(name_or_path), None


def cluster(hardware: str, gpus_per_node: int, nodes: int, inter_node_gbps: float | None = None,
            nvlink_gbps: float | None = None) -> Cluster:
    """The cluster from a hardware table, link bandwidths overridden where given (GB/s per GPU)."""
    hw = load_hardware(hardware)
    if inter_node_gbps is not None:
        hw = replace(hw, inter_node_bw=inter_node_gbps * 1e9)
    if nvlink_gbps is not None:
        hw = replace(hw, nvlink_bw=nvlink_gbps * 1e9)
    return Cluster(hw, gpus_per_node, nodes)


# Rows of a trace the probes may read: a probe replays the trace from its first row as far as its duration
# needs (`ProbeSize.max_requests` at most), as `ppserve bench capacity` does on the real pipeline, so a plan
# and a real capacity search of the same trace replay the same requests. A pool of the first --num-requests
# rows cycled instead (the planner's old reading) made `plan_then_run.py` plan a 48-row pool of 5.7 output
# tokens a request against real probes of the first 195 rows, 11.6 a request.
TRACE_PROBE_ROWS = ProbeSize.max_requests


def workload(name: str, num_requests: int, max_model_len: int, seed: int = 0, prefill_scale: float = 1.0,
             decode_scale: float = 1.0) -> tuple[list[WorkloadRequest], list[WorkloadRequest], str]:
    """(the estimates' requests, the probes' pool, a description).

    A dataset-like distribution by name: `num_requests` draws, both the estimates' and the pool (cycled by
    a probe that needs more: independent draws have no order to follow). A trace CSV (a path or a name in
    the shared traces): its first `num_requests` rows for the estimates (memory feasibility and the SLO's
    token budget), and its rows in order for the probes (`TRACE_PROBE_ROWS`, cycled only past the
    trace's end). `CONVERSATIONS`: the conversation trace's rows as the turns of multi-turn chats
    (`conversation_spec`): the pool is the rows, the estimates read the prompts the turns send."""
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    spec = conversation_spec(name)
    if spec is not None:
        return _conversations(spec, num_requests, max_model_len, seed, prefill_scale, decode_scale)
    if name in LENGTH_DISTRIBUTIONS:
        dist = LENGTH_DISTRIBUTIONS[name]
        pool = dist.sample(num_requests, max_model_len, seed)
        desc = f"{name} lengths ({dist.source}, log-normal stand-in), {num_requests} requests"
        if prefill_scale != 1.0 or decode_scale != 1.0:
            pool = [replace(r, prompt_len=max(1, round(r.prompt_len * prefill_scale)),
                            output_len=max(1, round(r.output_len * decode_scale))) for r in pool]
    else:
        path = Path(name)
        if not path.exists():
            path = default_trace_path(name if name.endswith(".csv") else f"{name}.csv")
        pool = read_trace(path, max(num_requests, TRACE_PROBE_ROWS), prefill_scale, decode_scale,
                          need_arrivals=False)
        desc = f"{path.name}, first {min(num_requests, len(pool))} rows (probes: its rows in order)"
    if prefill_scale != 1.0 or decode_scale != 1.0:
        desc += f", lengths scaled x{prefill_scale:g} (prompt) x{decode_scale:g} (output)"
    pool = clip_to_context(pool, max_model_len)
    return pool[:num_requests], pool, desc + ", Poisson arrivals"


# Multi-turn chats over the conversation trace's lengths (sim/conversations.py): each turn re-sends the
# history, so the replicas' prefix caches, and the router that fills them, decide much of the work.
CONVERSATIONS = "conversations"


def conversation_spec(name: str) -> ConversationSpec | None:
    """How `name` groups its rows into conversations, None for a workload of independent requests."""
    return ConversationSpec() if name == CONVERSATIONS else None


def _conversations(spec: ConversationSpec, num_requests: int, max_model_len: int, seed: int,
                   prefill_scale: float, decode_scale: float
                   ) -> tuple[list[WorkloadRequest], list[WorkloadRequest], str]:
    """The conversation trace's rows in order (each a turn's new message and answer), or where the
    trace is absent (a checkout without ../shared) its log-normal stand-in, said in the description."""
    try:
        path = default_trace_path("splitwise_conv.csv")
    except FileNotFoundError:
        rows = SPLITWISE_CONV_LIKE.sample(max(num_requests, TRACE_PROBE_ROWS), max_model_len, seed)
        rows = [replace(r, prompt_len=max(1, round(r.prompt_len * prefill_scale)),
                        output_len=max(1, round(r.output_len * decode_scale))) for r in rows]
        src = f"{SPLITWISE_CONV_LIKE.name} lengths (splitwise_conv.csv not found; its log-normal stand-in)"
    else:
        rows = read_trace(path, max(num_requests, TRACE_PROBE_ROWS), prefill_scale, decode_scale,
                          need_arrivals=False)
        src = "splitwise_conv.csv rows in order"
    rows = clip_to_context(rows, max_model_len)
    turns = conversation_requests(rows[:num_requests], spec, max_model_len)
    desc = (f"multi-turn conversations over {src} (each row a turn's new message and answer; "
            f"{spec.mean_turns:g} turns a conversation on average, {spec.think_s:g} s between an answer and "
            "the next turn)")
    if prefill_scale != 1.0 or decode_scale != 1.0:
        desc += f", lengths scaled x{prefill_scale:g} (prompt) x{decode_scale:g} (output)"
    return turns, rows, desc + ", Poisson arrivals"
