"""A quantized linear weight's stored tensors -> the floating-point weight [out, in] they encode.

compressed-tensors weights go through the library's own decompressor for their format (the same code
transformers decompresses them with); GPTQ and AWQ layouts are unpacked here, as their formats define
them. `QuantizedSource` wraps one layer's stored tensors so the loader can hand it to a layer's
`weight_loader` as an ordinary `CheckpointTensor`: the layer indexes its TP shard out of the dequantized
weight exactly as it would out of a float one, so every sharding rule holds unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ppserve.model.quant.codes import QuantCodes, attach, from_fp8, from_grouped, from_signed
from ppserve.model.quant.config import Quantization, WeightQuant

# The tensors each method stores per quantized linear layer, by suffix after the module's name.
STORED = {
    "compressed-tensors": ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                           "weight_g_idx", "input_scale", "input_zero_point", "weight_global_scale",
                           "input_global_scale"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
# The suffix whose presence marks a module as stored quantized.
MARKER = {"compressed-tensors": "weight_scale", "gptq": "qweight", "awq": "qweight"}
# AWQ's GEMM layout stores output column 8c + ORDER[j] in nibble j of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def dequantize(quant: Quantization, module: str,
               parts: dict[str, Tensor]) -> tuple[Tensor, QuantCodes | None]:
    """The float weight [out, in] of checkpoint module `module` from its stored `parts` (by suffix), and
    its codes where the format has them for a kernel (int4, int8, fp8)."""
    scheme = quant.scheme_for(module)
    try:
        if quant.method == "compressed-tensors":
            return _compressed_tensors(quant, scheme, module, parts)
        if quant.method == "gptq":
            return _gptq(scheme, parts, quant.gptq_v1_zeros)
        return _awq(scheme, parts)
    except KeyError as e:
        raise ValueError(f"{module}: the {quant.method} checkpoint lacks its {e.args[0]} tensor") from None


def _compressed_tensors(quant: Quantization, scheme: WeightQuant, module: str,
                        parts: dict[str, Tensor]) -> tuple[Tensor, QuantCodes | None]:
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if "weight_g_idx" in parts:
        raise ValueError(f"{module}: compressed-tensors group activation ordering (weight_g_idx) is not "
                         "supported")
    config = quant.library_config
    ct_scheme: Any = config.config_groups[quant.group_of(module)]
    fmt = ct_scheme.format or config.format
    compressor: Any = BaseCompressor.get_value_from_registry(fmt)
    local = {k: v for k, v in parts.items() if not k.startswith("input_")}
    if "weight" in local and local["weight"].dtype in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{module}: weight_scale is stored but the weight is {local['weight'].dtype}, "
                         f"not the {fmt} format's integer or fp8 type")
    weight: Tensor = compressor.decompress(local, ct_scheme)["weight"]
    if scheme.kind != "int":
        return weight, from_fp8(parts["weight"], parts["weight_scale"]) if "weight" in parts else None
    out, inp = weight.shape
    if "weight_packed" in parts:
        q = unpack_from_int32(parts["weight_packed"], scheme.bits, torch.Size([out, inp]))
    else:
        q = parts["weight"]
    zero = parts.get("weight_zero_point")
    scale = parts["weight_scale"]
    if zero is not None and "weight_packed" in parts and scale.dim() == 2:
        zero = unpack_from_int32(zero, scheme.bits, torch.Size(scale.shape), packed_dim=0)
    return weight, from_signed(scheme.bits, q, scale, zero, inp, scheme.int8_activations)


def _unpack_rows(packed: Tensor, bits: int) -> Tensor:
    """int32 [R, C] holding 32/bits values per word along the rows, lowest bits first -> [R*32/bits, C]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_cols(packed: Tensor, bits: int, order: tuple[int, ...] | None = None) -> Tensor:
    """int32 [R, C] holding 32/bits values per word along the columns -> [R, C*32/bits]; with `order`,
    value j of word c is column c*per + order[j]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    values = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        values = values[:, :, torch.tensor([order.index(j) for j in range(per)])]
    return values.reshape(packed.shape[0], packed.shape[1] * per)


def _gptq(scheme: WeightQuant, parts: dict[str, Tensor], v1_zeros: bool) -> tuple[Tensor, QuantCodes | None]:
    bits = scheme.bits
    q = _unpack_rows(parts["qweight"], bits)  # [in, out]
    scales = parts["scales"]  # [groups, out]
    zeros = _unpack_cols(parts["qzeros"], bits)[:, :q.shape[1]]  # [groups, out]
    if v1_zeros:
        zeros = zeros + 1
    in_features = q.shape[0]
    if "g_idx" in parts:
        g_idx = parts["g_idx"].long()
    else:
        size = scheme.group_size or in_features
        g_idx = torch.arange(in_features) // size
    _check_groups(g_idx, scales.shape[0], in_features, "GPTQ")
    w = (q - zeros[g_idx]).to(scales.dtype) * scales[g_idx]
    size = in_features // scales.shape[0]
    in_order = bool((g_idx == torch.arange(in_features) // size).all())  # desc_act may shuffle the groups
    return w.t().contiguous(), from_grouped(bits, q, scales, zeros, size, None if in_order else g_idx)


def _awq(scheme: WeightQuant, parts: dict[str, Tensor]) -> tuple[Tensor, QuantCodes | None]:
    q = _unpack_cols(parts["qweight"], 4, AWQ_ORDER)  # [in, out]
    scales = parts["scales"]  # [groups, out]
    zeros = _unpack_cols(parts["qzeros"], 4, AWQ_ORDER)[:, :q.shape[1]]
    in_features = q.shape[0]
    g_idx = torch.arange(in_features) // (scheme.group_size or in_features)
    _check_groups(g_idx, scales.shape[0], in_features, "AWQ")
    w = (q - zeros[g_idx]).to(scales.dtype) * scales[g_idx]
    return w.t().contiguous(), from_grouped(4, q, scales, zeros, scheme.group_size or in_features)


def _check_groups(g_idx: Tensor, groups: int, in_features: int, method: str) -> None:
    if g_idx.numel() != in_features or int(g_idx.max()) >= groups or int(g_idx.min()) < 0:
        raise ValueError(f"{method}: {groups} scale groups do not cover {in_features} input features")


class QuantizedSource:
    """One quantized layer's stored tensors, read and dequantized the first time any window is asked for
    (then kept until the loader drops it): a `CheckpointTensor` source, like a safetensors slice. Each
    window carries the matching window of the integer codes, where there are codes (codes.attach)."""

    def __init__(self, shape: tuple[int, ...], read: Callable[[], tuple[Tensor, QuantCodes | None]]) -> None:
        self._shape = list(shape)
        self._read = read
        self._full: Tensor | None = None
        self._codes: QuantCodes | None = None

    def get_shape(self) -> list[int]:
        return self._shape

    def __getitem__(self, index: Any) -> Tensor:
        if self._full is None:
            self._full, self._codes = self._read()
            if list(self._full.shape) != self._shape:
                raise ValueError(f"dequantized weight has shape {tuple(self._full.shape)}, the stored "
                                 f"tensors say {tuple(self._shape)}")
        window = self._full[index]
        return attach(window, None if self._codes is None else self._codes.window(index))


def stored_shape(quant: Quantization, module: str, shapes: dict[str, list[int]],
                 read: Callable[[str], Tensor]) -> tuple[int, int]:
    """The float weight's [out, in] from the stored tensors' shapes (and compressed-tensors' weight_shape)."""
    if quant.method == "compressed-tensors":
        if "weight_shape" in shapes:
            out, inp = (int(v) for v in read("weight_shape").tolist())
            return out, inp
        if "weight" not in shapes:
            raise ValueError(f"{module}: the compressed-tensors checkpoint has neither weight nor "
                             "weight_packed/weight_shape")
        out, inp = shapes["weight"]
        return out, inp
    rows, cols = shapes["qweight"]
    bits = quant.scheme_for(module).bits
    if quant.method == "gptq":
        return cols, rows * 32 // bits
    return cols * 8, rows
