"""A quantization_config read for the planner: stored bytes per linear weight, the precision the matmuls
multiply in, and what they change."""

from __future__ import annotations

import pytest

from ppserve.model.quant.config import WeightQuant, linear_compute, stored_weight_bytes
from ppserve.plan.inputs import model_spec_from_hf
from ppserve.sim.cost_model import load_model_spec, stage_weight_bytes

FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
           "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}
W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}}}}
# FP8-dynamic and INT8 W8A8 as llm-compressor writes them: the input activations quantized per token.
FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {**FP8["config_groups"]["group_0"], "input_activations": {
                   "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}}}}
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}, "input_activations": {
            "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}}}}
GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}


@pytest.mark.parametrize("quant,expected", [
    (FP8, 1.0),
    (W4, 0.5 + 2.5 / 128),  # a bf16 scale and a 4-bit zero point per 128 weights
    ({"quant_method": "compressed-tensors", "config_groups": {"W4A16": ["Linear"]}}, 0.5 + 2 / 128),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, 1.0),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
     0.5 + 2.5 / 64),
])
def test_stored_bytes_per_weight(quant: dict, expected: float) -> None:
    assert stored_weight_bytes({"quantization_config": quant}) == pytest.approx(expected)


@pytest.mark.parametrize("quant,expected", [
    (FP8_DYNAMIC, "fp8"),
    (W8A8, "int8"),
    (W4, ""),  # W4A16: weight-only, the matmuls run in bf16 on dequantized weights
    (GPTQ4, ""),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, ""),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, ""),
    (FP8, "fp8"),  # FP8 weights without quantized activations: `_scaled_mm` quantizes them per token
    ({"quant_method": "compressed-tensors", "config_groups": {"FP8_DYNAMIC": ["Linear"]}}, "fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"W8A8": ["Linear"]}}, "int8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"W8A16": ["Linear"]}}, ""),
    ({"quant_method": "compressed-tensors", "config_groups": {"W4A16": ["Linear"]}}, ""),
])
def test_the_matmuls_precision_follows_the_schemes_activations(quant: dict, expected: str) -> None:
    assert linear_compute({"quantization_config": quant}) == expected


def test_activation_schemes_store_the_bytes_of_their_weights() -> None:
    assert stored_weight_bytes({"quantization_config": FP8_DYNAMIC}) == 1.0
    assert stored_weight_bytes({"quantization_config": W8A8}) == 1.0
    assert linear_compute({}) == ""


def test_float_checkpoints_have_no_stored_bytes() -> None:
    assert stored_weight_bytes({}) is None
    assert WeightQuant("float", 8, None, True).bytes_per_weight() == 1.0


def test_planner_counts_the_quantized_bytes_of_a_config() -> None:
    """An FP8 config.json plans with half the matmul bytes of its bf16 twin; the ends stay bf16."""
    base = load_model_spec("llama3-70b")
    cfg = {"hidden_size": base.hidden_size, "num_attention_heads": base.num_heads,
           "num_key_value_heads": base.num_kv_heads, "num_hidden_layers": base.num_layers,
           "intermediate_size": base.intermediate_size, "vocab_size": base.vocab_size,
           "max_position_embeddings": base.max_model_len}
    bf16 = model_spec_from_hf(cfg, "bf16")
    fp8 = model_spec_from_hf({**cfg, "quantization_config": FP8}, "fp8")
    assert fp8.matmul_bytes == 1.0 and bf16.matmul_bytes == 2.0
    assert stage_weight_bytes(fp8, 10, False, False, 1) == stage_weight_bytes(bf16, 10, False, False, 1) / 2
    table = fp8.vocab_size * fp8.hidden_size * 2
    assert stage_weight_bytes(fp8, 0, True, False, 1) == table == stage_weight_bytes(bf16, 0, True, False, 1)
    assert load_model_spec("llama3-70b-fp8").matmul_bytes == 1.0
    # FP8 weights multiply in FP8 (the activations quantized per token at each call).
    assert (bf16.linear_compute, fp8.linear_compute) == ("", "fp8")
    assert model_spec_from_hf({**cfg, "quantization_config": FP8_DYNAMIC}, "fp8").linear_compute == "fp8"
    assert model_spec_from_hf({**cfg, "quantization_config": W8A8}, "w8a8").linear_compute == "int8"
    assert model_spec_from_hf({**cfg, "quantization_config": GPTQ4}, "gptq").linear_compute == ""
    assert load_model_spec("llama3-70b-fp8").linear_compute == "fp8"
