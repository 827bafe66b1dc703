"""The C decoder layers (llama_cpu_layers.c) on weights kept in GGUF blocks against the op-by-op
layers on the same blocks, for each GGUF type; and the layers' product entry points against
cpu_gguf_gemv.matmul."""

import ctypes
import functools
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.k_quant_blocks import Q4_K, Q6_K, quantize_q4_k, quantize_q6_k
from tests.test_fused_layers import _assert_fused_matches_op_by_op
from tests.utils import build_tiny_checkpoint, random_prompts, tokens_op_by_op_then_fused
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import PACKED_MAX_ROWS, Linear, pack_linear_weights
from vllm.model_executor.layers.quantization import cpu_gguf_gemv, gguf_linear
from vllm.model_executor.layers.quantization.gguf_blocks import PANELS, GGUFBlocks, block_size
from vllm.model_executor.models.llama_cpu_layers import FusedLayers
from vllm.platforms.cpu import cpu_flags

gguf = pytest.importorskip("gguf")

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": Q4_K, "Q6_K": Q6_K}
BLOCK = 16


def _quantize(quant_type: int, weights: np.ndarray) -> torch.Tensor:
    """(n, k) float32 -> (n, row bytes) uint8 blocks of `quant_type` (Q4_K and Q6_K by
    tests/k_quant_blocks.py)."""
    if quant_type in (Q4_K, Q6_K):
        return torch.from_numpy((quantize_q4_k if quant_type == Q4_K else quantize_q6_k)(weights))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType(quant_type))))


def _cases(shapes: list[tuple[int, int, int]]) -> list[tuple[str, int, int, int]]:
    """(type, m, n, k) for each type and shape, k rounded up to whole blocks (Q4_K, Q6_K: 256)."""
    return [(name, m, n, -(-k // block_size(TYPES[name])) * block_size(TYPES[name]))
            for name in TYPES for m, n, k in shapes]


def _product(quant_type: int, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C layer's product for `quant_type`, called through its address as the layer calls it."""
    address = cpu_gguf_gemv.layer_product_address(quant_type)
    assert address is not None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    kernel = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, p, i64, i64, i64)(address)
    (m, k), n = x.shape, blocks.shape[0]
    y = x.new_empty(m, n)
    assert kernel(x.data_ptr(), blocks.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                  m, n, k) == 0
    return y


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name,m,n,k", _cases([(1, 7, 64), (3, 33, 160), (5, 64, 576), (16, 64, 576)]))
def test_layer_product_is_the_op_by_op_product(name, m, n, k, with_bias):
    """The layer's entry point for a type is `product` on that type: the product that
    product_path names (where that is the weight-stationary one, matmul on bf16 x, int8
    activations where the ISA has them), the bias added to the float32 sums before the one
    rounding to bf16."""
    rng = np.random.default_rng(m + n + k)
    blocks = _quantize(TYPES[name], rng.standard_normal((n, k)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16() if with_bias else None
    got = _product(TYPES[name], x, blocks, bias)
    assert torch.equal(got, cpu_gguf_gemv.product(x, blocks, TYPES[name], bias))
    path = cpu_gguf_gemv.product_path(TYPES[name], m, n, k)
    assert torch.equal(got, cpu_gguf_gemv.product(x, blocks, TYPES[name], bias, path=path))
    if path in ("int8", "float"):
        assert torch.equal(got, cpu_gguf_gemv.matmul(x, blocks, TYPES[name], cpu_gguf_gemv.int8_available(), bias))
    if with_bias:  # and the bias did something
        assert not torch.equal(got, cpu_gguf_gemv.product(x, blocks, TYPES[name], None))


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_layer_products_are_those_the_isa_has():
    """The tiled product where the CPU has the tile GEMM (test_gguf_kernels.py checks the int8
    products against the ISA); on an AVX2-only CPU (test_isa_fallback.py runs this and the layer
    product test as one) neither, so the layers' entry points are the float32 product at every
    row count."""
    flags = cpu_flags()
    assert cpu_gguf_gemv.tiled_fits(64) == ({"avx512_bf16", "avx512bw"} <= flags or "amx_bf16" in flags)
    if not cpu_gguf_gemv.int8_available() and not cpu_gguf_gemv.tiled_fits(64):
        assert {cpu_gguf_gemv.product_path(TYPES["Q4_1"], m, 64, 64) for m in (1, 16, 300)} == {"float"}


@pytest.mark.skipif(not cpu_gguf_gemv.tiled_fits(64), reason="no tile GEMM here")
@pytest.mark.parametrize("name,m,n,k", _cases([(1, 16, 64), (9, 48, 160), (40, 1040, 576)]))
def test_tiled_product_is_bf16_dequantize_then_matmul(name, m, n, k):
    """The tiled product (where there is no int8 GEMM): the weights dequantized to bf16 (nearest
    even), their float32 products with x and the bias, rounded to bf16 once; 1040 rows are more
    than one panel."""
    rng = np.random.default_rng(m + n + k)
    blocks = _quantize(TYPES[name], rng.standard_normal((n, k)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16()
    got = cpu_gguf_gemv.product(x, blocks, TYPES[name], bias, path="tiled").double()
    dense = cpu_gguf_gemv.dequantize(blocks, TYPES[name], k, torch.bfloat16).double()      # (n, k)
    want = x.double() @ dense.T + bias.double()
    bound = (k + 32) * 2.0 ** -24 * (x.double().abs() @ dense.abs().T) + want.abs() * 2.0 ** -8
    assert torch.all((got - want).abs() <= bound)


needs_fused_layers = pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                                        reason="the C layers' attention kernels need AVX512-BF16")


def _quantize_in_place(model: torch.nn.Module, type_of: Callable[[str], int | None], dense: dict[str, torch.Tensor],
                       cache: dict[tuple[str, int], GGUFBlocks]) -> None:
    """Every product weight, the embedding and the lm_head of `model` become GGUF blocks of
    `type_of(name)` (None: bf16) made from `dense` (name -> the bf16 weight as loaded; blocks
    kept in `cache`), then, as the CPU backend prepares a loaded model, regrouped into the int8
    GEMM's panels where it takes them (and bf16 weights packed)."""
    params = dict(model.named_parameters())
    for name, weight in dense.items():
        quant_type = type_of(name)
        if quant_type is not None and (name, quant_type) not in cache:
            cache[name, quant_type] = GGUFBlocks(_quantize(quant_type, weight.float().numpy()), quant_type,
                                                 weight.shape[1])
        param = params[name]
        param.data = weight.clone()  # dense again, then blocks of this type
        for attr in ("quant_type", "in_features", "dense_dtype"):
            if hasattr(param, attr):
                delattr(param, attr)
        if quant_type is not None:
            rows = gguf_linear.load_blocks(param, cache[name, quant_type])  # param.data: (rows, row bytes) uint8
            param.data.copy_(rows)
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed, module.tiled = False, None  # the bf16 copies no longer stand for the weight
    gguf_linear.mark_quantized(model)
    pack_linear_weights(model)


@pytest.fixture(scope="module")
def quantizable_llms(tokenizer_dir, tmp_path_factory) -> Callable[[str], tuple]:
    """kind -> a bf16 tiny model of that kind (head_dim 64, so prefill chunks take the C prefill
    kernel; Qwen2 with q/k/v biases and a tied lm_head) and its weights as loaded, to quantize per
    test; each kind built once for the module (an indirect parametrization would rebuild it for
    each of its parameter sets)."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("the C layers' attention kernels need AVX512-BF16")

    @functools.cache
    def build(kind: str) -> tuple:
        path = build_tiny_checkpoint(kind, str(tmp_path_factory.mktemp(kind)), tokenizer_dir, hidden_size=256)
        llm = LLM(path, dtype="bfloat16", max_model_len=512, block_size=BLOCK, num_gpu_blocks_override=512,
                  enforce_eager=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
        model = llm.llm_engine.runner.model
        dense = {name: p.detach().clone() for name, p in model.named_parameters()
                 if p.dim() == 2 and (name.endswith("proj.weight") or "embed" in name or "lm_head" in name)}
        return llm, dense, {}

    return build


def _quantized(quantizable_llm: tuple, name: str, type_of: Callable[[str], int | None] | None = None) -> LLM:
    """A `quantizable_llms` engine with its weights in blocks of GGUF type `name` (or of `type_of(weight
    name)`, None: bf16), C layers rebuilt."""
    llm, dense, cache = quantizable_llm
    runner = llm.llm_engine.runner
    _quantize_in_place(runner.model, type_of or (lambda _: TYPES[name]), dense, cache)
    fused = FusedLayers.build(runner.model.model)
    assert fused is not None and fused.max_tokens == PACKED_MAX_ROWS
    runner.attn_backend.fused_layers = runner.model.model.fused_layers = fused
    assert llm.reset_prefix_cache()
    return llm


@needs_fused_layers
@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
@pytest.mark.parametrize("contexts,chunks", [([37], []), ([5, 200, 16], []), ([11 * i % 170 for i in range(16)], []),
                                             ([130, 3], [(1, 0), (2, 200)]), ([7], [(100, 30)])])
@pytest.mark.parametrize("kind,name", [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"), ("llama", "Q4_K"),
                                       ("llama", "Q6_K"), ("qwen2", "Q4_1")])
def test_quantized_steps_match_op_by_op(quantizable_llms, kind, name, contexts, chunks):
    """Same hidden states and cache writes from the C layers and the op-by-op layers on the
    same blocks (each type on Llama, hidden size 256 for the super-blocks; Qwen2's q/k/v
    biases on Q4_1), for 1-16 decodes and prefill chunks with and without decodes: products of 1
    to 101 rows, on the int8 GEMM where it runs and decodes the type (else 1-3 rows on the int8
    or float32 product, 16 and 101 on the tiled one); the GEMM's types in its panels, but Q4_K,
    which it reads from rows."""
    runner = _quantized(quantizable_llms(kind), name).llm_engine.runner
    weights = [m.weight for m in runner.model.modules() if isinstance(m, Linear)]  # the products'
    assert all(p.dtype == torch.uint8 for p in weights)
    panels = cpu_gguf_gemv.gemm_takes(TYPES[name]) and name != "Q4_K"  # the GEMM reads Q4_K's rows
    assert {bool(p.quant_type & PANELS) for p in weights} == {panels}
    _assert_fused_matches_op_by_op(runner, contexts, chunks, random.Random(len(contexts) + 7 * len(chunks)))


def _q4_k_m(name: str) -> int | None:
    """Types as a Q4_K_M file loads: Q4_K, Q6_K for layer 0's down and the lm_head, and bf16 for
    layer 0's q/k/v (stacked from a Q6_K v beside Q4_K q and k, dequantized when loaded)."""
    if name == "model.layers.0.self_attn.qkv_proj.weight":
        return None
    return Q6_K if name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight") else Q4_K


@needs_fused_layers
@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
@pytest.mark.parametrize("contexts,chunks", [([37, 5], []), ([130, 3], [(1, 0), (2, 200)]), ([7], [(100, 30)])])
def test_steps_on_weights_of_mixed_types_match_op_by_op(quantizable_llms, contexts, chunks):
    """Each weight has its own product in the C layers: a model of Q4_K, Q6_K and bf16 weights
    (as a Q4_K_M file loads) runs there, with the op-by-op layers' hidden states and cache."""
    runner = _quantized(quantizable_llms("llama"), "", _q4_k_m).llm_engine.runner
    types = {getattr(m.weight, "quant_type", None) for m in runner.model.modules() if isinstance(m, Linear)}
    assert types == {Q4_K, Q6_K, None}
    _assert_fused_matches_op_by_op(runner, contexts, chunks, random.Random(len(contexts) + 7 * len(chunks)))


@needs_fused_layers
@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantized_engine_decodes_through_fused_layers(quantizable_llms, kind):
    """Greedy chunked generations of 9 prompts (steps of up to 64 tokens, all of which the C
    layers take) on Q4_1 blocks (the default model's type; the step tests cover the others),
    with the op-by-op path's tokens."""
    llm = _quantized(quantizable_llms(kind), "Q4_1")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 90, 8, 61, 5, 70, 30], seed=5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = tokens_op_by_op_then_fused(
        llm, lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
