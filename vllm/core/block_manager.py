"""Paged KV cache bookkeeping: which cache blocks belong to which request. Imports no torch.

A request's tokens live in fixed-size blocks; its block table lists them in order, so token
position p sits in slot `table[p // block_size] * block_size + p % block_size`:

    positions  0 .. 15 | 16 .. 31 | 32 .. 40
    table      [   7   ,    2     ,    9    ]     (block_size = 16)
    slots    112 .. 127| 32 .. 47 | 144 .. 152

Parallel samples of one prompt (n > 1) share the prompt's full blocks. Only the partly filled
last block is copied, once per new sample, because every sample writes its own tokens there:

    parent  [ 7 | 2 | 9 ]          fork at 41 tokens:  blocks 7 and 2 shared (ref count 2),
    child   [ 7 | 2 | 5 ]          block 9 copied into 5 (the caller copies the KV data)
"""

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list, one block table per request, a reference count per block.

    Invariant: a block is in the free list exactly when its reference count is 0, and its count
    is the number of tables that hold it. Only full blocks are ever shared.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_missing_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table holds `num_tokens` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(self.block_table(request_id)))

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.num_missing_blocks(request_id, num_tokens) <= len(self._free)

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Extends the request's table to hold `num_tokens` tokens; caller checked `can_grow`."""
        missing = self.num_missing_blocks(request_id, num_tokens)
        assert missing <= len(self._free), "grow() without can_grow()"
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):
            table.append(self._allocate())

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Gives `child_id` the parent's first `num_tokens` tokens: full blocks shared, a partial
        last block copied into a fresh one. Returns the (source, destination) block whose KV the
        caller must copy, or None if nothing needs copying. Caller checked `can_fork`."""
        assert child_id not in self._tables and self.can_fork(parent_id, num_tokens)
        parent = self._tables[parent_id]
        num_full = num_tokens // self.block_size
        child = parent[:num_full]
        for block in child:
            self._refs[block] += 1
        copy = None
        if num_tokens % self.block_size:
            copy = (parent[num_full], self._allocate())
            child.append(copy[1])
        self._tables[child_id] = child
        return copy

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        assert len(self.block_table(parent_id)) >= self.num_blocks_for(num_tokens)
        return num_tokens % self.block_size == 0 or bool(self._free)

    def free(self, request_id: str) -> None:
        """Drops the request's table; blocks no other table holds go back to the free list
        (no-op if it holds none)."""
        for block in self._tables.pop(request_id, []):
            self._refs[block] -= 1
            assert self._refs[block] >= 0
            if self._refs[block] == 0:
                self._free.append(block)

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _allocate(self) -> int:
        block = self._free.popleft()
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block
