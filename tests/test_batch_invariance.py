"""A token's result does not depend on the rest of its step (bf16, C kernels).

How a prompt is cut into chunks and which other sequences share its steps change with the load
(the budget, the cache size, prefix-cache hits, preemption). Where the kernels sum every output
in one order whatever the step holds, greedy tokens and their logprobs are the same bits in
every case:
- kernels by position: a prompt's positions always take the prefill kernel, generated ones the
  decode kernel, even a prompt's last token alone in a step or a preempted request's generated
  tokens computed again in a chunk (cpu_metadata._by_role);
- prefill attention: a query's running softmax maximum moves with its own scores only, not
  with the other queries of its 16-query task (which depend on where the chunk starts);
- decode attention: a long sequence is split into parts by its own length, not by a share of
  the step's keys, so its partial sums merge in the same order whatever the batch;
- products: on the AVX512-BF16 tile GEMM every row count, decodes included, sums a row in
  the same order (cpu_tile_gemm.takes_decode_rows); on AMX the GEMV takes 1-4 rows, so there
  the engine-level check is skipped. The default model's GGUF blocks, where the int8 GEMM takes
  them at every row count (AVX512-VNNI, or AVX2's), pass each row's blocks through one epilogue
  in block order, whatever the tile.
"""

import random

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.attention.ops import cpu_paged_decode, cpu_paged_prefill
from vllm.model_executor.layers import cpu_tile_gemm
from vllm.model_executor.layers.linear import Linear, PACKED_MAX_ROWS, can_pack
from vllm.model_executor.layers.quantization import cpu_gguf_gemv
from vllm.model_executor.layers.quantization.gguf_linear import is_quantized
from tests.utils import build_tiny_checkpoint, on_tile_gemm_copy, random_prompts, smollm2_path

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16


def _on_attention_copy(kernel, available: bool, copy: str):
    """Runs an attention kernel module on its `copy`, "amx" or "avx512", skipping where this CPU
    has no such copy; back to AMX-where-present afterwards."""
    if not available:
        pytest.skip(f"no {kernel.__name__} here (no C compiler, or no ISA it has a copy for)")
    if kernel.use_amx(copy == "amx") != (copy == "amx"):
        pytest.skip(f"no {copy} copy of {kernel.__name__} here")
    yield copy
    kernel.use_amx(True)


@pytest.fixture(params=["amx", "avx512"])
def prefill_copy(request):
    available = cpu_paged_prefill.is_available(torch.device("cpu"), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    yield from _on_attention_copy(cpu_paged_prefill, available, request.param)


def _assert_chunks_match_the_whole_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                           table: torch.Tensor, contexts) -> None:
    """query: (L, H, D), one sequence's; the rows of a chunk from each of `contexts` to the end
    must equal the same positions' rows of the whole prefill, bit for bit."""
    length, heads = query.shape[:2]

    def attend(context: int) -> torch.Tensor:  # the rows of positions context .. length - 1
        out = torch.zeros(length - context, heads, HEAD_DIM, dtype=torch.bfloat16)
        cpu_paged_prefill.paged_prefill(query[context:].contiguous(), key_cache, value_cache, table,
                                        torch.tensor([0]), torch.tensor([length - context]),
                                        torch.tensor([context]), 0.125, None, out)
        return out

    whole = attend(0)
    for context in contexts:
        assert torch.equal(attend(context), whole[context:]), f"chunk from position {context}"


def test_prefill_attention_does_not_depend_on_the_chunk_split(prefill_copy):
    """The rows of a chunk equal the same positions' rows of one whole prefill, wherever the
    chunk starts. Scores spread over a wide range (a growing bias on one dimension) make the
    running maxima rise at different keys for different queries of a task."""
    torch.manual_seed(0)
    length = 300
    blocks = (length + BLOCK - 1) // BLOCK
    key_cache = torch.randn(blocks + 3, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()    # (blocks, B, KVH, D)
    value_cache = torch.randn_like(key_cache)
    key_cache[..., 0] += 8
    table = torch.randperm(blocks + 3)[:blocks].view(1, -1)                      # (1, blocks)
    query = torch.randn(length, HEADS, HEAD_DIM) * 6                             # (L, H, D)
    query[..., 0] += torch.linspace(-3, 5, length)[:, None]
    _assert_chunks_match_the_whole_prefill(query.bfloat16(), key_cache, value_cache, table,
                                           (1, 15, 31, 100, 137, 299))


@pytest.mark.parametrize("seed", range(3))
def test_prefill_attention_does_not_depend_on_the_chunk_split_when_some_queries_raise_their_maximum(
        prefill_copy, seed):
    """A task's step is taken back and summed again when any of its queries' weights outgrow
    the running maximum; every 23rd query here has scores that grow along the keys, so whether
    a query's steps are taken back depends on which queries share its task, that is on where
    its chunk starts. Its weights, and their total, must come out the same either way. (A
    different total shows only where it moves a bf16 output, so three random draws.)"""
    torch.manual_seed(seed)
    length = 400
    blocks = (length + BLOCK - 1) // BLOCK
    table = torch.randperm(blocks + 3)[:blocks].view(1, -1)                       # (1, blocks)
    key_cache = torch.randn(blocks + 3, BLOCK, KV_HEADS, HEAD_DIM)                # (blocks, B, KVH, D)
    positions = torch.arange(length)
    key_cache.view(-1, KV_HEADS, HEAD_DIM)[table[0, positions // BLOCK] * BLOCK + positions % BLOCK, :, 0] = \
        positions[:, None].float() / 4
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(length, 8, HEAD_DIM)                                      # (L, H, D)
    query[::23, :, 0] = 8.0
    _assert_chunks_match_the_whole_prefill(query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), table,
                                           range(1, length, 3))


@pytest.fixture(params=["amx", "avx512"])
def decode_copy(request):
    available = cpu_paged_decode.is_available(torch.device("cpu"), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM)
    yield from _on_attention_copy(cpu_paged_decode, available, request.param)


def test_decode_attention_does_not_depend_on_the_batch(decode_copy):
    """A sequence's decode attention is the same bits alone and beside seven others (whose keys
    change how a share of the step's keys would split it), over a wide range of scores."""
    torch.manual_seed(0)
    seqs, length = 8, 850
    blocks = (length + BLOCK - 1) // BLOCK
    key_cache = torch.randn(seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()  # (blocks, B, KVH, D)
    value_cache = torch.randn_like(key_cache)
    key_cache[..., 0] += 8
    tables = torch.randperm(seqs * blocks).view(seqs, blocks)                    # (S, blocks)
    query = torch.randn(seqs, HEADS, HEAD_DIM) * 6                               # (S, H, D)
    query[..., 0] += torch.linspace(-3, 5, seqs)[:, None]
    query = query.bfloat16()
    seq_lens = torch.tensor([length - 37 * i for i in range(seqs)])

    def attend(n: int) -> torch.Tensor:  # the first n sequences
        out = torch.empty(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        cpu_paged_decode.paged_decode(query[:n].contiguous(), key_cache, value_cache, tables[:n].contiguous(),
                                      seq_lens[:n].contiguous(), 0.125, None, out)
        return out

    batch = attend(seqs)
    for n in (1, 2, 5):
        assert torch.equal(attend(n), batch[:n]), f"{n} sequences"


@pytest.fixture(params=["amx", "avx512"])
def tile_copy(request):
    yield from on_tile_gemm_copy(request.param)


def test_linear_rows_do_not_depend_on_the_row_count(tile_copy):
    """Where the tile GEMM takes decode rows, a row's product is the same bits alone, among a
    few decodes or in a prefill-sized step; on AMX that holds from past the GEMV's rows on."""
    if not can_pack(torch.bfloat16):
        pytest.skip("no oneDNN here")
    torch.manual_seed(0)
    layer = Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    layer.pack()
    x = torch.randn(PACKED_MAX_ROWS, 576).bfloat16()                              # (M, in)
    counts = [1, 2, 3, 4, 5, 17, 64, PACKED_MAX_ROWS]
    if not cpu_tile_gemm.takes_decode_rows():
        counts = [rows for rows in counts if rows > 4]
    first = layer(x[:counts[0]])[0]
    for rows in counts[1:]:
        assert torch.equal(layer(x[:rows])[0], first), f"{rows} rows"


@pytest.fixture(scope="module")
def tiny_path(tokenizer_dir, tmp_path_factory) -> str:
    # head_dim 64: prefill chunks take the C prefill kernel and the C layers.
    return build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), tokenizer_dir, hidden_size=256)


def _llm(path: str, budget: int, num_blocks: int = 256, prefix_caching: bool = False) -> LLM:
    llm = LLM(path, dtype="bfloat16", max_model_len=min(512, num_blocks * BLOCK), block_size=BLOCK,
              num_gpu_blocks_override=num_blocks, enforce_eager=True, enable_chunked_prefill=True,
              max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    fused = llm.llm_engine.runner.attn_backend.fused_layers
    if fused is None or not fused.takes_prefills or not cpu_tile_gemm.takes_decode_rows():
        pytest.skip("the C layers do not sum every row alike here (no AVX512-BF16, or AMX's GEMV)")
    return llm


def _params(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _logprob_bits(steps) -> list:
    return [None if step is None else {t: lp.logprob for t, lp in step.items()} for step in steps or []]


def _results(outputs) -> list[tuple]:
    """Each request's prompt logprobs, and each sample's tokens, text and the bits of its logprobs."""
    return [(_logprob_bits(o.prompt_logprobs),
             [(tuple(c.token_ids), c.text, c.finish_reason, _logprob_bits(c.logprobs)) for c in o.outputs])
            for o in outputs]


def _generate(path: str, budget: int, prompts: list[list[int]], together: bool) -> list[tuple]:
    llm = _llm(path, budget)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = (llm.generate(requests, _params(), use_tqdm=False) if together
               else [llm.generate([r], _params(), use_tqdm=False)[0] for r in requests])
    return _results(outputs)


def test_tokens_and_logprobs_do_not_depend_on_batch_or_budget(tiny_path):
    """Five prompts decoded together with 64-token steps, then each alone with 32-token steps
    (other chunk boundaries, 1-row decodes): the same tokens and the same logprob bits."""
    prompts = random_prompts([150, 90, 37, 120, 5], seed=3)
    together = _generate(tiny_path, 64, prompts, together=True)
    alone = _generate(tiny_path, 32, prompts, together=False)
    assert together == alone


def test_a_prompts_last_token_alone_in_its_step_gets_the_same_bits(tiny_path):
    """With 16-token steps, prompts of 17, 33 and 65 tokens end with a one-token chunk, which the
    scheduler runs among the decodes; whole, each is one chunk. The prefill kernel takes that
    last position either way."""
    prompts = random_prompts([17, 33, 65], seed=4)
    assert _generate(tiny_path, 16, prompts, together=False) == _generate(tiny_path, 512, prompts, together=False)


def test_a_prefix_cache_hit_that_leaves_one_prompt_token_gets_the_same_bits(tiny_path):
    """A prompt that repeats an earlier one's 32 tokens and adds one computes that token alone;
    without the cache, all 33 in one chunk."""
    first, last = random_prompts([32, 1], seed=5)
    cached = _llm(tiny_path, 64, prefix_caching=True)
    cached.generate({"prompt_token_ids": first}, _params(), use_tqdm=False)
    hit = cached.generate({"prompt_token_ids": first + last}, _params(), use_tqdm=False)
    assert hit[0].num_cached_tokens == 32
    fresh = _llm(tiny_path, 64).generate({"prompt_token_ids": first + last}, _params(), use_tqdm=False)
    assert _results(hit) == _results(fresh)


def test_preempted_requests_compute_their_tokens_again_to_the_same_bits(tiny_path):
    """In a cache of 12 blocks, three requests of 100 tokens preempt each other; a preempted one
    computes its prompt and its generated tokens again in prefill chunks, where the decode kernel
    takes the generated positions as it did when they were decodes."""
    requests = [{"prompt_token_ids": p} for p in random_prompts([40, 50, 30], seed=6)]
    small, roomy = _llm(tiny_path, 64, num_blocks=12), _llm(tiny_path, 64)
    preempted = small.generate(requests, _params(100), use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert _results(preempted) == _results(roomy.generate(requests, _params(100), use_tqdm=False))


def test_a_random_load_gives_each_request_what_it_gets_alone(tiny_path):
    """Requests arrive while others run, in 16-token steps on a 24-block cache with prefix
    caching: chunks split anywhere, prompts share prefixes, requests preempt each other, one is
    aborted, some draw n seeded samples, some have penalties, a stop string and prompt logprobs.
    Each request that finishes has the tokens, text and logprob bits it has alone in a roomy
    engine."""
    rng = random.Random(0)
    shared = random_prompts([40], seed=7)[0]
    requests = []
    for i in range(10):
        prompt = shared[:rng.randrange(0, 41)] * (i % 2) + random_prompts([rng.randrange(1, 140)], seed=100 + i)[0]
        sampled, penalized = i % 3 == 1, i % 4 == 2
        requests.append((f"r{i}", prompt, SamplingParams(
            temperature=0.8 if sampled else 0, seed=i if sampled else None, n=2 if sampled else 1,
            max_tokens=rng.randrange(1, 50), ignore_eos=True, logprobs=2,
            repetition_penalty=1.2 if penalized else 1.0, frequency_penalty=0.3 if penalized else 0.0,
            prompt_logprobs=1 if penalized else None, stop=["e"] if penalized else None)))
    llm = _llm(tiny_path, 16, num_blocks=24, prefix_caching=True)
    engine, outputs, waiting, steps = llm.llm_engine, {}, list(requests), 0
    while waiting or engine.has_unfinished_requests():
        if waiting and (rng.random() < 0.4 or not engine.has_unfinished_requests()):
            request_id, prompt, params = waiting.pop(0)
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == 20:
            aborted = next(r for r, _, _ in requests if r in engine.requests)
            engine.abort_request(aborted)
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_prefix_cache_hits > 0
    assert aborted not in outputs and len(outputs) == len(requests) - 1
    roomy = _llm(tiny_path, 512)
    for request_id, prompt, params in requests:
        if request_id != aborted:
            alone = roomy.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            assert _results([outputs[request_id]]) == _results(alone), request_id


def _default_llm(budget: int, num_blocks: int = 256) -> LLM:
    """The default model (SmolLM2's Q4_1 GGUF, its LM head in Q8_0), kept in its blocks. Its
    products are row-invariant where the int8 GEMM takes every row count of every weight type:
    each row's blocks pass one epilogue, in block order, whatever the tile."""
    llm = LLM(smollm2_path(), max_model_len=min(512, num_blocks * BLOCK), block_size=BLOCK,
              num_gpu_blocks_override=num_blocks, enable_chunked_prefill=True, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    fused = runner.attn_backend.fused_layers
    weights = [p for p in runner.model.parameters() if is_quantized(p)]
    if (fused is None or not fused.takes_prefills or not weights
            or any(cpu_gguf_gemv.product_path(w.quant_type, m, w.shape[0], w.in_features) != "gemm"
                   for w in weights for m in (1, 2, 5, 17, 512))):
        pytest.skip("the default model's layers are not all C layers on the int8 GEMM here")
    return llm


def test_the_default_model_gives_the_same_bits_whatever_the_load():
    """SmolLM2 Q4_1: prompts of 17 and 33 tokens end with a one-token chunk at budget 16; in a
    14-block cache a request is preempted. Each request has the tokens and logprob bits it has
    alone at budget 512."""
    requests = [{"prompt_token_ids": p} for p in random_prompts([17, 33, 150, 90, 5], seed=3)]
    params = _params(40)
    roomy = _default_llm(512)
    alone = [roomy.generate([r], params, use_tqdm=False)[0] for r in requests]
    small_steps = _default_llm(16).generate(requests, params, use_tqdm=False)
    small_cache = _default_llm(64, num_blocks=14)
    preempted = small_cache.generate(requests, params, use_tqdm=False)
    assert small_cache.llm_engine.scheduler.num_preemptions > 0
    assert _results(small_steps) == _results(alone)
    assert _results(preempted) == _results(alone)
