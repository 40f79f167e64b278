"""Building-block layers of a Llama-family decoder that know their tensor-parallel shard.

Every parallel layer takes the FULL Hugging Face tensor in `weight_loader` (a tensor, or a lazily read
`CheckpointTensor` indexed the same way, so only the shard is read from disk) and keeps only the slice
its TP rank owns, so the loader never needs to know how a layer is sharded. At TP size 1 each layer
is an ordinary dense layer.

Linear layers own their fast path (a `PackedWeight`, ppserve/model/ops/gemm.py), and the element-wise
work goes through the op table (ppserve/model/ops): native kernels where they take the input, torch
otherwise.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppserve.model import ops
from ppserve.model.checkpoint_tensor import CheckpointTensor, as_tensor
from ppserve.model.ops import native
from ppserve.model.ops.gemm import PackedWeight, can_prepack
from ppserve.model.ops.quant_gemm import QuantizedLinear, int8_codes, join_rows
from ppserve.model.ops.settings import current
from ppserve.model.parallel import TPContext
from ppserve.model.quant.codes import CODE_PARTS, QuantCodes, codes_of

logger = logging.getLogger(__name__)


@functools.cache
def _warn_no_int8_kernel(device: str, dtype: str) -> None:
    logger.warning("model.quantization=int8: torch has no int8 weight-only kernel on %s for %s; the linear "
                   "layers keep their float weights", device, dtype)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Weights are always overwritten by the loader, so skip the cost of a random init.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy_checked(param: nn.Parameter, shard: Tensor | CheckpointTensor, what: str) -> None:
    if param.shape != shard.shape:
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(shard.shape)}")
    window = as_tensor(shard)
    with torch.no_grad():
        param.copy_(window)
    _keep_codes(param, 0, window)


def _keep_codes(param: nn.Parameter, row_offset: int, window: Tensor) -> None:
    """Remember the integer codes a quantized checkpoint's window carries, at the rows it fills, for the
    layer's `prepack` (ppserve/model/quant/codes.py)."""
    codes = codes_of(window)
    if codes is not None:
        parts: list[tuple[int, QuantCodes]] = getattr(param, CODE_PARTS, [])
        parts.append((row_offset, codes))
        setattr(param, CODE_PARTS, parts)


def _quantized(weight: nn.Parameter) -> QuantizedLinear | None:
    """The layer's weight packed for an integer kernel: the checkpoint's own codes where it loaded a
    quantized layer, int8 codes made here under `model.quantization: int8`, else None (the float weight
    serves). Once packed, the float copy is released (a one-element stand-in keeps its shape)."""
    parts: list[tuple[int, QuantCodes]] | None = getattr(weight, CODE_PARTS, None)
    if parts is not None:
        delattr(weight, CODE_PARTS)
        codes = join_rows(parts, weight.shape[0])
        packed = None if codes is None else QuantizedLinear.build(codes, weight.dtype, weight.device)
    elif current().quantization == "int8":
        packed = QuantizedLinear.build(int8_codes(weight), weight.dtype, weight.device, float32_ok=True)
        if packed is None:
            _warn_no_int8_kernel(str(weight.device), str(weight.dtype))
    else:
        return None
    if packed is not None:
        weight.data = weight.data.new_empty(1).expand(weight.shape)
    return packed


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty((hidden_size,), dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(x + y, norm(x + y)): the residual add and the norm after it, one pass in bf16. Neither input
        is modified (x may be a tensor the caller still holds, such as a stage's received input)."""
        return ops.add_rms_norm(x, y, self.weight, self.eps)

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        _copy_checked(param, full, "RMSNorm.weight")


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------

def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths divided by `factor`, short kept, smooth between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] for the HF rope variants ppserve supports."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        # Linear interpolation divides positions by `factor`; dividing frequencies is the same thing.
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Non-interleaved (HF "rotate_half") rotary embedding applied at explicit token positions.

    `cos_sin(positions)` is computed once per forward pass and shared by every layer; `apply` rotates
    any number of heads at once (the model rotates q and k together, they are adjacent in the QKV output).
    """

    inv_freq: Tensor  # the buffer registered in __init__

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.head_dim = head_dim
        # float32 buffer, not a parameter: it is derived from the config, never loaded.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling).to(device), persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in `dtype` (computed in float32 like the reference, then
        cast)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)

    # Shadows nn.Module.apply(fn) on purpose (the name the models and tests call): ppserve never walks a model
    # with Module.apply, which would reach this instead.
    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor, inplace: bool = False) -> Tensor:  # type: ignore[override]
        """x [T, H, D] -> rotated x. With `inplace` the fused kernel may rotate x itself (bf16 on CPU)."""
        return ops.rope_(x, cos, sin) if inplace else ops.rope(x, cos, sin)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated (q, k)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel linear layers
# ---------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPContext = TPContext(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.out_start, self.out_end = tp.shard_range(out_features)
        self.weight = _empty((self.out_end - self.out_start, in_features), dtype, device)
        self.bias = _empty((self.out_end - self.out_start,), dtype, device) if bias else None
        self.fast = PackedWeight()
        self.quant: QuantizedLinear | None = None  # set by prepack() where an integer kernel serves

    def prepack(self) -> None:
        self.quant = self.quant or _quantized(self.weight)
        if self.quant is None:
            self.fast.pack(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        return self.fast.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        _copy_checked(param, full[self.out_start:self.out_end], "ColumnParallelLinear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM (gate and up).

    Each rank's weight is [shard of proj 0; shard of proj 1; ...] so the output splits locally.
    `silu_mul` runs the gate/up pair with the activation in the GEMM's epilogue where a panel kernel (AMX
    or AVX512-BF16, `native.panel_gemm`) takes the weight (a layout whose panels alternate gate and up),
    and returns None elsewhere.
    """

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False,
                 tp: TPContext = TPContext(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype, device)
        self.gate_up_panels: Tensor | None = None  # set by prepack() where the fused panel path applies
        self.gate_up_kernel: str | None = None  # the panel kernel that packed it
        self.out_sizes = list(out_sizes)
        self.local_sizes = [s // tp.size for s in out_sizes]
        for s in out_sizes:
            tp.shard_range(s)  # validates divisibility of each part

    def prepack(self) -> None:
        self.quant = self.quant or _quantized(self.weight)
        kernel = native.panel_gemm() if self.quant is None and can_prepack(self.weight) else None
        if (kernel is not None and kernel.accepts(self.weight) and self.bias is None
                and len(self.local_sizes) == 2 and self.local_sizes[0] == self.local_sizes[1]
                and self.local_sizes[0] % 16 == 0):
            self.gate_up_panels, self.gate_up_kernel = kernel.pack_gate_up(self.weight), kernel.kernel
            # one copy: the model only calls `silu_mul`; a plain forward is F.linear
            self.fast = PackedWeight()
        else:
            self.gate_up_panels = self.gate_up_kernel = None
            if self.quant is None:
                self.fast.pack(self.weight)

    def silu_mul(self, x: Tensor) -> Tensor | None:
        """silu(gate) * up [T, I_local] in one pass over the GEMM's output, or None where not available."""
        if self.gate_up_panels is None or x.dtype != torch.bfloat16 or x.dim() != 2:
            return None
        kernel = native.panel_gemm(self.gate_up_kernel)
        assert kernel is not None  # it packed the weight
        return kernel(x, self.gate_up_panels, None, silu_mul=True)

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an integer shard_id, got {shard_id!r}")
        start, end = self.tp.shard_range(self.out_sizes[shard_id])
        offset = sum(self.local_sizes[:shard_id])
        _copy_checked_slice(param, offset, full[start:end], f"merged part {shard_id}")


def _copy_checked_slice(param: nn.Parameter, offset: int, shard: Tensor, what: str) -> None:
    dst = param.data.narrow(0, offset, shard.shape[0])
    if dst.shape != shard.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(shard.shape)}")
    with torch.no_grad():
        dst.copy_(shard)
    _keep_codes(param, offset, shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections (one GEMM); each rank holds its own query and key/value heads.

    When there are fewer KV heads than TP ranks, KV heads are replicated: rank r uses KV head
    r * num_kv_heads // tp.size, which keeps each rank's query heads paired with the right KV head.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPContext = TPContext(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if num_heads % tp.size != 0:
            raise ValueError(f"num_heads {num_heads} is not divisible by TP size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size != 0:
            raise ValueError(f"num_kv_heads {num_kv_heads} is not divisible by TP size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads != 0:
            raise ValueError(f"TP size {tp.size} is not a multiple of num_kv_heads {num_kv_heads}")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_local = num_heads // tp.size
        self.num_kv_heads_local = max(1, num_kv_heads // tp.size)
        local_out = (self.num_heads_local + 2 * self.num_kv_heads_local) * head_dim
        # Build as a plain layer of the local size; the base class's even split is not used here.
        super().__init__(hidden_size, local_out * tp.size, bias, tp, dtype, device)
        self.q_size = self.num_heads_local * head_dim
        self.kv_size = self.num_kv_heads_local * head_dim

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            start = self.tp.rank * self.num_heads_local * d
            _copy_checked_slice(param, 0, full[start:start + self.q_size], "q_proj")
            return
        if shard_id not in ("k", "v"):
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        if self.num_kv_heads >= self.tp.size:
            first_head = self.tp.rank * self.num_kv_heads_local
        else:
            first_head = self.tp.rank * self.num_kv_heads // self.tp.size
        start = first_head * d
        offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        _copy_checked_slice(param, offset, full[start:start + self.kv_size], f"{shard_id}_proj")

    def split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (local heads)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        return (q.reshape(t, self.num_heads_local, self.head_dim),
                k.reshape(t, self.num_kv_heads_local, self.head_dim),
                v.reshape(t, self.num_kv_heads_local, self.head_dim))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP ranks; partial sums are all-reduced here."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPContext = TPContext(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tp = tp
        self.in_start, self.in_end = tp.shard_range(in_features)
        self.weight = _empty((out_features, self.in_end - self.in_start), dtype, device)
        # The bias is replicated and added once, after the reduction.
        self.bias = _empty((out_features,), dtype, device) if bias else None
        self.fast = PackedWeight()
        self.quant: QuantizedLinear | None = None  # set by prepack() where an integer kernel serves

    def prepack(self) -> None:
        self.quant = self.quant or _quantized(self.weight)
        if self.quant is None:
            self.fast.pack(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        y = self.quant.linear(x, None) if self.quant is not None else self.fast.linear(x, self.weight, None)
        y = self.tp.all_reduce(y)  # the one collective inside a decoder layer's forward
        if self.bias is not None:
            y = y + self.bias
        return y

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        if param is self.bias:
            _copy_checked(param, full, "RowParallelLinear.bias")
        else:
            _copy_checked(param, full[:, self.in_start:self.in_end], "RowParallelLinear.weight")


# ---------------------------------------------------------------------------------------------
# Vocabulary-parallel embedding and LM head
# ---------------------------------------------------------------------------------------------

class _VocabShard(nn.Module):
    """Shared sharding of a [vocab, hidden] matrix: vocab padded to a multiple of tp.size, split evenly."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)  # ceil division
        self.vocab_start = tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)
        self.weight = _empty((self.per_rank, hidden_size), dtype, device)

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"vocab matrix has {full.shape[0]} rows, expected {self.vocab_size}")
        with torch.no_grad():
            param.zero_()  # padding rows stay zero
        _copy_checked_slice(param, 0, full[self.vocab_start:self.vocab_end], "vocab shard")


class VocabParallelEmbedding(_VocabShard):
    """Token embedding with the vocabulary split over TP ranks; ranks sum their partial lookups."""

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * owned  # ids of other ranks read row 0, masked below
        out = F.embedding(local_ids, self.weight) * owned[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    """LM head with the vocabulary split over TP ranks; logits are gathered back to the full vocab."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype, device)
        self.fast = PackedWeight()

    def prepack(self) -> None:
        self.fast.pack(self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        """[N, H] -> [N, vocab] float32 logits over the whole vocabulary, on every TP rank."""
        local = self.fast.linear(hidden, self.weight, None)  # [N, per_rank]
        full = self.tp.all_gather_last_dim(local)  # [N, per_rank * tp.size]
        return full[:, :self.vocab_size].float()

    def logits_on_first_rank(self, hidden: Tensor) -> Tensor | None:
        """The same logits on TP rank 0 only (None elsewhere): the one rank that samples."""
        full = self.tp.gather_last_dim_to_first(self.fast.linear(hidden, self.weight, None))
        return None if full is None else full[:, :self.vocab_size].float()


def prime_linear_paths(model: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
    """Choose every linear layer's GEMM path at every row bucket a microbatch of this stage can reach
    (`PackedWeight.prime`): up to `max_tokens` rows for the decoder layers, `max_logit_rows` for the LM
    head (only rows that get logits reach it). Run at warm-up, so that no serving step times paths; returns
    the (weight, bucket) pairs timed. Each layer passes what its forward passes (a row-parallel bias is
    added after the reduction, outside the GEMM)."""
    timed = 0
    for module in model.modules():
        fast = getattr(module, "fast", None)
        if not isinstance(fast, PackedWeight):
            continue
        rows = max_logit_rows if isinstance(module, ParallelLMHead) else max_tokens
        # nn.Module types its attributes Tensor | Module; a linear layer's are its weight and bias tensors
        weight = cast(Tensor, module.weight)
        bias = (None if isinstance(module, (RowParallelLinear, ParallelLMHead))
                else cast("Tensor | None", module.bias))
        timed += fast.prime(weight, bias, rows)
    return timed
