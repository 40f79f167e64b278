"""Quantized copies of a tiny float checkpoint: compressed-tensors by the library's own compressors, GPTQ and
AWQ by a small packer written from their format definitions (no library here writes them), each with the
float checkpoint of the weights they encode where transformers cannot read the format itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear_names(state: dict[str, Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in state
            if n.endswith(".weight") and n.split(".")[-2] in LINEAR_SUFFIXES]


def _copy_config(src: Path, dst: Path, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, default=str))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)


def compressed_tensors_copy(src: Path, dst: Path, preset: str, fmt: str, group_size: int | None = None,
                            scale_dtype: torch.dtype = torch.float32) -> Path:
    """`src` quantized with a compressed-tensors preset scheme (W4A16, W4A16_ASYM, W8A16, W8A8, FP8,
    FP8_DYNAMIC), scales from each weight's own min and max, stored in format `fmt`."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    assert args is not None
    if group_size is not None:
        args.group_size = group_size
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state = load_file(src / "model.safetensors")
    for name in _linear_names(state):
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
    _copy_config(src, dst, config.model_dump(mode="json"))
    return dst


def _quantize_groups(w: Tensor, bits: int, group: int, sym: bool, g_idx: Tensor,
                     min_zero: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """w [out, in] -> integer codes q [out, in] in [0, 2^bits), per-group scales and zeros [groups, out]
    (group of input column i is g_idx[i]; zeros at least `min_zero`)."""
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scales = torch.empty(groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s = torch.maximum(lo.abs(), hi) * 2 / top
            z = torch.full_like(s, (top + 1) // 2, dtype=torch.int32)
        else:
            s = (hi - lo) / top
            z = torch.round(-lo / s).to(torch.int32).clamp(min_zero, top)
        scales[g], zeros[g] = s.to(torch.float16), z
    q = torch.round(w / scales[g_idx].t().float() + zeros[g_idx].t()).clamp(0, top).to(torch.int32)
    return q, scales, zeros


def _pack(values: Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> Tensor:
    """Pack non-negative codes 32/bits per int32 along `dim`, value j at bits [j*bits, (j+1)*bits); with
    `order`, slot j holds element order[j] of each run."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    packed = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(per):
        packed |= (v[..., j].to(torch.int64) & ((1 << bits) - 1)) << (j * bits)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def gptq_copy(src: Path, dst: Path, ref: Path, bits: int, group_size: int, sym: bool = True,
              desc_act: bool = False) -> tuple[Path, Path]:
    """`src` in GPTQ's original layout (zero points stored minus one; `desc_act` with a shuffled g_idx) at
    `dst`, and at `ref` the float checkpoint of the weights those codes encode."""
    state = load_file(src / "model.safetensors")
    reference = dict(state)
    gen = torch.Generator().manual_seed(0)
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight")
        in_features = w.shape[1]
        g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
        if desc_act:
            g_idx = g_idx[torch.randperm(in_features, generator=gen)]
        # GPTQ's original layout stores zero - 1, so a zero of 0 cannot be stored: keep them from 1 up.
        q, scales, zeros = _quantize_groups(w, bits, group_size, sym, g_idx, min_zero=1)
        reference[f"{name}.weight"] = ((q - zeros[g_idx].t()) * scales[g_idx].t()).float().contiguous()
        state[f"{name}.qweight"] = _pack(q.t(), bits, 0)
        state[f"{name}.qzeros"] = _pack(zeros - 1, bits, 1)
        state[f"{name}.scales"] = scales
        state[f"{name}.g_idx"] = g_idx
    return _write_pair(src, dst, ref, state, reference,
                       {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                        "desc_act": desc_act, "checkpoint_format": "gptq"})


def awq_copy(src: Path, dst: Path, ref: Path, group_size: int) -> tuple[Path, Path]:
    """`src` in AWQ's GEMM layout (4 bits, zero points, columns interleaved 0 2 4 6 1 3 5 7 in each word)."""
    state = load_file(src / "model.safetensors")
    reference = dict(state)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight")
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group_size
        q, scales, zeros = _quantize_groups(w, 4, group_size, False, g_idx)
        reference[f"{name}.weight"] = ((q - zeros[g_idx].t()) * scales[g_idx].t()).float().contiguous()
        state[f"{name}.qweight"] = _pack(q.t(), 4, 1, order)
        state[f"{name}.qzeros"] = _pack(zeros, 4, 1, order)
        state[f"{name}.scales"] = scales
    return _write_pair(src, dst, ref, state, reference,
                       {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                        "version": "gemm"})


def _write_pair(src: Path, dst: Path, ref: Path, state: dict[str, Tensor], reference: dict[str, Tensor],
                quantization_config: dict) -> tuple[Path, Path]:
    _copy_config(src, dst, quantization_config)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(src, ref, dirs_exist_ok=True)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return dst, ref


def hf_dequantized(model_dir: Path) -> torch.nn.Module:
    """transformers' own reading of a compressed-tensors checkpoint, decompressed to float32 weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    model.generation_config.eos_token_id = None
    return model.eval()
