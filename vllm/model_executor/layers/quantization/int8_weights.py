"""Weight-only int8 with one scale per output channel (quantization="int8"), made at load time
from an unquantized checkpoint.

Every `Linear` weight (q/k/v, o, gate/up, down) is quantized per output row, symmetrically:

    d_r = max_i |W_ri| / 127, rounded up to fp16      q_ri = round(W_ri / d_r) in [-127, 127]

so that every weight is within d_r / 2 of d_r * q_ri, the value the products multiply. The
embedding and the lm_head stay in the run dtype, as vLLM's weight-only int8 methods keep them.

A row is stored as GGUF Q8_0 blocks whose every block carries the row's d (see cpu_gguf_gemv_blocks.h):

    row r:  [d_r][q_r0 .. q_r31]  [d_r][q_r32 .. q_r63]  ...     34 bytes per 32 weights

That layout is per-channel int8 that every GGUF product already runs (the weight-stationary
GEMVs with float32 or int8 activations, the tiled product, the C decoder layers), at 6% more
bytes than plain int8 codes plus one scale per row (34 bytes per 32 weights instead of 32), and
no kernel of its own. In-features must therefore be a multiple of 32.

`quantize_linear_weights` quantizes checkpoint tensors as the loader reads them: a stacked
weight's shards (q, k, v; gate, up) are rows of the stacked weight, and per-row scales make
quantizing each shard the same as quantizing the whole, so each shard becomes its rows of
blocks and no weight is ever resident in the run dtype.
"""

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization import gguf_linear
from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlocks, block_size
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

Q8_0 = 8  # GGMLQuantizationType.Q8_0
BLOCK_SIZE = block_size(Q8_0)  # weights per block
_MAX_CODE = 127


def quantize_rows(weight: torch.Tensor, name: str) -> GGUFBlocks:
    """weight: (rows, in) floating point, `name` its checkpoint tensor (for errors) -> Q8_0
    blocks, (rows, in / 32 * 34) uint8, of per-row scales as the module docstring says."""
    rows, in_features = weight.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"quantization='int8' cannot quantize {name}: its {in_features} input features "
                         f"are not a multiple of {BLOCK_SIZE} (rows are stored as blocks of {BLOCK_SIZE})")
    exact = torch.linalg.vector_norm(weight, torch.inf, dim=1, dtype=torch.float32) / _MAX_CODE  # (rows,)
    scale = exact.half()
    # Rounded up, never down, so that no code passes 127: the error stays within d / 2.
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
    if not torch.isfinite(scale).all():
        raise ValueError(f"quantization='int8' cannot quantize {name}: a row's largest weight is not "
                         f"finite or is beyond 127 times fp16's largest scale")
    divisor = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(1)         # (rows, 1); all-zero rows: codes 0
    codes = torch.div(weight, divisor).round_().clamp_(-_MAX_CODE, _MAX_CODE)  # (rows, in) float32
    blocks = in_features // BLOCK_SIZE
    data = torch.empty(rows, blocks, 2 + BLOCK_SIZE, dtype=torch.uint8)        # [d][32 codes] per block
    data[..., :2] = scale.view(torch.uint8).view(rows, 1, 2)                   # fp16 d, little-endian
    data[..., 2:].view(torch.int8).copy_(codes.view(rows, blocks, BLOCK_SIZE))
    return GGUFBlocks(data.view(rows, -1), Q8_0, in_features)


def _vocabulary_weight_names(model: nn.Module) -> set[str]:
    """The names under which the embedding's and the lm_head's weights load (a tied lm_head's
    included): the 2-D weights that stay in the run dtype."""
    return {f"{prefix}.{name}" for prefix, module in model.named_modules(remove_duplicate=False)
            if isinstance(module, (VocabParallelEmbedding, ParallelLMHead))
            for name, _ in module.named_parameters(recurse=False)}


def quantize_linear_weights(weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module
                            ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yields the checkpoint's (name, tensor) pairs for `model.load_weights`, every product
    weight (each 2-D tensor outside the embedding and the lm_head) as its Q8_0 blocks;
    biases, norms and the vocabulary tables as they are."""
    dense = _vocabulary_weight_names(model)
    for name, tensor in weights:
        if tensor.dim() == 2 and name not in dense:
            yield name, quantize_rows(tensor, name)
        else:
            yield name, tensor


def check_quantized(model: nn.Module) -> None:
    """Asserts that exactly the product weights of a loaded model hold blocks: every `Linear`'s
    but the lm_head's."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not isinstance(module, ParallelLMHead):
            assert module.quantized and module.weight.quant_type == Q8_0, f"{name} was not quantized"
        elif hasattr(module, "weight"):
            assert not gguf_linear.is_quantized(module.weight), f"{name} was quantized"
