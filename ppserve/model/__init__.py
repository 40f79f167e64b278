"""Llama-family model code: parallel layers, paged attention, the stage-aware decoder and its weight
loader."""
