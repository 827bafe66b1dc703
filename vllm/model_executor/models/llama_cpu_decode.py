"""The C path of a Llama model's decoder layers for steps of a few decodes (llama_cpu_decode.c).

A batch-1 decode step on CPU is bound by reading the weights (~10 ms for SmolLM2 at ~25 GB/s),
but run op by op its layers spend ~5 ms more between the GEMVs: norms, rotary, residual adds,
the cache write and attention, each a dispatch. `FusedDecodeLayers` runs each layer as one C
call instead, when a step holds only decodes, at most 32 of them (4 without the AMX kernel).
It uses the same GEMV, tile GEMM and attention kernels as the op-by-op path and rounds to bf16
where it does.

Built through `LlamaForCausalLM.enable_fused_decode`, which the CPU model runner calls for bf16
models when the kernels are available; with VLLM_CPU_C_KERNELS=0 or without a compiler the
op-by-op path runs every step.
"""

import ctypes
import functools
from pathlib import Path

import torch

from vllm.attention.backends.metadata import AttentionMetadata
from vllm.attention.ops import cpu_paged_decode
from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm
from vllm.platforms.c_build import load_c_library

_SOURCE = Path(__file__).with_name("llama_cpu_decode.c")
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    """struct decode_layer of llama_cpu_decode.c, field for field."""
    _fields_ = [(name, _ptr) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm",
                                          "gate_up", "gate_up_bias", "down", "down_bias",
                                          "qkv_tiles", "o_tiles", "gate_up_tiles", "down_tiles")] + \
               [(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    """struct decode_step of llama_cpu_decode.c, field for field."""
    _fields_ = [("tokens", _i64), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr), ("block_tables", _ptr),
                ("seq_lens", _ptr), ("max_blocks", _i64), ("block_size", _i64), ("window", _i64),
                ("gemv_rows", _i64), ("gemv", _ptr), ("tile_gemm", _ptr), ("tile_gemm_silu_mul", _ptr),
                ("attend", _ptr)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_c_library(_SOURCE, "decode steps run the layers op by op")
    if lib is not None:
        lib.llama_decode_layer.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _ptr, _ptr, _ptr]
        lib.llama_decode_layer.restype = ctypes.c_int
    return lib


def _kernel_addresses() -> tuple[int, int] | None:
    """Addresses of the GEMV and the bf16 decode-attention kernels, if both are built."""
    gemv, attend = cpu_gemv.kernel_address(), cpu_paged_decode.kernel_address(torch.bfloat16)
    return None if gemv is None or attend is None else (gemv, attend)


def _tiles(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(linear, "tiled", None)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecodeLayers:
    """Runs all decoder layers of a `LlamaModel` for a step of only decodes, one C call per layer.

    Holds pointers to the layers' weights: the model's parameters must not be replaced or moved
    after it is built (the runner builds it once the weights are loaded and packed).
    """

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL, kernels: tuple[int, int]) -> None:
        self._lib = lib
        self._gemv, self._attend = kernels
        self._gemv_rows = cpu_gemv.max_rows()
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        # Above the GEMV's rows, only if every product has its tile copy (Linear.pack).
        self._tile_gemm = cpu_tile_gemm.kernel_address()
        self._tile_gemm_silu_mul = cpu_tile_gemm.kernel_address(silu_mul=True)
        tiled = self._tile_gemm is not None and all(_tiles(m) is not None for m in linears)
        self.max_tokens = max(self._gemv_rows, cpu_tile_gemm.max_rows() if tiled else 0)
        self._layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for t in (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight):
                assert t.dtype == torch.bfloat16 and t.is_contiguous()
            self._layers.append(_Layer(
                _address(layer.input_layernorm.weight), _address(attn.qkv_proj.weight),
                _address(attn.qkv_proj.bias), _address(attn.o_proj.weight), _address(attn.o_proj.bias),
                _address(layer.post_attention_layernorm.weight), _address(mlp.gate_up_proj.weight),
                _address(mlp.gate_up_proj.bias), _address(mlp.down_proj.weight), _address(mlp.down_proj.bias),
                _address(_tiles(attn.qkv_proj)), _address(_tiles(attn.o_proj)),
                _address(_tiles(mlp.gate_up_proj)), _address(_tiles(mlp.down_proj)),
                layer.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                mlp.intermediate_size, layer.input_layernorm.eps, attn.scale))
        assert all(layer.input_layernorm.eps == layer.post_attention_layernorm.eps for layer in model.layers)
        # Keeps the pointed-to weights and tile copies alive.
        self._tensors = list(model.parameters()) + [_tiles(m) for m in linears]

    @classmethod
    def build(cls, model: torch.nn.Module) -> "FusedDecodeLayers | None":
        """For a loaded bf16 `LlamaModel` on CPU; None where a kernel cannot be built here."""
        if next(model.parameters()).dtype != torch.bfloat16:
            return None
        attn = model.layers[0].self_attn
        if not cpu_paged_decode.is_available(torch.device("cpu"), torch.bfloat16, attn.num_heads,
                                             attn.num_kv_heads, attn.head_dim):
            return None
        lib, kernels = _library(), _kernel_addresses()
        if lib is None or kernels is None:
            return None
        return cls(model, lib, kernels)

    def accepts(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the step is only decodes, each its own token, and few enough for the kernels."""
        paged = metadata.paged_decodes
        return (paged is not None and not metadata.groups and num_tokens <= self.max_tokens
                and paged.seq_lens.shape[0] == num_tokens)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 metadata: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """hidden: (T, hidden) bf16, updated in place by every layer; cos/sin: (T, 1, D)."""
        paged = metadata.paged_decodes
        assert hidden.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        key_cache = kv_caches[0][0]
        step = _Step(hidden.shape[0], cos.data_ptr(), sin.data_ptr(), metadata.slot_mapping.data_ptr(),
                     paged.block_tables.data_ptr(), paged.seq_lens.data_ptr(), paged.block_tables.shape[1],
                     key_cache.shape[1], paged.sliding_window or 0, self._gemv_rows, self._gemv,
                     self._tile_gemm, self._tile_gemm_silu_mul, self._attend)
        run, step_ref, out = self._lib.llama_decode_layer, ctypes.byref(step), hidden.data_ptr()
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            status = run(ctypes.byref(layer), step_ref, out, k.data_ptr(), v.data_ptr())
            assert status == 0, "a kernel rejected its sizes; build() checks them"
