"""The kernel tests under AddressSanitizer and UndefinedBehaviorSanitizer.

A subprocess builds the C kernels with VLLM_C_SANITIZE=address (vllm/platforms/c_build.py) and
runs the tests that drive them: the kernels against their references (the GGUF products too),
the attention kernels on model shapes, the whole-layer C path, and the step checks with every
out-of-range value (which must be refused before a kernel touches memory). Any out-of-bounds
access or undefined behaviour aborts the subprocess. Where the CPU has AVX512-BF16 but no AMX, the kernels'
AMX copies run on emulated tiles (VLLM_C_EMULATE=amx), so that their tile loads and stores are
checked too: this run then stands for test_amx_emulation.py's run of those tests, and checks that
each AMX copy ran. Other paths for an ISA this CPU lacks skip there as they do anywhere.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import AMX_COPIES, asan_runtime, build_kernels, passed_amx_tests
from vllm.platforms.cpu import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_c_kernels.py", "tests/test_attention.py", "tests/test_step_checks.py",
         "tests/test_gguf_kernels.py", "tests/test_fused_layers.py", "tests/test_fused_layers_f32.py",
         # The fused layers of one model; the tile GEMMs without a bias (the main suite adds one).
         "-k", "(not test_fused_layers or llama) and not (test_tile_gemm and True)"]


def test_kernel_tests_pass_with_sanitized_kernels(tmp_path, tiny_files_env):
    runtime = asan_runtime(tmp_path)
    if runtime is None:
        pytest.skip("the C compiler cannot build with -fsanitize=address,undefined")
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, **tiny_files_env, "VLLM_C_SANITIZE": "address", "LD_PRELOAD": runtime,
           # Python and torch keep memory until exit on purpose: leaks are not what is checked.
           # No stack is recorded per allocation (a third of the run's time, with Python's every
           # malloc under ASan): a report shows the faulting access's stack, and a rerun without
           # malloc_context_size=0 shows where the memory came from.
           # Reports go to files: the subprocess's pytest would swallow its own stderr.
           "ASAN_OPTIONS": f"detect_leaks=0:malloc_context_size=0:log_path={logs / 'asan'}",
           "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={logs / 'ubsan'}"}
    emulated = "amx_bf16" not in cpu_flags() and {"avx512_bf16", "avx512bw"} <= cpu_flags()
    if emulated:
        env["VLLM_C_EMULATE"] = "amx"
    build_kernels(env)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rp", "-p", "no:cacheprovider", *TESTS],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    reports = "".join(f.read_text()[:4000] for f in sorted(logs.iterdir()))
    assert result.returncode == 0 and not reports, reports + result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
    if emulated:  # this run stands for the emulated AMX copies' own tests (test_amx_emulation.py)
        assert passed_amx_tests(result.stdout) >= AMX_COPIES
