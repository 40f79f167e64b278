"""Quantized checkpoints load and compute what transformers computes from the same checkpoint.

compressed-tensors checkpoints are compared with transformers' own decompression of them; GPTQ and AWQ
(which transformers reads only through libraries not installed here) with transformers on the float
weights their codes encode. Weights are dequantized at load, so in float32 the logits are the reference's
to float32 rounding, at every pipeline cut and at TP 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_helpers import (
    TP_PROMPTS,
    PagedRunner,
    hf_logits,
    hf_model,
    load_stages,
    make_tiny_llama_dir,
    make_tiny_qwen3_dir,
    tp_scenario,
    tp_worker,
)
from tests.quant_helpers import awq_copy, compressed_tensors_copy, gptq_copy, hf_dequantized

pytest.importorskip("compressed_tensors")

PROMPT = [5, 17, 99, 3, 250, 42, 8, 61, 77, 12, 200, 31, 4, 4, 9]
# (preset, format, group size): every weight layout ppserve reads from compressed-tensors.
CT_SCHEMES = [("W4A16", "pack-quantized", 32), ("W4A16_ASYM", "pack-quantized", 32),
              ("W8A16", "pack-quantized", 32), ("W8A8", "int-quantized", None),
              ("FP8", "float-quantized", None), ("FP8_DYNAMIC", "float-quantized", None)]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("quant") / "float", num_layers=3)


def _pp_logits(model_dir: Path, cuts: list[int]) -> torch.Tensor:
    return PagedRunner(load_stages(model_dir, cuts)).run_chunked(0, PROMPT, 6)


@pytest.mark.parametrize("preset,fmt,group", CT_SCHEMES, ids=[s[0] for s in CT_SCHEMES])
def test_compressed_tensors_match_transformers(float_dir: Path, tmp_path: Path, preset: str, fmt: str,
                                               group: int | None) -> None:
    qdir = compressed_tensors_copy(float_dir, tmp_path / preset, preset, fmt, group)
    expected = hf_logits(hf_dequantized(qdir), PROMPT)
    assert not torch.allclose(expected, hf_logits(hf_model(float_dir), PROMPT), atol=1e-3), \
        "quantization changed nothing: the test would not see a float load"
    for cuts in ([0, 3], [0, 1, 3], [0, 1, 2, 3]):  # pp 1, 2, 3
        torch.testing.assert_close(_pp_logits(qdir, cuts), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,sym,desc_act", [(4, True, True), (4, False, False), (8, True, False)])
def test_gptq_matches_its_dequantized_weights(float_dir: Path, tmp_path: Path, bits: int, sym: bool,
                                              desc_act: bool) -> None:
    qdir, ref = gptq_copy(float_dir, tmp_path / "gptq", tmp_path / "ref", bits, 32, sym, desc_act)
    expected = hf_logits(hf_model(ref), PROMPT)
    torch.testing.assert_close(_pp_logits(qdir, [0, 3]), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_pp_logits(qdir, [0, 2, 3]), expected, rtol=1e-5, atol=1e-5)


def test_awq_matches_its_dequantized_weights(float_dir: Path, tmp_path: Path) -> None:
    qdir, ref = awq_copy(float_dir, tmp_path / "awq", tmp_path / "ref", 32)
    expected = hf_logits(hf_model(ref), PROMPT)
    torch.testing.assert_close(_pp_logits(qdir, [0, 1, 3]), expected, rtol=1e-5, atol=1e-5)


def test_moe_experts_quantized_per_expert(tmp_path: Path) -> None:
    """A Qwen3-MoE whose attention, dense MLP and every expert are W4A16 (the Hub's per-expert layout, as
    llm-compressor writes it): transformers' logits on the weights they encode, at pp 1 and 2."""
    from tests.quant_helpers import dequantized_copy

    float_moe = make_tiny_qwen3_dir(tmp_path / "moe", num_layers=2, dense_layers=(1,))
    qdir = compressed_tensors_copy(float_moe, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    assert any(".experts.3.down_proj.weight_packed" in n for n in _tensor_names(qdir))
    expected = hf_logits(hf_model(dequantized_copy(qdir, tmp_path / "ref")), PROMPT)
    for cuts in ([0, 2], [0, 1, 2]):
        torch.testing.assert_close(_pp_logits(qdir, cuts), expected, rtol=1e-5, atol=1e-5)


def _tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("fmt,dtype", [("w4a16", "float32"), ("w4a16", "bfloat16"),
                                       ("gptq-desc-act", "float32"), ("awq", "bfloat16"),
                                       ("gptq-desc-act", "bfloat16"), ("moe-w4a16", "bfloat16")])
def test_tp2_shards_a_quantized_checkpoint(float_dir: Path, tmp_path: Path, fmt: str, dtype: str) -> None:
    """Two gloo ranks each load their shard of a quantized checkpoint (in bf16, their shard of the codes,
    on the int4 kernel; for an MoE, each expert's slice): the same logits as one rank, to float32
    rounding or bf16 tolerance."""
    from ppserve.model.loader import load_stage_model

    if fmt == "moe-w4a16":  # every layer sparse, each rank's expert slice 32 wide: one group of 32
        moe = make_tiny_qwen3_dir(tmp_path / "moe", num_layers=2, dense_layers=(), expert_intermediate=64)
        qdir = compressed_tensors_copy(moe, tmp_path / "q", "W4A16", "pack-quantized", 32)
        assert all(b.quantized is not None for b in _moe_blocks(load_stage_model(qdir, 0, 2,
                                                                                   dtype=torch.bfloat16)))
    elif fmt == "w4a16":
        qdir = compressed_tensors_copy(float_dir, tmp_path / "q", "W4A16_ASYM", "pack-quantized", 32)
    elif fmt == "awq":
        qdir, _ = awq_copy(float_dir, tmp_path / "q", tmp_path / "ref", 32)
    else:
        qdir, _ = gptq_copy(float_dir, tmp_path / "q", tmp_path / "ref", 4, 32, sym=True, desc_act=True)
    layers = 2 if fmt.startswith("moe") else 3
    single = tp_scenario(load_stage_model(qdir, 0, layers, dtype=getattr(torch, dtype)))
    mp.spawn(tp_worker, args=(2, str(tmp_path / "init"), str(qdir), TP_PROMPTS, str(tmp_path), dtype),
             nprocs=2, join=True)
    for got, want in zip(torch.load(tmp_path / "logits.pt"), single, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            _agrees(got.float(), want.float())


def test_group_that_splits_a_tp_shard_names_the_layer(float_dir: Path, tmp_path: Path) -> None:
    """Groups of 64 over o_proj's 64 input columns cannot be split over 2 ranks: the load says where."""
    from ppserve.model.loader import load_stage_model
    from ppserve.model.parallel import TPContext

    qdir = compressed_tensors_copy(float_dir, tmp_path / "g64", "W4A16", "pack-quantized", 64)
    with pytest.raises(ValueError, match=r"o_proj.weight \(TP rank 1 of 2\).*group size 64"):
        load_stage_model(qdir, 0, 3, TPContext(rank=1, size=2, group=object()))


def test_greedy_output_equals_transformers_through_the_engine(float_dir: Path, tmp_path: Path) -> None:
    """The whole engine at pp 2 on a W4A16 checkpoint: greedy tokens equal transformers' on it."""
    from tests.oracle import greedy_continuations, ppserve_greedy, random_prompts

    qdir = compressed_tensors_copy(float_dir, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    prompts = random_prompts(3, [9, 23, 4])
    expected = greedy_continuations(hf_dequantized(qdir), prompts, 12)
    got, _ = ppserve_greedy(qdir, prompts, 12, executor="inproc", pipeline_parallel_size=2,
                            token_budget=16)
    assert got == expected


def _with_quant(float_dir: Path, dst: Path, quantization_config: dict) -> Path:
    import shutil

    shutil.copytree(float_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'.*compressed-tensors, gptq, awq"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "quantization_config is not valid"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ 4-bit 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "float", "group_size": 16, "strategy": "group"}}}},
     "format 'nvfp4-pack-quantized'"),
    # group activation ordering (weight_g_idx): compressed-tensors itself no longer reads it
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "actorder": "group"}}}},
     "(?s)not valid.*actorder='group' has been removed"),
])
def test_unsupported_quantization_fails_before_loading(float_dir: Path, tmp_path: Path,
                                                       quantization_config: dict, message: str) -> None:
    from ppserve.model.loader import read_hf_config
    from ppserve.model.registry import describe_model

    qdir = _with_quant(float_dir, tmp_path / "bad", quantization_config)
    with pytest.raises(ValueError, match=message):
        describe_model(read_hf_config(qdir))


def test_broken_quantized_tensors_name_the_layer(float_dir: Path, tmp_path: Path) -> None:
    """A missing scale tensor and a weight_shape that disagrees with the config fail naming the tensor."""
    from safetensors.torch import load_file, save_file

    qdir = compressed_tensors_copy(float_dir, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    state = load_file(qdir / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight_shape"] = torch.tensor([128, 32])
    save_file(state, qdir / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj|up_proj|shape"):
        load_stages(qdir, [0, 3])
    state.pop("model.layers.1.mlp.up_proj.weight_shape")
    state.pop("model.layers.0.self_attn.o_proj.weight_packed")
    save_file(state, qdir / "model.safetensors")
    with pytest.raises(ValueError, match="layers.0.self_attn.o_proj"):
        load_stages(qdir, [0, 3])


# ---- bf16: the integer kernels ----------------------------------------------------------------------

def _bf16_stage(model_dir: Path):
    from ppserve.model.loader import iter_weights, read_hf_config
    from ppserve.model.registry import build_stage_model, describe_model

    arch = describe_model(read_hf_config(model_dir))
    model = build_stage_model(arch, 0, arch.num_layers, dtype=torch.bfloat16)
    model.load_weights(iter_weights(model_dir, 0, arch.num_layers, arch.num_layers, need_embed=True,
                                    need_head=True))
    return model.eval()


def _bf16_logits(model) -> torch.Tensor:
    return PagedRunner([model], dtype=torch.bfloat16).run_chunked(0, PROMPT, 6).float()


def _linear_kinds(model) -> set[str | None]:
    from ppserve.model.layers import ColumnParallelLinear, RowParallelLinear

    return {m.quant.kind if m.quant is not None else None for m in model.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _agrees(got: torch.Tensor, want: torch.Tensor, tolerance: float = 0.05) -> None:
    """bf16 tolerance: within 5 % of the largest logit (`tolerance`), the same top token at 80 % of
    positions or more."""
    assert float((got - want).abs().max()) <= tolerance * float(want.abs().max())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.parametrize("preset,fmt,kind,bytes_ratio,tolerance", [
    ("W4A16", "pack-quantized", "int4", 0.35, 0.05), ("W4A16_ASYM", "pack-quantized", "int4", 0.35, 0.05),
    ("W8A8", "int-quantized", "int8", 0.55, 0.08)])
def test_bf16_serves_on_the_integer_kernels(float_dir: Path, tmp_path: Path, preset: str, fmt: str, kind: str,
                                            bytes_ratio: float, tolerance: float) -> None:
    """In bf16 every linear layer keeps the checkpoint's codes packed for torch's kernel (its float copy
    released) and agrees with transformers' float32 reading of the checkpoint to bf16 tolerance (W8A8 to
    8 %: its prefill chunks quantize activations to int8, which transformers' reading does not)."""
    qdir = compressed_tensors_copy(float_dir, tmp_path / preset, preset, fmt, 32)
    model, plain = _bf16_stage(qdir), _bf16_stage(float_dir)
    assert _linear_kinds(model) == {kind}
    w8a8 = {m.quant.int8_activations for m in model.modules() if getattr(m, "quant", None) is not None}
    assert w8a8 == {preset == "W8A8"}
    ends = sum(p.numel() * 2 for n, p in plain.named_parameters() if "layers." not in n)
    assert model.weight_bytes() - ends <= bytes_ratio * (plain.weight_bytes() - ends)
    _agrees(_bf16_logits(model), hf_logits(hf_dequantized(qdir), PROMPT), tolerance)


def _moe_blocks(model) -> list:
    from ppserve.model.moe import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def test_bf16_moe_experts_run_the_int4_kernel(tmp_path: Path) -> None:
    """In bf16 a W4A16 MoE's experts run torch's int4 kernel one expert at a time, their float weights
    released: the experts' bytes drop to under a third of bf16's, the logits agree with transformers' on
    the weights the checkpoint encodes, and a one-token step (its own path) equals that token's row of a
    many-token step to kernel rounding."""
    from tests.quant_helpers import dequantized_copy

    float_moe = make_tiny_qwen3_dir(tmp_path / "moe", num_layers=2, dense_layers=(1,))
    qdir = compressed_tensors_copy(float_moe, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    model, plain = _bf16_stage(qdir), _bf16_stage(float_moe)
    (block,), (plain_block,) = _moe_blocks(model), _moe_blocks(plain)
    assert block.quantized is not None and plain_block.quantized is None
    assert not block.capturable and block.panels is None
    float_bytes = sum(p.numel() * 2 for p in plain_block.experts.parameters())
    held = sum(p.untyped_storage().nbytes() for p in block.experts.parameters())
    assert held + sum(q.nbytes for q in block.quantized) <= 0.33 * float_bytes
    _agrees(_bf16_logits(model), hf_logits(hf_model(dequantized_copy(qdir, tmp_path / "ref")), PROMPT))
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(block(x[2:3]), block(x)[2:3], rtol=0.02, atol=0.02)


def test_a_long_prefill_chunk_multiplies_dequantized_int4(float_dir: Path, tmp_path: Path) -> None:
    """A 150-token prefill chunk takes the dequantized int4 path in every linear layer (k/v's 32 rows
    aside, which the kernel keeps): the logits still agree with transformers' reading of the checkpoint,
    to 7 % of the largest logit (the float model in bf16 needs over 5 % at this length too)."""
    from ppserve.model.ops import int4_dequant

    qdir = compressed_tensors_copy(float_dir, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    model = _bf16_stage(qdir)
    layers = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    assert sum(q.dequantizes for q in layers) >= len(layers) // 2
    prompt = torch.randint(3, 250, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    assert int4_dequant.layout_known()
    got = PagedRunner([model], dtype=torch.bfloat16).run_chunked(0, prompt, 150).float()
    _agrees(got, hf_logits(hf_dequantized(qdir), prompt), 0.07)


@pytest.mark.parametrize("method", ["gptq", "gptq-desc-act", "awq"])
def test_bf16_gptq_and_awq_run_the_int4_kernel(float_dir: Path, tmp_path: Path, method: str) -> None:
    """Every linear layer on the int4 kernel: GPTQ's shuffled groups (`desc_act`) too, their columns
    sorted into runs at packing and the activations gathered to match."""
    if method.startswith("gptq"):
        qdir, ref = gptq_copy(float_dir, tmp_path / "q", tmp_path / "ref", 4, 32, sym=False,
                              desc_act=method == "gptq-desc-act")
    else:
        qdir, ref = awq_copy(float_dir, tmp_path / "q", tmp_path / "ref", 32)
    model = _bf16_stage(qdir)
    assert _linear_kinds(model) == {"int4"}
    permuted = {m.quant.perm is not None for m in model.modules() if getattr(m, "quant", None) is not None}
    assert permuted == {method == "gptq-desc-act"}
    _agrees(_bf16_logits(model), hf_logits(hf_model(ref), PROMPT))


def test_codes_dequantize_to_the_librarys_weights(float_dir: Path, tmp_path: Path) -> None:
    """The codes kept for the kernels encode exactly the weight the library decompresses, per format."""
    from ppserve.model.loader import iter_weights
    from ppserve.model.quant.codes import codes_of

    for preset, fmt in (("W4A16_ASYM", "pack-quantized"), ("W4A16", "pack-quantized"),
                        ("W8A8", "int-quantized")):
        qdir = compressed_tensors_copy(float_dir, tmp_path / preset, preset, fmt, 32)
        for name, tensor in iter_weights(qdir, 0, 3, 3, need_embed=False, need_head=False):
            if not name.endswith("proj.weight"):
                continue
            window = tensor[:]
            codes = codes_of(window)
            assert codes is not None, name
            g = codes.group_size
            scales = codes.scales.float().repeat_interleave(g, 1)
            zeros = codes.zeros.float().repeat_interleave(g, 1)
            torch.testing.assert_close((codes.q.float() - zeros) * scales, window.float(), rtol=0, atol=0)


def test_on_the_fly_int8_halves_the_linear_weights(float_dir: Path) -> None:
    """`model.quantization: int8` on a float checkpoint: int8 kernels, about half bf16's bytes, and
    transformers' float32 logits to int8-and-bf16 tolerance."""
    from ppserve.model.ops import settings

    before = settings.current()
    plain = _bf16_stage(float_dir)
    settings.configure(settings.KernelSettings(quantization="int8"))
    try:
        model = _bf16_stage(float_dir)
    finally:
        settings.configure(before)
    assert _linear_kinds(model) == {"int8"} and _linear_kinds(plain) == {None}
    ends = sum(p.numel() * 2 for n, p in plain.named_parameters() if "layers." not in n)
    assert model.weight_bytes() - ends <= 0.55 * (plain.weight_bytes() - ends)
    _agrees(_bf16_logits(model), hf_logits(hf_model(float_dir), PROMPT))


def test_on_the_fly_int8_covers_the_experts(tmp_path: Path) -> None:
    """`model.quantization: int8` on a float MoE: every expert on the int8 kernel too, and transformers'
    float32 logits to int8-and-bf16 tolerance."""
    from ppserve.model.ops import settings

    float_moe = make_tiny_qwen3_dir(tmp_path / "moe", num_layers=2, dense_layers=(1,))
    before = settings.current()
    settings.configure(settings.KernelSettings(quantization="int8"))
    try:
        model = _bf16_stage(float_moe)
    finally:
        settings.configure(before)
    (block,) = _moe_blocks(model)
    assert block.quantized is not None
    assert {q.kind for experts in block.quantized for q in experts.each} == {"int8"}
    _agrees(_bf16_logits(model), hf_logits(hf_model(float_moe), PROMPT))


def test_int8_of_a_quantized_checkpoint_is_refused(float_dir: Path, tmp_path: Path) -> None:
    from ppserve import LLM

    qdir = compressed_tensors_copy(float_dir, tmp_path / "w4", "W4A16", "pack-quantized", 32)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(qdir), quantization="int8", executor="inproc")


def test_fp8_scaled_mm_path_matches_the_dequantized_weight() -> None:
    """The CUDA FP8 path (`_scaled_mm`, per-token activation scales), run where torch also has it, on
    CPU: within FP8 activation rounding of the dequantized weight's product."""
    from ppserve.model.ops.quant_gemm import QuantizedLinear
    from ppserve.model.quant.codes import from_fp8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * 0.1
    scale = w.abs().amax(1, keepdim=True) / 448
    codes = from_fp8((w / scale).to(torch.float8_e4m3fn), scale)
    assert codes is not None
    fp8 = QuantizedLinear.fp8(codes, torch.device("cpu"))
    assert fp8 is not None and fp8.nbytes < w.numel() * 2 * 0.55
    x = torch.randn(5, 64, generator=gen).bfloat16()
    want = x.double() @ (codes.q.double() * scale.double()).t()
    got = fp8.linear(x, None).double()
    assert float((got - want).abs().max()) <= 0.06 * float(want.abs().max())


def test_int_mm_pads_few_rows_to_a_fixed_shape() -> None:
    """The W8A8 CUDA path pads fewer than CUDA_INT_MM_MIN_ROWS rows with zeros (cuBLAS's int8 GEMM takes
    more than 16): the rows it returns are the unpadded product's, exactly, at every row count."""
    from ppserve.model.ops.quant_gemm import CUDA_INT_MM_MIN_ROWS, int_mm

    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    for rows in (1, 5, 17, CUDA_INT_MM_MIN_ROWS, 40):
        x = torch.randint(-127, 128, (rows, 64), generator=gen, dtype=torch.int8)
        got = int_mm(x, w, CUDA_INT_MM_MIN_ROWS)
        assert got.shape == (rows, 48)
        assert torch.equal(got, x.int() @ w.int().t())


def test_many_rows_multiply_the_int4_weight_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """From INT4_DEQUANT_MIN_ROWS rows a CPU int4 layer multiplies its weight dequantized from the kernel's
    own packing, a block of output rows at a time (here three blocks): within bf16 rounding of float64 on
    the weight the codes encode, as the kernel is below those rows. This torch packs as it is read."""
    from ppserve.gpu_check.kernels import _int4_codes
    from ppserve.model.ops import int4_dequant
    from ppserve.model.ops.quant_gemm import INT4_DEQUANT_MIN_ROWS, QuantizedLinear

    assert int4_dequant.layout_known(), "torch's CPU int4 packing changed: int4_dequant cannot read it"
    monkeypatch.setattr(int4_dequant, "BLOCK_ROWS", 128)
    calls: list[int] = []
    original = int4_dequant.dequantized_matmul

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return original(*args)

    monkeypatch.setattr(int4_dequant, "dequantized_matmul", counted)
    gen = torch.Generator().manual_seed(0)
    codes, w = _int4_codes(gen, 320, 256, 64)
    layer = QuantizedLinear.build(codes, torch.bfloat16, torch.device("cpu"))
    assert layer is not None and layer.dequantizes
    for rows in (INT4_DEQUANT_MIN_ROWS - 1, INT4_DEQUANT_MIN_ROWS, 300):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        got, want = layer.linear(x, None).double(), x.double() @ w.t()
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()), rows
    assert calls == [INT4_DEQUANT_MIN_ROWS, 300]
