"""The check's models, built on the device from a config: random weights saved as real HF directories.

Nothing is downloaded and no GGUF is read (the default model's file is 98 MB, over what a device run
may carry, and needs `gguf`). The shapes are the real models' (their config.json); on CPU (the dry run)
they shrink to the same proportions.

The random weights are drawn so that a top-1 comparison means something (`randomize`): the logits must be
peaked (the top token clear of the second by much more than verdicts.NEAR_TIE at most positions), and
two right implementations in bf16 must not part where they are. Scaling Gaussian logits up does not get
there: the top-two gap of N Gaussians is about their spread / sqrt(2 ln N), and bf16 rounding grows with
the logits, so a larger scale only moves the gap and the error together past NEAR_TIE. Instead the
output rows get log-normal scales (TOKEN_SPREAD: a few tokens are likely winners, as a trained model's
frequent tokens are, which widens the gap against the logits' size), at a size independent of the
hidden width (LOGIT_STD: the top logits land where NEAR_TIE is a few bf16 steps). And the decoder
layers stay narrow (LAYER_STD): wide random layers are chaotic, and over 30 of them bf16 rounding grows
into logit errors that flip clear winners.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's config.json (the default model), float32 on disk like its GGUF conversion.
SMOLLM2_135M: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                    num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152,
                                    rope_theta=100000.0, max_position_embeddings=8192,
                                    tie_word_embeddings=True)
# Llama-3-8B's config.json.
LLAMA3_8B: dict[str, Any] = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                 num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
                                 rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
# The same proportions for a CPU dry run (head dim 64 as in both, GQA groups 3 and 4).
SMOLLM2_SHRUNK: dict[str, Any] = {**SMOLLM2_135M, "hidden_size": 192, "intermediate_size": 512,
                                  "num_attention_heads": 3, "num_key_value_heads": 1, "num_hidden_layers": 2,
                                  "vocab_size": 512, "max_position_embeddings": 1024}
LLAMA3_SHRUNK: dict[str, Any] = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 896,
                                 "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 1024,
                                 "max_position_embeddings": 1024}
# Decoder layers' weights: a little wider than transformers' default init (0.02), so that the layers
# still mix the context (a wrong attention kernel moves the argmax); narrower than 0.03 and up, where a
# 30-layer random model amplifies bf16 rounding into logit errors that flip clear winners.
LAYER_STD = 0.025
EMBED_STD = 0.05  # an untied input embedding (the output rows, tied or not, follow LOGIT_STD)
LOGIT_STD = 0.7  # a unit-scale output row's logit spread over an RMS-normalised hidden state
TOKEN_SPREAD = 0.75  # sigma of the log-normal scale of each output row


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
        randomize(model)
        model.config.dtype = dtype
        model.save_pretrained(path)
    finally:
        torch.set_default_dtype(previous)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    # What a reader of the JSON needs to know about this checkpoint.
    (path / "gpu_check_model.json").write_text(json.dumps({
        "shape": shape, "dtype": dtype, "weights": "random", "layer_std": LAYER_STD, "embed_std": EMBED_STD,
        "logit_std": LOGIT_STD, "token_spread": TOKEN_SPREAD}))
    return path


def randomize(model: Any) -> None:
    """Draw every weight of a LlamaForCausalLM in place (under the caller's seed; see the module doc):
    norms near 1, decoder layers at LAYER_STD, an untied input embedding at EMBED_STD, the output rows
    by `peak_output_rows`."""
    import torch

    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p is head:  # tied: the embedding is the output matrix, drawn as one
                continue
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, LAYER_STD if ".layers." in f".{name}" else EMBED_STD)
        peak_output_rows(head)


def peak_output_rows(head: Any) -> None:
    """Output row j: a random direction of norm ~LOGIT_STD * exp(TOKEN_SPREAD * z_j), z_j standard normal,
    so its logit over a hidden state of RMS 1 has that spread whatever the hidden width."""
    import torch

    vocab, hidden = head.shape
    z = torch.randn(vocab, device=head.device, dtype=torch.float32)
    scale = LOGIT_STD * torch.exp(TOKEN_SPREAD * z) / hidden ** 0.5
    head.normal_(0.0, 1.0).mul_(scale[:, None].to(head.dtype))


def param_count(shape: dict[str, Any], layers: int | None = None) -> dict[str, int]:
    """Parameters of a Llama of `shape`: the decoder layers', and the embedding and head's."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    n = layers if layers is not None else shape["num_hidden_layers"]
    embed = v * h * (1 if shape.get("tie_word_embeddings") else 2)
    return {"layers": per_layer * n, "embed_and_head": embed, "head": v * h}
