"""Linear layer with packed weight copies for decodes and prefill chunks on CPU (bf16), and C
decode rows for float32.

Up to PACKED_MAX_ROWS rows (decodes, the lm_head's sampled rows, prefill chunks of the default
budget) the tile GEMM (cpu_tile_gemm.c: on AMX tiles, or on AVX512-BF16 dot products where
there is no AMX) runs on a copy of the weight packed once in AMX's tile layout: the weights then
stream from memory in the order the kernel consumes them, which is what bounds these row
counts. On AMX, products of up to `cpu_gemv.max_rows()` rows (batch-1 to batch-4 decodes) run
instead on a C GEMV that reads the plain weight (`gemv_rows`). Above PACKED_MAX_ROWS the product
is bound by compute, x no longer fits in L2 beside the tiles, and oneDNN's GEMM on the plain
weight is the better kernel. On CPUs with neither AMX nor AVX512-BF16 a oneDNN-blocked copy
takes the tile copy's place: oneDNN reads its own blocked layout without the reordering a plain
weight needs. A float32 layer keeps its weight as it is: `pack()` only sends its decode rows
to the C float32 GEMV, and the rest to F.linear.

Inside a captured graph the packed copies (the oneDNN one an opaque MKLDNN tensor) cannot be
traced, so there the layer calls the `vllm::packed_linear` custom op on the plain weight; the
op finds the packed copy of that weight at run time. Keying by the weight's storage, not by
the layer, keeps one graph for all layers that share a shape. An MLP's merged gate/up layer
and its activation are one more op, `vllm::silu_mul_linear` (silu_mul_linear): on the tile
copy the activation is the GEMM's epilogue.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm
from vllm.model_executor.layers.activation import silu_and_mul
from vllm.model_executor.layers.quantization import gguf_linear

PACKED_MAX_ROWS = 512

# Storage address of a packed layer's plain weight -> its oneDNN-blocked copy, or its tile
# copy where it has one. Filled by `Linear.pack()`, emptied when the weight is freed.
_PACKED_BY_WEIGHT: dict[int, torch.Tensor] = {}
_TILED_BY_WEIGHT: dict[int, torch.Tensor] = {}


def can_pack(dtype: torch.dtype) -> bool:
    """Whether `Linear.pack()` gives layers of this dtype their C kernels: bf16 with oneDNN, or
    float32 where its GEMV is built."""
    if dtype == torch.float32:
        return cpu_gemv.max_rows(dtype) > 0
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def gemv_rows() -> int:
    """Rows up to which a product with a tile copy still runs on the GEMV: none where the tile
    GEMM takes decode rows too (cpu_tile_gemm.takes_decode_rows), else the GEMV's."""
    return 0 if cpu_tile_gemm.takes_decode_rows() else cpu_gemv.max_rows()


def _tile_copy(rows: int, weight: torch.Tensor) -> torch.Tensor | None:
    """`weight`'s tile copy if `rows` run on it (past gemv_rows(), up to PACKED_MAX_ROWS)."""
    if gemv_rows() < rows <= PACKED_MAX_ROWS:
        return _TILED_BY_WEIGHT.get(weight.data_ptr())
    return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    tiled = _tile_copy(rows, weight)
    if tiled is not None:
        return cpu_tile_gemm.gemm(x, tiled, bias)
    if 0 < rows <= cpu_gemv.max_rows(x.dtype):
        return cpu_gemv.gemv(x, weight, bias)  # decode rows: weight-bandwidth bound
    if 0 < rows <= PACKED_MAX_ROWS:
        packed = _PACKED_BY_WEIGHT.get(weight.data_ptr())
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.library.custom_op("vllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (T, in), weight: (out, in) -> (T, out), on the packed copy of `weight` when it fits."""
    return _linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` that, after `pack()`, runs up to PACKED_MAX_ROWS rows on a packed weight copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.packed = False
        self.tiled: torch.Tensor | None = None  # the tile copy of the weight, after pack()
        self.quantized = False  # the weight holds GGUF blocks (gguf_linear.mark_quantized)

    def reset_parameters(self) -> None:
        """Leaves the weights uninitialised: the model's load_weights writes every parameter, so
        a random initialisation would be time spent for nothing."""

    def pack(self) -> None:
        assert can_pack(self.weight.dtype) and self.weight.device.type == "cpu"
        self.packed = True
        if self.weight.dtype == torch.float32:
            return  # the float32 GEMV reads the weight as it is
        key = self.weight.data_ptr()
        self.tiled = cpu_tile_gemm.pack(self.weight)  # None: no tile GEMM here, or the shape does not fit
        if self.tiled is not None:
            _TILED_BY_WEIGHT[key] = self.tiled
            weakref.finalize(self.weight, _TILED_BY_WEIGHT.pop, key, None)
        elif torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # oneDNN's bf16 kernels need AVX512BW/VL/DQ or AVX-NE-CONVERT; without them the rows
            # the C kernels do not take stay on F.linear.
            _PACKED_BY_WEIGHT[key] = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            weakref.finalize(self.weight, _PACKED_BY_WEIGHT.pop, key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ bias): (T, in) -> (T, out), on the packed copy where there is one."""
        if self.quantized:
            return gguf_linear.linear(x, self.weight, bias)
        if not self.packed:
            return F.linear(x, self.weight, bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.weight, bias)
        return _linear(x, self.weight, bias)


def _tile_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of x @ weight^T + bias in one pass of the tile GEMM, where these rows run on
    weight's tile copy; None elsewhere."""
    tiled = _tile_copy(x.shape[0], weight)
    if tiled is None or tiled.shape[0] % 32:  # gate's and up's 16-column blocks pair up
        return None
    return cpu_tile_gemm.gemm_silu_mul(x, tiled, bias)


@torch.library.custom_op("vllm::silu_mul_linear", mutates_args=())
def silu_mul_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (T, in), weight: (2 I, in), gate's rows then up's -> silu(gate) * up, (T, I)."""
    act = _tile_silu_mul(x, weight, bias)
    # Packed layers exist only on the CPU backend, whose C element-wise ops are then on.
    return act if act is not None else silu_and_mul(_linear(x, weight, bias), c_kernels=True)


@silu_mul_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def silu_mul_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of `layer(x)`, whose output columns are gate's then up's, with the
    activation in the epilogue of the tile GEMM: (T, in) -> (T, out / 2). None where the layer
    has no packed copy (the caller then applies the layer and the activation). The same
    roundings as the two steps; the (T, out) product never goes to memory, so the activation
    adds no pass over it. In a captured graph
    it is the `vllm::silu_mul_linear` op, which picks its path at run time like packed_linear."""
    if not layer.packed:
        return None
    if torch.compiler.is_compiling():
        return silu_mul_linear_op(x, layer.weight, layer.bias)
    return _tile_silu_mul(x, layer.weight, layer.bias)


def pack_linear_weights(model: nn.Module) -> None:
    """Packs every `Linear` of a loaded CPU model whose dtype `can_pack` (weights must not change
    afterwards): dense weights get their path to the C kernels, and in a bf16 model weights of
    GGUF blocks are regrouped into the int8 GEMM's panels where it takes them (a tied lm_head's
    with its embedding; float32 products read rows)."""
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if not module.quantized:
            module.pack()
        elif module.weight.dense_dtype == torch.bfloat16:
            gguf_linear.to_panels(module.weight)
