"""The C products on GGUF blocks (cpu_gguf_gemv.c) against the gguf package's dequantize followed
by a float64 matmul, on blocks the gguf package quantizes from random weights (Q4_K and Q6_K:
random super-blocks, tests/k_quant_blocks.py)."""

import shutil

import numpy as np
import pytest
import torch

from tests.k_quant_blocks import Q4_K, Q6_K, random_q4_k, random_q6_k
from vllm.model_executor.layers.quantization import cpu_gguf_gemv
from vllm.model_executor.layers.quantization.gguf_blocks import PANELS, block_size, row_bytes
from vllm.platforms.cpu import cpu_flags

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not cpu_gguf_gemv.available(),
                                reason="the GGUF kernels need a C compiler")

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": Q4_K, "Q6_K": Q6_K}
# (tokens, output rows, K): odd row counts, 1 to 8 tokens; K not a multiple of 256 (CASES rounds it
# up to whole super-blocks for Q4_K and Q6_K: 1 to 3 of them).
SHAPES = [(1, 1, 32), (1, 7, 96), (2, 33, 160), (3, 64, 576), (5, 17, 288), (8, 65, 544)]
X_BLOCK = 32  # the int8 product quantizes x per 32 columns
_EPS32 = 2.0 ** -24  # float32 unit roundoff


def _whole_blocks(name: str, k: int) -> int:
    """k rounded up to whole blocks of type `name` (Q4_K and Q6_K rows are super-blocks of 256)."""
    size = block_size(TYPES[name])
    return -(-k // size) * size


# (type, tokens, output rows, K) for each type and shape.
CASES = [(name, m, n, _whole_blocks(name, k)) for name in TYPES for m, n, k in SHAPES]


def _blocks(quant_type: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights in GGUF blocks (Q4_K, Q6_K: random super-blocks): ((n, row bytes) uint8, the
    gguf package's (n, k) float32)."""
    rng = np.random.default_rng(seed)
    if quant_type in (Q4_K, Q6_K):
        data = (random_q4_k if quant_type == Q4_K else random_q6_k)(n, k, rng)
    else:
        weights = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        data = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(quant_type))
    assert data.shape == (n, row_bytes(quant_type, k))
    dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(quant_type)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(data)), dense


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // X_BLOCK, 1, generator=g).mul(3).repeat_interleave(
        X_BLOCK, 1).view(m, k)  # block scales that differ, as the int8 path sees them
    return x.to(dtype)


def _float_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float32 rounding of K products and their sums: (K + 32) u |W| |x| (a sum over K terms
    in 32 lanes, then across the lanes, is within that of the exact sum)."""
    k = w.shape[1]
    return (k + 32) * _EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_the_gguf_packages(name):
    k = _whole_blocks(name, 160)
    data, dense = _blocks(TYPES[name], 9, k, seed=1)
    assert torch.equal(cpu_gguf_gemv.dequantize(data, TYPES[name], k, torch.float32), torch.from_numpy(dense))
    rows = torch.tensor([8, 0, 3, 3])
    picked = cpu_gguf_gemv.dequantize(data, TYPES[name], k, torch.bfloat16, rows)
    assert torch.equal(picked, torch.from_numpy(dense)[rows].bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,m,n,k", CASES)
def test_float_product_is_dequantize_then_matmul(name, m, n, k, dtype):
    data, dense = _blocks(TYPES[name], n, k, seed=m * n + k)
    x = _x(m, k, dtype, seed=k)
    y = cpu_gguf_gemv.matmul(x, data, TYPES[name], int8_activations=False)
    assert y.shape == (m, n) and y.dtype == dtype
    xf = x.float().numpy()
    want = xf.astype(np.float64) @ dense.astype(np.float64).T
    bound = _float_bound(dense, xf)
    if dtype == torch.bfloat16:  # the result is rounded to bf16 once
        bound = bound + np.abs(want) * 2.0 ** -8
    assert np.all(np.abs(y.float().numpy() - want) <= bound)


def _quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q8 activation blocks, as the C code forms them in float32: (x's codes times
    their scales (M, K), the scales (M, K / 32))."""
    m, k = x.shape
    blocks = x.reshape(m, k // X_BLOCK, X_BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inv[..., None])  # round half to even, as the C code's nearbyintf
    assert np.abs(codes).max() <= 127
    return (codes * d[..., None].astype(np.float64)).reshape(m, k), d


@pytest.mark.skipif(not cpu_gguf_gemv.int8_available(), reason="the CPU has no int8 dot products")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,m,n,k", CASES)
def test_int8_product_is_dequantize_then_matmul_of_quantized_activations(name, m, n, k, dtype):
    data, dense = _blocks(TYPES[name], n, k, seed=m * n + k)
    x = _x(m, k, dtype, seed=k)
    y = cpu_gguf_gemv.matmul(x, data, TYPES[name], int8_activations=True)
    assert y.shape == (m, n) and y.dtype == dtype
    xf = x.float().numpy()
    xq, scales = _quantized_activations(xf)
    out = y.float().numpy()
    rounding = np.abs(out) * 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    # Integer block sums are exact; what is left is float32 rounding of the scaled block sums.
    want = xq @ dense.astype(np.float64).T
    assert np.all(np.abs(out - want) <= _float_bound(dense, xq) + rounding)
    # Against x itself: each activation moved by at most half its block's scale.
    half_step = np.repeat(scales / 2, X_BLOCK, axis=1).astype(np.float64)   # (M, K)
    exact = xf.astype(np.float64) @ dense.astype(np.float64).T
    bound = half_step @ np.abs(dense.astype(np.float64)).T + _float_bound(dense, xf) + rounding
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.skipif(not cpu_gguf_gemv.int8_available(), reason="no int8 product in this build")
def test_int8_product_is_exact_at_the_extreme_codes():
    """Q8_0 codes of -128 and 127 against x codes of +-127: the largest pair sums the int8
    products form (2 * 128 * 127, within int16 for AVX2's pair products), signs mixed."""
    k = 64
    codes = np.tile(np.array([-128, -128, 127, -128], dtype=np.int8), (3, k // 4))  # (3, k)
    codes[1] = -128
    codes[2, ::2] = 127
    scale = np.full((3, k // X_BLOCK, 1), np.float16(2.0 ** -6)).view(np.uint8)     # (3, blocks, 2)
    data = np.concatenate([scale, codes.view(np.uint8).reshape(3, k // X_BLOCK, X_BLOCK)], axis=-1).reshape(3, -1)
    dense = codes.astype(np.float64) * 2.0 ** -6
    x = torch.from_numpy(np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)[None])  # codes +-127
    y = cpu_gguf_gemv.matmul(x, torch.from_numpy(data), TYPES["Q8_0"], int8_activations=True)
    want = x.double().numpy() @ dense.T  # x is exactly its codes times 1/127: only float32 sums round
    assert np.allclose(y.numpy(), want, rtol=2.0 ** -20, atol=0)


# (tokens, output rows, K). AVX512-VNNI: up to a tile of 8 rows each block multiplied as it is
# decoded (1, 5, 8); past it, pairs of unpacked panels take tiles of 6, 4, 2 and 1 rows (16 =
# 6 + 6 + 4, 17, 20 = 6 + 6 + 6 + 2, 40) and an odd last panel tiles of 8, 4, 2 and 1 (31 = 8 +
# 8 + 8 + 4 + 2 + 1); 16-row panels: one partial, a pair with a partial second (20), a pair and
# a partial third (33), a pair and a whole third (48), several. AVX2: up to 4 rows decoded as
# they multiply (1); past it, both 8-row halves of 16 output rows unpacked take tiles of 3 rows
# and the rest (5 = 3 + 2, 16 = 5 * 3 + 1), and a last lone half tiles of 4 and the rest (31 =
# 7 * 4 + 3); 16 output rows: whole, 1 or 4 or 7 rows of a lone half, a partial second half (29).
GEMM_SHAPES = [(1, 16, 32), (5, 17, 96), (8, 33, 160), (16, 48, 576), (17, 33, 160), (20, 20, 96), (31, 7, 64),
               (40, 80, 1536), (16, 29, 96)]
# The types the int8 GEMM decodes (Q4_K from its rows, K rounded up to whole super-blocks), and
# those of them that panels hold (32-weight blocks one after another).
GEMM_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K"]
PANEL_TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def _skip_unless_the_gemm_decodes(name: str) -> None:
    if not cpu_gguf_gemv.gemm_takes(TYPES[name]):
        pytest.skip(f"the int8 GEMM built here does not decode {name} (AVX512-VNNI's decodes Q4_K)")


@pytest.mark.skipif(not cpu_gguf_gemv.gemm_available(), reason="no int8 GEMM here (AVX2 or AVX512-VNNI)")
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("name", GEMM_TYPES)
def test_gemm_is_dequantize_then_matmul_of_quantized_activations(name, m, n, k):
    """The int8 GEMM: x's blocks quantized as for the int8 product, exact integer block sums,
    then float32 rounding of the scaled block sums and of the bias added, one rounding to bf16."""
    _skip_unless_the_gemm_decodes(name)
    k = _whole_blocks(name, k)
    data, dense = _blocks(TYPES[name], n, k, seed=m * n + k)
    x = _x(m, k, torch.bfloat16, seed=k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    y = cpu_gguf_gemv.product(x, data, TYPES[name], bias, path="gemm")
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    xq, _ = _quantized_activations(x.float().numpy())
    want = xq @ dense.astype(np.float64).T + bias.double().numpy()
    out = y.double().numpy()
    bound = _float_bound(dense, xq) + 2 * _EPS32 * np.abs(want) + np.abs(out) * 2.0 ** -8
    assert np.all(np.abs(out - want) <= bound)


@pytest.mark.skipif(not cpu_gguf_gemv.gemm_available(), reason="no int8 GEMM here (AVX2 or AVX512-VNNI)")
@pytest.mark.parametrize("name", GEMM_TYPES)
def test_gemm_rows_do_not_depend_on_the_other_rows(name):
    """Each row of x sums its blocks in the same order whatever tile it falls in: a token's
    result is the same bits in a step of 40 rows (tiles on an unpacked panel) and of 5 (blocks
    multiplied as they are decoded) as alone (80 000 outputs, so that a float32 rounding that
    differs shows through the rounding to bf16)."""
    _skip_unless_the_gemm_decodes(name)
    k = _whole_blocks(name, 576)
    data, _ = _blocks(TYPES[name], 2008, k, seed=3)
    x = _x(40, k, torch.bfloat16, seed=4)
    together = cpu_gguf_gemv.product(x, data, TYPES[name], None, path="gemm")
    fives = torch.cat([cpu_gguf_gemv.product(x[i:i + 5], data, TYPES[name], None, path="gemm")
                       for i in range(0, 40, 5)])
    alone = torch.cat([cpu_gguf_gemv.product(x[i:i + 1], data, TYPES[name], None, path="gemm") for i in range(40)])
    assert torch.equal(alone, together)
    assert torch.equal(alone, fives)


@pytest.mark.skipif(not cpu_gguf_gemv.gemm_available(), reason="no int8 GEMM here (AVX2 or AVX512-VNNI)")
@pytest.mark.parametrize("name", PANEL_TYPES)
def test_panels_are_the_rows_regrouped(name):
    """A weight regrouped into 16-row panels dequantizes to the same rows (all, or looked up as
    an embedding does) and multiplies to the same bits as its rows, at every row count the GEMM
    tiles differently (one row decodes and multiplies in one pass)."""
    quant_type, n, k = TYPES[name], 96, 160
    data, _ = _blocks(quant_type, n, k, seed=5)
    panels = cpu_gguf_gemv.to_panels(data, quant_type, k)
    assert panels.shape == data.shape and not torch.equal(panels, data)
    assert torch.equal(cpu_gguf_gemv.dequantize(panels, quant_type | PANELS, k, torch.float32),
                       cpu_gguf_gemv.dequantize(data, quant_type, k, torch.float32))
    ids = torch.tensor([17, 0, n - 1, 17, 40])
    assert torch.equal(cpu_gguf_gemv.dequantize(panels, quant_type | PANELS, k, torch.bfloat16, ids),
                       cpu_gguf_gemv.dequantize(data, quant_type, k, torch.bfloat16, ids))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    for m in (1, 2, 3, 4, 16, 17, 40):
        x = _x(m, k, torch.bfloat16, seed=m)
        assert cpu_gguf_gemv.product_path(quant_type | PANELS, m, n, k) == "gemm"
        assert torch.equal(cpu_gguf_gemv.product(x, panels, quant_type | PANELS, bias),
                           cpu_gguf_gemv.product(x, data, quant_type, bias, path="gemm")), m


@pytest.mark.skipif(not cpu_gguf_gemv.gemm_available(), reason="no int8 GEMM here (AVX2 or AVX512-VNNI)")
def test_only_whole_panels_of_the_gemms_types_are_regrouped():
    """Rows that are not whole panels, Q4_K (which the GEMM reads from its rows) and panels again
    stay as they are;
    the products that read rows refuse panels."""
    data, _ = _blocks(TYPES["Q4_1"], 40, 64, seed=6)
    assert cpu_gguf_gemv.to_panels(data, TYPES["Q4_1"], 64) is None
    assert cpu_gguf_gemv.to_panels(_blocks(Q4_K, 32, 256, seed=7)[0], Q4_K, 256) is None
    panels = cpu_gguf_gemv.to_panels(data[:32].contiguous(), TYPES["Q4_1"], 64)
    assert cpu_gguf_gemv.to_panels(panels, TYPES["Q4_1"] | PANELS, 64) is None
    with pytest.raises(AssertionError, match="status 1"):
        cpu_gguf_gemv.product(_x(2, 64, torch.bfloat16, seed=0), panels, TYPES["Q4_1"] | PANELS, None, path="int8")


@pytest.mark.skipif(not cpu_gguf_gemv.gemm_available(), reason="no int8 GEMM here (AVX2 or AVX512-VNNI)")
@pytest.mark.parametrize("m", [1, 2, 16, 256])
@pytest.mark.parametrize("name", GEMM_TYPES)
def test_bf16_products_take_the_gemm_where_it_runs(name, m):
    """Where the int8 GEMM is built it serves bf16 x at every row count, Q4_K's from 2 rows (its
    benchmark has it ahead of the weight-stationary and tiled products there), and `product`
    runs it."""
    k = _whole_blocks(name, 64)
    data, _ = _blocks(TYPES[name], 48, k, seed=m)
    x = _x(m, k, torch.bfloat16, seed=m)
    if name == "Q4_K" and (m == 1 or not cpu_gguf_gemv.gemm_takes(TYPES[name])):
        # and at every row count where the GEMM built here does not decode Q4_K (AVX2's)
        assert cpu_gguf_gemv.product_path(TYPES[name], m, 48, k) == "int8"
        return
    assert cpu_gguf_gemv.product_path(TYPES[name], m, 48, k) == "gemm"
    assert torch.equal(cpu_gguf_gemv.product(x, data, TYPES[name], None),
                       cpu_gguf_gemv.product(x, data, TYPES[name], None, path="gemm"))


@pytest.mark.skipif(not cpu_gguf_gemv.tiled_fits(48), reason="no tile GEMM here")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_super_blocks_take_the_weight_stationary_then_a_product_for_many_rows(name):
    """A single row takes the weight-stationary product; more take the int8 GEMM where it is
    built and decodes the type (Q4_K, from its rows), else, from a few rows, the tiled product."""
    quant_type = TYPES[name]
    many = "gemm" if cpu_gguf_gemv.gemm_takes(quant_type) else "tiled"
    assert cpu_gguf_gemv.gemm_takes(quant_type) == (name == "Q4_K" and cpu_gguf_gemv.gemm_available())
    assert cpu_gguf_gemv.product_path(quant_type, 1, 48, 256) == ("int8" if cpu_gguf_gemv.int8_available() else "float")
    assert cpu_gguf_gemv.product_path(quant_type, 64, 48, 256) == many
    assert cpu_gguf_gemv.batched_fits(quant_type, 48, 256)
    assert cpu_gguf_gemv.batched_fits(quant_type, 40, 256) == (many == "gemm")  # tiles need whole 16-row panels
    assert cpu_gguf_gemv.to_panels(_blocks(quant_type, 48, 256, seed=5)[0], quant_type, 256) is None  # rows only
    data, dense = _blocks(quant_type, 48, 512, seed=5)
    x = _x(64, 512, torch.bfloat16, seed=5)
    want = x.double().numpy() @ dense.astype(np.float64).T
    got = cpu_gguf_gemv.product(x, data, quant_type, None, path="tiled").double().numpy()
    # bf16 tiles (a relative 2^-9 per weight) and bf16 output (2^-9)
    bound = 2.0 ** -8 * (np.abs(x.double().numpy()) @ np.abs(dense.astype(np.float64)).T) + 2.0 ** -8 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound + 1e-30)


def test_int8_product_is_where_the_isa_has_it():
    flags = cpu_flags()
    # vpdpbusd where AVX512-VNNI or AVX-VNNI has it, AVX2's pair products elsewhere (an AVX2-only
    # CPU: test_isa_fallback.py also runs this file as one).
    assert cpu_gguf_gemv.int8_available() == ("avx2" in flags)
    # The int8 GEMM: AVX512-VNNI's, which also decodes Q4_K, else AVX2's on the pair products.
    vnni = {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
    assert cpu_gguf_gemv.gemm_available() == ("avx2" in flags)
    assert cpu_gguf_gemv.gemm_takes(TYPES["Q4_1"]) == ("avx2" in flags)
    assert cpu_gguf_gemv.gemm_takes(Q4_K) == vnni
    # A few rows of bf16 x take the int8 product; without AVX2, the portable float32 product.
    assert (cpu_gguf_gemv.product_path(TYPES["Q4_1"], 3, 16, 64) == "float") == ("avx2" not in flags)
