"""Reads a GGUF checkpoint's tensors under Hugging Face Llama parameter names: dequantized to
float32, or, with `keep_quantized`, its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices left in their blocks."""

import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

from vllm.model_executor.layers.quantization import gguf_blocks

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
    stat = os.stat(path)
    return _quantized_type_names(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _quantized_type_names(path: str, mtime_ns: int, size: int) -> frozenset[str]:
    # The reader parses every metadata field (a vocabulary's worth): once per file version.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e
    return frozenset(tensor.tensor_type.name for tensor in reader.tensors) - set(_FLOAT_TYPE_NAMES)


def iter_gguf_weights(path: str, num_heads: int, num_kv_heads: int, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | gguf_blocks.GGUFBlocks]]:
    """Yields (hf_name, float32 tensor) for every tensor in the file; with `keep_quantized`,
    (hf_name, GGUFBlocks) for its quantized matrices, which must then all be of a type the
    kernels take (float tensors, such as norms, are float32 tensors either way)."""
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    try:
        reader = GGUFReader(path)
    except ValueError as e:  # e.g. a quantized tensor whose rows are not whole blocks of its type
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    float_types = tuple(GGMLQuantizationType[name] for name in _FLOAT_TYPE_NAMES)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # GGUF lists dims fastest-first; numpy's shape is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        quantized = keep_quantized and tensor.tensor_type not in float_types
        if quantized and not (gguf_blocks.is_supported(tensor.tensor_type) and len(shape) == 2):
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, which quantization='gguf' "
                f"cannot keep quantized (supported: {', '.join(gguf_blocks.supported_type_names())}); "
                "load it with quantization='none' to dequantize every tensor")
        if quantized:  # rows of blocks: (rows, row bytes)
            weights = np.asarray(tensor.data).reshape(shape[0], -1)
        else:
            weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        # Both permutations move whole rows, so they apply to rows of blocks as they are.
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            weights = _unpermute_rope(weights, num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            weights = _unpermute_rope(weights, num_kv_heads)
        weights = torch.from_numpy(np.require(weights, requirements=["C", "W"]))  # blocks: off the file's map
        yield name, gguf_blocks.GGUFBlocks(weights, int(tensor.tensor_type), shape[1]) if quantized else weights
