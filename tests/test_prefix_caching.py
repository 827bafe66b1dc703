"""Automatic prefix caching in the block manager and the scheduler (no torch, no model).

The engine-level tests (same greedy tokens with and without caching) are in
test_prefix_caching_engine.py; the scheduler's property test runs with caching too.
"""

import pytest

from tests.test_scheduler import FakeEngine, assert_block_partition, calls
from vllm.core.block_manager import BlockManager
from vllm.core.prefix_cache import hash_block
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceStatus


def _tokens(ids: list[int]):
    return lambda start, end: ids[start:end]


def _filled(bm: BlockManager, request_id: str, ids: list[int]) -> list[int]:
    """A request that computed `ids` and named its full blocks; returns its table."""
    bm.allocate(request_id, bm.cached_prefix(request_id, len(ids) - 1, _tokens(ids)), len(ids))
    bm.cache_blocks(request_id, len(ids), _tokens(ids))
    return bm.block_table(request_id)


# ---------------------------------------------------------------- the hash chain


def test_a_block_hash_depends_on_its_tokens_its_parent_and_the_key():
    h0 = hash_block(None, [1, 2, 3, 4], b"m")
    assert h0 == hash_block(None, [1, 2, 3, 4], b"m")
    assert len({h0, hash_block(None, [1, 2, 3, 5], b"m"), hash_block(None, [1, 2, 3, 4], b"other"),
                hash_block(h0, [1, 2, 3, 4], b"m")}) == 4
    # Token ids beyond 16 bits and negative ones are encoded whole, not truncated.
    assert hash_block(None, [70000], b"") != hash_block(None, [70000 % 65536], b"")


# ---------------------------------------------------------------- the block manager


def test_a_second_request_shares_the_full_blocks_of_the_first():
    bm = BlockManager(num_blocks=10, block_size=4, enable_caching=True)
    a = _filled(bm, "a", list(range(10)))                      # blocks 0, 1 full, 2 partial
    cached = bm.cached_prefix("b", 11, _tokens([*range(8), 50, 51, 52, 53]))
    assert cached == a[:2]
    bm.allocate("b", cached, 12)
    assert bm.block_table("b")[:2] == a[:2] and bm.block_table("b")[2] not in a
    assert [bm.ref_count(b) for b in a] == [2, 2, 1]
    # The chain stops at the first block that differs, even if later ones match.
    assert bm.cached_prefix("c", 11, _tokens([0, 1, 2, 9, 4, 5, 6, 7, 8, 9, 10])) == []
    assert_block_partition(bm)


def test_lookup_is_limited_to_the_tokens_asked_and_changes_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_caching=True)
    a = _filled(bm, "a", list(range(12)))
    bm.free("a")
    free = bm.free_blocks()
    assert bm.cached_prefix("b", 11, _tokens(list(range(12)))) == a[:2]  # 11 tokens: 2 blocks
    assert bm.cached_prefix("c", 12, _tokens(list(range(12)))) == a
    assert bm.free_blocks() == free and all(bm.ref_count(b) == 0 for b in a)


def test_without_caching_nothing_is_named_or_found():
    bm = BlockManager(num_blocks=4, block_size=4)
    _filled(bm, "a", list(range(8)))
    bm.free("a")
    assert bm.cached_prefix("b", 8, _tokens(list(range(8)))) == []


def test_freed_blocks_keep_their_names_until_evicted_least_recent_first():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    a = _filled(bm, "a", [1, 2, 3, 4])                          # 2 named blocks
    b = _filled(bm, "b", [5, 6, 7, 8, 9])                       # 2 named, 1 unnamed partial
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6
    # Unnamed blocks first, then the named ones, least recently freed first, last blocks
    # of a request before its first.
    assert bm.free_blocks() == [5, b[2], a[1], a[0], b[1], b[0]]
    bm.grow("x", 4)                                             # the 2 blocks that hold nothing
    assert bm.cached_prefix("a2", 4, _tokens([1, 2, 3, 4])) == a
    bm.grow("y", 2)                                             # evicts a's last block
    assert bm.cached_prefix("a3", 4, _tokens([1, 2, 3, 4])) == a[:1]
    assert bm.cached_prefix("b2", 4, _tokens([5, 6, 7, 8])) == b[:2]
    assert_block_partition(bm)


def test_taking_cached_blocks_that_nobody_holds_counts_against_the_free_ones():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = _filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    bm.grow("other", 4)                                         # the 2 unnamed blocks
    assert bm.num_free_blocks == 2                              # a's, evictable
    cached = bm.cached_prefix("b", 5, _tokens([1, 2, 3, 4, 5]))
    assert cached == a and bm.can_allocate(cached, 4) and not bm.can_allocate(cached, 5)
    assert not bm.can_allocate([], 5)
    bm.allocate("b", cached, 4)
    assert bm.num_free_blocks == 0 and [bm.ref_count(x) for x in a] == [1, 1]
    assert_block_partition(bm)


def test_a_block_computed_twice_keeps_the_first_name_and_the_second_stays_unnamed():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    bm.allocate("a", [], 2)
    bm.allocate("b", [], 2)                                     # both compute [7, 8] at once
    bm.cache_blocks("a", 2, _tokens([7, 8]))
    bm.cache_blocks("b", 2, _tokens([7, 8]))
    (a,), (b,) = bm.block_table("a"), bm.block_table("b")
    assert bm.prefix_cache.hash_of(a) is not None and bm.prefix_cache.hash_of(b) is None
    bm.free("b")
    bm.free("a")
    assert bm.prefix_cache.evictable_blocks() == [a]            # b holds nothing to keep
    assert bm.free_blocks()[-1] == a
    assert_block_partition(bm)


def test_forks_share_names_with_their_parent():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    ids = [1, 2, 3, 4, 5]
    bm.allocate("p", [], 5)
    bm.cache_blocks("p", 4, _tokens(ids))
    assert bm.fork("p", "c", 5) is not None
    bm.cache_blocks("c", 6, _tokens(ids + [9]))                 # the child's own third block
    assert bm.block_table("c")[:2] == bm.block_table("p")[:2]
    bm.free("p")
    bm.free("c")
    assert len(bm.cached_prefix("q", 6, _tokens(ids + [9]))) == 3
    assert_block_partition(bm)


# ---------------------------------------------------------------- the scheduler


def _eng(**kwargs) -> FakeEngine:
    kwargs = {"budget": 16, "block_size": 4, "num_blocks": 64, "enable_prefix_caching": True, **kwargs}
    return FakeEngine(**kwargs)


def test_chunks_start_after_the_cached_prefix():
    eng = _eng()
    prefix = list(range(100, 120))                              # 5 full blocks
    a = eng.add("a", 0, max_tokens=2, prompt=prefix + [1, 2])
    eng.run()
    b = eng.add("b", 0, max_tokens=2, prompt=prefix + [3, 4, 5])
    out = eng.step()
    assert calls(out) == [("b", 3, 20)] and out.scheduled[0].sample
    assert b.num_cached_tokens == 20 and a.num_cached_tokens == 0
    assert (eng.sched.num_prefix_cache_queries, eng.sched.num_prefix_cache_hits) == (22 + 23, 20)
    eng.run()
    assert_block_partition(eng.bm)


def test_a_prompt_cached_whole_computes_its_last_block_again():
    eng = _eng()
    prompt = list(range(100, 116))                              # exactly 4 blocks
    eng.add("a", 0, max_tokens=1, prompt=prompt)
    eng.run()
    b = eng.add("b", 0, max_tokens=1, prompt=prompt)
    out = eng.step()
    assert calls(out) == [("b", 4, 12)] and out.scheduled[0].sample
    assert b.num_cached_tokens == 12
    # The last block is b's own: a block found in the cache is never written.
    cached = eng.bm.cached_prefix("z", 16, lambda i, j: prompt[i:j])
    assert out.scheduled[0].block_table[:3] == cached[:3] and out.scheduled[0].block_table[3] != cached[3]


def test_a_prompt_one_token_past_the_cache_computes_one_token():
    eng = _eng()
    prompt = list(range(100, 117))
    eng.add("a", 0, max_tokens=1, prompt=prompt)
    eng.run()
    eng.add("b", 0, max_tokens=1, prompt=prompt)
    assert calls(eng.step()) == [("b", 1, 16)]


def test_a_request_arriving_with_the_first_reads_nothing_it_writes():
    """Blocks are named once the step that fills them has run: a second request admitted in
    the same step computes its prompt."""
    eng = _eng(budget=64, max_num_partial_prefills=2)
    prompt = list(range(100, 112))
    eng.add("a", 0, max_tokens=3, prompt=prompt)
    eng.add("b", 0, max_tokens=3, prompt=prompt)
    assert calls(eng.step()) == [("a", 12, 0), ("b", 12, 0)]
    c = eng.add("c", 0, max_tokens=3, prompt=prompt)
    assert calls(eng.step()) == [("a", 1, 12), ("b", 1, 12), ("c", 4, 8)]
    assert c.num_cached_tokens == 8


def test_a_long_shared_prefix_skips_whole_chunks():
    eng = _eng(budget=8)
    prefix = list(range(100, 140))                              # 40 tokens: 5 chunks of 8
    eng.add("a", 0, max_tokens=1, prompt=prefix + [1])
    eng.run()
    n = len(eng.outputs)
    assert n == 6
    eng.add("b", 0, max_tokens=1, prompt=prefix + [2])
    eng.run()
    assert [calls(o) for o in eng.outputs[n:]] == [[("b", 1, 40)]]


def test_prompt_logprobs_are_computed_not_read_from_the_cache():
    eng = _eng()
    prompt = list(range(100, 120))
    eng.add("a", 0, max_tokens=1, prompt=prompt)
    eng.run()
    b = eng.add("b", 0, max_tokens=1, prompt=prompt)
    b.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    out = eng.step()
    assert calls(out) == [("b", 16, 0)]
    assert out.scheduled[0].prompt_logprob_targets == tuple(prompt[1:17])
    assert b.num_cached_tokens == 0
    assert eng.sched.num_prefix_cache_hits == 0


def test_a_preempted_request_finds_its_own_blocks_again():
    # 4 blocks of 4: a and b fill them while decoding; a's third block preempts b.
    eng = _eng(budget=64, max_model_len=16, num_blocks=4, max_num_partial_prefills=2)
    a = eng.add("a", 4, max_tokens=8)
    b = eng.add("b", 4, max_tokens=8)
    while not eng.outputs or not eng.outputs[-1].preempted_request_ids:
        eng.step()
    assert eng.outputs[-1].preempted_request_ids == ["b"] and len(b.output_token_ids) == 5
    # b's 2 full blocks were named when it was preempted; a's third block evicted the last
    # one (a request's last blocks go first), and a's own blocks were freed after b's.
    while not a.is_finished:
        eng.step()
    assert calls(eng.step()) == [("b", 5, 4)]
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0   # set at its first admission
    eng.run()
    assert b.status is SequenceStatus.FINISHED_LENGTH
    assert_block_partition(eng.bm)


def test_a_partial_prefill_preempted_after_its_first_chunk_keeps_its_full_block():
    # 4 blocks of 4: b starts beside a (all of b's blocks fit then), and its first chunk (7
    # tokens) fills one block and part of another; a's next decode takes the last free block,
    # so b's next chunk preempts b itself before it ran again.
    eng = _eng(budget=8, max_num_seqs=2, max_model_len=12, num_blocks=4, max_num_partial_prefills=2)
    a = eng.add("a", 3, max_tokens=4)
    assert calls(eng.step()) == [("a", 3, 0)]
    b = eng.add("b", 12, max_tokens=1)
    assert calls(eng.step()) == [("a", 1, 3), ("b", 7, 0)]
    out = eng.step()
    assert calls(out) == [("a", 1, 4)] and out.preempted_request_ids == ["b"]
    eng.step()
    assert a.is_finished
    assert calls(eng.step()) == [("b", 8, 4)]                   # its first block was kept
    assert b.status is SequenceStatus.FINISHED_LENGTH


def test_blocks_of_a_step_that_never_ran_are_not_found():
    """An abort may follow a step that failed: the blocks it would have filled are not named."""
    eng = _eng()
    prompt = list(range(100, 112))
    a = eng.add("a", 0, max_tokens=2, prompt=prompt)
    assert calls(eng.sched.schedule()) == [("a", 12, 0)]        # scheduled, never run
    eng.sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    eng.add("b", 0, max_tokens=1, prompt=prompt + [1])
    assert calls(eng.step()) == [("b", 13, 0)]


def test_classic_scheduling_uses_the_cache_too():
    eng = _eng(budget=64, max_model_len=64, enable_chunked_prefill=False)
    prompt = list(range(100, 130))
    eng.add("a", 0, max_tokens=2, prompt=prompt)
    eng.run()
    eng.add("b", 0, max_tokens=2, prompt=prompt + [7])
    assert calls(eng.step()) == [("b", 3, 28)]
    eng.run()
    assert_block_partition(eng.bm)


@pytest.mark.parametrize("caching", [False, True])
def test_requests_with_shared_prefixes_read_their_own_tokens(caching):
    eng = _eng(budget=16, num_blocks=12, enable_prefix_caching=caching)
    prefix = list(range(100, 124))
    for i in range(6):
        eng.add(f"r{i}", 0, max_tokens=5, prompt=prefix[:8 * (i % 4)] + [200 + i] * (3 + i))
    eng.run()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())
    assert (eng.sched.num_prefix_cache_hits > 0) == caching
