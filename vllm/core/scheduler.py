"""SARATHI-style scheduler: one token budget per step, decodes first, prefill chunks fill the rest.

There are no phases. Every request has `num_tokens` and `num_computed_tokens`; a step gives it
`min(tokens left, budget left)`. Decodes (one token left) go first, so a long prompt never
stalls them; the budget they leave is shared by the prompts mid-prefill and new ones, short
prompts beside long ones (`_schedule_prefills`). With `max_step_latency_ms` that budget comes
from a model of step time (vllm/core/step_time_model.py). Imports no torch.

With prefix caching a request starts from the cached blocks that hold its first tokens: they
count as computed, and its first chunk starts after them. At least the last token is always
computed, so the step has its logits; and since only whole blocks are shared, a request whose
tokens are all cached computes its last block again, in a block of its own:

    prompt     | a b c d | e f g h | i j |        cached: [a b c d] [e f g h]
    admitted   computed = 8, first chunk = [i j]
    prompt     | a b c d | e f g h |              cached: both blocks
    admitted   computed = 4, first chunk = [e f g h] (into a new block)

A block is named once the step that filled it has run, so a request never reads KV that its
own step writes. A request asking for prompt logprobs reads from the cache only the positions
whose logprobs it already has (after a preemption), as vLLM's requests with prompt logprobs
skip the cache: the other positions are computed to score them.
"""

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from vllm.core.scheduling_policy import SchedulingPolicy
from vllm.core.step_time_model import (StepBudget, StepShape, StepTimeModel, attended_pairs, latency_budget,
                                       padded_size)
from vllm.logger import init_logger
from vllm.sequence import Sequence, SequenceStatus

logger = init_logger(__name__)

# Under max_step_latency_ms a step's prefill part is at least the prompt tokens queued per step
# over the last DRAIN_WINDOW_STEPS steps: the prompts keep up with arrivals. The step is the
# largest within the target, which drains a burst's backlog as fast as the target allows, so
# this floor only decides when the target gives way: where no step within it keeps up, and
# then only while the target's percentile has room for the gaps it misses (`may_miss`).
DRAIN_WINDOW_STEPS = 256


@dataclass(frozen=True, slots=True)
class _PrefillDemand:
    """What the prompts could take of a step's prefill budget, read once a step: the running
    prompts mid-prefill, long (more than `long_prompt_threshold` tokens left) and short, and
    the chunks each kind could take of the whole budget (the long ones' with the oldest waiting
    long prompt's, if it can start; the short ones' with the waiting short prompts' total)."""

    running_long: list[Sequence]
    running_short: list[Sequence]
    long_chunks: list[int]
    short_chunks: list[int]
    waiting_short: int

    def needs(self, budget: int) -> tuple[int, int]:
        """(long, short): the tokens of a prefill `budget` each kind could take."""
        return (sum(min(c, budget) for c in self.long_chunks),
                sum(min(c, budget) for c in self.short_chunks) + min(self.waiting_short, budget))

    def shares(self, budget: int) -> tuple[int, int]:
        """(long share, short share) of a prefill budget: the long prompts' up to half of it,
        the short prompts' the rest, each up to what that kind can take."""
        return _split(budget, *self.needs(budget))

    def priced_chunks(self, budget: int) -> list[tuple[int, int]]:
        """The (num_tokens, context_len) chunks a prefill budget buys, for the step-time model:
        the short prompts' share after the deepest short context, and what they leave, as far
        as the long prompts can take it, after the deepest long context. (Priced at one context
        for all the prompts, a short prompt beside a long one deep in its prefill would be
        charged the long one's attention, and the step sized well below the target.)"""
        long_need, short_need = self.needs(budget)
        _, short_share = _split(budget, long_need, short_need)
        return [(min(long_need, budget - short_share), _deepest(self.running_long)),
                (short_share, _deepest(self.running_short))]


def _split(budget: int, long_need: int, short_need: int) -> tuple[int, int]:
    """_PrefillDemand.shares for known needs."""
    long_share = min(budget - budget // 2, long_need)
    return long_share, min(budget - long_share, short_need)


def _deepest(seqs: list[Sequence]) -> int:
    return max((s.num_computed_tokens for s in seqs), default=0)


@dataclass(slots=True)
class _StepLog:
    """What `schedule()` advanced for one step, so that `undo()` can take it back."""

    output: SchedulerOutput | None = None
    # (sequence, num_computed_tokens, num_prompt_logprob_positions) before the step took tokens.
    taken: list[tuple[Sequence, int, int]] = field(default_factory=list)
    decodes: set[str] = field(default_factory=set)  # the requests the step decodes
    admitted: list[Sequence] = field(default_factory=list)  # in admission order
    # The waiting queue before the first admission: short prompts may start ahead of long ones.
    waiting: list[Sequence] | None = None


@dataclass(slots=True)
class _PrefillRound:
    """The prefill part of one step as it fills: the budget left of it and the part the prompts
    being scheduled may use (`limit`, counted from the start), the prompts mid-prefill after the
    step (`held`, running ones not yet scheduled included) and of those the long ones, and
    whether waiting prompts may still start."""

    budget: int
    held: int
    limit: int = 0
    num_long: int = 0
    can_admit: bool = True
    chunks: list[ScheduledSequence] = field(default_factory=list)
    start: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.budget

    def available(self) -> int:
        """Tokens the next chunk may take: within the limit and the budget."""
        return max(0, min(self.budget, self.limit - (self.start - self.budget)))


class Scheduler:
    """Owns the waiting queue, the running list and the block manager.

    Invariants: `waiting` and `running` are in the order of the scheduling policy (see
    scheduling_policy.py: by arrival, or by priority); the running sequences, counting the
    samples each has yet to fork, are at most `max_num_seqs`; only running requests own KV
    blocks; a request is in at most one of `waiting` and `running`.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.policy = SchedulingPolicy(config.policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished_since_last_step: list[str] = []
        self._blocks_to_copy: list[tuple[int, int]] = []
        self._log = _StepLog()
        self.num_preemptions = 0
        # Blocks kept free when admitting, for the running requests to grow into (vLLM's 1%).
        self._watermark_blocks = block_manager.num_blocks // 100
        # Prefix cache lookups, in tokens as vLLM counts them: the tokens of each request
        # admitted while caching is on (each admission after a preemption too), and of those
        # the tokens found in the cache.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        # With max_step_latency_ms: the model that sizes each step, and the token counts a
        # step may be padded to (the warmed buckets; empty: any count).
        self.step_time_model: StepTimeModel | None = None
        self.token_buckets: list[int] = []
        # Prompt tokens queued since the last step, and per step over the last DRAIN_WINDOW_STEPS
        # (the steps before the first count as none): the rate the prefill keeps up with under
        # max_step_latency_ms.
        self._tokens_queued = 0
        self._tokens_queued_per_step: deque[int] = deque(maxlen=DRAIN_WINDOW_STEPS)

    # ---------------------------------------------------------------- requests in and out

    def add(self, seq: Sequence) -> None:
        """Queues a request, or finishes it at once (FINISHED_IGNORED) if it can never run."""
        error = self._why_unschedulable(seq)
        if error is not None:
            logger.warning("Request %s ignored: %s", seq.request_id, error)
            seq.error = error
            seq.status = SequenceStatus.FINISHED_IGNORED
            return
        self.policy.enqueue(self.waiting, seq)
        self._tokens_queued += seq.num_prompt_tokens

    def _why_unschedulable(self, seq: Sequence) -> str | None:
        if seq.num_seats > self.config.max_num_seqs:
            return (f"n={seq.num_seats} parallel samples exceed max_num_seqs="
                    f"{self.config.max_num_seqs}")
        if seq.num_prompt_tokens > self.config.max_model_len:
            return (f"prompt has {seq.num_prompt_tokens} tokens, more than max_model_len="
                    f"{self.config.max_model_len}")
        needed = self.block_manager.num_blocks_for(seq.num_prompt_tokens)
        if needed > self.block_manager.num_blocks:
            return (f"prompt needs {needed} KV cache blocks but the cache only has "
                    f"{self.block_manager.num_blocks}")
        if not self.config.enable_chunked_prefill and seq.num_prompt_tokens > self.config.max_num_batched_tokens:
            return (f"prompt has {seq.num_prompt_tokens} tokens, more than max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens} (enable chunked prefill to run it)")
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Marks a request finished and releases its blocks at once."""
        assert status.finished
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            # It just sampled, so the step that computed its tokens ran; an abort may come
            # after a step that failed, whose blocks must not be found.
            self.block_manager.cache_blocks(seq.request_id, seq.num_computed_tokens, seq.token_slice, seq.cache_salt)
        self.block_manager.free(seq.request_id)
        self._finished_since_last_step.append(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, parent: Sequence) -> None:
        """Starts the parent's pending samples, now that its prompt is in the cache: each shares
        the prompt's full blocks and gets a copy of the partial last one. A sample that finds no
        free block for that copy waits to recompute its prompt instead, like a preempted one."""
        assert parent.status is SequenceStatus.RUNNING and not parent.is_prefill
        num_tokens = parent.num_computed_tokens
        for child in parent.pending_forks:
            if self.block_manager.can_fork(parent.request_id, num_tokens):
                copy = self.block_manager.fork(parent.request_id, child.request_id, num_tokens)
                if copy is not None:
                    self._blocks_to_copy.append(copy)
                child.num_computed_tokens = num_tokens
                child.status = SequenceStatus.RUNNING
                self.policy.start(self.running, child)
            else:
                child.status = SequenceStatus.WAITING
                self.policy.enqueue(self.waiting, child, again=True)
        parent.pending_forks = []

    # ---------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """The next step. It counts as computed at once; `undo()` takes it back if it fails."""
        self._log = _StepLog()
        if self.config.enable_chunked_prefill:
            out = self._schedule_chunked()
        else:
            out = self._schedule_classic()
        out.finished_request_ids = self._finished_since_last_step
        out.blocks_to_copy = self._blocks_to_copy
        self._finished_since_last_step = []
        self._blocks_to_copy = []
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert self._num_seats() <= self.config.max_num_seqs
        self._log.output = out
        return out

    def undo(self, step: SchedulerOutput) -> None:
        """Takes back `step`, the last one scheduled, whose forward pass or sampling failed: its
        requests count as computed what they did before it, the requests it admitted wait again
        at the head of the queue (without blocks), and its block copies and finished ids go to
        the next step. Its KV writes need no undoing: they lie past every request's computed
        tokens, so the retry overwrites them. Preemptions stay: those requests recompute anyway.
        """
        log = self._log
        assert log.output is step, "undo() of a step other than the last one scheduled"
        self._log = _StepLog()
        for seq, num_computed, num_logprob_positions in log.taken:
            seq.num_computed_tokens = num_computed
            seq.num_prompt_logprob_positions = num_logprob_positions
        for seq in log.admitted:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
        if log.admitted:
            self._restore_waiting_order(log)
        self._finished_since_last_step[:0] = step.finished_request_ids
        self._blocks_to_copy[:0] = step.blocks_to_copy

    def update_from_output(
            self, step: SchedulerOutput, sampled_token_ids: Mapping[str, int],
            check_stop: Callable[[Sequence, SequenceStatus | None], SequenceStatus | None],
    ) -> list[Sequence]:
        """Takes in the tokens sampled for `step`, the last one scheduled (the runner's
        `sampled_token_ids`, by sample id): forks the pending samples of each prompt that
        completed, appends each sample's token and finishes the samples that stop. Returns the
        sequences that got a token, in step order (a prompt's forks right after it).

        The scheduler decides the stops that tokens and lengths make (EOS, `stop_token_ids`,
        `max_tokens`, `max_model_len`). Stop strings need the text and grammars their matchers,
        which the engine holds: after each token the scheduler calls `check_stop(seq, status)`
        with its own decision (None while the request goes on), and the returned status is
        final. A stop string may thus turn None or FINISHED_LENGTH into FINISHED_STOPPED (a stop
        completed by the last allowed token wins, as in vLLM).
        """
        assert self._log.output is step, "update_from_output() of a step other than the last one"
        seqs = {seq.request_id: seq for seq, _, _ in self._log.taken}
        updated: list[Sequence] = []
        for scheduled in step.scheduled:
            if scheduled.request_id not in sampled_token_ids:
                continue  # a non-final prefill chunk: nothing sampled
            seq = seqs[scheduled.request_id]
            samples = [seq, *seq.pending_forks] if scheduled.forks else [seq]
            if scheduled.forks:
                self.fork(seq)  # before the token: the samples share the prompt's blocks only
            for sample in samples:
                token = sampled_token_ids[sample.request_id]
                sample.output_token_ids.append(token)
                status = check_stop(sample, self._check_stop(sample, token))
                if status is not None:
                    self.finish(sample, status)
                updated.append(sample)
        return updated

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """How `token`, just appended, ends `seq`, if it does (stop strings aside)."""
        params = seq.sampling_params
        num_outputs = len(seq.output_token_ids)
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token == seq.eos_token_id:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _schedule_chunked(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        preempted: list[str] = []
        scheduled_ids: set[str] = set()

        # 1. Running decodes in the policy's order; blocks come from the last running requests if needed.
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._reserve(seq, seq.num_tokens, scheduled_ids, preempted):
                continue
            decodes.append(self._take(seq, 1))
            scheduled_ids.add(seq.request_id)
            self._log.decodes.add(seq.request_id)
            budget -= 1

        # 2. Prefill chunks in the budget the decodes leave (or the latency target does).
        demand = self._prefill_demand()
        chosen = self._latency_budget(decodes, demand)
        if chosen is not None:
            budget = min(budget, chosen.num_tokens - len(decodes))
        prefills = self._schedule_prefills(budget, demand, scheduled_ids, preempted)
        decodes = [d for d in decodes if d.request_id in scheduled_ids]  # less any a prompt preempted
        out = SchedulerOutput(decodes + prefills, num_decodes=len(decodes), preempted_request_ids=preempted)
        if chosen is not None:  # the prediction of the step as scheduled, which its measured time answers
            out.token_budget = chosen.num_tokens
            out.predicted_seconds = self.step_time_model.predict(self.step_shape(out))
        return out

    def _latency_budget(self, decodes: list[ScheduledSequence], demand: _PrefillDemand) -> StepBudget | None:
        """The step's token budget under `max_step_latency_ms`, when a prompt waits or is
        mid-prefill and the step-time model has data; else None (the budget is
        max_num_batched_tokens). Its prefill part is at least the prompt tokens queued per step
        of late: under the target, the prompts keep up with arrivals (else their queue, and the
        time to the first token, grow without bound)."""
        target_ms = self.config.max_step_latency_ms
        if target_ms is None:
            return None
        self._tokens_queued_per_step.append(self._tokens_queued)
        self._tokens_queued = 0
        model = self.step_time_model
        if model is None or not model.is_fitted:
            return None
        if not self.waiting and not demand.running_long and not demand.running_short:
            return None
        queued = self._tokens_queued_per_step
        return latency_budget(
            model, target_ms / 1000, decode_keys=sum(d.context_len + 1 for d in decodes),
            num_decodes=len(decodes), prefill_chunks=demand.priced_chunks,
            sizes=self.token_buckets, max_num_batched_tokens=self.config.max_num_batched_tokens,
            min_prefill_tokens=math.ceil(sum(queued) / DRAIN_WINDOW_STEPS),
            may_miss=model.may_miss(len(decodes)))

    def step_shape(self, step: SchedulerOutput) -> StepShape:
        """What the step-time model reads of a scheduled step (padded as the runner pads it)."""
        decodes, prefills = step.scheduled[:step.num_decodes], step.scheduled[step.num_decodes:]
        return StepShape(padded_size(self.token_buckets, step.num_batched_tokens),
                         attended_pairs((s.num_tokens, s.context_len) for s in prefills),
                         sum(s.context_len + 1 for s in decodes), step.num_decodes)

    def _schedule_prefills(self, budget: int, demand: _PrefillDemand, scheduled_ids: set[str],
                           preempted: list[str]) -> list[ScheduledSequence]:
        """Prefill chunks for this step, in admission order, within `budget` tokens.

        At most `max_num_partial_prefills` prompts are mid-prefill between steps, and of those at
        most `max_long_partial_prefills` are long (more than `long_prompt_threshold` tokens left
        to compute). Long and short prompts share the budget this way:

            long share  = min(ceil(budget / 2), what the long prompts can take)
            short share = min(budget - long share, what the short prompts can take)
            order       = running short prompts, running long ones, the first waiting long
                          one (if a long slot is free), waiting short ones; each takes at most
                          its share while the other kind still has a claim, and what one kind
                          leaves the other takes.

        So a short prompt is admitted beside a long one being prefilled, past long prompts
        still waiting for a long slot; long prompts start in arrival order among themselves, and
        the oldest one waiting takes a long slot as soon as one is free; a stream of short
        prompts never takes more than half the budget from long ones. A waiting prompt that
        does not fit the KV cache stops admission for the step (new requests never preempt
        running ones), so no later prompt is admitted ahead of it.
        """
        running_long, running_short = demand.running_long, demand.running_short
        round_ = _PrefillRound(budget=budget, held=len(running_long) + len(running_short),
                               num_long=len(running_long))
        long_share, short_share = demand.shares(budget)

        # Each kind may use its own share and whatever the other kind does not claim.
        round_.limit = budget - long_share
        for seq in running_short:
            self._continue_prefill(seq, round_, scheduled_ids, preempted)
        used_by_short = budget - round_.budget
        round_.limit = budget - max(0, short_share - used_by_short)
        for seq in running_long:
            self._continue_prefill(seq, round_, scheduled_ids, preempted)
        # Slots may have freed above (a long prompt's last chunk): the check is the admission's.
        self._admit_waiting(round_, want_long=True, preempted=preempted)
        round_.limit = budget
        self._admit_waiting(round_, want_long=False, preempted=preempted)

        # Admitted requests join `running` last: list the chunks in admission order.
        order = {s.request_id: i for i, s in enumerate(self.running)}
        return sorted(round_.chunks, key=lambda c: order[c.request_id])

    def _prefill_demand(self) -> _PrefillDemand:
        """The prompts' demand on this step's prefill budget (see _PrefillDemand)."""
        partial = [s for s in self.running if s.is_prefill]
        running_long = [s for s in partial if self._is_long(s.num_uncomputed_tokens)]
        running_short = [s for s in partial if not self._is_long(s.num_uncomputed_tokens)]
        most = self.config.max_num_batched_tokens
        long_chunks = [self._chunk_size(s, most) for s in running_long]
        next_long = self._next_waiting_long(_PrefillRound(budget=most, held=len(partial),
                                                          num_long=len(running_long)))
        if next_long is not None:
            long_chunks.append(self._chunk_size(next_long, most))
        return _PrefillDemand(running_long, running_short, long_chunks,
                              [self._chunk_size(s, most) for s in running_short], self._waiting_short_need(most))

    def _is_long(self, num_uncomputed_tokens: int) -> bool:
        threshold = self.config.long_prompt_threshold
        return threshold > 0 and num_uncomputed_tokens > threshold

    def _next_waiting_long(self, round_: "_PrefillRound") -> Sequence | None:
        """The oldest waiting long prompt, if it can start now: a long and a partial slot are
        free, and its seats and blocks fit. (Budget set aside for a prompt that cannot start
        would be lost to the others, every step.)"""
        if (round_.num_long >= self.config.max_long_partial_prefills
                or round_.held >= self.config.max_num_partial_prefills):
            return None
        seq = next((s for s in self.waiting if self._is_long(s.num_tokens)), None)
        if (seq is None or self._num_seats() + seq.num_seats > self.config.max_num_seqs
                or not self._has_room_for(seq, self._cached_prefix(seq))):
            return None
        return seq

    def _waiting_short_need(self, budget: int) -> int:
        """Tokens the waiting short prompts that can start now could take this step (up to
        `budget`), counting their whole prompts (before any prefix cache hit)."""
        need, seats = 0, self._num_seats()
        for seq in self.waiting:
            if need >= budget:
                break
            if self._is_long(seq.num_tokens):
                continue
            seats += seq.num_seats
            if seats > self.config.max_num_seqs or not self._has_room_for(seq, []):
                break  # admission stops here too
            need += seq.num_tokens
        return min(need, budget)

    def _continue_prefill(self, seq: Sequence, round_: "_PrefillRound", scheduled_ids: set[str],
                          preempted: list[str]) -> None:
        """The next chunk of a running partial prefill, within the round's limit."""
        if seq.status is not SequenceStatus.RUNNING:
            return  # preempted earlier in this step
        available = round_.available()
        if available == 0:
            return
        chunk = self._chunk_size(seq, available)
        if not self._reserve(seq, seq.num_computed_tokens + chunk, scheduled_ids, preempted):
            return
        was_long = self._is_long(seq.num_uncomputed_tokens)
        round_.chunks.append(self._take(seq, chunk))
        scheduled_ids.add(seq.request_id)
        round_.budget -= chunk
        if not seq.is_prefill:  # its last chunk: its slot is free
            round_.held -= 1
            round_.num_long -= was_long

    def _admit_waiting(self, round_: "_PrefillRound", *, want_long: bool,
                       preempted: list[str]) -> None:
        """Starts waiting prompts of one kind, in queue order, while the round allows: long ones
        (`want_long`) up to the first that cannot start, short ones past the long ones."""
        config = self.config
        for seq in list(self.waiting):
            if (preempted or round_.available() == 0 or not round_.can_admit
                    or round_.held >= config.max_num_partial_prefills):
                return
            if self._num_seats() + seq.num_seats > config.max_num_seqs:
                round_.can_admit = False
                return
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            is_long = self._is_long(seq.num_tokens - num_cached)
            if is_long != want_long:
                continue
            if is_long and round_.num_long >= config.max_long_partial_prefills:
                return
            chunk = min(self._chunk_size(seq, round_.available()), seq.num_tokens - num_cached)
            if (not self.block_manager.can_allocate(cached, num_cached + chunk)
                    or not self._has_room_for(seq, cached)):
                round_.can_admit = False  # new requests never preempt running ones
                return
            self._admit(seq)
            self._allocate(seq, cached, num_cached + chunk)
            round_.chunks.append(self._take(seq, chunk))
            round_.budget -= chunk
            if seq.is_prefill:
                round_.held += 1
                round_.num_long += is_long

    def _schedule_classic(self) -> SchedulerOutput:
        """vLLM's policy without chunking: whole prompts in prefill-only steps, else decodes."""
        budget = self.config.max_num_batched_tokens
        prefills: list[ScheduledSequence] = []
        while (self.waiting
               and self._num_seats() + self.waiting[0].num_seats <= self.config.max_num_seqs):
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_new = seq.num_tokens - len(cached) * self.block_manager.block_size
            if num_new > budget or not self.block_manager.can_allocate(cached, seq.num_tokens):
                break
            self._admit(seq)
            self._allocate(seq, cached, seq.num_tokens)
            prefills.append(self._take(seq, num_new))
            budget -= num_new
        if prefills:
            return SchedulerOutput(prefills, num_decodes=0)

        decodes: list[ScheduledSequence] = []
        preempted: list[str] = []
        scheduled_ids: set[str] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if not self._reserve(seq, seq.num_tokens, scheduled_ids, preempted):
                continue
            decodes.append(self._take(seq, 1))
            scheduled_ids.add(seq.request_id)
        return SchedulerOutput(decodes, num_decodes=len(decodes), preempted_request_ids=preempted)

    # ---------------------------------------------------------------- helpers

    def _num_seats(self) -> int:
        return sum(s.num_seats for s in self.running)

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        chunk = min(seq.num_uncomputed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            chunk = min(chunk, self.config.long_prefill_token_threshold)
        return chunk

    def _has_room_for(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether a waiting request may start from its `cached` blocks: the blocks of all its
        known tokens fit, beside a watermark, as in vLLM. Admitted on its first chunk's blocks
        alone, a long prompt would take the blocks the running decodes grow into, and be
        preempted when they do, again and again. With nothing running, any request that fits
        the cache may start."""
        if not self.running:
            return True
        return self.block_manager.can_allocate(cached, seq.num_tokens, reserve=self._watermark_blocks)

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled_ids: set[str],
                 preempted: list[str]) -> bool:
        """Makes room for `seq` to hold `num_tokens` KV entries, preempting by recompute the last
        running requests (the most recently admitted; by priority, the worst) not yet scheduled
        this step; by priority also the decodes this step scheduled, which a better prompt's
        chunk may take the blocks of. False if `seq` itself had to be preempted or no victim
        was left."""
        while not self.block_manager.can_grow(seq.request_id, num_tokens):
            victim = self.running[-1]
            if victim.request_id in scheduled_ids:
                if not (self.policy.by_priority and victim.request_id in self._log.decodes):
                    return False
                self._unschedule_decode(victim, scheduled_ids)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        self.block_manager.grow(seq.request_id, num_tokens)
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting request (which holds no blocks) may start from."""
        max_tokens = seq.num_tokens - 1  # the last token is computed for its logits
        if seq.sampling_params.prompt_logprobs is not None:
            max_tokens = min(max_tokens, seq.num_prompt_logprob_positions)
        return self.block_manager.cached_prefix(seq.request_id, max_tokens, seq.token_slice, seq.cache_salt)

    def _allocate(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Gives an admitted request its cached blocks, counted as computed, and blocks up to
        `num_tokens`."""
        self.block_manager.allocate(seq.request_id, cached, num_tokens)
        seq.num_computed_tokens = len(cached) * self.block_manager.block_size
        if seq.num_cached_tokens is None:  # its first admission
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.block_manager.enable_caching:
            self.num_prefix_cache_queries += seq.num_tokens
            self.num_prefix_cache_hits += seq.num_computed_tokens

    def _take(self, seq: Sequence, num_tokens: int) -> ScheduledSequence:
        """Hands the next `num_tokens` of `seq` to this step and counts them as computed."""
        assert 0 < num_tokens <= seq.num_uncomputed_tokens
        start = seq.num_computed_tokens
        self._log.taken.append((seq, start, seq.num_prompt_logprob_positions))
        # Earlier steps computed the tokens before `start`: the blocks they fill can be shared.
        self.block_manager.cache_blocks(seq.request_id, start, seq.token_slice, seq.cache_salt)
        seq.num_computed_tokens += num_tokens
        sample = seq.num_computed_tokens == seq.num_tokens
        # Positions of this chunk that predict a prompt token (p predicts token p + 1), skipping
        # those a run before a preemption already handed out.
        targets: tuple[int, ...] = ()
        first = max(start, seq.num_prompt_logprob_positions)
        if seq.sampling_params.prompt_logprobs is not None:
            end = min(start + num_tokens, seq.num_prompt_tokens - 1)  # last predicting position + 1
            targets = tuple(seq.prompt_token_ids[first + 1:end + 1])
            seq.num_prompt_logprob_positions = first + len(targets)
        return ScheduledSequence(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + num_tokens),
            start_position=start,
            block_table=list(self.block_manager.block_table(seq.request_id)),
            sample=sample,
            sampling_params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            forks=tuple((c.request_id, c.sampling_params) for c in seq.pending_forks) if sample else (),
            prompt_logprobs_start=first,
            prompt_logprob_targets=targets,
        )

    def _admit(self, seq: Sequence) -> None:
        if self._log.waiting is None:
            self._log.waiting = list(self.waiting)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.policy.start(self.running, seq)
        self._log.admitted.append(seq)

    def _unschedule_decode(self, seq: Sequence, scheduled_ids: set[str]) -> None:
        """Takes a decode out of the step being scheduled (its one token stays unused)."""
        [entry] = [e for e in self._log.taken if e[0] is seq]
        self._log.taken.remove(entry)
        seq.num_computed_tokens = entry[1]
        scheduled_ids.remove(seq.request_id)
        self._log.decodes.remove(seq.request_id)

    def _restore_waiting_order(self, log: _StepLog) -> None:
        """Puts the requests a step admitted back where they waited (requests queued since
        then stay after them)."""
        assert log.waiting is not None
        back = set(log.admitted) | set(self.waiting)
        restored = [s for s in log.waiting if s in back]
        known = set(restored)
        self.waiting = deque(restored + [s for s in self.waiting if s not in known])

    def _preempt(self, seq: Sequence) -> None:
        if self.num_preemptions % 50 == 0:  # the first, then every 50th, as vLLM does
            logger.warning("Request %s is preempted (recomputed later): the KV cache is full. "
                           "Preemptions cost throughput; a larger cache (kv_cache_memory_bytes) or "
                           "fewer concurrent sequences (max_num_seqs) avoid them. Preemptions so "
                           "far: %d", seq.request_id, self.num_preemptions + 1)
        self.running.remove(seq)
        # Named blocks stay cached: the request finds them again if they are not evicted.
        self.block_manager.cache_blocks(seq.request_id, seq.num_computed_tokens, seq.token_slice, seq.cache_salt)
        self.block_manager.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.enqueue(self.waiting, seq, again=True)
