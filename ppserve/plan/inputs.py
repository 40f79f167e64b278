"""`ppserve plan`'s inputs turned into the simulator's terms: a model table from a name, a YAML or an HF
config.json; the cluster; the workload's fixed trace of request lengths."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ppserve.plan.space import Cluster
from ppserve.sim.cost_model import ModelSpec, load_hardware, load_model_spec
from ppserve.sim.lengths import LENGTH_DISTRIBUTIONS
from ppserve.sim.workload import WorkloadRequest, clip_to_context, default_trace_path, read_trace

__all__ = ["model_spec", "model_spec_from_hf", "cluster", "workload"]

_GELU = {"gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"}


def model_spec_from_hf(cfg: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json's fields (Llama, Mistral, Qwen, Falcon-style names)."""
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


def workload(name: str, num_requests: int, max_model_len: int, seed: int = 0, prefill_scale: float = 1.0,
             decode_scale: float = 1.0) -> tuple[list[WorkloadRequest], str]:
    """The fixed trace of lengths: a dataset-like distribution by name, or the first rows of a trace CSV
    (a path or a name in the shared traces); and its description."""
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    if name in LENGTH_DISTRIBUTIONS:
        dist = LENGTH_DISTRIBUTIONS[name]
        reqs = dist.sample(num_requests, max_model_len, seed)
        desc = f"{name} lengths ({dist.source}, log-normal stand-in), {num_requests} requests"
    else:
        path = Path(name)
        if not path.exists():
            path = default_trace_path(name if name.endswith(".csv") else f"{name}.csv")
        reqs = read_trace(path, num_requests, prefill_scale, decode_scale, need_arrivals=False)
        desc = f"{path.name}, first {len(reqs)} rows"
    if prefill_scale != 1.0 or decode_scale != 1.0:
        desc += f", lengths scaled x{prefill_scale:g} (prompt) x{decode_scale:g} (output)"
        if name in LENGTH_DISTRIBUTIONS:
            reqs = [replace(r, prompt_len=max(1, round(r.prompt_len * prefill_scale)),
                            output_len=max(1, round(r.output_len * decode_scale))) for r in reqs]
    return clip_to_context(reqs, max_model_len), desc + ", Poisson arrivals"
