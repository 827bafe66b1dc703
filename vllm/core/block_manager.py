"""Paged KV cache bookkeeping: which cache blocks belong to which request. Imports no torch.

A request's tokens live in fixed-size blocks; its block table lists them in order, so token
position p sits in slot `table[p // block_size] * block_size + p % block_size` (`kv_slots`):

    positions  0 .. 15 | 16 .. 31 | 32 .. 40
    table      [   7   ,    2     ,    9    ]     (block_size = 16)
    slots    112 .. 127| 32 .. 47 | 144 .. 152

Parallel samples of one prompt (n > 1) share the prompt's full blocks. Only the partly filled
last block is copied, once per new sample, because every sample writes its own tokens there:

    parent  [ 7 | 2 | 9 ]          fork at 41 tokens:  blocks 7 and 2 shared (ref count 2),
    child   [ 7 | 2 | 5 ]          block 9 copied into 5 (the caller copies the KV data)

With prefix caching (vllm/core/prefix_cache.py) full blocks are shared between requests too: a
new request starts its table with the cached blocks that hold its first tokens, and a block
whose computed tokens fill it is named for later requests. Named blocks that no table holds stay
free but keep their contents; a block is taken for new tokens from those that hold nothing
first, then by evicting the least recently freed named one.
"""

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from vllm.core.prefix_cache import BlockHash, PrefixCache, hash_block, salt_key

# tokens(start, end): the request's token ids at positions [start, end).
TokenSlice = Callable[[int, int], Sequence[int]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_slots(block_table: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The cache slot of each token position of a request whose blocks `block_table` lists."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class BlockManager:
    """Free list, one block table per request, a reference count per block, and the prefix cache.

    Invariant: a block is free (in `_free`, or evictable in the prefix cache) exactly when its
    reference count is 0, and its count is the number of tables that hold it. Only full blocks
    are ever shared, and a named block holds the tokens its hash names.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 cache_key: bytes = b"") -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # free blocks that hold nothing named
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self.prefix_cache = PrefixCache() if enable_caching else None
        self._cache_key = cache_key  # what else the KV depends on (the model), hashed into every name
        # Per request: the hashes of its first full blocks (computed as needed, cached or not)
        # and how many of its table's blocks are named.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_named: dict[str, int] = {}

    @property
    def enable_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    def free_blocks(self) -> list[int]:
        """Every free block: those holding nothing named, then the evictable ones (LRU first)."""
        return list(self._free) + (self.prefix_cache.evictable_blocks() if self.prefix_cache else [])

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
        return self.num_missing_blocks(request_id, num_tokens) <= self.num_free_blocks

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Extends the request's table to hold `num_tokens` tokens; caller checked `can_grow`."""
        missing = self.num_missing_blocks(request_id, num_tokens)
        assert missing <= self.num_free_blocks, "grow() without can_grow()"
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):
            table.append(self._allocate())

    # ---------------------------------------------------------------- prefix caching

    def cached_prefix(self, request_id: str, num_tokens: int, tokens: TokenSlice,
                      salt: str | None = None) -> list[int]:
        """The cached blocks that hold the request's first full blocks, as far as they are cached,
        within its first `num_tokens` tokens (empty without caching). Changes no block. A
        request with a cache `salt` finds only blocks named by requests with the same salt."""
        if self.prefix_cache is None:
            return []
        blocks = []
        for i in range(num_tokens // self.block_size):
            block = self.prefix_cache.lookup(self._block_hash(request_id, i, tokens, salt))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, cached_blocks: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether a request without blocks can start from `cached_blocks` and hold `num_tokens`
        tokens, leaving `reserve` blocks free: cached blocks that nobody holds are taken from
        the free ones too."""
        num_evictable = sum(self._refs[b] == 0 for b in cached_blocks)
        missing = max(0, self.num_blocks_for(num_tokens) - len(cached_blocks))
        return missing + num_evictable + reserve <= self.num_free_blocks

    def allocate(self, request_id: str, cached_blocks: list[int], num_tokens: int) -> None:
        """Starts the request's table with `cached_blocks` (shared), then fresh blocks up to
        `num_tokens` tokens; caller checked `can_allocate`."""
        assert request_id not in self._tables and self.can_allocate(cached_blocks, num_tokens)
        for block in cached_blocks:
            if self._refs[block] == 0:
                self.prefix_cache.unpark(block)
            self._refs[block] += 1
        self._tables[request_id] = list(cached_blocks)
        self._num_named[request_id] = len(cached_blocks)
        self.grow(request_id, num_tokens)

    def cache_blocks(self, request_id: str, num_computed_tokens: int, tokens: TokenSlice,
                     salt: str | None = None) -> None:
        """Names the request's blocks that its first `num_computed_tokens` tokens fill, whose KV
        must be in the cache already (computed by an earlier step), so later requests (with the
        same cache `salt`) find them."""
        if self.prefix_cache is None:
            return
        table = self._tables.get(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table))
        for i in range(self._num_named.get(request_id, 0), num_full):
            block_hash = self._block_hash(request_id, i, tokens, salt)
            named = self.prefix_cache.hash_of(table[i])
            if named is None:
                self.prefix_cache.insert(table[i], block_hash)
            else:  # shared from the cache, or named by the request it was forked from
                assert named == block_hash
        self._num_named[request_id] = max(num_full, self._num_named.get(request_id, 0))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, if no request holds blocks (else changes nothing and
        returns False), as vLLM's `reset_prefix_cache`."""
        if self.prefix_cache is None or self._tables:
            return self.prefix_cache is None
        self._free.extend(self.prefix_cache.reset())
        return True

    def _block_hash(self, request_id: str, index: int, tokens: TokenSlice, salt: str | None) -> BlockHash:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            # The salt goes into the first block's name, and through the chain into every other.
            key = self._cache_key + salt_key(salt) if i == 0 else self._cache_key
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens(i * bs, (i + 1) * bs), key))
        return hashes[index]

    # ---------------------------------------------------------------- forks and freeing

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
        self._hashes[child_id] = self._hashes.get(parent_id, [])[:num_full]
        self._num_named[child_id] = min(self._num_named.get(parent_id, 0), num_full)
        return copy

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        assert len(self.block_table(parent_id)) >= self.num_blocks_for(num_tokens)
        return num_tokens % self.block_size == 0 or self.num_free_blocks > 0

    def free(self, request_id: str) -> None:
        """Drops the request's table; blocks no other table holds become free, named ones
        evictable (no-op if it holds none)."""
        self._hashes.pop(request_id, None)
        self._num_named.pop(request_id, None)
        named = []
        for block in self._tables.pop(request_id, []):
            self._refs[block] -= 1
            assert self._refs[block] >= 0
            if self._refs[block] == 0:
                if self.prefix_cache is not None and self.prefix_cache.hash_of(block) is not None:
                    named.append(block)
                else:
                    self._free.append(block)
        # Last blocks first: they are evicted before the blocks their names chain from, which
        # more requests share and without which they could not be found anyway.
        for block in reversed(named):
            self.prefix_cache.park(block)

    def _allocate(self) -> int:
        block = self._free.popleft() if self._free else self.prefix_cache.evict()
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block
