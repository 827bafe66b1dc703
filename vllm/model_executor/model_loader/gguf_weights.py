"""Reads a GGUF checkpoint's tensors, dequantized, under Hugging Face Llama parameter names."""

from collections.abc import Iterator

import numpy as np
import torch

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


def iter_gguf_weights(path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (hf_name, float32 tensor) for every tensor in the file."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # GGUF lists dims fastest-first; numpy's shape is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            weights = _unpermute_rope(weights, num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            weights = _unpermute_rope(weights, num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(weights))
