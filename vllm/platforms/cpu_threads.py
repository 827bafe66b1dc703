"""A CPU worker's thread count, adapted to what else runs on its cores.

The kernels split each product over OpenMP threads that spin at their barriers. When another
process is busy on one of the cores, the thread that shares it runs in time slices and every
barrier waits for it, while its partner spins on the other core: a step then takes several
times longer than on one thread alone. A server never has its cores to itself (tokenizers, the
HTTP layer, other services), so between steps the worker looks at how much of the machine's
CPU time went to other processes since it last looked, and runs on the cores left to it:

    others = (busy time of all cores - this process's CPU time) / wall time     (in cores)
    threads = max_threads - others, rounded down past a margin, at least 1

Dropping a thread needs others above 0.4 of a core; taking it back needs them under 0.3, so a
load near the threshold does not flip the count every interval. An interval in which the worker
itself hardly ran (it waited for requests) decides nothing: what other processes did while it
waited says little about what they do once it runs, and the first steps after a pause would
otherwise run on the cores a job that has since ended was using. Setting OMP_NUM_THREADS (or
VLLM_CPU_ADAPTIVE_THREADS=0) keeps the count fixed, as the user chose.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

_DROP_MARGIN = 0.4  # of a core used by others before a thread is given up
_TAKE_MARGIN = 0.3  # of a core, at most, used by others before a thread is taken back
# Of a core used by this process, below which an interval counts as idle: a worker that steps
# keeps at least its own thread runnable, which gets more than this beside several busy processes.
_IDLE_OWN = 0.1


@dataclass(frozen=True)
class CpuTimes:
    """Seconds since an arbitrary origin: wall clock, all cores' busy time, this process's
    (with its waited-for children's)."""
    wall: float
    busy: float
    own: float


def read_cpu_times() -> CpuTimes | None:
    """The machine's busy time from /proc/stat (Linux) and this process's CPU time, all
    threads, with that of the children it has waited for (the compiler building a C kernel on
    first use works for the worker, not against it); None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...: idle and iowait are the idle time.
    jiffies = [int(x) for x in fields[1:]]
    busy = sum(jiffies) - jiffies[3] - (jiffies[4] if len(jiffies) > 4 else 0)
    children = os.times()
    return CpuTimes(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"),
                    time.process_time() + children.children_user + children.children_system)


def threads_for(others: float, current: int, max_threads: int) -> int:
    """The thread count for `others` cores used by other processes, from `current`."""
    lower = math.floor(max_threads - others + _DROP_MARGIN)
    if lower < current:
        return max(1, lower)
    higher = math.floor(max_threads - others + _TAKE_MARGIN)
    return max(current, min(max_threads, higher))


class ThreadGovernor:
    """Sets the calling thread's kernel thread count before each step (OpenMP keeps the count
    per thread, so it must run on the thread that runs the steps).

    Built on the thread that loaded the model and warmed it up: OpenMP also keeps a team of
    kernel threads per thread that starts parallel work, so steps on any other thread add a team,
    more threads than cores, and GNU OpenMP's threads then sleep at every barrier instead of
    spinning. That is worth a warning, once.
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 read_times: Callable[[], CpuTimes | None] = read_cpu_times,
                 interval_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` is the wall clock of `read_times`' times; it decides, without reading
        /proc/stat, whether an interval has passed."""
        assert max_threads > 1
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self._set_threads = set_threads
        self._read_times = read_times
        self._clock = clock
        self._last = read_times()
        self._loading_thread = threading.get_ident()
        self._step_thread: int | None = None
        self._warned_thread = False

    def before_step(self) -> None:
        # Steps may move between threads (an engine stepped from threads of the caller's choosing).
        if threading.get_ident() != self._step_thread:
            if threading.get_ident() != self._loading_thread and not self._warned_thread:
                logger.warning("The engine steps on another thread than the one that loaded the model: "
                               "the kernels' OpenMP threads now outnumber the %d cores, and every step "
                               "is slower. Step it from the thread that built it (as "
                               "AsyncLLMEngine.from_engine_args does).", self.max_threads)
                self._warned_thread = True
            self._set_threads(self.threads)
            self._step_thread = threading.get_ident()
        if self._last is None or self._clock() - self._last.wall < self.interval_s:
            return
        now = self._read_times()
        if now is None:
            return
        wall, own = now.wall - self._last.wall, now.own - self._last.own
        others = max(0.0, (now.busy - self._last.busy) - own) / wall
        self._last = now
        if own / wall < _IDLE_OWN:
            return  # the worker waited for work: the next interval decides
        threads = threads_for(others, self.threads, self.max_threads)
        if threads != self.threads:
            logger.info("Other processes use %.1f of the cores: kernels now run on %d thread(s) of %d",
                        others, threads, self.max_threads)
            self.threads = threads
            self._set_threads(threads)
            self._step_thread = threading.get_ident()

    @property
    def at_full_width(self) -> bool:
        """Whether steps run on all the threads the worker had when it warmed up, and so when it
        captured its graphs (torch's thread count is part of the state their guards check)."""
        return self.threads == self.max_threads


def adaptive_threads_enabled() -> bool:
    """Off when the user fixed the count (OMP_NUM_THREADS) or turned it off."""
    return "OMP_NUM_THREADS" not in os.environ and os.environ.get("VLLM_CPU_ADAPTIVE_THREADS", "1") != "0"
