"""Incremental detokenization: append each step's new text without decoding everything again.

Only the last few tokens are decoded each step: the window from `prefix_offset` gives the new
tokens their left context (a byte-level BPE token can be half a UTF-8 character; a SentencePiece
token's leading space depends on what precedes it). Text is held back while it ends in U+FFFD,
an incomplete character, unless the request is finishing.
"""

from vllm.sequence import Sequence


def detokenize_incrementally(tokenizer, seq: Sequence, final: bool = False, skip_last: bool = False) -> str:
    """Extends `seq.output_text` with the text of its newest output tokens (but the last one with
    `skip_last`: a stop token, whose text is not output); returns the new text."""
    ids = seq.output_token_ids[:-1] if skip_last else seq.output_token_ids
    skip = seq.sampling_params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
        return ""
    new_text = full_text[len(prefix_text):]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    seq.output_text += new_text
    return new_text
