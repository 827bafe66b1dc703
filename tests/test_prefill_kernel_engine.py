"""bf16 chunked prefill end to end through the C prefill kernel (cpu_paged_prefill.c), against
the grouped torch path it replaces and transformers in float32."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.utils import build_tiny_checkpoint, random_prompts
from vllm import LLM, SamplingParams

PROMPT_LENGTHS = [150, 3, 70, 130]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def checkpoint_and_llm(request, tokenizer_dir, tmp_path_factory) -> tuple[str, LLM]:
    """A tiny model with head_dim 64 (the kernel's), chunks of up to 64 tokens in blocks of 16."""
    path = build_tiny_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)), tokenizer_dir,
                                 hidden_size=256)
    llm = LLM(path, dtype="bfloat16", max_model_len=512, block_size=16, num_gpu_blocks_override=256,
              enforce_eager=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
    if not llm.llm_engine.runner.attn_backend.paged_prefill:
        pytest.skip("the C prefill kernel needs a C compiler and AVX2 or AVX512-BF16")
    return path, llm


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """The logprob of every prompt token after the first, all prompts in one run."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([entry[token].logprob for out, p in zip(outs, prompts)
                         for entry, token in zip(out.prompt_logprobs[1:], p[1:])])


def test_prefill_kernel_is_as_close_to_float32_as_the_torch_path(checkpoint_and_llm):
    """Prompts of 3-150 tokens in chunks of up to 64 (with and without context, across blocks,
    past Mistral's window of 96): their prompt logprobs through the kernel are as close to
    transformers' float32 ones as those of the grouped torch path (flash attention on the chunk
    and on the gathered context, merged). The two runs take the op-by-op layers, so they differ
    in attention only; both round the weights to bf16, the larger part of their error."""
    path, llm = checkpoint_and_llm
    backend = llm.llm_engine.runner.attn_backend
    fused = backend.fused_layers
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    got = {}
    backend.fused_layers = llm.llm_engine.runner.model.model.fused_layers = None
    try:
        for paged_prefill in (False, True):
            backend.paged_prefill = paged_prefill
            got[paged_prefill] = _prompt_logprobs(llm, prompts)
    finally:
        backend.paged_prefill = True
        backend.fused_layers = llm.llm_engine.runner.model.model.fused_layers = fused
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0, :-1].log_softmax(-1)
                          .gather(1, torch.tensor(p[1:])[:, None])[:, 0] for p in prompts])
    torch_error, kernel_error = ((got[k] - want).abs().mean().item() for k in (False, True))
    assert kernel_error <= 1.25 * torch_error

