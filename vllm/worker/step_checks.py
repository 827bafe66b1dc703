"""The scheduler-to-runner contract, checked once per step before any kernel runs.

The kernels trust the metadata they are given: a block-table entry or a slot past the cache
would make them read or write memory that is not theirs, silently. A bug in whatever makes the
tables (the block manager, prefix caching, a new platform's metadata) must fail the step with an
error that names the numbers instead. Host values only: a few comparisons per sequence.
"""

from vllm.core.scheduler_output import SchedulerOutput


def check_step(step: SchedulerOutput, num_blocks: int, block_size: int) -> None:
    """Raises IndexError if a block table, a sequence's length or a block copy of `step` lies
    outside a cache of `num_blocks` blocks of `block_size` tokens (its pad block excluded: only
    padding may use it), ValueError if a share of the step is empty."""
    for s in step.scheduled:
        if s.num_tokens <= 0 or s.start_position < 0:
            raise ValueError(f"request {s.request_id}: a step share of {s.num_tokens} tokens at "
                             f"position {s.start_position}")
        table = s.block_table
        if table and (min(table) < 0 or max(table) >= num_blocks):
            bad = next(b for b in table if not 0 <= b < num_blocks)
            raise IndexError(f"request {s.request_id}: block table entry {bad} outside the "
                             f"cache's blocks [0, {num_blocks})")
        end = s.start_position + s.num_tokens
        if end > len(table) * block_size:
            raise IndexError(f"request {s.request_id}: {end} tokens, but its block table holds "
                             f"{len(table)} blocks of {block_size}")
    for pair in step.blocks_to_copy:
        if not all(0 <= b < num_blocks for b in pair):
            raise IndexError(f"block copy {pair} outside the cache's blocks [0, {num_blocks})")
