"""The C kernels on CPUs with less than this one: what each build promises, and the fallbacks.

The kernels are built with `-march=native` and choose their code paths by the compiler's ISA
macros, so a build for an older ISA is what an older CPU gets. A compiler wrapper that appends
`-march=x86-64-v3` (AVX2 and FMA, no AVX-512) builds them as an AVX2-only server would; the
engine must then report every AVX-512 kernel unavailable and still give transformers' tokens.
On this CPU, each kernel must be available exactly where its ISA is.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.utils import avx2_only_env, hf_greedy, random_prompts
from vllm.platforms.cpu import cpu_flags

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64",
                                reason="needs an x86-64 C compiler")

PROMPT_LENGTHS = [3, 17, 70]
MAX_TOKENS = 12

# Prints which kernels this build offers and greedy tokens of a chunked run in float32 and bf16.
_PROBE = textwrap.dedent("""
    import json, sys
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
    print(json.dumps({"gemv_rows": cpu_gemv.max_rows(), "tile_gemm_rows": cpu_tile_gemm.max_rows(),
                      "paged_prefill": cpu_paged_prefill.kernel_address() is not None, "tokens": tokens}))
""")


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


def test_avx2_only_build_falls_back(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    result = _probe(path, avx2_only_env(tmp_path))
    assert result["gemv_rows"] == 0 and result["tile_gemm_rows"] == 0 and not result["paged_prefill"]
    _check_tokens(result, path)


def test_native_build_offers_what_the_cpu_has(tiny_checkpoints, tmp_path):
    flags = cpu_flags()
    path = tiny_checkpoints["llama"]
    result = _probe(path, dict(os.environ, VLLM_CPU_C_KERNELS="1"))
    assert (result["gemv_rows"] > 0) == ({"avx512_bf16", "avx512bw"} <= flags)
    # The tile GEMM's AVX512-BF16 copy, or its AMX one (which CPUs with AMX have beside it).
    assert (result["tile_gemm_rows"] > 0) == ({"avx512_bf16", "avx512bw"} <= flags or "amx_bf16" in flags)
    assert result["paged_prefill"] == ({"avx512_bf16", "avx512bw", "avx512dq"} <= flags)
    _check_tokens(result, path)
