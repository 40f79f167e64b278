"""A quantized checkpoint's tensor names -> the float-named tensors the layers load.

A quantized linear layer is stored as several tensors (`q_proj.weight_packed`, `.weight_scale`, ...; GPTQ's
`q_proj.qweight`, `.qzeros`, `.scales`, `.g_idx`). `group_quantized` gathers them under the one name a
floating-point checkpoint would use (`q_proj.weight`) as a lazily dequantized `CheckpointTensor`, and
passes every other tensor (norms, embeddings, biases, unquantized layers) through as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import Tensor

from ppserve.model.checkpoint_tensor import CheckpointTensor
from ppserve.model.quant.codes import QuantCodes
from ppserve.model.quant.config import Quantization
from ppserve.model.quant.dequant import MARKER, STORED, QuantizedSource, dequantize, stored_shape


def quantized_modules(quant: Quantization, names: Iterable[str]) -> set[str]:
    """The checkpoint modules stored quantized: those with the method's marker tensor."""
    suffix = "." + MARKER[quant.method]
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}


def group_quantized(quant: Quantization, slices: dict[str, Any],
                    wanted: Callable[[str], bool]) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, tensor) for every checkpoint tensor `wanted(name)` keeps, a quantized layer's stored tensors
    yielded once as its dequantized `<module>.weight`. `slices` maps every name to its safetensors slice."""
    modules = quantized_modules(quant, slices)
    stored = STORED[quant.method]
    for name, source in slices.items():
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in stored:
            if suffix == MARKER[quant.method] and wanted(f"{module}.weight"):
                yield f"{module}.weight", _dequantized(quant, module, slices)
            continue
        if wanted(name):
            yield name, CheckpointTensor(source)


def _dequantized(quant: Quantization, module: str, slices: dict[str, Any]) -> CheckpointTensor:
    present = {s: slices[f"{module}.{s}"] for s in STORED[quant.method] if f"{module}.{s}" in slices}
    shapes = {s: list(src.get_shape()) for s, src in present.items()}

    def read_one(suffix: str) -> Tensor:
        t: Tensor = present[suffix][:] if shapes[suffix] else present[suffix][()]
        return t

    shape = stored_shape(quant, module, shapes, read_one)

    def read() -> tuple[Tensor, QuantCodes | None]:
        try:
            return dequantize(quant, module, {s: read_one(s) for s in present})
        except (RuntimeError, IndexError) as e:  # the library's and torch's shape errors
            raise ValueError(f"{module}: its stored {quant.method} tensors do not fit together: {e}") from e

    return CheckpointTensor(QuantizedSource(shape, read))
