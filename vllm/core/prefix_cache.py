"""Automatic prefix caching: full KV blocks found again by the tokens they hold. Imports no torch.

A full block is named by a hash chained over its parent's hash, its own token ids and a key of
whatever else changes the KV (the model and its dtype), so two requests whose first k blocks hold
the same tokens name those blocks alike, and a block is only ever found with its whole prefix:

    tokens   | a b c d | e f g h | i j
    hashes     h0 = H(-, abcd)   h1 = H(h0, efgh)     (the partial last block has no hash)

A cached block whose last holder lets it go keeps its contents and its hash: it waits among the
free blocks, least recently freed first, until a request finds it (and takes it back) or the
block manager needs a block and evicts the oldest.

A request's cache salt (vLLM's `cache_salt`) goes into its first block's name: only requests
with the same salt share blocks, so a tenant cannot learn from timing what another one's prompts
began with.

SHA-256 rather than Python's `hash`: a collision would silently hand one request another's KV.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes) -> BlockHash:
    """The chained hash of one full block."""
    h = hashlib.sha256(parent or b"")
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_key(salt: str | None) -> bytes:
    """What a cache salt adds to the first block's key: a digest, so that no salt's bytes can
    pass for token ids of an unsalted block."""
    if salt is None:
        return b""
    return hashlib.sha256(b"cache_salt:" + salt.encode()).digest()


class PrefixCache:
    """Which block holds which hash, and the cached blocks nobody holds, in LRU order.

    Invariants: `_block_of` and `_hash_of` are inverse maps (one block per hash: a block computed
    again elsewhere stays unnamed); every evictable block has a hash.
    """

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def insert(self, block: int, block_hash: BlockHash) -> None:
        """Names a block that was just filled; a no-op if another block has the name already."""
        assert block not in self._hash_of
        if block_hash not in self._block_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def park(self, block: int) -> None:
        """A named block nobody holds any more: it becomes the most recently freed."""
        assert block in self._hash_of and block not in self._evictable
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A request found the block: it is no longer free."""
        del self._evictable[block]

    def reset(self) -> list[int]:
        """Forgets every name; returns the evictable blocks, which now hold nothing."""
        blocks = list(self._evictable)
        self._block_of.clear()
        self._hash_of.clear()
        self._evictable.clear()
        return blocks

    def evict(self) -> int:
        """Forgets the least recently freed block and returns it for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block
