"""The C kernels' build and loader (vllm/platforms/c_build.py, c_library.py), the bf16 GEMV, the
tile GEMM (AMX and AVX512-BF16 copies) and the element-wise C."""

import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.utils import on_tile_gemm_copy
from vllm.model_executor.layers import cpu_gemv, cpu_layer_ops, cpu_tile_gemm
from vllm.model_executor.layers.linear import Linear, can_pack
from vllm.platforms import c_build
from vllm.platforms.c_library import CFunction, CLibrary
from vllm.platforms.cpu import cpu_flags

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="the C kernels need a C compiler")


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert c_build.load_c_library(cpu_gemv._LIBRARY.source, "the torch path is used") is None
    assert "the torch path is used" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


def test_switch_turns_kernels_off_and_rejects_other_values(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_C_KERNELS", "0")
    assert c_build.load_c_library(cpu_gemv._LIBRARY.source, "") is None
    monkeypatch.setenv("VLLM_CPU_C_KERNELS", "yes")
    with pytest.raises(ValueError, match="VLLM_CPU_C_KERNELS"):
        c_build.load_c_library(cpu_gemv._LIBRARY.source, "")


_PROBE_SOURCE = """
#include <stdint.h>
static int ready;
int64_t twice(int64_t x) { return 2 * x; }
int set_ready(int value) { return ready = value; }
int is_ready(void) { return ready; }
int yes(void) { return 1; }
int no(void) { return 0; }
"""


@pytest.fixture
def probe_source(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    source = tmp_path / "probe.c"
    source.write_text(_PROBE_SOURCE)
    return source


@needs_cc
def test_library_is_typed_loaded_once_and_gives_addresses(probe_source):
    loads = []
    library = CLibrary(probe_source, "", {"twice": CFunction([ctypes.c_int64], ctypes.c_int64),
                                          "set_ready": CFunction([ctypes.c_int])},
                       supported="yes", on_load=lambda lib: loads.append(lib.set_ready(1)))
    lib = library.get()
    assert lib is not None and library.get() is lib and loads == [1]
    assert lib.is_ready() == 1
    assert lib.twice(3 << 40) == 6 << 40  # needs the declared int64 argument and result
    twice = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(library.address("twice"))
    assert twice(-21) == -42
    with pytest.raises(AssertionError, match="not declared"):
        library.address("is_ready")


@needs_cc
def test_library_the_cpu_does_not_support_is_unavailable(probe_source):
    library = CLibrary(probe_source, "", {"twice": CFunction([ctypes.c_int64], ctypes.c_int64)}, supported="no")
    assert library.get() is None and library.address("twice") is None


def test_included_headers_are_followed_through_headers_to_the_kernel_directory(tmp_path):
    (tmp_path / "outer.h").write_text('#include "inner.h"\n#include <stdint.h>\n')
    (tmp_path / "inner.h").write_text('#include "bf16.h"\n#include "outer.h"\n')  # a cycle, and a shared one
    (tmp_path / "unused.h").write_text("")
    source = tmp_path / "probe.c"
    source.write_text('#include "outer.h"\n  #  include "inner.h"\n')
    assert c_build.included_headers(source) == sorted(
        [tmp_path / "outer.h", tmp_path / "inner.h", c_build.KERNEL_SOURCES / "bf16.h"])


@needs_cc
def test_a_library_is_rebuilt_when_a_header_it_includes_changes(probe_source):
    probe_source.write_text('#include "probe.h"\n' + _PROBE_SOURCE)
    header = probe_source.with_name("probe.h")
    header.write_text("#define PROBE 1\n")

    def built() -> set[str]:
        assert c_build.load_c_library(probe_source, "") is not None
        return {p.name for p in (probe_source.parent / "cache").rglob("*.so")}

    first = built()
    probe_source.with_name("unrelated.h").write_text("#define OTHER 1\n")
    assert built() == first  # a header it does not include leaves its key alone
    header.write_text("#define PROBE 2\n")
    assert len(built() - first) == 1


def test_library_is_unavailable_with_the_kernels_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_C_KERNELS", "0")
    library = CLibrary(cpu_gemv._LIBRARY.source, "", {"gemv_bf16": CFunction([])})
    assert library.get() is None and library.address("gemv_bf16") is None


@needs_cc
def test_gemv_is_built_where_the_cpu_has_avx512_bf16():
    assert cpu_gemv.max_rows() == (4 if "avx512_bf16" in cpu_flags() else 0)


@needs_cc
@pytest.mark.skipif(cpu_gemv.max_rows() == 0, reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (70, 100)])  # in, out; 70: a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float32_linear(rows, shape, with_bias):
    torch.manual_seed(rows)
    k, n = shape
    x = torch.randn(rows, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = cpu_gemv.gemv(x, weight, bias)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums of exact products, then one rounding to bf16 (8 significant bits)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_cc
@pytest.mark.skipif(cpu_gemv.max_rows() == 0, reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 5, 13, 4103])  # W rows: below, between and past whole blocks of 4
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_rows_past_whole_blocks(rows, n, threads):
    """Every output row, whichever thread and block (or the rows left after the blocks) has it,
    is the float32 sum rounded once; k = 47: one 32-wide step and a tail."""
    torch.manual_seed(n)
    k = 47
    x = torch.randn(rows, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemv.gemv(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_cc
def test_float32_gemv_is_built_where_the_cpu_has_avx2_and_fma():
    assert cpu_gemv.max_rows(torch.float32) == (cpu_gemv.F32_MAX_ROWS if {"avx2", "fma"} <= cpu_flags() else 0)


needs_float32_gemv = pytest.mark.skipif(cpu_gemv.max_rows(torch.float32) == 0, reason="the CPU lacks AVX2 with FMA")


@needs_cc
@needs_float32_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 48])  # 7: a group of 4 and one of 3
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (70, 100), (5, 7)])  # in, out; 70, 5: tails
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_gemv_matches_float64_linear(rows, shape, with_bias):
    torch.manual_seed(rows)
    k, n = shape
    x, weight = torch.randn(rows, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    bias = torch.randn(n, dtype=torch.float64) if with_bias else None
    got = cpu_gemv.gemv(x.float(), weight.float(), None if bias is None else bias.float())
    want = F.linear(x.float().double(), weight.float().double(), bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # k float32 roundings of sums of magnitude ~sqrt(k), against exact products of the same inputs
    torch.testing.assert_close(got.double(), want, rtol=0, atol=k * 2 ** -22)


@needs_cc
@needs_float32_gemv
@pytest.mark.parametrize("n", [1, 3, 5, 13, 4103])  # W rows: below, between and past whole blocks of 3 and 4
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_gemv_bits_do_not_depend_on_the_rows_beside_them(n, threads):
    """An output is the same bits whatever the row count (blocks of 4 W rows up to 2 rows of x, of
    3 from 3 on; x's rows in groups of 4 and the rest), whichever thread and block (or the rows
    after the blocks) took its W row; k = 47: 5 steps of 8 and a masked tail."""
    torch.manual_seed(n)
    x, weight, bias = torch.randn(9, 47), torch.randn(n, 47), torch.randn(n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = [cpu_gemv.gemv(x[:rows], weight, bias) for rows in range(1, 10)]
    finally:
        torch.set_num_threads(before)
    alone = torch.cat([cpu_gemv.gemv(x[i:i + 1], weight, bias) for i in range(9)])
    for rows, got in enumerate(together, start=1):
        assert torch.equal(got, alone[:rows]), rows
    torch.testing.assert_close(alone, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_cc
@needs_float32_gemv
def test_packed_float32_linear_takes_decode_rows_to_the_gemv():
    torch.manual_seed(0)
    layer = Linear(47, 13, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(13, 47))
        layer.bias.copy_(torch.randn(13))
    assert can_pack(torch.float32)
    layer.pack()
    rows = cpu_gemv.max_rows(torch.float32)
    x = torch.randn(rows + 1, 47)
    with torch.no_grad():
        assert torch.equal(layer(x[:rows]), cpu_gemv.gemv(x[:rows], layer.weight, layer.bias))
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # past the GEMV's rows


@needs_cc
def test_tile_gemm_is_built_where_the_cpu_has_amx_or_avx512_bf16():
    flags = cpu_flags()
    has_avx512 = {"avx512_bf16", "avx512bw"} <= flags
    has_amx = {"amx_tile", "amx_bf16"} <= flags or (has_avx512 and bool(c_build.emulation_flags()))
    assert cpu_tile_gemm.max_rows() == (32 if has_amx or has_avx512 else 0)
    if cpu_tile_gemm.max_rows():
        assert cpu_tile_gemm.use_amx(True) == has_amx  # AMX where the CPU has it (and Linux allows it)


@pytest.fixture(params=["amx", "avx512"])
def tile_copy(request):
    """The tile GEMM on each of its copies that this CPU has."""
    yield from on_tile_gemm_copy(request.param)


def _assert_within_product_bound(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None) -> None:
    """got (M, N) bf16 against the exact x @ weight^T + bias of the bf16 inputs (float64 holds it
    exactly enough). Both copies add the exact bf16 products (8-bit significands: exact in
    float32) into float32 sums, one round-to-nearest-even per addition (vdpbf16ps and AMX's
    tdpbf16ps alike, whatever the order), so with u = 2^-24 and k + 1 additions counting the
    bias's: |sum - exact| <= e = 1.01 (k + 1) u sum|terms|. Their flushing of denormal inputs and
    outputs to zero cannot matter at these magnitudes. Then one rounding to bf16 (8 significant
    bits): |got - sum| <= 2^-8 |sum|. Together: |got - exact| <= 2^-8 (|exact| + e) + e."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T                                                    # (M, N)
    magnitude = x64.abs() @ w64.abs().T                                    # (M, N): sum |terms|
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    e = 1.01 * (x.shape[1] + 1) * 2.0 ** -24 * magnitude
    excess = (got.double() - exact).abs() - (2.0 ** -8 * (exact.abs() + e) + e)
    assert excess.max() <= 0, f"{(excess > 0).sum()} outputs outside the bound, by up to {excess.max():.3g}"


@needs_cc
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 13, 16, 17, 24, 31, 32, 33, 50, 64, 77, 100, 250, 264])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 1024), (64, 48), (32, 16)])  # in, out
@pytest.mark.parametrize("with_bias", [False, True])
def test_tile_gemm_matches_exact_product(rows, shape, with_bias, tile_copy):
    """Output widths that fill every group and ones that leave the last short (groups of 4, 3
    and 2 blocks of 16 columns on 2 threads: 1024, 960 and 48 columns; 16: one block). AMX: one
    tile of x (up to 16 rows) and two; past 32 rows, 32-row slabs with a last one of 17-32 rows
    (50 = 32 + 18, 250 = 224 + 26) or of 1-16 rows on one tile (77 = 64 + 13, 264 = 256 + 8);
    with in = 1536 and 250 or 264 rows the threads split the slabs, not the column blocks.
    AVX512: blocks of rows of every height 1-12 (4, 3 and 2 column blocks take up to 6, 8 and
    12 rows at a time) and the uneven splits of 13-264 rows between them."""
    torch.manual_seed(rows)
    k, n = shape
    x = torch.randn(rows, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = cpu_tile_gemm.gemm(x, cpu_tile_gemm.pack(weight), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    _assert_within_product_bound(got, x, weight, bias)


@needs_cc
@pytest.mark.parametrize("rows", [1, 4, 5, 13, 16, 17, 31, 32, 33, 50, 77, 100, 264])
@pytest.mark.parametrize("shape", [(576, 3072), (64, 96), (64, 64), (96, 160), (1024, 96)])  # in, out (gate | up)
@pytest.mark.parametrize("with_bias", [False, True])
def test_tile_gemm_silu_mul_equals_the_product_then_silu_mul(rows, shape, with_bias, tile_copy):
    """Bit for bit the two steps it fuses, on each copy: gate block j meets up block j half the
    weight later. Groups of 2 pairs (3072 and 64 columns on 2 threads) and of 1 (96: 3 pairs,
    160: 5). AMX: up to 16 rows on one tile of x, then 32-row slabs with a last one of 17-32 or
    1-16 rows (with in = 1024 and 264 rows, split between the threads by slabs). AVX512: blocks of
    up to 6 rows (2 pairs) or 12 (1 pair)."""
    torch.manual_seed(rows)
    k, n = shape
    x = torch.randn(rows, k).bfloat16()
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    packed = cpu_tile_gemm.pack(weight)
    got = cpu_tile_gemm.gemm_silu_mul(x, packed, bias)
    assert got.shape == (rows, n // 2)
    assert torch.equal(got, cpu_layer_ops.silu_mul(cpu_tile_gemm.gemm(x, packed, bias)))


@needs_cc
@pytest.mark.skipif(cpu_tile_gemm.max_rows() == 0, reason="the CPU has neither AMX nor AVX512-BF16")
def test_tile_pack_only_takes_shapes_that_fill_whole_tiles():
    assert cpu_tile_gemm.pack(torch.randn(48, 64).bfloat16()) is not None
    assert cpu_tile_gemm.pack(torch.randn(40, 64).bfloat16()) is None   # out % 16
    assert cpu_tile_gemm.pack(torch.randn(48, 80).bfloat16()) is None   # in % 32
    assert cpu_tile_gemm.pack(torch.randn(48, 64)) is None              # float32


@needs_cc
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_rms_norm_rounds_as_torch_does(rows):
    """bf16 at the same two points as the torch norm; only the float32 sum's order differs, so
    an element may move by one bf16 unit, rarely."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 3).bfloat16()
    weight = torch.randn(576).bfloat16()
    h = x.float()
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = cpu_layer_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    assert (got != want).float().mean() < 0.01


@needs_cc
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_add_rms_norm_adds_in_place_then_norms(rows):
    """The residual add rounds as torch's bf16 add, bit for bit; the norm then reads the sum."""
    torch.manual_seed(rows)
    residual = (torch.randn(rows, 576) * 3).bfloat16()
    delta = torch.randn(rows, 576).bfloat16()
    weight = torch.randn(576).bfloat16()
    want_sum = residual + delta
    want = cpu_layer_ops.rms_norm(want_sum, weight, 1e-5)
    got = cpu_layer_ops.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, want_sum)
    assert torch.equal(got, want)


@needs_cc
@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 72), (264, 1536), (3, 7)])
def test_silu_mul_rounds_as_torch_does(rows, width):
    """bf16 at the same two points as torch; e^x's last float32 bit may differ, so silu(gate)
    may move by one bf16 unit, rarely, and the product's own rounding can stretch that to just
    over one unit of the result. Widths off 16 take the scalar tail."""
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate, up = gate_up.split(width, dim=-1)
    want = F.silu(gate) * up
    got = cpu_layer_ops.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=0)
    assert (got != want).float().mean() < 0.01


@needs_cc
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rotary_equals_torch_bit_for_bit(rows):
    """q and k as views inside qkv rows (strided), the layout the attention layer hands over."""
    torch.manual_seed(rows)
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64).bfloat16()
    qk = qkv[:, :12 * 64].view(rows, 12, 64)                                  # (T, H + KVH, D)
    cos, sin = torch.randn(rows, 1, 64).bfloat16(), torch.randn(rows, 1, 64).bfloat16()
    want = qk * cos + torch.roll(qk, 32, dims=-1) * sin
    assert torch.equal(cpu_layer_ops.rotary(qk, cos, sin), want)
