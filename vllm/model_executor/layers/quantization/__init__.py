"""Quantized weights: GGUF blocks kept as they are in the file (gguf_blocks.py), their C products
(cpu_gguf_gemv.c) and the linear and embedding layers' use of them (gguf_linear.py); per-channel
int8 weights made at load as Q8_0 blocks (int8_weights.py)."""
