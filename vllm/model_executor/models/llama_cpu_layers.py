"""The C path of a Llama model's decoder layers for bf16 steps on CPU (llama_cpu_layers.c), on
bf16 weights or on weights kept in GGUF blocks, and for float32 steps on float32 weights.

A batch-1 decode step on CPU is bound by reading the weights, but run op by op its layers
also spend time between the GEMVs: norms, rotary, residual adds, the cache write and attention,
each a dispatch and an allocation, which for a small model is of the order of the weight
reading itself. A prefill chunk's layers are mostly products, yet their ~15 torch and ctypes
calls a layer still add a fixed cost to every step. How close decodes come to the weight-reading
bound is workload C's `C_fraction_of_memory_bandwidth` in benchmarks/results/workloads.json
(`python benchmarks/benchmark_workloads.py --output-json benchmarks/results/workloads.json`). `FusedLayers`
runs all the layers in one C call instead (each layer's steps in C, the rotary tables read at
the tokens' positions, and the final norm after the last layer), for a step of decodes, prefill
chunks or both whose attention the C kernels take whole (no metadata groups) and whose rows the
GEMV or the tile GEMM take (up to PACKED_MAX_ROWS; linear.py says which takes which). It uses
the same kernels as the op-by-op path and rounds to bf16 where it does.

With quantization="gguf" the products are cpu_gguf_gemv.c's, one entry point per GGUF type
with the bf16 GEMV's signature (the weight is its rows of blocks): the same product as the
op-by-op layers', for every row count (weight-stationary for decodes, dequantized tiles on the
tile GEMM for more rows). Each weight has its own product, so a model whose weights differ in
type (llama.cpp's Q4_K_M files: Q6_K beside Q4_K, and bf16 where stacked tensors differ) runs
here too.

A float32 model's layers are the same C code on float32 rows (llama_layers_f32), its products
the float32 GEMV (cpu_gemv_f32.c) up to its rows, its attention the float32 decode kernel:
steps of decodes only (there is no float32 prefill kernel), in float32 throughout, as torch's
float32 ops compute them.

Built through `LlamaForCausalLM.enable_fused_layers`, which the CPU model runner calls for bf16
and float32 models when the kernels are available; with VLLM_CPU_C_KERNELS=0 or without a
compiler the op-by-op path runs every step. Captured graphs keep the torch layers.
"""

import ctypes

import torch

from vllm.attention.backends.cpu_metadata import AttentionMetadata
from vllm.attention.ops import cpu_paged_decode, cpu_paged_prefill
from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm
from vllm.model_executor.layers.linear import PACKED_MAX_ROWS, gemv_rows
from vllm.model_executor.layers.quantization import cpu_gguf_gemv, gguf_linear
from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_BAD_POSITION = -1  # llama_layers' LLAMA_BAD_POSITION


class _Product(ctypes.Structure):
    """struct product of llama_cpu_layers.c: one weight's product for up to `gemv_rows` rows, and
    the tile GEMM on its tile copy above (None: none)."""
    _fields_ = [("gemv", _ptr), ("gemv_rows", _i64), ("tile_gemm", _ptr)]

    @property
    def max_rows(self) -> int:
        return PACKED_MAX_ROWS if self.tile_gemm else self.gemv_rows


class _Layer(ctypes.Structure):
    """struct layer_weights of llama_cpu_layers.c, field for field."""
    _fields_ = [(name, _ptr) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm",
                                          "gate_up", "gate_up_bias", "down", "down_bias",
                                          "qkv_tiles", "o_tiles", "gate_up_tiles", "down_tiles")] + \
               [(name, _Product) for name in ("qkv_product", "o_product", "gate_up_product", "down_product")] + \
               [(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    """struct layer_step of llama_cpu_layers.c, field for field."""
    _fields_ = [("tokens", _i64), ("cos", _ptr), ("sin", _ptr), ("positions", _ptr), ("max_position", _i64),
                ("slots", _ptr),
                ("decodes", _i64), ("decode_rows", _ptr), ("decode_block_tables", _ptr), ("seq_lens", _ptr),
                ("decode_max_blocks", _i64),
                ("prefills", _i64), ("prefill_block_tables", _ptr), ("token_offsets", _ptr),
                ("query_lens", _ptr), ("context_lens", _ptr), ("prefill_max_blocks", _i64),
                ("block_size", _i64), ("window", _i64), ("tile_gemm_silu_mul", _ptr), ("attend_decodes", _ptr),
                ("attend_prefills", _ptr)]


_LAYERS = CFunction([ctypes.POINTER(_Layer), _i64, _ptr, ctypes.c_float, ctypes.POINTER(_Step), _ptr,
                     ctypes.POINTER(_ptr), ctypes.POINTER(_ptr), _ptr])
_LIBRARY = CLibrary(KERNEL_SOURCES / "llama_cpu_layers.c", "the layers run op by op", {
    "llama_layers": _LAYERS, "llama_layers_f32": _LAYERS,
    "llama_layer_workspace": CFunction([ctypes.POINTER(_Layer), _i64], _i64),
})
_LAYERS_BY_DTYPE = {torch.bfloat16: "llama_layers", torch.float32: "llama_layers_f32"}


def _tiles(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(linear, "tiled", None)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _product(linear: torch.nn.Module) -> _Product | None:
    """A linear layer's product. float32 weights: the float32 GEMV (cpu_gemv_f32.c) up to its
    rows. bf16 weights: the GEMV (cpu_gemv.c) up to its rows, the tile
    GEMM above on the weight's tile copy (Linear.pack; without one, up to the GEMV's rows only).
    GGUF blocks: their type's product (cpu_gguf_gemv.c) for every row count, as the op-by-op
    layers use it: up to PACKED_MAX_ROWS where it has a product for many rows (int8 GEMM or
    tiled) for the weight's shape, else up to gguf_linear.GEMV_MAX_ROWS (larger steps stay op
    by op). None where the kernel is not built here."""
    if linear.quantized:
        if linear.weight.dense_dtype != torch.bfloat16:
            return None  # GGUF products take bf16 rows
        gemv = cpu_gguf_gemv.layer_product_address(linear.weight.quant_type)
        batched = cpu_gguf_gemv.batched_fits(linear.weight.quant_type, linear.weight.shape[0],
                                             linear.weight.in_features)
        return None if gemv is None else _Product(gemv, PACKED_MAX_ROWS if batched else gguf_linear.GEMV_MAX_ROWS)
    if linear.weight.dtype == torch.float32:
        gemv = cpu_gemv.kernel_address(torch.float32)
        return None if gemv is None else _Product(gemv, cpu_gemv.max_rows(torch.float32))
    gemv, tile_gemm = cpu_gemv.kernel_address(), cpu_tile_gemm.kernel_address()
    if gemv is None:
        return None
    if tile_gemm is None or _tiles(linear) is None:
        return _Product(gemv, cpu_gemv.max_rows())
    return _Product(gemv, gemv_rows(), tile_gemm)


class FusedLayers:
    """Runs all decoder layers of a `LlamaModel` for a step, and its final norm, in one C call.

    Holds pointers to the layers' weights: the model's parameters must not be replaced or moved
    after it is built (the runner builds it once the weights are loaded and packed).
    """

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL, products: list[_Product], attend_decodes: int,
                 attend_prefills: int | None) -> None:
        dtype = model.norm.weight.dtype  # the steps' rows, caches and dense weights
        self._lib = lib
        self._layers_fn = getattr(lib, _LAYERS_BY_DTYPE[dtype])
        self._attend_decodes, self._attend_prefills = attend_decodes, attend_prefills
        self.takes_prefills = attend_prefills is not None  # else only steps of decodes
        linears = _linears(model)
        # bf16's tile GEMM, with SiLU-and-multiply as its epilogue
        self._tile_gemm_silu_mul = cpu_tile_gemm.kernel_address(silu_mul=True) if dtype == torch.bfloat16 else None
        self.max_tokens = min(p.max_rows for p in products)
        layers = []
        for index, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                # rows in the model's dtype, or rows of GGUF blocks that the product reads whole
                assert linear.weight.dtype == (torch.uint8 if linear.quantized else dtype)
                assert linear.weight.is_contiguous()
                # The C layer reads one bias value per output row of the weight.
                if linear.bias is not None and linear.bias.shape != linear.weight.shape[:1]:
                    raise ValueError(f"bias of shape {tuple(linear.bias.shape)} for a weight of "
                                     f"shape {tuple(linear.weight.shape)}")
            layers.append(_Layer(
                _address(layer.input_layernorm.weight), _address(attn.qkv_proj.weight),
                _address(attn.qkv_proj.bias), _address(attn.o_proj.weight), _address(attn.o_proj.bias),
                _address(layer.post_attention_layernorm.weight), _address(mlp.gate_up_proj.weight),
                _address(mlp.gate_up_proj.bias), _address(mlp.down_proj.weight), _address(mlp.down_proj.bias),
                _address(_tiles(attn.qkv_proj)), _address(_tiles(attn.o_proj)),
                _address(_tiles(mlp.gate_up_proj)), _address(_tiles(mlp.down_proj)),
                *products[4 * index:4 * index + 4],  # in _linears' order
                layer.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                mlp.intermediate_size, layer.input_layernorm.eps, attn.scale))
        assert all(layer.input_layernorm.eps == layer.post_attention_layernorm.eps for layer in model.layers)
        self._layers = (_Layer * len(layers))(*layers)
        # The rotary tables, read at each token's position, and the final norm: (P, D) and (hidden,).
        cos, sin, norm = model.rotary.cos, model.rotary.signed_sin, model.norm.weight
        assert cos.shape == sin.shape and cos.shape[1] == model.layers[0].self_attn.head_dim
        assert cos.dtype == sin.dtype == norm.dtype == dtype
        assert cos.is_contiguous() and sin.is_contiguous() and norm.is_contiguous()
        self._rotary_rows = cos.shape[0]
        self._cos, self._sin, self._norm = cos.data_ptr(), sin.data_ptr(), norm.data_ptr()
        self._eps = model.norm.eps
        # Each layer's key and value cache addresses, for the caches last given (_bind)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._keys = self._values = None
        # Keeps the pointed-to weights, tile copies and rotary tables alive.
        self._tensors = list(model.parameters()) + [_tiles(m) for m in linears] + [cos, sin]
        self._workspace = torch.empty(0, dtype=dtype)  # grown to the largest step's need

    @classmethod
    def build(cls, model: torch.nn.Module) -> "FusedLayers | None":
        """For a loaded bf16 `LlamaModel` on CPU, its products' weights bf16 or GGUF blocks of any
        types (each weight its own product), or a float32 one on float32 weights; None where the
        decode kernels or a weight's product cannot be built here (without the prefill kernel,
        only steps of decodes: always so in float32). Steps carry prefill chunks for the prefill
        kernel only where it takes the model's shapes (cpu_paged_prefill.is_available)."""
        dtype = model.norm.weight.dtype
        if dtype not in _LAYERS_BY_DTYPE:
            return None
        attn = model.layers[0].self_attn
        if not cpu_paged_decode.is_available(torch.device("cpu"), dtype, attn.num_heads,
                                             attn.num_kv_heads, attn.head_dim):
            return None
        products = [_product(linear) for linear in _linears(model)]
        lib, attend_decodes = _LIBRARY.get(), cpu_paged_decode.kernel_address(dtype)
        if lib is None or None in products or attend_decodes is None:
            return None
        attend_prefills = cpu_paged_prefill.kernel_address() if dtype == torch.bfloat16 else None
        return cls(model, lib, products, attend_decodes, attend_prefills)

    def accepts(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the C kernels take all of the step: its attention (no groups, no padding) and
        its rows."""
        if metadata.groups or metadata.num_real_tokens != num_tokens or num_tokens > self.max_tokens:
            return False
        if metadata.paged_prefills is not None and not self.takes_prefills:
            return False
        return metadata.paged_decodes is not None or metadata.paged_prefills is not None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """hidden: (T, hidden) bf16 embeddings, positions: (T,) int64 -> the final norm of the
        last layer's output, (T, hidden), in hidden's memory."""
        assert hidden.is_contiguous() and positions.dtype == torch.int64 and positions.is_contiguous()
        num_tokens = hidden.shape[0]
        assert positions.shape == (num_tokens,)
        decodes, prefills = metadata.paged_decodes, metadata.paged_prefills
        windows = {p.sliding_window for p in (decodes, prefills) if p is not None}
        assert len(windows) == 1, "decodes and prefills share the model's window"
        step = _Step(num_tokens, self._cos, self._sin, positions.data_ptr(), self._rotary_rows,
                     metadata.slot_mapping.data_ptr(),
                     block_size=kv_caches[0][0].shape[1], window=windows.pop() or 0,
                     tile_gemm_silu_mul=self._tile_gemm_silu_mul, attend_decodes=self._attend_decodes,
                     attend_prefills=self._attend_prefills)
        if decodes is not None:
            step.decodes = decodes.seq_lens.shape[0]
            step.decode_rows = None if decodes.rows is None else decodes.rows.data_ptr()
            step.decode_block_tables, step.seq_lens = decodes.block_tables.data_ptr(), decodes.seq_lens.data_ptr()
            step.decode_max_blocks = decodes.block_tables.shape[1]
        if prefills is not None:
            step.prefills = prefills.query_lens.shape[0]
            step.prefill_block_tables = prefills.block_tables.data_ptr()
            step.token_offsets, step.query_lens = prefills.token_offsets.data_ptr(), prefills.query_lens.data_ptr()
            step.context_lens = prefills.context_lens.data_ptr()
            step.prefill_max_blocks = prefills.block_tables.shape[1]
        need = self._lib.llama_layer_workspace(self._layers, num_tokens)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=self._workspace.dtype)
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        status = self._layers_fn(self._layers, len(self._layers), self._norm, self._eps,
                                        ctypes.byref(step), hidden.data_ptr(), self._keys, self._values,
                                        self._workspace.data_ptr())
        if status == _BAD_POSITION:  # as the op-by-op path's lookup in the tables would raise it
            raise IndexError(f"a position in [{int(positions.min())}, {int(positions.max())}] is outside "
                             f"the rotary tables' {self._rotary_rows} rows")
        assert status == 0, "a kernel rejected its sizes; build() checks them"
        return hidden

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Takes the addresses of the layers' caches (the model's list, the same every step
        until the caches are bound again); keeps the list, and so the caches, alive."""
        assert len(kv_caches) == len(self._layers)
        self._caches = kv_caches
        self._keys = (_ptr * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches))
        self._values = (_ptr * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches))
