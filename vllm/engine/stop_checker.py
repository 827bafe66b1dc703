"""The stops that need a request's text or grammar: the scheduler's `check_stop` hook.

The scheduler decides the stops that token ids and lengths make (EOS, `stop_token_ids`,
`max_tokens`, `max_model_len`); it then calls the hook with its decision after each token
(see `Scheduler.update_from_output`), and the hook's answer is final.
"""

from vllm.engine.detokenizer import detokenize_incrementally
from vllm.engine.structured_output import StructuredOutputManager
from vllm.sequence import Sequence, SequenceStatus


class StopChecker:
    """Extends each sample's text with its new token, ends it at a stop string the token
    completes, and at the end of its grammar."""

    def __init__(self, tokenizer, structured_output: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.structured_output = structured_output

    def __call__(self, seq: Sequence, status: SequenceStatus | None) -> SequenceStatus | None:
        """`status`: the scheduler's decision for the token just appended to `seq` (None while
        it goes on). Stop strings first, then the sample's grammar, which ends the request once
        complete."""
        status = self._check_stop_string(seq, status)
        if seq.request_id in self.structured_output:
            try:
                if self.structured_output.accept(seq.request_id, seq.output_token_ids[-1]) and status is None:
                    return SequenceStatus.FINISHED_STOPPED
            except ValueError as e:  # other constraints of the request left no token the grammar allows
                seq.error = str(e)
                return SequenceStatus.FINISHED_ERROR
        return status

    def _check_stop_string(self, seq: Sequence, status: SequenceStatus | None) -> SequenceStatus | None:
        """Extends the text with the new token's, and stops at a stop string it completes. The
        scheduler stops a request only at EOS or a stop token: like a stop string, its text is
        output only with `include_stop_str_in_output` (as in vLLM; special tokens aside, EOS
        text shows only without `skip_special_tokens`)."""
        stop_token = status is SequenceStatus.FINISHED_STOPPED and not seq.sampling_params.include_stop_str_in_output
        new_text = detokenize_incrementally(self.tokenizer, seq, final=status is not None, skip_last=stop_token)
        # A stop string completed by the last allowed token wins over the length limit, as in vLLM.
        if status in (None, SequenceStatus.FINISHED_LENGTH) and _hit_stop_string(seq, new_text):
            return SequenceStatus.FINISHED_STOPPED
        return status


def _hit_stop_string(seq: Sequence, new_text: str) -> bool:
    """Ends the text at the earliest stop string that ends in `new_text` (a stop may span
    several tokens), keeping the stop itself only with `include_stop_str_in_output`."""
    params = seq.sampling_params
    if not params.stop or not new_text or len(seq.output_token_ids) < params.min_tokens:
        return False
    text = seq.output_text
    matches = []
    for stop in params.stop:
        index = text.find(stop, max(0, len(text) - len(new_text) - len(stop) + 1))
        if index != -1:
            matches.append((index, stop))
    if not matches:
        return False
    index, stop = min(matches)
    seq.output_text = text[:index + len(stop) if params.include_stop_str_in_output else index]
    seq.stop_reason = stop
    return True
