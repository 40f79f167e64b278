"""Quantized checkpoints: reading their `quantization_config` (config.py), turning a layer's stored
tensors into its weight (dequant.py) and presenting them to the layers under float names (reader.py)."""
