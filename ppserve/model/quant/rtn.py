"""Round-to-nearest quantization of a float safetensors checkpoint into the compressed-tensors format.

Scales come from each weight's own minimum and maximum (per tensor, channel or group, as the preset
scheme says), and the library's own compressor stores the codes, so the result is a checkpoint that
transformers, vLLM and ppserve all read. Benchmarks and tests build their quantized models with it;
calibrated quantization (GPTQ, AWQ, SmoothQuant) is llm-compressor's job.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_names(state: dict[str, Tensor]) -> list[str]:
    """The decoder layers' linear modules of a checkpoint (the LM head and embeddings stay float)."""
    return [n[: -len(".weight")] for n in state
            if n.endswith(".weight") and n.split(".")[-2] in LINEAR_SUFFIXES]


def copy_config(src: Path, dst: Path, quantization_config: dict[str, Any]) -> None:
    """src's config.json with `quantization_config`, and its other small files, into dst."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, default=str))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)


def compressed_tensors_copy(src: Path, dst: Path, preset: str, fmt: str, group_size: int | None = None,
                            scale_dtype: torch.dtype = torch.float32) -> Path:
    """`src` quantized with a compressed-tensors preset scheme (W4A16, W4A16_ASYM, W8A16, W8A8, FP8,
    FP8_DYNAMIC; `group_size` for the grouped ones), scales from each weight's own min and max, stored in
    format `fmt`."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    assert args is not None
    if group_size is not None and args.strategy == "group":
        args.group_size = group_size
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state: dict[str, Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(path))
    for name in linear_names(state):
        w = state.pop(f"{name}.weight")
        if args.strategy == "group":
            grouped = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        local = {"weight": w, "weight_scale": scale.to(scale_dtype)}
        if not args.symmetric:
            local["weight_zero_point"] = zero
        for key, value in compressor.compress(local, scheme).items():
            state[f"{name}.{key}"] = value.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.COMPRESSED)
    copy_config(src, dst, config.model_dump(mode="json"))
    return dst
