"""The kernels' AMX copies on emulated tiles (vllm/csrc/cpu/amx_emulation.h).

On a CPU with AVX512-BF16 but no AMX, the AMX copies of the tile GEMM and of the prefill and
decode attention skip in every test, and so do the choices that follow them (on AMX the GEMV keeps
1-4 rows, which the tile GEMM's AVX512 copy takes elsewhere). Here a subprocess builds the kernels
with VLLM_C_EMULATE=amx and runs the tests of those kernels and of the C layers (the GGUF ones on
one model): the AMX copies (the main suite runs the AVX512 ones), with the engine choosing as on
an AMX CPU. Where the compiler can sanitize, test_sanitized_kernels.py runs the kernels' own
tests on emulated tiles, and this run keeps the rest. The emulation itself is checked first: its
tile product against a matrix product, and its faults where the hardware raises #UD.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import AMX_COPIES, asan_runtime, build_kernels, passed_amx_tests
from vllm.model_executor.layers import cpu_tile_gemm
from vllm.platforms import c_build
from vllm.platforms.c_build import KERNEL_SOURCES
from vllm.platforms.cpu import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_c_kernels.py", "tests/test_attention.py", "tests/test_fused_layers.py",
                "tests/test_gguf_kernels.py"]
LAYER_TESTS = ["tests/test_batch_invariance.py", "tests/test_gguf_fused_layers.py",
               # The GGUF C layers of one model, on Q8_0, Q4_1 and the mixed K-quant model (Q4_K,
               # Q6_K, bf16): the tiled product dequantizes each type into the same bf16 panels for
               # the tile GEMM, and the main suite runs every type on the AVX512 copies, which build
               # here as there.
               "-k", "(not test_gguf_fused_layers or (llama and not Q4_0 and not Q4_K and not Q6_K)) "
                     "and not avx512"]

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None, reason="the C kernels need a C compiler"),
    pytest.mark.skipif(not {"avx512_bf16", "avx512bw"} <= cpu_flags(),
                       reason="the AMX copies use AVX512-BF16 beside the tiles, as AMX CPUs have it"),
]

_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include "amx.h"

/* c (16 x 16 float32) = a (16 x 32 bf16) @ b, b given as the tile of 16 rows of 16 bf16 pairs. */
void tile_product(const uint16_t *a, const uint16_t *b_pairs, float *c) {
    amx_configure_full_tiles();
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b_pairs, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}

int main(int argc, char **argv) {
    static uint16_t buffer[16 * 32];
    if (argc > 1 && !strcmp(argv[1], "unconfigured")) _tile_loadd(0, buffer, 64);
    if (argc > 1 && !strcmp(argv[1], "mismatched")) {
        struct tile_config cfg = {.palette = 1};
        for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        cfg.rows[1] = 8;  /* a's rows differ from the destination's */
        amx_load_config(&cfg);
        _tile_dpbf16ps(0, 1, 2);
    }
    return 0;
}
"""


def test_emulated_kernels_build_into_their_own_cache_and_other_values_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_C_EMULATE", "amx")
    lib = c_build.load_c_library(cpu_tile_gemm._LIBRARY.source, "")
    assert lib is not None and lib.tile_gemm_use_amx(1) == 1
    assert [p.parent.name for p in tmp_path.rglob("*.so")] == ["kernels-amx-emulated"]
    monkeypatch.setenv("VLLM_C_EMULATE", "avx10")
    with pytest.raises(ValueError, match="VLLM_C_EMULATE"):
        c_build.load_c_library(cpu_tile_gemm._LIBRARY.source, "")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Path:
    """The source above, built over the emulated tiles into a library and an executable."""
    out = tmp_path_factory.mktemp("amx_emulation")
    (out / "probe.c").write_text(_SOURCE)
    flags = ["-O2", "-march=native", "-std=c11", "-DVLLM_EMULATE_AMX", f"-I{KERNEL_SOURCES}"]
    for extra, target in ((["-shared", "-fPIC"], "probe.so"), ([], "probe")):
        subprocess.run(["cc", *flags, *extra, str(out / "probe.c"), "-o", str(out / target)], check=True)
    return out


def test_the_emulated_tile_product_is_the_matrix_product(emulated):
    """TDPBF16PS multiplies a row of a (32 bf16) by a column of b, whose tile holds row k of b's
    pairs as b[2k][n], b[2k + 1][n] for each column n (Intel's VNNI layout)."""
    lib = ctypes.CDLL(str(emulated / "probe.so"))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(torch.bfloat16)                  # (M, K)
    b = torch.randn(32, 16, generator=gen).to(torch.bfloat16)                  # (K, N)
    b_pairs = b.reshape(16, 2, 16).transpose(1, 2).contiguous()               # (K / 2, N, 2)
    c = torch.empty(16, 16, dtype=torch.float32)                               # (M, N)
    lib.tile_product(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b_pairs.data_ptr()),
                     ctypes.c_void_p(c.data_ptr()))
    # bf16 products are exact in float32; only the order of the 32 additions differs.
    torch.testing.assert_close(c, a.double().matmul(b.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,message", [("unconfigured", "the tiles are not configured"),
                                          ("mismatched", "the first source's rows differ")])
def test_the_emulation_faults_where_the_hardware_does(emulated, case, message):
    result = subprocess.run([str(emulated / "probe"), case], capture_output=True, text=True)
    assert result.returncode == -signal.SIGABRT and message in result.stderr, result.stderr
    assert subprocess.run([str(emulated / "probe")]).returncode == 0


@pytest.mark.skipif("amx_bf16" in cpu_flags(), reason="this CPU runs the AMX copies themselves")
def test_the_amx_copies_and_the_choices_they_make_pass_on_emulated_tiles(tmp_path, tiny_files_env):
    sanitized = asan_runtime(tmp_path) is not None  # then the sanitized run takes the kernels' tests
    tests = LAYER_TESTS if sanitized else KERNEL_TESTS + LAYER_TESTS
    env = {**os.environ, **tiny_files_env, "VLLM_C_EMULATE": "amx"}
    build_kernels(env)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEp", "-p", "no:cacheprovider", *tests],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0, "\n".join(failed) + result.stdout[-3000:] + result.stderr[-2000:]
    if not sanitized:
        assert passed_amx_tests(result.stdout) >= AMX_COPIES
