"""The vectorized mixed-batch paged attention against the naive per-token reference."""

import dataclasses
import random
import shutil

import pytest
import torch

from tests.reference_attention import reference_paged_attention
from vllm.attention.backends.abstract import SeqSpan
from vllm.attention.backends.cpu_attn import paged_attention, write_to_kv_cache
from vllm.attention.backends.cpu_metadata import build_attention_metadata
from vllm.attention.ops import cpu_kv_cache, cpu_paged_decode, cpu_paged_prefill
from vllm.core.block_manager import kv_slots
from vllm.platforms.cpu import cpu_flags


def _kernel_built() -> bool:
    """The C decode kernel must build wherever a C compiler is installed (CI machines have one)."""
    if shutil.which("cc") is None:
        return False
    assert cpu_paged_decode.is_available(torch.device("cpu"), torch.float32, 8, 2, 64)
    return True


def _random_step(rng: random.Random, num_decodes: int, num_prefills: int, block_size: int,
                 num_blocks: int) -> tuple[list[SeqSpan], list[int]]:
    """Decodes (with context), then prefill chunks: fresh ones and later chunks with context."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    spans, slots, offset = [], [], 0
    for i in range(num_decodes + num_prefills):
        if i < num_decodes:
            ctx, q_len = rng.randint(0, 90), 1
        else:
            ctx, q_len = rng.choice([0, rng.randint(1, 70)]), rng.randint(1, 45)
        table = [free.pop() for _ in range(-(-(ctx + q_len) // block_size))]
        spans.append(SeqSpan(offset, q_len, ctx, table))
        slots += kv_slots(table, range(ctx, ctx + q_len), block_size)
        offset += q_len
    return spans, slots


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_mixed_batch_matches_reference(seed, block_size, heads, sliding_window):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 16, 128
    num_decodes, num_prefills = rng.randint(0, 5), rng.randint(0 if seed % 2 else 1, 4)
    if num_decodes + num_prefills == 0:
        num_decodes = 1
    spans, slots = _random_step(rng, num_decodes, num_prefills, block_size, num_blocks)
    # The last block is the pad block, as in the CacheEngine.
    key_cache = torch.randn(num_blocks + 1, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(num_blocks + 1, block_size, num_kv_heads, head_dim)
    t = len(slots)
    q, k, v = torch.randn(t, num_heads, head_dim), torch.randn(t, num_kv_heads, head_dim), \
        torch.randn(t, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    want = None
    # The chunk-causal + context split, the single-mask path, and decodes on the C kernel.
    for split, paged in ((True, False), (False, False), (True, True)):
        meta = build_attention_metadata(spans, num_decodes, slots, block_size, num_heads // num_kv_heads,
                                        sliding_window, num_blocks, torch.device("cpu"), split_prefill=split,
                                        paged_decode=paged and _kernel_built())
        write_to_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        got = paged_attention(q, k, v, key_cache, value_cache, meta, scale)
        if want is None:
            want = reference_paged_attention(q, key_cache, value_cache, spans, scale, sliding_window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _prefill_isa() -> bool:
    """Whether this CPU has an ISA the prefill kernel has a copy for: AVX512-BF16, or AVX2 and FMA."""
    return {"avx512_bf16", "avx512bw", "avx512dq"} <= cpu_flags() or {"avx2", "fma"} <= cpu_flags()


@pytest.mark.skipif(not (shutil.which("cc") and _prefill_isa()),
                    reason="both C kernels: a C compiler and AVX2 or AVX512-BF16")
def test_with_both_kernels_each_query_goes_to_the_kernel_of_its_positions_role():
    """Prompt positions to the prefill kernel and generated ones to the decode kernel, whatever
    the span's role in the step: a prompt's last token alone (a one-token span among the
    decodes) and the generated positions of a recomputed request (inside a prefill chunk)."""
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 24, 4, 2, 64
    free = list(range(num_blocks))
    spans = []
    for offset, q_len, ctx, prompt in [(0, 1, 40, 10), (1, 1, 7, 8), (2, 12, 20, 25), (14, 9, 0, 9)]:
        table = [free.pop() for _ in range(-(-(ctx + q_len) // block_size))]
        spans.append(SeqSpan(offset, q_len, ctx, table, num_prompt_tokens=prompt))
    slots = [slot for s in spans for slot in kv_slots(s.block_table, range(s.context_len, s.context_len + s.query_len),
                                                      block_size)]
    meta = build_attention_metadata(spans, 2, slots, block_size, heads // kv_heads, None, num_blocks,
                                    torch.device("cpu"), torch.bfloat16, paged_decode=True, paged_prefill=True)
    decodes, prefills = meta.paged_decodes, meta.paged_prefills
    assert decodes.rows.tolist() == [0, *range(7, 14)]
    assert decodes.seq_lens.tolist() == [41, *range(26, 33)]
    assert prefills.token_offsets.tolist() == [1, 2, 14]
    assert prefills.query_lens.tolist() == [1, 5, 9]
    assert prefills.context_lens.tolist() == [7, 20, 0]
    key_cache = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim).bfloat16()
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(len(slots), heads, head_dim).bfloat16()                     # (T, H, D)
    got = paged_attention(q, None, None, key_cache, value_cache, meta, head_dim ** -0.5)
    want = reference_paged_attention(q.float(), key_cache.float(), value_cache.float(), spans, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # Spans that do not give their prompt's length keep their role in the step.
    unknown = [dataclasses.replace(s, num_prompt_tokens=None) for s in spans]
    by_step = build_attention_metadata(unknown, 2, slots, block_size, heads // kv_heads, None, num_blocks,
                                       torch.device("cpu"), torch.bfloat16, paged_decode=True, paged_prefill=True)
    assert by_step.paged_decodes.rows is None and by_step.paged_decodes.seq_lens.tolist() == [41, 8]
    assert by_step.paged_prefills.token_offsets.tolist() == [2, 14]


def test_cache_write_lands_in_the_right_slots():
    key_cache = torch.zeros(3, 4, 1, 2)
    value_cache = torch.zeros(3, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_to_kv_cache(k, -k, key_cache, value_cache, torch.tensor([5, 0, 11]))
    assert key_cache[1, 1, 0].tolist() == [0.0, 1.0]     # slot 5 = block 1, offset 1
    assert key_cache[0, 0, 0].tolist() == [2.0, 3.0]
    assert value_cache[2, 3, 0].tolist() == [-4.0, -5.0]  # slot 11 = block 2, offset 3


@pytest.mark.skipif(shutil.which("cc") is None, reason="the C cache write needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c_cache_write_equals_index_copy_from_views_inside_qkv(dtype):
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 70, 6, 2, 8
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(40 * 4)[:num_tokens]
    want_k, want_v = torch.zeros(40, 4, num_kv_heads, head_dim, dtype=dtype), torch.zeros(40, 4, num_kv_heads,
                                                                                        head_dim, dtype=dtype)
    want_k.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    want_v.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    assert cpu_kv_cache.write_rows(k, v, got_k, got_v, slots)   # the C copy, not the fallback
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the C cache write needs a C compiler")
@pytest.mark.parametrize("bad_slot", [-1, 12])
def test_c_cache_write_rejects_slots_outside_the_cache_and_writes_nothing(bad_slot):
    key_cache, value_cache = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    with pytest.raises(IndexError, match="outside the cache's 12 slots"):
        write_to_kv_cache(k, k, key_cache, value_cache, torch.tensor([5, bad_slot, 0]))
    assert not key_cache.any() and not value_cache.any()


def test_decodes_of_very_different_lengths_are_attended_in_separate_groups():
    # Four decodes with 2000 cached tokens and sixteen with 40: one group would pad all twenty
    # to 2000 keys. Each group keeps every member within twice its own block count.
    block_size = 16
    lengths = [2000] * 4 + [40] * 16
    rng = random.Random(0)
    rng.shuffle(lengths)
    spans = [SeqSpan(i, 1, n, list(range(-(-(n + 1) // block_size)))) for i, n in enumerate(lengths)]
    slots = [0] * len(spans)
    meta = build_attention_metadata(spans, len(spans), slots, block_size, 1, None, 999, torch.device("cpu"))
    assert sorted(g.block_tables.shape for g in meta.groups) == [(4, 126), (16, 3)]
    assert not any(g.leading_decodes for g in meta.groups)
    # Each group keeps the step's token order, and together they cover every decode once.
    rows = [g.gather_index.view(-1).tolist() for g in meta.groups]
    assert all(r == sorted(r) for r in rows) and sorted(sum(rows, [])) == list(range(20))
    # Lengths within a factor of two share one group, sliced rather than gathered.
    near = [SeqSpan(i, 1, n, list(range(-(-(n + 1) // block_size)))) for i, n in enumerate([40, 70, 33])]
    meta = build_attention_metadata(near, 3, [0] * 3, block_size, 1, None, 999, torch.device("cpu"))
    assert len(meta.groups) == 1 and meta.groups[0].leading_decodes


def test_prefill_chunks_of_very_different_lengths_are_attended_in_separate_groups():
    # The last 464-token chunk of a long prompt beside sixteen fresh 32-token prompts: one group
    # would pad all seventeen to 464 queries.
    spans, offset = [SeqSpan(0, 464, 1536, list(range(125)))], 464
    for i in range(16):
        spans.append(SeqSpan(offset, 32, 0, [200 + 2 * i, 201 + 2 * i]))
        offset += 32
    meta = build_attention_metadata(spans, 0, [0] * offset, 16, 1, None, 999, torch.device("cpu"))
    assert sorted(g.gather_index.shape for g in meta.groups) == [(1, 464), (16, 32)]


def _on_copy(kernel, copy: str):
    """Runs `kernel` (cpu_paged_decode or cpu_paged_prefill) on its AMX copy, where the CPU has
    AMX, or on the AVX512 copy that CPUs without it take; back to AMX-where-present afterwards."""
    if copy == "amx" and not kernel.use_amx(True):
        pytest.skip("no AMX here")
    kernel.use_amx(copy == "amx")
    yield copy
    kernel.use_amx(True)


@pytest.fixture(params=["amx", "avx512"])
def decode_copies(request):
    """bf16 decodes on each copy of the decode kernel this CPU has."""
    yield from _on_copy(cpu_paged_decode, request.param)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the decode kernel needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 64), (8, 4, 64), (16, 4, 64), (16, 2, 64),
                                   (8, 8, 128), (8, 4, 128), (12, 3, 128)],
                         ids=lambda h: "q{}-kv{}-d{}".format(*h))
def test_paged_decode_kernel_on_model_shapes(dtype, sliding_window, heads, decode_copies):
    """SmolLM2's heads (9 query, 3 KV, head_dim 64) and other groupings and head sizes (bf16 has
    fast copies for 1-4 query heads per KV head at 64, 1-2 at 128, the general loop for the
    rest), block 128, contexts that end anywhere in a block and span several 64-key tiles,
    blocks in scrambled order."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = heads
    block_size, num_blocks = 128, 40
    assert cpu_paged_decode.is_available(torch.device("cpu"), dtype, num_heads, num_kv_heads, head_dim)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    spans = []
    for i, ctx in enumerate([0, 1, 63, 64, 127, 128, 300, 777]):
        table = [free.pop() for _ in range(-(-(ctx + 1) // block_size))]
        spans.append(SeqSpan(i, 1, ctx, table))
        # Keys the sequence must not see (past its end in its last block, before its window) are
        # NaN: kernels that read whole tiles of keys must never let one into a result.
        first = 0 if sliding_window is None else max(0, ctx + 1 - sliding_window)
        unseen = list(range(first)) + list(range(ctx + 1, len(table) * block_size))
        slots = kv_slots(table, unseen, block_size)
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    meta = build_attention_metadata(spans, len(spans), [0] * len(spans), block_size,
                                    num_heads // num_kv_heads, sliding_window, num_blocks - 1,
                                    torch.device("cpu"), dtype, paged_decode=True)
    assert meta.groups == () and meta.paged_decodes is not None
    q = torch.randn(len(spans), num_heads, head_dim).to(dtype)
    out = torch.zeros_like(q)
    paged = meta.paged_decodes
    cpu_paged_decode.paged_decode(q, key_cache, value_cache, paged.block_tables, paged.seq_lens,
                                  head_dim ** -0.5, sliding_window, out)
    want = reference_paged_attention(q, key_cache, value_cache, spans, head_dim ** -0.5, sliding_window)
    # bf16: the output's rounding, and on the AVX512-BF16 copy the weights' (bf16 pairs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the decode kernel needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contexts", [[1999], [700, 2100], [300], [271, 767], [2000, 40, 90, 130]])
def test_paged_decode_kernel_splits_long_sequences_over_threads(contexts, dtype, decode_copies):
    """Sequences of more than a 64-key tile are split into parts and merged (task_parts): up to
    256 keys a part a tile (41, 91, 131 keys: 1, 2, 3 parts); above, parts of 256 and the rest
    where their count is even or the rest short (2101 keys: 8 and 53), else an even count with
    the tiles dealt evenly (2000: 7 of 256 and 208; 701: 128, 192, 192, 189; 301: 128, 173; 272:
    128, 144; 768: 4 of 192)."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 128, 40
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    spans = [SeqSpan(i, 1, ctx, [free.pop() for _ in range(-(-(ctx + 1) // block_size))])
             for i, ctx in enumerate(contexts)]
    meta = build_attention_metadata(spans, len(spans), [0] * len(spans), block_size, 3, None,
                                    num_blocks - 1, torch.device("cpu"), paged_decode=True)
    q = torch.randn(len(spans), num_heads, head_dim).to(dtype)
    out = torch.zeros_like(q)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # more parts than threads, and an odd count of threads
    try:
        cpu_paged_decode.paged_decode(q, key_cache, value_cache, meta.paged_decodes.block_tables,
                                      meta.paged_decodes.seq_lens, head_dim ** -0.5, None, out)
    finally:
        torch.set_num_threads(threads)
    want = reference_paged_attention(q, key_cache, value_cache, spans, head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def _reference_on_one_thread(*args) -> torch.Tensor:
    """reference_paged_attention: its thousands of small ops take far longer on a pool of threads
    (each op a fork and join), above all on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_paged_attention(*args)
    finally:
        torch.set_num_threads(threads)


def _prefill_kernel_built() -> bool:
    """The prefill kernel must build wherever a C compiler and one of its ISAs are present."""
    if shutil.which("cc") is None or not _prefill_isa():
        return False
    assert cpu_paged_prefill.is_available(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 128)
    return True


@pytest.fixture(params=["amx", "avx512"])
def prefill_copies(request):
    """Prefills on each copy of the prefill kernel this CPU has."""
    yield from _on_copy(cpu_paged_prefill, request.param)


@pytest.mark.skipif(not _prefill_kernel_built(), reason="the prefill kernel needs a C compiler and AVX2 or AVX512-BF16")
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("sliding_window", [None, 40])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (16, 2)], ids=lambda h: "q{}-kv{}".format(*h))
def test_paged_prefill_kernel_matches_reference(block_size, sliding_window, heads, prefill_copies):
    """A mixed step on both C kernels: two decodes, then chunks with and without context, of
    1-300 queries (partial 16-query blocks, steps of 32 keys cut by the diagonal and by the
    window), blocks in scrambled order, and bucket padding. Every cache slot that holds no key
    is NaN: the kernel must never let one into a result."""
    torch.manual_seed(2)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 64, 80
    num_decodes = 2
    steps = [(70, 1), (3, 1), (0, 1), (0, 37), (100, 1), (250, 300), (5, 16), (0, 16), (128, 33), (31, 17)]
    free = torch.randperm(num_blocks - 1).tolist()  # the last block is the pad block
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    value_cache = key_cache.clone()
    spans, offset = [], 0
    for context, queries in steps:
        table = [free.pop() for _ in range(-(-(context + queries) // block_size))]
        slots = kv_slots(table, range(context + queries), block_size)
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(len(slots), num_kv_heads,
                                                                         head_dim).bfloat16()
        spans.append(SeqSpan(offset, queries, context, table))
        offset += queries
    padding = 3
    # The queries as the attention layer hands them over: q inside the rotated q|k rows (strided).
    qk = torch.randn(offset + padding, num_heads + num_kv_heads, head_dim).bfloat16()
    q = qk[:, :num_heads]
    meta = build_attention_metadata(spans, num_decodes, [0] * (offset + padding), block_size,
                                    num_heads // num_kv_heads, sliding_window, num_blocks - 1,
                                    torch.device("cpu"), torch.bfloat16, paged_decode=True, paged_prefill=True)
    assert meta.groups == () and meta.paged_prefills is not None and meta.paged_decodes is not None
    assert meta.num_real_tokens == offset
    kv = torch.empty(0, num_kv_heads, head_dim, dtype=torch.bfloat16)  # read from the cache only
    # Freed memory of the output's size holding NaN, which its allocation is likely to reuse:
    # the padding rows, which no kernel writes, must still come out zero.
    poison = torch.full((offset + padding + 1, num_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    del poison
    got = paged_attention(q, kv, kv, key_cache, value_cache, meta, head_dim ** -0.5)
    want = _reference_on_one_thread(q, key_cache, value_cache, spans, head_dim ** -0.5, sliding_window)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # bf16 weights and output
    assert got[offset:].eq(0).all()  # bucket padding


@pytest.mark.skipif(not _prefill_kernel_built(), reason="the prefill kernel needs a C compiler and AVX2 or AVX512-BF16")
@pytest.mark.parametrize("queries,context,heads,block_size,sliding_window", [
    (1, 0, (9, 3), 16, None), (1, 300, (4, 2), 128, None), (16, 0, (4, 2), 16, None),
    (17, 111, (9, 3), 128, None), (64, 64, (9, 3), 16, 96), (100, 900, (4, 2), 16, 96),
    (200, 0, (4, 2), 128, 96), (200, 150, (9, 3), 128, 96), (512, 0, (4, 2), 16, None),
    (512, 300, (9, 3), 128, None), (512, 300, (4, 2), 16, 96),
], ids=lambda x: "none" if x is None else "q{}-kv{}".format(*x) if isinstance(x, tuple) else str(x))
def test_paged_prefill_kernel_one_chunk(queries, context, heads, block_size, sliding_window, prefill_copies):
    """One chunk of 1-512 queries, the first (no context) or a later one, on SmolLM2's heads and
    the tiny models' (4 query, 2 KV), across blocks of 16 and 128 keys and (Mistral's) window of
    96; straight through the kernel's wrapper. Cache slots the chunk must not read are NaN."""
    torch.manual_seed(queries + context)
    num_heads, num_kv_heads = heads
    head_dim, keys = 64, context + queries
    num_blocks = -(-keys // block_size) + 2
    table = torch.randperm(num_blocks)[:-(-keys // block_size)].tolist()
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    value_cache = key_cache.clone()
    slots = kv_slots(table, range(keys), block_size)
    for cache in (key_cache, value_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(keys, num_kv_heads, head_dim).bfloat16()
    spans = [SeqSpan(0, queries, context, table)]
    qk = torch.randn(queries, num_heads + num_kv_heads, head_dim).bfloat16()  # q inside q|k rows
    q = qk[:, :num_heads]
    out = torch.zeros(queries, num_heads, head_dim, dtype=torch.bfloat16)
    column = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    cpu_paged_prefill.paged_prefill(q, key_cache, value_cache, torch.tensor([table]), column(0), column(queries),
                                    column(context), head_dim ** -0.5, sliding_window, out)
    want = _reference_on_one_thread(q, key_cache, value_cache, spans, head_dim ** -0.5, sliding_window)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)  # bf16 weights and output
