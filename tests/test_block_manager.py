"""BlockManager: the free list, per-request block tables and the slot arithmetic. No torch."""

from collections import Counter
import pytest

from vllm.core.block_manager import BlockManager, cdiv, kv_slots


def _assert_partition(bm: BlockManager) -> None:
    """A block is free exactly when no table holds it; its count is the tables that do."""
    holders = Counter(b for table in bm._tables.values() for b in table)
    free = bm.free_blocks()
    assert sorted(set(holders) | set(free)) == list(range(bm.num_blocks))
    assert not set(holders) & set(free) and len(free) == len(set(free)) == bm.num_free_blocks
    assert all(bm.ref_count(b) == holders[b] for b in range(bm.num_blocks))


def test_cdiv_and_num_blocks_for():
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    bm = BlockManager(num_blocks=8, block_size=16)
    assert [bm.num_blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_grow_allocates_only_missing_blocks():
    bm = BlockManager(num_blocks=8, block_size=16)
    bm.grow("a", 16)
    assert bm.block_table("a") == [0]
    bm.grow("a", 16)  # already holds 16 tokens: no new block
    assert bm.block_table("a") == [0]
    assert bm.num_missing_blocks("a", 17) == 1
    bm.grow("a", 17)
    assert bm.block_table("a") == [0, 1]
    bm.grow("a", 5)  # never shrinks
    assert bm.block_table("a") == [0, 1]
    bm.grow("b", 40)
    assert bm.block_table("b") == [2, 3, 4]
    assert bm.num_free_blocks == 3
    _assert_partition(bm)


def test_free_returns_blocks_and_is_idempotent():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow("a", 8)
    bm.grow("b", 8)
    assert bm.num_free_blocks == 0
    bm.free("a")
    assert bm.num_free_blocks == 2
    assert bm.block_table("a") == []
    bm.free("a")  # no-op
    bm.free("never-seen")  # no-op
    assert bm.num_free_blocks == 2
    bm.grow("c", 5)  # reuses a's blocks
    assert bm.block_table("c") == [0, 1]
    _assert_partition(bm)


def test_can_grow_false_when_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.can_grow("a", 12)
    assert not bm.can_grow("a", 13)
    bm.grow("a", 8)
    assert bm.can_grow("b", 4)
    assert not bm.can_grow("b", 5)
    assert bm.can_grow("a", 12)  # a needs only one more block
    bm.grow("b", 4)
    assert bm.num_free_blocks == 0
    assert bm.can_grow("a", 8)  # nothing missing
    assert not bm.can_grow("a", 9)
    with pytest.raises(AssertionError):
        bm.grow("a", 9)
    assert bm.block_table("a") == [0, 1]  # a failed grow changes nothing
    _assert_partition(bm)


def test_slot_arithmetic_matches_module_docstring():
    """Builds the docstring's table [7, 2, 9] (block_size 16) through the public API."""
    bm = BlockManager(num_blocks=10, block_size=16)
    for i in range(10):
        bm.grow(f"r{i}", 16)  # r_i owns block i
    for i in (7, 2, 9):
        bm.free(f"r{i}")  # the free list is FIFO: 7, 2, 9
    bm.grow("req", 41)
    assert bm.block_table("req") == [7, 2, 9]
    assert kv_slots(bm.block_table("req"), (0, 15, 16, 31, 32, 40), 16) == [112, 127, 32, 47, 144, 152]
    _assert_partition(bm)


def test_slots_of_one_request_are_distinct_and_inside_its_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.grow("x", 7)
    bm.grow("y", 9)
    bm.free("x")
    bm.grow("z", 10)
    slots = {rid: kv_slots(bm.block_table(rid), range(n), 4) for rid, n in (("y", 9), ("z", 10))}
    for rid, n in (("y", 9), ("z", 10)):
        assert len(set(slots[rid])) == n
        assert {s // 4 for s in slots[rid]} == set(bm.block_table(rid))
    assert not set(slots["y"]) & set(slots["z"])
    _assert_partition(bm)


def test_invalid_geometry_is_rejected():
    with pytest.raises(AssertionError):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(AssertionError):
        BlockManager(num_blocks=4, block_size=0)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.grow("p", 10)                                  # blocks 0, 1, 2 (2 half full)
    assert bm.fork("p", "c1", 10) == (2, 3)           # copy partial block 2 into fresh block 3
    assert bm.fork("p", "c2", 10) == (2, 4)
    assert bm.block_table("c1") == [0, 1, 3] and bm.block_table("c2") == [0, 1, 4]
    assert [bm.ref_count(b) for b in range(5)] == [3, 3, 1, 1, 1]
    _assert_partition(bm)
    bm.free("p")                                      # shared blocks stay with the children
    assert bm.num_free_blocks == 10 - 4
    bm.free("c1")
    bm.free("c2")
    assert bm.num_free_blocks == 10
    _assert_partition(bm)


def test_fork_at_a_block_boundary_copies_nothing_and_needs_no_free_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.grow("p", 8)
    bm.grow("q", 1)
    assert bm.num_free_blocks == 0 and bm.can_fork("p", 8)
    assert bm.fork("p", "c", 8) is None and bm.block_table("c") == [0, 1]
    bm.free("q")
    bm.grow("p", 10)  # position 8 opens a block of p's own
    assert bm.block_table("p") == [0, 1, 2] and bm.ref_count(2) == 1
    assert not bm.can_grow("c", 9)
    _assert_partition(bm)


def test_fork_with_a_partial_block_needs_a_free_one():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.grow("p", 6)
    assert bm.can_fork("p", 6)
    bm.grow("q", 1)
    assert not bm.can_fork("p", 6)
