"""The C kernels on CPUs with less than this one: what each build promises, and the fallbacks.

The kernels are built with `-march=native` (tuned generically where AVX2 is the widest
extension) and choose their code paths by the compiler's ISA macros, so a build for an older ISA
is what an older CPU gets. VLLM_CPU_ISA=avx2 builds them for
x86-64-v3 (AVX2 and FMA, no AVX-512) as an AVX2-only server would, and hides the later
extensions from the engine's choices; the engine must then report every AVX-512 kernel
unavailable (the prefill kernel runs its AVX2 copy) and still give transformers' tokens. On
this CPU, each kernel must be available exactly where its ISA is.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.utils import avx2_only_env, build_kernels, hf_greedy, random_prompts
from vllm.model_executor.layers import cpu_gemv
from vllm.platforms import c_build
from vllm.platforms.cpu import cpu_flags, cpu_isa

PAST_AVX2 = ("avx512", "amx", "avx_vnni")  # flag prefixes of extensions an AVX2-only CPU lacks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64",
                                reason="needs an x86-64 C compiler")

PROMPT_LENGTHS = [3, 17, 70]
MAX_TOKENS = 12

# Prints which kernels this build offers and greedy tokens of a chunked run in float32 and bf16.
_PROBE = textwrap.dedent("""
    import json, sys
    import torch
    from tests.utils import random_prompts
    from vllm import LLM, SamplingParams
    from vllm.attention.ops import cpu_paged_prefill
    from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm

    path, lengths, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths)]
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, max_model_len=256, max_num_batched_tokens=32, block_size=16)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        tokens[dtype] = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"gemv_rows": cpu_gemv.max_rows(), "gemv_f32_rows": cpu_gemv.max_rows(torch.float32),
                      "tile_gemm_rows": cpu_tile_gemm.max_rows(),
                      "paged_prefill": cpu_paged_prefill.kernel_address() is not None, "tokens": tokens}))
""")


@pytest.fixture(scope="module")
def avx2_env(tmp_path_factory) -> dict[str, str]:
    """One AVX2-only environment for the module: its kernels and inductor's are built once."""
    return avx2_only_env(tmp_path_factory.mktemp("avx2_only"))


def _probe(path: str, env: dict[str, str]) -> dict:
    """_PROBE on `path` in a subprocess with `env` (an AVX2-only build's, or this CPU's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _PROBE, path, json.dumps(PROMPT_LENGTHS), str(MAX_TOKENS)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_tokens(result: dict, path: str) -> None:
    assert result["tokens"]["float32"] == hf_greedy(path, random_prompts(PROMPT_LENGTHS), MAX_TOKENS)
    # bf16 rounds differently on each path; it must run to the end all the same.
    assert all(len(t) == MAX_TOKENS for t in result["tokens"]["bfloat16"])


def test_avx2_only_build_falls_back(tiny_checkpoints, avx2_env):
    path = tiny_checkpoints["llama"]
    result = _probe(path, avx2_env)
    # The AVX512 products fall back; prefill attention and the float32 GEMV have copies for AVX2.
    assert result["gemv_rows"] == 0 and result["tile_gemm_rows"] == 0 and result["paged_prefill"]
    assert result["gemv_f32_rows"] == cpu_gemv.F32_MAX_ROWS
    _check_tokens(result, path)


def test_native_build_offers_what_the_cpu_has(tiny_checkpoints, tmp_path):
    flags = cpu_flags()
    path = tiny_checkpoints["llama"]
    result = _probe(path, dict(os.environ, VLLM_CPU_C_KERNELS="1"))
    assert (result["gemv_rows"] > 0) == ({"avx512_bf16", "avx512bw"} <= flags)
    assert (result["gemv_f32_rows"] > 0) == ({"avx2", "fma"} <= flags)
    # The tile GEMM's AVX512-BF16 copy, or its AMX one (which CPUs with AMX have beside it).
    assert (result["tile_gemm_rows"] > 0) == ({"avx512_bf16", "avx512bw"} <= flags or "amx_bf16" in flags)
    assert result["paged_prefill"] == ({"avx512_bf16", "avx512bw", "avx512dq"} <= flags or {"avx2", "fma"} <= flags)
    _check_tokens(result, path)


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma", "f16c"}, ["-march=native", "-mtune=generic"]),  # AVX2 widest: tuned as x86-64-v3
    ({"avx2", "fma", "avx_vnni"}, ["-march=native", "-mtune=generic"]),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, ["-march=native"]),
    ({"avx2", "avx512f", "amx_tile"}, ["-march=native"]),
    ({"sse4_2"}, ["-march=native"]),
    (set(), ["-march=native"]),  # no /proc/cpuinfo flags
])
def test_the_build_targets_this_cpu_tuned_generically_where_avx2_is_widest(monkeypatch, flags, want):
    monkeypatch.delenv("VLLM_CPU_ISA", raising=False)
    monkeypatch.setattr(c_build, "cpu_flags", lambda: frozenset(flags))
    assert c_build.isa_flags() == want


def test_vllm_cpu_isa_avx2_hides_the_later_extensions_and_builds_for_x86_64_v3(monkeypatch, tmp_path):
    native = cpu_flags()
    monkeypatch.setenv("VLLM_CPU_ISA", "avx2")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    cpu_flags.cache_clear()
    try:
        flags = cpu_flags()
        assert flags <= native and {"avx2", "fma"} & native <= flags
        assert not [f for f in flags if f.startswith(PAST_AVX2)]
        assert c_build.isa_flags() == ["-march=x86-64-v3", "-mtune=generic"]
        assert c_build.load_c_library(c_build.KERNEL_SOURCES / "cpu_gemv.c", "") is not None
        assert [p.parent.name for p in tmp_path.rglob("*.so")] == ["kernels-avx2"]
        monkeypatch.setenv("VLLM_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="VLLM_CPU_ISA"):
            cpu_isa()
    finally:
        monkeypatch.delenv("VLLM_CPU_ISA")
        cpu_flags.cache_clear()


# The tests of the kernels and of the engine's token-level results, run as on an AVX2-only CPU.
AVX2_ONLY_TESTS = ["tests/test_attention.py", "tests/test_c_kernels.py", "tests/test_gguf_kernels.py",
                   "tests/test_fused_layers.py", "tests/test_fused_layers_f32.py", "tests/test_step_checks.py",
                   "tests/test_batch_invariance.py",
                   "tests/test_prefill_kernel_engine.py", "tests/test_tiny_models_vs_hf.py",
                   "tests/test_chunked_prefill_demo.py", "tests/test_engine_args.py",
                   "tests/test_gguf_fused_layers.py::test_layer_products_are_those_the_isa_has",
                   "tests/test_gguf_fused_layers.py::test_layer_product_is_the_op_by_op_product",
                   # The first run as AVX2-only inside; graphs compile long; the async demo's engine
                   # steps as the demo's does.
                   "-k", "not avx2_only and not graph_mode and not async_demo"]


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="an AVX2-only run needs AVX2 and FMA")
@pytest.mark.skipif(not [f for f in cpu_flags() if f.startswith(PAST_AVX2)],
                    reason="this CPU has nothing past AVX2: the whole suite runs as on an AVX2-only one")
def test_the_engine_passes_its_tests_as_an_avx2_only_cpu(avx2_env, tiny_files_env):
    """On a CPU with AVX-512 (or AMX), the AVX2-only paths of the kernels and the engine's choices
    for them skip in every test; here a subprocess runs those tests with VLLM_CPU_ISA=avx2 and
    torch held to AVX2, so that main stays green on such a CPU too."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**avx2_env, **tiny_files_env}
    build_kernels(env)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AVX2_ONLY_TESTS],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0, "\n".join(failed) + result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
