"""Quantized copies of a tiny float checkpoint: compressed-tensors by the library's own compressors
(ppserve/model/quant/rtn.py), GPTQ and AWQ by a small packer written from their format definitions (no
library here writes them), each with the float checkpoint of the weights they encode, since transformers
reads those formats only through libraries not installed here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ppserve.model.quant.rtn import compressed_tensors_copy, copy_config, linear_names

__all__ = ["awq_copy", "compressed_tensors_copy", "dequantized_copy", "gptq_copy", "hf_dequantized"]


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
    """`src` in GPTQ's original layout (zero points stored minus one; `desc_act` with a shuffled g_idx; a
    zero bias for every layer, as AutoGPTQ writes) at `dst`, and at `ref` the float checkpoint of the
    weights those codes encode."""
    state = load_file(src / "model.safetensors")
    reference = dict(state)
    gen = torch.Generator().manual_seed(0)
    orders: dict[str, torch.Tensor] = {}  # projections of one input share its order, as GPTQ derives it
    for name in linear_names(state):
        w = state.pop(f"{name}.weight")
        in_features = w.shape[1]
        g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
        if desc_act:
            module, proj = name.rsplit(".", 1)
            proj = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
            order = orders.setdefault(f"{module}.{proj}", torch.randperm(in_features, generator=gen))
            g_idx = g_idx[order]
        # GPTQ's original layout stores zero - 1, so a zero of 0 cannot be stored: keep them from 1 up.
        q, scales, zeros = _quantize_groups(w, bits, group_size, sym, g_idx, min_zero=1)
        reference[f"{name}.weight"] = ((q - zeros[g_idx].t()) * scales[g_idx].t()).float().contiguous()
        state[f"{name}.qweight"] = _pack(q.t(), bits, 0)
        state[f"{name}.qzeros"] = _pack(zeros - 1, bits, 1)
        state[f"{name}.scales"] = scales
        state[f"{name}.g_idx"] = g_idx
        state[f"{name}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # as AutoGPTQ exports them
    return _write_pair(src, dst, ref, state, reference,
                       {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                        "desc_act": desc_act, "checkpoint_format": "gptq"})


def awq_copy(src: Path, dst: Path, ref: Path, group_size: int) -> tuple[Path, Path]:
    """`src` in AWQ's GEMM layout (4 bits, zero points, columns interleaved 0 2 4 6 1 3 5 7 in each word)."""
    state = load_file(src / "model.safetensors")
    reference = dict(state)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    for name in linear_names(state):
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
    copy_config(src, dst, quantization_config)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(src, ref, dirs_exist_ok=True)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return dst, ref


def hf_dequantized(model_dir: Path) -> torch.nn.Module:
    """transformers' own reading of a compressed-tensors checkpoint, decompressed to float32 weights."""
    import warnings

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():  # that the checkpoint's own quantization_config is the one used
        warnings.simplefilter("ignore", UserWarning)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    model.generation_config.eos_token_id = None
    return model.eval()


def dequantized_copy(qdir: Path, ref: Path) -> Path:
    """The float checkpoint of the weights a compressed-tensors checkpoint encodes, decompressed by the
    library itself, for transformers where it cannot read the quantized one (per-expert MoE layers)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((qdir / "config.json").read_text())
                                               ["quantization_config"])
    scheme = next(iter(config.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(config.format)
    state = load_file(qdir / "model.safetensors")
    modules = {n[: -len(".weight_scale")] for n in state if n.endswith(".weight_scale")}
    out = {n: t for n, t in state.items() if n.rpartition(".")[0] not in modules}
    for m in modules:
        local = {n.rpartition(".")[2]: t for n, t in state.items() if n.rpartition(".")[0] == m}
        out[f"{m}.weight"] = compressor.decompress(local, scheme)["weight"].float().contiguous()
    shutil.copytree(qdir, ref, dirs_exist_ok=True)
    config_json = json.loads((ref / "config.json").read_text())
    del config_json["quantization_config"]
    (ref / "config.json").write_text(json.dumps(config_json))
    save_file(out, ref / "model.safetensors", metadata={"format": "pt"})
    return ref
