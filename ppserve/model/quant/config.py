"""A checkpoint's `quantization_config`, read once: which format its weights are stored in, at how many bits.

Three methods are read: compressed-tensors (what llm-compressor writes: `pack-quantized` int4/int8,
`int-quantized` and `float-quantized` int8/fp8, `naive-quantized`; its schemes are parsed by the
compressed-tensors library itself), GPTQ (4 and 8 bits, groups, `desc_act`) and AWQ (GEMM layout, 4 bits).
Anything else fails here, naming what is not supported, before a tensor is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# compressed-tensors formats whose weights ppserve reads (the others: nvfp4/mxfp packs, 2:4 sparsity).
COMPRESSED_TENSORS_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightQuant:
    """How one group of linear weights is stored: `kind` 'int' or 'float', `bits`, `group_size` (None: one
    scale per output channel or per tensor), `symmetric` (False: a zero point per group); and whether the
    scheme computes with int8 or FP8 activations."""

    kind: str
    bits: int
    group_size: int | None
    symmetric: bool
    int8_activations: bool = False  # the scheme quantizes activations to int8 per token, dynamically (W8A8)
    fp8_activations: bool = False  # the scheme quantizes activations to FP8, dynamic or static scales

    @property
    def compute(self) -> str:
        """The precision ppserve's GPU path multiplies its matmuls in: 'fp8' for FP8 weights (`_scaled_mm`
        quantizes the activations per token whatever the scheme says of them), 'int8' for INT8 W8A8
        (`_int_mm`), '' (the model dtype) for weight-only integer schemes."""
        if self.bits != 8:
            return ""
        if self.kind == "float":
            return "fp8"
        return "int8" if self.int8_activations else ""

    def bytes_per_weight(self, scale_bytes: int = 2) -> float:
        """Stored bytes per weight, its share of the scales and zero points included."""
        per_group = 0.0 if self.group_size is None else (scale_bytes + (0 if self.symmetric else 0.5))
        return self.bits / 8 + per_group / (self.group_size or 1)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: `method` ('compressed-tensors' | 'gptq' | 'awq'), its on-disk `format`,
    and each config group as (name, targets, WeightQuant). `raw` is the config as read, for the library
    that parses compressed-tensors schemes."""

    method: str
    format: str
    groups: tuple[tuple[str, tuple[str, ...], WeightQuant], ...]
    raw: dict[str, Any]
    gptq_v1_zeros: bool = False  # GPTQ's original layout stores every zero point minus one
    library_config: Any = field(default=None, compare=False)  # compressed-tensors' parsed QuantizationConfig

    def group_of(self, module: str) -> str:
        """The config group of checkpoint module `module` (a linear layer's HF name): the first whose
        targets match it (a class name such as 'Linear' matches every linear layer; 're:...' by regular
        expression)."""
        for name, targets, _ in self.groups:
            if any(not t.startswith("re:") or re.match(t[3:], module) for t in targets):
                return name
        raise ValueError(f"{module}: stored quantized, but no quantization_config group targets it")

    def scheme_for(self, module: str) -> WeightQuant:
        group = self.group_of(module)
        return next(scheme for name, _, scheme in self.groups if name == group)


def parse_quantization(hf_config: dict[str, Any]) -> Quantization | None:
    """The config.json's quantization, or None for a floating-point checkpoint (ValueError naming what is
    not supported)."""
    raw = hf_config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    raise ValueError(f"the checkpoint is quantized with quant_method={raw.get('quant_method')!r}, which "
                     "ppserve does not read (supported: compressed-tensors, gptq, awq)")


def _compressed_tensors(raw: dict[str, Any]) -> Quantization:
    from compressed_tensors.quantization import QuantizationConfig

    try:
        config = QuantizationConfig.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError names the fields
        raise ValueError(f"the checkpoint's compressed-tensors quantization_config is not valid: {e}") \
            from None
    fmt = config.format
    groups = []
    for name, scheme in config.config_groups.items():
        args = scheme.weights  # presets are expanded to schemes on validation
        if args is None:
            raise ValueError(f"compressed-tensors group {name!r} quantizes no weights")
        group_fmt = scheme.format or fmt
        if group_fmt not in COMPRESSED_TENSORS_FORMATS:
            raise ValueError(f"compressed-tensors format {group_fmt!r} (group {name!r}) is not supported; "
                             f"supported: {', '.join(COMPRESSED_TENSORS_FORMATS)}")
        kind = str(args.type.value if hasattr(args.type, "value") else args.type)
        if (kind, args.num_bits) not in (("int", 4), ("int", 8), ("float", 8)):
            raise ValueError(f"compressed-tensors group {name!r}: {kind}{args.num_bits} weights are not "
                             "supported (int4, int8 and fp8 are)")
        strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not "
                             "supported (tensor, channel and group are)")
        group = args.group_size if strategy == "group" else None
        targets = tuple(scheme.targets)
        acts = scheme.input_activations
        act_kind = None if acts is None else str(getattr(acts.type, "value", acts.type))
        int8_acts, fp8_acts = _activations(act_kind, getattr(acts, "num_bits", None),
                                           acts is not None and bool(acts.dynamic))
        scheme_of = WeightQuant(kind, args.num_bits, group, bool(args.symmetric), int8_acts, fp8_acts)
        groups.append((name, targets, scheme_of))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return Quantization("compressed-tensors", str(fmt), tuple(groups), raw, library_config=config)


def _activations(kind: str | None, bits: int | None, dynamic: bool) -> tuple[bool, bool]:
    """(int8_activations, fp8_activations) of a scheme whose input activations are quantized to `kind` at
    `bits` (None: not quantized). Int8 counts only with dynamic scales: the W8A8 path computes them per
    token at each call. FP8 counts with either: `_scaled_mm` scales activations per token anyway."""
    return kind == "int" and bits == 8 and dynamic, kind == "float" and bits == 8


def _group_size(raw: dict[str, Any], method: str) -> int | None:
    size = int(raw.get("group_size", -1))
    if size == -1:
        return None
    if size <= 0:
        raise ValueError(f"{method} group_size must be positive or -1, got {size}")
    return size


def _gptq(raw: dict[str, Any]) -> Quantization:
    bits = int(raw.get("bits", 0))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (4 and 8 are)")
    fmt = str(raw.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)")
    scheme = WeightQuant("int", bits, _group_size(raw, "GPTQ"), bool(raw.get("sym", True)))
    return Quantization("gptq", fmt, (("gptq", ("Linear",), scheme),), raw, gptq_v1_zeros=fmt == "gptq")


def _awq(raw: dict[str, Any]) -> Quantization:
    bits = int(raw.get("bits", raw.get("w_bit", 0)))
    version = str(raw.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"AWQ {bits}-bit {version!r} is not supported (4-bit GEMM layout is)")
    size = _group_size({"group_size": raw.get("group_size", raw.get("q_group_size", -1))}, "AWQ")
    scheme = WeightQuant("int", 4, size, not bool(raw.get("zero_point", True)))
    return Quantization("awq", "gemm", (("awq", ("Linear",), scheme),), raw)


def _raw_scheme(hf_config: dict[str, Any]) -> WeightQuant | None:
    """The first group's scheme, read from the raw config without importing torch or compressed-tensors
    (for the planner); None for a floating-point checkpoint. A compressed-tensors group given as a preset
    name ('W4A16', 'W8A8', 'FP8_DYNAMIC') is read by its name."""
    raw = hf_config.get("quantization_config")
    if not isinstance(raw, dict):
        return None
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method in ("gptq", "awq"):
        return (_gptq if method == "gptq" else _awq)(raw).groups[0][2]
    if method != "compressed-tensors":
        return None
    for name, group in (raw.get("config_groups") or {}).items():
        if isinstance(group, dict) and isinstance(group.get("weights"), dict):
            w, a = group["weights"], group.get("input_activations")
            size = w.get("group_size") if w.get("strategy") == "group" else None
            acts = (_activations(str(a.get("type", "int")), int(a.get("num_bits", 8)), bool(a.get("dynamic")))
                    if isinstance(a, dict) else (False, False))
            return WeightQuant(str(w.get("type", "int")), int(w["num_bits"]), size,
                               bool(w.get("symmetric", True)), *acts)
        upper = str(name).upper()
        if upper.startswith("FP8"):  # every FP8 preset quantizes activations to FP8 too
            return WeightQuant("float", 8, None, True, fp8_activations=True)
        preset = re.match(r"W(\d+)A(\d*)|INT8", upper)  # INT8 is W8A8's other name
        if preset is not None:
            bits, act_bits = (int(preset.group(1)), preset.group(2)) if preset.group(1) else (8, "8")
            return WeightQuant("int", bits, 128 if bits < 8 else None, True, int8_activations=act_bits == "8")
    return None


def stored_weight_bytes(hf_config: dict[str, Any]) -> float | None:
    """Bytes a quantized checkpoint stores per linear weight (scales included), for the planner; None for a
    floating-point one."""
    scheme = _raw_scheme(hf_config)
    return None if scheme is None else scheme.bytes_per_weight()


def linear_compute(hf_config: dict[str, Any]) -> str:
    """The precision a checkpoint's linear layers multiply in, for the planner (ModelSpec.linear_compute):
    'fp8' for FP8 weights with FP8 input activations, 'int8' for W8A8 int8, '' (the model dtype) for
    weight-only schemes (W4A16, W8A16, GPTQ, AWQ) and floating-point checkpoints."""
    scheme = _raw_scheme(hf_config)
    return "" if scheme is None else scheme.compute
