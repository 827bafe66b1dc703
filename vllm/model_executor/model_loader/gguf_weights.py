"""Reads a GGUF checkpoint's tensors under Hugging Face Llama parameter names: dequantized to
float32, or, with `keep_quantized`, its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices left in their blocks."""

from collections.abc import Iterator

import numpy as np
import torch

from vllm.model_executor.layers.quantization import gguf_blocks
from vllm.model_executor.model_loader.gguf_metadata import tensor_index

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2)
    if prefix != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of q/k rows (interleaved rotary pairs -> HF's two halves).

    llama.cpp stores each head's rows as (pair, half) pairs; HF keeps (half, pair).
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")


def quantized_type_names(path: str) -> frozenset[str]:
    """Names of the quantized tensor types in a GGUF file ("Q4_1", "Q6_K", ...), read from its
    tensor list without loading any data."""
    return frozenset(t.type_name for t in tensor_index(path).tensors) - set(_FLOAT_TYPE_NAMES)


def iter_gguf_weights(path: str, num_heads: int, num_kv_heads: int, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | gguf_blocks.GGUFBlocks]]:
    """Yields (hf_name, float32 tensor) for every tensor in the file; with `keep_quantized`,
    (hf_name, GGUFBlocks) for its quantized matrices, which must then all be of a type the
    kernels take (float tensors, such as norms, are float32 tensors either way)."""
    from gguf import GGMLQuantizationType, dequantize

    index = tensor_index(path)
    if index.architecture != "llama":
        raise ValueError(f"GGUF architecture {index.architecture!r} is not supported (only 'llama')")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in index.tensors:
        name = _hf_name(tensor.name)
        shape, tensor_type = tensor.shape, GGMLQuantizationType[tensor.type_name]
        quantized = keep_quantized and tensor.type_name not in _FLOAT_TYPE_NAMES
        if quantized and not (gguf_blocks.is_supported(tensor_type) and len(shape) == 2):
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is {tensor.type_name}, which quantization='gguf' "
                f"cannot keep quantized (supported: {', '.join(gguf_blocks.supported_type_names())}); "
                "load it with quantization='none' to dequantize every tensor")
        # Rows of raw bytes: (rows, row bytes), the layout dequantize takes for every type.
        rows = int(np.prod(shape[:-1]))
        raw = data[tensor.offset:tensor.offset + tensor.num_bytes].reshape(rows, -1)
        weights = raw if quantized else dequantize(raw, tensor_type).reshape(shape).astype(np.float32)
        # Both permutations move whole rows, so they apply to rows of blocks as they are.
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            weights = _unpermute_rope(weights, num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            weights = _unpermute_rope(weights, num_kv_heads)
        weights = torch.from_numpy(np.require(weights, requirements=["C", "W"]))  # blocks: off the file's map
        yield name, gguf_blocks.GGUFBlocks(weights, int(tensor_type), shape[1]) if quantized else weights
