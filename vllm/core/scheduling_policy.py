"""In which order the scheduler serves requests: vLLM's `scheduling_policy`.

    fcfs      by arrival; a preempted request waits at the head of the queue, and the requests
              admitted last are preempted first
    priority  by (priority, arrival time), the lowest value first: the waiting queue and the
              running list keep that order, so a request waits behind better ones only, a
              preempted one goes back to its place, and the worst running one is preempted first

Either way a waiting request never preempts a running one (as in vLLM). Imports no torch.
"""

import bisect
from collections import deque

from vllm.config import SCHEDULING_POLICIES
from vllm.sequence import Sequence


class SchedulingPolicy:
    """Where a request goes in the waiting queue and in the running list."""

    def __init__(self, name: str) -> None:
        assert name in SCHEDULING_POLICIES, name
        self.by_priority = name == "priority"

    @staticmethod
    def key(seq: Sequence) -> tuple[int, float]:
        return seq.priority, seq.arrival_time

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, *, again: bool = False) -> None:
        """Queues `seq`: a new request (`again` False), or one that ran and must start over (a
        preempted request, a sample that found no block to fork into)."""
        if self.by_priority:
            waiting.insert(bisect.bisect_right(waiting, self.key(seq), key=self.key), seq)
        elif again:
            waiting.appendleft(seq)
        else:
            waiting.append(seq)

    def start(self, running: list[Sequence], seq: Sequence) -> None:
        """Adds an admitted request to `running`, whose order is the order steps serve it in."""
        if self.by_priority:
            bisect.insort_right(running, seq, key=self.key)
        else:
            running.append(seq)
