"""The check's models, built on the device from a config: random weights saved as real HF directories.

Nothing is downloaded and no GGUF is read (the default model's file is 98 MB, over what a device run
may carry, and needs `gguf`). The shapes are the real models' (their config.json); on CPU (the dry run)
they shrink to the same proportions. Weights are drawn wider than transformers' default init (std
0.02 gives near-uniform logits, where every top-1 comparison is a coin toss): then logits are peaked and
a wrong kernel shows as a wrong argmax.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's config.json (the default model), float32 on disk like its GGUF conversion.
SMOLLM2_135M: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                    num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152,
                                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
# Llama-3-8B's config.json.
LLAMA3_8B: dict[str, Any] = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                 num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
                                 rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
# The same proportions for a CPU dry run (head dim 64 as in both, GQA groups 3 and 4).
SMOLLM2_SHRUNK: dict[str, Any] = {**SMOLLM2_135M, "hidden_size": 192, "intermediate_size": 512,
                                  "num_attention_heads": 3, "num_key_value_heads": 1, "num_hidden_layers": 2,
                                  "vocab_size": 512, "max_position_embeddings": 1024}
LLAMA3_SHRUNK: dict[str, Any] = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 1024,
                                 "max_position_embeddings": 1024}
WEIGHT_STD = 0.05


def shape_for(name: str, cuda: bool) -> dict[str, Any]:
    if name == "smollm2":
        return dict(SMOLLM2_135M if cuda else SMOLLM2_SHRUNK)
    if name == "llama3_8b":
        return dict(LLAMA3_8B if cuda else LLAMA3_SHRUNK)
    raise ValueError(f"unknown check model {name!r}: smollm2 or llama3_8b")


def checkpoint(models_dir: Path, name: str, shape: dict[str, Any], dtype: str, device: str) -> Path:
    """The HF directory of `name` (built once per run: a later phase reuses it)."""
    path = models_dir / f"{name}-{shape['num_hidden_layers']}l-{dtype}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    build_random_llama(path, shape, dtype, device)
    return path


def build_random_llama(path: Path, shape: dict[str, Any], dtype: str, device: str) -> Path:
    """A LlamaForCausalLM with random weights (seeded), initialised on `device`, saved in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # built in its dtype: an 8B model in fp32 would be 32 GB
    try:
        with torch.device(device):
            model: Any = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
                else:
                    p.normal_(0.0, WEIGHT_STD)
        model.config.dtype = dtype
        model.save_pretrained(path)
    finally:
        torch.set_default_dtype(previous)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    # What a reader of the JSON needs to know about this checkpoint.
    (path / "gpu_check_model.json").write_text(json.dumps({"shape": shape, "dtype": dtype, "weights": "random",
                                                           "weight_std": WEIGHT_STD}))
    return path


def param_count(shape: dict[str, Any], layers: int | None = None) -> dict[str, int]:
    """Parameters of a Llama of `shape`: the decoder layers', and the embedding and head's."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    n = layers if layers is not None else shape["num_hidden_layers"]
    embed = v * h * (1 if shape.get("tie_word_embeddings") else 2)
    return {"layers": per_layer * n, "embed_and_head": embed, "head": v * h}
