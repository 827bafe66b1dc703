"""Quantized weights: GGUF blocks kept as they are in the file (gguf_blocks.py), their C products
(cpu_gguf_gemv.c) and the linear and embedding layers' use of them (gguf_linear.py)."""
