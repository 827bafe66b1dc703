"""Helpers for the tests: tiny checkpoints, Hugging Face references, prompt sets."""

import functools
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from vllm.model_executor.model_loader.source import default_model_path

TINY_VOCAB = 49152  # SmolLM2's tokenizer, so text prompts and decoding work on the tiny models


def smollm2_path() -> str:
    return default_model_path()


def build_tiny_checkpoint(kind: str, out_dir: str, tokenizer_dir: str, hidden_size: int = 64,
                          max_position_embeddings: int = 1024, num_heads: int = 4,
                          num_kv_heads: int = 2) -> str:
    """Saves a randomly initialised model of `kind` with the SmolLM2 tokenizer beside it:
    `num_heads` heads of hidden_size / num_heads (`num_kv_heads` KV heads), 2 layers.

    The initialiser range is larger than a trained model's so the logits are well separated:
    greedy comparisons then test the computation, not float rounding between near-ties.
    """
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config)

    common = dict(vocab_size=TINY_VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "mistral":
        config = MistralConfig(**common, sliding_window=96, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(kind)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


@functools.cache
def smollm2_tokenizer():
    """Transformers' tokenizer of the SmolLM2 GGUF, converted from the file's header (which takes
    seconds) once per session; callers must not modify it."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


def hf_model(model_path: str, dtype: torch.dtype = torch.float32):
    """Transformers' model of a checkpoint directory or .gguf file, loaded once per session (a
    GGUF file is dequantized when loaded, which takes seconds); callers must not modify it."""
    return _hf_model(model_path, dtype)  # one cache key however the dtype is passed


@functools.cache
def _hf_model(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if model_path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(model_path)
        model_path = os.path.dirname(model_path)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs).eval()


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Transformers' greedy `generate`, one prompt at a time (no padding); EOS ends a sequence."""
    model = hf_model(model_path, dtype)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)[0, len(prompt):].tolist()
            eos = model.generation_config.eos_token_id
            eos = {eos} if isinstance(eos, int) else set(eos or [])
            for i, t in enumerate(gen):
                if t in eos:
                    gen = gen[:i + 1]
                    break
            outs.append(gen)
    return outs


def on_tile_gemm_copy(copy: str):
    """For a fixture: runs the tile GEMM (cpu_tile_gemm) on its `copy`, "amx" or "avx512",
    skipping where this CPU has no such copy; back to AMX-where-present afterwards."""
    import pytest

    from vllm.model_executor.layers import cpu_tile_gemm
    from vllm.platforms.cpu import cpu_flags

    if cpu_tile_gemm.max_rows() == 0:
        pytest.skip("no tile GEMM here (no C compiler, or neither AMX nor AVX512-BF16)")
    if copy == "amx" and not cpu_tile_gemm.use_amx(True):
        pytest.skip("no AMX here")
    if copy == "avx512" and not {"avx512_bf16", "avx512bw"} <= cpu_flags():
        pytest.skip("no AVX512-BF16 here")
    cpu_tile_gemm.use_amx(copy == "amx")
    try:
        yield copy
    finally:
        cpu_tile_gemm.use_amx(True)


def avx2_only_env(tmp_path) -> dict[str, str]:
    """Environment for a process that runs as on an AVX2-only CPU: the engine with
    VLLM_CPU_ISA=avx2 (its C kernels built for x86-64-v3, into their own cache under `tmp_path`),
    torch's kernels held to AVX2, and inductor's cache under `tmp_path`, since its key leaves out
    ATEN_CPU_CAPABILITY and would hand back kernels compiled for this CPU."""
    return dict(os.environ, VLLM_CPU_ISA="avx2", VLLM_CACHE_ROOT=str(tmp_path / "kernels"), VLLM_CPU_C_KERNELS="1",
                ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
                TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))


def tokens_op_by_op_then_fused(llm, generate) -> list:
    """`generate()`'s result run op by op, then on `llm`'s C decoder layers, each from an empty
    prefix cache (both compute the same chunks); asserts that only the second takes the C layers."""
    runner = llm.llm_engine.runner
    fused = runner.attn_backend.fused_layers
    results = []
    try:
        for use_fused in (False, True):
            runner.attn_backend.fused_layers = runner.model.model.fused_layers = fused if use_fused else None
            assert llm.reset_prefix_cache()
            before = runner.graph_stats.eager_steps
            results.append(generate())
            assert (runner.graph_stats.eager_steps > before) == use_fused
    finally:
        runner.attn_backend.fused_layers = runner.model.model.fused_layers = fused
    return results


def assert_greedy_close(ours: list[list[int]], ref: list[list[int]], our_logprobs: list, ref_logprobs: list,
                        min_agreed: int) -> None:
    """Greedy runs that may flip near-ties (int8 activations, bf16 roundings): where a request's
    tokens first differ, each run's token is in the other's top logprobs at that position (same
    prefix), and the runs agree until then on at least `min_agreed` tokens in all."""
    agreed = 0
    for a, b, la, lb in zip(ours, ref, our_logprobs, ref_logprobs, strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed += i
        if i < len(a):
            assert a[i] in lb[i] and b[i] in la[i], (i, a[i], b[i])
    assert agreed >= min_agreed


def build_kernels(env: dict[str, str]) -> None:
    """Builds the kernels of the variant `env` asks for (sanitized, emulated, AVX2-only) one per
    core, before a test subprocess would build them one by one on first use."""
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "vllm.platforms.c_build"], cwd=root, env=env, check=True, timeout=600)


# The tests whose AMX copy must run rather than skip where the tiles are emulated: the tile GEMM,
# both attention kernels, the C layers.
AMX_COPIES = {"test_tile_gemm_matches_exact_product", "test_paged_decode_kernel_on_model_shapes",
              "test_paged_prefill_kernel_matches_reference", "test_fused_mixed_steps_match_op_by_op"}


def passed_amx_tests(report: str) -> set[str]:
    """The tests whose AMX copy passed, in a pytest report with -rp."""
    return {line.split("[")[0].split("::")[-1] for line in report.splitlines()
            if line.startswith("PASSED") and "amx" in line}


def asan_runtime(tmp_path: Path) -> str | None:
    """The compiler's ASan runtime, if it can build a sanitized library at all; else None."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    source = tmp_path / "probe.c"
    source.write_text("int probe(int *p, int i) { return p[i] << 1; }\n")
    built = subprocess.run([compiler, "-fsanitize=address,undefined", "-shared", "-fPIC", str(source),
                            "-o", str(tmp_path / "probe.so")], capture_output=True)
    if built.returncode != 0 or not os.path.isabs(runtime) or not os.path.exists(runtime):
        return None
    return runtime
