"""Paged KV cache bookkeeping: which cache blocks belong to which request. Imports no torch.

A request's tokens live in fixed-size blocks; its block table lists them in order, so token
position p sits in slot `table[p // block_size] * block_size + p % block_size`:

    positions  0 .. 15 | 16 .. 31 | 32 .. 40
    table      [   7   ,    2     ,    9    ]     (block_size = 16)
    slots    112 .. 127| 32 .. 47 | 144 .. 152
"""

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list plus one block table per request.

    Invariant: every block id is either in the free list or in exactly one table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

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
            table.append(self._free.popleft())

    def free(self, request_id: str) -> None:
        """Returns all of the request's blocks to the free list (no-op if it holds none)."""
        self._free.extend(self._tables.pop(request_id, []))

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
