"""Linear layers and the embedding on weights kept in GGUF blocks (quantization="gguf").

Loading GGUF blocks into a layer's weight (`load_blocks`) keeps the same `nn.Parameter` and swaps
its data for the blocks, (out rows, row bytes) uint8, marking it with `quant_type`, the number
of input columns and the dtype it stands in for; a tied lm_head shares the parameter, so it
reads the embedding's blocks. `Linear.matmul` and `VocabParallelEmbedding` then come here:

  bf16 x                 cpu_gguf_gemv.product, the C decoder layers' product too, x quantized
                         per 32-block to int8 where the CPU has int8 dot products: the int8
                         GEMM at every row count (16 output rows of blocks unpacked at a time
                         for all rows of x, from the panels `to_panels` regroups the weights
                         into; with AVX512-VNNI also Q4_K from its rows, from 2 rows of x; with
                         AVX2 Q8_0, Q4_0 and Q4_1 only; not Q6_K); else up to a few rows one pass
                         over the blocks, dequantized in registers (int8 or float32 dot
                         products), and from there (batched decodes, prefill chunks) each weight
                         dequantized to bf16 panel by panel for the tile GEMM (cpu_tile_gemm.c)
  float32 x, <= GEMV_MAX_ROWS  float32 products of the dequantized weights in registers, as
                         exact as the unquantized float32 path
  other products         the weight dequantized into a temporary in x's dtype and torch's GEMM
                         (float32 prefill chunks; bf16 where the tile GEMM cannot run, in
                         float32 on the weight's bf16 values where the CPU has no bf16 dot
                         products, rounded to bf16 once)
  embedding              the looked-up rows dequantized, in the dtype the weight stands in for

Without the C library (no compiler, VLLM_CPU_C_KERNELS=0) the gguf package dequantizes the
whole weight for every product: correct, slow.
"""

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.quantization import cpu_gguf_gemv
from vllm.model_executor.layers.quantization.gguf_blocks import PANELS, GGUFBlocks
from vllm.platforms.cpu import cpu_has_native_bf16_dot

# Rows up to which the weight-stationary products serve where no product made for many rows
# runs (float32 x, or neither the int8 GEMM nor the tile GEMM here): past it, dequantizing the
# weight once beats unpacking it once per row.
GEMV_MAX_ROWS = 16


def is_quantized(param: torch.Tensor) -> bool:
    """Whether `param` holds GGUF blocks; layers read it once, after loading (`mark_quantized`)."""
    return getattr(param, "quant_type", None) is not None


def mark_quantized(model: nn.Module) -> None:
    """Sets `quantized` on every layer that declares it (Linear, VocabParallelEmbedding) to
    whether its weight holds GGUF blocks, so that their forward tests a flag. Call once the
    weights are loaded."""
    for module in model.modules():
        if hasattr(module, "quantized"):
            module.quantized = is_quantized(module.weight)


def takes_blocks(param: nn.Parameter) -> bool:
    """Whether `param`, already written, takes further GGUF tensors (`load_blocks`)."""
    return is_quantized(param) or getattr(param, "mixed_gguf_types", False)


def load_blocks(param: nn.Parameter, blocks: GGUFBlocks) -> torch.Tensor:
    """Turns `param`, a (rows, in) weight, into rows of `blocks`' type on its first GGUF tensor
    (uninitialised, as the model created it); returns the (rows, row bytes) data for the
    parameter's weight loader to copy in, like a dense tensor.

    The tensors stacked into one weight may differ in type (llama.cpp's Q4_K_M files keep some
    layers' v in Q6_K beside q and k in Q4_K). Such a weight holds one layout, so it is
    dequantized to the dtype it stands in for: the rows loaded so far, then each tensor as it
    comes (returned dense, (rows, in))."""
    if getattr(param, "mixed_gguf_types", False):
        return dequantize_blocks(blocks.data, blocks.quant_type, blocks.in_features, param.dtype)
    if not is_quantized(param):
        if param.dim() != 2 or param.shape[1] != blocks.in_features:
            raise ValueError(f"GGUF blocks of shape {blocks.shape} for a weight of shape {tuple(param.shape)}")
        param.dense_dtype = param.dtype
        param.in_features = blocks.in_features
        param.quant_type = blocks.quant_type
        param.requires_grad_(False)  # integer data cannot take a gradient
        param.data = torch.empty(param.shape[0], blocks.data.shape[1], dtype=torch.uint8)
    elif param.in_features != blocks.in_features:
        raise ValueError(f"GGUF blocks of {blocks.in_features} columns for a weight of {param.in_features} columns")
    elif param.quant_type != blocks.quant_type:
        # Rows not yet written dequantize to whatever they hold until their tensor overwrites them.
        param.data = dequantize(param, param.dense_dtype)                       # (rows, in)
        param.quant_type = None
        param.mixed_gguf_types = True
        return dequantize_blocks(blocks.data, blocks.quant_type, blocks.in_features, param.dtype)
    return blocks.data


def to_panels(weight: nn.Parameter) -> None:
    """Regroups a loaded weight of GGUF blocks into the int8 GEMM's 16-row panels in place, where
    that GEMM takes it (cpu_gguf_gemv.to_panels; else leaves it in rows). Only for a bf16 model:
    float32 products read rows. Its rows can no longer be sliced; its (tied) embedding still
    looks up rows."""
    assert weight.dense_dtype == torch.bfloat16
    panels = cpu_gguf_gemv.to_panels(weight.data, weight.quant_type, weight.in_features)
    if panels is not None:
        weight.data = panels
        weight.quant_type |= PANELS


def dequantize(weight: nn.Parameter, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """weight's rows `rows` (R,) (all if None) -> (R, in) in dtype."""
    return dequantize_blocks(weight.data, weight.quant_type, weight.in_features, dtype, rows)


def dequantize_blocks(blocks: torch.Tensor, quant_type: int, in_features: int, dtype: torch.dtype,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """blocks (N, row bytes) of `quant_type`, its rows `rows` (R,) (all if None) -> (R, in) in
    dtype (float32: the gguf package's values)."""
    if cpu_gguf_gemv.available():
        return cpu_gguf_gemv.dequantize(blocks, quant_type, in_features, dtype, rows)
    from gguf import GGMLQuantizationType, quants

    data = blocks if rows is None else blocks[rows]
    return torch.from_numpy(quants.dequantize(data.numpy(), GGMLQuantizationType(quant_type))).to(dtype)


def _matmul(x: torch.Tensor, blocks: torch.Tensor, quant_type: int, in_features: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    """x: (T, in) float32 or bf16, blocks: (out, row bytes), bias: (out,) or None -> (T, out) in
    x's dtype; the bias is added to the float32 sums, as the C decoder layers add it."""
    rows = x.shape[0]
    small = rows <= GEMV_MAX_ROWS and cpu_gguf_gemv.available()
    if x.dtype == torch.bfloat16 and (small or cpu_gguf_gemv.batched_fits(quant_type, blocks.shape[0], in_features)):
        return cpu_gguf_gemv.product(x, blocks, quant_type, bias)  # the C decoder layers' product
    if small:
        return cpu_gguf_gemv.matmul(x, blocks, quant_type, int8_activations=False, bias=bias)
    if x.dtype == torch.bfloat16 and not cpu_has_native_bf16_dot():
        # Such a CPU's bf16 GEMM converts its operands to float32 as it goes, at a fraction of
        # the float32 GEMM's rate: the same float32 sums of the same products (x and the
        # weight's bf16 values) in the float32 GEMM, rounded to bf16 once.
        weight = dequantize_blocks(blocks, quant_type, in_features, torch.bfloat16).float()   # (out, in)
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, dequantize_blocks(blocks, quant_type, in_features, x.dtype), bias)


@torch.library.custom_op("vllm::gguf_linear", mutates_args=())
def gguf_linear_op(x: torch.Tensor, blocks: torch.Tensor, quant_type: int, in_features: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x: (T, in), blocks: (out, row bytes) of `quant_type` -> (T, out), for captured graphs."""
    return _matmul(x, blocks, quant_type, in_features, bias)


@gguf_linear_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, quant_type: int, in_features: int,
      bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for a weight of GGUF blocks: (T, in) -> (T, out)."""
    if torch.compiler.is_compiling():
        return gguf_linear_op(x, weight.data, weight.quant_type, weight.in_features, bias)
    return _matmul(x, weight.data, weight.quant_type, weight.in_features, bias)   # (T, out)


@torch.library.custom_op("vllm::gguf_embedding", mutates_args=())
def gguf_embedding_op(input_ids: torch.Tensor, blocks: torch.Tensor, quant_type: int, in_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """input_ids: (T,) -> (T, in) rows of `blocks`, dequantized to dtype, for captured graphs."""
    return cpu_gguf_gemv.dequantize(blocks, quant_type, in_features, dtype, input_ids)


@gguf_embedding_op.register_fake
def _(input_ids: torch.Tensor, blocks: torch.Tensor, quant_type: int, in_features: int,
      dtype: torch.dtype) -> torch.Tensor:
    return blocks.new_empty(input_ids.shape[0], in_features, dtype=dtype)


def embedding(input_ids: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """input_ids: (T,) in [0, rows) -> their rows of a weight of GGUF blocks, (T, in)."""
    if torch.compiler.is_compiling():
        return gguf_embedding_op(input_ids, weight.data, weight.quant_type, weight.in_features, weight.dense_dtype)
    return dequantize(weight, weight.dense_dtype, input_ids)
